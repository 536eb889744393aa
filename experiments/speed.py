"""`python -m experiments speed`: end-to-end decode tokens/s of one request, and its peers.

What a user feels first: one prompt, greedy, through the whole engine (scheduler, prefill,
step programs, read-back). Rows, measured in one run so their ratios are comparable on a noisy
machine:

  engine lanes=1 k=0     the stock engine sized for one request
  engine lanes=N k=0     the same request on an engine with N lanes (N - 1 idle): with lane
                         buckets it must cost about the same as lanes=1 (issue: idle lanes
                         cost nothing)
  engine lanes=N k=K     MTP speculation
  transformers generate  Qwen3_5ForCausalLM.generate on the same checkpoint (when transformers
                         and torch are installed: `pip install -e ".[test]"`), the CPU peer

Every row generates the same tokens (checked: greedy engines must agree token for token with
each other and with transformers). Each row runs `--repeats` times after a warm-up call that
compiles; the table gives the median tokens/s (generated tokens / wall time of generate, the
prefill included). The last line of stdout is the JSON of the rows.

`--clock=h200`: the engine rows run here (the same tokens) but are timed on each engine's
cost_model.VirtualClock: every program an engine launches costs what the cost model predicts
for Qwen3.5-27B on one H200 at that program's shapes, plus the host time measured here
(each row also gives the median host and modelled device seconds of a call). The
transformers row cannot be priced: it stays on this machine's wall clock, is marked so, and
gets no ratio (a ratio between the two clocks would mean nothing). `--clock_calibration=PATH`:
the clock's constants from a gpu_check calibration file (mtpjax/cost_model.py
load_calibration); the output says which constants priced it.
"""

from __future__ import annotations

import json
import os
import time

import numpy as np
from absl import flags

import mtpjax
from experiments import card as card_lib
from mtpjax.sampling import SamplingParams

FLAGS = flags.FLAGS
DEFAULT_CHECKPOINT = os.path.join(os.path.dirname(__file__), "..", "checkpoints", "tiny")
flags.DEFINE_string("checkpoint", DEFAULT_CHECKPOINT, "HF or converted checkpoint folder")
flags.DEFINE_integer("lanes", 4, "lanes of the multi-lane engine rows (the default engine's)")
flags.DEFINE_integer("num_speculative_tokens", 1, "K of the speculative row (0: no such row)")
flags.DEFINE_integer("prompt_len", 32, "prompt tokens (random ids, seeded)")
flags.DEFINE_integer("max_new_tokens", 128, "tokens to generate")
flags.DEFINE_integer("repeats", 3, "timed generate calls per row (after one warm-up)")
flags.DEFINE_enum("kernels", "auto", ["auto", "reference", "pallas", "interpret"], "kernels")
flags.DEFINE_bool("hf", True, "add the transformers generate row when transformers is installed")
flags.DEFINE_integer("seed", 0, "prompt seed")
flags.DEFINE_string("out", "", "also write the JSON rows here")
card_lib.define_clock_flag()
card_lib.define_simulate_flag()


def _time(fn, repeats: int, now=time.perf_counter, clock=None) -> tuple[list[int], float, dict]:
    """(tokens, median seconds of a call on `now`, and with a VirtualClock the median
    modelled device and measured host seconds of a call)."""
    tokens = fn()                                   # warm-up: compiles
    times, parts = [], []
    for _ in range(repeats):
        t0 = now()
        before = None if clock is None else (clock.device_s, clock.host_s)
        again = fn()
        times.append(now() - t0)
        if clock is not None:
            parts.append((clock.device_s - before[0], clock.host_s - before[1]))
        if again != tokens:
            raise AssertionError("a repeated greedy run produced other tokens")
    split = ({} if clock is None else
             {"device_s": float(np.median([d for d, _ in parts])),
              "host_s": float(np.median([h for _, h in parts]))})
    return tokens, float(np.median(times)), split


def engine_row(cfg, params, prompt, *, lanes: int, k: int, n_new: int, kernels, repeats: int,
               clock: str = "wall", simulate_acceptance: str | None = None,
               clock_calibration: str | None = None):
    max_seq = len(prompt) + n_new + 8
    e = mtpjax.Engine(cfg, params, num_speculative_tokens=k, max_lanes=lanes, max_seq_len=max_seq,
                      kernels=None if kernels == "auto" else kernels,
                      eos_token_ids=(),             # generate exactly n_new tokens
                      simulate_acceptance=card_lib.simulator(simulate_acceptance) if k else None)
    e.clock = card_lib.make_clock(clock, k, weights=card_lib.clock_weights(params),
                                  page_size=e.page_size, calibration=clock_calibration)
    sp = SamplingParams(temperature=0.0, max_new_tokens=n_new)
    run = lambda: e.generate([prompt], sp)[0].token_ids
    tokens, sec, split = _time(run, repeats, lambda: card_lib.now(e), e.clock)
    return {"row": f"engine lanes={lanes} k={k}", "tokens": tokens, "seconds": sec,
            "tokens_per_s": len(tokens) / sec, "clock": clock, **split}


def hf_row(path: str, prompt, *, n_new: int, repeats: int):
    try:
        import torch
        from transformers import Qwen3_5ForCausalLM
    except ImportError:
        return None
    m = Qwen3_5ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.tensor([prompt], dtype=torch.long)

    def run():
        with torch.no_grad():
            out = m.generate(ids, max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
        return [int(t) for t in out[0, len(prompt):]]

    # torch's thread pool collapses when the cores are shared (seen here: 50 tokens/s on one
    # thread, 5 on two under load): give the peer its best of 1 and all cores.
    best = None
    for threads in sorted({1, os.cpu_count() or 1}):
        torch.set_num_threads(threads)
        tokens, sec, _ = _time(run, repeats)
        if best is None or sec < best[1]:
            best = (tokens, sec, threads)
    tokens, sec, threads = best
    return {"row": "transformers generate", "tokens": tokens, "seconds": sec,
            "tokens_per_s": len(tokens) / sec, "torch_threads": threads, "clock": "wall"}


def main(argv):
    del argv
    from experiments.progress import Progress
    log = Progress("speed")
    card_lib.check_clock_flags(FLAGS.clock, FLAGS.clock_calibration)   # before any work
    log(f"loading {FLAGS.checkpoint}")
    cfg, params = mtpjax.load_checkpoint(FLAGS.checkpoint, "float32")
    rng = np.random.default_rng(FLAGS.seed)
    prompt = [int(t) for t in rng.integers(0, cfg.vocab_size, FLAGS.prompt_len)]
    kw = dict(n_new=FLAGS.max_new_tokens, kernels=FLAGS.kernels, repeats=FLAGS.repeats,
              clock=FLAGS.clock, simulate_acceptance=FLAGS.simulate_acceptance,
              clock_calibration=FLAGS.clock_calibration)
    cells = [(1, 0), (FLAGS.lanes, 0)]
    if FLAGS.num_speculative_tokens and cfg.has_mtp:
        cells.append((FLAGS.lanes, FLAGS.num_speculative_tokens))
    rows = []
    for lanes, k in cells:
        log(f"engine lanes={lanes} k={k}: a first call (compiles its programs: a few seconds "
            f"each on a CPU), then {FLAGS.repeats} timed calls")
        rows.append(engine_row(cfg, params, prompt, lanes=lanes, k=k, **kw))
    if FLAGS.hf:
        log("transformers generate (the peer), 1 and all threads")
        hf = hf_row(FLAGS.checkpoint, prompt, n_new=FLAGS.max_new_tokens,
                    repeats=FLAGS.repeats)
        if hf is not None:
            rows.append(hf)
    ref = rows[0]["tokens"]
    for r in rows:
        r["same_tokens_as_first_row"] = r.pop("tokens") == ref
    print(format_rows(rows, FLAGS.clock, FLAGS.clock_calibration))
    out = {"checkpoint": os.path.abspath(FLAGS.checkpoint), "prompt_len": FLAGS.prompt_len,
           "max_new_tokens": FLAGS.max_new_tokens, "repeats": FLAGS.repeats,
           "clock": FLAGS.clock, "simulated_acceptance": FLAGS.simulate_acceptance,
           "clock_calibration": FLAGS.clock_calibration,
           "time": (card_lib.predicted_words(calibration=FLAGS.clock_calibration)
                    + "; rows marked wall are this machine's"
                    if FLAGS.clock == "h200" else "wall time on this machine"), "rows": rows}
    if FLAGS.out:
        with open(FLAGS.out, "w") as f:
            json.dump(out, f, indent=2)
    print(json.dumps(out))


def format_rows(rows: list[dict], clock: str, calibration: str | None = None) -> str:
    """The table (sets each row's ratio_vs_first_row: None for a row on another clock than
    the first's). With the h200 clock: the predicted line first, a host column, and rows not
    on the clock (transformers) marked."""
    base = rows[0]
    lines = []
    if clock == "h200":
        lines.append(f"clock h200: engine rows {card_lib.predicted_words(calibration=calibration)}"
                     "; host = measured "
                     "host seconds per call, included")
    lines.append(f"{'row':<26} {'tokens/s':>9} {'vs lanes=1 k=0':>15} {'same tokens':>12}"
                 + (f" {'host ms/call':>12}" if clock == "h200" else ""))
    for r in rows:
        same = r["clock"] == base["clock"]
        r["ratio_vs_first_row"] = r["tokens_per_s"] / base["tokens_per_s"] if same else None
        ratio = f"{r['ratio_vs_first_row']:.2f}" if same else "n/a"
        line = (f"{r['row']:<26} {r['tokens_per_s']:>9.1f} {ratio:>15} "
                f"{str(r['same_tokens_as_first_row']):>12}")
        if clock == "h200":
            line += (f" {1e3 * r['host_s']:>12.1f}" if "host_s" in r else
                     f" {'':>12}  (wall time on this machine: not on the h200 clock)")
        lines.append(line)
    return "\n".join(lines)
