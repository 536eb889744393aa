"""Qwen3.5 text model and MTP head as pure functions over typed pytrees.

Data flow of one call (`forward`):

  tokens [B, T] --embed--> h [B, T, H]
    --Python loop over the decoder layers (params.layers / cache.layers, model order)-->
       each layer: h += mixer(rmsnorm_1p(h)); h += mlp(rmsnorm_1p(h))
       full-attention mixer: writes its K/V into its cache entry, attends causally
       GDN mixer: conv window + recurrent state from its cache entry (chunked or step mode)
    --final rmsnorm_1p--> post-norm hidden [B, T, H]   (what lm_head and the MTP consume)

Why a Python loop and not a `lax.scan` over stacked layers: every layer's weights and cache are
their own arrays, so each GEMM reads its weight buffer as is and each cache update is done in
place on the donated buffer. Compiled for the H200, the scan form copied every weight and cache
slice once per step (2-3x the bytes of the weights; `python -m experiments aot` audits it).
The cost is compile time, which grows with depth (reported by the aot command).

Every call describes its tokens with a `Segment`: lane b holds tokens[b, :n_valid[b]] at
absolute positions start[b] + t; the rest of the row is padding that touches no state. So one
compiled program serves a batch of unequal prompts (right padding) and idle lanes (n_valid 0).
A call's B lanes are the GDN cache slots [lane0, lane0 + B): an engine step runs only the
first B slots of a larger cache (a lane bucket), a prefill chunk runs one slot; packed prefill
chunks (several lanes' chunks in one call) name their slots one by one (lane0 an i32[B] vector).

The cache goes in and comes back out (donate it at the jit boundary). KV storage is swappable,
chosen by the storage type in `kv_attend`:
  `ContiguousKV` [lanes, max_len, NKV, HD] per layer: no page table; the teacher-forced entry
      points (`api.forward_logits`, `api.mtp_logits`) and the path-equivalence tests use it.
  `PagedKV` [NKV, num_pages, page_size, HD] per layer: the engine's pool. Every layer (and the
      MTP layer) shares one page table per lane, `Segment.page_table` i32[B, pages_per_lane]:
      token position p of lane b lives in page page_table[b, p // page_size], slot
      p % page_size. Written with `pallas_kernels.write_kv`, read with
      `paged_attention_reference` (kernels "reference") or the Pallas `paged_attention`
      ("pallas", or "interpret" for the Pallas interpreter on CPU).
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

import pallas_kernels as pk
from mtpjax import gdn as gdn_math
from mtpjax.config import FULL, Config
from mtpjax.params import FullLayer, GdnParams, LinearLayer, MlpParams, Params, AttnParams
from mtpjax.quant import Fp8Weight, fp8_dense


def _pytree(cls=None, *, static=()):
    def wrap(cls):
        cls = dataclasses.dataclass(frozen=True)(cls)
        names = [f.name for f in dataclasses.fields(cls)]
        return jax.tree_util.register_dataclass(
            cls, data_fields=[n for n in names if n not in static], meta_fields=list(static))
    return wrap(cls) if cls is not None else wrap


# --------------------------------------------------------------------------------------------
# Cache pytrees
# --------------------------------------------------------------------------------------------

@_pytree
class ContiguousKV:
    """One layer's K/V in lane-major contiguous storage. Leaves: [B, S, NKV, HD]."""
    k: jax.Array
    v: jax.Array


@_pytree(static=("page_size",))
class PagedKV:
    """One layer's paged K/V pool, shared by all lanes. Leaves: [NKV, num_pages, page_size, HD].

    Which page holds which lane's tokens is not stored here: the page table travels in the
    `Segment` of each call (the host allocator owns it, see kv_pool.py). Pages no lane owns
    hold garbage (tests fill them with NaN); reads never look past a lane's length.
    """
    k: jax.Array
    v: jax.Array
    page_size: int

    @property
    def num_pages(self) -> int:
        return self.k.shape[-3]


@_pytree
class GdnCache:
    """One Gated DeltaNet layer's state, per lane slot (leading axis B = the engine's lanes).

    conv:  [B, KC-1+P, CONV_DIM]  raw pre-conv inputs, oldest first; the valid history for
           the next block is rows [n_pend, n_pend + KC-1) (see gdn.py: pending replay).
    state: [B, NV, DK, DV] float32, committed state from before the pending block.
    pend_k [B, P, NV, DK], pend_v [B, P, NV, DV], pend_g / pend_beta [B, P, NV]: the
           last block's per-token delta-rule inputs, float32.
    """
    conv: jax.Array
    state: jax.Array
    pend_k: jax.Array
    pend_v: jax.Array
    pend_g: jax.Array
    pend_beta: jax.Array


@_pytree
class Cache:
    layers: tuple               # per decoder layer, model order: ContiguousKV | PagedKV (full
                                # attention) or GdnCache (Gated DeltaNet)
    mtp: ContiguousKV | PagedKV | None  # the MTP layer's own KV
    n_pend: jax.Array           # i32[B]: pending tokens to replay at the next step (all layers)
    mtp_h: jax.Array | None = None  # [B, H]: per lane, the target's post-norm hidden state at
                                # the last position of its latest prefill chunk (MTP models):
                                # a prefix-cache snapshot keeps it, so a hit whose next token
                                # differs can rewrite the MTP KV there (engine/snapshots.py)

    @property
    def gdn(self) -> tuple:
        return tuple(c for c in self.layers if isinstance(c, GdnCache))

    @property
    def kv(self) -> tuple:
        """The full-attention layers' KV storage, then the MTP layer's (when present)."""
        out = tuple(c for c in self.layers if not isinstance(c, GdnCache))
        return out + ((self.mtp,) if self.mtp is not None else ())

    @property
    def num_pending_slots(self) -> int:
        return self.gdn[0].pend_k.shape[1]


def map_kv(cache: Cache, fn) -> Cache:
    """Apply fn to every KV storage (full-attention layers and the MTP layer)."""
    layers = tuple(c if isinstance(c, GdnCache) else fn(c) for c in cache.layers)
    return dataclasses.replace(cache, layers=layers,
                               mtp=None if cache.mtp is None else fn(cache.mtp))


def init_cache(cfg: Config, batch: int, max_len: int, num_pending: int = 1,
               dtype="float32") -> Cache:
    """An empty cache for `batch` lanes of up to `max_len` tokens.

    num_pending = k + 1 for a speculative engine with k drafts (1 for plain decoding).
    """
    dt = jnp.dtype(dtype)

    def kv():
        shape = (batch, max_len, cfg.num_key_value_heads, cfg.head_dim)
        return ContiguousKV(jnp.zeros(shape, dt), jnp.zeros(shape, dt))

    return _cache(cfg, batch, num_pending, dt, kv)


def init_paged_cache(cfg: Config, lanes: int, num_pages: int, page_size: int,
                     num_pending: int = 1, dtype="float32") -> Cache:
    """An empty engine cache: a KV pool of `num_pages` pages of `page_size` tokens per
    full-attention layer and for the MTP layer, and GDN state in `lanes` per-lane slots."""
    if page_size < 1 or num_pages < 1:
        raise ValueError(f"page_size and num_pages must be >= 1, got {page_size}, {num_pages}")
    dt = jnp.dtype(dtype)

    def kv():
        shape = (cfg.num_key_value_heads, num_pages, page_size, cfg.head_dim)
        return PagedKV(jnp.zeros(shape, dt), jnp.zeros(shape, dt), page_size)

    return _cache(cfg, lanes, num_pending, dt, kv)


def _cache(cfg: Config, batch: int, P: int, dt, kv) -> Cache:
    kc = cfg.linear_conv_kernel_dim - 1
    nv, dk, dv = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    f32 = jnp.float32

    def gdn():
        return GdnCache(
            conv=jnp.zeros((batch, kc + P, cfg.conv_dim), dt),
            state=jnp.zeros((batch, nv, dk, dv), f32),
            pend_k=jnp.zeros((batch, P, nv, dk), f32),
            pend_v=jnp.zeros((batch, P, nv, dv), f32),
            pend_g=jnp.zeros((batch, P, nv), f32),
            pend_beta=jnp.zeros((batch, P, nv), f32))

    return Cache(
        layers=tuple(kv() if kind == FULL else gdn() for kind in cfg.layer_types),
        mtp=kv() if cfg.has_mtp else None,
        n_pend=jnp.zeros((batch,), jnp.int32),
        mtp_h=jnp.zeros((batch, cfg.hidden_size), dt) if cfg.has_mtp else None,
    )


@_pytree
class Segment:
    """Which tokens of a [B, T] call are real: lane b has n_valid[b] tokens from position start[b].

    page_table (paged KV only): i32[B, pages_per_lane], the pool pages of each lane in position
    order. Every page that holds a position < start + n_valid must be allocated; unallocated
    entries should hold num_pages (out of range), which makes a stray write a no-op.
    lane0: the call's lanes are the cache's GDN slots [lane0, lane0 + B): 0 (a Python int: the
    first B slots, e.g. a lane bucket) or an i32 scalar (one prefill lane); or an i32[B] vector
    naming each row's slot (packed prefill chunks): a slot out of range (>= the cache's slots)
    marks a padding row, which reads zeros and writes nothing.
    """
    start: jax.Array    # i32[B]
    n_valid: jax.Array  # i32[B]
    page_table: jax.Array | None = None
    lane0: jax.Array | int = 0

    @staticmethod
    def full(batch: int, length: int) -> "Segment":
        return Segment(jnp.zeros((batch,), jnp.int32), jnp.full((batch,), length, jnp.int32))


def _first_slots(lane0) -> bool:
    """lane0 is the static 0: the call's lanes are the cache's first slots."""
    return isinstance(lane0, int) and lane0 == 0


def _row_slots(lane0) -> bool:
    """lane0 names each row's slot (an i32[B] vector: packed prefill chunks)."""
    return getattr(lane0, "ndim", 0) == 1


def take_slots(tree, lane0, n: int):
    """Rows [lane0, lane0 + n) of every [B_cache, ...] leaf (a no-op for the whole cache); with
    a vector lane0, rows lane0[i] (zeros for a slot out of range: a padding row)."""
    def take(a):
        if _row_slots(lane0):
            return jnp.take(a, lane0, axis=0, mode="fill", fill_value=0)
        if _first_slots(lane0) and a.shape[0] == n:
            return a
        return lax.dynamic_slice_in_dim(a, lane0, n, axis=0)
    return jax.tree.map(take, tree)


def put_slots(tree, lane0, sub):
    """Write `sub`'s rows back at [lane0, lane0 + n): in place on a donated cache; with a
    vector lane0, at rows lane0[i] (a slot out of range is dropped: a padding row)."""
    def put(a, s):
        if _row_slots(lane0):
            return a.at[lane0].set(s.astype(a.dtype), mode="drop")
        if s.shape == a.shape and _first_slots(lane0):
            return s
        return lax.dynamic_update_slice_in_dim(a, s.astype(a.dtype), lane0, axis=0)
    return jax.tree.map(put, tree, sub)


# --------------------------------------------------------------------------------------------
# Small blocks
# --------------------------------------------------------------------------------------------

def dense(x, w):
    """y = x @ w.T with w stored [out, in]; f32 accumulation, one rounding to x's dtype.
    An FP8 weight (quant.Fp8Weight) is read as FP8 by the block-scaled matmul."""
    if isinstance(w, Fp8Weight):
        return fp8_dense(x, w)
    return jnp.einsum("...i,oi->...o", x, w, preferred_element_type=jnp.float32).astype(x.dtype)


def rmsnorm_1p(x, w, eps):
    """Zero-centred RMSNorm: x_hat * (1 + w), computed in f32 and rounded once (spec §3.1a)."""
    xf = x.astype(jnp.float32)
    y = xf * lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (y * (1.0 + w.astype(jnp.float32))).astype(x.dtype)


def gated_rmsnorm(o, z, w, eps):
    """GDN output norm: plain weight, then SiLU(z) gate (spec §3.1b, HF rounding order)."""
    dt = z.dtype
    xf = o.astype(jnp.float32)
    y = (xf * lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)).astype(dt)
    y = w.astype(dt) * y
    return (y.astype(jnp.float32) * jax.nn.silu(z.astype(jnp.float32))).astype(dt)


def l2norm(x, eps=1e-6):
    return x * lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def row_parallel(cfg: Config, x, w):
    """dense(x, w) for a weight split by input columns under tensor parallelism: each shard's
    float32 partial sum is all-reduced over cfg.tp_axis, then rounded once (the one-device
    GEMM's float32 accumulation, in another order). Without tp it is dense."""
    if cfg.tp_axis is None:
        return dense(x, w)
    if isinstance(w, Fp8Weight):
        raise NotImplementedError("FP8 weights under tensor parallelism")  # tensor_parallel checks first
    y = jnp.einsum("...i,oi->...o", x, w, preferred_element_type=jnp.float32)
    return lax.psum(y, cfg.tp_axis).astype(x.dtype)


def mlp_block(cfg: Config, p: MlpParams, x, out=None):
    gate, up = jnp.split(dense(x, p.gate_up), 2, axis=-1)        # one GEMM over [gate | up]
    return (out or partial(row_parallel, cfg))(jax.nn.silu(gate) * up, p.down_proj)


def dense_partials(x, w):
    """dense(x, w) before its last step: f32 [S, ..., out] partial sums over S slices of the
    contraction (split-K done here), for a consumer that sums them itself (the Pallas add +
    RMSNorm: the GEMM then needs no reduction kernel between them; XLA's own split-K put one
    there). S = 8 for a contraction of >= 16k, else 4 (what XLA picked for these GEMMs at
    1-5 rows, deviceless); dense's rounded output where w is FP8 or S does not divide it."""
    K = x.shape[-1]
    S = 8 if K >= 16384 else 4
    if isinstance(w, Fp8Weight) or K % S:
        return dense(x, w)
    xs = x.reshape(x.shape[:-1] + (S, K // S))
    ws = w.reshape(w.shape[0], S, K // S)
    return jnp.einsum("...si,osi->s...o", xs, ws, preferred_element_type=jnp.float32)


def rope_cos_sin(cfg: Config, positions, dtype):
    """NeoX partial RoPE tables for positions [B, T] -> cos, sin [B, T, RD] (spec §3.5)."""
    rd = cfg.rotary_dim
    inv_freq = cfg.rope_theta ** (-jnp.arange(0, rd, 2, dtype=jnp.float32) / rd)
    ang = positions.astype(jnp.float32)[..., None] * inv_freq
    ang = jnp.concatenate([ang, ang], axis=-1)
    return jnp.cos(ang).astype(dtype), jnp.sin(ang).astype(dtype)


def apply_rope(x, cos, sin, rd):
    """x [B, T, N, HD]; rotate the first rd dims (rotate-half), pass the rest through."""
    xr, xp = x[..., :rd], x[..., rd:]
    half = rd // 2
    rot = jnp.concatenate([-xr[..., half:], xr[..., :half]], axis=-1)
    xr = xr * cos[:, :, None, :] + rot * sin[:, :, None, :]
    return jnp.concatenate([xr, xp], axis=-1)


# --------------------------------------------------------------------------------------------
# Attention storage: write + attend (the part the paged pool replaces)
# --------------------------------------------------------------------------------------------

def kv_attend(kv: ContiguousKV | PagedKV, q, k, v, seg: Segment, sm_scale: float,
              kernels: str = "reference"):
    """Write this call's K/V into one layer's storage and attend causally.

    kv: one layer (ContiguousKV leaves [B, S, NKV, HD], or PagedKV leaves
    [NKV, num_pages, page_size, HD] with seg.page_table); q [B, T, NQ, HD]; k, v [B, T, NKV, HD].
    Returns o [B, T, NQ, HD] (f32 softmax) and the updated storage. Rows t >= n_valid are
    padding: they write nothing (their output is unspecified, zeros on the paged path).
    """
    if isinstance(kv, PagedKV):
        return _paged_attend(kv, q, k, v, seg, sm_scale, kernels)
    return _contiguous_attend(kv, q, k, v, seg, sm_scale)


def _paged_attend(kv: PagedKV, q, k, v, seg: Segment, sm_scale: float, kernels: str):
    kv = kv_write(kv, k, v, seg)
    kv_lens = seg.start + seg.n_valid     # tokens in the cache after this call's write
    attend = (pk.paged_attention_reference if kernels == "reference" else
              partial(pk.paged_attention, interpret=kernels == "interpret"))
    o = attend(q, kv.k, kv.v, seg.page_table, kv_lens, seg.n_valid, sm_scale=sm_scale)
    return o, kv


def kv_write(kv: ContiguousKV | PagedKV, k, v, seg: Segment):
    """Write this call's valid K/V rows (t < n_valid, at positions start + t) into one
    layer's storage, attending nothing: what the MTP's KV fill needs (see mtp_fill_kv)."""
    if isinstance(kv, PagedKV):
        if seg.page_table is None:
            raise ValueError("paged KV storage needs a Segment with a page_table")
        k_pages, v_pages = pk.write_kv(kv.k, kv.v, k, v, seg.page_table,
                                       seg.start + seg.n_valid, seg.n_valid)
        return PagedKV(k_pages, v_pages, kv.page_size)
    full = kv
    return put_slots(full, seg.lane0, _contiguous_write(take_slots(kv, seg.lane0, k.shape[0]),
                                                        k, v, seg))


def _contiguous_write(kv: ContiguousKV, k, v, seg: Segment) -> ContiguousKV:
    B, T = k.shape[:2]
    S = kv.k.shape[1]
    t = jnp.arange(T)
    pos = seg.start[:, None] + t[None, :]                               # [B, T]
    slot = jnp.where(t[None, :] < seg.n_valid[:, None], pos, S)         # invalid -> dropped
    b_idx = jnp.broadcast_to(jnp.arange(B)[:, None], (B, T))
    return ContiguousKV(kv.k.at[b_idx, slot].set(k.astype(kv.k.dtype), mode="drop"),
                        kv.v.at[b_idx, slot].set(v.astype(kv.v.dtype), mode="drop"))


def _contiguous_attend(kv: ContiguousKV, q, k, v, seg: Segment, sm_scale: float):
    B, T, NQ, HD = q.shape
    full = kv
    kv = _contiguous_write(take_slots(kv, seg.lane0, B), k, v, seg)
    k_all, v_all = kv.k, kv.v
    S, NKV = k_all.shape[1], k_all.shape[2]
    pos = seg.start[:, None] + jnp.arange(T)[None, :]                   # [B, T]

    G = NQ // NKV
    qg = q.reshape(B, T, NKV, G, HD)
    s = jnp.einsum("btngd,bsnd->bngts", qg, k_all,
                   preferred_element_type=jnp.float32) * sm_scale       # [B, NKV, G, T, S]
    visible = jnp.arange(S)[None, None, :] <= pos[:, :, None]           # [B, T, S]
    s = jnp.where(visible[:, None, None], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1).astype(q.dtype)
    o = jnp.einsum("bngts,bsnd->btngd", p, v_all.astype(q.dtype),
                   preferred_element_type=jnp.float32).astype(q.dtype)
    return o.reshape(B, T, NQ, HD), put_slots(full, seg.lane0, kv)


def _project_qkv(cfg: Config, p: AttnParams, x, cos, sin):
    """x [B, T, H] (normed) -> q [B, T, NQ, HD] (normed, roped), gate [B, T, NQ*HD],
    k [B, T, NKV, HD] (normed, roped), v [B, T, NKV, HD]."""
    return _split_qkv(cfg, p, dense(x, p.qkv), cos, sin)     # one GEMM over [q | k | v]


def _split_qkv(cfg: Config, p: AttnParams, qkv, cos, sin):
    """The fused projection qkv [B, T, (2 NQ + 2 NKV) HD] -> q, gate, k, v as _project_qkv."""
    B, T, _ = qkv.shape
    nq, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    qg = qkv[..., :2 * nq * hd].reshape(B, T, nq, 2 * hd)
    q, gate = qg[..., :hd], qg[..., hd:]
    k = qkv[..., 2 * nq * hd:(2 * nq + nkv) * hd].reshape(B, T, nkv, hd)
    v = qkv[..., (2 * nq + nkv) * hd:].reshape(B, T, nkv, hd)
    q = apply_rope(rmsnorm_1p(q, p.q_norm, cfg.rms_norm_eps), cos, sin, cfg.rotary_dim)
    k = apply_rope(rmsnorm_1p(k, p.k_norm, cfg.rms_norm_eps), cos, sin, cfg.rotary_dim)
    return q, gate.reshape(B, T, nq * hd), k, v


def attention_block(cfg: Config, p: AttnParams, x, kv, seg: Segment, cos, sin,
                    kernels: str = "reference"):
    """Gated full attention (spec §3.4). x [B, T, H] (already normed)."""
    o, kv = _attend_gated(cfg, p, dense(x, p.qkv), kv, seg, cos, sin, kernels)
    return row_parallel(cfg, o, p.o_proj), kv


def _attend_gated(cfg: Config, p: AttnParams, qkv, kv, seg: Segment, cos, sin, kernels: str):
    """Attention between the fused projection qkv [B, T, ...] and o_proj: q/k norms and rope,
    KV write + paged attention, the sigmoid gate. Returns (o [B, T, NQ*HD], kv).

    On the Pallas path a paged decode / verify block (T <= pk.QK_MAX_TOKENS, and a rotary
    half the compiled kernel takes: pk.qk_norm_rope_fits) runs it as three
    kernels (XLA made twelve on the H200): pk.qk_norm_rope_write (split, norms, rope, the KV
    write in place, q folded into the attention kernel's rows), the attention kernel, and
    one that merges its splits and applies the gate (pk.paged_attention_gated)."""
    B, T, _ = qkv.shape
    if (kernels != "reference" and isinstance(kv, PagedKV)
            and pk.qk_norm_rope_fits(T, cfg.rotary_dim, kernels == "interpret")):
        if seg.page_table is None:
            raise ValueError("paged KV storage needs a Segment with a page_table")
        interpret = kernels == "interpret"
        kv_lens = seg.start + seg.n_valid
        qf, k_pages, v_pages = pk.qk_norm_rope_write(
            qkv, p.q_norm, p.k_norm, cos, sin, kv.k, kv.v, seg.page_table, kv_lens, seg.n_valid,
            num_q_heads=cfg.num_attention_heads, rotary_dim=cfg.rotary_dim,
            eps=cfg.rms_norm_eps, interpret=interpret)
        o = pk.paged_attention_gated(qf, k_pages, v_pages, seg.page_table, kv_lens, seg.n_valid,
                                     qkv, num_q_heads=cfg.num_attention_heads,
                                     sm_scale=cfg.head_dim ** -0.5, interpret=interpret)
        return o, PagedKV(k_pages, v_pages, kv.page_size)
    q, gate, k, v = _split_qkv(cfg, p, qkv, cos, sin)
    o, kv = kv_attend(kv, q, k, v, seg, cfg.head_dim ** -0.5, kernels)
    return o.reshape(B, T, gate.shape[-1]) * jax.nn.sigmoid(gate), kv


# --------------------------------------------------------------------------------------------
# Gated DeltaNet block
# --------------------------------------------------------------------------------------------

def _take_rows(x, start, n):
    """x [B, R, C]; rows [start[b], start[b] + n) of each lane -> [B, n, C]."""
    idx = start[:, None] + jnp.arange(n)[None, :]
    return jnp.take_along_axis(x, idx[:, :, None], axis=1)


def gdn_block(cfg: Config, p: GdnParams, x, c: GdnCache, n_pend, seg: Segment, mode: str,
              kernels: str = "reference"):
    """Gated DeltaNet mixer (spec §3.6). x [B, T, H] (already normed).

    c: this layer's state for every lane slot; the call uses slots [seg.lane0, seg.lane0 + B).
    n_pend: i32[B], the call's lanes' pending tokens.
    mode "chunk" (prefill): chunked delta rule from the committed state, which must have no
      pending tokens (a fresh lane, or the previous prefill chunk); the end state becomes
      committed and nothing is left pending.
    mode "step" (decode / verify, T <= P): pending replay, then the recurrence over the block;
      the block becomes the pending buffer (see gdn.py).
    """
    y, c = _gdn_mix(cfg, p, _gdn_in_proj(p, x), c, n_pend, seg, mode, kernels)
    return row_parallel(cfg, y, p.out_proj), c


def _gdn_in_proj(p: GdnParams, x):
    """x [..., H] -> [..., CONV + NV*DV + 2 NV]: one GEMM over [qkv | z | b | a]."""
    proj = dense(x, p.in_proj)
    if p.in_proj_ba is not None:                                   # FP8 [qkv|z] + dense [b|a]
        proj = jnp.concatenate([proj, dense(x, p.in_proj_ba)], axis=-1)
    return proj


def _gdn_mix(cfg: Config, p: GdnParams, proj, c: GdnCache, n_pend, seg: Segment, mode: str,
             kernels: str, proj_parts=None):
    """The GDN mixer between in_proj and out_proj: conv window, delta rule (chunked or
    pending replay), gated norm. proj [B, T, ...] (_gdn_in_proj); proj_parts: the same as
    f32 split partials [S, B, T, ...] (dense_partials), which the Pallas kernel then reads
    instead. Returns (y [B, T, NV*DV], c with the call's slots updated)."""
    B, T, _ = proj.shape
    kc = cfg.linear_conv_kernel_dim - 1
    nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    kd, cd = cfg.linear_key_dim, cfg.conv_dim
    P = c.pend_k.shape[1]
    if mode == "step" and T > P:
        raise ValueError(f"a step of {T} tokens needs at least {T} pending slots, cache has {P}")
    cv = take_slots(c, seg.lane0, B)                               # the call's lanes
    mixed = proj[..., :cd]                                         # [B, T, CONV]
    z = proj[..., cd:cd + nv * dv].reshape(B, T, nv, dv)
    b = proj[..., cd + nv * dv:cd + nv * dv + nv]                  # [B, T, NV]
    a = proj[..., cd + nv * dv + nv:]

    hist = _take_rows(cv.conv, n_pend, kc)                         # [B, KC-1, CONV]
    if mode == "chunk":  # a chunk at position 0 starts a sequence: no history, zero state
        fresh = seg.start == 0                                     # [B]
        hist = jnp.where(fresh[:, None, None], 0, hist)
        cv = dataclasses.replace(cv, state=jnp.where(fresh[:, None, None, None], 0.0, cv.state))
    xs = jnp.concatenate([hist, mixed.astype(cv.conv.dtype)], axis=1)   # [B, KC-1+T, CONV]
    w = p.conv1d[:, 0, :].astype(proj.dtype)                       # [CONV, KC]
    conv = sum(xs[:, j:j + T] * w[:, j] for j in range(kc + 1))
    mixed = jax.nn.silu(conv.astype(jnp.float32)).astype(proj.dtype)

    q = mixed[..., :kd].reshape(B, T, nk, dk)
    k = mixed[..., kd:2 * kd].reshape(B, T, nk, dk)
    v = mixed[..., 2 * kd:].reshape(B, T, nv, dv).astype(jnp.float32)
    rep = nv // nk
    q = jnp.repeat(q, rep, axis=2).astype(jnp.float32)             # v-head h <- k-head h // rep
    k = jnp.repeat(k, rep, axis=2).astype(jnp.float32)
    q = l2norm(q) * (dk ** -0.5)
    k = l2norm(k)
    g, beta = pk.gate_values(a, b, p.A_log, p.dt_bias)

    live = jnp.arange(T)[None, :] < seg.n_valid[:, None]           # [B, T]
    k = jnp.where(live[..., None, None], k, 0.0)
    v = jnp.where(live[..., None, None], v, 0.0)
    beta = jnp.where(live[..., None], beta, 0.0)
    g = jnp.where(live[..., None], g, 0.0)

    if mode == "chunk":
        o, S = gdn_math.prefill(q, k, v, g, beta, cv.state, kernels)
        window = _take_rows(xs, seg.n_valid, kc)                   # last KC-1 valid raw inputs
        conv_new = jnp.concatenate([window, cv.conv[:, kc:]], axis=1)
        new = dataclasses.replace(cv, conv=conv_new, state=S)
    else:
        # The kernel reads and writes the first B slots of the whole state in place; anything
        # else works on the call's slots.
        # The block's T pending slots and KC-1+T conv rows are written in place, not all P
        # (K + 1) of them: the next step reads only its first n_pend <= T slots and rows
        # [n_pend, n_pend + KC-1), so what lies past T is never read. A depth-0 step of a
        # K-slot engine then writes what the stock step writes.
        at = lambda a, u: lax.dynamic_update_slice(
            a, u.astype(a.dtype), (seg.lane0,) + (0,) * (a.ndim - 1))
        first = _first_slots(seg.lane0)
        # The Pallas kernel (on the cache's first slots, one program per head) computes
        # the gates itself, writes the new pending buffers in place after its replay read
        # the old ones and applies the output norm: on the H200 that saves the gate
        # kernels, the pending writes (and the two copies of pend_v per layer XLA made to
        # write it beside the kernel's read) and the norm kernel (issue 36).
        # The conv output goes in packed, q and k as raw key-head rows (the kernel
        # normalises them); rows past a lane's valid tokens are not masked: their outputs
        # and pending slots are never used (n_pend <= n_valid).
        if kernels != "reference" and first:
            y, S, pk_, pv_, pg_, pb_ = gdn_math.step(
                c.state, c.pend_k, c.pend_v, c.pend_g, c.pend_beta, n_pend, mixed, None, None,
                None, None, kernels, live=seg.n_valid > 0,
                gates=(proj if proj_parts is None else proj_parts, p.A_log, p.dt_bias),
                gate_offset=cd + nv * dv, write_pending=True, norm_weight=p.norm,
                norm_offset=cd, norm_eps=cfg.rms_norm_eps, key_heads=nk,
                ab_dtype=None if proj_parts is None else proj.dtype)
            return y.reshape(B, T, nv * dv), GdnCache(
                conv=at(c.conv, xs), state=S, pend_k=pk_, pend_v=pv_, pend_g=pg_,
                pend_beta=pb_)
        o, S = gdn_math.step(c.state if first else cv.state, cv.pend_k, cv.pend_v, cv.pend_g,
                             cv.pend_beta, n_pend, q, k, v, g, beta, kernels,
                             live=seg.n_valid > 0)
        state = S if S.shape == c.state.shape and first else at(c.state, S)
        y = gated_rmsnorm(o.astype(proj.dtype), z, p.norm, cfg.rms_norm_eps)
        return y.reshape(B, T, nv * dv), GdnCache(
            conv=at(c.conv, xs), state=state, pend_k=at(c.pend_k, k), pend_v=at(c.pend_v, v),
            pend_g=at(c.pend_g, g), pend_beta=at(c.pend_beta, beta))

    y = gated_rmsnorm(o.astype(proj.dtype), z, p.norm, cfg.rms_norm_eps)
    return y.reshape(B, T, nv * dv), put_slots(c, seg.lane0, new)


# --------------------------------------------------------------------------------------------
# Decoder layers and the whole model
# --------------------------------------------------------------------------------------------

def full_layer(cfg, p: FullLayer, h, kv, seg, cos, sin, kernels="reference", final_norm=None):
    """One full-attention decoder layer (the MTP's): (h after it, kv); with final_norm,
    (rmsnorm_1p(h after it, final_norm), kv). Its adds ride with the norms (add_norm)."""
    eps = cfg.rms_norm_eps
    out = _residual_out(cfg, kernels, h)
    _, x = add_norm(h, None, p.input_layernorm, eps, kernels)
    o, kv = _attend_gated(cfg, p.attn, dense(x, p.attn.qkv), kv, seg, cos, sin, kernels)
    h, x = add_norm(h, out(o, p.attn.o_proj), p.post_attention_layernorm, eps, kernels)
    d = mlp_block(cfg, p.mlp, x, out)
    if final_norm is not None:
        return add_norm(h, d, final_norm, eps, kernels)[1], kv
    return h + (d if d.ndim == h.ndim else jnp.sum(d, 0).astype(h.dtype)), kv


PARTIALS_MAX_ROWS = 16


def _residual_out(cfg: Config, kernels: str, h):
    """The projections whose outputs go into the residual: on the Pallas path (one device),
    for at most PARTIALS_MAX_ROWS token rows (decode and verify steps: where a GEMM is split
    over its contraction anyway, and the partials cost next to nothing; a prefill chunk's
    would cost S times its output), as split-K partials that the next add + RMSNorm kernel
    sums (dense_partials); else row_parallel."""
    rows = h.size // h.shape[-1]
    if kernels != "reference" and cfg.tp_axis is None and rows <= PARTIALS_MAX_ROWS:
        return dense_partials
    return partial(row_parallel, cfg)


@dataclasses.dataclass(frozen=True)
class Group:
    """One part of a forward call: tokens [B, T] described by seg, run in `mode` ("chunk":
    a prefill chunk, "step": decode / verify blocks). A call over several groups (a decode
    batch and a prefill chunk: one engine iteration) runs every GEMM once over all of their
    tokens, so the weights are read once; only the mixers (attention over each group's pages,
    the GDN recurrence in each group's mode) run per group, in order."""
    tokens: jax.Array
    seg: Segment
    mode: str


def _cat(xs: list):
    """Per-group arrays [B_g, T_g, ...] -> one [N, ...] for token-wise work (a lone group
    stays as it is)."""
    if len(xs) == 1:
        return xs[0]
    return jnp.concatenate([x.reshape((-1,) + x.shape[2:]) for x in xs])


def _uncat(y, shapes: list):
    """The inverse of _cat for groups of [B_g, T_g] tokens."""
    if len(shapes) == 1:
        return [y]
    out, i = [], 0
    for B, T in shapes:
        out.append(y[i:i + B * T].reshape((B, T) + y.shape[1:]))
        i += B * T
    return out


def add_norm(h, d, w, eps, kernels: str):
    """(h + d, rmsnorm_1p(h + d, w)); d None: (h, rmsnorm_1p(h, w)). The Pallas kernels make it
    one kernel with both outputs (pallas_kernels/rmsnorm.py: XLA made three on the H200);
    the reference path runs the model's own ops."""
    if kernels == "reference":
        if d is not None:
            h = h + d
        return h, rmsnorm_1p(h, w, eps)
    return pk.add_rmsnorm(h, d, w, eps=eps, interpret=kernels == "interpret")


def _layer(cfg: Config, kind: str, p, h, d, c, groups, n_pends, ropes, kernels: str):
    """One decoder layer over every group's tokens: h + d is its input (d: the previous
    layer's MLP output, not yet added, so the add rides with this layer's input norm; None
    for the first layer), in _cat form [N, H] (or [B, T, H] for one group). Returns
    (h, the MLP output to add to it, this layer's cache)."""
    eps = cfg.rms_norm_eps
    shapes = [g.tokens.shape for g in groups]
    h, x = add_norm(h, d, p.input_layernorm, eps, kernels)
    out = _residual_out(cfg, kernels, h)
    if kind == FULL:
        parts = []
        for g, qkv, (cos, sin) in zip(groups, _uncat(dense(x, p.attn.qkv), shapes), ropes):
            o, c = _attend_gated(cfg, p.attn, qkv, c, g.seg, cos, sin, kernels)
            if len(groups) > 1:
                # order this group's attention before the next group's KV write into the
                # same pool: otherwise XLA may copy the whole pool to keep both (the H200
                # audit showed two copies of every layer's K and V pool)
                o, c = lax.optimization_barrier((o, c))
            parts.append(o)
        mix = out(_cat(parts), p.attn.o_proj)
    else:
        parts = []
        if (out is dense_partials and len(groups) == 1 and groups[0].mode == "step"
                and p.gdn.in_proj_ba is None):
            # a decode step alone: the in-projection as split partials that the conv fusion
            # and the GDN kernel sum (no reduction kernel after the GEMM)
            ip = dense_partials(x, p.gdn.in_proj)
            projs = [(jnp.sum(ip, 0).astype(x.dtype), ip)] if ip.ndim == x.ndim + 1 else None
        else:
            projs = None
        for g, proj, n_pend in zip(groups, projs or _uncat(_gdn_in_proj(p.gdn, x), shapes),
                                   n_pends):
            proj, proj_parts = proj if projs else (proj, None)
            y, c = _gdn_mix(cfg, p.gdn, proj, c, n_pend, g.seg, g.mode, kernels, proj_parts)
            parts.append(y)
        mix = out(_cat(parts), p.gdn.out_proj)
    h, x = add_norm(h, mix, p.post_attention_layernorm, eps, kernels)
    return h, mlp_block(cfg, p.mlp, x, out), c


def forward(cfg: Config, params: Params, cache: Cache, tokens, seg: Segment, mode: str,
            kernels: str = "reference"):
    """Run the target model over tokens [B, T]; returns (post-norm hidden [B, T, H], cache).

    mode: "chunk" (prefill chunks) or "step" (decode / verify blocks of at most P tokens).
    After a call every lane's n_valid tokens are pending ("step": n_pend = n_valid, which a
    speculative engine lowers to accepted + 1 once it knows) or none are ("chunk").
    """
    (h,), cache = forward_groups(cfg, params, cache, [Group(tokens, seg, mode)], kernels)
    return h, cache


def forward_groups(cfg: Config, params: Params, cache: Cache, groups, kernels: str = "reference"):
    """`forward` over several groups of tokens in one pass (see Group): returns (the post-norm
    hidden [B_g, T_g, H] of each group, cache).

    The groups' mixers run in list order within each layer, so a later group sees what an
    earlier one wrote in that layer: a lane's prefill chunk, then its first decode token
    (which attends the chunk's KV and continues from its GDN state). Each group's pending
    count is read at the start of the call, so a lane that an earlier group prefills must
    enter with n_pend = 0 (steps.iteration ensures it).
    """
    groups = list(groups)
    shapes = [g.tokens.shape for g in groups]
    dt = params.embed.dtype
    h = _cat([embed_tokens(cfg, params, g.tokens) for g in groups])
    ropes = [rope_cos_sin(cfg, g.seg.start[:, None] + jnp.arange(g.tokens.shape[1])[None, :], dt)
             for g in groups]
    n_pends = [take_slots(cache.n_pend, g.seg.lane0, g.tokens.shape[0]) for g in groups]
    layers = []
    d = None
    for kind, p, c in zip(cfg.layer_types, params.layers, cache.layers):
        h, d, c = _layer(cfg, kind, p, h, d, c, groups, n_pends, ropes, kernels)
        layers.append(c)
    _, h = add_norm(h, d, params.final_norm, cfg.rms_norm_eps, kernels)
    n_pend = cache.n_pend
    for g in groups:
        new = jnp.zeros_like(g.seg.n_valid) if g.mode == "chunk" else g.seg.n_valid
        n_pend = put_slots(n_pend, g.seg.lane0, new)
    cache = dataclasses.replace(cache, layers=tuple(layers), n_pend=n_pend)
    return _uncat(h, shapes), cache


def embed_tokens(cfg: Config, params: Params, tokens):
    """tokens [...] -> embeddings [..., H]. Under tensor parallelism each shard holds a block
    of vocabulary rows: it looks up the tokens in its block (zeros elsewhere) and an
    all-reduce assembles them (exact: one nonzero term per token)."""
    if cfg.tp_axis is None:
        return params.embed[tokens]
    rows = params.embed.shape[0]
    local = tokens - lax.axis_index(cfg.tp_axis) * rows
    mine = (local >= 0) & (local < rows)
    h = jnp.where(mine[..., None], params.embed[jnp.clip(local, 0, rows - 1)], 0)
    return lax.psum(h, cfg.tp_axis)


def lm_head(params: Params, h):
    """Post-norm hidden [..., H] -> float32 logits [..., V] (tied heads read the embedding).
    Under tensor parallelism: this shard's block of the (padded) vocabulary."""
    w = params.embed if params.lm_head is None else params.lm_head
    return jnp.einsum("...i,vi->...v", h, w, preferred_element_type=jnp.float32)


def full_logits(cfg: Config, params: Params, h):
    """float32 logits [..., V] over the whole vocabulary on every shard: under tensor
    parallelism the vocabulary blocks are all-gathered (what the sampler needs)."""
    logits = lm_head(params, h)
    if cfg.tp_axis is None:
        return logits
    return lax.all_gather(logits, cfg.tp_axis, axis=logits.ndim - 1,
                          tiled=True)[..., :cfg.vocab_size]


def argmax_tokens(cfg: Config, params: Params, h):
    """Greedy token i32[...] = first argmax of the logits. Under tensor parallelism without
    gathering the logits: each shard's max and first argmax of its block, all-gathered
    ([tp, ...] pairs), then the first shard holding the global max."""
    logits = lm_head(params, h)
    if cfg.tp_axis is None:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    rows = logits.shape[-1]
    first = lax.axis_index(cfg.tp_axis) * rows
    logits = jnp.where(first + jnp.arange(rows) < cfg.vocab_size, logits, -jnp.inf)  # padding
    best = lax.all_gather(jnp.max(logits, axis=-1), cfg.tp_axis)                  # [tp, ...]
    where = lax.all_gather(jnp.argmax(logits, axis=-1).astype(jnp.int32) + first, cfg.tp_axis)
    shard = jnp.argmax(best, axis=0)
    return jnp.take_along_axis(where, shard[None], axis=0)[0].astype(jnp.int32)


def _draft_scores(cfg: Config, params: Params, h):
    """This shard's draft rows for the MTP's post-norm hidden h [..., H]: (float32 scores
    [..., n], their token ids i32[n], ascending): the draft vocabulary's head (params.draft,
    N x H) or, without one, the lm_head's block of the vocabulary. Padding rows (a draft
    head's id -1, the vocabulary padding of a tp block) score -inf."""
    d = params.draft
    if d is None:
        logits = lm_head(params, h)
        rows = logits.shape[-1]
        ids = jnp.arange(rows, dtype=jnp.int32)
        if cfg.tp_axis is not None:
            ids = ids + lax.axis_index(cfg.tp_axis) * rows
            logits = jnp.where(ids < cfg.vocab_size, logits, -jnp.inf)   # padding
        return logits, ids
    logits = jnp.einsum("...i,ni->...n", h, d.weight, preferred_element_type=jnp.float32)
    return jnp.where(d.ids >= 0, logits, -jnp.inf), d.ids.astype(jnp.int32)


def _first_argmax(cfg: Config, logits, ids):
    """The token of the first best row of (scores, ids) from _draft_scores; under tensor
    parallelism each shard's max and that row's id are all-gathered ([tp, ...] pairs) and
    the first shard holding the global max wins (blocks are in ascending id order)."""
    tok = ids[jnp.argmax(logits, axis=-1)]
    if cfg.tp_axis is None:
        return tok
    best = lax.all_gather(jnp.max(logits, axis=-1), cfg.tp_axis)       # [tp, ...]
    toks = lax.all_gather(tok, cfg.tp_axis)
    shard = jnp.argmax(best, axis=0)
    return jnp.take_along_axis(toks, shard[None], axis=0)[0]


def draft_tokens(cfg: Config, params: Params, h):
    """A draft's token i32[...] from the MTP's post-norm hidden h [..., H]: the first argmax
    over the draft vocabulary's rows (params.draft, N x H read instead of the V x H lm_head)
    or, without one, over the whole vocabulary (argmax_tokens' token). Drafts only propose:
    verification samples from the target's full logits, so the draft vocabulary changes
    acceptance, never the output. With every id in the head (ascending) the token is
    argmax_tokens' exactly (same first argmax).

    Under tensor parallelism each shard holds a block of the head's rows and their ids: its
    max and that row's id are all-gathered ([tp, ...] pairs) and the first shard holding the
    global max wins, as in argmax_tokens (blocks are in ascending id order)."""
    return _first_argmax(cfg, *_draft_scores(cfg, params, h))


def draft_candidates(cfg: Config, params: Params, h, c: int, want):
    """(draft_tokens' token i32[...], its candidates i32[..., c]): the ids of the c best draft
    rows, best first (ties: lower id first, so candidate 0 is the draft), -1 past the rows
    there are; all -1 when `want` (a bool scalar) is false, which skips the top-c (lax.cond:
    the draft itself is computed outside the branch, the same whatever `want`).

    What they are for: a grammar-constrained lane's drafts are corrected on the host
    (grammar.Constraint.masked_drafts): the first candidate the grammar allows is the masked
    argmax of the draft logits whenever any of the c is allowed. Under tensor parallelism
    each shard's top c (scores, ids) are all-gathered and the top c of the tp x c pairs taken;
    concatenated in shard order, ties still go to the lower id."""
    logits, ids = _draft_scores(cfg, params, h)
    tok = _first_argmax(cfg, logits, ids)

    def top():
        m = min(c, logits.shape[-1])
        vals, rows = lax.top_k(logits, m)
        toks = ids[rows]
        if cfg.tp_axis is not None:             # [tp, ..., m] -> [..., tp * m], shard order
            vals = jnp.moveaxis(lax.all_gather(vals, cfg.tp_axis), 0, -2)
            toks = jnp.moveaxis(lax.all_gather(toks, cfg.tp_axis), 0, -2)
            vals = vals.reshape(*vals.shape[:-2], -1)
            toks = toks.reshape(*toks.shape[:-2], -1)
            vals, best = lax.top_k(vals, min(c, vals.shape[-1]))
            toks = jnp.take_along_axis(toks, best, axis=-1)
        toks = jnp.where(vals > -jnp.inf, toks, -1).astype(jnp.int32)
        pad = [(0, 0)] * (toks.ndim - 1) + [(0, c - toks.shape[-1])]
        return jnp.pad(toks, pad, constant_values=-1)
    cands = lax.cond(want, top, lambda: jnp.full(tok.shape + (c,), -1, jnp.int32))
    return tok, cands


def mtp_forward(cfg: Config, params: Params, cache: Cache, h_prev, next_tokens, seg: Segment,
                kernels: str = "reference"):
    """One MTP pass over aligned pairs (spec §5.1-5.2).

    h_prev [B, T, H]: post-norm hidden states (the target's, or the MTP's own when chaining);
    next_tokens [B, T]: the token after each hidden state's position; the pair at position
    start + t is written to the MTP KV cache there and predicts the token at position + 2.
    Returns (MTP post-norm hidden [B, T, H], cache).
    """
    m = params.mtp
    x, cos, sin = _mtp_input(cfg, params, h_prev, next_tokens, seg)
    x, kv = full_layer(cfg, m.layer, x, cache.mtp, seg, cos, sin, kernels, final_norm=m.norm)
    return x, dataclasses.replace(cache, mtp=kv)


def _mtp_input(cfg: Config, params: Params, h_prev, next_tokens, seg: Segment):
    """The MTP layer's input x [B, T, H] for aligned pairs, and the pairs' rope tables."""
    m = params.mtp
    eps = cfg.rms_norm_eps
    e = rmsnorm_1p(embed_tokens(cfg, params, next_tokens), m.pre_fc_norm_embedding, eps)
    hh = rmsnorm_1p(h_prev.astype(e.dtype), m.pre_fc_norm_hidden, eps)
    x = dense(jnp.concatenate([e, hh], axis=-1), m.fc)
    positions = seg.start[:, None] + jnp.arange(next_tokens.shape[1])[None, :]
    cos, sin = rope_cos_sin(cfg, positions, x.dtype)
    return x, cos, sin


def mtp_fill_kv(cfg: Config, params: Params, cache: Cache, h_prev, next_tokens, seg: Segment):
    """Write the MTP KV of aligned pairs without running the MTP: what a step that drafts
    nothing (depth 0) needs so that later steps can draft again.

    The MTP KV at position p depends only on the pair (h_p, token p+1): embedding, the two
    norms, fc, the layer's input norm and its qkv projection. The attention, MLP, final norm
    and lm_head (most of a draft's cost) are skipped. Arguments as in mtp_forward.
    Returns the cache.
    """
    k, v = mtp_kv(cfg, params, h_prev, next_tokens, seg)
    return dataclasses.replace(cache, mtp=kv_write(cache.mtp, k, v, seg))


def mtp_kv(cfg: Config, params: Params, h_prev, next_tokens, seg: Segment):
    """The MTP layer's K and V [B, T, NKV, HD] for aligned pairs (mtp_fill_kv, which writes
    them; a prefix-cache restore rewrites one position with them, engine/snapshots.py)."""
    m = params.mtp
    x, cos, sin = _mtp_input(cfg, params, h_prev, next_tokens, seg)
    _, _, k, v = _project_qkv(cfg, m.layer.attn,
                              rmsnorm_1p(x, m.layer.input_layernorm, cfg.rms_norm_eps), cos, sin)
    return k, v
