"""`python -m experiments bench [--batch_sizes=1,4,8] [--context_lens=64,256] [--synthetic=27b]`.

Microbenchmarks of the three step programs, each timed as ONE jitted XLA program written
directly over `mtpjax.model.forward` / `mtp_forward` with a contiguous `model.init_cache` (the
engine loop, sampling and host bookkeeping are left out on purpose; `--kv=paged` swaps in the
engine's page pool, `model.init_paged_cache` + a shuffled page table, so that attention runs
through the paged-attention kernel that `--kernels` selects):

  decode  forward over 1 token per lane, "step" mode, P = 1 pending slot, + lm_head + argmax
          (the stock engine, k = 0)
  verify  forward over k+1 tokens per lane, "step" mode, P = k+1, + lm_head + argmax
          (the target half of a speculative step)
  draft   mtp_forward over 1 token per lane + lm_head + argmax (one chained MTP step)

For every (program, batch B, context C):

  1. Build the model (a checkpoint, the random tiny config, or 27B-shaped synthetic weights)
     and a cache for B lanes of C + T slots; every lane sits at position C. Cache contents are
     zeros (the cost of these programs does not depend on values). n_pend = T: the previous
     block was fully accepted and is replayed, the steady state of each program.
  2. Call once (compile, reported as `first_call_s`) and twice more to warm up, then time
     `--iters` calls, each followed by `block_until_ready`; the cache is donated and fed back.
  3. Report the median seconds per step, tokens/s (tokens processed: B for decode and draft,
     B * (k+1) for verify) and the roofline: bytes a step must move

         weights read once (target: all text weights but the embedding table, lm_head
                             included; draft: MTP layer + lm_head) + the gathered embedding rows
       + KV read at context C + T, KV written for T tokens
       + GDN cache read + written (recurrent state f32, conv window, pending buffers)

     divided by `--hbm_gbps` (default 4800, an H200's HBM) gives `floor_s`; `bw_fraction` =
     floor_s / median_s. The floor is that of the H200 whatever device ran: on a CPU the
     fraction is printed and stored but labelled as not applicable (`roofline_applies`).

`speculative` in the JSON combines the three per (B, C): a speculative step costs about
verify + k * draft (the real step runs the MTP once over k+1 pairs and then k-1 chained steps),
and `break_even_tokens_per_step` = that / decode is the mean emitted tokens per step (accepted
+ 1) speculation needs to beat plain decoding.

`--sweep=lanes` measures something else: whole-engine generated tokens/s against lanes
(`--sweep_lanes`, default 1,2,4,8,16) for fixed draft depths and the adaptive depth policy
(`--sweep_depths`, default 0,1,2,3,4,adaptive), greedy requests on held-out text, as ONE
markdown table with ratios to depth 0, tokens per verify step and the adaptive depth histogram
(experiments/depth_sweep.py says how and why); `--out` defaults to runs/depth_sweep.json there.

`--clock=h200`: nothing is timed. The step programs above are not the engine's programs (a
speculative step is one program, `steps.decode_step` at depth d), so instead of timing them
the bench prices, for every (B, C), the programs the engine launches as mtpjax/cost_model.py
predicts them for Qwen3.5-27B on one H200 (`--weights=fp8`: FP8 linears; `--tp`): the decode
step at every depth 0..k, one chained draft, and a prefill chunk of C tokens, with the bytes
by term, FLOPs, kernels and seconds of each; `--checkpoint` / `--synthetic` do not matter
there. `--sweep=lanes --clock=h200` runs the sweep's engines here, each on its own clock
(real tokens, acceptance and adaptive depths; tokens/s as the cost model prices the 27B on an
H200). `--sweep=prefix` is not on the clock yet and refuses `--clock=h200`.
`--clock_calibration=PATH` (with `--clock=h200`, any sweep or none): the clock's constants
from a gpu_check calibration file instead of the published ones (mtpjax/cost_model.py
load_calibration); every report says which.

`--sweep=ttft --clock=h200`: time to first token against prompt length (`--ttft_prompts`,
default 512, 2048, 4096 tokens). One engine (`--checkpoint`, one lane, no prefix cache,
`--prefill_chunk` tokens per iteration, default 512, K = `--num_speculative_tokens`) serves
one request per length, alone; each request's TTFT is the clock's time from submit to its first
token (every prefill chunk, the decode step its last token joins, which samples it, and the
host time measured here), beside `roofline_ms`: the 27B prefill of that many tokens at the
cost model's achievable rates, max(FLOPs / bf16 throughput, weights once / bandwidth)
(CostModel.prefill_roofline). Each row also splits the clock's time: prefill chunks, the
joining step, kernel-launch and per-program overhead inside them, host. Only the H200 clock
means anything here (this machine's wall time is not a 27B's), so `--clock=wall` is refused.
`--out` (default runs/ttft.json) gets {"ttft": [{"prompt_tokens", "ttft_ms", "roofline_ms",
...}], ...}.

The last stdout line is the whole result as one JSON document; `--out` gets the same document.
`experiments/gpu_check.py` imports this module and reuses its flags and functions.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform
import shlex
import sys
import time
from functools import partial
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

from experiments import card as card_lib
from experiments import depth_sweep, mesh_flags, prefix_bench, weight_flags
from mtpjax import model, quant, tensor_parallel
from mtpjax.config import FULL, LINEAR, Config, qwen3_5_27b
from mtpjax.params import Params, abstract_params, fp8_paths

FLAGS = flags.FLAGS
DEFAULT_CHECKPOINT = "checkpoints/tiny"
SWEEP_OUT = "runs/depth_sweep.json"
mesh_flags.define()
weight_flags.define()
flags.DEFINE_string("checkpoint", DEFAULT_CHECKPOINT,
                    "checkpoint folder (HF or converted); when the default one holds no "
                    "config.json the random tiny config is used")
flags.DEFINE_enum("synthetic", "", ["", "tiny", "27b"],
                  "use random weights instead of --checkpoint: 'tiny' (the train_tiny "
                  "architecture) or '27b' (Qwen3.5-27B shapes)")
flags.DEFINE_integer("layers", None, "with --synthetic: keep only the first N decoder layers "
                     "(shrinks depth for memory; the 27B pattern repeats every 4 layers)")
flags.DEFINE_list("batch_sizes", ["1", "4", "8"], "lanes per step")
flags.DEFINE_list("context_lens", ["64", "256"], "tokens already cached per lane")
flags.DEFINE_integer("num_speculative_tokens", 3, "k: the verify program runs k+1 tokens")
flags.DEFINE_enum("dtype", "auto", ["auto", "float32", "bfloat16"],
                  "weights/activations/KV dtype; auto = bfloat16 on GPU, float32 elsewhere")
flags.DEFINE_enum("kernels", "auto", ["auto", "reference", "pallas", "interpret"],
                  "kernel implementations (gated delta; paged attention with --kv=paged); "
                  "auto = pallas on GPU, reference elsewhere")
flags.DEFINE_list("programs", ["decode", "verify", "draft"], "which step programs to time")
flags.DEFINE_enum("kv", "contiguous", ["contiguous", "paged"],
                  "KV storage: contiguous `model.init_cache` (default), or the engine's paged "
                  "pool (`model.init_paged_cache` + a page table; attention then goes through "
                  "the paged-attention kernel selected by --kernels)")
flags.DEFINE_integer("page_size", 16, "tokens per page with --kv=paged")
flags.DEFINE_integer("iters", 20, "timed calls per program (after compile + 2 warm-up calls)")
flags.DEFINE_float("hbm_gbps", 4800.0, "device memory bandwidth in GB/s for the roofline "
                   "(default: H200)")
flags.DEFINE_integer("seed", 0, "seed for synthetic weights and inputs")
flags.DEFINE_string("out", "bench.json", "JSON results path ('' = do not write; with "
                    f"--sweep the default is {SWEEP_OUT})")
flags.DEFINE_enum("sweep", "", ["", "lanes", "prefix", "ttft"],
                  "'lanes': instead of the step programs, whole-engine tokens/s against lanes "
                  "for fixed draft depths and the adaptive policy, one table "
                  "(experiments/depth_sweep.py; the --sweep_* flags); 'ttft': time to first "
                  "token against prompt length on the H200 clock, beside the 27B prefill's "
                  "roofline (--ttft_prompts, --prefill_chunk; needs --clock=h200)")
flags.DEFINE_list("ttft_prompts", ["512", "2048", "4096"], "--sweep=ttft: prompt lengths "
                  "(tokens), one request each, one row each")
if "prefill_chunk" not in FLAGS:       # serve defines it too; a process may import both
    flags.DEFINE_integer("prefill_chunk", 512, "--sweep=ttft: the engine's prefill chunk, "
                         "the tokens one iteration prefills (512: a budget a 27B engine would "
                         "run; the judge's engines use 64)")
flags.DEFINE_list("prefix_lens", ["100", "200", "400", "800"],
                  "--sweep=prefix: shared prefix lengths (tokens), one table row each")
flags.DEFINE_integer("prefix_suffix_tokens", 16, "--sweep=prefix: distinct tokens after the "
                     "shared prefix")
flags.DEFINE_integer("prefix_repeats", 3, "--sweep=prefix: timed requests per length and engine")
flags.DEFINE_list("sweep_lanes", [str(x) for x in depth_sweep.DEFAULT_LANES],
                  "--sweep=lanes: lane counts (engine max_lanes), one table row each")
flags.DEFINE_list("sweep_depths", [str(x) for x in depth_sweep.DEFAULT_DEPTHS],
                  "--sweep=lanes: columns: fixed draft depths (integers >= 0; 0 = the stock "
                  "engine) and/or 'adaptive' (K = the deepest fixed depth listed)")
flags.DEFINE_integer("sweep_requests_per_lane", 2, "--sweep=lanes: greedy requests per lane "
                     "(L lanes serve L * this many requests)")
flags.DEFINE_integer("sweep_new_tokens", 48, "--sweep=lanes: tokens generated per request")
flags.DEFINE_integer("sweep_prompt_tokens", 32, "--sweep=lanes: prompt length (held-out text)")
card_lib.define_clock_flag()
card_lib.define_simulate_flag()
flags.DEFINE_integer("sweep_passes", 2, "--sweep=lanes: timed passes per cell (interleaved "
                     "across depths; the cell reports the median)")

PROGRAMS = ("decode", "verify", "draft")
H200_GBPS = 4800.0


# --------------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------------

def tiny_config(layers: int | None = None) -> Config:
    """The architecture `experiments/train_tiny.py` trains by default (random weights here)."""
    n = layers or 8
    return Config(
        vocab_size=4096, hidden_size=256, intermediate_size=768,
        layer_types=tuple(FULL if (i + 1) % 4 == 0 else LINEAR for i in range(n)),
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, rope_theta=10000.0,
        partial_rotary_factor=0.25, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=64, linear_value_head_dim=64, linear_conv_kernel_dim=4,
        tie_word_embeddings=True, mtp_num_hidden_layers=1, max_position_embeddings=8192)


def shrink_layers(cfg: Config, layers: int | None) -> Config:
    if not layers or layers == cfg.num_layers:
        return cfg
    types = cfg.layer_types[:layers]
    if layers < 1 or layers > cfg.num_layers or FULL not in types or LINEAR not in types:
        raise ValueError(f"--layers={layers}: need 1..{cfg.num_layers} layers holding at least "
                         f"one full-attention and one linear layer (pattern "
                         f"{cfg.layer_types[:cfg.layer_period]})")
    return dataclasses.replace(cfg, layer_types=types)


def _leaf_kind(path, shape) -> str:
    names = [getattr(p, "name", "") for p in path]
    name = names[-1]
    if name in ("A_log", "dt_bias", "conv1d"):
        return name
    if name == "norm" and len(names) > 1 and names[-2] == "gdn":
        return "gdn_norm"
    if len(shape) - (1 if names[0] in ("full", "linear") else 0) == 1:
        return "norm"
    return "matrix"


def _uniform_bounds(kind: str, shape) -> tuple[float, float, float]:
    """(offset, lo, hi): leaf = offset + U(lo, hi), with init_params' scales (same std)."""
    if kind == "A_log":
        return 0.0, 1.0, 16.0              # then log()
    if kind == "dt_bias":
        return 0.0, -1.0, 1.0
    if kind == "gdn_norm":
        return 1.0, -0.1, 0.1
    if kind == "norm":
        return 0.0, -0.1, 0.1
    if kind == "fp8q":                   # FP8 codes over e4m3's range; the scale sizes them
        return 0.0, -quant.FP8_MAX, quant.FP8_MAX
    a = (3.0 / shape[-1]) ** 0.5 if kind == "conv1d" else 0.02 * 3 ** 0.5
    return 0.0, -a, a


def _draw(key, shape, dtype, kind):
    off, lo, hi = _uniform_bounds(kind, shape)
    if kind == "A_log":
        return jnp.log(jax.random.uniform(key, shape, jnp.float32, lo, hi)).astype(dtype)
    return (off + jax.random.uniform(key, shape, jnp.dtype(dtype), lo, hi)).astype(dtype)


_CHUNK_ELEMS = 1 << 26   # random-bit temporaries stay ~1 GB whatever the leaf size


@partial(jax.jit, static_argnames=("kind", "rows"), donate_argnames=("buf",))
def _fill_rows(buf, key, start, *, kind, rows):
    """buf[start:start+rows] = fresh random rows, in place (buf is donated)."""
    x = _draw(key, (rows,) + buf.shape[1:], buf.dtype, kind)
    return jax.lax.dynamic_update_slice_in_dim(buf, x, start, axis=0)


def _device_leaf(key, shape, dtype, kind):
    """One leaf drawn on device in its own dtype, in slabs of axis 0 (a 27B leaf
    of 10^8-10^9 elements: drawing it at once would need several times its size in temporaries)."""
    row = int(np.prod(shape[1:])) if len(shape) > 1 else 1
    rows = max(1, _CHUNK_ELEMS // row)
    if len(shape) < 2 or rows >= shape[0]:
        return jax.jit(_draw, static_argnums=(1, 2, 3))(key, shape, dtype, kind)
    buf = jnp.zeros(shape, dtype)
    # the last slab's start is clamped by dynamic_update_slice: it just redraws some rows
    for i, start in enumerate(range(0, shape[0], rows)):
        buf = _fill_rows(buf, jax.random.fold_in(key, i), start, kind=kind, rows=rows)
    return buf


def synthetic_params(cfg: Config, dtype: str, seed: int = 0, weights: str = "dense",
                     mtp_weights: str = "dense") -> Params:
    """Random weights (uniform, with `init_params`' per-leaf scales), cheap to make at any size.

    `init_params` draws float32 normals eagerly and casts them: at 27B that is a float32
    temporary twice the size of each leaf, and on a CPU every one of its ~50 random ops compiles
    separately (tens of seconds for the tiny config). Here models under 1 GB are drawn with
    numpy on the host; bigger ones leaf by leaf on the device, in their final dtype.
    weights="fp8": the linears are FP8 leaves (quant.Fp8Weight, 128 x 128 blocks; the MTP
    head's too with mtp_weights="fp8"): uniform codes over e4m3's range times a scale that gives
    the dense init's spread, drawn directly (no dense copy is ever made).
    """
    abstract = abstract_params(cfg, dtype, fp8_paths(cfg, weights, mtp_weights))
    on_host = nbytes(abstract) < (1 << 30)
    rng = np.random.default_rng(seed)
    key = jax.random.key(seed)
    counter = iter(range(1, 1 << 30))

    def fp8_leaf(a: quant.Fp8Weight) -> quant.Fp8Weight:
        shape = tuple(a.q.shape)
        if on_host:
            q = rng.uniform(-quant.FP8_MAX, quant.FP8_MAX, shape).astype(quant.FP8)
        else:
            q = _device_leaf(jax.random.fold_in(key, next(counter)), shape, "bfloat16", "fp8q")
        _, _, hi = _uniform_bounds("matrix", shape)
        scale = jnp.full(a.scale.shape, hi / quant.FP8_MAX, jnp.float32)
        return quant.Fp8Weight(jnp.asarray(q).astype(quant.FP8), scale, a.block)

    def leaf(path, a):
        if quant.is_fp8(a):
            return fp8_leaf(a)
        shape, kind = tuple(a.shape), _leaf_kind(path, a.shape)
        if not on_host:
            return _device_leaf(jax.random.fold_in(key, next(counter)), shape, str(a.dtype),
                                kind)
        off, lo, hi = _uniform_bounds(kind, shape)
        x = rng.uniform(lo, hi, shape).astype(np.float32)
        x = np.log(x) if kind == "A_log" else off + x
        return jnp.asarray(x, a.dtype)

    return jax.tree_util.tree_map_with_path(leaf, abstract, is_leaf=quant.is_fp8)


def resolve_dtype(dtype: str) -> str:
    if dtype == "auto":
        return "bfloat16" if jax.default_backend() == "gpu" else "float32"
    return dtype


def resolve_kernels(kernels: str) -> str:
    if kernels == "auto":
        return "pallas" if jax.default_backend() == "gpu" else "reference"
    if kernels == "pallas" and jax.default_backend() != "gpu":
        raise ValueError("--kernels=pallas needs a GPU (Triton); use interpret or reference")
    return kernels


def build_model(checkpoint: str, synthetic: str, layers: int | None, dtype: str, seed: int = 0,
                weights: str = "auto", mtp_weights: str = "auto"):
    """(cfg, params, description) from the flags' choice of model (weights / mtp_weights:
    the linears, see mtpjax/quant.py; for synthetic models "fp8" draws FP8 leaves directly and
    "auto" means dense)."""
    syn_w = "fp8" if weights == "fp8" else "dense"
    syn_m = "fp8" if mtp_weights == "fp8" else "dense"
    if synthetic == "27b":
        cfg = shrink_layers(qwen3_5_27b(), layers)
        t = time.perf_counter()
        params = jax.block_until_ready(synthetic_params(cfg, dtype, seed, syn_w, syn_m))
        return cfg, params, {"source": "synthetic", "name": "qwen3_5_27b",
                             "layers": cfg.num_layers, "init_s": time.perf_counter() - t,
                             "weights": syn_w, "mtp_weights": syn_m}
    if synthetic == "tiny" or (checkpoint == DEFAULT_CHECKPOINT and not os.path.exists(
            os.path.join(checkpoint, "config.json"))):
        cfg = tiny_config(layers)
        params = synthetic_params(cfg, dtype, seed, syn_w, syn_m)
        why = ("--synthetic=tiny" if synthetic else
               f"{DEFAULT_CHECKPOINT} not found (run `python -m experiments train_tiny`)")
        return cfg, params, {"source": "random", "name": "tiny", "layers": cfg.num_layers,
                             "why": why, "weights": syn_w, "mtp_weights": syn_m}
    if layers:
        raise ValueError("--layers only applies to --synthetic models")
    from mtpjax.api import load_checkpoint
    cfg, params = load_checkpoint(checkpoint, dtype, weights=weights, mtp_weights=mtp_weights)
    return cfg, params, {"source": "checkpoint", "name": checkpoint, "layers": cfg.num_layers,
                         "weights": weights, "mtp_weights": mtp_weights}


def config_summary(cfg: Config) -> dict:
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads",
            "num_key_value_heads", "head_dim", "linear_num_key_heads", "linear_num_value_heads",
            "linear_key_head_dim", "linear_value_head_dim", "tie_word_embeddings")
    d = {k: getattr(cfg, k) for k in keys}
    d.update(num_layers=cfg.num_layers, num_full_layers=cfg.num_full_layers,
             num_linear_layers=cfg.num_linear_layers, has_mtp=cfg.has_mtp)
    return d


# --------------------------------------------------------------------------------------------
# Roofline bytes
# --------------------------------------------------------------------------------------------

def nbytes(tree) -> int:
    """Bytes one device holds (a sharded array's shard; a replicated or one-device array whole)."""
    def one(x):
        sh = getattr(x, "sharding", None)
        shape = sh.shard_shape(x.shape) if sh is not None else x.shape
        return int(np.prod(shape)) * jnp.dtype(x.dtype).itemsize
    return int(sum(one(x) for x in jax.tree.leaves(tree)))


def lm_head_weight(params: Params):
    return params.embed if params.lm_head is None else params.lm_head


def target_weight_bytes(params: Params) -> int:
    """Weights one target step reads: every text weight except the embedding table (spec §9)."""
    return nbytes((params.layers, params.final_norm, lm_head_weight(params)))


def mtp_weight_bytes(params: Params) -> int:
    """Weights one MTP step reads: the MTP layer, its norms and fc, and the shared lm_head."""
    return nbytes((params.mtp, lm_head_weight(params)))


def kv_bytes_per_token(cfg: Config, n_layers: int, dtype) -> int:
    return n_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * jnp.dtype(dtype).itemsize


def step_bytes(cfg: Config, params: Params, cache: model.Cache, program: str, batch: int,
               context: int, T: int) -> dict:
    """Bytes a step must move at minimum (see the module docstring)."""
    dt = params.embed.dtype
    emb_rows = batch * T * cfg.hidden_size * jnp.dtype(dt).itemsize
    if program == "draft":
        w = mtp_weight_bytes(params) + emb_rows
        per_tok = kv_bytes_per_token(cfg, 1, dt)
        state = 0
    else:
        w = target_weight_bytes(params) + emb_rows
        per_tok = kv_bytes_per_token(cfg, cfg.num_full_layers, dt)
        state = 2 * nbytes(cache.gdn)            # read + write of every lane's GDN cache
    kv = batch * per_tok * (context + T) + batch * per_tok * T
    return {"weights": w, "kv": kv, "gdn_state": state, "total": w + kv + state}


# --------------------------------------------------------------------------------------------
# The step programs
# --------------------------------------------------------------------------------------------

def _target_body(cfg, params, cache, tokens, start, page_table, kernels):
    B, T = tokens.shape
    seg = _segment(start, T, page_table)
    h, cache = model.forward(cfg, params, cache, tokens, seg, "step", kernels)
    return model.argmax_tokens(cfg, params, h), cache


def _draft_body(cfg, params, cache, h_prev, tokens, start, page_table, kernels):
    B, T = tokens.shape
    seg = _segment(start, T, page_table)
    h, cache = model.mtp_forward(cfg, params, cache, h_prev, tokens, seg, kernels)
    return model.argmax_tokens(cfg, params, h), cache


@partial(jax.jit, static_argnames=("cfg", "kernels", "mesh"), donate_argnames=("cache",))
def target_step(cfg: Config, params: Params, cache: model.Cache, tokens, start, page_table, *,
                kernels: str, mesh=None):
    """decode (T = 1) / verify (T = k+1): forward in "step" mode + lm_head + greedy tokens.

    page_table: i32[B, pages_per_lane] for a paged cache, None for a contiguous one.
    mesh: a tensor-parallel mesh the params and cache are laid out on (tensor_parallel.py).
    """
    return tensor_parallel.on_mesh(partial(_target_body, kernels=kernels), cfg, mesh, params,
                                   cache, tokens, start, page_table, n_out=2, cache_at=1)


@partial(jax.jit, static_argnames=("cfg", "kernels", "mesh"), donate_argnames=("cache",))
def draft_step(cfg: Config, params: Params, cache: model.Cache, h_prev, tokens, start,
               page_table, *, kernels: str, mesh=None):
    """One MTP step over 1 token per lane + lm_head + greedy draft."""
    return tensor_parallel.on_mesh(partial(_draft_body, kernels=kernels), cfg, mesh, params,
                                   cache, h_prev, tokens, start, page_table, n_out=2,
                                   cache_at=1)


def _segment(start, T: int, page_table):
    n_valid = jnp.full(start.shape, T, jnp.int32)
    if page_table is None:
        return model.Segment(start, n_valid)
    return model.Segment(start, n_valid, page_table)


def make_cache(cfg: Config, kv: str, batch: int, slots: int, P: int, dtype, page_size: int,
               rng, mesh=None):
    """(cache, page_table) for `batch` lanes of `slots` tokens with P pending slots.

    paged: one pool of batch * ceil(slots / page_size) pages, handed out in a random order,
    so lanes' pages interleave in memory as they do in a long-running engine.
    mesh: built sharded on a tensor-parallel mesh.
    """
    if kv == "contiguous":
        return tensor_parallel.sharded_cache(
            cfg, mesh, lambda c: model.init_cache(c, batch, slots, P, dtype)), None
    if kv != "paged":
        raise ValueError(f"kv must be 'contiguous' or 'paged', got {kv!r}")
    ppl = -(-slots // page_size)
    cache = tensor_parallel.sharded_cache(
        cfg, mesh, lambda c: model.init_paged_cache(c, batch, batch * ppl, page_size, P, dtype))
    table = rng.permutation(batch * ppl).astype(np.int32).reshape(batch, ppl)
    return cache, jnp.asarray(table)


def time_calls(call, cache, iters: int, warmup: int = 2):
    """call(cache) -> (out, cache). Returns (first_call_s, [seconds per timed call])."""
    t = time.perf_counter()
    out, cache = call(cache)
    jax.block_until_ready((out, cache))
    first = time.perf_counter() - t
    for _ in range(warmup):
        out, cache = call(cache)
        jax.block_until_ready((out, cache))
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        out, cache = call(cache)
        jax.block_until_ready((out, cache))
        times.append(time.perf_counter() - t)
    del cache, out
    return first, times


def bench_program(cfg: Config, params: Params, program: str, batch: int, context: int, k: int,
                  kernels: str, iters: int, hbm_gbps: float, seed: int = 0,
                  kv: str = "contiguous", page_size: int = 16, replicas=None) -> dict:
    """replicas: [(mesh, params laid out on it)] (--tp / --dp): every timed call runs the step
    on each replica (dispatched together, so they run at once) and waits for all; the bytes
    and floor are one device's, tokens/s counts every replica."""
    replicas = replicas or [(None, params)]
    if program not in PROGRAMS:
        raise ValueError(f"unknown program {program!r}; choose from {PROGRAMS}")
    if program == "draft" and not cfg.has_mtp:
        raise ValueError("the draft program needs an MTP head")
    T = k + 1 if program == "verify" else 1
    dt = params.embed.dtype
    rng = np.random.default_rng(seed)
    caches, table = [], None
    for mesh, _ in replicas:
        c, table = make_cache(cfg, kv, batch, context + T, T, dt, page_size,
                              np.random.default_rng(seed), mesh)
        n_pend = np.full((batch,), T, np.int32)
        caches.append(dataclasses.replace(c, n_pend=jax.device_put(n_pend, c.n_pend.sharding)))
    mesh0, params0 = replicas[0]
    local = tensor_parallel.shard_config(cfg, tensor_parallel.mesh_tp(mesh0))
    bytes_ = step_bytes(local, params0, caches[0], program, batch, context, T)
    tokens = np.asarray(rng.integers(0, cfg.vocab_size, (batch, T)), np.int32)
    start = np.full((batch,), context, np.int32)
    table = None if table is None else np.asarray(table)
    if program == "draft":
        h_prev = np.asarray(rng.standard_normal((batch, T, cfg.hidden_size))).astype(dt)
        one = lambda m, p, c: draft_step(cfg, p, c, h_prev, tokens, start, table,
                                         kernels=kernels, mesh=m)
    else:
        one = lambda m, p, c: target_step(cfg, p, c, tokens, start, table, kernels=kernels,
                                          mesh=m)

    def call(cs):
        res = [one(m, p, c) for (m, p), c in zip(replicas, cs)]
        return [r[0] for r in res], [r[1] for r in res]
    first, times = time_calls(call, caches, iters)
    med = float(np.median(times))
    floor = bytes_["total"] / (hbm_gbps * 1e9)
    wfloor = bytes_["weights"] / (hbm_gbps * 1e9)
    return {
        "program": program, "batch": batch, "context_len": context, "tokens_per_lane": T,
        "kv": kv,
        "iters": iters, "first_call_s": first, "median_s": med, "min_s": float(np.min(times)),
        "p90_s": float(np.percentile(times, 90)),
        "tokens_per_s": len(replicas) * batch * T / med, "replicas": len(replicas),
        "tp": tensor_parallel.mesh_tp(mesh0),
        "bytes": bytes_, "achieved_gbps": bytes_["total"] / med / 1e9,
        "floor_s": floor, "bw_fraction": floor / med, "x_floor": med / floor,
        "weight_floor_s": wfloor, "x_weight_floor": med / wfloor,
    }


def speculative_summary(rows: list[dict], k: int) -> list[dict]:
    by = {(r["program"], r["batch"], r["context_len"]): r for r in rows if "median_s" in r}
    out = []
    for (prog, b, c), r in sorted(by.items(), key=lambda kv: kv[0][1:]):
        if prog != "decode" or ("verify", b, c) not in by or ("draft", b, c) not in by:
            continue
        dec, ver, dra = r["median_s"], by["verify", b, c]["median_s"], by["draft", b, c]["median_s"]
        est = ver + k * dra
        out.append({"batch": b, "context_len": c, "k": k, "decode_s": dec, "verify_s": ver,
                    "draft_s": dra, "spec_step_estimate_s": est,
                    "break_even_tokens_per_step": est / dec,
                    "max_tokens_per_step": k + 1})
    return out


def device_info() -> dict:
    d = jax.devices()[0]
    info = {"backend": jax.default_backend(), "device_kind": d.device_kind,
            "device_count": jax.device_count(), "platform": platform.platform(),
            "python": platform.python_version(), "jax": jax.__version__,
            "xla_flags": os.environ.get("XLA_FLAGS", "")}
    try:
        info["cpu_cores_available"] = len(os.sched_getaffinity(0))
    except AttributeError:
        info["cpu_cores_available"] = os.cpu_count()
    if info["backend"] == "cpu":
        info["cpu"] = platform.processor() or platform.machine()
    return info


def run_bench(cfg: Config, params: Params, *, programs, batch_sizes, context_lens, k: int,
              kernels: str, iters: int, hbm_gbps: float, seed: int = 0,
              kv: str = "contiguous", page_size: int = 16, deadline: float | None = None,
              log=print, replicas=None) -> dict:
    """Time every (program, batch, context); entries past `deadline` are recorded as skipped."""
    rows = []
    for b in batch_sizes:
        for c in context_lens:
            for prog in programs:
                if prog == "draft" and not cfg.has_mtp:
                    continue
                if deadline is not None and time.monotonic() > deadline:
                    rows.append({"program": prog, "batch": b, "context_len": c,
                                 "skipped": "time budget"})
                    log(f"  {prog:6s} B={b} C={c}: skipped (time budget)")
                    continue
                r = bench_program(cfg, params, prog, b, c, k, kernels, iters, hbm_gbps, seed,
                                  kv, page_size, replicas)
                rows.append(r)
                log(f"  {prog:6s} B={b} C={c} T={r['tokens_per_lane']}: "
                    f"{r['median_s'] * 1e3:.3f} ms/step, {r['tokens_per_s']:.1f} tok/s, "
                    f"x{r['x_floor']:.2f} of floor (first call {r['first_call_s']:.1f} s)")
    return {"results": rows, "speculative": speculative_summary(rows, k)}


def roofline_label(backend: str, hbm_gbps: float) -> dict:
    applies = backend == "gpu"
    basis = f"{hbm_gbps:g} GB/s" + (" (H200 HBM)" if hbm_gbps == H200_GBPS else "")
    note = ("floor = bytes moved per step / bandwidth" if applies else
            f"measured on {backend}: the floor is that of a {basis} GPU, so bw_fraction / "
            "x_floor are NOT meaningful for this device (printed for format only)")
    return {"hbm_gbps": hbm_gbps, "roofline_applies": applies, "roofline_note": note}


def format_table(rows: list[dict], backend: str) -> str:
    lab = "" if backend == "gpu" else " [roofline of an H200; not this device]"
    head = (f"{'program':8s} {'B':>3s} {'ctx':>6s} {'T':>2s} {'ms/step':>10s} {'tok/s':>10s} "
            f"{'GB/step':>8s} {'floor ms':>9s} {'x floor':>8s} {'%BW':>6s}")
    lines = [f"step programs{lab}", head, "-" * len(head)]
    for r in rows:
        if "median_s" not in r:
            lines.append(f"{r['program']:8s} {r['batch']:3d} {r['context_len']:6d}  "
                         f"skipped ({r['skipped']})")
            continue
        lines.append(
            f"{r['program']:8s} {r['batch']:3d} {r['context_len']:6d} "
            f"{r['tokens_per_lane']:2d} {r['median_s'] * 1e3:10.3f} {r['tokens_per_s']:10.1f} "
            f"{r['bytes']['total'] / 1e9:8.3f} {r['floor_s'] * 1e3:9.3f} "
            f"{r['x_floor']:8.2f} {100 * r['bw_fraction']:5.1f}%")
    return "\n".join(lines)


def format_spec(spec: list[dict]) -> str:
    if not spec:
        return ""
    lines = ["speculative step estimate (verify + k * draft) vs plain decode",
             f"{'B':>3s} {'ctx':>6s} {'k':>2s} {'decode ms':>10s} {'spec ms':>10s} "
             f"{'break-even tok/step':>20s}"]
    for s in spec:
        lines.append(f"{s['batch']:3d} {s['context_len']:6d} {s['k']:2d} "
                     f"{s['decode_s'] * 1e3:10.3f} {s['spec_step_estimate_s'] * 1e3:10.3f} "
                     f"{s['break_even_tokens_per_step']:14.2f} / {s['max_tokens_per_step']}")
    return "\n".join(lines)


def command_line() -> str:
    return "python -m experiments " + " ".join(shlex.quote(a) for a in sys.argv[1:])


def write_json(path: str, doc: dict) -> None:
    if path:
        card_lib.write_json(path, doc)


def sweep_main(log) -> None:
    """--sweep=lanes: experiments/depth_sweep.py over the flags' model; one table + JSON."""
    lanes = depth_sweep.parse_lanes(FLAGS.sweep_lanes)     # bad values fail before any work
    depths = depth_sweep.parse_depths(FLAGS.sweep_depths)
    for name in ("sweep_requests_per_lane", "sweep_new_tokens", "sweep_prompt_tokens",
                 "sweep_passes"):
        if FLAGS[name].value < 1:
            raise ValueError(f"--{name} must be >= 1, got {FLAGS[name].value}")
    if FLAGS.tp * FLAGS.dp > 1:
        raise ValueError("--sweep=lanes runs one engine on one device; drop --tp/--dp")
    dtype, kernels = resolve_dtype(FLAGS.dtype), resolve_kernels(FLAGS.kernels)
    out = FLAGS.out if FLAGS["out"].present else SWEEP_OUT
    info = device_info()
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    cfg, params, desc = build_model(FLAGS.checkpoint, FLAGS.synthetic, FLAGS.layers, dtype,
                                    FLAGS.seed, FLAGS.weights, FLAGS.mtp_weights)
    from mtpjax.text import Tokenizer
    tok = Tokenizer.from_checkpoint(FLAGS.checkpoint)   # prompts: held-out text
    n = max(lanes) * FLAGS.sweep_requests_per_lane
    prompts = depth_sweep.heldout_prompts(tok, n, FLAGS.sweep_prompt_tokens, FLAGS.seed)
    top = max(max(p) for p in prompts)
    if top >= cfg.vocab_size:
        raise ValueError(f"the tokenizer of {FLAGS.checkpoint} makes id {top}, outside the "
                         f"model's vocabulary of {cfg.vocab_size}")
    clock_words = card_lib.predicted_words(FLAGS.tp, FLAGS.clock_calibration)
    header = [f"# bench --sweep=lanes: tokens/s vs lanes, fixed draft depths and adaptive",
              f"date: {date}",
              f"command: {command_line()}",
              f"machine: {info['backend']} ({info['device_kind']}), "
              f"{info.get('cpu_cores_available')} cores available, {info['platform']}, "
              f"python {info['python']}, jax {info['jax']}",
              f"model: {desc['source']} {desc['name']} ({desc['layers']} layers), dtype={dtype}, "
              f"kernels={kernels}",
              f"workload: L lanes x {FLAGS.sweep_requests_per_lane} greedy requests of "
              f"{FLAGS.sweep_new_tokens} new tokens after {FLAGS.sweep_prompt_tokens}-token "
              f"held-out prompts; {FLAGS.sweep_passes} interleaved pass(es) per cell",
              f"clock: {FLAGS.clock}" + (f" ({clock_words}: tokens, "
                                         "acceptance and depths are real)"
                                         if FLAGS.clock != "wall" else " (timed here)")]
    if FLAGS.simulate_acceptance:
        header.append(f"simulated acceptance: {FLAGS.simulate_acceptance} (each verify step "
                      "accepts a seeded draw from the profile; timing only)")
    for line in header:
        log(line)
    res = depth_sweep.run_sweep(cfg, params, prompts, lanes=lanes, depths=depths,
                                requests_per_lane=FLAGS.sweep_requests_per_lane,
                                new_tokens=FLAGS.sweep_new_tokens, passes=FLAGS.sweep_passes,
                                kernels=kernels, page_size=FLAGS.page_size, log=log,
                                clock=FLAGS.clock,
                                simulate_acceptance=FLAGS.simulate_acceptance,
                                clock_calibration=FLAGS.clock_calibration)
    table = depth_sweep.format_table(res)
    doc = {"command": command_line(), "date": date, "device": info,
           "model": {**desc, "config": config_summary(cfg), "dtype": dtype},
           "kernels": kernels, "sweep": "lanes", "seed": FLAGS.seed, "clock": FLAGS.clock,
           "clock_calibration": FLAGS.clock_calibration,
           **res, "table": table}
    log("")
    log("\n".join(header[1:]))
    log("")
    log(table)
    log(f"(sweep took {res['elapsed_s']:.0f} s, compiling included)")
    write_json(out, doc)
    if out:
        log(f"wrote {out}")
    print(json.dumps(doc), flush=True)


def prefix_main(log) -> None:
    """--sweep=prefix: time to first token with the prefix cache off and on
    (experiments/prefix_bench.py); one table + JSON."""
    lens = [int(x) for x in FLAGS.prefix_lens]
    if not lens or min(lens) < 1 or FLAGS.prefix_suffix_tokens < 1 or FLAGS.prefix_repeats < 1:
        raise ValueError("--prefix_lens, --prefix_suffix_tokens and --prefix_repeats must be "
                         "positive")
    if FLAGS.tp * FLAGS.dp > 1:
        raise ValueError("--sweep=prefix runs one engine on one device; drop --tp/--dp")
    dtype, kernels = resolve_dtype(FLAGS.dtype), resolve_kernels(FLAGS.kernels)
    out = FLAGS.out if FLAGS["out"].present else "runs/prefix_ttft.json"
    info = device_info()
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    cfg, params, desc = build_model(FLAGS.checkpoint, FLAGS.synthetic, FLAGS.layers, dtype,
                                    FLAGS.seed, FLAGS.weights, FLAGS.mtp_weights)
    from mtpjax.text import Tokenizer
    tok = Tokenizer.from_checkpoint(FLAGS.checkpoint)
    need = max(lens) + (FLAGS.prefix_repeats + 2) * FLAGS.prefix_suffix_tokens
    stream = [t for p in depth_sweep.heldout_prompts(tok, 64, 64, FLAGS.seed) for t in p]
    while len(stream) < need:
        stream = stream + stream
    header = ["# bench --sweep=prefix: time to first token, prefix cache off vs on",
              f"date: {date}", f"command: {command_line()}",
              f"machine: {info['backend']} ({info['device_kind']}), "
              f"{info.get('cpu_cores_available')} cores available, python {info['python']}, "
              f"jax {info['jax']}",
              f"model: {desc['source']} {desc['name']} ({desc['layers']} layers), dtype={dtype}, "
              f"kernels={kernels}, K={FLAGS.num_speculative_tokens} draft slots"]
    for line in header:
        log(line)
    res = prefix_bench.run_ttft_sweep(
        cfg, params, stream, shared_lens=lens, suffix_tokens=FLAGS.prefix_suffix_tokens,
        repeats=FLAGS.prefix_repeats, k=FLAGS.num_speculative_tokens, kernels=kernels,
        page_size=FLAGS.page_size, log=log)
    table = prefix_bench.format_table(res)
    log("")
    log(table)
    doc = {"command": command_line(), "date": date, "device": info, "sweep": "prefix",
           "model": {**desc, "dtype": dtype}, "kernels": kernels, **res, "table": table}
    write_json(out, doc)
    if out:
        log(f"wrote {out}")
    print(json.dumps(doc), flush=True)


class _SplitClock:
    """A cost_model.VirtualClock's wrapper that also splits the device time it adds by
    program kind ("prefill", "decode", "mixed", ...) and keeps, of each, the overhead inside
    it (kernel launches + the per-program cost: Hardware.launch_s x kernels + program_s)."""

    def __init__(self, clock):
        self.clock, self.by_kind, self.overhead_s = clock, {}, 0.0

    def __getattr__(self, name):          # model, now, host_s, add_host, report, ...
        return getattr(self.clock, name)

    def launch(self, key, contexts=(), start=0, is_last=True, wait=True) -> float:
        s = self.clock.launch(key, contexts, start, is_last, wait)
        cost = self.clock.model.program(key, contexts, start, is_last)
        hw = self.clock.model.hw
        self.by_kind[key[0]] = self.by_kind.get(key[0], 0.0) + s
        self.overhead_s += hw.launch_s * cost.kernels + hw.program_s
        return s


def ttft_prompts(stream: Sequence[int], lengths: Sequence[int]) -> list[list[int]]:
    """One prompt per length: the first N tokens of `stream` (repeated as needed)."""
    top = max(lengths)
    if not stream:
        raise ValueError("no tokens to build prompts from")
    reps = -(-top // len(stream))
    tokens = list(stream) * reps
    return [tokens[:n] for n in lengths]


def run_ttft_sweep(cfg: Config, params: Params, prompts: Sequence[Sequence[int]], *, k: int,
                   prefill_chunk: int, kernels: str, page_size: int, weights: str = "bf16",
                   log=print, calibration: str | None = None) -> list[dict]:
    """Each prompt alone on one clocked engine (one lane, no prefix cache: every token is
    prefilled); per prompt: ttft_ms (the clock's submit-to-first-token time, from the
    engine's timing), roofline_ms (CostModel.prefill_roofline), their ratio, and the clock's
    split of that time (the prefill chunks run alone; the decode step the last token joins,
    which samples it and carries the last chunk when the scheduler puts it there; the launch
    overhead inside both; the host time). Every prompt runs once untimed first: compiling is
    no clock time anyway (the model runner prices a program's run), but a first request's host time
    holds one-time costs (first calls of host-side helpers) no served request pays."""
    from mtpjax import Engine
    from mtpjax.sampling import SamplingParams
    longest = max(len(p) for p in prompts)
    max_seq_len = min(longest + 64 + 2 * k + page_size, cfg.max_position_embeddings)
    if longest + 2 > max_seq_len:
        raise ValueError(f"a {longest}-token prompt does not fit the model's "
                         f"{cfg.max_position_embeddings} positions")
    clock = _SplitClock(card_lib.make_clock("h200", k, weights=weights, page_size=page_size,
                                            calibration=calibration))
    engine = Engine(cfg, params, num_speculative_tokens=k, max_lanes=1,
                    max_seq_len=max_seq_len, prefill_chunk=prefill_chunk, kernels=kernels,
                    page_size=page_size, prefix_cache=False, clock=clock)
    for prompt in prompts:                # warm: compiles and first-call host costs
        engine.generate([prompt], SamplingParams(max_new_tokens=1))
    rows = []
    for prompt in prompts:
        n = len(prompt)
        t0 = {key: engine.timing[key] for key in ("ttft_s", "first_tokens", "prefill_chunks")}
        kinds0, over0 = dict(clock.by_kind), clock.overhead_s
        out = engine.generate([prompt], SamplingParams(max_new_tokens=1))[0]
        if out.error is not None:
            raise RuntimeError(f"{n}-token prompt: {out.error}")
        firsts = engine.timing["first_tokens"] - t0["first_tokens"]
        if firsts != 1:
            raise RuntimeError(f"{n}-token prompt: {firsts} first tokens on the clock")
        ttft = engine.timing["ttft_s"] - t0["ttft_s"]
        spent = {kind: s - kinds0.get(kind, 0.0) for kind, s in clock.by_kind.items()}
        device = sum(spent.values())     # every program ran before the first token was out
        roof = clock.model.prefill_roofline(n)
        rows.append({
            "prompt_tokens": n, "ttft_ms": 1e3 * ttft, "roofline_ms": 1e3 * roof,
            "ratio": ttft / roof,
            "prefill_chunks": engine.timing["prefill_chunks"] - t0["prefill_chunks"],
            "prefill_ms": 1e3 * spent.get("prefill", 0.0),
            "first_step_ms": 1e3 * (spent.get("decode", 0.0) + spent.get("mixed", 0.0)),
            "overhead_ms": 1e3 * (clock.overhead_s - over0),
            "host_ms": 1e3 * (ttft - device)})     # host time inside the TTFT window
        log(f"  {n} tokens: ttft {rows[-1]['ttft_ms']:.2f} ms, roofline {1e3 * roof:.2f} ms")
    return rows


def format_ttft(rows: list[dict]) -> str:
    head = (f"{'prompt':>7} {'ttft_ms':>9} {'roof_ms':>9} {'ratio':>6} {'chunks':>6} "
            f"{'prefill_ms':>10} {'step_ms':>8} {'launch_ms':>9} {'host_ms':>8}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['prompt_tokens']:>7} {r['ttft_ms']:>9.2f} {r['roofline_ms']:>9.2f} "
                     f"{r['ratio']:>6.3f} {r['prefill_chunks']:>6} {r['prefill_ms']:>10.2f} "
                     f"{r['first_step_ms']:>8.2f} {r['overhead_ms']:>9.2f} "
                     f"{r['host_ms']:>8.2f}")
    lines.append("ttft = prefill + step + host; launch: the kernel-launch and per-program cost "
                 "inside prefill + step; roof: the 27B prefill's max(FLOPs / bf16 "
                 "throughput, weights once / bandwidth)")
    return "\n".join(lines)


def ttft_main(log) -> None:
    """--sweep=ttft: run_ttft_sweep over --ttft_prompts on the flags' model; table + JSON."""
    if FLAGS.clock != "h200":
        raise ValueError("--sweep=ttft compares with the 27B's roofline on an H200: run it "
                         "with --clock=h200")
    lens = [int(x) for x in FLAGS.ttft_prompts]
    if not lens or min(lens) < 2:
        raise ValueError(f"--ttft_prompts must be >= 2 tokens each, got {lens}")
    if FLAGS.prefill_chunk < 1:
        raise ValueError(f"--prefill_chunk must be >= 1, got {FLAGS.prefill_chunk}")
    if FLAGS.tp * FLAGS.dp > 1:
        raise ValueError("--sweep=ttft runs one engine on one device; drop --tp/--dp")
    dtype, kernels = resolve_dtype(FLAGS.dtype), resolve_kernels(FLAGS.kernels)
    out = FLAGS.out if FLAGS["out"].present else "runs/ttft.json"
    cfg, params, desc = build_model(FLAGS.checkpoint, FLAGS.synthetic, FLAGS.layers, dtype,
                                    FLAGS.seed, FLAGS.weights, FLAGS.mtp_weights)
    from mtpjax.text import Tokenizer
    tok = Tokenizer.from_checkpoint(FLAGS.checkpoint)
    stream = [t for p in depth_sweep.heldout_prompts(tok, 64, 64, FLAGS.seed) for t in p]
    weights = card_lib.clock_weights(params)
    k = FLAGS.num_speculative_tokens
    header = [f"# bench --sweep=ttft: time to first token vs prompt length, clock h200 "
              f"({card_lib.predicted_words(calibration=FLAGS.clock_calibration)}; host time "
              "measured here)",
              f"command: {command_line()}",
              f"engine: {desc['source']} {desc['name']} ({desc['layers']} layers) run here, "
              f"dtype={dtype}, kernels={kernels}, one lane, K={k}, prefill_chunk="
              f"{FLAGS.prefill_chunk}, page_size={FLAGS.page_size}, no prefix cache"]
    for line in header:
        log(line)
    rows = run_ttft_sweep(cfg, params, ttft_prompts(stream, lens), k=k,
                          prefill_chunk=FLAGS.prefill_chunk, kernels=kernels,
                          page_size=FLAGS.page_size, weights=weights, log=log,
                          calibration=FLAGS.clock_calibration)
    table = format_ttft(rows)
    log("")
    log(table)
    doc = {"command": command_line(),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "sweep": "ttft", "clock": "h200",
           "time": card_lib.predicted_words(calibration=FLAGS.clock_calibration),
           "model": {**desc, "dtype": dtype}, "kernels": kernels,
           "num_speculative_tokens": k, "prefill_chunk": FLAGS.prefill_chunk,
           "page_size": FLAGS.page_size, "weights": weights, "ttft": rows, "table": table}
    write_json(out, doc)
    if out:
        log(f"wrote {out}")
    print(json.dumps(doc), flush=True)


def price_programs(batch_sizes, context_lens, k: int, *, weights: str = "bf16", tp: int = 1,
                   page_size: int = 16, calibration: str | None = None) -> dict:
    """--clock=h200: the cost model's price of the programs the engine launches for the 27B,
    per (B, C): ("decode", d, B) for d = 0..k with B lanes each holding C tokens, ("draft", B)
    and ("prefill", C) (a whole prompt of C tokens in one chunk), and per (B, C) the
    break-even tokens per step of each depth (its price / depth 0's): what speculation at
    depth d must emit per step to pay. Nothing is timed. calibration: the clock's constants
    from a gpu_check calibration file (the mid set; cost_model.load_calibration)."""
    from mtpjax.cost_model import CostModel, clock_constants
    m = CostModel(weights=weights, tp=tp, K=k, page_size=page_size,
                  hw=clock_constants(calibration).mid)
    rows, spec = [], []
    row = lambda key, b, c, cost, tokens: {
        "program": key, "batch": b, "context_len": c, "seconds": cost.seconds,
        "tokens_per_s": None if tokens is None else tokens / cost.seconds,
        "bytes": dict(cost.bytes),
        "total_bytes": cost.total_bytes, "must_read_bytes": cost.must_read_bytes,
        "flops": cost.flops, "kernels": cost.kernels}
    for b in batch_sizes:
        for c in context_lens:
            ctx = [c] * b
            dec = [m.decode(d, b, ctx) for d in range(k + 1)]
            # a depth-d step emits 1 + accepted drafts per lane: tokens/s only at depth 0
            rows += [row(("decode", d, b), b, c, x, None if d else b) for d, x in enumerate(dec)]
            if k:
                rows.append(row(("draft", b), b, c, m.draft(b, ctx), None))
            spec.append({"batch": b, "context_len": c, "k": k,
                         "decode_s": [x.seconds for x in dec],
                         "break_even_tokens_per_step": [x.seconds / dec[0].seconds for x in dec]})
    rows += [row(("prefill", c), 1, 0, m.prefill(c), c) for c in context_lens]
    return {"results": rows, "speculative": spec,
            "hardware": {f: getattr(m.hw, f) for f in ("name", "hbm_bytes_per_s",
                                                       "bf16_flops_per_s", "launch_s",
                                                       "program_s", "origin")},
            "sources": dict(m.hw.sources)}


def format_prices(res: dict) -> str:
    lines = [f"clock h200: {card_lib.predicted_words(hardware=res.get('hardware'))}; nothing "
             "below was timed (tok/s: "
             "depth 0 and prefill only; a deeper step's tokens depend on acceptance)",
             f"{'program':18s} {'B':>3s} {'ctx':>6s} {'ms':>9s} {'tok/s':>10s} {'GB':>8s} "
             f"{'GFLOP':>9s} {'kernels':>7s}"]
    for r in res["results"]:
        tps = "-" if r["tokens_per_s"] is None else f"{r['tokens_per_s']:.1f}"
        lines.append(f"{str(r['program']):18s} {r['batch']:3d} {r['context_len']:6d} "
                     f"{r['seconds'] * 1e3:9.3f} {tps:>10s} "
                     f"{r['total_bytes'] / 1e9:8.3f} {r['flops'] / 1e9:9.1f} {r['kernels']:7d}")
    lines.append("break-even tokens per step (depth d's price / depth 0's), d = 0..k:")
    for sp in res["speculative"]:
        lines.append(f"  B={sp['batch']} C={sp['context_len']}: "
                     + ", ".join(f"d{d} {x:.3f}" for d, x in
                                 enumerate(sp["break_even_tokens_per_step"])))
    return "\n".join(lines)


def clock_main(log) -> None:
    """--clock=h200 without a sweep: price_programs over the flags' shapes; one table + JSON."""
    batch_sizes = [int(x) for x in FLAGS.batch_sizes]
    context_lens = [int(x) for x in FLAGS.context_lens]
    weights = "fp8" if FLAGS.weights == "fp8" else "bf16"
    res = price_programs(batch_sizes, context_lens, FLAGS.num_speculative_tokens,
                         weights=weights, tp=FLAGS.tp, page_size=FLAGS.page_size,
                         calibration=FLAGS.clock_calibration)
    doc = {"command": command_line(),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "clock": "h200", "time": card_lib.predicted_words(FLAGS.tp, FLAGS.clock_calibration),
           "model": {"name": "qwen3_5_27b", "weights": weights, "tp": FLAGS.tp},
           "num_speculative_tokens": FLAGS.num_speculative_tokens, **res}
    log(format_prices(res))
    write_json(FLAGS.out, doc)
    if FLAGS.out:
        log(f"wrote {FLAGS.out}")
    print(json.dumps(doc), flush=True)


def main(argv):
    del argv
    log = partial(print, flush=True)
    card_lib.check_clock_flags(FLAGS.clock, FLAGS.clock_calibration)   # before any work
    if FLAGS.sweep == "ttft":
        return ttft_main(log)
    if FLAGS.clock != "wall":
        if FLAGS.sweep == "prefix":
            raise ValueError("--sweep=prefix times its own engines on this machine's wall "
                             "clock (experiments/prefix_bench.py takes no clock yet): run it "
                             "with --clock=wall")
        if not FLAGS.sweep:
            return clock_main(log)
    if FLAGS.sweep == "prefix":
        return prefix_main(log)
    if FLAGS.sweep:
        return sweep_main(log)
    dtype, kernels = resolve_dtype(FLAGS.dtype), resolve_kernels(FLAGS.kernels)
    batch_sizes = [int(x) for x in FLAGS.batch_sizes]
    context_lens = [int(x) for x in FLAGS.context_lens]
    programs = list(FLAGS.programs)
    bad = [p for p in programs if p not in PROGRAMS]
    if bad:
        raise ValueError(f"--programs: unknown {bad}; choose from {PROGRAMS}")
    k = FLAGS.num_speculative_tokens
    if k < 1 and "verify" in programs:
        raise ValueError("--num_speculative_tokens must be >= 1 to time verify")
    info = device_info()
    log(f"bench on {info['backend']} ({info['device_kind']}), dtype={dtype}, kernels={kernels}, "
        f"kv={FLAGS.kv}")
    cfg, params, desc = build_model(FLAGS.checkpoint, FLAGS.synthetic, FLAGS.layers, dtype,
                                    FLAGS.seed, FLAGS.weights, FLAGS.mtp_weights)
    if quant.has_fp8(params):     # the FP8 matmul follows --kernels, like the engine's
        params = quant.set_impl(params, kernels)
    log(f"model: {desc}")
    replicas = None
    if FLAGS.tp * FLAGS.dp > 1:
        meshes = tensor_parallel.make_meshes(FLAGS.tp, FLAGS.dp)
        replicas = [(m, tensor_parallel.place_params(cfg, params, m)) for m in meshes]
        log(f"tp={FLAGS.tp} dp={FLAGS.dp}: bytes and floors per device, tokens/s over all "
            f"replicas")
    res = run_bench(cfg, params, programs=programs, batch_sizes=batch_sizes,
                    context_lens=context_lens, k=k, kernels=kernels, iters=FLAGS.iters,
                    hbm_gbps=FLAGS.hbm_gbps, seed=FLAGS.seed, kv=FLAGS.kv,
                    page_size=FLAGS.page_size, log=log, replicas=replicas)
    doc = {
        "command": command_line(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": info,
        "model": {**desc, "config": config_summary(cfg), "dtype": dtype,
                  "target_weight_bytes": target_weight_bytes(params),
                  "mtp_weight_bytes": mtp_weight_bytes(params) if cfg.has_mtp else 0},
        "kernels": kernels, "kv": FLAGS.kv, "page_size": FLAGS.page_size,
        "tp": FLAGS.tp, "dp": FLAGS.dp,
        "num_speculative_tokens": k, "iters": FLAGS.iters,
        **roofline_label(info["backend"], FLAGS.hbm_gbps),
        **res,
    }
    log(format_table(res["results"], info["backend"]))
    spec = format_spec(res["speculative"])
    if spec:
        log(spec)
    write_json(FLAGS.out, doc)
    if FLAGS.out:
        log(f"wrote {FLAGS.out}")
    print(json.dumps(doc), flush=True)
