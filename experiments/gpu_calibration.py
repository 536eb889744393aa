"""gpu_check's calibrate part: the H200 clock's three constants measured on the lent GPU, and the
calibration file the clock reads (`--clock_calibration=PATH`, mtpjax/cost_model.py
load_calibration).

The clock prices a program as max(bytes / bandwidth, FLOPs / throughput) + launch_s x kernels +
program_s. Each constant is measured so that this formula reproduces the measurement:

  1. hbm_bytes_per_s  one jitted program that reads a bf16 buffer of S bytes (a row sum in f32
     over rows of 8,192, the access pattern of a decode GEMV: every byte read once, almost
     nothing written), and the same over 2S bytes. bandwidth = S / (t(2S) - t(S)): the launch,
     the ramp-up and the host's dispatch cancel. S = 4 GiB on a GPU (25x the H200's 50 MB L2,
     so nothing is served from cache). A copy (x + 1: S read, S written, 2S moved) is measured
     the same way and reported beside it; the clock takes the read, since a decode step moves
     its weights one way.
  2. launch_s  two programs of N and 2N small dependent kernels XLA cannot fuse: an elementwise
     update of a 256-element f32 vector, each one behind a `lax.optimization_barrier`. Their
     kernels are counted in the compiled program's optimized HLO (experiments/hlo_audit.py,
     the counter of h200_kernel_counts.py), so launch_s = (t(2N) - t(N)) / (kernels(2N) -
     kernels(N)), whatever XLA made of the chain. Both programs are long enough (N = 256)
     that XLA replays them as command buffers (CUDA graphs) as it does a step program, under
     the same XLA flags: this is a kernel's cost inside a graph, its tiny run included.
  3. program_s  a one-kernel program (x + 1 on one float) called and waited for, one call at a
     time, as the engine does each step (it reads the step's tokens back): program_s = the
     median call - launch_s x its kernels. The same program dispatched back to back (each
     call on the previous call's result, one wait at the end) is reported beside it: the
     dispatch rate when nothing waits.

Each measurement runs in rounds; a round times both programs of a pair interleaved (so drift
hits both) and keeps each one's median; a round's constant is one sample. The constant's value
is the median of its rounds' samples; the samples go in the file, and the clock's fast / slow
bounds are their extremes, widened to at least +-10% (cost_model.CALIBRATED_MIN_SPREAD).

  4. steps  the 27B-shaped decode step (experiments/bench.py's decode program: synthetic bf16
     weights, paged KV, context --context_lens[0]) at 1, 8 and 32 lanes
     (--calibration_step_batches), timed by gpu_check's model part, each beside the cost
     model's prediction at the calibrated and at the published constants. The clock does not
     read these; they show how well the calibrated constants price a real step (bench's
     decode program is the step's target forward + lm_head + argmax, without the sampler).

The file (CALIBRATION_FORMAT) holds: device (kind, backend, jax, XLA flags, ...), date, smoke,
each constant as {value, unit, samples, how, and the raw medians it came from}, errors (a
constant that could not be measured, and why), steps, elapsed_s. `--smoke` runs the same code
at toy sizes (seconds on a CPU); its file says "smoke": true and the clock refuses it.
"""

from __future__ import annotations

import datetime
import gc
import statistics
import time
from functools import partial
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from mtpjax.cost_model import (CALIBRATED, CALIBRATED_MIN_SPREAD, CALIBRATION_FORMAT,
                               H200_CONSTANTS, CostModel)

ROW = 8192            # bandwidth: elements per summed row
CHAIN_ELEMS = 256     # launch cost: elements each chained kernel updates

# sizes and repeats; smoke: the same programs at toy size (a CPU in seconds)
SIZES = {
    False: dict(bw_bytes=4 << 30, bw_rounds=7, bw_per_round=3,
                chain_n=256, chain_elems=CHAIN_ELEMS, chain_rounds=10, chain_per_round=5,
                call_rounds=10, call_per_round=20, b2b_calls=200),
    # XLA:CPU drops the optimization barriers and fuses a chain into one loop, so on a CPU the
    # slope is the chain's arithmetic per link: 16k elements x 64 links stand above a loaded
    # CPU's jitter and stay below a call's cost. A smoke number is plumbing, not a constant.
    True: dict(bw_bytes=32 << 20, bw_rounds=5, bw_per_round=3,
               chain_n=64, chain_elems=1 << 14, chain_rounds=5, chain_per_round=5,
               call_rounds=3, call_per_round=10, b2b_calls=20),
}
UNITS = {"hbm_bytes_per_s": "bytes/s", "launch_s": "s per kernel", "program_s": "s per program"}


def log(*a):
    print(*a, flush=True)


# ------------------------------------------------------------------------------ programs

def read_program():
    """Sum each ROW-element row of a [rows, ROW] bf16 buffer in f32: every byte read once."""
    return jax.jit(lambda x: jnp.sum(x.astype(jnp.float32), axis=-1))


def copy_program():
    """x + 1 in bf16: every byte read once and written once."""
    return jax.jit(lambda x: x + jnp.asarray(1, x.dtype))


def chain_program(n: int):
    """n dependent elementwise kernels, an optimization barrier after each so that XLA cannot
    fuse them into one."""
    def chain(x):
        for i in range(n):
            x = lax.optimization_barrier(x * 1.0001 + 1e-3 * (i % 7))
        return x
    return jax.jit(chain)


def tiny_program():
    return jax.jit(lambda x: x + 1.0)


@partial(jax.jit, static_argnums=0)
def _pattern(rows: int):
    """A [rows, ROW] bf16 buffer of small integers (no RNG: 2^32 elements and more)."""
    r = lax.broadcasted_iota(jnp.int32, (rows, ROW), 0)
    c = lax.broadcasted_iota(jnp.int32, (rows, ROW), 1)
    return ((r * 7 + c) % 251).astype(jnp.bfloat16)


def _rows(nbytes: int) -> int:
    return nbytes // (2 * ROW)


def abstract_programs(smoke: bool) -> dict[str, tuple[Callable, tuple]]:
    """name -> (jitted program, abstract arguments): what the calibrate part compiles, for a
    deviceless compile (tests/test_gpu_check.py compiles them for the H200)."""
    s = SIZES[smoke]
    rows = _rows(s["bw_bytes"])
    bf = lambda n: jax.ShapeDtypeStruct((n, ROW), jnp.bfloat16)
    vec = jax.ShapeDtypeStruct((s["chain_elems"],), jnp.float32)
    return {"read_S": (read_program(), (bf(rows),)), "read_2S": (read_program(), (bf(2 * rows),)),
            "copy_S": (copy_program(), (bf(rows),)), "copy_2S": (copy_program(), (bf(2 * rows),)),
            "chain_N": (chain_program(s["chain_n"]), (vec,)),
            "chain_2N": (chain_program(2 * s["chain_n"]), (vec,)),
            "tiny": (tiny_program(), (jax.ShapeDtypeStruct((1,), jnp.float32),))}


def compile_counted(jitted, args) -> tuple[Callable, int | None, str]:
    """(the compiled program, the kernels it launches counted in its optimized HLO
    (hlo_audit.traffic, loop trips applied), how): the count is None, with why, when the text
    cannot be read. The compiled program is what gets timed: compiled once."""
    compiled = jitted.lower(*args).compile()
    try:
        from experiments.hlo_audit import traffic
        return compiled, int(traffic(compiled.as_text()).count()), "optimized HLO"
    except Exception as e:  # noqa: BLE001 - the caller falls back to the nominal count
        return compiled, None, f"not counted ({type(e).__name__}: {e})"


# ------------------------------------------------------------------------------ timing

def _seconds(fn, *args) -> float:
    t = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - t


def paired_rounds(a: Callable[[], float], b: Callable[[], float], rounds: int,
                  per_round: int) -> list[tuple[float, float]]:
    """(median of a, median of b) per round; each round calls a and b alternately, per_round
    times each, so drift during a round hits both. Each callable returns its seconds."""
    a(), b()                                          # compile and warm
    out = []
    for _ in range(rounds):
        ta, tb = [], []
        for _ in range(per_round):
            ta.append(a())
            tb.append(b())
        out.append((statistics.median(ta), statistics.median(tb)))
    return out


def _slope_samples(pairs, amount: float) -> tuple[list[float], list[float]]:
    """amount / (t_b - t_a) per round (a rate; a round whose difference is not positive is
    dropped), and the differences themselves."""
    diffs = [tb - ta for ta, tb in pairs]
    return [amount / d for d in diffs if d > 0], diffs


def _medians(pairs) -> dict:
    return {"a_median_s": statistics.median(p[0] for p in pairs),
            "b_median_s": statistics.median(p[1] for p in pairs)}


def measure_bandwidth(smoke: bool) -> dict:
    """hbm_bytes_per_s from the read pair (S and 2S bytes); the copy pair beside it."""
    s = SIZES[smoke]
    rows = _rows(s["bw_bytes"])
    S = rows * ROW * 2
    small, big = _pattern(rows), _pattern(2 * rows)
    jax.block_until_ready((small, big))
    read, copy = read_program(), copy_program()
    out = {}
    for name, prog, moved in (("read", read, S), ("copy", copy, 2 * S)):
        pairs = paired_rounds(lambda: _seconds(prog, small), lambda: _seconds(prog, big),
                              s["bw_rounds"], s["bw_per_round"])
        samples, diffs = _slope_samples(pairs, moved)
        med = _medians(pairs)
        out[name] = {"bytes_moved_S": moved, "bytes_moved_2S": 2 * moved,
                     "samples": samples, "dropped_rounds": len(diffs) - len(samples),
                     "value": statistics.median(samples) if samples else None,
                     "S_median_s": med["a_median_s"], "2S_median_s": med["b_median_s"],
                     # one program alone, its launch and ramp-up included
                     "single_program_bytes_per_s": 2 * moved / med["b_median_s"]}
        gc.collect()
    del small, big
    gc.collect()
    r = out["read"]
    if not r["samples"]:
        raise RuntimeError(f"no round read 2S slower than S (medians {r['S_median_s']:.3g} s, "
                           f"{r['2S_median_s']:.3g} s): no bandwidth")
    how = (f"a bf16 buffer read once (row sums, f32) at S = {S / 2**30:.3g} GiB and 2S: S / "
           f"(t(2S) - t(S)), median of {len(r['samples'])} rounds of {s['bw_per_round']} "
           f"interleaved calls each; a copy (x + 1, 2S moved) measured "
           f"{out['copy']['value'] or 0:.4g} B/s beside it")
    return {"value": r["value"], "samples": r["samples"], "how": how, "raw": out}


def measure_kernel_cost(smoke: bool) -> dict:
    """launch_s from chains of N and 2N unfusable kernels, counted in the compiled HLO."""
    s = SIZES[smoke]
    N = s["chain_n"]
    x = jnp.asarray(np.linspace(0.0, 1.0, s["chain_elems"], dtype=np.float32))
    pa, ka, how_a = compile_counted(chain_program(N), (x,))
    pb, kb, how_b = compile_counted(chain_program(2 * N), (x,))
    counted = ka is not None and kb is not None and kb > ka
    extra = (kb - ka) if counted else N
    pairs = paired_rounds(lambda: _seconds(pa, x), lambda: _seconds(pb, x),
                          s["chain_rounds"], s["chain_per_round"])
    diffs = [tb - ta for ta, tb in pairs]
    samples = [d / extra for d in diffs if d > 0]
    if not samples:
        raise RuntimeError(f"the {2 * N}-kernel chain did not run slower than the {N}-kernel "
                           f"one in any round (medians {_medians(pairs)}): no launch cost")
    if counted:
        kernels = f"{ka} and {kb} kernels in their optimized HLO"
    elif ka is None or kb is None:
        kernels = f"{N} and {2 * N} kernels assumed ({how_a if ka is None else how_b})"
    else:      # XLA:CPU: the barriers dropped, the chain fused
        kernels = (f"the optimized HLO shows {ka} and {kb} kernels, the chain fused: {N} and "
                   f"{2 * N} links assumed")
    how = (f"programs of {N} and {2 * N} dependent elementwise kernels on {s['chain_elems']} "
           f"f32 (an optimization barrier after each: XLA cannot fuse them; {kernels}): "
           f"(t(2N) - t(N)) / {extra} kernels, median of {len(samples)} rounds of "
           f"{s['chain_per_round']} interleaved calls each; inside a command buffer when XLA "
           "replays the program as one (its flags as the run's XLA_FLAGS)")
    return {"value": statistics.median(samples), "samples": samples, "how": how,
            "raw": {"n": N, "kernels_N": ka, "kernels_2N": kb, "counted": counted,
                    "kernels_per_step_of_chain": extra, "dropped_rounds": len(diffs) - len(samples),
                    "N_median_s": _medians(pairs)["a_median_s"],
                    "2N_median_s": _medians(pairs)["b_median_s"]}}


def measure_program_cost(smoke: bool, launch_s: float | None) -> dict:
    """program_s from a one-kernel program called and waited for one call at a time, less its
    kernels at launch_s (the clock's price of the same program); back-to-back beside it."""
    s = SIZES[smoke]
    x = jnp.zeros((1,), jnp.float32)
    prog, k, how_k = compile_counted(tiny_program(), (x,))
    k = k if k is not None else 1
    _seconds(prog, x), _seconds(prog, x)
    rounds = []
    for _ in range(s["call_rounds"]):
        rounds.append(statistics.median(_seconds(prog, x) for _ in range(s["call_per_round"])))
    b2b = []
    for _ in range(max(3, s["call_rounds"] // 2)):
        y = x
        t = time.perf_counter()
        for _ in range(s["b2b_calls"]):
            y = prog(y)
        jax.block_until_ready(y)
        b2b.append((time.perf_counter() - t) / s["b2b_calls"])
    less = (launch_s or 0.0) * k
    samples = [r - less for r in rounds if r - less > 0]
    if not samples:
        raise RuntimeError(f"a one-kernel call took {statistics.median(rounds):.3g} s, not "
                           f"more than its {k} kernel(s) at launch_s = {launch_s:.3g} s")
    how = (f"a {k}-kernel program (x + 1 on one f32) called and waited for, one call at a "
           f"time as the engine's steps are: the median call less {k} x launch_s "
           + ("(launch_s measured above)" if launch_s else "(launch_s not measured: 0)")
           + f", median of {len(samples)} rounds of {s['call_per_round']} calls; dispatched "
           f"back to back (no wait between calls) it took {statistics.median(b2b):.3g} s a call")
    return {"value": statistics.median(samples), "samples": samples, "how": how,
            "raw": {"kernels": k, "kernels_counted": how_k,
                    "call_median_s": statistics.median(rounds), "call_round_medians_s": rounds,
                    "back_to_back_per_call_s": statistics.median(b2b),
                    "back_to_back_samples_s": b2b}}


def run_calibrate(smoke: bool, deadline: float, log=log) -> dict:
    """The three constants, each in turn while the deadline allows; a measurement that fails
    or is not started in time goes to `errors` (name -> why) and the file lacks that constant
    (the clock then refuses the file, naming it)."""
    t0 = time.monotonic()
    constants, errors = {}, {}
    steps = (("hbm_bytes_per_s", lambda: measure_bandwidth(smoke)),
             ("launch_s", lambda: measure_kernel_cost(smoke)),
             ("program_s", lambda: measure_program_cost(
                 smoke, constants.get("launch_s", {}).get("value"))))
    for name, fn in steps:
        if time.monotonic() > deadline:
            errors[name] = "skipped (time budget)"
            log(f"[calibrate] {name}: skipped (time budget)")
            continue
        t = time.monotonic()
        try:
            c = fn()
            constants[name] = {"value": float(c["value"]), "unit": UNITS[name],
                               "samples": [float(x) for x in c["samples"]], "how": c["how"],
                               "raw": c["raw"], "seconds": time.monotonic() - t}
            pub = getattr(H200_CONSTANTS.mid, name)
            log(f"[calibrate] {name}: {c['value']:.4g} {UNITS[name]} (published mid {pub:.4g}; "
                f"{len(c['samples'])} samples {min(c['samples']):.4g}..{max(c['samples']):.4g}; "
                f"{time.monotonic() - t:.1f} s)")
        except Exception as e:  # noqa: BLE001 - record and go on with the next constant
            errors[name] = f"{type(e).__name__}: {e}"
            log(f"[calibrate] {name}: ERROR {errors[name]}")
        gc.collect()
    return {"constants": constants, "errors": errors, "elapsed_s": time.monotonic() - t0}


# ------------------------------------------------------------------------------ steps, file

def step_rows(cfg, results: list[dict], batches, context_len: int, *, weights: str,
              page_size: int, calibrated: dict) -> list[dict]:
    """The decode step at each of `batches` lanes (bench rows at `context_len`), beside the
    cost model's stock step, CostModel(K = 0).decode(0, B) (bench's decode program is the
    stock engine's: one token, one pending slot, no drafts; K = 0 has the kernel table's
    counts), at the calibrated constants (`calibrated`: name -> value; those measured) and at
    the published mid ones. A batch with no timed row is listed with why."""
    import dataclasses
    hw = dataclasses.replace(H200_CONSTANTS.mid, **calibrated)
    cal, pub = (CostModel(cfg=cfg, weights=weights, K=0, page_size=page_size, hw=h)
                for h in (hw, H200_CONSTANTS.mid))
    by_b = {r["batch"]: r for r in results
            if r.get("program") == "decode" and r.get("context_len") == context_len}
    rows = []
    for B in batches:
        r = by_b.get(B)
        row = {"program": "decode", "batch": B, "context_len": context_len,
               "layers": cfg.num_layers}
        if r is None or "median_s" not in r:
            rows.append({**row, "skipped": (r or {}).get("skipped", "not timed")})
            continue
        pc, pp = cal.decode(0, B, [context_len] * B), pub.decode(0, B, [context_len] * B)
        rows.append({**row, "median_s": r["median_s"], "min_s": r["min_s"],
                     "p90_s": r["p90_s"], "predicted_kernels": pc.kernels,
                     "predicted_bytes": pc.total_bytes,
                     "predicted_s": pc.seconds, "x_predicted": r["median_s"] / pc.seconds,
                     "predicted_s_published": pp.seconds,
                     "x_predicted_published": r["median_s"] / pp.seconds,
                     "calibrated_constants_used": sorted(calibrated)})
    return rows


def calibration_doc(device: dict, date: str, smoke: bool, cal: dict | None,
                    steps: dict | None, partial: bool) -> dict:
    """The calibration file's document (see the module docstring)."""
    cal = cal or {"constants": {}, "errors": {n: "the calibrate part did not run"
                                              for n in CALIBRATED}, "elapsed_s": 0.0}
    return {"format": CALIBRATION_FORMAT, "date": date, "device": device, "smoke": smoke,
            "partial": partial, "constants": cal["constants"], "errors": cal["errors"],
            "published_mid": {n: getattr(H200_CONSTANTS.mid, n) for n in CALIBRATED},
            "steps": steps or {"rows": [], "note": "the model part did not run"},
            "elapsed_s": cal["elapsed_s"],
            "reads_it": "python -m experiments judge --clock=h200 --clock_calibration=PATH "
                        "(also bench, speed, serve_bench, clock_check): the constants replace "
                        "the clock's mid set; fast / slow: the samples' extremes, at least "
                        f"{CALIBRATED_MIN_SPREAD:.0%} around it (mtpjax/cost_model.py "
                        "load_calibration)"}


def now_iso() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
