"""`python -m experiments gpu_check [--smoke] [--out=gpu_check.json] [--budget_s=420]`.

One command for a GPU session: compiled kernel tests, kernel timings against HBM bandwidth and
a full 27B-shaped decode / verify step against the weight floor. Parts run in this order, each
time-boxed inside `--budget_s` (default 420 s; a model program already compiling when the
budget runs out still finishes, so allow ~1 more minute — well under a 10-minute device call):

  1. pytest  `pytest tests/test_kernel_paged_attention.py tests/test_kernel_gated_delta.py
             -k Compiled` in a subprocess with MTPJAX_TEST_PLATFORM=gpu (tests/conftest.py
             otherwise pins the tests to CPU), BEFORE this process touches the GPU (JAX
             preallocates most of the GPU memory in whichever process starts first). Those
             files define their `...Compiled` subclasses only when the backend is gpu. The
             part passes only if the tests ran on a gpu backend, at least one compiled test
             ran, and none failed, errored or was skipped (read from a --junitxml report).
  2. kernels Triton kernels alone, at 27B shapes (fp8_matmul: the MLP gate_up in FP8 at
             T = 1 / 8 / 32; bytes = the FP8 weight + scales + x and y), each in one jitted program that calls the
             kernel L times on distinct buffers (L sized so that they exceed the 50 MB L2, so
             nothing is served from cache) and reports the median time per call:
               paged_attention  NQ=24, NKV=4, HD=256, page 16, 8k context, B 1/8, q_len 1/2;
                                bytes = the K and V pages read (B x 8k x 4 x 256 x 2 x 2 B)
               gated_delta_verify  H=48, DK=DV=128, B 1/8, T 1/2 (P = T pending, all
                                replayed); bytes = state read + write (2 x 3 MiB per lane)
                                + the token inputs
               chunk_gated_delta   H=48, DK=DV=128, B=1, T 64 / 1024 (prefill chunks); bytes =
                                q, k, v, g, beta read + o written + state read and write (it
                                may well be compute-bound: the floor is only a memory floor)
  3. model   `experiments.bench` on Qwen3.5-27B shapes with synthetic bf16 weights: all 64
             layers when they fit the device's memory (they do on an H200: 54.6 GB), else the
             largest multiple of 4 that does; decode, verify (k+1 tokens) and draft at
             B = 1 then 8, context 1024, KV in the engine's page pool (--kv=paged, so the
             paged-attention kernel runs inside the model; if that fails, the part is rerun
             with --kv=contiguous and says so in `kv_fallback`). Target: decode and verify
             at B = 1 within 1.15x of the weight floor (51.25 GB / --hbm_gbps = 10.68 ms on
             an H200).

The model part reuses bench's flags (--batch_sizes, --context_lens, --num_speculative_tokens,
--dtype, --kernels, --kv, --page_size, --iters, --hbm_gbps, --layers, --synthetic, --out) with
gpu_check's own defaults. `--smoke` makes everything tiny for a CPU CI job (< 2 min): pytest
only collects, kernels run in interpret mode at toy shapes, the model part is the random tiny
config with interpret kernels and the paged pool. Explicit flags win over the smoke defaults.

Needs a CUDA-enabled jaxlib on the GPU machine (the project venv here is CPU-only). On an H200
expect roughly: pytest 1-2.5 min, kernels < 1 min, model 2-4 min (synthetic init ~15 s, then a
compile of tens of seconds per program); everything is cut off by the budget above.

Writes `--out` and prints a summary table; the last stdout line is the JSON document. `ok` is
true, and the exit status 0, only when nothing failed, fell back or was skipped: `failures`
lists every reason otherwise (failing, skipped or no compiled tests, tests not on a GPU, the
pytest time-out, a kernel or model error, a kernel or model entry skipped for the time budget,
paged attention failing and the model part falling back to contiguous KV, no GPU backend).
"""

from __future__ import annotations

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
from experiments.gpu_check_report import failures, parse_junit, pytest_problems  # noqa: F401

FLAGS = flags.FLAGS
FLAGS.set_default("out", "gpu_check.json")
FLAGS.set_default("synthetic", "27b")
FLAGS.set_default("batch_sizes", ["1", "8"])
FLAGS.set_default("context_lens", ["1024"])
FLAGS.set_default("kv", "paged")   # the engine's storage: exercises paged attention in the model
flags.DEFINE_boolean("smoke", False, "tiny shapes, interpret kernels, few iters (CPU CI)")
flags.DEFINE_float("budget_s", 420.0, "wall-clock budget for all parts together")
flags.DEFINE_float("pytest_timeout_s", 150.0, "time-out of the pytest part")
flags.DEFINE_float("kernels_budget_s", 90.0, "time box of the kernel-timing part")
flags.DEFINE_string("pytest_k", "Compiled", "pytest -k expression (the compiled subclasses)")
flags.DEFINE_list("parts", ["pytest", "kernels", "model"], "parts to run")
flags.DEFINE_float("weight_floor_target", 1.15, "decode/verify at B=1 must be within this "
                   "factor of the weight floor")

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
                  "kernels": "interpret", "dtype": "float32", "iters": 2}

# (name, shapes) of the kernel part; the smoke shapes keep every code path, at toy size.
KERNEL_SHAPES = {
    False: {"paged": dict(nq=24, nkv=4, hd=256, page=16, ctx=8192, batches=(1, 8), q_lens=(1, 2),
                          dtype="bfloat16"),
            "verify": dict(h=48, dk=128, dv=128, batches=(1, 8), ts=(1, 2)),
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
                deadline: float) -> list[dict]:
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
            rows.append(r)
            log(f"[kernels] {name}: {r['median_s'] * 1e6:.1f} us/call, "
                f"{r['achieved_gbps']:.0f} GB/s, x{r['x_floor']:.2f} of floor "
                f"({r['calls_per_program']} calls/program, first call {r['first_call_s']:.1f} s)")
        except Exception as e:  # noqa: BLE001 - record and go on with the other kernels
            rows.append({"kernel": name, "error": f"{type(e).__name__}: {e}"})
            log(f"[kernels] {name}: ERROR {type(e).__name__}: {e}")
        gc.collect()
    return rows


# --------------------------------------------------------------------------------------------
# 3. model
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


def run_model(smoke: bool, deadline: float) -> dict:
    dtype = bench.resolve_dtype(FLAGS.dtype)
    kernels = bench.resolve_kernels(FLAGS.kernels)
    batch_sizes = [int(x) for x in FLAGS.batch_sizes]
    context_lens = [int(x) for x in FLAGS.context_lens]
    layers, mem = FLAGS.layers, {}
    if FLAGS.synthetic == "27b":
        layers, mem = fit_layers(qwen3_5_27b(), dtype, max(batch_sizes), FLAGS.layers)
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
    targets = []
    for r in res["results"]:
        if r.get("batch") == 1 and r["program"] in ("decode", "verify") and "median_s" in r:
            targets.append({"program": r["program"], "batch": 1, "context_len": r["context_len"],
                            "median_s": r["median_s"], "weight_floor_s": r["weight_floor_s"],
                            "x_weight_floor": r["x_weight_floor"],
                            "target": FLAGS.weight_floor_target,
                            "met": r["x_weight_floor"] <= FLAGS.weight_floor_target})
    wbytes = bench.target_weight_bytes(params)
    del params
    gc.collect()
    return {**desc, "config": bench.config_summary(cfg), "dtype": dtype, "kernels": kernels,
            "num_speculative_tokens": k, "kv": kv, "kv_fallback": fallback, "memory": mem,
            "target_weight_bytes": wbytes, **res,
            "weight_floor_targets": targets}


# --------------------------------------------------------------------------------------------
# Summary and main
# --------------------------------------------------------------------------------------------

def summary_table(doc: dict) -> str:
    lab = "" if doc["roofline_applies"] else "  [roofline of an H200; not this device]"
    out = [f"gpu_check summary ({doc['device'].get('device_kind')}, smoke={doc['smoke']}, "
           f"{doc['elapsed_s']:.0f} s){lab}"]
    p = doc.get("pytest")
    if p:
        out.append(f"pytest   {p['mode']:12s} {'ok' if p['passed'] else 'FAILED':6s} "
                   f"{p['summary']}")
    head = f"{'kernel':20s} {'shape':34s} {'us/call':>10s} {'GB/s':>8s} {'x floor':>8s}"
    rows = doc.get("kernels") or []
    if rows:
        out += [head, "-" * len(head)]
    for r in rows:
        if "median_s" not in r:
            out.append(f"{r['kernel']:55s} {r.get('skipped') or r.get('error')}")
            continue
        if r["kernel"] == "paged_attention":
            shape = f"B={r['batch']} q={r['q_len']} ctx={r['context_len']}"
        elif r["kernel"] == "gated_delta_verify":
            shape = f"B={r['batch']} T={r['tokens']} H={r['heads']}"
        elif r["kernel"] == "fp8_matmul":
            shape = f"T={r['tokens']} O={r['out']} I={r['inp']} fp8"
        else:
            shape = f"B={r['batch']} T={r['tokens']} H={r['heads']} chunk={r['chunk_size']}"
        out.append(f"{r['kernel']:20s} {shape:34s} {r['median_s'] * 1e6:10.1f} "
                   f"{r['achieved_gbps']:8.3g} {r['x_floor']:8.3g}")
    m = doc.get("model")
    if m and "results" in m:
        out.append(f"model: {m.get('name')} {m.get('layers')} layers, {m['dtype']}, "
                   f"kernels={m['kernels']}, kv={m['kv']}"
                   + (f"  ({m['kv_fallback']})" if m.get("kv_fallback") else ""))
        out.append(bench.format_table(m["results"], doc["device"]["backend"]))
        na = "" if doc["roofline_applies"] else "  [n/a: not a GPU]"
        for t in m["weight_floor_targets"]:
            out.append(f"target {t['program']} B=1: {t['median_s'] * 1e3:.3g} ms = "
                       f"x{t['x_weight_floor']:.3f} of the weight floor "
                       f"{t['weight_floor_s'] * 1e3:.3g} ms (target x{t['target']}) -> "
                       f"{'MET' if t['met'] else 'NOT MET'}{na}")
    elif m:
        out.append(f"model: ERROR {m.get('error')}")
    return "\n".join(out)


def main(argv):
    del argv
    t0 = time.monotonic()
    deadline = t0 + FLAGS.budget_s
    smoke = FLAGS.smoke
    if smoke:
        _apply_smoke_defaults()
    parts = list(FLAGS.parts)
    doc = {"command": bench.command_line(),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "smoke": smoke, "budget_s": FLAGS.budget_s, "parts": parts}
    failed = []

    if "pytest" in parts:   # first: before this process initialises (and fills) the GPU
        doc["pytest"] = run_pytest(smoke, min(FLAGS.pytest_timeout_s, deadline - time.monotonic()),
                                   FLAGS.pytest_k)
        if not doc["pytest"]["passed"]:
            failed.append("pytest")

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
        doc["kernels"] = run_kernels(smoke, interpret, FLAGS.iters, FLAGS.hbm_gbps, kdeadline)
        if any("error" in r or "skipped" in r for r in doc["kernels"]):
            failed.append("kernels")

    if "model" in parts:
        try:
            doc["model"] = run_model(smoke, deadline)
        except Exception as e:  # noqa: BLE001 - keep the other parts' results
            traceback.print_exc()
            doc["model"] = {"error": f"{type(e).__name__}: {e}"}
            failed.append("model")
        m = doc["model"]
        if "model" not in failed and (m.get("kv_fallback") or
                                      any("skipped" in r for r in m.get("results", []))):
            failed.append("model")

    doc["elapsed_s"] = time.monotonic() - t0
    doc["failed_parts"] = failed
    doc["failures"] = failures(doc)
    doc["ok"] = not failed and not doc["failures"]
    log(summary_table(doc))
    for why in doc["failures"]:
        log(f"NOT OK: {why}")
    bench.write_json(FLAGS.out, doc)
    if FLAGS.out:
        log(f"wrote {FLAGS.out}")
    print(json.dumps(doc), flush=True)
    return 0 if doc["ok"] else 1
