"""Tokens/s against lanes for fixed draft depths and the adaptive policy: one table, one run.

`python -m experiments bench --sweep=lanes` (issue 13, item 5) calls `run_sweep` and prints
`format_table`. This module defines no flags (so tests and other sub-commands can import it)
and every function takes plain values.

Why it is measured this way:

- Whole engine, real text. The step microbenchmarks of bench.py leave out the scheduler,
  prefill, read-back and, above all, acceptance; whether depth d pays depends on how many
  drafts the target accepts, so the requests are greedy continuations of held-out text
  (`heldout_prompts`: windows of the held-out split of `experiments/corpus.py`, the split the
  tiny checkpoint never trained on, tokenized with the checkpoint's tokenizer).
- Same work in every cell. For L lanes: L * requests_per_lane requests (so lanes refill once
  requests finish, as on a server) on an engine with max_lanes=L, the same prompts for every
  depth, each request exactly `new_tokens` long (stop tokens are switched off: a depth that
  flipped one late argmax would otherwise change the amount of work). tokens/s = generated
  tokens / wall seconds of `generate`, prefill included.
- Depth 0 is the stock engine (num_speculative_tokens=0). Every other column runs an engine
  with K = the deepest depth of the sweep: depth d >= 1 fixed = the fixed policy at depth d
  (`SpeculationPolicy(depth=d)`), "adaptive" = mtpjax.engine.depth.AdaptiveDepth, which may pick any
  depth 0..K each step. So all of them share one set of compiled programs (a depth-d step on
  a K-slot engine differs from one on a d-slot engine only in the size of the GDN pending
  buffer, (K+1) small per-token inputs): compiling, not running, is what a cold sweep spends
  its time on.
- No compiling inside a timed pass: each engine first runs the workload once untimed (its
  prefill and decode programs) and then `engine.warmup()` (every depth 0..K for every lane
  bucket, as an adaptive policy may switch to any of them; a fixed engine only ever runs
  its depth d, so it warms only that depth and its warm-up generate has usually compiled it
  already). Engines are built once per (lanes, depth) and reused by every pass; engines of
  equal shapes (every K-slot column: fixed depths >= 1 and adaptive) share their compiled
  programs through the jit caches.
- A noisy, shared machine: the passes interleave. For each L every depth runs its pass 1,
  then every depth its pass 2, in the reverse order, and so on; a cell reports the median
  tokens/s of its passes, and its ratio to depth 0 of the same L (so slow periods hit all
  columns alike rather than one).
- Each cell also reports what explains its speed: the tokens per verify step
  ((accepted drafts + verify steps) / verify steps, summed over the requests: 1 + the mean
  accepted drafts), the per-position conditional acceptance, and the histogram of the
  depths its decode steps ran (engine steps, not lane-steps; it sums to the step count). The
  adaptive policy keeps learning across passes (its warm-up run is its first lesson), so its
  cells measure the policy after one untimed run of the workload.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, Sequence

import numpy as np

from experiments import corpus

ADAPTIVE = "adaptive"
DEFAULT_LANES = (1, 2, 4, 8, 16)
DEFAULT_DEPTHS = (0, 1, 2, 3, 4, ADAPTIVE)


# --------------------------------------------------------------------------------------------
# Flag values
# --------------------------------------------------------------------------------------------

def _distinct(items: Sequence[str | int], flag: str, one: Callable[[str], int | str]) -> list:
    """A flag list parsed item by item (`one` raises on a bad item): distinct, in order."""
    out: list = []
    for it in items:
        v = one(str(it).strip())
        if v in out:
            raise ValueError(f"{flag}: {v} is listed twice")
        out.append(v)
    if not out:
        raise ValueError(f"{flag}: give at least one value")
    return out


def _lane(s: str) -> int:
    try:
        n = int(s)
    except ValueError:
        raise ValueError(f"--sweep_lanes: {s!r} is not an integer") from None
    if n < 1:
        raise ValueError(f"--sweep_lanes: lane counts must be >= 1, got {n}")
    return n


def _depth(s: str) -> int | str:
    if s.lower() == ADAPTIVE:
        return ADAPTIVE
    try:
        d = int(s)
    except ValueError:
        raise ValueError(f"--sweep_depths: unknown depth {s!r}; give integers >= 0 and/or "
                         f"'{ADAPTIVE}'") from None
    if d < 0:
        raise ValueError(f"--sweep_depths: depths must be >= 0, got {d}")
    return d


def parse_lanes(items: Sequence[str | int]) -> list[int]:
    """Lane counts from a flag list: positive, distinct integers, kept in the given order."""
    return _distinct(items, "--sweep_lanes", _lane)


def parse_depths(items: Sequence[str | int]) -> list[int | str]:
    """Depths from a flag list: integers >= 0 and the name 'adaptive', distinct.

    'adaptive' runs with K = the deepest integer depth listed, so it needs one >= 1.
    """
    out = _distinct(items, "--sweep_depths", _depth)
    if ADAPTIVE in out and adaptive_k(out) < 1:
        raise ValueError(f"--sweep_depths: '{ADAPTIVE}' takes K from the deepest integer depth "
                         f"listed, which must be >= 1 (got {out})")
    return out


def adaptive_k(depths: Sequence[int | str]) -> int:
    """K of the adaptive engine: the deepest fixed depth of the sweep (0 when none)."""
    return max((d for d in depths if d != ADAPTIVE), default=0)


def engine_k(depth: int | str, depths: Sequence[int | str]) -> int:
    """Draft slots of a cell's engine: 0 for the stock column, else the sweep's deepest depth."""
    return 0 if depth == 0 else adaptive_k(depths)


def label(depth: int | str) -> str:
    return ADAPTIVE if depth == ADAPTIVE else f"depth {depth}"


# --------------------------------------------------------------------------------------------
# Workload
# --------------------------------------------------------------------------------------------

def heldout_prompts(tokenizer, n: int, prompt_tokens: int, seed: int = 0,
                    heldout_percent: int = 5) -> list[list[int]]:
    """n prompts of `prompt_tokens` ids: windows of held-out text, so acceptance is realistic.

    The documents of corpus.py's held-out split (files the tiny checkpoint did not train on)
    are tokenized in their sorted order until n of them hold a prompt (tokenizing all of them
    takes seconds); prompt i is a window at a seeded random offset of document
    i mod (documents found), so consecutive prompts come from different files. The same
    (n, prompt_tokens, seed) gives the same prompts on every run, and the first m of them do
    not depend on n (a sweep's smaller lane counts serve a prefix of its prompts).
    tokenizer: a `tokenizers.Tokenizer` or `mtpjax.text.Tokenizer` (anything whose
    `encode(text)` returns ids or an object with `.ids`).
    """
    if n < 1 or prompt_tokens < 1:
        raise ValueError(f"need n >= 1 and prompt_tokens >= 1, got n={n}, "
                         f"prompt_tokens={prompt_tokens}")
    docs = []
    for text in corpus.iter_texts("heldout", heldout_percent):
        enc = tokenizer.encode(text)
        ids = list(getattr(enc, "ids", enc))
        if len(ids) >= prompt_tokens:
            docs.append(ids)
            if len(docs) == n:
                break
    if not docs:
        raise ValueError(f"no held-out document of {corpus.stdlib_root()} has {prompt_tokens} "
                         "tokens: cannot draw prompts")
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        ids = docs[i % len(docs)]
        start = int(rng.integers(0, len(ids) - prompt_tokens + 1))
        out.append([int(t) for t in ids[start:start + prompt_tokens]])
    return out


def max_seq_len_for(prompt_tokens: int, new_tokens: int) -> int:
    """Context limit of the sweep's engines: the request plus a little room."""
    return prompt_tokens + new_tokens + 8


# --------------------------------------------------------------------------------------------
# Measuring
# --------------------------------------------------------------------------------------------

def make_engine(cfg, params, lanes: int, depth: int | str, depths, max_seq_len: int,
                kernels: str | None, page_size: int = 16, lane_slots: int | None = None,
                clock: str = "wall", simulate_acceptance: str | None = None,
                clock_calibration: str | None = None, overlap: bool = True):
    """The cell's engine: depth 0 = the stock engine; depth d >= 1 = K = adaptive_k(depths)
    draft slots with the fixed policy at d; adaptive = K slots, adaptive policy. Stop tokens
    off (see top). lane_slots (default lanes): the device state's lane slots (the Engine's
    pool then covers all of them; the cell's own page budget is `lanes` lanes at full
    context), so every cell of one K shares its compiled programs (Engine.shape_key).
    clock "h200": the engine times itself on its own cost_model.VirtualClock
    (experiments/card.py make_clock; clock_calibration: its constants from a gpu_check
    calibration file). simulate_acceptance: a profile each verify step's
    acceptance is drawn from (mtpjax/simulated_acceptance.py; timing only). overlap: the
    engine's loop (False: the serial loop, for before/after comparisons)."""
    import mtpjax
    from experiments import card as card_lib
    from mtpjax.engine.scheduler import SpeculationPolicy
    k = engine_k(depth, depths)
    policy = (ADAPTIVE if depth == ADAPTIVE else
              SpeculationPolicy(depth=int(depth)) if k else "fixed")
    return mtpjax.Engine(cfg, params, num_speculative_tokens=k, max_lanes=lanes,
                         max_seq_len=max_seq_len, kernels=kernels, page_size=page_size,
                         eos_token_ids=(), speculation_policy=policy,
                         lane_slots=lanes if lane_slots is None else lane_slots,
                         clock=card_lib.make_clock(clock, k, weights=card_lib.clock_weights(params),
                                                   page_size=page_size,
                                                   calibration=clock_calibration),
                         simulate_acceptance=card_lib.simulator(simulate_acceptance) if k else None,
                         overlap=overlap)


def run_pass(engine, prompts, sampling) -> dict:
    """One timed generate of the workload: seconds on the engine's time (its clock's when it
    has one, else wall), tokens, and what the steps did."""
    from experiments import card as card_lib
    engine.reset_timing()
    t0 = card_lib.now(engine)
    outs = engine.generate(prompts, sampling)
    seconds = card_lib.now(engine) - t0
    bad = [o.error for o in outs if o.error]
    if bad:
        raise RuntimeError(f"{len(bad)} request(s) failed, first: {bad[0]}")
    st = engine.stats()
    k = engine.k
    acc_pos, tried_pos = [0] * k, [0] * k
    for o in outs:
        for j in range(k):
            acc_pos[j] += o.stats.accepted_per_position[j]
            tried_pos[j] += o.stats.tried_per_position[j]
    tokens = sum(len(o.token_ids) for o in outs)
    return {
        "seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds,
        "output_lengths": [len(o.token_ids) for o in outs],
        "steps": int(st["steps"]), "depth_steps": [int(x) for x in engine.depth_steps],
        "step_s": float(st["step_s"]), "prefill_s": float(st["prefill_s"]),
        "host_s": float(st["host_s"]), "host_work_s": float(st.get("host_work_s", 0.0)),
        "launches": int(st.get("launches", 0)), "overlapped": int(st.get("overlapped", 0)),
        "lane_steps": sum(sum(o.stats.depth_steps) for o in outs),
        "verify_steps": sum(o.stats.verify_steps for o in outs),
        "accepted_tokens": sum(o.stats.accepted_tokens for o in outs),
        "accepted_per_position": acc_pos, "tried_per_position": tried_pos,
        "token_ids": [list(o.token_ids) for o in outs],   # dropped from the JSON by the caller
    }


def warm(engine, prompts, sampling, depth) -> dict:
    """Compile everything the timed passes may run: one untimed generate of the workload,
    then engine.warmup() (every depth for adaptive; its depth only for a fixed engine)."""
    t0 = time.perf_counter()
    run_pass(engine, prompts, sampling)
    t1 = time.perf_counter()
    n = engine.warmup(None if depth == ADAPTIVE else [int(depth)])
    t2 = time.perf_counter()
    return {"generate_s": t1 - t0, "warmup_s": t2 - t1, "warmup_programs": n}


def summarize(lanes: int, depth, k: int, passes: list[dict], warmup: dict,
              base_ids: list[list[int]] | None, policy_report: dict | None) -> dict:
    """A cell: the median tokens/s over passes and the step statistics summed over them."""
    acc = sum(p["accepted_tokens"] for p in passes)
    ver = sum(p["verify_steps"] for p in passes)
    acc_pos = [sum(p["accepted_per_position"][j] for p in passes) for j in range(k)]
    tried_pos = [sum(p["tried_per_position"][j] for p in passes) for j in range(k)]
    hist = [sum(p["depth_steps"][d] for p in passes) for d in range(k + 1)]
    cell = {
        "lanes": lanes, "depth": depth, "label": label(depth), "num_speculative_tokens": k,
        "policy": ADAPTIVE if depth == ADAPTIVE else "fixed",
        "tokens_per_s": statistics.median(p["tokens_per_s"] for p in passes),
        "tokens_per_verify_step": (acc + ver) / ver if ver else None,
        "acceptance_per_position": [a / t if t else None for a, t in zip(acc_pos, tried_pos)],
        "depth_steps": hist, "steps": sum(p["steps"] for p in passes),
        "tokens": sum(p["tokens"] for p in passes),
        "verify_steps": ver, "accepted_tokens": acc,
        "lane_steps": sum(p["lane_steps"] for p in passes),
        "passes": [{k_: v for k_, v in p.items() if k_ != "token_ids"} for p in passes],
        "warmup": warmup,
    }
    if base_ids is not None:
        ids = passes[0]["token_ids"]
        cell["same_tokens_as_depth0"] = (sum(a == b for a, b in zip(ids, base_ids))
                                         / max(len(ids), 1))
    if policy_report is not None:
        cell["policy_report"] = policy_report
    return cell


def run_sweep(cfg, params, prompts: Sequence[Sequence[int]], *, lanes: Sequence[int],
              depths: Sequence[int | str], requests_per_lane: int, new_tokens: int,
              passes: int = 2, kernels: str | None = None, page_size: int = 16,
              log: Callable[[str], None] = print, clock: str = "wall",
              simulate_acceptance: str | None = None,
              clock_calibration: str | None = None) -> dict:
    """Every (lanes, depth) cell; see the module docstring. prompts: at least
    max(lanes) * requests_per_lane of them (lane count L serves the first L * requests_per_lane).

    Returns {"cells": [...], "settings": {...}}; cells hold the tokens/s median, the ratio to
    depth 0 of the same lane count (None when depth 0 is not swept) and the step statistics.
    """
    from mtpjax.sampling import SamplingParams
    lanes, depths = parse_lanes(lanes), parse_depths(depths)
    if requests_per_lane < 1 or new_tokens < 1 or passes < 1:
        raise ValueError(f"need requests_per_lane, new_tokens and passes >= 1, got "
                         f"{requests_per_lane}, {new_tokens}, {passes}")
    need = max(lanes) * requests_per_lane
    if len(prompts) < need:
        raise ValueError(f"{len(prompts)} prompts for up to {need} requests")
    if not cfg.has_mtp and any(d != 0 for d in depths):
        raise ValueError("depths other than 0 need a checkpoint with an MTP head")
    prompt_tokens = max(len(p) for p in prompts[:need])
    max_seq = max_seq_len_for(prompt_tokens, new_tokens)
    sampling = SamplingParams(temperature=0.0, max_new_tokens=new_tokens)
    cells = []
    t_start = time.perf_counter()
    for L in lanes:
        work = [list(p) for p in prompts[:L * requests_per_lane]]
        engines, warmups = {}, {}
        for d in depths:
            engines[d] = make_engine(cfg, params, L, d, depths, max_seq, kernels, page_size,
                                     lane_slots=max(lanes), clock=clock,
                                     simulate_acceptance=simulate_acceptance,
                                     clock_calibration=clock_calibration)
            warmups[d] = warm(engines[d], work, sampling, d)
            log(f"  lanes={L:<3d} {label(d):9s} compiled: warm-up generate "
                f"{warmups[d]['generate_s']:.1f} s, warmup() {warmups[d]['warmup_programs']} "
                f"programs {warmups[d]['warmup_s']:.1f} s")
        runs: dict = {d: [] for d in depths}
        for p in range(passes):
            order = list(depths) if p % 2 == 0 else list(reversed(depths))
            for d in order:
                r = run_pass(engines[d], work, sampling)
                runs[d].append(r)
                log(f"  lanes={L:<3d} {label(d):9s} pass {p + 1}: {r['tokens_per_s']:8.1f} "
                    f"tok/s ({r['tokens']} tokens, {r['seconds']:.2f} s, {r['steps']} steps, "
                    f"depths {r['depth_steps']})")
        base_ids = runs[0][0]["token_ids"] if 0 in runs else None
        row = []
        for d in depths:
            rep = engines[d].policy.report() if d == ADAPTIVE else None
            row.append(summarize(L, d, engines[d].k, runs[d], warmups[d],
                                 None if d == 0 else base_ids, rep))
        base = next((c["tokens_per_s"] for c in row if c["depth"] == 0), None)
        for c in row:
            c["ratio_vs_depth0"] = None if base is None else c["tokens_per_s"] / base
        cells.extend(row)
        del engines
        # the table so far: a long sweep can be followed (or stopped) row by row
        log(format_table({"settings": {"lanes": [c["lanes"] for c in cells[::len(depths)]],
                                       "depths": depths, "passes": passes,
                                       "adaptive_k": adaptive_k(depths)
                                       if ADAPTIVE in depths else None},
                          "cells": cells}).split("\n\n")[0])
    return {"settings": {"lanes": lanes, "depths": depths, "requests_per_lane": requests_per_lane,
                         "new_tokens": new_tokens, "prompt_tokens": prompt_tokens,
                         "max_seq_len": max_seq, "passes": passes, "page_size": page_size,
                         "adaptive_k": adaptive_k(depths) if ADAPTIVE in depths else None,
                         "temperature": 0.0, "stop_tokens": "off", "clock": clock},
            "cells": cells, "elapsed_s": time.perf_counter() - t_start}


# --------------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------------

def format_cell(c: dict) -> str:
    """'tok/s (ratio x) · tok/verify-step', + ' · steps at depth 0..K [..]' for adaptive."""
    ratio = "" if c.get("ratio_vs_depth0") is None else f" ({c['ratio_vs_depth0']:.2f}x)"
    tps = c["tokens_per_verify_step"]
    s = f"{c['tokens_per_s']:.1f}{ratio} · " + ("-" if tps is None else f"{tps:.2f}/step")
    if c["depth"] == ADAPTIVE:
        s += " · d" + "/".join(str(n) for n in c["depth_steps"])
    return s


def format_table(result: dict) -> str:
    """ONE markdown table: a row per lane count, a column per depth (see format_cell)."""
    depths = result["settings"]["depths"]
    by = {(c["lanes"], c["depth"]): c for c in result["cells"]}
    head = "| lanes | " + " | ".join(label(d) for d in depths) + " |"
    lines = [head, "|" + "---:|" * (len(depths) + 1)]
    for L in result["settings"]["lanes"]:
        lines.append(f"| {L} | " + " | ".join(format_cell(by[L, d]) for d in depths) + " |")
    s = result["settings"]
    k = s["adaptive_k"]
    lines += ["", "cell: generated tokens/s, median of "
              f"{s['passes']} pass(es) (ratio to depth 0 of the same row) · tokens per verify "
              "step (1 + mean accepted drafts; '-' when no step verified drafts)"
              + (f" · adaptive: decode steps at depth 0/1/.../{k}, all passes" if k else "")]
    return "\n".join(lines)
