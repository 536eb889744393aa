"""Tensor parallelism in the Megatron layout, on a JAX device mesh.

A tensor-parallel step is the one-device step program run under `jax.shard_map` over the mesh
axis "tp": every device runs the same model code on its shard's heads, with a per-shard
`Config` (`shard_config`: head counts and intermediate size divided by tp, `tp_axis` set) that
tells the model where to reduce. The layout:

  full attention  q heads split; KV heads split, or replicated when tp exceeds them (each shard
                  holds the one KV head its q heads read, as vLLM does); o_proj split by input
                  columns -> one all-reduce of the layer output
  Gated DeltaNet  value heads split (recurrent state, pending buffers, z, b, a, A_log, dt_bias
                  by value head); key heads split or replicated like KV heads; conv channels
                  follow their q/k/v heads; out_proj split by columns -> one all-reduce
  MLP             intermediate split (gate_up rows, down_proj columns) -> one all-reduce
  embed, lm_head  vocabulary split, padded with zero rows to a multiple of tp: the embedding
                  lookup is a masked local lookup + all-reduce; logits stay sharded for the MTP
                  drafts' argmax (local max/argmax, then an all-gather of [tp, B] pairs), and
                  are all-gathered only where the sampler needs the distribution (verification
                  and the first token: temperature / top-k / top-p need the full vocabulary to
                  stay bit-identical to the one-device sampler)
  MTP             the same layout (its fc and norms are replicated: fc reads a replicated input)
  KV pool, GDN    sharded by head like the weights that write them; never gathered

Sharded leaves are stored shard-major: rows (or columns) of a fused leaf are reordered so that
shard s's block of the global array is exactly the leaf the per-shard model expects
([q_s | k_s | v_s] for the attention qkv, [qkv_s | z_s | b_s | a_s] for the GDN in_proj,
[gate_s | up_s] for the MLP). `layout_index` gives that reordering per leaf; loaders apply it one
leaf at a time on the host and place each shard on its device (`place_leaf`), so no device and
no host buffer ever holds the whole model.

Row-parallel partial sums are reduced in float32 and rounded once, like the one-device GEMM's
float32 accumulation; the summation order differs, so results match the one-device engine to
float32 rounding, not bit for bit (tests/test_tensor_parallel.py measures what that means for
tokens).
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from mtpjax import quant
from mtpjax.config import Config
from mtpjax.params import Params, _build, get_path, leaf_dtype, leaf_shapes, replace_path

TP_AXIS = "tp"


class ShardingError(ValueError):
    """A tp / dp request this model or this machine cannot run; the message says why."""


# --------------------------------------------------------------------------------------------
# Which heads a shard holds
# --------------------------------------------------------------------------------------------

def check_tp(cfg: Config, tp: int) -> None:
    """Raise ShardingError naming the config key when `tp` does not divide what it must."""
    if not isinstance(tp, int) or tp < 1:
        raise ShardingError(f"tp must be a positive integer, got {tp!r}")

    def split(key: str, n: int, replicable: bool):
        if n % tp == 0 or (replicable and tp % n == 0):
            return
        rule = "divisible by tp" + (" or divide tp (replicated)" if replicable else "")
        raise ShardingError(f"tp={tp} does not fit {key}={n}: it must be {rule}")

    split("num_attention_heads", cfg.num_attention_heads, False)
    split("num_key_value_heads", cfg.num_key_value_heads, True)
    split("linear_num_value_heads", cfg.linear_num_value_heads, False)
    split("linear_num_key_heads", cfg.linear_num_key_heads, True)
    split("intermediate_size", cfg.intermediate_size, False)


def check_fp8(params, tp: int) -> None:
    """FP8 weights (quant.Fp8Weight) are not split across devices yet: block scales straddle
    shard boundaries for some layouts, and no GPU has checked the sharded kernel."""
    if tp > 1 and quant.has_fp8(params):
        raise ShardingError("FP8 weights under tensor parallelism (tp > 1) are not supported "
                            "yet; use tp=1 (an FP8 27B fits one H200), dp for more devices, or "
                            "weights='dense'")


def heads_of_shard(n: int, tp: int, s: int) -> np.ndarray:
    """The global head ids shard s holds of n heads: a contiguous block, or (n < tp) the one
    head its block of the wider head type reads (replication)."""
    if n >= tp:
        per = n // tp
        return np.arange(s * per, (s + 1) * per)
    return np.array([s * n // tp])


def shard_config(cfg: Config, tp: int) -> Config:
    """The config one shard's model code runs with (tp = 1: cfg itself)."""
    check_tp(cfg, tp)
    if tp == 1:
        return cfg
    return dataclasses.replace(
        cfg, num_attention_heads=cfg.num_attention_heads // tp,
        num_key_value_heads=max(1, cfg.num_key_value_heads // tp),
        linear_num_key_heads=max(1, cfg.linear_num_key_heads // tp),
        linear_num_value_heads=cfg.linear_num_value_heads // tp,
        intermediate_size=cfg.intermediate_size // tp, tp_axis=TP_AXIS)


def padded_vocab(cfg: Config, tp: int) -> int:
    return -(-cfg.vocab_size // tp) * tp


# --------------------------------------------------------------------------------------------
# The shard-major layout of every leaf
# --------------------------------------------------------------------------------------------

def _blocks(tp: int, parts) -> np.ndarray:
    """Concatenate, shard by shard, the index blocks parts = [(offset, n_heads, width)]."""
    out = []
    for s in range(tp):
        for off, n, w in parts:
            h = heads_of_shard(n, tp, s)
            out.append((off + h[:, None] * w + np.arange(w)[None, :]).reshape(-1))
    return np.concatenate(out)


def layout_index(cfg: Config, tp: int, path: tuple) -> tuple[int, np.ndarray] | None:
    """(axis, index) such that the tensor-parallel leaf is `take(leaf, index, axis)` (index -1:
    a zero row of vocabulary padding), sharded evenly along `axis`; None: replicated as is."""
    if tp == 1:
        return None
    name, parent = path[-1], (path[-2] if len(path) > 1 else None)
    nq, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv, kd, vd, cd = (cfg.linear_key_head_dim, cfg.linear_value_head_dim,
                          cfg.linear_key_dim, cfg.linear_value_dim, cfg.conv_dim)
    inter = cfg.intermediate_size
    conv_parts = [(0, nk, dk), (kd, nk, dk), (2 * kd, nv, dv)]
    if name in ("embed", "lm_head"):
        idx = np.arange(padded_vocab(cfg, tp))
        return 0, np.where(idx < cfg.vocab_size, idx, -1)
    if parent == "attn" and name == "qkv":
        return 0, _blocks(tp, [(0, nq, 2 * hd), (2 * nq * hd, nkv, hd),
                               ((2 * nq + nkv) * hd, nkv, hd)])
    if parent == "attn" and name == "o_proj":
        return 1, _blocks(tp, [(0, nq, hd)])
    if parent == "mlp" and name == "gate_up":
        return 0, _blocks(tp, [(0, tp, inter // tp), (inter, tp, inter // tp)])
    if parent == "mlp" and name == "down_proj":
        return 1, _blocks(tp, [(0, tp, inter // tp)])
    if parent == "gdn" and name == "in_proj":
        return 0, _blocks(tp, conv_parts + [(cd, nv, dv), (cd + vd, nv, 1),
                                            (cd + vd + nv, nv, 1)])
    if parent == "gdn" and name == "conv1d":
        return 0, _blocks(tp, conv_parts)
    if parent == "gdn" and name in ("A_log", "dt_bias"):
        return 0, _blocks(tp, [(0, nv, 1)])
    if parent == "gdn" and name == "out_proj":
        return 1, _blocks(tp, [(0, nv, dv)])
    return None  # norms, the MTP fc: replicated


def _spec(axis: int | None) -> P:
    return P() if axis is None else P(*([None] * axis + [TP_AXIS]))


def param_specs(cfg: Config, tp: int) -> Params:
    """A Params tree of PartitionSpecs (the shard_map in_specs of the weights)."""
    def spec(path, shape):
        lay = layout_index(cfg, tp, path)
        return _spec(None if lay is None else lay[0])
    return _build(cfg, spec)


def to_layout(cfg: Config, tp: int, path: tuple, host: np.ndarray) -> np.ndarray:
    """One leaf in the standard (one-device) layout -> its tensor-parallel global layout."""
    lay = layout_index(cfg, tp, path)
    if lay is None:
        return host
    axis, idx = lay
    out = np.take(host, np.maximum(idx, 0), axis=axis)
    if (idx < 0).any():
        shape = [1] * out.ndim
        shape[axis] = len(idx)
        out = np.where((idx >= 0).reshape(shape), out, np.zeros((), out.dtype))
    return out


def place_leaf(cfg: Config, mesh: Mesh | None, path: tuple, host: np.ndarray) -> jax.Array:
    """Put one standard-layout host leaf on the mesh: each device receives only its shard
    (`make_array_from_callback` also works when the mesh spans processes)."""
    if mesh is None:
        return jax.device_put(host)
    tp = mesh.shape[TP_AXIS]
    g = to_layout(cfg, tp, path, host)
    lay = layout_index(cfg, tp, path)
    sharding = NamedSharding(mesh, _spec(None if lay is None else lay[0]))
    return jax.make_array_from_callback(g.shape, sharding, lambda index: g[index])


def place_params(cfg: Config, params: Params, mesh: Mesh | None) -> Params:
    """Lay a standard-layout Params tree out on the mesh, one leaf at a time."""
    if mesh is None:
        return params
    check_fp8(params, mesh_tp(mesh))
    if quant.has_fp8(params):     # tp = 1: the whole tree on the mesh's device
        return jax.device_put(params, NamedSharding(mesh, P()))
    for path in leaf_shapes(cfg):
        leaf = get_path(params, path)
        host = np.asarray(jax.device_get(leaf))
        params = replace_path(params, path, place_leaf(cfg, mesh, path, host))
    return params


def sharded_abstract_params(cfg: Config, mesh: Mesh, dtype="bfloat16") -> Params:
    """ShapeDtypeStructs with their NamedShardings (deviceless AOT, memory reports)."""
    tp = mesh.shape[TP_AXIS]

    def leaf(path, shape):
        lay = layout_index(cfg, tp, path)
        shape = list(shape)
        if lay is not None:
            shape[lay[0]] = len(lay[1])
        return jax.ShapeDtypeStruct(tuple(shape), leaf_dtype(path, dtype),
                                    sharding=NamedSharding(mesh, _spec(None if lay is None
                                                                       else lay[0])))
    return _build(cfg, leaf)


# --------------------------------------------------------------------------------------------
# Caches
# --------------------------------------------------------------------------------------------

def cache_specs(cache):
    """PartitionSpecs for a model.Cache: KV by head, GDN state by value head (conv by channel),
    n_pend and the MTP's saved hidden state replicated."""
    from mtpjax import model  # model imports nothing from here; avoid a cycle at import time

    def kv_spec(kv):
        if isinstance(kv, model.PagedKV):          # [NKV, pages, page_size, HD]
            return model.PagedKV(P(TP_AXIS), P(TP_AXIS), kv.page_size)
        return model.ContiguousKV(P(None, None, TP_AXIS), P(None, None, TP_AXIS))

    def layer_spec(c):
        if isinstance(c, model.GdnCache):
            return model.GdnCache(conv=P(None, None, TP_AXIS), state=P(None, TP_AXIS),
                                  pend_k=P(None, None, TP_AXIS), pend_v=P(None, None, TP_AXIS),
                                  pend_g=P(None, None, TP_AXIS),
                                  pend_beta=P(None, None, TP_AXIS))
        return kv_spec(c)

    return model.Cache(layers=tuple(layer_spec(c) for c in cache.layers),
                       mtp=None if cache.mtp is None else kv_spec(cache.mtp), n_pend=P(),
                       mtp_h=None if cache.mtp_h is None else P())


def init_paged_cache(cfg: Config, mesh: Mesh | None, lanes: int, num_pages: int,
                     page_size: int, num_pending: int = 1, dtype="float32"):
    """model.init_paged_cache, created shard by shard on the mesh (each device allocates only
    its heads' KV pages and GDN state; nothing is gathered)."""
    from mtpjax import model
    return sharded_cache(cfg, mesh, lambda c: model.init_paged_cache(
        c, lanes, num_pages, page_size, num_pending, dtype))


def sharded_cache(cfg: Config, mesh: Mesh | None, make):
    """make(cfg) -> a model.Cache, built shard by shard on the mesh (make(per-shard config) on
    each device; mesh None: make(cfg) on the default device)."""
    if mesh is None:
        return make(cfg)
    local = shard_config(cfg, mesh_tp(mesh))
    fn = lambda: make(local)
    return jax.jit(spmd(fn, mesh, (), cache_specs(jax.eval_shape(fn))))()


def on_mesh(body, cfg: Config, mesh: Mesh | None, params, cache, *rest, n_out: int,
            cache_at: int = 0, rest_specs: tuple | None = None, out_specs: tuple | None = None):
    """body(cfg, params, cache, *rest) -> n_out outputs, one of them (at cache_at) the cache:
    as is (mesh None), or under shard_map with the per-shard config: weights and caches by
    their tensor-parallel specs, everything else (lane state, sampling settings, tokens, page
    tables) replicated in and out, unless rest_specs / out_specs (one spec per rest argument /
    output, the cache's included) say otherwise (a snapshot store is sharded too)."""
    if mesh is None:
        return body(cfg, params, cache, *rest)
    tp = mesh_tp(mesh)
    cs = cache_specs(cache)
    outs = (tuple(cs if i == cache_at else P() for i in range(n_out)) if out_specs is None
            else tuple(out_specs))
    rests = (P(),) * len(rest) if rest_specs is None else tuple(rest_specs)
    pspecs = param_specs(cfg, tp) if tp > 1 else jax.tree.map(lambda _: P(), params)
    if tp > 1 and params.draft is not None:    # the draft vocabulary's head: rows split
        from mtpjax.draft_vocab import head_spec
        pspecs = dataclasses.replace(pspecs, draft=head_spec(tp))
    f = spmd(partial(body, shard_config(cfg, tp)), mesh, (pspecs, cs) + rests, outs)
    return f(params, cache, *rest)


def spmd(fn, mesh: Mesh, in_specs, out_specs):
    """shard_map over the mesh. Replication is not type-checked (check_vma=False): the Pallas
    kernels carry no varying-axis rules; outputs declared replicated are computed from reduced
    or gathered values only, identically on every shard."""
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                         check_vma=False)


# --------------------------------------------------------------------------------------------
# Meshes
# --------------------------------------------------------------------------------------------

def make_meshes(tp: int, dp: int, devices: Sequence | None = None) -> list[Mesh | None]:
    """dp meshes of tp devices each ([None] for tp = dp = 1 on the default device: the
    one-device programs, no shard_map).

    Devices are taken in order: replica r uses devices[r*tp:(r+1)*tp] (on a GPU host, keep a
    replica's devices on one NVLink island by ordering `devices`)."""
    for name, v in (("tp", tp), ("dp", dp)):
        if not isinstance(v, int) or v < 1:
            raise ShardingError(f"{name} must be a positive integer, got {v!r}")
    explicit = devices is not None
    devices = list(jax.devices() if devices is None else devices)
    if tp * dp > len(devices):
        raise ShardingError(f"tp={tp} x dp={dp} needs {tp * dp} devices, JAX sees "
                            f"{len(devices)} ({devices[0].platform}); on CPU set XLA_FLAGS="
                            f"--xla_force_host_platform_device_count={tp * dp} before JAX starts")
    if tp == 1 and dp == 1 and not explicit:
        return [None]
    return [Mesh(np.array(devices[r * tp:(r + 1) * tp]), (TP_AXIS,)) for r in range(dp)]


def mesh_tp(mesh: Mesh | None) -> int:
    return 1 if mesh is None else mesh.shape[TP_AXIS]


# --------------------------------------------------------------------------------------------
# Memory per device (shapes only: eval_shape, no arrays)
# --------------------------------------------------------------------------------------------

def memory_per_device(cfg: Config, tp: int, dtype="bfloat16", *, lanes: int = 1,
                      max_seq_len: int = 1024, page_size: int = 16, K: int = 1,
                      hbm_bytes: float = 141e9, hbm_use: float = 0.9,
                      weights: str = "dense", mtp_weights: str = "dense") -> dict:
    """Bytes one device holds under tensor parallelism, from shapes alone.

    weights: every leaf's share (sharded leaves / tp, padding and replicated KV / GDN key
    heads included; replicated leaves whole). gdn_state: `lanes` GDN slots with K+1 pending
    slots. kv: per token (all full-attention layers + the MTP layer, this device's KV heads)
    and per page. kv_tokens_fit: tokens of KV that fit in hbm_use x hbm_bytes after weights and
    GDN state. loader_peak_host: what the loaders hold on the host at once (the largest
    standard leaf + its tensor-parallel copy + the largest checkpoint tensor).
    weights="fp8" (tp = 1): the linears as FP8 + block scales (mtp_weights for the head).
    """
    from mtpjax import model
    from mtpjax.params import abstract_params, fp8_paths, hf_tensor_map
    check_tp(cfg, tp)
    fp8 = fp8_paths(cfg, weights, mtp_weights)
    local = shard_config(cfg, tp)
    part = {}                      # fused leaf -> its largest checkpoint tensor's bytes
    for s in hf_tensor_map(cfg):
        if s.rows is not None:
            b = int(np.prod(s.shape)) * leaf_dtype(s.path, dtype).itemsize
            part[s.path] = max(part.get(s.path, 0), b)
    weights, peak_host = 0, 0
    for path, shape in leaf_shapes(cfg).items():
        n = int(np.prod(shape)) * leaf_dtype(path, dtype).itemsize
        lay = layout_index(cfg, tp, path)
        g = n if lay is None else n * len(lay[1]) // shape[lay[0]]
        weights += g if lay is None else g // tp
        # hf_loader: the leaf (for a fused leaf, plus the tensor being copied in), and for
        # tp > 1 its tensor-parallel copy (to_layout) while the shards are sent
        peak_host = max(peak_host, n + part.get(path, 0) + (g if tp > 1 else 0))
    if fp8:
        if tp > 1:
            raise ShardingError("FP8 weights under tensor parallelism (tp > 1) are not "
                                "supported yet")
        weights = sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize
                      for x in jax.tree.leaves(abstract_params(cfg, dtype, fp8)))
    cache = jax.eval_shape(lambda: model.init_paged_cache(local, lanes, 1, page_size, K + 1,
                                                          dtype))
    gdn = sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(cache.gdn))
    per_tok = ((local.num_full_layers + (1 if cfg.has_mtp else 0)) * 2
               * local.num_key_value_heads * cfg.head_dim * np.dtype(dtype).itemsize)
    free = hbm_use * hbm_bytes - weights - gdn
    return {"tp": tp, "weights_bytes": int(weights), "gdn_state_bytes": int(gdn),
            "kv_bytes_per_token": int(per_tok), "kv_page_bytes": int(per_tok * page_size),
            "kv_bytes": int(per_tok * lanes * max_seq_len), "lanes": lanes,
            "max_seq_len": max_seq_len, "hbm_bytes": hbm_bytes, "hbm_use": hbm_use,
            "kv_tokens_fit": int(max(free, 0) // per_tok),
            "loader_peak_host_bytes": int(peak_host)}
