"""`python -m experiments ttft_check [--ttft_clock=wall|h200]`: time to first token when
prompts arrive together, packed prefill against one chunk a step, in one run.

Packed prefill (Engine(prefill_rows=R), default min(4, lanes)) runs the prefill chunks of up
to R lanes in one step; `prefill_rows=1` is one chunk a step, what it replaced. For the stock
engine (K = 0) and the default candidate (K = 4, adaptive depth), each both ways, it measures:

  burst   `--prompts` held-out prompts of `--prompt_tokens` tokens (default 8 x 512) submitted
          at once to an engine of as many lanes: per request the time from the call to its
          first token; the cell's mean and p90 (median over passes)
  chat    the judge's chat workload (8 conversations x 3 turns on a 64-token system prompt,
          one generate call a turn): the mean time to first token of each turn

on the engine's time: this machine's wall clock, or the H200 clock (`--ttft_clock=h200`: the
27B's programs priced by mtpjax/cost_model.py, a prediction, not a measurement). Passes are
interleaved (cell order reversed every other pass) and each cell checks it emitted the
one-chunk engine's tokens (greedy).
"""

from __future__ import annotations

import json
import os

from absl import app, flags

from experiments import card as card_lib
from experiments import chat_workload, depth_sweep
from experiments.ttft_runs import HEADER, run

flags.DEFINE_string("checkpoint", os.path.join(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))), "checkpoints", "tiny"), "checkpoint directory")
flags.DEFINE_integer("prompts", 8, "prompts submitted together (and engine lanes)")
flags.DEFINE_integer("prompt_tokens", 512, "tokens per prompt")
flags.DEFINE_integer("k", 4, "the candidate's draft slots (adaptive depth)")
flags.DEFINE_integer("passes", 3, "timed passes per cell")
flags.DEFINE_integer("new_tokens", 16, "tokens per request")
flags.DEFINE_integer("prefill_chunk", 64, "tokens of a prefill chunk (Engine prefill_chunk)")
flags.DEFINE_bool("chat", True, "also run the judge's chat workload")
flags.DEFINE_enum("ttft_clock", "wall", ["wall", "h200"], "wall: this machine's time; h200: "
                  "the H200 clock's prediction for the 27B")
flags.DEFINE_string("out", "runs/ttft_check.json", "where the results go ('' = nowhere)")

FLAGS = flags.FLAGS
TEXTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "judge_texts.json")


def main(argv):
    del argv
    from mtpjax.api import load_checkpoint
    from mtpjax.text import Tokenizer
    cfg, params = load_checkpoint(FLAGS.checkpoint, "float32")
    tok = Tokenizer.from_checkpoint(FLAGS.checkpoint)
    prompts = depth_sweep.heldout_prompts(tok, FLAGS.prompts, FLAGS.prompt_tokens)
    with open(TEXTS) as f:
        texts = [(tok.encode(t["prompt"])[-48:], tok.encode(t["continuation"]))
                 for t in json.load(f)["texts"]]
    print(f"ttft_check: {FLAGS.prompts} x {FLAGS.prompt_tokens}-token prompts at once, "
          f"{FLAGS.ttft_clock} clock"
          + (f" ({card_lib.predicted_words()})" if FLAGS.ttft_clock == "h200" else ""))
    print(HEADER)
    out = run(cfg, params, prompts, texts, lanes=FLAGS.prompts, k=FLAGS.k,
              passes=FLAGS.passes, new_tokens=FLAGS.new_tokens, clock=FLAGS.ttft_clock,
              prefill_chunk=FLAGS.prefill_chunk,
              chat_spec=chat_workload.ChatSpec() if FLAGS.chat else None)
    if FLAGS.out:
        card_lib.write_json(FLAGS.out, out, indent=1)
        print(f"wrote {FLAGS.out}")


if __name__ == "__main__":
    app.run(main)
