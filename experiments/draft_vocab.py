"""`python -m experiments draft_vocab`: rank a checkpoint's vocabulary by token counts and write
the draft-vocabulary list (`draft_vocab.json`, mtpjax/draft_vocab.py) beside it.

What is counted: a text corpus through the checkpoint's own tokenizer (--corpus) and/or the
model's own greedy continuations of held-out prompts (--greedy_prompts): the tokens a draft
has to propose are the ones the model writes, so its own outputs are the closest sample.
The end-of-turn ids (the config's eos ids) rank first whatever their count.

  python -m experiments draft_vocab                                   # the tiny checkpoint
  python -m experiments draft_vocab --checkpoint=/models/Qwen3.5-27B \\
      --corpus=stdlib,/data/agent_traces/*.txt --greedy_prompts=512 --size=65536

Then `Engine.from_checkpoint(path, draft_vocab=N)` (or `--draft_vocab=N` on the commands that
take it) drafts over the N most frequent ids.
"""

from __future__ import annotations

import glob
import os

import numpy as np
from absl import flags

FLAGS = flags.FLAGS
flags.DEFINE_string("checkpoint", "checkpoints/tiny", "HF checkpoint folder (its tokenizer.json "
                    "tokenizes the corpus; its weights make the greedy outputs)")
flags.DEFINE_list("corpus", ["stdlib"], "text sources: 'stdlib' (the train split of the "
                  "Python standard library, experiments/corpus.py) and/or text files or globs")
flags.DEFINE_integer("max_corpus_tokens", 4_000_000, "stop counting the corpus after this "
                     "many tokens")
flags.DEFINE_integer("greedy_prompts", 64, "held-out prompts whose greedy continuations are "
                     "counted too (0: none)")
flags.DEFINE_integer("prompt_tokens", 64, "tokens of each greedy prompt")
flags.DEFINE_integer("greedy_tokens", 64, "new tokens of each greedy continuation")
flags.DEFINE_integer("greedy_weight", 10, "each greedy output token counts this many times (a "
                     "small sample of what the model writes against a large corpus)")
flags.DEFINE_integer("size", 0, "ids the list keeps, most frequent first (0: every id seen; an "
                     "engine asking for more drafts ids never seen, in id order)")
flags.DEFINE_string("out", "", "the list's path (default: draft_vocab.json in --checkpoint)")
flags.DEFINE_bool("progress", True, "progress lines on stderr")


def corpus_streams(tokenizer, sources, max_tokens: int, log):
    """Token id arrays of the corpus sources, until max_tokens."""
    from experiments import corpus
    eot = tokenizer.token_to_id(corpus.EOT)
    total = 0
    for src in sources:
        if src == "stdlib":
            texts = corpus.iter_texts("train")
        else:
            paths = sorted(glob.glob(src)) or [src]
            for p in paths:
                if not os.path.isfile(p):
                    raise FileNotFoundError(f"--corpus: no such file {p}")
            texts = (open(p, encoding="utf-8", errors="replace").read() for p in paths)
        for text in texts:
            ids = tokenizer.encode(text)
            if eot is not None:
                ids = [eot] + ids
            yield np.asarray(ids[:max_tokens - total], np.int64)
            total += min(len(ids), max_tokens - total)
            if total >= max_tokens:
                log(f"corpus: {total:,} tokens (--max_corpus_tokens)")
                return
        log(f"corpus: {total:,} tokens after {src}")


def greedy_outputs(path: str, tokenizer, n: int, prompt_tokens: int, new_tokens: int, log):
    """The model's greedy continuations of n held-out stdlib prompts (a stock engine)."""
    import mtpjax
    from experiments import corpus
    from mtpjax.sampling import SamplingParams
    prompts = []
    for text in corpus.iter_texts("heldout"):
        ids = tokenizer.encode(text)
        if len(ids) >= prompt_tokens:
            prompts.append(ids[:prompt_tokens])
        if len(prompts) == n:
            break
    eng = mtpjax.Engine.from_checkpoint(path, "float32", max_lanes=8,
                                        max_seq_len=prompt_tokens + new_tokens + 1)
    log(f"greedy continuations of {len(prompts)} held-out prompts, {new_tokens} tokens each")
    outs = eng.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=new_tokens))
    return [np.asarray(o.token_ids, np.int64) for o in outs]


def main(argv):
    del argv
    from experiments.progress import Progress
    from mtpjax import draft_vocab as dv
    from mtpjax.config import Config
    from mtpjax.text import Tokenizer
    log = Progress("draft_vocab", FLAGS.progress)
    cfg = Config.from_pretrained(FLAGS.checkpoint)
    tok = Tokenizer.from_checkpoint(FLAGS.checkpoint)
    V = cfg.vocab_size
    counts = dv.count_tokens(corpus_streams(tok, FLAGS.corpus, FLAGS.max_corpus_tokens, log), V)
    n_corpus = int(counts.sum())
    n_greedy = 0
    if FLAGS.greedy_prompts > 0:
        outs = greedy_outputs(FLAGS.checkpoint, tok, FLAGS.greedy_prompts, FLAGS.prompt_tokens,
                              FLAGS.greedy_tokens, log)
        g = dv.count_tokens(outs, V)
        n_greedy = int(g.sum())
        counts += FLAGS.greedy_weight * g
    if cfg.eos_token_ids:          # rank the ends of turn first: one more than the top count
        for t in cfg.eos_token_ids:
            counts[t] = counts.max() + 1
    source = (f"corpus {','.join(FLAGS.corpus)}: {n_corpus} tokens; greedy continuations of "
              f"{FLAGS.greedy_prompts} held-out stdlib prompts: {n_greedy} tokens x "
              f"{FLAGS.greedy_weight}; eos ids first; tokenizer {FLAGS.checkpoint}")
    vocab = dv.from_counts(counts, source)
    if FLAGS.size:
        if not 1 <= FLAGS.size <= V:
            raise SystemExit(f"--size must lie in [1, {V}], got {FLAGS.size}")
        keep = np.zeros(V, np.int64)
        keep[vocab.ranking[:FLAGS.size]] = vocab.counts[:FLAGS.size]
        vocab = dv.from_counts(keep, source + f"; kept the top {FLAGS.size}")
    out = FLAGS.out or os.path.join(FLAGS.checkpoint, dv.FILE)
    vocab.save(out)
    seen = int((vocab.counts > 0).sum())
    print(f"wrote {out}: {seen} of {V} ids ranked ({source})")
    for share in (0.1, 0.25, 0.5, 1.0):
        n = max(1, round(share * V))
        print(f"  top {n:>7} ({share:>4.0%} of the vocabulary) cover {vocab.coverage(n):.4f} "
              "of the counted tokens")
