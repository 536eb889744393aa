"""`python -m experiments generate --prompt=TEXT [--chat] [--checkpoint=checkpoints/tiny] ...`

Streams the decoded continuation of one prompt to stdout as the engine emits tokens (MTP
speculation on by default, `--num_speculative_tokens=0` for the stock engine), then prints one
stats line:

    [stats] tokens=N finish=... time=Xs tok/s=... ttft=Xs decode_tok/s=... acceptance=a
    (accepted/drafted) tokens/step=... k=...

`time` and `ttft` include compiling the prefill/decode programs on the first call; add
`--warmup` to run the request once unmeasured first. With `--chat` the prompt is a user message
rendered with the Qwen3.5 ChatML template (`--system`, `--enable_thinking`) and generation
stops at `<|im_end|>`.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time

from absl import flags

from experiments import mesh_flags, weight_flags

FLAGS = flags.FLAGS
mesh_flags.define()
weight_flags.define()
flags.DEFINE_string("checkpoint", "checkpoints/tiny", "checkpoint folder (HF safetensors or "
                    "converted) with tokenizer.json")
flags.DEFINE_string("prompt", "def fibonacci(n):", "prompt text (the user message with --chat)")
flags.DEFINE_boolean("chat", False, "wrap the prompt in the ChatML chat template")
flags.DEFINE_string("system", None, "system message (with --chat)")
flags.DEFINE_boolean("enable_thinking", True, "chat template: open a <think> block (Qwen3.5 "
                     "default) or an empty one")
flags.DEFINE_integer("num_speculative_tokens", 1, "MTP draft slots K: each step drafts up "
                     "to K tokens (0 = no speculation)")
flags.DEFINE_boolean("adaptive", False, "choose each step's depth in 0..K from measured step "
                     "time and acceptance (mtpjax/engine/depth.py); else always K")
flags.DEFINE_integer("max_new_tokens", 128, "tokens to generate at most")
flags.DEFINE_float("temperature", None, "0 = greedy (default: --generation_config's)")
flags.DEFINE_integer("top_k", None, "0 = off (default: --generation_config's)")
flags.DEFINE_float("top_p", None, "1.0 = off (default: --generation_config's)")
flags.DEFINE_enum("generation_config", "auto", ["auto", "none"], "sampling defaults for the "
                  "flags left out: 'auto' = the checkpoint's generation_config.json "
                  "(temperature, top_p, top_k, penalties), 'none' = OpenAI's (temperature 1)")
flags.DEFINE_integer("seed", 0, "sampling seed")
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "compute dtype")
flags.DEFINE_integer("max_seq_len", 0, "context limit of the engine's cache; 0 = prompt + "
                     "max_new_tokens")
flags.DEFINE_string("kernels", None, "gdn/attention kernels (default: pallas on GPU, "
                    "reference elsewhere)")
flags.DEFINE_boolean("prefix_cache", True, "reuse cached prompt prefixes (KV pages + GDN "
                     "snapshots); with --warmup the timed run hits the warm-up's prefix")
flags.DEFINE_boolean("skip_special_tokens", False, "leave special tokens out of the text")
flags.DEFINE_boolean("warmup", False, "run the request once first so that the stats exclude "
                     "compilation")


def main(argv):
    if len(argv) > 1:
        raise SystemExit(f"unexpected arguments: {' '.join(argv[1:])}")
    import mtpjax
    from mtpjax.generation_config import SamplingDefaults
    from mtpjax.sampling import SamplingParams
    from mtpjax.text import TextEngine, Tokenizer, apply_chat_template

    path = FLAGS.checkpoint
    if not os.path.isdir(path):
        hint = (" (train it with `python -m experiments train_tiny`)"
                if os.path.normpath(path) == os.path.normpath("checkpoints/tiny") else "")
        raise SystemExit(f"checkpoint folder not found: {path}{hint}; pass --checkpoint=DIR")
    try:
        tok = Tokenizer.from_checkpoint(path)
    except (FileNotFoundError, ValueError) as e:
        raise SystemExit(str(e))

    if FLAGS.chat:
        msgs = ([{"role": "system", "content": FLAGS.system}] if FLAGS.system else [])
        msgs.append({"role": "user", "content": FLAGS.prompt})
        prompt_text = apply_chat_template(msgs, True, FLAGS.enable_thinking)
    else:
        prompt_text = FLAGS.prompt
    prompt_ids = tok.encode(prompt_text)
    if not prompt_ids:
        raise SystemExit("the prompt encodes to no tokens")

    t0 = time.perf_counter()
    cfg = mtpjax.Config.from_pretrained(path)
    max_seq_len = FLAGS.max_seq_len or len(prompt_ids) + FLAGS.max_new_tokens + 1
    max_seq_len = max(2, min(max_seq_len, cfg.max_position_embeddings))
    engine = mtpjax.Engine.from_checkpoint(
        path, FLAGS.dtype, FLAGS.num_speculative_tokens, tp=FLAGS.tp, dp=FLAGS.dp, max_lanes=1,
        max_seq_len=max_seq_len, kernels=FLAGS.kernels, weights=FLAGS.weights,
        mtp_weights=FLAGS.mtp_weights,
        speculation_policy="adaptive" if FLAGS.adaptive else "fixed",
        prefix_cache=FLAGS.prefix_cache)
    text_engine = TextEngine(engine, tok, skip_special_tokens=FLAGS.skip_special_tokens)
    print(f"[load] {path}: {cfg.num_layers} layers, vocab {cfg.vocab_size}, "
          f"{FLAGS.dtype}, weights={FLAGS.weights}, k={engine.k}, kernels={engine.kernels}, tp={FLAGS.tp}, "
          f"dp={FLAGS.dp}, prompt {len(prompt_ids)} "
          f"tokens, {time.perf_counter() - t0:.1f}s", file=sys.stderr, flush=True)

    d = SamplingDefaults.resolve(FLAGS.generation_config, path)
    pick = lambda v, default: default if v is None else v
    sp = SamplingParams(temperature=pick(FLAGS.temperature, d.temperature),
                        top_k=pick(FLAGS.top_k, d.top_k), top_p=pick(FLAGS.top_p, d.top_p),
                        presence_penalty=d.presence_penalty,
                        frequency_penalty=d.frequency_penalty,
                        repetition_penalty=d.repetition_penalty,
                        max_new_tokens=FLAGS.max_new_tokens, seed=FLAGS.seed)
    print(f"[generate] sampling: temperature {sp.temperature:g}, top_p {sp.top_p:g}, top_k "
          f"{sp.top_k}, repetition_penalty {sp.repetition_penalty:g} (defaults: {d.source})",
          file=sys.stderr, flush=True)
    if FLAGS.chat:
        sp = dataclasses.replace(sp, stop_token_ids=tok.stop_ids())
    print("[generate] the first step of each kind compiles its program (a few seconds each on "
          "a CPU; later runs load them from the compilation cache)", file=sys.stderr, flush=True)
    if FLAGS.warmup:
        text_engine.generate([prompt_ids], sp)

    first = []

    def on_token(i, new):
        if not first:
            first.append(time.perf_counter())

    def on_text(i, piece):
        sys.stdout.write(piece)
        sys.stdout.flush()

    t0 = time.perf_counter()
    (out,) = text_engine.generate([prompt_ids], sp, on_text=on_text, on_token=on_token)
    t1 = time.perf_counter()
    sys.stdout.write("\n")
    if out.error:
        print(f"[error] {out.error}", flush=True)
        raise SystemExit(1)
    n = len(out.token_ids)
    st = out.stats
    ttft = (first[0] - t0) if first else float("nan")
    rest = t1 - first[0] if first else 0.0
    decode_tps = (n - 1) / rest if n > 1 and rest > 0 else float("nan")
    if engine.k:
        acc = (f"acceptance={st.accepted_tokens / max(st.drafted_tokens, 1):.3f} "
               f"({st.accepted_tokens}/{st.drafted_tokens}) "
               f"per_position={st.accepted_per_position} "
               f"tokens/step={st.tokens_per_step:.2f}")
    else:
        acc = "acceptance=n/a (k=0)"
    print(f"[stats] tokens={n} finish={out.finish_reason} time={t1 - t0:.2f}s "
          f"tok/s={n / (t1 - t0):.1f} ttft={ttft:.2f}s decode_tok/s={decode_tps:.1f} {acc} "
          f"k={engine.k}", flush=True)
