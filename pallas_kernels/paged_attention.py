"""Causal multi-query paged attention (Pallas, Triton backend) and the KV write.

Data flow of one call (one layer):

1. The wrapper folds, per lane ``b`` and KV head ``h``, the ``Tq`` query
   positions and the ``G = NQ // NKV`` query heads of the group into the rows
   of one query block: row ``r = t * G + g``. The rows are padded to a power
   of two (>= 16, the Triton dot minimum); long prefill chunks are split into
   row blocks of ``tuning.max_block_rows``.
2. The kernel runs on a grid ``(B, NKV, row_blocks, k_splits)``. Each program
   walks its share of the lane's page table in steps of
   ``pages_per_compute_block`` pages, gathers those K/V pages straight from
   the pool with a *masked* load (slots at or beyond ``kv_len`` are never
   read; their values come back as 0) and keeps an f32 online softmax. So
   each KV page is read once per (lane, kv head, row block) and split,
   whatever ``Tq`` and ``G`` are.
3. Query row ``t`` of lane ``b`` sits at absolute position
   ``kv_len - q_len + t`` and sees keys ``<= `` that position. Rows with
   ``t >= q_len`` (and padding rows) are fully masked and come out as zeros.
   Scores are masked with ``jnp.where`` (NaN-safe), probabilities of masked
   entries are set to exactly 0, and V rows beyond ``kv_len`` are loaded as
   0, so NaN-poisoned pool memory cannot leak.
4. A page id that a row needs (a position <= the row's query position) but
   that lies outside ``[0, num_pages)`` is a corrupt page table: the page is
   not read, and every row that needs it comes out NaN (only that lane's
   rows), instead of clamping the id and reading some other lane's page.
   Hosts validate tables first (``mtpjax.engine.kv_pool.PageAllocator.table``,
   ``validate_paged_inputs_dynamic``); the NaN is the in-program backstop.
5. With ``k_splits > 1`` every split writes an unnormalised partial output
   plus its row max and row sum, and the wrapper merges them (flash
   decoding). With one split the kernel normalises and writes the output.

Backend: Triton (``pltr.CompilerParams`` is always passed; without it jax 0.10
sends a ``pallas_call`` on CUDA to Mosaic GPU). Triton has no scalar
prefetch, so the page table, ``kv_lens`` and ``q_lens`` reach the kernel as
ordinary blocked inputs and the K/V pools as whole-array blocks indexed by
the gathered page ids.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from pallas_kernels.tuned_block_sizes import (
    TRITON_MIN_DOT,
    PagedAttentionTuning,
    get_paged_attention_tuning,
    next_pow2,
)

# Finite mask value: exp(MASK - m) underflows to 0 for any real score m, and
# MASK - MASK = 0 stays finite for fully masked rows (no inf - inf).
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
_MIN_ROWS = 16  # Triton dot needs M >= 16.
_NO_BAD = np.iinfo(np.int32).max  # "no out-of-pool page seen" (a token position never reached)


def _is_pow2(x: int) -> bool:
  return x > 0 and (x & (x - 1)) == 0


# ---------------------------------------------------------------------------
# Kernel
# ---------------------------------------------------------------------------


def _paged_attention_kernel(
    kv_len_ref,  # i32[1]                     this lane's kv length (incl. new tokens)
    q_len_ref,  # i32[1]                      this lane's valid query tokens
    table_ref,  # i32[pages_per_partition]    this lane's page ids for this split
    q_ref,  # [block_rows, HD]                folded query rows of (lane, kv head)
    k_pages_ref,  # [num_pages, page_size, HD]  this kv head's K pool
    v_pages_ref,  # [num_pages, page_size, HD]  this kv head's V pool
    o_ref,  # [block_rows, HD]                output (or f32 partial when split)
    *stat_refs,  # l_ref, m_ref: f32[block_rows] (only when split)
    group: int,
    page_size: int,
    pages_per_block: int,
    pages_per_partition: int,
    sm_scale: float,
    precision,
    split: bool,
):
  block_rows, head_dim = q_ref.shape
  block_k = pages_per_block * page_size
  row_block = pl.program_id(2)
  split_idx = pl.program_id(3)

  kv_len = kv_len_ref[0]
  q_len = q_len_ref[0]

  # Query rows of this program: row r = t * group + g.
  rows = row_block * block_rows + lax.broadcasted_iota(jnp.int32, (block_rows,), 0)
  t = rows // group
  row_valid = t < q_len
  q_pos = kv_len - q_len + t  # absolute position of the row's query token

  # Keys needed by this row block: up to the last valid row's position.
  t_first = (row_block * block_rows) // group
  t_last = jnp.minimum(((row_block + 1) * block_rows - 1) // group, q_len - 1)
  n_tokens = jnp.where(t_first < q_len, kv_len - q_len + t_last + 1, 0)
  n_tokens = jnp.clip(n_tokens, 0, kv_len)
  n_pages = (n_tokens + page_size - 1) // page_size
  start_page = split_idx * pages_per_partition
  end_page = jnp.minimum(n_pages, start_page + pages_per_partition)
  n_iter = (jnp.maximum(end_page - start_page, 0) + pages_per_block - 1) // pages_per_block

  q = q_ref[...]
  num_pool_pages = k_pages_ref.shape[0]

  def body(i, carry):
    acc, m_prev, l_prev, first_bad = carry
    local = i * pages_per_block
    page_ids = table_ref[pl.ds(local, pages_per_block)]  # [ppb]
    first_tok = (start_page + local) * page_size
    tok = first_tok + lax.broadcasted_iota(jnp.int32, (block_k,), 0)  # [block_k]
    page_idx = start_page + local + lax.broadcasted_iota(jnp.int32, (pages_per_block,), 0)
    page_valid = page_idx < n_pages
    # A needed page id outside the pool is a corrupt table: never form its address (read
    # page 0 under a mask instead) and remember its first token, so that every row that
    # needs it comes out NaN instead of silently reading another lane's page.
    in_pool = (page_ids >= 0) & (page_ids < num_pool_pages)
    bad = page_valid & ~in_pool
    first_bad = jnp.minimum(first_bad, jnp.min(jnp.where(bad, page_idx * page_size, _NO_BAD)))
    page_ok = page_valid & in_pool
    page_ids = jnp.where(page_ok, page_ids, 0)
    slot_valid = ((first_tok
                   + lax.broadcasted_iota(jnp.int32, (pages_per_block, page_size, 1), 0)
                   * page_size
                   + lax.broadcasted_iota(jnp.int32, (pages_per_block, page_size, 1), 1)
                   ) < kv_len) & page_ok[:, None, None]
    # Masked gather of [ppb, page_size, HD]: slots >= kv_len are not read.
    shape3 = (pages_per_block, page_size, head_dim)
    idx = (jnp.broadcast_to(page_ids[:, None, None], shape3),
           lax.broadcasted_iota(jnp.int32, shape3, 1),
           lax.broadcasted_iota(jnp.int32, shape3, 2))
    slot_valid = jnp.broadcast_to(slot_valid, shape3)
    k = pltr.load(k_pages_ref.at[idx], mask=slot_valid, other=0)
    v = pltr.load(v_pages_ref.at[idx], mask=slot_valid, other=0)
    k = k.reshape(block_k, head_dim)
    v = v.reshape(block_k, head_dim)

    s = lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                        preferred_element_type=jnp.float32, precision=precision)
    s = s * sm_scale
    mask = (tok[None, :] <= q_pos[:, None]) & row_valid[:, None]
    s = jnp.where(mask, s, MASK_VALUE)
    m_next = jnp.maximum(m_prev, jnp.max(s, axis=1))
    correction = jnp.exp(m_prev - m_next)
    p = jnp.where(mask, jnp.exp(s - m_next[:, None]), 0.0)
    l_next = l_prev * correction + jnp.sum(p, axis=1)
    pv = jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32,
                 precision=precision)
    acc = acc * correction[:, None] + pv
    return acc, m_next, l_next, first_bad

  acc0 = jnp.zeros((block_rows, head_dim), jnp.float32)
  m0 = jnp.full((block_rows,), MASK_VALUE, jnp.float32)
  l0 = jnp.zeros((block_rows,), jnp.float32)
  acc, m, l, first_bad = lax.fori_loop(0, n_iter, body, (acc0, m0, l0, jnp.int32(_NO_BAD)))
  # Rows that needed a page outside the pool (a corrupt page table) are poisoned.
  poison = row_valid & (q_pos >= first_bad)

  if split:
    l_ref, m_ref = stat_refs
    o_ref[...] = jnp.where(poison[:, None], jnp.nan, acc)
    l_ref[...] = jnp.where(poison, jnp.nan, l)
    m_ref[...] = jnp.where(poison, jnp.nan, m)   # NaN survives the merge of the splits
  else:
    # Fully masked rows have l == 0 and acc == 0 -> output 0.
    l_safe = jnp.where(l > 0.0, l, 1.0)
    o = jnp.where(poison[:, None], jnp.nan, acc / l_safe[:, None])
    o_ref[...] = o.astype(o_ref.dtype)


# ---------------------------------------------------------------------------
# Wrapper
# ---------------------------------------------------------------------------


def _static_validate(q, k_pages, v_pages, page_tables, kv_lens, q_lens, interpret):
  if q.ndim != 4:
    raise ValueError(f"q must be [B, Tq, NQ, HD], got shape {q.shape}")
  if k_pages.ndim != 4:
    raise ValueError(
        f"k_pages must be [NKV, num_pages, page_size, HD], got shape {k_pages.shape}")
  if k_pages.shape != v_pages.shape:
    raise ValueError(
        f"k_pages and v_pages must have the same shape, got {k_pages.shape} and "
        f"{v_pages.shape}")
  if k_pages.dtype != v_pages.dtype:
    raise ValueError(
        f"k_pages and v_pages must have the same dtype, got {k_pages.dtype} and "
        f"{v_pages.dtype}")
  b, tq, nq, hd = q.shape
  nkv, num_pages, page_size, hd_k = k_pages.shape
  if hd_k != hd:
    raise ValueError(f"head_dim of q ({hd}) and of k_pages ({hd_k}) differ")
  if nq % nkv != 0:
    raise ValueError(
        f"number of query heads ({nq}) must be divisible by KV heads ({nkv})")
  if tq < 1:
    raise ValueError(f"Tq must be >= 1, got {tq}")
  if num_pages < 1 or page_size < 1:
    raise ValueError(f"the page pool must be non-empty, got {k_pages.shape}")
  if page_tables.ndim != 2 or page_tables.shape[0] != b:
    raise ValueError(
        f"page_tables must be [B={b}, pages_per_lane], got shape {page_tables.shape}")
  if page_tables.shape[1] < 1:
    raise ValueError("page_tables must have at least one page per lane")
  for name, arr in (("page_tables", page_tables), ("kv_lens", kv_lens),
                    ("q_lens", q_lens)):
    if arr.dtype != jnp.int32:
      raise ValueError(f"{name} must be int32, got {arr.dtype}")
  if kv_lens.shape != (b,):
    raise ValueError(f"kv_lens must be [B={b}], got shape {kv_lens.shape}")
  if q_lens.shape != (b,):
    raise ValueError(f"q_lens must be [B={b}], got shape {q_lens.shape}")
  if not interpret:
    if not _is_pow2(page_size):
      raise ValueError(
          f"the Triton kernel needs a power-of-two page_size, got {page_size}")
    if not _is_pow2(hd) or hd < TRITON_MIN_DOT:
      raise ValueError(
          f"the Triton kernel needs a power-of-two head_dim >= {TRITON_MIN_DOT} (a dot "
          f"dimension), got {hd}")


def _key_block_pages(tuning: PagedAttentionTuning, page_size: int, pages_per_lane: int,
                     interpret: bool) -> int:
  """Pages per online-softmax step: the tuning's, cut to the table (a power of two), but
  never below a 16-token key block on the Triton path (extra pages are masked, not read).

  Raises ValueError when the tuning itself asks for a Triton key block < 16 tokens.
  """
  ppb = tuning.pages_per_compute_block
  if not interpret and ppb * page_size < TRITON_MIN_DOT:
    raise ValueError(
        f"the Triton kernel needs a key block (pages_per_compute_block * page_size) of at "
        f"least {TRITON_MIN_DOT} tokens (a dot dimension), got "
        f"{ppb} * {page_size} = {ppb * page_size}")
  floor = 1 if interpret else next_pow2(-(-TRITON_MIN_DOT // page_size))
  return min(ppb, max(next_pow2(pages_per_lane), floor))


def validate_paged_inputs_dynamic(q, k_pages, page_tables, kv_lens, q_lens):
  """Host-side checks of the *values* (call outside jit, e.g. in debug runs).

  Raises ValueError when ``0 <= q_lens <= min(Tq, kv_lens)`` or
  ``kv_lens <= pages_per_lane * page_size`` is violated, or when a page id
  that will be read is outside the pool.
  """
  tq = q.shape[1]
  num_pages, page_size = k_pages.shape[1], k_pages.shape[2]
  kv = np.asarray(kv_lens)
  ql = np.asarray(q_lens)
  table = np.asarray(page_tables)
  if np.any(ql < 0) or np.any(ql > tq):
    raise ValueError(f"q_lens must lie in [0, Tq={tq}], got {ql}")
  if np.any(ql > kv):
    raise ValueError(f"q_lens must be <= kv_lens, got {ql} and {kv}")
  cap = table.shape[1] * page_size
  if np.any(kv > cap):
    raise ValueError(f"kv_lens must be <= pages_per_lane * page_size = {cap}, got {kv}")
  for b in range(table.shape[0]):
    used = table[b, : -(-int(kv[b]) // page_size)]
    bad = np.flatnonzero((used < 0) | (used >= num_pages))
    if bad.size:
      j = int(bad[0])
      raise ValueError(f"page table lane {b} entry {j}: page id {int(used[j])} is outside "
                       f"the pool [0, {num_pages}) (the lane needs {used.size} pages)")


def query_rows(tq: int, group: int, tuning: PagedAttentionTuning) -> tuple[int, int]:
  """(block_rows, rows_pad): the query rows of one program and the folded rows of one
  (lane, kv head) after padding (``rows_pad >= tq * group``, a multiple of block_rows)."""
  n_rows = tq * group
  if next_pow2(max(n_rows, _MIN_ROWS)) <= tuning.max_block_rows:
    block_rows = next_pow2(max(n_rows, _MIN_ROWS))
  else:
    block_rows = tuning.max_block_rows
  return block_rows, pl.cdiv(n_rows, block_rows) * block_rows


def _attend_rows(qf, k_pages, v_pages, page_tables, kv_lens, q_lens, *, group: int,
                 block_rows: int, sm_scale: float, interpret: bool,
                 tuning: PagedAttentionTuning, force_split: bool):
  """The attention kernel over folded query rows qf [B, NKV, rows_pad, HD]: (its outputs,
  split). split (k_splits > 1, or force_split): (o f32 [S, B, NKV, rows_pad, HD] unnormalised,
  l, m f32 [S, B, NKV, rows_pad]); else o [B, NKV, rows_pad, HD] in qf's dtype."""
  b, nkv, rows_pad, hd = qf.shape
  _, num_pages, page_size, _ = k_pages.shape
  n_row_blocks = rows_pad // block_rows

  # --- page blocks and splits ---------------------------------------------------
  pages_per_lane = page_tables.shape[1]
  ppb = _key_block_pages(tuning, page_size, pages_per_lane, interpret)
  n_blocks = pl.cdiv(pages_per_lane, ppb)
  if tuning.k_splits is None:
    k_splits = pl.cdiv(tuning.target_programs, b * nkv * n_row_blocks)
  else:
    k_splits = tuning.k_splits
  k_splits = max(1, min(k_splits, n_blocks))
  blocks_per_split = pl.cdiv(n_blocks, k_splits)
  k_splits = pl.cdiv(n_blocks, blocks_per_split)  # drop empty trailing splits
  ppp = blocks_per_split * ppb
  table = page_tables
  if k_splits * ppp != pages_per_lane:
    table = jnp.pad(page_tables, ((0, 0), (0, k_splits * ppp - pages_per_lane)))
  split = k_splits > 1 or force_split

  precision = lax.Precision.HIGHEST if qf.dtype == jnp.float32 else None
  kernel = functools.partial(
      _paged_attention_kernel,
      group=group,
      page_size=page_size,
      pages_per_block=ppb,
      pages_per_partition=ppp,
      sm_scale=float(sm_scale),
      precision=precision,
      split=split,
  )
  grid = (b, nkv, n_row_blocks, k_splits)
  in_specs = [
      pl.BlockSpec((1,), lambda i, h, r, s: (i,)),  # kv_lens
      pl.BlockSpec((1,), lambda i, h, r, s: (i,)),  # q_lens
      pl.BlockSpec((None, ppp), lambda i, h, r, s: (i, s)),  # page table
      pl.BlockSpec((None, None, block_rows, hd), lambda i, h, r, s: (i, h, r, 0)),
      pl.BlockSpec((None, num_pages, page_size, hd), lambda i, h, r, s: (h, 0, 0, 0)),
      pl.BlockSpec((None, num_pages, page_size, hd), lambda i, h, r, s: (h, 0, 0, 0)),
  ]
  if split:
    out_shape = [
        jax.ShapeDtypeStruct((k_splits, b, nkv, rows_pad, hd), jnp.float32),
        jax.ShapeDtypeStruct((k_splits, b, nkv, rows_pad), jnp.float32),
        jax.ShapeDtypeStruct((k_splits, b, nkv, rows_pad), jnp.float32),
    ]
    out_specs = [
        pl.BlockSpec((None, None, None, block_rows, hd),
                     lambda i, h, r, s: (s, i, h, r, 0)),
        pl.BlockSpec((None, None, None, block_rows), lambda i, h, r, s: (s, i, h, r)),
        pl.BlockSpec((None, None, None, block_rows), lambda i, h, r, s: (s, i, h, r)),
    ]
  else:
    out_shape = jax.ShapeDtypeStruct((b, nkv, rows_pad, hd), qf.dtype)
    out_specs = pl.BlockSpec((None, None, block_rows, hd),
                             lambda i, h, r, s: (i, h, r, 0))

  out = pl.pallas_call(
      kernel,
      grid=grid,
      in_specs=in_specs,
      out_specs=out_specs,
      out_shape=out_shape,
      compiler_params=pltr.CompilerParams(num_warps=tuning.num_warps,
                                          num_stages=tuning.num_stages),
      interpret=interpret,
      name=f"paged_attention_{tuning.name}_rows{block_rows}_splits{k_splits}",
  )(kv_lens, q_lens, table, qf, k_pages, v_pages)
  return out, split


@functools.partial(jax.jit, static_argnames=("sm_scale", "interpret", "tuning"))
def paged_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    page_tables: jax.Array,
    kv_lens: jax.Array,
    q_lens: jax.Array,
    *,
    sm_scale: float,
    interpret: bool = False,
    tuning: PagedAttentionTuning | None = None,
) -> jax.Array:
  """Causal multi-query attention over a paged KV cache (one layer).

  Args:
    q: [B, Tq, NQ, HD] queries (already normed/RoPE'd).
    k_pages, v_pages: [NKV, num_pages, page_size, HD] KV pool; the new tokens
      must already be written (see :func:`write_kv`).
    page_tables: i32[B, pages_per_lane]; entry j of lane b is the pool page
      holding that lane's tokens [j*page_size, (j+1)*page_size). Entries past
      the lane's length are never dereferenced.
    kv_lens: i32[B] tokens in the cache per lane, including the new ones.
    q_lens: i32[B] valid query tokens per lane (0..Tq). Query t of lane b is
      at absolute position kv_lens[b] - q_lens[b] + t.
    sm_scale: softmax scale (e.g. HD ** -0.5).
    interpret: run the Pallas interpreter (CPU tests).
    tuning: block sizes; ``None`` looks up ``tuned_block_sizes``.

  Returns:
    [B, Tq, NQ, HD] in q.dtype; rows t >= q_lens[b] are zeros; a valid row
    that needs a position whose page id is outside ``[0, num_pages)`` is NaN.

  Raises:
    ValueError: on inconsistent shapes or dtypes (see ``_static_validate``),
      and on the Triton path for a dot dimension below 16 (head_dim, or the
      tuning's key block ``pages_per_compute_block * page_size``).
  """
  _static_validate(q, k_pages, v_pages, page_tables, kv_lens, q_lens, interpret)
  b, tq, nq, hd = q.shape
  nkv, num_pages, page_size, _ = k_pages.shape
  group = nq // nkv
  if tuning is None:
    tuning = get_paged_attention_tuning(hd, page_size, tq * group)

  # --- fold (Tq, G) into rows -------------------------------------------------
  n_rows = tq * group
  block_rows, rows_pad = query_rows(tq, group, tuning)
  qf = q.reshape(b, tq, nkv, group, hd).transpose(0, 2, 1, 3, 4)
  qf = qf.reshape(b, nkv, n_rows, hd)
  if rows_pad != n_rows:
    qf = jnp.pad(qf, ((0, 0), (0, 0), (0, rows_pad - n_rows), (0, 0)))
  out, split = _attend_rows(qf, k_pages, v_pages, page_tables, kv_lens, q_lens,
                            group=group, block_rows=block_rows, sm_scale=sm_scale,
                            interpret=interpret, tuning=tuning, force_split=False)
  if split:
    o_part, l_part, m_part = out
    m_max = jnp.max(m_part, axis=0)
    w = jnp.exp(m_part - m_max[None])
    l_tot = jnp.sum(l_part * w, axis=0)
    o = jnp.sum(o_part * w[..., None], axis=0)
    o = o / jnp.where(l_tot > 0.0, l_tot, 1.0)[..., None]
    o = o.astype(q.dtype)
  else:
    o = out
  o = o[:, :, :n_rows].reshape(b, nkv, tq, group, hd).transpose(0, 2, 1, 3, 4)
  return o.reshape(b, tq, nq, hd)


# ---------------------------------------------------------------------------
# Gated attention over folded rows (the fused attention layer's middle)
# ---------------------------------------------------------------------------


def _merge_gate_kernel(
    o_ref,  # f32[S, HD]   this row's unnormalised partial outputs, one per split
    l_ref,  # f32[S]       their row sums
    m_ref,  # f32[S]       their row maxima
    gate_ref,  # [HD]      the row's gate logits (a column block of the qkv projection)
    out_ref,  # [HD]       the gated output row
    *,
    splits: int,
):
  m = [m_ref[s] for s in range(splits)]
  m_max = m[0]
  for x in m[1:]:
    m_max = jnp.maximum(m_max, x)
  l_tot = jnp.zeros((), jnp.float32)
  acc = jnp.zeros(o_ref.shape[1:], jnp.float32)
  for s in range(splits):
    w = jnp.exp(m[s] - m_max)
    l_tot = l_tot + l_ref[s] * w
    acc = acc + o_ref[s, :] * w
  dt = out_ref.dtype
  o = (acc / jnp.where(l_tot > 0.0, l_tot, 1.0)).astype(dt)
  g = gate_ref[...].astype(jnp.float32)
  sg = (1.0 / (1.0 + jnp.exp(-g))).astype(dt)          # jax.nn.sigmoid in the gate's dtype
  out_ref[...] = (o.astype(jnp.float32) * sg.astype(jnp.float32)).astype(dt)


def _gated_validate(qf, qkv, num_q_heads, k_pages):
  if qf.ndim != 4:
    raise ValueError(f"qf must be [B, NKV, rows, HD], got shape {qf.shape}")
  if qkv.ndim != 3:
    raise ValueError(f"qkv must be [B, Tq, (2 NQ + 2 NKV) HD], got shape {qkv.shape}")
  b, nkv, rows, hd = qf.shape
  if num_q_heads % nkv:
    raise ValueError(f"num_q_heads ({num_q_heads}) must be a multiple of NKV ({nkv})")
  if qkv.shape[0] != b or qkv.shape[2] != (2 * num_q_heads + 2 * nkv) * hd:
    raise ValueError(f"qkv {qkv.shape} does not match qf {qf.shape} with "
                     f"{num_q_heads} query heads")
  if rows < qkv.shape[1] * (num_q_heads // nkv):
    raise ValueError(f"qf holds {rows} rows, fewer than Tq * G = "
                     f"{qkv.shape[1] * (num_q_heads // nkv)}")
  if qkv.dtype != qf.dtype:
    raise ValueError(f"qkv and qf dtypes differ: {qkv.dtype} and {qf.dtype}")
  if k_pages.shape[0] != nkv or k_pages.shape[3] != hd:
    raise ValueError(f"the pool {k_pages.shape} does not match qf {qf.shape} in NKV/HD")


@functools.partial(jax.jit, static_argnames=("num_q_heads", "sm_scale", "interpret",
                                             "tuning", "num_warps"))
def paged_attention_gated(qf, k_pages, v_pages, page_tables, kv_lens, q_lens, qkv, *,
                          num_q_heads: int, sm_scale: float, interpret: bool = False,
                          tuning: PagedAttentionTuning | None = None, num_warps: int = 4):
  """Gated attention from folded query rows: :func:`paged_attention`, then ``o *
  sigmoid(gate)`` with the gate read straight from the fused qkv projection.

  Two kernels: the attention kernel over qf (always in split form, so the second kernel
  finishes every row the same way), then one program per (lane, kv head, row) that merges
  the splits (flash decoding), rounds to qf's dtype, and multiplies by the sigmoid of the
  row's gate, each rounded to that dtype (the model's ``o * jax.nn.sigmoid(gate)``), writing
  the row where the model's reshape puts it.

  Args:
    qf: [B, NKV, rows, HD] normed, roped queries folded as :func:`paged_attention` folds
      them (row t * G + g is query head kv_head * G + g of token t), rows >= Tq * G ignored;
      rows must be ``query_rows(Tq, G, tuning)[1]`` (qk_norm_rope_write writes that).
    k_pages, v_pages, page_tables, kv_lens, q_lens: as :func:`paged_attention`.
    qkv: [B, Tq, (2 NQ + 2 NKV) HD] the fused projection; head j's gate is columns
      [(2 j + 1) HD, (2 j + 2) HD).
    num_q_heads: NQ.
  Returns:
    [B, Tq, NQ * HD] in qf's dtype; rows t >= q_lens[b] are zeros.
  Raises:
    ValueError: on inconsistent shapes (and as :func:`paged_attention`).
  """
  _gated_validate(qf, qkv, num_q_heads, k_pages)
  b, tq, _ = qkv.shape
  nkv, hd = qf.shape[1], qf.shape[3]
  group = num_q_heads // nkv
  q_shape = jnp.zeros((b, tq, num_q_heads, hd), qf.dtype)      # shapes only: checks
  _static_validate(q_shape, k_pages, v_pages, page_tables, kv_lens, q_lens, interpret)
  if tuning is None:
    tuning = get_paged_attention_tuning(hd, k_pages.shape[2], tq * group)
  block_rows, rows_pad = query_rows(tq, group, tuning)
  if qf.shape[2] != rows_pad:
    raise ValueError(f"qf must hold {rows_pad} rows for Tq={tq}, G={group}, got {qf.shape[2]}")
  (o_part, l_part, m_part), _ = _attend_rows(
      qf, k_pages, v_pages, page_tables, kv_lens, q_lens, group=group,
      block_rows=block_rows, sm_scale=sm_scale, interpret=interpret, tuning=tuning,
      force_split=True)
  splits = o_part.shape[0]
  grid = (b, nkv, tq * group)
  return pl.pallas_call(
      functools.partial(_merge_gate_kernel, splits=splits),
      grid=grid,
      in_specs=[
          pl.BlockSpec((splits, None, None, None, hd), lambda i, h, r: (0, i, h, r, 0)),
          pl.BlockSpec((splits, None, None, None), lambda i, h, r: (0, i, h, r)),
          pl.BlockSpec((splits, None, None, None), lambda i, h, r: (0, i, h, r)),
          pl.BlockSpec((None, None, hd),
                       lambda i, h, r: (i, r // group, 2 * (h * group + r % group) + 1)),
      ],
      out_specs=pl.BlockSpec((None, None, hd),
                             lambda i, h, r: (i, r // group, h * group + r % group)),
      out_shape=jax.ShapeDtypeStruct((b, tq, num_q_heads * hd), qf.dtype),
      compiler_params=pltr.CompilerParams(num_warps=num_warps, num_stages=1),
      interpret=interpret,
      name=f"attention_merge_gate_s{splits}",
  )(o_part, l_part, m_part, qkv)


@functools.partial(jax.jit, static_argnames=("num_q_heads", "sm_scale", "interpret",
                                             "tuning", "num_warps"))
def paged_attention_gated_reference(qf, k_pages, v_pages, page_tables, kv_lens, q_lens, qkv,
                                    *, num_q_heads: int, sm_scale: float,
                                    interpret: bool = False, tuning=None, num_warps: int = 4):
  """jnp version of :func:`paged_attention_gated` (same signature): unfold the rows,
  :func:`paged_attention_reference`, then the model's ``o * jax.nn.sigmoid(gate)``."""
  del interpret, tuning, num_warps
  _gated_validate(qf, qkv, num_q_heads, k_pages)
  b, tq, _ = qkv.shape
  nkv, hd = qf.shape[1], qf.shape[3]
  group = num_q_heads // nkv
  q = qf[:, :, :tq * group].reshape(b, nkv, tq, group, hd).transpose(0, 2, 1, 3, 4)
  q = q.reshape(b, tq, num_q_heads, hd)
  o = paged_attention_reference(q, k_pages, v_pages, page_tables, kv_lens, q_lens,
                                sm_scale=sm_scale)
  gate = qkv[..., :2 * num_q_heads * hd].reshape(b, tq, num_q_heads, 2 * hd)[..., hd:]
  return o.reshape(b, tq, num_q_heads * hd) * jax.nn.sigmoid(gate.reshape(b, tq, -1))


# ---------------------------------------------------------------------------
# Reference and KV write
# ---------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("sm_scale", "interpret", "tuning"))
def paged_attention_reference(
    q, k_pages, v_pages, page_tables, kv_lens, q_lens, *, sm_scale,
    interpret=False, tuning=None):
  """Plain-jnp oracle with the signature of :func:`paged_attention`.

  Gathers every page of every lane, masks causally (NaN-safe ``where`` on
  scores and on V), and does an f32 softmax. Rows that need a page id outside
  the pool come out NaN, as in the kernel. ``interpret``/``tuning`` are
  accepted and ignored so tests can swap the two functions.
  """
  del interpret, tuning
  _static_validate(q, k_pages, v_pages, page_tables, kv_lens, q_lens, True)
  b, tq, nq, hd = q.shape
  nkv, num_pages, page_size, _ = k_pages.shape
  group = nq // nkv
  n_ctx = page_tables.shape[1] * page_size
  in_pool = (page_tables >= 0) & (page_tables < num_pages)  # [B, pages_per_lane]
  table = jnp.where(in_pool, page_tables, 0)  # a safe address; bad pages poison below
  k = k_pages[:, table].reshape(nkv, b, n_ctx, hd).astype(jnp.float32)
  v = v_pages[:, table].reshape(nkv, b, n_ctx, hd).astype(jnp.float32)
  kpos = jnp.arange(n_ctx, dtype=jnp.int32)
  t = jnp.arange(tq, dtype=jnp.int32)
  qpos = kv_lens[:, None] - q_lens[:, None] + t[None, :]  # [B, Tq]
  row_valid = t[None, :] < q_lens[:, None]  # [B, Tq]
  # A row that needs a position whose page id is outside the pool (a corrupt table) is NaN.
  bad_pos = ~jnp.repeat(in_pool, page_size, axis=1)  # [B, n_ctx]
  poison = row_valid & jnp.any(
      bad_pos[:, None, :] & (kpos[None, None, :] <= qpos[:, :, None]), axis=-1)  # [B, Tq]
  mask = (kpos[None, None, :] <= qpos[:, :, None]) & row_valid[:, :, None]
  mask &= kpos[None, None, :] < kv_lens[:, None, None]  # [B, Tq, n_ctx]
  v = jnp.where((kpos[None, None, :] < kv_lens[None, :, None])[..., None], v, 0.0)

  qg = q.reshape(b, tq, nkv, group, hd).astype(jnp.float32)
  s = jnp.einsum("btngd,nbsd->bngts", qg, k, precision=lax.Precision.HIGHEST)
  s = s * sm_scale
  mask = mask[:, None, None]  # [B, 1, 1, Tq, n_ctx]
  s = jnp.where(mask, s, -jnp.inf)
  m = jnp.max(s, axis=-1, keepdims=True)
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  p = jnp.where(mask, jnp.exp(s - m), 0.0)
  l = jnp.sum(p, axis=-1, keepdims=True)
  o = jnp.einsum("bngts,nbsd->btngd", p, v, precision=lax.Precision.HIGHEST)
  o = o / jnp.where(l > 0, l, 1.0).transpose(0, 3, 1, 2, 4)
  o = jnp.where(poison[:, :, None, None, None], jnp.nan, o)
  return o.reshape(b, tq, nq, hd).astype(q.dtype)


def _write_kv_validate(k_pages, v_pages, k_new, v_new, page_tables, kv_lens, q_lens):
  if k_pages.ndim != 4 or k_pages.shape != v_pages.shape:
    raise ValueError(
        "k_pages and v_pages must both be [NKV, num_pages, page_size, HD], got "
        f"{k_pages.shape} and {v_pages.shape}")
  if k_new.ndim != 4 or k_new.shape != v_new.shape:
    raise ValueError(
        f"k_new and v_new must both be [B, Tq, NKV, HD], got {k_new.shape} and "
        f"{v_new.shape}")
  b, _, nkv, hd = k_new.shape
  if (nkv, hd) != (k_pages.shape[0], k_pages.shape[3]):
    raise ValueError(
        f"k_new [B, Tq, NKV, HD]={k_new.shape} does not match the pool "
        f"{k_pages.shape} in NKV/HD")
  if page_tables.ndim != 2 or page_tables.shape[0] != b:
    raise ValueError(
        f"page_tables must be [B={b}, pages_per_lane], got {page_tables.shape}")
  if kv_lens.shape != (b,) or q_lens.shape != (b,):
    raise ValueError(
        f"kv_lens and q_lens must be [B={b}], got {kv_lens.shape} and {q_lens.shape}")
  for name, arr in (("page_tables", page_tables), ("kv_lens", kv_lens),
                    ("q_lens", q_lens)):
    if arr.dtype != jnp.int32:
      raise ValueError(f"{name} must be int32, got {arr.dtype}")


@jax.jit
def write_kv(k_pages, v_pages, k_new, v_new, page_tables, kv_lens, q_lens):
  """Scatter the valid new tokens of every lane into the paged pool.

  Token t of lane b (t < q_lens[b]) goes to absolute position
  ``pos = kv_lens[b] - q_lens[b] + t``, i.e. page ``page_tables[b, pos //
  page_size]``, slot ``pos % page_size``. Rows t >= q_lens[b] are routed to
  an out-of-range page index and dropped, so they write nothing.

  Plain jnp (a scatter). The caller should jit its step with the pools
  donated (``donate_argnames``) so XLA updates them in place.

  Args:
    k_pages, v_pages: [NKV, num_pages, page_size, HD].
    k_new, v_new: [B, Tq, NKV, HD] (cast to the pool dtype).
    page_tables: i32[B, pages_per_lane]; kv_lens, q_lens: i32[B] as in
      :func:`paged_attention` (kv_lens counts the new tokens).

  Returns:
    (k_pages, v_pages) updated.
  """
  _write_kv_validate(k_pages, v_pages, k_new, v_new, page_tables, kv_lens, q_lens)
  _, tq, _, _ = k_new.shape
  num_pages, page_size = k_pages.shape[1], k_pages.shape[2]
  pages_per_lane = page_tables.shape[1]
  t = jnp.arange(tq, dtype=jnp.int32)
  pos = kv_lens[:, None] - q_lens[:, None] + t[None, :]  # [B, Tq]
  valid = (t[None, :] < q_lens[:, None]) & (pos >= 0) & (pos < pages_per_lane * page_size)
  page_col = jnp.clip(pos // page_size, 0, pages_per_lane - 1)
  page = jnp.take_along_axis(page_tables, page_col, axis=1)
  # Invalid rows, and page ids outside the pool (a corrupt table: negative ids would
  # otherwise wrap around to another lane's page), are routed out of range -> dropped.
  valid &= (page >= 0) & (page < num_pages)
  page = jnp.where(valid, page, num_pages)
  slot = jnp.where(valid, pos % page_size, 0)
  # Advanced indices (page, slot) are adjacent -> update shape [NKV, B, Tq, HD].
  k_upd = k_new.transpose(2, 0, 1, 3).astype(k_pages.dtype)
  v_upd = v_new.transpose(2, 0, 1, 3).astype(v_pages.dtype)
  k_pages = k_pages.at[:, page, slot].set(k_upd, mode="drop")
  v_pages = v_pages.at[:, page, slot].set(v_upd, mode="drop")
  return k_pages, v_pages


def write_kv_reference(k_pages, v_pages, k_new, v_new, page_tables, kv_lens, q_lens):
  """Loop-over-tokens numpy specification of :func:`write_kv` (host only)."""
  kp = np.array(k_pages)
  vp = np.array(v_pages)
  kn, vn = np.asarray(k_new), np.asarray(v_new)
  table, kv, ql = np.asarray(page_tables), np.asarray(kv_lens), np.asarray(q_lens)
  num_pages, page_size = kp.shape[1], kp.shape[2]
  for b in range(kn.shape[0]):
    for t in range(int(ql[b])):
      pos = int(kv[b]) - int(ql[b]) + t
      page, slot = table[b, pos // page_size], pos % page_size
      if not 0 <= page < num_pages:
        continue  # a corrupt table entry: the write is dropped
      kp[:, page, slot] = kn[b, t]
      vp[:, page, slot] = vn[b, t]
  return kp, vp

