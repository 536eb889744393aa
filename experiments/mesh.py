"""`python -m experiments mesh [--tps=2,4] [--dp=1] [--num_speculative_tokens=1]`.

Tensor / data parallel engines against the one-device engine on the same requests: token
agreement (greedy and seeded sampling), where the first difference falls, and wall time. Row-
parallel reductions add float32 partial sums in another order than one device does; this
measures what that does to the tokens (tests/test_mesh.py demands equality on small models).

On CPU JAX gets as many host devices as the largest tp x dp (experiments/mesh_flags.py); on a
GPU host it uses the GPUs. The last stdout line is the result as one JSON document.
"""

from __future__ import annotations

import json
import time

import numpy as np
from absl import flags

from experiments import mesh_flags

FLAGS = flags.FLAGS
mesh_flags.define()
flags.DEFINE_string("checkpoint", "checkpoints/tiny", "HF or converted checkpoint folder")
flags.DEFINE_list("tps", ["2", "4"], "tensor-parallel degrees to compare with one device")
flags.DEFINE_integer("num_speculative_tokens", 1, "k of every engine")
flags.DEFINE_integer("requests", 16, "requests (half greedy, half sampled)")
flags.DEFINE_integer("prompt_len", 24, "prompt tokens (random ids, seeded)")
flags.DEFINE_integer("max_new_tokens", 48, "tokens per request")
flags.DEFINE_integer("max_lanes", 8, "lanes per engine (replica)")
flags.DEFINE_float("temperature", 1.0, "temperature of the sampled half")
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "compute dtype")
flags.DEFINE_string("out", "", "also write the JSON here")


def agreement(ref: list[list[int]], got: list[list[int]]) -> dict:
    """Positionwise agreement until each request's first difference (after it, the contexts
    differ, so later tokens are not comparable)."""
    same, total, first = 0, 0, []
    for a, b in zip(ref, got):
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        if n < max(len(a), len(b)):
            first.append(n)
        same += n
        total += len(a)
    return {"tokens_before_first_difference": same, "tokens": total,
            "agreement": same / max(total, 1), "requests_differing": len(first),
            "first_difference_at": first}


def main(argv):
    del argv
    import mtpjax
    from mtpjax.sampling import SamplingParams

    tps = [int(t) for t in FLAGS.tps]
    mesh_flags.setup_devices(max(tps) * FLAGS.dp)
    rng = np.random.default_rng(0)
    cfg, params = mtpjax.load_checkpoint(FLAGS.checkpoint, FLAGS.dtype)
    prompts = [rng.integers(0, cfg.vocab_size, FLAGS.prompt_len).tolist()
               for _ in range(FLAGS.requests)]
    sps = [SamplingParams(max_new_tokens=FLAGS.max_new_tokens,
                          temperature=0.0 if i % 2 == 0 else FLAGS.temperature, seed=i)
           for i in range(FLAGS.requests)]
    kw = dict(num_speculative_tokens=FLAGS.num_speculative_tokens, max_lanes=FLAGS.max_lanes,
              max_seq_len=FLAGS.prompt_len + FLAGS.max_new_tokens + 8, eos_token_ids=())

    def run(tp: int, dp: int) -> tuple[list[list[int]], float, float]:
        eng = mtpjax.make_engine(cfg, params, tp=tp, dp=dp, **kw)
        t0 = time.perf_counter()
        eng.generate(prompts, sps)                          # compile every program it uses
        t1 = time.perf_counter()
        outs = eng.generate(prompts, sps)
        return [o.token_ids for o in outs], t1 - t0, time.perf_counter() - t1

    ref, ref_compile, ref_s = run(1, 1)    # seconds: the second of two identical runs
    rows = [{"tp": 1, "dp": 1, "compile_s": ref_compile, "seconds": ref_s}]
    print(f"one device: {ref_s:.2f} s for {FLAGS.requests} requests", flush=True)
    for tp in tps:
        got, comp, sec = run(tp, FLAGS.dp)
        greedy = agreement(ref[0::2], got[0::2])
        sampled = agreement(ref[1::2], got[1::2])
        rows.append({"tp": tp, "dp": FLAGS.dp, "compile_s": comp, "seconds": sec,
                     "greedy": greedy, "sampled": sampled})
        print(f"tp={tp} dp={FLAGS.dp}: greedy agreement {greedy['agreement']:.4f} "
              f"({greedy['requests_differing']} requests differ), sampled "
              f"{sampled['agreement']:.4f} ({sampled['requests_differing']} differ); "
              f"{sec:.2f} s", flush=True)
    doc = {"command": "python -m experiments mesh " + " ".join(
        f"--{k}={v}" for k, v in (("tps", ",".join(FLAGS.tps)), ("dp", FLAGS.dp),
                                  ("num_speculative_tokens", FLAGS.num_speculative_tokens),
                                  ("requests", FLAGS.requests),
                                  ("max_new_tokens", FLAGS.max_new_tokens))),
           "checkpoint": FLAGS.checkpoint, "dtype": FLAGS.dtype, "rows": rows}
    if FLAGS.out:
        with open(FLAGS.out, "w") as f:
            json.dump(doc, f, indent=1)
    print(json.dumps(doc), flush=True)
