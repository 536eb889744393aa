"""The attention layer's prologue in one kernel (Pallas, Triton backend): from the fused
qkv projection to normed, roped queries folded for the paged-attention kernel, with the
new K/V written into the paged pool in place.

Between the qkv GEMM and the attention kernel the model splits the projection (query heads
interleaved with their gates, then K, then V), applies the per-head zero-centred RMSNorm
(``rmsnorm_1p`` with q_norm / k_norm) and the partial NeoX RoPE to q and k, scatters k and
v into the pool (``write_kv``) and folds q into the attention kernel's rows (a pad). XLA
made about eight kernels of that on the H200; this is one:

1. grid ``(B, NKV)``: one program per lane and kv head, a static loop over the Tq tokens
   (decode and verify blocks: Tq is small);
2. each head row is read straight from the projection in power-of-two column pieces (the
   two rotated halves ``[0, rd/2)``, ``[rd/2, rd)``, then the pass-through columns in
   power-of-two chunks: Triton tensors must be powers of two; the 27B's head of 256 with
   rd 64 is 32 + 32 + 128 + 64);
3. the norm in f32, rounded once to the projection's dtype (spec §3.1a), then the rotation
   in that dtype as the model computes it (``x * cos`` and ``rotate_half(x) * sin`` each
   rounded, then their sum);
4. k and v of a valid token (t < q_len) go to pool page ``table[pos // page_size]``, slot
   ``pos % page_size`` with ``pos = kv_len - q_len + t`` (the pools are aliased to the
   outputs: written in place); a padding row, or a page id outside the pool (a corrupt
   table), writes nothing, as ``write_kv`` drops it;
5. query head ``h * G + g`` of token t goes to row ``t * G + g`` of ``qf[b, h]``; rows
   ``Tq * G`` up to the padded row count are zeros.

``qk_norm_rope_write_reference`` is the same in plain jnp: the model's ops
(``mtpjax.model._split_qkv``, ``write_kv``, the fold of ``paged_attention``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from pallas_kernels.paged_attention import query_rows, write_kv
from pallas_kernels.tuned_block_sizes import get_paged_attention_tuning

MAX_TOKENS = 16      # the kernel unrolls its loop over tokens: decode / verify blocks only


def _pow2_pieces(start: int, n: int) -> list[tuple[int, int]]:
  """[start, start + n) as (offset, size) pieces of power-of-two sizes, largest first."""
  out = []
  while n:
    size = 1 << (n.bit_length() - 1)
    out.append((start, size))
    start, n = start + size, n - size
  return out


def head_pieces(head_dim: int, rotary_dim: int) -> list[tuple[int, int]]:
  """The column pieces a head row is read in: the two rotated halves, then the rest."""
  half = rotary_dim // 2
  return [(0, half), (half, half)] + _pow2_pieces(rotary_dim, head_dim - rotary_dim)


def fits(tokens: int, rotary_dim: int, interpret: bool) -> bool:
  """Whether the kernel takes a block of `tokens` tokens with this rotary_dim: at most
  MAX_TOKENS (the loop is unrolled) and, compiled, a power-of-two rotated half (Triton
  tensors; the pass-through columns are read in power-of-two pieces whatever HD is)."""
  half = rotary_dim // 2
  return 1 <= tokens <= MAX_TOKENS and (interpret or (half > 0 and half & (half - 1) == 0))


def _kernel(
    kv_len_ref,  # i32[1]                 this lane's kv length (incl. the new tokens)
    q_len_ref,  # i32[1]                  this lane's valid new tokens
    table_ref,  # i32[pages_per_lane]     this lane's page ids
    qkv_ref,  # [T, C]                    this lane's rows of the fused projection
    qw_ref,  # [HD]                       q_norm weight
    kw_ref,  # [HD]                       k_norm weight
    cos_ref,  # [T, RD]
    sin_ref,  # [T, RD]
    k_in_ref,  # [num_pages, page_size, HD]  this kv head's K pool (aliased to k_out_ref)
    v_in_ref,  # [num_pages, page_size, HD]  this kv head's V pool (aliased to v_out_ref)
    qf_ref,  # [rows, HD]                 out: folded query rows of (lane, kv head)
    k_out_ref,  # [num_pages, page_size, HD]
    v_out_ref,  # [num_pages, page_size, HD]
    *,
    n_tok: int,
    group: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    pieces: tuple,
    eps: float,
    page_size: int,
):
  del k_in_ref, v_in_ref     # written in place through the aliased outputs
  h = pl.program_id(1)
  dt = qf_ref.dtype
  hd = head_dim
  half = pieces[0][1]
  kv_len = kv_len_ref[0]
  q_len = q_len_ref[0]
  pages_per_lane = table_ref.shape[0]
  num_pages = k_out_ref.shape[0]

  def row(t, col0):
    return [qkv_ref[t, pl.ds(col0 + o, n)] for o, n in pieces]

  def norm_rope(t, col0, w_ref):
    xs = [x.astype(jnp.float32) for x in row(t, col0)]
    ss = xs[0] * xs[0]
    ss = jnp.sum(ss)
    for x in xs[1:]:
      ss = ss + jnp.sum(x * x)
    r = lax.rsqrt(ss / hd + eps)
    ys = [(x * r * (1.0 + w_ref[pl.ds(o, n)].astype(jnp.float32))).astype(dt)
          for x, (o, n) in zip(xs, pieces)]

    def mul(a, b):  # one product rounded to dt, as the model's dt multiply
      return (a.astype(jnp.float32) * b.astype(jnp.float32)).astype(dt)

    def add(a, b):
      return (a.astype(jnp.float32) + b.astype(jnp.float32)).astype(dt)

    x1, x2 = ys[0], ys[1]
    c1, c2 = cos_ref[t, pl.ds(0, half)], cos_ref[t, pl.ds(half, half)]
    s1, s2 = sin_ref[t, pl.ds(0, half)], sin_ref[t, pl.ds(half, half)]
    y1 = add(mul(x1, c1), mul(-x2, s1))
    y2 = add(mul(x2, c2), mul(x1, s2))
    return [y1, y2] + ys[2:]

  k_col = 2 * num_q_heads * hd + h * hd
  v_col = (2 * num_q_heads + num_kv_heads) * hd + h * hd
  for t in range(n_tok):
    # this token's K/V into the pool (valid rows only; write_kv's rules)
    pos = kv_len - q_len + t
    valid = (t < q_len) & (pos >= 0) & (pos < pages_per_lane * page_size)
    page = table_ref[jnp.clip(pos // page_size, 0, pages_per_lane - 1)]
    valid &= (page >= 0) & (page < num_pages)
    page = jnp.where(valid, page, 0)
    slot = jnp.where(valid, pos % page_size, 0)
    k_row = norm_rope(t, k_col, kw_ref)
    v_row = row(t, v_col)

    @pl.when(valid)
    def _write():
      for (o, n), k, v in zip(pieces, k_row, v_row):
        k_out_ref[page, slot, pl.ds(o, n)] = k.astype(k_out_ref.dtype)
        v_out_ref[page, slot, pl.ds(o, n)] = v.astype(v_out_ref.dtype)

    for g in range(group):
      q_row = norm_rope(t, 2 * (h * group + g) * hd, qw_ref)
      for (o, n), q in zip(pieces, q_row):
        qf_ref[t * group + g, pl.ds(o, n)] = q
  for r in range(n_tok * group, qf_ref.shape[0]):
    for o, n in pieces:
      qf_ref[r, pl.ds(o, n)] = jnp.zeros((n,), dt)


def _validate(qkv, q_norm, k_norm, cos, sin, k_pages, v_pages, page_tables, kv_lens, q_lens,
              num_q_heads, rotary_dim, interpret):
  if qkv.ndim != 3:
    raise ValueError(f"qkv must be [B, T, (2 NQ + 2 NKV) HD], got shape {qkv.shape}")
  if k_pages.ndim != 4 or k_pages.shape != v_pages.shape or k_pages.dtype != v_pages.dtype:
    raise ValueError(f"k_pages and v_pages must both be [NKV, num_pages, page_size, HD] of "
                     f"one dtype, got {k_pages.dtype}{k_pages.shape}, "
                     f"{v_pages.dtype}{v_pages.shape}")
  b, t, c = qkv.shape
  nkv, _, _, hd = k_pages.shape
  if num_q_heads < 1 or num_q_heads % nkv:
    raise ValueError(f"num_q_heads ({num_q_heads}) must be a positive multiple of NKV ({nkv})")
  if c != (2 * num_q_heads + 2 * nkv) * hd:
    raise ValueError(f"qkv has {c} columns; (2 NQ + 2 NKV) HD = "
                     f"{(2 * num_q_heads + 2 * nkv) * hd} for NQ={num_q_heads}, NKV={nkv}, "
                     f"HD={hd}")
  if not 1 <= t <= MAX_TOKENS:
    raise ValueError(f"T must lie in 1..{MAX_TOKENS} (the token loop is unrolled), got {t}")
  if q_norm.shape != (hd,) or k_norm.shape != (hd,):
    raise ValueError(f"q_norm and k_norm must be [HD={hd}], got {q_norm.shape}, "
                     f"{k_norm.shape}")
  if rotary_dim % 2 or not 0 < rotary_dim <= hd:
    raise ValueError(f"rotary_dim must be even and in (0, HD={hd}], got {rotary_dim}")
  if cos.shape != (b, t, rotary_dim) or sin.shape != cos.shape:
    raise ValueError(f"cos and sin must be [B, T, RD]={[b, t, rotary_dim]}, got "
                     f"{cos.shape}, {sin.shape}")
  if page_tables.ndim != 2 or page_tables.shape[0] != b:
    raise ValueError(f"page_tables must be [B={b}, pages_per_lane], got {page_tables.shape}")
  if kv_lens.shape != (b,) or q_lens.shape != (b,):
    raise ValueError(f"kv_lens and q_lens must be [B={b}], got {kv_lens.shape}, "
                     f"{q_lens.shape}")
  for name, arr in (("page_tables", page_tables), ("kv_lens", kv_lens), ("q_lens", q_lens)):
    if arr.dtype != jnp.int32:
      raise ValueError(f"{name} must be int32, got {arr.dtype}")
  if not fits(t, rotary_dim, interpret):
    raise ValueError(f"the Triton kernel needs rotary_dim / 2 a power of two, got "
                     f"{rotary_dim // 2}")


@functools.partial(jax.jit, static_argnames=("num_q_heads", "rotary_dim", "eps", "interpret",
                                             "num_warps"))
def qk_norm_rope_write(qkv, q_norm, k_norm, cos, sin, k_pages, v_pages, page_tables, kv_lens,
                       q_lens, *, num_q_heads: int, rotary_dim: int, eps: float,
                       interpret: bool = False, num_warps: int = 4):
  """Split, norm and rope q and k, write k and v into the pool, fold q: one kernel.

  Args:
    qkv: [B, T, (2 NQ + 2 NKV) HD] the fused projection (head j's query at columns
      [2 j HD, (2 j + 1) HD), its gate after it; then K heads, then V heads); T <= 16.
    q_norm, k_norm: [HD] zero-centred norm weights.
    cos, sin: [B, T, RD] NeoX RoPE tables (``mtpjax.model.rope_cos_sin``).
    k_pages, v_pages: [NKV, num_pages, page_size, HD] the pool (updated in place: donate it
      at the jit boundary).
    page_tables, kv_lens, q_lens: as ``paged_attention`` (kv_lens counts the new tokens).
    num_q_heads: NQ; rotary_dim: RD; eps: the norms' epsilon.
  Returns:
    (qf [B, NKV, rows, HD] in qkv's dtype: row t * G + g is query head h * G + g of token t,
    normed and roped, rows >= T * G zeros, rows = ``query_rows`` of the attention kernel's
    tuning, what ``paged_attention_gated`` takes; k_pages; v_pages).
  Raises:
    ValueError: on inconsistent shapes or dtypes; on the Triton path for rotary_dim / 2 not
      a power of two (see `fits`).
  """
  _validate(qkv, q_norm, k_norm, cos, sin, k_pages, v_pages, page_tables, kv_lens, q_lens,
            num_q_heads, rotary_dim, interpret)
  b, t, _ = qkv.shape
  nkv, num_pages, page_size, hd = k_pages.shape
  group = num_q_heads // nkv
  _, rows = query_rows(t, group, get_paged_attention_tuning(hd, page_size, t * group))
  pages_per_lane = page_tables.shape[1]
  pieces = tuple(head_pieces(hd, rotary_dim))
  kernel = functools.partial(_kernel, n_tok=t, group=group, num_q_heads=num_q_heads,
                             num_kv_heads=nkv, head_dim=hd, pieces=pieces, eps=float(eps),
                             page_size=page_size)
  pool_spec = pl.BlockSpec((None, num_pages, page_size, hd), lambda i, h: (h, 0, 0, 0))
  vec_spec = pl.BlockSpec((hd,), lambda i, h: (0,))
  rope_spec = pl.BlockSpec((None, t, rotary_dim), lambda i, h: (i, 0, 0))
  return tuple(pl.pallas_call(
      kernel,
      grid=(b, nkv),
      in_specs=[
          pl.BlockSpec((1,), lambda i, h: (i,)),  # kv_lens
          pl.BlockSpec((1,), lambda i, h: (i,)),  # q_lens
          pl.BlockSpec((None, pages_per_lane), lambda i, h: (i, 0)),
          pl.BlockSpec((None, t, qkv.shape[2]), lambda i, h: (i, 0, 0)),
          vec_spec, vec_spec, rope_spec, rope_spec, pool_spec, pool_spec,
      ],
      out_specs=[pl.BlockSpec((None, None, rows, hd), lambda i, h: (i, h, 0, 0)),
                 pool_spec, pool_spec],
      out_shape=[jax.ShapeDtypeStruct((b, nkv, rows, hd), qkv.dtype),
                 jax.ShapeDtypeStruct(k_pages.shape, k_pages.dtype),
                 jax.ShapeDtypeStruct(v_pages.shape, v_pages.dtype)],
      input_output_aliases={8: 1, 9: 2},
      compiler_params=pltr.CompilerParams(num_warps=num_warps, num_stages=1),
      interpret=interpret,
      name=f"qk_norm_rope_write_t{t}_g{group}",
  )(kv_lens, q_lens, page_tables, qkv, q_norm, k_norm, cos, sin, k_pages, v_pages))


def _rmsnorm_1p(x, w, eps):
  xf = x.astype(jnp.float32)
  y = xf * lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
  return (y * (1.0 + w.astype(jnp.float32))).astype(x.dtype)


def _rope(x, cos, sin, rd):
  xr, xp = x[..., :rd], x[..., rd:]
  half = rd // 2
  rot = jnp.concatenate([-xr[..., half:], xr[..., :half]], axis=-1)
  xr = xr * cos[:, :, None, :] + rot * sin[:, :, None, :]
  return jnp.concatenate([xr, xp], axis=-1)


@functools.partial(jax.jit, static_argnames=("num_q_heads", "rotary_dim", "eps", "interpret",
                                             "num_warps"))
def qk_norm_rope_write_reference(qkv, q_norm, k_norm, cos, sin, k_pages, v_pages, page_tables,
                                 kv_lens, q_lens, *, num_q_heads: int, rotary_dim: int,
                                 eps: float, interpret: bool = False, num_warps: int = 4):
  """jnp version of :func:`qk_norm_rope_write` (same signature and returns): the model's
  split, ``rmsnorm_1p`` and ``apply_rope`` (mtpjax/model.py), :func:`write_kv`, the fold."""
  del interpret, num_warps
  _validate(qkv, q_norm, k_norm, cos, sin, k_pages, v_pages, page_tables, kv_lens, q_lens,
            num_q_heads, rotary_dim, True)
  b, t, _ = qkv.shape
  nkv, _, page_size, hd = k_pages.shape
  nq, group = num_q_heads, num_q_heads // nkv
  q = qkv[..., :2 * nq * hd].reshape(b, t, nq, 2 * hd)[..., :hd]
  k = qkv[..., 2 * nq * hd:(2 * nq + nkv) * hd].reshape(b, t, nkv, hd)
  v = qkv[..., (2 * nq + nkv) * hd:].reshape(b, t, nkv, hd)
  q = _rope(_rmsnorm_1p(q, q_norm, eps), cos, sin, rotary_dim)
  k = _rope(_rmsnorm_1p(k, k_norm, eps), cos, sin, rotary_dim)
  k_pages, v_pages = write_kv(k_pages, v_pages, k, v, page_tables, kv_lens, q_lens)
  _, rows = query_rows(t, group, get_paged_attention_tuning(hd, page_size, t * group))
  qf = q.reshape(b, t, nkv, group, hd).transpose(0, 2, 1, 3, 4).reshape(b, nkv, t * group, hd)
  qf = jnp.pad(qf, ((0, 0), (0, 0), (0, rows - t * group), (0, 0)))
  return qf, k_pages, v_pages
