"""`python -m experiments cpu_flags`: which XLA:CPU settings decode the tiny fastest here.

XLA reads its flags once, when the backend starts, so each candidate runs in a fresh process
(this module with `--worker`) with its own XLA_FLAGS and the engine's own defaults off
(MTPJAX_XLA_CPU_FLAGS=none, mtpjax/xla_cpu.py). A worker loads the checkpoint, builds a stock
engine (K = 0, lanes = its batch, one lane bucket, no prefix cache), compiles it with one
untimed generate, then times `--repeats` generate calls of `--new_tokens` tokens per lane and
prints the median tokens/s and the tokens it produced. Candidates and batches are interleaved
over `--passes` (this machine is noisy), the table gives each cell's median over passes and its
ratio to the default settings measured in the same run, and says whether every candidate
produced the default's tokens (the flags change scheduling, never the arithmetic a test
could see). The last stdout line is the JSON; `--out` writes it too.

What it decides: mtpjax/xla_cpu.py's CHOSEN, the flags the engine sets for itself (the user's
XLA_FLAGS still win) — only a candidate that beats the default at batch 1 and at batch 8.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

from absl import flags

flags.DEFINE_string("checkpoint", "checkpoints/tiny", "checkpoint folder")
flags.DEFINE_list("batches", ["1", "8"], "lanes (requests decoded together) per cell")
flags.DEFINE_integer("new_tokens", 128, "tokens generated per request")
flags.DEFINE_integer("prompt_tokens", 24, "prompt length (random ids, seeded)")
flags.DEFINE_integer("repeats", 3, "timed generate calls per worker (after one untimed)")
flags.DEFINE_integer("passes", 2, "interleaved passes over every (candidate, batch)")
flags.DEFINE_list("candidates", None, "names of mtpjax.xla_cpu.CANDIDATES to run (default all)")
flags.DEFINE_string("out", "", "also write the JSON here")
flags.DEFINE_bool("worker", False, "internal: time one cell in this process")
flags.DEFINE_integer("worker_batch", 1, "internal: the worker's lanes")
FLAGS = flags.FLAGS


def worker() -> dict:
    import numpy as np
    import mtpjax
    from mtpjax.sampling import SamplingParams
    b = FLAGS.worker_batch
    eng = mtpjax.Engine.from_checkpoint(FLAGS.checkpoint, num_speculative_tokens=0,
                                        max_lanes=b, lane_buckets=[b], prefix_cache=False,
                                        max_seq_len=FLAGS.prompt_tokens + FLAGS.new_tokens + 8)
    rng = np.random.default_rng(0)
    prompts = [list(map(int, rng.integers(10, eng.cfg.vocab_size - 10, FLAGS.prompt_tokens)))
               for _ in range(b)]
    sp = SamplingParams(max_new_tokens=FLAGS.new_tokens)
    eng.generate(prompts, sp)                                   # compiles
    rates, outs = [], None
    for _ in range(FLAGS.repeats):
        t0 = time.perf_counter()
        outs = eng.generate(prompts, sp)
        rates.append(sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t0))
    return {"tok_s": statistics.median(rates), "all": rates,
            "tokens": [o.token_ids for o in outs],
            "xla_flags": os.environ.get("XLA_FLAGS", "")}


def run_cell(flags_: str, batch: int) -> dict:
    env = dict(os.environ, XLA_FLAGS=flags_, JAX_PLATFORMS="cpu", MTPJAX_XLA_CPU_FLAGS="none")
    cmd = [sys.executable, "-m", "experiments", "cpu_flags", "--worker",
           f"--worker_batch={batch}", f"--checkpoint={FLAGS.checkpoint}",
           f"--new_tokens={FLAGS.new_tokens}", f"--prompt_tokens={FLAGS.prompt_tokens}",
           f"--repeats={FLAGS.repeats}", "--nocompilation_cache"]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if r.returncode != 0:
        raise SystemExit(f"worker failed (XLA_FLAGS={flags_!r}, batch {batch}):\n"
                         f"{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main(argv):
    del argv
    if FLAGS.worker:
        print(json.dumps(worker()))
        return 0
    from mtpjax import xla_cpu
    names = FLAGS.candidates or list(xla_cpu.CANDIDATES)
    unknown = [n for n in names if n not in xla_cpu.CANDIDATES]
    if unknown:
        raise SystemExit(f"unknown candidates {unknown}; choose from {list(xla_cpu.CANDIDATES)}")
    if "default" not in names:
        names = ["default"] + names
    batches = [int(b) for b in FLAGS.batches]
    cells: dict = {(n, b): [] for n in names for b in batches}
    tokens: dict = {}
    for p in range(FLAGS.passes):
        for b in batches:
            for n in names:
                res = run_cell(" ".join(xla_cpu.CANDIDATES[n]), b)
                cells[(n, b)].append(res["tok_s"])
                tokens.setdefault((n, b), res["tokens"])
                print(f"[cpu_flags] pass {p + 1}/{FLAGS.passes} batch {b} {n}: "
                      f"{res['tok_s']:.1f} tok/s", file=sys.stderr, flush=True)
    rows = []
    for n in names:
        row = {"candidate": n, "xla_flags": " ".join(xla_cpu.CANDIDATES[n])}
        for b in batches:
            med = statistics.median(cells[(n, b)])
            base = statistics.median(cells[("default", b)])
            row[f"b{b}"] = {"tok_s": med, "passes": cells[(n, b)], "ratio": med / base,
                            "same_tokens": tokens[(n, b)] == tokens[("default", b)]}
        rows.append(row)
    print("| candidate | XLA_FLAGS | " + " | ".join(f"batch {b} tok/s (x default)"
                                                   for b in batches) + " | same tokens |")
    print("|---|---|" + "---:|" * len(batches) + "---|")
    for r in rows:
        cells_md = " | ".join(f"{r[f'b{b}']['tok_s']:.1f} ({r[f'b{b}']['ratio']:.2f}x)"
                              for b in batches)
        same = all(r[f"b{b}"]["same_tokens"] for b in batches)
        print(f"| {r['candidate']} | `{r['xla_flags'] or '(none)'}` | {cells_md} | {same} |")
    result = {"rows": rows, "chosen_now": list(xla_cpu.CHOSEN),
              "settings": {"checkpoint": FLAGS.checkpoint, "batches": batches,
                           "new_tokens": FLAGS.new_tokens, "repeats": FLAGS.repeats,
                           "passes": FLAGS.passes}}
    if FLAGS.out:
        with open(FLAGS.out, "w") as f:
            json.dump(result, f, indent=1)
    print(json.dumps(result))
    return 0
