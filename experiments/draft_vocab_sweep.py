"""`python -m experiments draft_vocab_sweep`: what a draft vocabulary (mtpjax/draft_vocab.py)
costs in acceptance and earns in speed.

1. Measured on the bundled tiny checkpoint (this CPU; what acceptance does not depend on the
   device): an engine drafting K tokens at a fixed depth over held-out prompts, greedy, with
   the draft vocabulary at each --shares of the vocabulary (the list shipped beside the
   checkpoint). Per N: acceptance by draft position (the share of verify steps that accept
   draft j), tokens per verify step, the share of the reply tokens inside the N ids (the
   `miss` rate m: a draft whose full argmax is outside them proposes another token), the
   model a_j(N) = a_j(full) (1 - m)^j next to the measurement, and that the replies equal the
   full-vocabulary engine's token for token (lossless).
2. Predicted for Qwen3.5-27B on one H200 (mtpjax/cost_model.py, bf16, the clock the judge's
   `--clock=h200` uses): per N in --sizes_27b, the draft program's bytes and time, each depth's
   step time at 1, 8 and 32 lanes, the depth mtpjax.engine.depth.AdaptiveDepth would choose from
   them (depth.predict) and its tokens/s against the stock step. The 27B's acceptance is the
   aot command's assumed profile (--acceptance) times (1 - m(N))^j, m(N) from one published
   point (a 32k-row draft head for Qwen's MTP: acceptance 66.7% -> 63.6%, so m(32k) = 4.6%)
   and a Zipf (s = 1) tail for other N: m(N) = m(32k) x tail(N) / tail(32k), tail(N) = 1 -
   H_N / H_V. An assumption until a 27B run measures it; stated in the output.

--out writes everything as JSON.
"""

from __future__ import annotations

import json
import math

import numpy as np
from absl import flags

FLAGS = flags.FLAGS
flags.DEFINE_string("checkpoint", "checkpoints/tiny", "checkpoint with a draft_vocab.json")
flags.DEFINE_list("shares", ["0.1", "0.25", "0.5", "1.0"], "draft vocabulary sizes to measure, "
                  "as shares of the vocabulary")
flags.DEFINE_integer("num_speculative_tokens", 4, "K: drafts per step (fixed depth K)")
flags.DEFINE_integer("prompts", 16, "held-out stdlib prompts")
flags.DEFINE_integer("prompt_tokens", 96, "tokens per prompt")
flags.DEFINE_integer("max_new_tokens", 96, "tokens per reply")
flags.DEFINE_integer("lanes", 8, "engine lanes")
flags.DEFINE_list("sizes_27b", ["16384", "32768", "65536", "248320"], "27B draft vocabulary "
                  "sizes to price (248320: the whole vocabulary)")
flags.DEFINE_list("acceptance", ["0.92", "0.84", "0.65", "0.54"], "27B acceptance with the "
                  "whole vocabulary: share of verify steps accepting draft j (the aot command's "
                  "assumed profile)")
flags.DEFINE_float("miss_32k", 1 - 63.6 / 66.7, "27B: share of drafts a 32k-row draft head "
                   "loses (published: acceptance 66.7% -> 63.6%)")
flags.DEFINE_integer("context", 2048, "27B: tokens of context per lane for the step prices")
flags.DEFINE_list("lanes_27b", ["1", "8", "32"], "27B lane counts to price")
flags.DEFINE_string("out", "", "write the results here (JSON)")
flags.DEFINE_bool("progress", True, "progress lines on stderr")

V27 = 248320


def measure_tiny(log) -> dict:
    """Part 1: the tiny checkpoint's acceptance at each share of its vocabulary."""
    import mtpjax
    from experiments import corpus
    from mtpjax import draft_vocab as dv
    from mtpjax.sampling import SamplingParams
    from mtpjax.engine.scheduler import SpeculationPolicy
    from mtpjax.text import Tokenizer
    tok = Tokenizer.from_checkpoint(FLAGS.checkpoint)
    cfg, params = mtpjax.load_checkpoint(FLAGS.checkpoint, "float32")
    vocab = dv.DraftVocab.load(FLAGS.checkpoint, cfg.vocab_size)
    prompts = []
    for text in corpus.iter_texts("heldout"):
        ids = tok.encode(text)
        if len(ids) >= FLAGS.prompt_tokens:
            prompts.append(ids[:FLAGS.prompt_tokens])
        if len(prompts) == FLAGS.prompts:
            break
    K = FLAGS.num_speculative_tokens
    sp = SamplingParams(temperature=0.0, max_new_tokens=FLAGS.max_new_tokens)
    rows, ref = [], None
    for share in sorted((float(s) for s in FLAGS.shares), reverse=True):
        n = max(1, round(share * cfg.vocab_size))
        ids = None if n == cfg.vocab_size else vocab.top(n)
        log(f"tiny: draft vocabulary {n} of {cfg.vocab_size} ids ({share:.0%}), K = {K}, "
            f"{len(prompts)} prompts")
        eng = mtpjax.Engine(cfg, params, num_speculative_tokens=K, max_lanes=FLAGS.lanes,
                            max_seq_len=FLAGS.prompt_tokens + FLAGS.max_new_tokens + 2 * K,
                            speculation_policy=SpeculationPolicy(), draft_vocab=ids)
        outs = eng.generate(prompts, sp)
        toks = [o.token_ids for o in outs]
        if ref is None:
            ref = toks
        steps = sum(o.stats.verify_steps for o in outs)
        tried = sum(o.stats.tried_per_position[0] for o in outs)
        acc = [sum(o.stats.accepted_per_position[j] for o in outs) / max(tried, 1)
               for j in range(K)]
        emitted = sum(o.stats.accepted_tokens for o in outs) + steps
        rows.append({"share": share, "n": n, "acceptance": acc,
                     "tokens_per_verify": emitted / max(steps, 1),
                     "coverage_counted": vocab.coverage(n),
                     "same_tokens_as_full": toks == ref})
    full = rows[0]["acceptance"]
    reply = np.concatenate([np.asarray(t[1:], np.int64) for t in ref])   # target's tokens
    for r in rows:
        inside = np.isin(reply, vocab.top(r["n"]))
        r["miss"] = float(1 - inside.mean())
        r["model_acceptance"] = [a * (1 - r["miss"]) ** (j + 1) for j, a in enumerate(full)]
    return {"checkpoint": FLAGS.checkpoint, "vocab_size": cfg.vocab_size, "K": K,
            "prompts": len(prompts), "prompt_tokens": FLAGS.prompt_tokens,
            "max_new_tokens": FLAGS.max_new_tokens, "lanes": FLAGS.lanes, "rows": rows}


def zipf_miss(n: int, miss_32k: float, V: int = V27) -> float:
    """m(N) from m(32k) and a Zipf (s = 1) tail: 1 - H_N / H_V, H the harmonic number."""
    h = lambda x: math.log(x) + 0.5772156649 + 1 / (2 * x)
    tail = lambda x: 1 - h(x) / h(V)
    return 0.0 if n >= V else miss_32k * tail(n) / tail(32768)


def predict_27b(log) -> dict:
    """Part 2: the 27B's draft program and step prices per N, and the adaptive depth."""
    from mtpjax.cost_model import CostModel
    from mtpjax.engine.depth import predict
    K = FLAGS.num_speculative_tokens
    base = [float(a) for a in FLAGS.acceptance][:K]
    rows = []
    for n in (int(s) for s in FLAGS.sizes_27b):
        m = CostModel(K=K, draft_vocab=None if n >= V27 else n)
        miss = zipf_miss(n, FLAGS.miss_32k)
        acc = [a * (1 - miss) ** (j + 1) for j, a in enumerate(base)]
        draft = m.draft(1, [FLAGS.context])
        row = {"n": n, "miss": miss, "acceptance": acc, "draft_bytes": draft.total_bytes,
               "draft_ms": draft.seconds * 1e3, "lanes": {}}
        for B in (int(b) for b in FLAGS.lanes_27b):
            secs = [m.program(("decode", d, B), [FLAGS.context] * B).seconds
                    for d in range(K + 1)]
            depth, rates = predict(secs, acc, B)
            row["lanes"][B] = {"step_ms": [s * 1e3 for s in secs], "depth": depth,
                               "tokens_per_s": rates[depth], "stock_tokens_per_s": rates[0],
                               "speedup": rates[depth] / rates[0],
                               "tokens_per_s_by_depth": rates}
        rows.append(row)
        log(f"27B N={n}: draft {draft.total_bytes / 1e9:.2f} GB {draft.seconds * 1e3:.3f} ms; "
            + ", ".join(f"{B} lanes depth {v['depth']} {v['tokens_per_s']:.0f} tok/s "
                        f"({v['speedup']:.3f}x stock)" for B, v in row["lanes"].items()))
    best = {B: max(rows, key=lambda r: r["lanes"][B]["tokens_per_s"])["n"]
            for B in rows[0]["lanes"]}
    return {"K": K, "context": FLAGS.context, "base_acceptance": base,
            "miss_32k": FLAGS.miss_32k, "rows": rows, "best_n_by_lanes": best,
            "assumption": "27B acceptance = --acceptance x (1 - m(N))^j; m(32k) published "
                          "(66.7% -> 63.6%), other N by a Zipf (s = 1) tail"}


def format_tiny(t: dict) -> str:
    K = t["K"]
    head = (f"{'N':>6} {'share':>6} {'miss':>6} {'tok/verify':>10}  "
            + " ".join(f"{'a' + str(j + 1):>6}" for j in range(K)) + "   model "
            + " ".join(f"{'a' + str(j + 1):>6}" for j in range(K)) + "  lossless")
    lines = [head]
    for r in t["rows"]:
        lines.append(f"{r['n']:>6} {r['share']:>6.0%} {r['miss']:>6.3f} "
                     f"{r['tokens_per_verify']:>10.3f}  "
                     + " ".join(f"{a:>6.3f}" for a in r["acceptance"]) + "         "
                     + " ".join(f"{a:>6.3f}" for a in r["model_acceptance"])
                     + f"  {r['same_tokens_as_full']}")
    return "\n".join(lines)


def format_27b(p: dict) -> str:
    lanes = list(p["rows"][0]["lanes"])
    head = f"{'N':>7} {'miss':>6} {'draft_GB':>8} {'draft_ms':>8} " + " ".join(
        f"{f'{B} lanes: depth tok/s x':>26}" for B in lanes)
    lines = [head]
    for r in p["rows"]:
        lines.append(f"{r['n']:>7} {r['miss']:>6.3f} {r['draft_bytes'] / 1e9:>8.3f} "
                     f"{r['draft_ms']:>8.3f} " + " ".join(
                         f"{v['depth']:>12} {v['tokens_per_s']:>7.0f} {v['speedup']:>5.3f}"
                         for v in r["lanes"].values()))
    return "\n".join(lines)


def main(argv):
    del argv
    from experiments.progress import Progress
    log = Progress("draft_vocab_sweep", FLAGS.progress)
    tiny = measure_tiny(log)
    print(f"tiny checkpoint ({tiny['vocab_size']} ids), K = {tiny['K']} fixed, "
          f"{tiny['prompts']} held-out prompts x {tiny['max_new_tokens']} greedy tokens: "
          "acceptance a_j = share of verify steps accepting draft j")
    print(format_tiny(tiny))
    p = predict_27b(log)
    print(f"\nQwen3.5-27B on one H200 (cost model, bf16, K = {p['K']}, context {p['context']}; "
          f"{p['assumption']}):")
    print(format_27b(p))
    print(f"highest predicted tokens/s: N = {p['best_n_by_lanes']} (by lanes)")
    if FLAGS.out:
        with open(FLAGS.out, "w") as f:
            json.dump({"tiny": tiny, "h200_27b": p}, f, indent=1)
        print(f"wrote {FLAGS.out}")
