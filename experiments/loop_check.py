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

import os

from absl import app, flags

from experiments import card as card_lib
from experiments import depth_sweep
from experiments.loop_runs import HEADER, run

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
        card_lib.write_json(FLAGS.out, out, indent=1)
        print(f"wrote {FLAGS.out}")


if __name__ == "__main__":
    app.run(main)
