"""`python -m experiments gpu_check [--smoke] [--out=gpu_check.json] [--budget_s=480]
[--calibration_out=PATH]`.

One command for a GPU session: compiled kernel tests, kernel timings against HBM bandwidth,
the H200 clock's constants measured (a calibration file the clock reads), the tiny
checkpoint's engine on the GPU against the CPU reference engine, and a full 27B-shaped decode
/ verify / draft step against the weight floor and the cost model. Parts run in this order,
each time-boxed inside `--budget_s` (default 480 s; a model program already compiling when the
budget runs out still finishes, so allow ~1 more minute):

  1. pytest  `pytest tests/test_kernel_paged_attention.py tests/test_kernel_gated_delta.py
             tests/test_kernel_fp8_matmul.py -k Compiled` in a subprocess with
             MTPJAX_TEST_PLATFORM=gpu (tests/conftest.py otherwise pins the tests to CPU),
             BEFORE this process touches the GPU (JAX preallocates most of the GPU memory in
             whichever process starts first). Those files define their `...Compiled`
             subclasses only when the backend is gpu. The part passes only if the tests ran on
             a gpu backend, at least one compiled test ran, and none failed, errored or was
             skipped (read from a --junitxml report). Time-out --pytest_timeout_s (150 s).
  2. kernels Triton kernels alone, at 27B shapes, each in one jitted program that calls the
             kernel L times on distinct buffers (L sized so that they exceed the 50 MB L2, so
             nothing is served from cache); the median time per call. Box --kernels_budget_s.
               paged_attention  NQ=24, NKV=4, HD=256, page 16, 8k context, B 1/8, q_len 1/2;
                                bytes = the K and V pages read (B x 8k x 4 x 256 x 2 x 2 B)
               gated_delta_verify  H=48, DK=DV=128, B 1/8/32, T 1/2 (P = T pending, all
                                replayed); bytes = state read + write (2 x 3 MiB per lane)
                                + the token inputs
               chunk_gated_delta   H=48, DK=DV=128, B=1, T 64 / 1024 (prefill chunks); bytes =
                                q, k, v, g, beta read + o written + state read and write (it
                                may well be compute-bound: the floor is only a memory floor)
               fp8_matmul       the MLP gate_up in FP8 at T = 1 / 8 / 32; bytes = the FP8
                                weight + scales + x and y
             Target (--kernel_floor_target, 1.5): a memory-bound kernel (all but
             chunk_gated_delta) within 1.5x of its floor at 4.8 TB/s, i.e. >= 3.2 TB/s, about
             3/4 of the ~4.3 TB/s a device-to-device copy reaches on these H200s; only at
             shapes whose floor is >= 20 us (--kernel_target_min_floor_us: paged attention at
             B=8, verify at B=32, every fp8_matmul), below that launch and ramp-up dominate.
  3. calibrate  the clock's constants (experiments/gpu_calibration.py has the how): HBM
             bandwidth (a 4 GiB and an 8 GiB bf16 read, the slope), the cost of one kernel
             inside a graph (programs of 256 and 512 unfusable dependent kernels, counted in
             their optimized HLO, the slope), the cost of a program (a one-kernel program
             called and waited for, less its kernel); each in rounds, the median and the
             per-round samples. Box --calibrate_budget_s (60 s; ~10-20 s expected on an
             H200). Then the model part also times the decode step at
             --calibration_step_batches (1, 8, 32) lanes (32 after everything else, with its
             own compile) and lists each beside the cost model at the calibrated and the
             published constants. Writes --calibration_out (default
             gpu_check_calibration.json beside --out) after this part ("partial": true) and
             again at the end with the step times; `--clock_calibration=PATH` on the judge,
             bench, speed, serve_bench and clock_check reads it (mtpjax/cost_model.py
             load_calibration). A constant not measured (an error, or the box ran out) is a
             failure of the part, and the clock refuses the file naming it.
  4. engine  the bundled tiny checkpoint (--engine_checkpoint) end to end through
             `Engine.generate`: 4 short prompts x 32 greedy tokens, speculative at fixed depth
             K = 4 (--engine_k, the judge's default). The reference engine (kernels=reference,
             float32) runs on the CPU device (built and run under jax.default_device(cpu); the
             part checks where its params and cache live); the engine under test runs the
             Pallas kernels on the GPU in float32 and bfloat16 (--engine_dtypes). float32 must
             give the reference's tokens exactly (a failure otherwise: the kernels, the
             programs or the GPU's numerics break lossless speculation); bfloat16 reports its
             agreement (the judge's greedy_agreement: common prefix / reference length, mean
             over prompts, and the first diverging token per prompt), not gated. float32
             engines run under jax.default_matmul_precision("float32"): a GPU's default for
             float32 dots is TF32, which alone could change a greedy token. Box
             --engine_budget_s (120 s); a dtype not started in it is skipped (not ok), and
             a run without a float32 engine compared is not ok.
  5. model   `experiments.bench` on Qwen3.5-27B shapes with synthetic bf16 weights: all 64
             layers when they fit the device's memory (they do on an H200: 54.6 GB), else the
             largest multiple of 4 that does; decode, verify (k+1 tokens) and draft at
             B = 1 then 8, context 1024, KV in the engine's page pool (--kv=paged, so the
             paged-attention kernel runs inside the model; if that fails, the part is rerun
             with --kv=contiguous and says so in `kv_fallback`). Target: decode and verify
             at B = 1 within 1.15x of the weight floor (51.25 GB / --hbm_gbps = 10.68 ms on
             an H200). Next to each timed step, the cost model's H200 prediction
             (mtpjax/cost_model.py) and measured / predicted: decode against
             CostModel.decode(0), draft against CostModel.draft, and the depth-k step
             (bench's verify + k x draft) against CostModel.decode(k); reported, not gated.

A calibration alone, in a short window: `--parts=calibrate,model --programs=decode` (the
three constants, then the decode step at 1, 8, 32 lanes; ~3 min on an H200 by the estimates
above: one 27B init, three step compiles).

The model part reuses bench's flags (--batch_sizes, --context_lens, --num_speculative_tokens,
--dtype, --kernels, --kv, --page_size, --iters, --hbm_gbps, --layers, --synthetic, --out) with
gpu_check's own defaults. `--smoke` makes everything tiny for a CPU CI job: pytest only
collects, kernels run in interpret mode at toy shapes (every floor under 20 us: no kernel
target), the engine part compares the Pallas interpreter (float32 only, 16 tokens) with the
reference engine, the model part is the random tiny config with interpret kernels and the
paged pool, the calibrate part measures toy sizes (its file says "smoke": true, and the clock
refuses it) with steps at 1 and 2 lanes. On a CPU every floor target is "n/a" (the floors are
an H200's) and does not fail the run. Explicit flags win over the smoke defaults.

`ok` is true, and the exit status 0, only when nothing failed, fell back or was skipped, the
float32 engine matched the reference, and every kernel and step floor target was MET on the
GPU: `failures` lists every reason otherwise, with the numbers. The report is written to
`--out` after each part (with "partial": true), so a run cut off from outside keeps what it
finished; the last stdout line is the JSON document.

A 15-minute GPU window (the device tool: a machine's start, 1-4 min, and at most 600 s per
command, all counted). The machine's image has Python 3.12 and JAX 0.11.2 with the CUDA 13
plugin (this repo pins 0.10.2) and every package gpu_check and the kernel tests import (absl,
numpy, ml_dtypes, safetensors, tokenizers, orbax-checkpoint, tensorstore, pytest): nothing to
install, run the tree in place with its python3. Checked on the CPU for 0.11.2 (a Python 3.12
venv with jax/jaxlib 0.11.2): `gpu_check --smoke` passes, and the engine part's programs
(tiny checkpoint, kernels=pallas, float32 and bfloat16) lower for cuda through the Pallas
Triton backend, which 0.11 deprecates (a warning) but keeps; deviceless, 0.11 needs an
abstract "NVIDIA H200" device for that lowering, on the GPU it reads the real one. Name the
H200 (the floors are an H200's, --hbm_gbps=4800, and 64 layers need its memory); one call,
then give the machine back at once:

    run(kind="nvidia-h200", timeout_s=590, command=
        "set -o pipefail; export PYTHONPATH=$PWD PYTHONUNBUFFERED=1; nvidia-smi -L;
         timeout -k 10 560 python3 -m experiments gpu_check --budget_s=480
         --nocompilation_cache --out=$OUT/gpu_check.json 2>&1 | tee $OUT/gpu_check.log")

(the command on one line). $OUT/gpu_check.json comes back even when the command is cut off
(written after each part, "partial": true until the end). Expected on an H200: pytest 1-2.5
min; kernels < 1.5 min (box 90 s); calibrate 10-30 s (box 60 s: small compiles, ~2 s of
timed calls); engine 1-2 min (the CPU reference compiles 2 programs of
the 8-layer model, ~10 s each on 16 cores; each GPU dtype 2 programs with Triton kernels);
model the rest of the 480 s (27B synthetic init ~15 s, then a compile of tens of seconds per
step program; B = 1 first, so the two step targets come before B = 8; the calibration's
decode at B = 32 last: if the budget runs out first it is skipped, and the run is not ok,
but the calibration file keeps its constants and steps at 1 and 8). 480 s + one
overrunning compile (<= 60 s) + start-up stays inside 560 s; with the machine's start that is
<= 14 min. A part cut off by the budget is skipped and the run is not ok: rerun the rest in a
later window with --parts (e.g. --parts=model). On an H100 (the tool's default kind) add
--hbm_gbps=3350, or its floor targets are an H200's.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import traceback
from functools import partial

from absl import flags

from experiments import bench  # defines the shared flags
from experiments import gpu_calibration
from experiments.gpu_check_report import (engine_verdict, finish, floor_target, kernel_label,
                                          kernel_target, parse_junit, pytest_problems)

FLAGS = flags.FLAGS
FLAGS.set_default("out", "gpu_check.json")
FLAGS.set_default("synthetic", "27b")
FLAGS.set_default("batch_sizes", ["1", "8"])
FLAGS.set_default("context_lens", ["1024"])
FLAGS.set_default("kv", "paged")   # the engine's storage: exercises paged attention in the model
PARTS = ("pytest", "kernels", "calibrate", "engine", "model")
flags.DEFINE_boolean("smoke", False, "tiny shapes, interpret kernels, few iters (CPU CI)")
flags.DEFINE_float("budget_s", 480.0, "wall-clock budget for all parts together")
flags.DEFINE_float("pytest_timeout_s", 150.0, "time-out of the pytest part")
flags.DEFINE_float("kernels_budget_s", 90.0, "time box of the kernel-timing part")
flags.DEFINE_string("pytest_k", "Compiled", "pytest -k expression (the compiled subclasses)")
flags.DEFINE_list("parts", list(PARTS), "parts to run (any of: " + ", ".join(PARTS) + ")")
flags.DEFINE_float("weight_floor_target", 1.15, "decode/verify at B=1 must be within this "
                   "factor of the weight floor")
flags.DEFINE_float("kernel_floor_target", 1.5, "a memory-bound kernel (paged_attention, "
                   "gated_delta_verify, fp8_matmul) must be within this factor of its HBM floor "
                   "at --hbm_gbps, at every timed shape whose floor is at least "
                   "--kernel_target_min_floor_us")
flags.DEFINE_float("kernel_target_min_floor_us", 20.0, "shapes with a smaller floor are "
                   "launch-bound: reported, no target")
flags.DEFINE_string("engine_checkpoint", "checkpoints/tiny", "checkpoint of the engine part")
flags.DEFINE_list("engine_dtypes", ["float32", "bfloat16"], "engine part: dtypes of the GPU "
                  "engine (float32 must be greedy-equal to the CPU reference; the others are "
                  "reported)")
flags.DEFINE_integer("engine_k", 4, "engine part: draft slots K (the judge's default, "
                     "experiments/judge.py JudgeConfig.k), fixed depth K every step")
flags.DEFINE_integer("engine_max_new_tokens", 32, "engine part: greedy tokens per prompt")
flags.DEFINE_float("engine_budget_s", 120.0, "time box of the engine part")
flags.DEFINE_float("calibrate_budget_s", 60.0, "time box of the calibrate part's three "
                   "constants (its step times are the model part's)")
flags.DEFINE_string("calibration_out", None, "the calibration file the clock reads "
                    "(--clock_calibration); default: gpu_check_calibration.json beside --out")
flags.DEFINE_list("calibration_step_batches", ["1", "8", "32"], "calibrate: lanes of the "
                  "27B-shaped decode steps the model part times for the calibration file (at "
                  "--context_lens[0]; those not in --batch_sizes are timed after the rest)")

import jax  # noqa: E402  (after the flag defaults; importing jax does not touch the GPU)
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import pallas_kernels as pk  # noqa: E402
from mtpjax import quant  # noqa: E402
from mtpjax.config import qwen3_5_27b  # noqa: E402

KERNEL_TEST_FILES = ("tests/test_kernel_paged_attention.py", "tests/test_kernel_gated_delta.py",
                     "tests/test_kernel_fp8_matmul.py")
L2_DEFEAT_BYTES = 256 << 20   # > 5x the H200's 50 MB L2
MAX_CALLS = 64

SMOKE_DEFAULTS = {"synthetic": "tiny", "layers": 4, "batch_sizes": ["1"], "context_lens": ["32"],
                  "kernels": "interpret", "dtype": "float32", "iters": 2,
                  # one interpret engine (each costs ~20-40 s of CPU compile): bf16 is a
                  # reported-only number, and on a CPU it says nothing about the GPU's
                  "engine_dtypes": ["float32"], "engine_max_new_tokens": 16,
                  "calibration_step_batches": ["1", "2"]}

# (name, shapes) of the kernel part; the smoke shapes keep every code path, at toy size.
KERNEL_SHAPES = {
    False: {"paged": dict(nq=24, nkv=4, hd=256, page=16, ctx=8192, batches=(1, 8), q_lens=(1, 2),
                          dtype="bfloat16"),
            "verify": dict(h=48, dk=128, dv=128, batches=(1, 8, 32), ts=(1, 2)),
            "chunk": dict(h=48, dk=128, dv=128, batch=1, ts=(64, 1024), chunk=64),
            # the 27B MLP gate_up (the largest linear) in FP8, 128 x 128 blocks
            "fp8": dict(o=34816, i=5120, ts=(1, 8, 32), dtype="bfloat16")},
    True: {"paged": dict(nq=4, nkv=2, hd=32, page=16, ctx=40, batches=(2,), q_lens=(1, 2),
                         dtype="float32"),
           "verify": dict(h=4, dk=32, dv=32, batches=(2,), ts=(1, 2)),
           "chunk": dict(h=4, dk=32, dv=32, batch=1, ts=(32,), chunk=16),
           "fp8": dict(o=200, i=136, ts=(3,), dtype="float32")},
}


def log(*a):
    print(*a, flush=True)


def _apply_smoke_defaults():
    for name, value in SMOKE_DEFAULTS.items():
        if not FLAGS[name].present:
            FLAGS[name].value = value


# --------------------------------------------------------------------------------------------
# 1. pytest
# --------------------------------------------------------------------------------------------

def run_pytest(smoke: bool, timeout_s: float, pytest_k: str) -> dict:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs",
           *KERNEL_TEST_FILES]
    mode = "collect-only" if smoke else "compiled"
    cmd += ["--collect-only"] if smoke else ["-k", pytest_k]
    # The compiled subclasses exist only on a gpu backend; conftest pins tests to CPU unless
    # told otherwise, and stops the session if a GPU was asked for and is not there.
    env = dict(os.environ, MTPJAX_TEST_PLATFORM="cpu" if smoke else "gpu")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    log(f"[pytest] MTPJAX_TEST_PLATFORM={env['MTPJAX_TEST_PLATFORM']} {' '.join(cmd[1:])} "
        f"(timeout {timeout_s:.0f} s)")
    t = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        xml = os.path.join(tmp, "junit.xml")
        try:
            p = subprocess.run(cmd + [f"--junitxml={xml}"], cwd=root, env=env,
                               capture_output=True, text=True, timeout=max(timeout_s, 1.0))
            rc, text, timed_out = p.returncode, p.stdout + p.stderr, False
        except subprocess.TimeoutExpired as e:
            out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            rc, text, timed_out = None, out, True
        lines = [ln for ln in text.strip().splitlines() if ln.strip()]
        counts = parse_junit(xml) if os.path.exists(xml) else None
    summary = lines[-1] if lines else ""
    if smoke and rc == 0:   # -q --collect-only prints "path: count" per file
        per_file = [ln.rsplit(": ", 1) for ln in lines if ln.startswith("tests/") and ": " in ln]
        n = sum(int(c) for _, c in per_file if c.isdigit())
        counts = {**(counts or {}), "tests": n}
        summary = f"collected {n} tests in {len(per_file)} files"
    why = pytest_problems(rc, timed_out, counts, smoke)
    ok = not why
    res = {"mode": mode, "command": " ".join(cmd[1:]), "returncode": rc, "timed_out": timed_out,
           "summary": summary, "counts": counts, "passed": ok,
           "elapsed_s": time.monotonic() - t}
    if not ok:
        res["why"] = "; ".join(why)
        res["tail"] = "\n".join(lines[-40:])
    log(f"[pytest] {'ok' if ok else 'FAILED'}: {summary} ({res['elapsed_s']:.1f} s)"
        + ("" if ok else f" -- {res['why']}"))
    return res


# --------------------------------------------------------------------------------------------
# 2. kernels
# --------------------------------------------------------------------------------------------

def _n_calls(bytes_per_call: int, smoke: bool) -> int:
    if smoke:
        return 2
    return int(min(MAX_CALLS, max(2, math.ceil(L2_DEFEAT_BYTES / max(bytes_per_call, 1)))))


def _kernel_row(kernel, shape, calls, times, bytes_per_call, hbm_gbps, **extra):
    per_call = float(np.median(times)) / calls
    floor = bytes_per_call / (hbm_gbps * 1e9)
    return {"kernel": kernel, **shape, "calls_per_program": calls, "median_s": per_call,
            "min_s": float(np.min(times)) / calls, "bytes": bytes_per_call,
            "achieved_gbps": bytes_per_call / per_call / 1e9, "floor_s": floor,
            "bw_fraction": floor / per_call, "x_floor": per_call / floor, **extra}


def bench_paged_attention(b, q_len, s, interpret, iters, hbm_gbps, seed):
    nq, nkv, hd, page, ctx = s["nq"], s["nkv"], s["hd"], s["page"], s["ctx"]
    dt = jnp.dtype(s["dtype"])
    ppl = -(-ctx // page)
    read = b * ctx * nkv * hd * 2 * dt.itemsize                       # K and V pages
    io = 2 * b * q_len * nq * hd * dt.itemsize                        # q in, o out
    L = _n_calls(read, interpret)
    n_pages = L * b * ppl
    k_pages = _normal(seed, (nkv, n_pages, page, hd), dt)
    v_pages = _normal(seed + 1, (nkv, n_pages, page, hd), dt)
    perm = np.random.default_rng(seed + 2).permutation(n_pages).astype(np.int32)
    tables = jnp.asarray(perm.reshape(L, b, ppl))
    q = _normal(seed + 3, (b, q_len, nq, hd), dt)
    kv_lens = jnp.full((b,), ctx, jnp.int32)
    q_lens = jnp.full((b,), q_len, jnp.int32)

    @jax.jit
    def prog(q, k_pages, v_pages, tables, kv_lens, q_lens):
        return tuple(pk.paged_attention(q, k_pages, v_pages, tables[i], kv_lens, q_lens,
                                        sm_scale=hd ** -0.5, interpret=interpret)
                     for i in range(L))

    call = lambda c: (prog(q, k_pages, v_pages, tables, kv_lens, q_lens), c)
    first, times = bench.time_calls(call, None, iters)
    shape = dict(batch=b, q_len=q_len, context_len=ctx, nq=nq, nkv=nkv, head_dim=hd,
                 page_size=page, dtype=str(dt))
    return _kernel_row("paged_attention", shape, L, times, read + io, hbm_gbps,
                       kv_bytes=read, first_call_s=first)


@partial(jax.jit, static_argnames=("shape", "dtype", "scale"))
def _device_normal(key, *, shape, dtype, scale):
    return (scale * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


def _normal(seed: int, shape, dtype, scale: float = 1.0):
    """N(0, scale^2): numpy for small arrays (no compile on a CPU), the device for big ones."""
    if int(np.prod(shape)) <= 1 << 22:
        x = np.random.default_rng(seed).standard_normal(shape, np.float32) * scale
        return jnp.asarray(x, dtype)
    return _device_normal(jax.random.key(seed), shape=tuple(shape), dtype=str(jnp.dtype(dtype)),
                          scale=float(scale))


def _delta_inputs(seed, b, t, h, dk, dv):
    """q, k (unit-ish rows), v, g (log decay < 0), beta for a [B, T, H] block, float32."""
    q = _normal(seed, (b, t, h, dk), jnp.float32, dk ** -0.5)
    k = _normal(seed + 1, (b, t, h, dk), jnp.float32, dk ** -0.5)
    v = _normal(seed + 2, (b, t, h, dv), jnp.float32)
    g = jnp.full((b, t, h), -0.05, jnp.float32)
    beta = jnp.full((b, t, h), 0.5, jnp.float32)
    return q, k, v, g, beta


@partial(jax.jit, static_argnums=0)
def _zeros(shape):
    return jnp.zeros(shape, jnp.float32)


def bench_verify(b, t, s, interpret, iters, hbm_gbps, seed):
    h, dk, dv = s["h"], s["dk"], s["dv"]
    p = t                                         # pending slots = the block length (k + 1)
    state = b * h * dk * dv * 4
    tok = lambda n: b * n * h * (2 * dk + 2 * dv + 2) * 4   # q,k (new) / k,v + g,beta; o
    bytes_ = 2 * state + tok(p) + tok(t)
    L = _n_calls(bytes_, interpret)
    _, pk_, pv, pg, pb = _delta_inputs(seed, b, p, h, dk, dv)
    q, k, v, g, beta = _delta_inputs(seed + 10, b, t, h, dk, dv)
    n_pend = jnp.full((b,), p, jnp.int32)
    states = tuple(_zeros((b, h, dk, dv)) for _ in range(L))

    @partial(jax.jit, donate_argnames=("states",))
    def prog(states, pk_, pv, pg, pb, n_pend, q, k, v, g, beta):
        outs, new = [], []
        for st in states:
            o, st = pk.gated_delta_verify(st, pk_, pv, pg, pb, n_pend, q, k, v, g, beta,
                                          interpret=interpret)
            outs.append(o)
            new.append(st)
        return tuple(outs), tuple(new)

    call = lambda sts: prog(sts, pk_, pv, pg, pb, n_pend, q, k, v, g, beta)
    first, times = bench.time_calls(call, states, iters)
    shape = dict(batch=b, tokens=t, pending=p, heads=h, dk=dk, dv=dv)
    return _kernel_row("gated_delta_verify", shape, L, times, bytes_, hbm_gbps,
                       state_bytes_rw=2 * state, first_call_s=first)


def bench_chunk(t, s, interpret, iters, hbm_gbps, seed):
    h, dk, dv, b, chunk = s["h"], s["dk"], s["dv"], s["batch"], s["chunk"]
    state = b * h * dk * dv * 4
    bytes_ = 2 * state + b * t * h * (2 * dk + 2 * dv + 2) * 4
    L = _n_calls(bytes_, interpret)
    q, k, v, g, beta = _delta_inputs(seed, b, t, h, dk, dv)
    states = tuple(_zeros((b, h, dk, dv)) for _ in range(L))

    @partial(jax.jit, donate_argnames=("states",))
    def prog(states, q, k, v, g, beta):
        outs, new = [], []
        for st in states:
            o, st = pk.chunk_gated_delta(q, k, v, g, beta, st, chunk_size=chunk,
                                         interpret=interpret)
            outs.append(o)
            new.append(st)
        return tuple(outs), tuple(new)

    call = lambda sts: prog(sts, q, k, v, g, beta)
    first, times = bench.time_calls(call, states, iters)
    shape = dict(batch=b, tokens=t, heads=h, dk=dk, dv=dv, chunk_size=chunk)
    row = _kernel_row("chunk_gated_delta", shape, L, times, bytes_, hbm_gbps,
                      first_call_s=first, note="memory floor only; may be compute-bound")
    row["tokens_per_s"] = b * t / row["median_s"]
    return row


def bench_fp8_matmul(t, s, interpret, iters, hbm_gbps, seed):
    """pallas_kernels.fp8_matmul on [t, I] x FP8 [O, I] with 128 x 128 block scales; bytes =
    the FP8 weight + its scales + x in + y out (a decode GEMM is memory-bound)."""
    import ml_dtypes
    o, i = s["o"], s["i"]
    dt = jnp.dtype(s["dtype"])
    nbo, nbi = -(-o // 128), -(-i // 128)
    wbytes = o * i + nbo * nbi * 4
    L = _n_calls(wbytes, interpret)
    rng = np.random.default_rng(seed)
    qs = [jnp.asarray(rng.uniform(-448, 448, (o, i)).astype(ml_dtypes.float8_e4m3fn))
          for _ in range(min(L, 2))]
    qs = [jnp.copy(qs[n % len(qs)]) for n in range(L)]       # L distinct buffers (defeat L2)
    scale = jnp.full((nbo, nbi), 1e-3, jnp.float32)
    x = _normal(seed + 1, (t, i), dt)

    @jax.jit
    def prog(x, qs, scale):
        return tuple(pk.fp8_matmul(x, q, scale, (128, 128), interpret=interpret) for q in qs)

    call = lambda c: (prog(x, qs, scale), c)
    first, times = bench.time_calls(call, None, iters)
    io = t * i * dt.itemsize + t * o * dt.itemsize
    return _kernel_row("fp8_matmul", dict(tokens=t, out=o, inp=i, block=[128, 128],
                                          dtype=str(dt)),
                       L, times, wbytes + io, hbm_gbps, weight_bytes=wbytes,
                       first_call_s=first)


def run_kernels(smoke: bool, interpret: bool, iters: int, hbm_gbps: float,
                deadline: float, backend: str) -> list[dict]:
    """Time every kernel job; each row with a memory-floor target (kernel_target) gets it,
    evaluated only on a GPU (elsewhere the floor is an H200's: n/a)."""
    s = KERNEL_SHAPES[smoke]
    jobs = []
    for b in s["paged"]["batches"]:
        for ql in s["paged"]["q_lens"]:
            jobs.append((f"paged_attention B={b} q_len={ql} ctx={s['paged']['ctx']}",
                         partial(bench_paged_attention, b, ql, s["paged"])))
    for b in s["verify"]["batches"]:
        for t in s["verify"]["ts"]:
            jobs.append((f"gated_delta_verify B={b} T={t}", partial(bench_verify, b, t,
                                                                    s["verify"])))
    for t in s["chunk"]["ts"]:
        jobs.append((f"chunk_gated_delta B={s['chunk']['batch']} T={t}",
                     partial(bench_chunk, t, s["chunk"])))
    for t in s["fp8"]["ts"]:
        jobs.append((f"fp8_matmul T={t} O={s['fp8']['o']} I={s['fp8']['i']}",
                     partial(bench_fp8_matmul, t, s["fp8"])))
    rows = []
    for i, (name, fn) in enumerate(jobs):
        if time.monotonic() > deadline:
            rows.append({"kernel": name, "skipped": "time budget"})
            log(f"[kernels] {name}: skipped (time budget)")
            continue
        try:
            r = fn(interpret, iters, hbm_gbps, FLAGS.seed + 100 * i)
            target = kernel_target(r, FLAGS.kernel_floor_target,
                                   FLAGS.kernel_target_min_floor_us * 1e-6,
                                   applies=backend == "gpu" and not interpret, backend=backend)
            if target:
                r["target"] = target
            rows.append(r)
            log(f"[kernels] {name}: {r['median_s'] * 1e6:.1f} us/call, "
                f"{r['achieved_gbps']:.0f} GB/s, x{r['x_floor']:.2f} of floor "
                f"({r['calls_per_program']} calls/program, first call {r['first_call_s']:.1f} s)"
                + (f"; target x{target['target']}: {target['status']}" if target else ""))
        except Exception as e:  # noqa: BLE001 - record and go on with the other kernels
            rows.append({"kernel": name, "error": f"{type(e).__name__}: {e}"})
            log(f"[kernels] {name}: ERROR {type(e).__name__}: {e}")
        gc.collect()
    return rows


# --------------------------------------------------------------------------------------------
# 4. engine
# --------------------------------------------------------------------------------------------

# Short prompts of different kinds (code, prose); each fits one 16-token prefill chunk.
ENGINE_PROMPTS = ("def fibonacci(n):", "The capital of France is", "import numpy as np\n",
                  "Once upon a time")
ENGINE_CHUNK = 16


def engine_settings(prompts: list[list[int]], max_new_tokens: int) -> dict:
    """Engine kwargs that keep the program set small: one lane per prompt in one lane bucket,
    one prefill bucket, no prefix cache (its snapshot programs are not what is checked)."""
    n = len(prompts)
    return dict(max_lanes=n, lane_buckets=(n,), prefill_chunk=ENGINE_CHUNK,
                prefill_buckets=(ENGINE_CHUNK,), prefix_cache=False,
                max_seq_len=max(len(p) for p in prompts) + max_new_tokens + 1)


def matmul_precision(dtype: str):
    """float32 engines compute their dots in full float32 (the reference's numerics): a GPU's
    default for float32 dots is TF32 (10-bit mantissa), which would make the float32 engine
    differ from the CPU reference for a reason that is not the kernels'. The Pallas kernels set
    HIGHEST themselves in float32; this covers the model's own jnp dots."""
    return (jax.default_matmul_precision("float32") if dtype == "float32"
            else contextlib.nullcontext())


def engine_tokens(path: str, dtype: str, kernels: str, k: int, prompts: list[list[int]],
                  max_new_tokens: int) -> dict:
    """Greedy replies of an Engine (fixed depth k) built on the default device, with the
    platform its params and cache live on (a check that the reference really ran on the CPU
    and the candidate on the GPU)."""
    from mtpjax.engine import Engine
    from mtpjax.sampling import SamplingParams
    t = time.monotonic()
    with matmul_precision(dtype):
        eng = Engine.from_checkpoint(path, dtype, k, kernels=kernels,
                                     **engine_settings(prompts, max_new_tokens))
        outs = eng.generate(prompts, SamplingParams(max_new_tokens=max_new_tokens))
    bad = [o.error for o in outs if o.error]
    if bad:
        raise RuntimeError(f"a request failed: {bad[0]}")
    leaves = jax.tree.leaves(eng.params) + jax.tree.leaves(eng.cache)
    platforms = sorted({d.platform for x in leaves for d in x.devices()})
    return {"dtype": dtype, "kernels": kernels, "platform": ",".join(platforms),
            "device": str(jax.tree.leaves(eng.params)[0].devices().pop()),
            "matmul_precision": "float32" if dtype == "float32" else "default",
            "seconds": time.monotonic() - t, "depth_steps": list(eng.depth_steps),
            "tokens": [list(o.token_ids) for o in outs]}


def run_engine(smoke: bool, deadline: float) -> dict:
    """The tiny checkpoint end to end: the reference engine (kernels="reference", float32,
    params, cache and programs on the CPU device) against the engine under test (Pallas on the
    GPU; the Pallas interpreter in --smoke) in each --engine_dtypes, greedy, speculative at
    fixed depth K. float32 must give the reference's tokens exactly (gated); other dtypes
    report their agreement (tokens equal up to the first divergence, per prompt)."""
    from mtpjax.text import Tokenizer
    path, k, n_new = FLAGS.engine_checkpoint, FLAGS.engine_k, FLAGS.engine_max_new_tokens
    kernels = "interpret" if smoke else "pallas"
    dtypes = list(FLAGS.engine_dtypes)
    bad = [d for d in dtypes if d not in ("float32", "bfloat16")]
    if bad or not dtypes:
        raise ValueError(f"--engine_dtypes must list float32 and/or bfloat16, got {dtypes}")
    tok = Tokenizer.from_checkpoint(path)
    prompts = [tok.encode(t) for t in ENGINE_PROMPTS]
    doc = {"checkpoint": path, "k": k, "policy": "fixed", "max_new_tokens": n_new,
           "prompts": list(ENGINE_PROMPTS), "prompt_tokens": [len(p) for p in prompts],
           "expect_platforms": not smoke, "runs": []}
    log(f"[engine] {path}: reference (float32, kernels=reference) on the CPU, then "
        f"kernels={kernels} in {', '.join(dtypes)}; K={k}, {len(prompts)} prompts x {n_new} "
        "greedy tokens")
    with jax.default_device(jax.devices("cpu")[0]):
        doc["reference"] = engine_tokens(path, "float32", "reference", k, prompts, n_new)
    ref = doc["reference"]
    log(f"[engine] reference: {ref['seconds']:.1f} s on {ref['device']}, depth steps "
        f"{ref['depth_steps']}")
    for dtype in dtypes:
        run = {"dtype": dtype, "kernels": kernels, "gated": dtype == "float32"}
        if time.monotonic() > deadline:
            run["skipped"] = "time budget"
            log(f"[engine] {dtype} {kernels}: skipped (time budget)")
        else:
            try:
                run = engine_verdict(ref, {**run, **engine_tokens(path, dtype, kernels, k,
                                                                   prompts, n_new)})
                c = run["comparison"]
                log(f"[engine] {dtype} {kernels}: {run['seconds']:.1f} s on {run['device']}: "
                    f"tokens {run['verdict']}, agreement {c['agreement']:.3f}, first "
                    f"divergence per prompt {[p['first_divergence'] for p in c['per_prompt']]}")
            except Exception as e:  # noqa: BLE001 - record and go on with the next dtype
                traceback.print_exc()
                run["error"] = f"{type(e).__name__}: {e}"
                log(f"[engine] {dtype} {kernels}: ERROR {run['error']}")
        doc["runs"].append(run)
        gc.collect()
    return doc


# --------------------------------------------------------------------------------------------
# 5. model
# --------------------------------------------------------------------------------------------

def fit_layers(cfg_full, dtype: str, max_batch: int, requested: int | None) -> tuple[int, dict]:
    """Layers to build: `requested`, else all that fit the device memory (multiples of 4)."""
    from mtpjax.params import abstract_params
    if requested:
        return requested, {"requested": requested}
    stats = jax.devices()[0].memory_stats() or {}
    limit = stats.get("bytes_limit")
    if not limit:
        return cfg_full.num_layers, {"bytes_limit": None}
    free = limit - stats.get("bytes_in_use", 0)
    period = cfg_full.layer_period
    # per lane: GDN state 144 MiB x 2 (donation double-buffers at worst) + KV; plus workspace
    margin = 8e9 + max_batch * 2 * 0.3e9
    n = cfg_full.num_layers
    while n > period:
        need = bench.nbytes(abstract_params(bench.shrink_layers(cfg_full, n), dtype)) + margin
        if need <= free:
            break
        n -= period
    return n, {"bytes_limit": int(limit), "bytes_free": int(free), "layers_fit": n}


def predict_steps(cfg, results: list[dict], speculative: list[dict], k: int, weights: str,
                  page_size: int, comparable: bool) -> dict:
    """The cost model's H200 prediction (mtpjax/cost_model.py) next to each timed step of the
    model part, and measured / predicted. Every lane sits at position C, so each of the B
    lanes has C tokens cached.

    decode: CostModel.decode(0, B, C...), the depth-0 engine step (the stock step);
    draft:  CostModel.draft(B, C...), one chained MTP step;
    verify: bench times the target forward over k+1 tokens alone, a program the engine never
            launches on its own and the cost model does not price; the depth-k step it is
            part of is compared instead, as bench's estimate verify + k x draft against
            CostModel.decode(k, B, C...) (one row per B and C in `rows`).
    Writes predicted_s / x_predicted (None for verify) into `results` and returns the table."""
    from mtpjax.cost_model import CostModel
    cm = CostModel(cfg=cfg, weights=weights, K=k, page_size=page_size)
    rows = []
    for r in results:
        if "median_s" not in r:
            continue
        B, C = r["batch"], r["context_len"]
        if r["program"] == "verify":
            r["predicted_s"] = r["x_predicted"] = None
            r["prediction"] = f"none alone: see the depth-{k} step in cost_model.rows"
            continue
        cost = cm.decode(0, B, [C] * B) if r["program"] == "decode" else cm.draft(B, [C] * B)
        r["predicted_s"], r["x_predicted"] = cost.seconds, r["median_s"] / cost.seconds
        rows.append({"program": r["program"], "batch": B, "context_len": C,
                     "measured_s": r["median_s"], "predicted_s": cost.seconds,
                     "x_predicted": r["median_s"] / cost.seconds,
                     "predicted_bytes": cost.total_bytes,
                     "predicted_kernels": getattr(cost, "kernels", None)})
    for sp in speculative:
        B, C = sp["batch"], sp["context_len"]
        cost = cm.decode(k, B, [C] * B)
        rows.append({"program": f"step depth {k} (verify + {k} x draft)", "batch": B,
                     "context_len": C, "measured_s": sp["spec_step_estimate_s"],
                     "predicted_s": cost.seconds,
                     "x_predicted": sp["spec_step_estimate_s"] / cost.seconds,
                     "predicted_bytes": cost.total_bytes,
                     "predicted_kernels": getattr(cost, "kernels", None)})
    hw = {f: getattr(cm.hw, f, None) for f in ("name", "hbm_bytes_per_s", "bf16_flops_per_s",
                                                "launch_s", "program_s")}
    return {"hardware": hw.pop("name"), **hw, "weights": weights, "K": k,
            "layers": cfg.num_layers,
            "comparable": comparable,
            "note": ("measured on an H200-class GPU in bf16: the ratio tests the cost model"
                     if comparable else "the prediction is an H200's in bf16; this run is not "
                     "(device or dtype), so x_predicted is printed for format only"),
            "rows": rows}


def run_model(smoke: bool, deadline: float, backend: str,
              calibration: dict | None = None) -> dict:
    """The model part; calibration (the calibrate part's result, None when it did not run):
    the decode step is also timed at --calibration_step_batches lanes (those --batch_sizes
    lacks, after the rest) and `calibration_steps` lists them beside the cost model at the
    calibrated constants (gpu_calibration.step_rows)."""
    dtype = bench.resolve_dtype(FLAGS.dtype)
    kernels = bench.resolve_kernels(FLAGS.kernels)
    batch_sizes = [int(x) for x in FLAGS.batch_sizes]
    context_lens = [int(x) for x in FLAGS.context_lens]
    step_batches = ([int(x) for x in FLAGS.calibration_step_batches]
                    if calibration is not None else [])
    layers, mem = FLAGS.layers, {}
    if FLAGS.synthetic == "27b":
        layers, mem = fit_layers(qwen3_5_27b(), dtype, max(batch_sizes + step_batches),
                                 FLAGS.layers)
    log(f"[model] building {FLAGS.synthetic or FLAGS.checkpoint} ({layers} layers, {dtype})")
    cfg, params, desc = bench.build_model(FLAGS.checkpoint, FLAGS.synthetic, layers, dtype,
                                          FLAGS.seed, FLAGS.weights, FLAGS.mtp_weights)
    if quant.has_fp8(params):
        params = quant.set_impl(params, kernels)
    log(f"[model] {desc}")
    k = FLAGS.num_speculative_tokens
    # a 27B program compiles in tens of seconds: do not start one in the last minute
    guard = 0.0 if smoke else 60.0
    run = partial(bench.run_bench, cfg, params, programs=list(FLAGS.programs),
                  batch_sizes=batch_sizes, context_lens=context_lens, k=k, kernels=kernels,
                  iters=FLAGS.iters, hbm_gbps=FLAGS.hbm_gbps, seed=FLAGS.seed,
                  page_size=FLAGS.page_size, deadline=deadline - guard,
                  log=lambda m: log(f"[model]{m}"))
    kv, fallback = FLAGS.kv, None
    try:
        res = run(kv=kv)
    except Exception as e:  # noqa: BLE001 - one device session: still get the weight-floor data
        if kv != "paged":
            raise
        traceback.print_exc()
        fallback = f"kv=paged failed ({type(e).__name__}: {e}); reran with kv=contiguous"
        log(f"[model] {fallback}")
        kv = "contiguous"
        res = run(kv=kv)
    cal_steps = None
    if calibration is not None:
        cal_steps = calibration_steps(cfg, res, run, kv, step_batches, context_lens[0],
                                      calibration, "fp8" if quant.has_fp8(params) else "bf16")
    targets = []
    applies = backend == "gpu" and kernels != "interpret"
    for r in res["results"]:
        if r.get("batch") == 1 and r["program"] in ("decode", "verify") and "median_s" in r:
            targets.append({"program": r["program"], "batch": 1, "context_len": r["context_len"],
                            "median_s": r["median_s"], "weight_floor_s": r["weight_floor_s"],
                            "x_weight_floor": r["x_weight_floor"],
                            **floor_target(r["x_weight_floor"], FLAGS.weight_floor_target,
                                           applies, f"{kernels} kernels on {backend}")})
    weights = "fp8" if quant.has_fp8(params) else "bf16"
    try:
        predicted = predict_steps(cfg, res["results"], res["speculative"], k, weights,
                                  FLAGS.page_size, applies and dtype == "bfloat16")
    except Exception as e:  # noqa: BLE001 - the timings stand without the prediction
        traceback.print_exc()
        predicted = {"error": f"{type(e).__name__}: {e}"}
    wbytes = bench.target_weight_bytes(params)
    del params
    gc.collect()
    return {**desc, "config": bench.config_summary(cfg), "dtype": dtype, "kernels": kernels,
            "num_speculative_tokens": k, "kv": kv, "kv_fallback": fallback, "memory": mem,
            "target_weight_bytes": wbytes, **res,
            "weight_floor_targets": targets, "cost_model": predicted,
            **({"calibration_steps": cal_steps} if cal_steps is not None else {})}


def calibration_steps(cfg, res: dict, run, kv: str, batches: list[int], context_len: int,
                      calibration: dict, weights: str) -> dict:
    """The decode step at `batches` lanes for the calibration file: those the model part did
    not time at `context_len` are timed now (appended to res["results"], so a skip there is
    the model part's, as any other), then gpu_calibration.step_rows."""
    done = {r["batch"] for r in res["results"] if r["program"] == "decode"
            and r["context_len"] == context_len and "median_s" in r}
    extra = [b for b in batches if b not in done]
    error = None
    if extra:
        log(f"[model] calibration: decode at {extra} lanes, context {context_len}")
        try:
            res["results"] += run(kv=kv, programs=["decode"], batch_sizes=extra,
                                  context_lens=[context_len])["results"]
        except Exception as e:  # noqa: BLE001 - the rest of the model part stands
            traceback.print_exc()
            error = f"{type(e).__name__}: {e}"
    calibrated = {n: c["value"] for n, c in calibration["constants"].items()}
    rows = gpu_calibration.step_rows(cfg, res["results"], batches, context_len,
                                     weights=weights, page_size=FLAGS.page_size,
                                     calibrated=calibrated)
    out = {"rows": rows, "context_len": context_len, "kv": kv,
           "note": "bench's decode program (target forward + lm_head + argmax) beside "
                   "CostModel(K=0).decode(0, B) (the stock engine's step, which also samples) at "
                   "the calibrated constants (predicted_s) and the published ones "
                   "(predicted_s_published); not read by the clock"}
    if error:
        out["error"] = error
    return out


# --------------------------------------------------------------------------------------------
# Summary and main
# --------------------------------------------------------------------------------------------

def _engine_lines(e: dict) -> list[str]:
    if "error" in e:
        return [f"engine: ERROR {e['error']}"]
    ref = e.get("reference", {})
    out = [f"engine: {e['checkpoint']}, K={e['k']} fixed, {len(e['prompts'])} prompts x "
           f"{e['max_new_tokens']} greedy tokens; reference float32 kernels=reference on "
           f"{ref.get('device')} ({ref.get('seconds', 0):.1f} s)"]
    for r in e["runs"]:
        head = f"  {r['dtype']:9s} {r['kernels']:9s}"
        if "comparison" not in r:
            out.append(f"{head} {r.get('skipped') or r.get('error')}")
            continue
        c = r["comparison"]
        gate = "gated: must be equal" if r["gated"] else "reported, not gated"
        out.append(f"{head} on {r['device']}: agreement {c['agreement']:.3f}, first divergence "
                   f"per prompt {[p['first_divergence'] for p in c['per_prompt']]} -> "
                   f"{r['verdict']} ({gate}; {r['seconds']:.1f} s)")
    return out


def _cost_model_lines(cm: dict) -> list[str]:
    if "error" in cm:
        return [f"cost model: ERROR {cm['error']}"]
    out = [f"cost model ({cm['hardware']}, {cm['weights']} weights, {cm['layers']} layers): "
           f"measured / predicted" + ("" if cm["comparable"] else "  [n/a: " + cm["note"] + "]"),
           f"  {'step':32s} {'B':>3s} {'ctx':>6s} {'measured ms':>12s} {'predicted ms':>13s} "
           f"{'x pred':>7s}"]
    for r in cm["rows"]:
        out.append(f"  {r['program']:32s} {r['batch']:3d} {r['context_len']:6d} "
                   f"{r['measured_s'] * 1e3:12.3f} {r['predicted_s'] * 1e3:13.3f} "
                   f"{r['x_predicted']:7.2f}")
    return out


def _calibrate_lines(c: dict, steps: dict | None) -> list[str]:
    from mtpjax.cost_model import CALIBRATED, H200
    out = [f"calibrate -> {c.get('file')} ({c['elapsed_s']:.0f} s; the clock reads it with "
           f"--clock_calibration)"]
    for n in CALIBRATED:
        if n in c["errors"]:
            out.append(f"  {n:16s} {c['errors'][n]}")
            continue
        v = c["constants"][n]
        out.append(f"  {n:16s} {v['value']:.4g} {v['unit']} (published mid "
                   f"{getattr(H200, n):.4g}; {len(v['samples'])} rounds "
                   f"{min(v['samples']):.4g}..{max(v['samples']):.4g})")
    for r in (steps or {}).get("rows", []):
        head = f"  decode B={r['batch']:<3d} C={r['context_len']} ({r['layers']} layers)"
        if "median_s" not in r:
            out.append(f"{head}: skipped ({r['skipped']})")
            continue
        out.append(f"{head}: {r['median_s'] * 1e3:.3f} ms; predicted {r['predicted_s'] * 1e3:.3f}"
                   f" ms calibrated (x{r['x_predicted']:.2f}), "
                   f"{r['predicted_s_published'] * 1e3:.3f} ms published "
                   f"(x{r['x_predicted_published']:.2f})")
    if (steps or {}).get("error"):
        out.append(f"  steps: ERROR {steps['error']}")
    return out


def summary_table(doc: dict) -> str:
    lab = "" if doc["roofline_applies"] else "  [roofline of an H200; not this device]"
    out = [f"gpu_check summary ({doc['device'].get('device_kind')}, smoke={doc['smoke']}, "
           f"{doc['elapsed_s']:.0f} s){lab}"]
    p = doc.get("pytest")
    if p:
        out.append(f"pytest   {p['mode']:12s} {'ok' if p['passed'] else 'FAILED':6s} "
                   f"{p['summary']}")
    head = (f"{'kernel':55s} {'us/call':>10s} {'GB/s':>8s} {'x floor':>8s}  target")
    rows = doc.get("kernels") or []
    if rows:
        out += [head, "-" * len(head)]
    for r in rows:
        if "median_s" not in r:
            out.append(f"{r['kernel']:55s} {r.get('skipped') or r.get('error')}")
            continue
        t = r.get("target")
        tgt = f"x{t['target']}: {t['status']}" if t else "none (reported)"
        out.append(f"{kernel_label(r):55s} {r['median_s'] * 1e6:10.1f} "
                   f"{r['achieved_gbps']:8.3g} {r['x_floor']:8.3g}  {tgt}")
    if doc.get("calibrate"):
        out += _calibrate_lines(doc["calibrate"], (doc.get("model") or {}).get(
            "calibration_steps"))
    if doc.get("engine"):
        out += _engine_lines(doc["engine"])
    m = doc.get("model")
    if m and "results" in m:
        out.append(f"model: {m.get('name')} {m.get('layers')} layers, {m['dtype']}, "
                   f"kernels={m['kernels']}, kv={m['kv']}"
                   + (f"  ({m['kv_fallback']})" if m.get("kv_fallback") else ""))
        out.append(bench.format_table(m["results"], doc["device"]["backend"]))
        for t in m["weight_floor_targets"]:
            out.append(f"target {t['program']} B=1: {t['median_s'] * 1e3:.3g} ms = "
                       f"x{t['x_weight_floor']:.3f} of the weight floor "
                       f"{t['weight_floor_s'] * 1e3:.3g} ms (target x{t['target']}) -> "
                       f"{t['status']}")
        if m.get("cost_model"):
            out += _cost_model_lines(m["cost_model"])
    elif m:
        out.append(f"model: ERROR {m.get('error')}")
    return "\n".join(out)


def _write_partial(doc: dict, t0: float) -> None:
    """The report so far, after each part: a run killed by an outer time-out keeps its
    finished parts."""
    if FLAGS.out:
        bench.write_json(FLAGS.out, {**doc, "partial": True,
                                     "elapsed_s": time.monotonic() - t0})


def calibration_path() -> str:
    """--calibration_out, else gpu_check_calibration.json beside --out."""
    if FLAGS.calibration_out:
        return FLAGS.calibration_out
    return os.path.join(os.path.dirname(FLAGS.out or ""), "gpu_check_calibration.json")


def _write_calibration(doc: dict, partial: bool) -> None:
    """The calibration file (gpu_calibration.calibration_doc): after the calibrate part
    (partial, no step times yet) and at the end (with the model part's steps)."""
    m = doc.get("model") or {}
    steps = m.get("calibration_steps") or (
        {"rows": [], "note": f"the model part failed: {m['error']}"} if "error" in m else None)
    bench.write_json(doc["calibrate"]["file"], gpu_calibration.calibration_doc(
        doc["device"], doc["date"], doc["smoke"], doc["calibrate"], steps, partial))


def main(argv):
    del argv
    t0 = time.monotonic()
    deadline = t0 + FLAGS.budget_s
    smoke = FLAGS.smoke
    if smoke:
        _apply_smoke_defaults()
    parts = list(FLAGS.parts)
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        raise SystemExit(f"--parts: unknown {unknown}; choose from {', '.join(PARTS)}")
    doc = {"command": bench.command_line(),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "smoke": smoke, "budget_s": FLAGS.budget_s, "parts": parts}
    failed = []

    if "pytest" in parts:   # first: before this process initialises (and fills) the GPU
        doc["pytest"] = run_pytest(smoke, min(FLAGS.pytest_timeout_s, deadline - time.monotonic()),
                                   FLAGS.pytest_k)
        if not doc["pytest"]["passed"]:
            failed.append("pytest")
        _write_partial(doc, t0)

    info = bench.device_info()
    doc["device"] = info
    doc.update(bench.roofline_label(info["backend"], FLAGS.hbm_gbps))
    if info["backend"] != "gpu" and not smoke:
        doc["error"] = (f"backend is {info['backend']}: the full check needs a GPU; "
                        "run with --smoke for the CPU version")
        log(doc["error"])
        parts, failed = [], failed + ["backend"]

    if "kernels" in parts:
        interpret = smoke or FLAGS.kernels == "interpret" or info["backend"] != "gpu"
        kdeadline = min(deadline, time.monotonic() + FLAGS.kernels_budget_s)
        log(f"[kernels] {'interpret' if interpret else 'compiled'}, budget "
            f"{kdeadline - time.monotonic():.0f} s")
        doc["kernels"] = run_kernels(smoke, interpret, FLAGS.iters, FLAGS.hbm_gbps, kdeadline,
                                     info["backend"])
        if any("error" in r or "skipped" in r for r in doc["kernels"]):
            failed.append("kernels")
        _write_partial(doc, t0)

    if "calibrate" in parts:
        cdeadline = min(deadline, time.monotonic() + FLAGS.calibrate_budget_s)
        log(f"[calibrate] bandwidth, kernel and program cost; budget "
            f"{cdeadline - time.monotonic():.0f} s")
        doc["calibrate"] = gpu_calibration.run_calibrate(smoke, cdeadline, log)
        doc["calibrate"]["file"] = calibration_path()
        _write_calibration(doc, partial=True)
        _write_partial(doc, t0)

    if "engine" in parts:
        edeadline = min(deadline, time.monotonic() + FLAGS.engine_budget_s)
        try:
            doc["engine"] = run_engine(smoke, edeadline)
        except Exception as e:  # noqa: BLE001 - keep the other parts' results
            traceback.print_exc()
            doc["engine"] = {"error": f"{type(e).__name__}: {e}"}
        gc.collect()
        _write_partial(doc, t0)

    if "model" in parts:
        try:
            doc["model"] = run_model(smoke, deadline, info["backend"], doc.get("calibrate"))
        except Exception as e:  # noqa: BLE001 - keep the other parts' results
            traceback.print_exc()
            doc["model"] = {"error": f"{type(e).__name__}: {e}"}
            failed.append("model")
        m = doc["model"]
        if "model" not in failed and (m.get("kv_fallback") or
                                      any("skipped" in r for r in m.get("results", []))):
            failed.append("model")

    doc["elapsed_s"] = time.monotonic() - t0
    if "calibrate" in doc:
        _write_calibration(doc, partial=False)
    doc.update(finish(doc, failed, PARTS))   # failures, failed_parts, ok
    log(summary_table(doc))
    for why in doc["failures"]:
        log(f"NOT OK: {why}")
    bench.write_json(FLAGS.out, doc)
    if FLAGS.out:
        log(f"wrote {FLAGS.out}")
    print(json.dumps(doc), flush=True)
    return 0 if doc["ok"] else 1
