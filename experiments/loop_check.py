"""`python -m experiments loop_check [--lanes=1,8,16] [--clock=wall|h200]`: the serial loop
against the overlapped one, in one run.

The engine's default loop plans and launches step N+1 while the device runs step N
(mtpjax/engine/engine.py); `Engine(overlap=False)` is the serial loop it replaced (plan,
launch, wait, commit). For each lane count this runs the stock engine (K = 0) and the
default candidate (K = 4, adaptive depth) in both loops on the same greedy held-out
requests (experiments/depth_sweep.py: same prompts, stop tokens off, each request exactly
`--new_tokens` long), passes interleaved (loop and engine alternate, the order reversed on
every other pass) so a slow period on a shared machine hits every cell. It reports per
cell the median of its passes:

  tokens/s       generated tokens / seconds of `generate` (wall, or the H200 clock's)
  host_ms        per decode step, the time the device waited for the host: from one
                 launch's end to the next launch (the runner's probe: an upper bound); on
                 the clock, host time the modelled device could not hide
  host_work_ms   per decode step, the host's own time (scheduling, the batch record,
                 committing tokens), overlapped or not
  overlapped     the share of launches queued behind a step still running

and checks that both loops emitted the same tokens (they must: tests/test_overlap.py).
"""

from __future__ import annotations

import json
import os
import statistics

from absl import app, flags

from experiments import card as card_lib
from experiments import depth_sweep

flags.DEFINE_string("checkpoint", os.path.join(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))), "checkpoints", "tiny"), "checkpoint folder")
flags.DEFINE_list("lanes", ["1", "8", "16"], "lane counts")
flags.DEFINE_integer("k", 4, "the candidate's draft slots (adaptive depth)")
flags.DEFINE_integer("passes", 3, "timed passes per cell")
flags.DEFINE_integer("requests_per_lane", 2, "requests per lane")
flags.DEFINE_integer("new_tokens", 48, "tokens per request")
flags.DEFINE_integer("prompt_tokens", 32, "prompt tokens per request")
flags.DEFINE_enum("loop_clock", "wall", ["wall", "h200"], "wall: this machine's time; h200: "
                  "each engine on its own H200 clock (experiments/card.py make_clock)")
flags.DEFINE_string("out", "runs/loop_check.json", "where the results go ('' = nowhere)")
FLAGS = flags.FLAGS

LOOPS = (("serial", False), ("overlapped", True))


def cell_summary(passes: list[dict]) -> dict:
    """Medians over a cell's passes: tokens/s, host ms per decode step (the device's wait
    and the host's work), the share of launches that overlapped a running step."""
    per_step = lambda p, key: 1e3 * p[key] / max(p["steps"], 1)
    return {"tokens_per_s": statistics.median(p["tokens_per_s"] for p in passes),
            "host_ms": statistics.median(per_step(p, "host_s") for p in passes),
            "host_work_ms": statistics.median(per_step(p, "host_work_s") for p in passes),
            "step_ms": statistics.median(per_step(p, "step_s") for p in passes),
            "overlapped": statistics.median(p["overlapped"] / max(p["launches"], 1)
                                            for p in passes),
            "steps": statistics.median(p["steps"] for p in passes)}


def run(cfg, params, prompts, lanes: list[int], k: int, passes: int, requests_per_lane: int,
        new_tokens: int, clock: str, log=print) -> dict:
    """Every (lanes, engine, loop) cell; see the module docstring."""
    from mtpjax.sampling import SamplingParams
    sampling = SamplingParams(temperature=0.0, max_new_tokens=new_tokens)
    depths = [0, depth_sweep.ADAPTIVE]
    max_seq = depth_sweep.max_seq_len_for(max(len(p) for p in prompts), new_tokens)
    rows = []
    for L in lanes:
        work = [list(p) for p in prompts[:L * requests_per_lane]]
        engines = {}
        for d in depths:
            for name, overlap in LOOPS:
                e = depth_sweep.make_engine(cfg, params, L, d, [0, k], max_seq, None,
                                            lane_slots=max(lanes), clock=clock,
                                            overlap=overlap)
                depth_sweep.warm(e, work, sampling, d)
                engines[d, name] = e
        runs = {key: [] for key in engines}
        order = list(engines)
        for p in range(passes):
            for key in (order if p % 2 == 0 else order[::-1]):
                runs[key].append(depth_sweep.run_pass(engines[key], work, sampling))
        for d in depths:
            ids = {name: runs[d, name][0]["token_ids"] for name, _ in LOOPS}
            for name, _ in LOOPS:
                row = {"lanes": L, "engine": "stock" if d == 0 else "candidate", "loop": name,
                       **cell_summary(runs[d, name]),
                       "same_tokens": ids[name] == ids["serial"]}
                rows.append(row)
                log(format_row(row))
    return {"settings": {"lanes": lanes, "k": k, "passes": passes, "clock": clock,
                         "requests_per_lane": requests_per_lane, "new_tokens": new_tokens},
            "rows": rows}


def format_row(r: dict) -> str:
    return (f"| {r['lanes']:>5} | {r['engine']:9s} | {r['loop']:10s} | "
            f"{r['tokens_per_s']:8.1f} | {r['step_ms']:7.2f} | {r['host_ms']:7.3f} | "
            f"{r['host_work_ms']:8.3f} | {r['overlapped']:6.0%} | {r['same_tokens']} |")


HEADER = ("| lanes | engine    | loop       |    tok/s | step ms | host ms | work ms  | "
          "overl. | same tokens |\n|---|---|---|---|---|---|---|---|---|")


def main(argv):
    del argv
    from mtpjax.api import load_checkpoint
    from mtpjax.text import Tokenizer
    lanes = depth_sweep.parse_lanes(FLAGS.lanes)
    cfg, params = load_checkpoint(FLAGS.checkpoint, "float32")
    tok = Tokenizer.from_checkpoint(FLAGS.checkpoint)
    prompts = depth_sweep.heldout_prompts(tok, max(lanes) * FLAGS.requests_per_lane,
                                          FLAGS.prompt_tokens)
    print(f"loop_check: {FLAGS.loop_clock} clock, "
          f"{'H200 clock: ' + card_lib.predicted_words() if FLAGS.loop_clock == 'h200' else ''}")
    print(HEADER)
    out = run(cfg, params, prompts, lanes, FLAGS.k, FLAGS.passes, FLAGS.requests_per_lane,
              FLAGS.new_tokens, FLAGS.loop_clock)
    if FLAGS.out:
        os.makedirs(os.path.dirname(FLAGS.out) or ".", exist_ok=True)
        with open(FLAGS.out, "w") as f:
            json.dump(out, f, indent=1)
        print(f"wrote {FLAGS.out}")


if __name__ == "__main__":
    app.run(main)
