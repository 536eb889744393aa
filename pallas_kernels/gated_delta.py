"""Gated delta rule (GDN) kernels: chunked prefill and speculative verify/decode.

Math (spec §4.1, per value head, state ``S`` is ``[DK, DV]`` f32, HF layout)::

    S   = exp(g_t) * S                 # decay first
    u_t = beta_t * (v_t - S.T @ k_t)   # delta-rule correction
    S   = S + outer(k_t, u_t)          # rank-1 write
    o_t = S.T @ q_t                    # read-out from the UPDATED state

Inputs are already head-expanded (one q/k row per value head), q and k are
L2-normalised and q is pre-scaled; ``g <= 0`` and ``beta`` are f32 ``[B, T, H]``.

Both kernels use the Triton backend (``pltr.CompilerParams`` is always
passed) and a grid over ``(B, H, DV // block_v)``: the recurrence is
separable over value columns, so splitting DV gives more programs and fewer
registers per program without any cross-program communication.

``chunk_gated_delta`` (prefill)
    Each program loops over chunks of ``chunk_size`` tokens and applies the
    chunked WY form of spec §4.2 with f32 matmuls (precision HIGHEST, i.e.
    IEEE f32 on the GPU, not TF32). ``(I + A)^-1`` is formed inside the kernel
    by forward substitution (one masked row update per chunk row; stable, the
    same recurrence a unit-lower triangular solve runs). The within-chunk
    cumulative decay ``gamma`` is computed by the wrapper (a tiny XLA cumsum).

``gated_delta_verify`` (speculative verify, and plain decode with T = 1)
    "Pending-token replay" rollback. The stored state is the *committed*
    state from before the previous verify block; the previous block's
    (k, v, g, beta) are kept as a pending buffer. One call:

    1. reads the state once,
    2. replays the first ``n_pend[b]`` pending tokens (the tokens accepted in
       the previous round; no outputs) -> committed state ``S_c``,
    3. writes ``S_c`` back in place (the state input is aliased to the
       output) -- the only state write,
    4. runs the ``T`` new tokens from ``S_c`` in registers, emitting ``o``.

    The caller then stores this call's (k, v, g, beta) as the next pending
    buffer and sets ``n_pend = accepted + 1``. State traffic is one read and
    one write per step whatever the number of drafts; the extra cost is
    replaying up to ``P`` rank-1 updates, which is compute on data already in
    registers.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from pallas_kernels.tuned_block_sizes import TRITON_MIN_DOT, GatedDeltaTuning, get_gated_delta_tuning

_HI = lax.Precision.HIGHEST


def _is_pow2(x: int) -> bool:
  return x > 0 and (x & (x - 1)) == 0


def _dot(a, b):
  return jnp.dot(a, b, preferred_element_type=jnp.float32, precision=_HI)


def _dot_tn(a, b):  # a.T @ b
  return lax.dot_general(a, b, (((0,), (0,)), ((), ())),
                         preferred_element_type=jnp.float32, precision=_HI)


def _dot_nt(a, b):  # a @ b.T
  return lax.dot_general(a, b, (((1,), (1,)), ((), ())),
                         preferred_element_type=jnp.float32, precision=_HI)


def _block_v(dv: int, tuning: GatedDeltaTuning, interpret: bool) -> int:
  bv = min(tuning.block_v, dv)
  if not interpret and bv < TRITON_MIN_DOT:
    raise ValueError(f"the Triton kernel needs block_v >= {TRITON_MIN_DOT} (a dot dimension), "
                     f"got block_v={bv} for DV={dv}")
  if dv % bv == 0:
    return bv
  if interpret:
    return dv
  raise ValueError(f"block_v={tuning.block_v} must divide DV={dv}")


# ---------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------


def _validate_tokens(prefix, q, k, v, g, beta, b=None, h=None):
  if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
    raise ValueError(
        f"{prefix}q, k must be [B, T, H, DK] and v [B, T, H, DV]; got {q.shape}, "
        f"{k.shape}, {v.shape}")
  if q.shape != k.shape:
    raise ValueError(f"{prefix}q and k must have the same shape, got {q.shape} and {k.shape}")
  bt = q.shape[:3]
  if v.shape[:3] != bt:
    raise ValueError(f"{prefix}v must be [B, T, H, DV] matching q {q.shape}, got {v.shape}")
  if g.shape != bt or beta.shape != bt:
    raise ValueError(
        f"{prefix}g and beta must be [B, T, H]={bt}, got {g.shape} and {beta.shape}")
  for name, x in (("g", g), ("beta", beta)):
    if x.dtype != jnp.float32:
      raise ValueError(f"{prefix}{name} must be float32, got {x.dtype}")
  if b is not None and q.shape[0] != b:
    raise ValueError(f"{prefix}batch {q.shape[0]} does not match the state batch {b}")
  if h is not None and q.shape[2] != h:
    raise ValueError(f"{prefix}heads {q.shape[2]} do not match the state heads {h}")


def _validate_state(state, q, v, *, slots=False):
  """state [B, H, DK, DV]; with slots=True, [S >= B, H, DK, DV] (lanes 0..B-1 are used)."""
  b, _, h, dk = q.shape
  dv = v.shape[-1]
  ok = (state.ndim == 4 and state.shape[1:] == (h, dk, dv)
        and (state.shape[0] >= b if slots else state.shape[0] == b))
  if not ok:
    want = f"[S >= {b}, {h}, {dk}, {dv}]" if slots else str((b, h, dk, dv))
    raise ValueError(f"state must be [B, H, DK, DV]={want}, got {state.shape}")
  if state.dtype != jnp.float32:
    raise ValueError(f"state must be float32, got {state.dtype}")


def _validate_triton_dims(dk, dv, interpret):
  if not interpret:
    if not _is_pow2(dk) or dk < 16:
      raise ValueError(f"the Triton kernel needs a power-of-two DK >= 16, got {dk}")
    if not _is_pow2(dv):
      raise ValueError(f"the Triton kernel needs a power-of-two DV, got {dv}")


# ---------------------------------------------------------------------------
# Chunked prefill kernel
# ---------------------------------------------------------------------------


def _chunk_kernel(
    q_ref,  # [T_pad, DK]   queries of (lane, head)
    k_ref,  # [T_pad, DK]
    v_ref,  # [T_pad, bv]   this program's value columns
    gam_ref,  # f32[T_pad]  within-chunk cumulative log decay
    beta_ref,  # f32[T_pad]
    s_in_ref,  # f32[DK, bv] initial state columns
    o_ref,  # [T_pad, bv]
    s_out_ref,  # f32[DK, bv] final state columns (aliases s_in)
    *,
    chunk: int,
    n_chunks: int,
):
  c_iota_r = lax.broadcasted_iota(jnp.int32, (chunk, chunk), 0)
  c_iota_c = lax.broadcasted_iota(jnp.int32, (chunk, chunk), 1)
  lower_incl = c_iota_r >= c_iota_c
  strict = c_iota_r > c_iota_c
  eye = jnp.where(c_iota_r == c_iota_c, 1.0, 0.0).astype(jnp.float32)
  last = lax.broadcasted_iota(jnp.int32, (chunk,), 0) == chunk - 1

  def chunk_body(c, s):
    sl = pl.ds(c * chunk, chunk)
    qc = q_ref[sl, :].astype(jnp.float32)  # [C, DK]
    kc = k_ref[sl, :].astype(jnp.float32)  # [C, DK]
    vc = v_ref[sl, :].astype(jnp.float32)  # [C, bv]
    gam = gam_ref[sl]  # [C]
    beta = beta_ref[sl]  # [C]

    # Causal decay D_ij = exp(gam_i - gam_j), i >= j; mask BEFORE exp.
    diff = jnp.where(lower_incl, gam[:, None] - gam[None, :], 0.0)
    decay = jnp.where(lower_incl, jnp.exp(diff), 0.0)  # [C, C]
    kk = _dot_nt(kc, kc)  # [C, C]
    a = jnp.where(strict, beta[:, None] * kk * decay, 0.0)

    # tinv = (I + A)^-1 by forward substitution: row i = e_i - A[i, :] @ tinv.
    def subst(i, tinv):
      sel = c_iota_r == i
      a_row = jnp.sum(jnp.where(sel, a, 0.0), axis=0)  # [C]
      new_row = jnp.sum(a_row[:, None] * tinv, axis=0)  # [C]
      return jnp.where(sel, eye - new_row[None, :], tinv)

    tinv = lax.fori_loop(1, chunk, subst, eye)

    big_gam = jnp.exp(gam)  # [C]
    u = _dot(tinv, vc * beta[:, None])  # [C, bv]
    wk = _dot(tinv, kc * (beta * big_gam)[:, None])  # [C, DK]
    v_new = u - _dot(wk, s)  # [C, bv]
    qk = jnp.where(lower_incl, _dot_nt(qc, kc) * decay, 0.0)  # [C, C]
    o = _dot(qc * big_gam[:, None], s) + _dot(qk, v_new)  # [C, bv]
    o_ref[sl, :] = o.astype(o_ref.dtype)

    gam_last = jnp.sum(jnp.where(last, gam, 0.0))
    k_dec = kc * jnp.exp(gam_last - gam)[:, None]  # [C, DK]
    return jnp.exp(gam_last) * s + _dot_tn(k_dec, v_new)

  s = s_in_ref[...]
  s = lax.fori_loop(0, n_chunks, chunk_body, s)
  s_out_ref[...] = s


def _chunk_pad(x, t_pad):
  t = x.shape[1]
  if t == t_pad:
    return x
  pad = [(0, 0)] * x.ndim
  pad[1] = (0, t_pad - t)
  return jnp.pad(x, pad)


@functools.partial(jax.jit, static_argnames=("chunk_size", "interpret", "tuning"))
def chunk_gated_delta(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    state: jax.Array,
    *,
    chunk_size: int = 64,
    interpret: bool = False,
    tuning: GatedDeltaTuning | None = None,
) -> tuple[jax.Array, jax.Array]:
  """Chunked (WY-form) gated delta rule over a prompt chunk.

  Args:
    q, k: [B, T, H, DK] (L2-normalised; q pre-scaled by DK**-0.5).
    v: [B, T, H, DV].
    g: f32[B, T, H] log decay (<= 0); beta: f32[B, T, H].
    state: f32[B, H, DK, DV] initial state (zeros for a fresh prompt). It is
      aliased to ``final_state``, so donating it updates it in place.
    chunk_size: tokens per chunk (64 = HF/FLA; Triton needs a power of two
      >= 16). T need not be a multiple: the tail is zero-padded (a no-op).
    interpret: run the Pallas interpreter.
    tuning: ``GatedDeltaTuning``; ``None`` looks up ``tuned_block_sizes``.

  Returns:
    (o [B, T, H, DV] in v.dtype, final_state f32[B, H, DK, DV]).

  Ragged lanes: right-pad a shorter lane with ``g = beta = 0`` (and any
  finite q, k, v). Such a token leaves the state unchanged, so the final
  state is that of the real tokens; outputs at padded positions are junk.
  """
  _validate_tokens("", q, k, v, g, beta)
  _validate_state(state, q, v)
  b, t, h, dk = q.shape
  dv = v.shape[-1]
  if t < 1:
    raise ValueError(f"T must be >= 1, got {t}")
  if chunk_size < 1:
    raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
  if not interpret and (not _is_pow2(chunk_size) or chunk_size < 16):
    raise ValueError(
        f"the Triton kernel needs a power-of-two chunk_size >= 16, got {chunk_size}")
  _validate_triton_dims(dk, dv, interpret)
  if tuning is None:
    tuning = get_gated_delta_tuning("chunk", dk, dv)
  bv = _block_v(dv, tuning, interpret)

  n_chunks = pl.cdiv(t, chunk_size)
  t_pad = n_chunks * chunk_size
  q_p, k_p, v_p = (_chunk_pad(x, t_pad) for x in (q, k, v))
  g_p, beta_p = _chunk_pad(g, t_pad), _chunk_pad(beta, t_pad)
  gam = jnp.cumsum(g_p.reshape(b, n_chunks, chunk_size, h), axis=2).reshape(b, t_pad, h)

  kernel = functools.partial(_chunk_kernel, chunk=chunk_size, n_chunks=n_chunks)
  grid = (b, h, dv // bv)
  o, s_out = pl.pallas_call(
      kernel,
      grid=grid,
      in_specs=[
          pl.BlockSpec((None, t_pad, None, dk), lambda i, j, c: (i, 0, j, 0)),  # q
          pl.BlockSpec((None, t_pad, None, dk), lambda i, j, c: (i, 0, j, 0)),  # k
          pl.BlockSpec((None, t_pad, None, bv), lambda i, j, c: (i, 0, j, c)),  # v
          pl.BlockSpec((None, t_pad, None), lambda i, j, c: (i, 0, j)),  # gamma
          pl.BlockSpec((None, t_pad, None), lambda i, j, c: (i, 0, j)),  # beta
          pl.BlockSpec((None, None, dk, bv), lambda i, j, c: (i, j, 0, c)),  # state
      ],
      out_specs=[
          pl.BlockSpec((None, t_pad, None, bv), lambda i, j, c: (i, 0, j, c)),
          pl.BlockSpec((None, None, dk, bv), lambda i, j, c: (i, j, 0, c)),
      ],
      out_shape=[
          jax.ShapeDtypeStruct((b, t_pad, h, dv), v.dtype),
          jax.ShapeDtypeStruct((b, h, dk, dv), jnp.float32),
      ],
      input_output_aliases={5: 1},
      compiler_params=pltr.CompilerParams(num_warps=tuning.num_warps,
                                          num_stages=tuning.num_stages),
      interpret=interpret,
      name=f"chunk_gated_delta_c{chunk_size}_{tuning.name}",
  )(q_p, k_p, v_p, gam, beta_p, state)
  return o[:, :t], s_out


# ---------------------------------------------------------------------------
# Verify / decode kernel (pending-token replay)
# ---------------------------------------------------------------------------


def _verify_kernel(
    n_pend_ref,  # i32[1]       pending tokens to replay for this lane
    live_ref,  # i32[1]         1 if the lane runs this step, 0 if it is idle
    s_in_ref,  # f32[DK, bv]    committed state before the previous block
    pk_ref,  # [P, DK]          pending keys
    pv_ref,  # [P, bv]          pending values (this program's columns)
    pg_ref,  # f32[P]           pending log decay
    pb_ref,  # f32[P]           pending beta
    q_ref,  # [T, DK]           new queries
    k_ref,  # [T, DK]
    v_ref,  # [T, bv]
    g_ref,  # f32[T]            (gated: [T, C] the rows of the tensor holding b and a)
    b_ref,  # f32[T]            (gated: the same [T, C] block, unused)
    *rest,  # gated: A_log f32[1], dt_bias f32[1] of this head; norm: w [DV]; then the
    # outputs: o_ref [T, bv] outputs of the new tokens (norm: the gated-normed outputs);
    # s_out_ref f32[DK, bv] committed state S_c (aliases s_in); with write_pend_v,
    # pv_out_ref [P, bv] (aliases pv_ref); with write_pending (bv = DV: one program per
    # head), pk_out, pv_out, pg_out, pb_out (alias the pending inputs): rows [0, T) take
    # this block's values once the replay has read the old ones
    n_new: int,
    gated: bool = False,
    gate_offset: int = 0,
    n_heads: int = 0,
    write_pend_v: bool = False,
    write_pending: bool = False,
    norm_offset: int = -1,
    norm_eps: float = 0.0,
    qk_l2norm: bool = False,
    ab_splits: int = 0,
    ab_dtype=None,
):
  head = pl.program_id(1)   # (read here: the interpreter has no program_id under pl.when)
  norm = norm_offset >= 0
  if gated:
    alog_ref, dtb_ref, *rest = rest
  if norm:
    nw_ref, *rest = rest
  o_ref, s_out_ref, *rest = rest
  pv_out_ref = rest[0] if write_pend_v else None
  if write_pending:
    pk_out_ref, pv_out_ref, pg_out_ref, pb_out_ref = rest

  def ab_at(t, idx):
    """The in-projection's row t at idx; from split partials: their f32 sum rounded to the
    projection's dtype (the GEMM's output)."""
    if not ab_splits:
      return g_ref[t, idx]
    x = g_ref[0, t, idx]
    for j in range(1, ab_splits):
      x = x + g_ref[j, t, idx]
    return x.astype(ab_dtype)

  def gates(t):
    """(g_t, beta_t) of new token t: read, or (gated) computed as the model does."""
    if not gated:
      return g_ref[t], b_ref[t]
    b_raw = ab_at(t, gate_offset + head)
    a = ab_at(t, gate_offset + n_heads + head).astype(jnp.float32) + dtb_ref[0].astype(jnp.float32)
    softplus = jnp.maximum(a, 0.0) + jnp.log1p(jnp.exp(-jnp.abs(a)))
    # sigmoid in f32, rounded once to b's dtype (gate_values)
    beta = (1.0 / (1.0 + jnp.exp(-b_raw.astype(jnp.float32)))).astype(b_raw.dtype)
    return -jnp.exp(alog_ref[0].astype(jnp.float32)) * softplus, beta.astype(jnp.float32)

  def new_qk(t):
    """(q_t, k_t) f32 of new token t: as passed, or (qk_l2norm) the raw conv outputs
    L2-normalised (eps 1e-6), q scaled by DK^-0.5, as mtpjax.model does."""
    q_t = q_ref[t, :].astype(jnp.float32)
    k_t = k_ref[t, :].astype(jnp.float32)
    if qk_l2norm:
      q_t = q_t * lax.rsqrt(jnp.sum(q_t * q_t) + 1e-6) * (q_t.shape[0] ** -0.5)
      k_t = k_t * lax.rsqrt(jnp.sum(k_t * k_t) + 1e-6)
    return q_t, k_t

  def store_pending():
    if write_pend_v or write_pending:
      for t in range(n_new):
        pv_out_ref[t, :] = v_ref[t, :].astype(pv_out_ref.dtype)
    if write_pending:
      for t in range(n_new):
        pk_out_ref[t, :] = new_qk(t)[1].astype(pk_out_ref.dtype)
        g_t, b_t = gates(t)
        pg_out_ref[t] = g_t.astype(pg_out_ref.dtype)
        pb_out_ref[t] = b_t.astype(pb_out_ref.dtype)

  def output(t, o):
    """o_t [DV] f32 -> what the kernel stores: o itself, or (norm) the GDN output norm of
    mtpjax.model.gated_rmsnorm on o rounded to z's dtype: rmsnorm (plain weight), then the
    SiLU(z) gate, z read from the in-projection rows at norm_offset + head * DV."""
    if not norm:
      return o.astype(o_ref.dtype)
    dt = o_ref.dtype
    x = o.astype(dt).astype(jnp.float32)
    y = (x * lax.rsqrt(jnp.mean(x * x) + norm_eps)).astype(dt)
    y = (nw_ref[...].astype(dt) * y).astype(jnp.float32)
    dv = o.shape[0]
    z = ab_at(t, pl.ds(norm_offset + head * dv, dv)).astype(jnp.float32)
    return (y * (z / (1.0 + jnp.exp(-z)))).astype(dt)

  def step(s, k_t, v_t, g_t, b_t):
    s = jnp.exp(g_t) * s
    pred = jnp.sum(s * k_t[:, None], axis=0)  # [bv] = S.T @ k
    u = b_t * (v_t - pred)
    return s + k_t[:, None] * u[None, :]

  def replay(p, s):
    return step(s, pk_ref[p, :].astype(jnp.float32), pv_ref[p, :].astype(jnp.float32),
                pg_ref[p], pb_ref[p])

  def new_token(t, s):
    g_t, b_t = gates(t)
    q_t, k_t = new_qk(t)
    s = step(s, k_t, v_ref[t, :].astype(jnp.float32), g_t, b_t)
    o = jnp.sum(s * q_t[:, None], axis=0)  # S.T @ q
    o_ref[t, :] = output(t, o)
    return s

  # An idle lane's state is neither read nor written (it stays in place: s_out aliases
  # s_in); its outputs are zeros, stored row by row: Triton tensors must have power-of-two
  # sizes, and T = k + 1 is not one for k = 2, 4, ...
  @pl.when(live_ref[0] == 0)
  def _idle():
    for t in range(n_new):
      o_ref[t, :] = jnp.zeros(o_ref.shape[1:], o_ref.dtype)
    store_pending()

  @pl.when(live_ref[0] != 0)
  def _run():
    s = s_in_ref[...]
    # Only the first n_pend slots are read; slots beyond may hold anything.
    s = lax.fori_loop(0, n_pend_ref[0], replay, s)
    s_out_ref[...] = s
    store_pending()       # after the replay: the new block replaces the pending values
    lax.fori_loop(0, n_new, new_token, s)


@functools.partial(jax.jit, static_argnames=("interpret", "tuning", "write_pend_v",
                                             "gate_offset", "write_pending", "norm_offset",
                                             "norm_eps", "qk_l2norm", "key_heads",
                                             "ab_dtype"))
def gated_delta_verify(
    state: jax.Array,
    pend_k: jax.Array,
    pend_v: jax.Array,
    pend_g: jax.Array,
    pend_beta: jax.Array,
    n_pend: jax.Array,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array | None,
    beta: jax.Array | None,
    *,
    live: jax.Array | None = None,
    gates: tuple | None = None,
    gate_offset: int = 0,
    write_pend_v: bool = False,
    write_pending: bool = False,
    norm_weight: jax.Array | None = None,
    norm_offset: int = -1,
    norm_eps: float = 1e-6,
    qk_l2norm: bool = False,
    key_heads: int = 0,
    ab_dtype=None,
    interpret: bool = False,
    tuning: GatedDeltaTuning | None = None,
):
  """Speculative verify (or decode, T = 1) step with pending-token replay.

  Args:
    state: f32[S, H, DK, DV], S >= B: committed state of S lane slots, from before
      the previous block; lane b of the call is slot b, slots >= B are neither
      read nor written (an engine step over a lane bucket passes its whole
      cache). Aliased to ``new_state``: donate it to update it in place.
    pend_k: [B, P, H, DK], pend_v: [B, P, H, DV] ([S >= B, P, H, DV] with
      write_pend_v), pend_g, pend_beta: f32[B, P, H] -- the previous block's
      inputs (P >= 1).
    n_pend: i32[B] in [0, P]: how many pending tokens to commit (accepted
      drafts of the previous round + 1; 0 when nothing is pending, e.g.
      right after prefill). Slots >= n_pend are never read.
    q, k: [B, T, H, DK], v: [B, T, H, DV], g, beta: f32[B, T, H] -- the new
      block (T = k + 1 for k drafts; T = 1 for plain decode).
    live: bool or i32 [B], optional: lanes that run this step. An idle lane's
      state slot is neither read nor written and its outputs are zeros (its
      tokens must be padding: the reference gives the same state). None: all run.
    gates: optional (ab [B, T, C], A_log [H], dt_bias [H]): the raw gate
      inputs b = ab[..., o:o + H] and a = ab[..., o + H:o + 2H] for o =
      gate_offset (static), e.g. the GDN in-projection's output as it is, so no
      slice of it is materialised: the kernel computes g = -exp(A_log)
      softplus(a + dt_bias) and beta = sigmoid(b) per new token itself
      (gate_values; pass g = beta = None). No mask: rows past a lane's valid
      tokens are padding whose outputs are unspecified.
    write_pend_v: also return pend_v with rows [0, T) of lanes < B replaced by
      v (the next pending values), written by the kernel after its replay has
      read the old ones; pend_v is aliased to that output (donate it).
    write_pending: like write_pend_v for all four pending buffers (each may
      have lane slots >= B): rows [0, T) of lanes < B take k, v and the block's
      g and beta (with gates: as computed, no mask; rows past a lane's valid
      tokens are never replayed, n_pend <= n_valid). One program per head
      (block_v = DV, the "verify_head" tuning): the replay's reads of pend_k,
      pend_g and pend_beta are then the program's own.
    norm_weight: [DV], with gates: the outputs come back through the GDN
      output norm (mtpjax.model.gated_rmsnorm) instead: o rounded to ab's
      dtype, RMSNorm over DV with this weight and norm_eps, times SiLU(z) for
      z = ab[..., norm_offset + h * DV:...+DV] of head h, in ab's dtype. One
      program per head, as write_pending.
    qk_l2norm: q and k are the raw [B, T, HK, DK] key-head rows (HK divides H;
      value head h reads key head h // (H / HK)): the kernel L2-normalises them
      (eps 1e-6) and scales q by DK^-0.5, as the model does, and pend_k takes
      the normalised k. With write_pending.
    key_heads: HK > 0 (implies qk_l2norm): q is the packed conv output
      [B, T, 2 HK DK + H DV] (raw q | raw k | v, the model's `mixed`) and k = v =
      None: the kernel reads each head's columns from it (no slice materialised).
    ab_dtype: with gates' ab given as f32 [S, B, T, C] split-K partial sums of
      the in-projection (mtpjax.model.dense_partials; no reduction kernel after
      the GEMM): the dtype their sum is rounded to (the projection's), static.
    interpret: run the Pallas interpreter.
    tuning: ``GatedDeltaTuning``; ``None`` looks up ``tuned_block_sizes``.

  Returns:
    (o [B, T, H, DV] in v.dtype, new_state f32[S, H, DK, DV]) where
    new_state is the state after the n_pend committed pending tokens
    (*not* after the new tokens); slots >= B keep their input values. With
    write_pend_v, the new pend_v is a third result; with write_pending, the
    new pend_k, pend_v, pend_g, pend_beta are results 3 to 6.
  """
  per_head = write_pending or norm_weight is not None
  if per_head and gates is None:
    raise ValueError("write_pending and norm_weight need gates (the in-projection rows)")
  if write_pending and write_pend_v:
    raise ValueError("write_pending writes pend_v too: pass one of them")
  packed = key_heads > 0
  if packed:
    if k is not None or v is not None:
      raise ValueError("key_heads: q is the packed [q | k | v] rows; pass k = v = None")
    qk_l2norm = True
    qkv = q
    h, dk, dv = state.shape[1:]
    hk = key_heads
    if (qkv.ndim != 3 or qkv.shape[-1] != 2 * hk * dk + h * dv or h % hk
        or (2 * hk * dk) % dv):
      raise ValueError(f"key_heads={hk}: q must be the packed [B, T, 2 HK DK + H DV="
                       f"{2 * hk * dk + h * dv}] rows (HK dividing H={h}, 2 HK DK a "
                       f"multiple of DV), got {qkv.shape}")
    q = k = jax.ShapeDtypeStruct(qkv.shape[:2] + (hk, dk), qkv.dtype)
    v = jax.ShapeDtypeStruct(qkv.shape[:2] + (h, dv), qkv.dtype)
  if qk_l2norm and not write_pending:
    raise ValueError("qk_l2norm needs write_pending (pend_k takes the normalised keys)")
  rep = 1
  if qk_l2norm:                     # the checks below see head-expanded q and k
    hk, h = q.shape[2], v.shape[2]
    if q.ndim != 4 or q.shape != k.shape or h % hk:
      raise ValueError(f"qk_l2norm: q and k must be [B, T, HK, DK] with HK dividing the "
                       f"value heads {h}, got {q.shape} and {k.shape}")
    rep = h // hk
    q_raw, k_raw = q, k
    q = k = jax.ShapeDtypeStruct(q.shape[:2] + (h,) + q.shape[3:], q.dtype)
  b, t, h, dk = q.shape
  gated = gates is not None
  if gated:
    if g is not None or beta is not None:
      raise ValueError("pass g = beta = None with gates (the kernel computes them)")
    ab, a_log, dt_bias = _validate_gates(gates, q, gate_offset, ab_dtype)
    g = beta = jnp.zeros(q.shape[:3], jnp.float32)      # for the checks only (unused)
  _validate_tokens("", q, k, v, g, beta)
  _validate_state(state, q, v, slots=True)
  dv = v.shape[-1]
  slots = write_pend_v or write_pending
  pends = (pend_k, pend_v, pend_g, pend_beta)
  if min(x.shape[0] for x in pends) < b:
    raise ValueError(f"the pending buffers have {[x.shape[0] for x in pends]} lane slots, "
                     f"the call runs {b}")
  cut = lambda x, on: x[:b] if on else x
  _validate_tokens("pending ", cut(pend_k, write_pending), cut(pend_k, write_pending),
                   cut(pend_v, slots), cut(pend_g, write_pending),
                   cut(pend_beta, write_pending), b=b, h=h)
  if norm_weight is not None and (norm_weight.shape != (dv,) or not
                                  0 <= norm_offset <= gates[0].shape[-1] - h * dv):
    raise ValueError(f"norm_weight must be [DV]=[{dv}] and z = ab[..., {norm_offset}:"
                     f"{norm_offset} + H*DV] inside ab {gates[0].shape}, got "
                     f"{norm_weight.shape}")
  p = pend_k.shape[1]
  if pend_k.shape[-1] != dk or pend_v.shape[-1] != dv:
    raise ValueError(
        f"pending k/v head dims {pend_k.shape[-1]}/{pend_v.shape[-1]} do not match "
        f"DK={dk}/DV={dv}")
  if t < 1 or p < 1:
    raise ValueError(f"T and P must be >= 1, got T={t}, P={p}")
  if slots and t > p:
    raise ValueError(f"writing the pending buffers needs T <= P, got T={t}, P={p}")
  if n_pend.shape != (b,) or n_pend.dtype != jnp.int32:
    raise ValueError(f"n_pend must be int32[B={b}], got {n_pend.dtype}{list(n_pend.shape)}")
  _validate_triton_dims(dk, dv, interpret)
  if tuning is None:
    tuning = get_gated_delta_tuning("verify_head" if per_head else "verify", dk, dv)
  bv = _block_v(dv, tuning, interpret)
  if per_head and bv != dv:
    raise ValueError(f"write_pending / norm_weight run one program per head: block_v must "
                     f"be DV={dv}, got {bv}")
  n_pend = jnp.clip(n_pend, 0, p)
  if live is None:
    live = jnp.ones((b,), jnp.int32)
  if live.shape != (b,):
    raise ValueError(f"live must be [B={b}], got {live.shape}")
  live = live.astype(jnp.int32)

  if qk_l2norm:
    q, k = q_raw, k_raw
  norm = norm_weight is not None
  if packed:
    q = k = v = qkv
  ab_splits = ab.shape[0] if gated and ab.ndim == 4 else 0
  out_dt = (ab_dtype or ab.dtype) if gated else None
  kernel = functools.partial(_verify_kernel, n_new=t, gated=gated, gate_offset=gate_offset,
                             qk_l2norm=qk_l2norm, ab_splits=ab_splits,
                             ab_dtype=jnp.dtype(out_dt) if gated else None,
                             n_heads=h, write_pend_v=write_pend_v,
                             write_pending=write_pending,
                             norm_offset=norm_offset if norm else -1, norm_eps=norm_eps)
  grid = (b, h, dv // bv)

  def tok_spec(n, d, col):
    if col:
      return pl.BlockSpec((None, n, None, d), lambda i, j, c: (i, 0, j, c))
    return pl.BlockSpec((None, n, None, d), lambda i, j, c: (i, 0, j, 0))

  def scal_spec(n):
    return pl.BlockSpec((None, n, None), lambda i, j, c: (i, 0, j))

  head_spec = pl.BlockSpec((1,), lambda i, j, c: (j,))
  state_spec = pl.BlockSpec((None, None, dk, bv), lambda i, j, c: (i, j, 0, c))
  if packed:       # column blocks of the packed rows: q, k in units of DK, v of bv
    v0 = 2 * key_heads * dk // bv
    new_specs = [pl.BlockSpec((None, t, dk), lambda i, j, c: (i, 0, j // rep)),
                 pl.BlockSpec((None, t, dk), lambda i, j, c: (i, 0, key_heads + j // rep)),
                 pl.BlockSpec((None, t, bv), lambda i, j, c: (i, 0, v0 + j * (dv // bv) + c))]
  else:
    new_qk_spec = pl.BlockSpec((None, t, None, dk), lambda i, j, c: (i, 0, j // rep, 0))
    new_specs = [new_qk_spec, new_qk_spec, tok_spec(t, bv, True)]
  in_specs = [
      pl.BlockSpec((1,), lambda i, j, c: (i,)),  # n_pend
      pl.BlockSpec((1,), lambda i, j, c: (i,)),  # live
      state_spec,
      tok_spec(p, dk, False), tok_spec(p, bv, True), scal_spec(p), scal_spec(p),
      *new_specs,
      scal_spec(t), scal_spec(t),
  ]
  args = [n_pend, live, state, pend_k, pend_v, pend_g, pend_beta, q, k, v, g, beta]
  if gated:
    ab_spec = (pl.BlockSpec((ab_splits, None, t, ab.shape[-1]), lambda i, j, c: (0, i, 0, 0))
               if ab_splits else pl.BlockSpec((None, t, ab.shape[-1]), lambda i, j, c: (i, 0, 0)))
    in_specs[-2:] = [ab_spec, ab_spec]
    args[-2:] = [ab, ab]
    in_specs += [head_spec, head_spec]
    args += [a_log, dt_bias]
  if norm:
    in_specs.append(pl.BlockSpec((dv,), lambda i, j, c: (0,)))
    args.append(norm_weight)
  out_specs = [tok_spec(t, bv, True), state_spec]
  out_shape = [jax.ShapeDtypeStruct((b, t, h, dv), out_dt if norm else
                                    jnp.float32 if packed else v.dtype),
               jax.ShapeDtypeStruct(state.shape, jnp.float32)]
  aliases = {2: 1}
  if write_pend_v:
    out_specs.append(tok_spec(p, bv, True))
    out_shape.append(jax.ShapeDtypeStruct(pend_v.shape, pend_v.dtype))
    aliases[4] = 2
  if write_pending:
    out_specs += [tok_spec(p, dk, False), tok_spec(p, bv, True), scal_spec(p), scal_spec(p)]
    out_shape += [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in pends]
    aliases.update({3: 2, 4: 3, 5: 4, 6: 5})
  name = (f"gated_delta_verify{'_gated' if gated else ''}{'_pv' if write_pend_v else ''}"
          f"{'_pend' if write_pending else ''}{'_norm' if norm else ''}"
          f"{'_l2' if qk_l2norm else ''}")
  return tuple(pl.pallas_call(
      kernel,
      grid=grid,
      in_specs=in_specs,
      out_specs=out_specs,
      out_shape=out_shape,
      input_output_aliases=aliases,
      compiler_params=pltr.CompilerParams(num_warps=tuning.num_warps,
                                          num_stages=tuning.num_stages),
      interpret=interpret,
      name=f"{name}_{tuning.name}",
  )(*args))


def _validate_gates(gates, q, offset: int, ab_dtype=None):
  """gates = (ab, A_log, dt_bias), checked; any float dtypes (the kernel reads them as f32,
  so the caller's buffers go in as they are); ab f32 [S, B, T, C] split partials with
  ab_dtype."""
  if len(gates) != 3:
    raise ValueError("gates must be (ab, A_log, dt_bias)")
  ab, a_log, dt_bias = gates
  bt, h = q.shape[:2], q.shape[2]
  if ab.ndim == 4 and (ab_dtype is None or ab.dtype != jnp.float32):
    raise ValueError(f"gates ab as split partials [S, B, T, C] must be f32 with ab_dtype "
                     f"given, got {ab.dtype} and ab_dtype={ab_dtype}")
  if ab.ndim == 4:
    ab = jax.ShapeDtypeStruct(ab.shape[1:], jnp.dtype(ab_dtype))   # for the checks
  if ab.ndim != 3 or ab.shape[:2] != bt or not 0 <= offset <= ab.shape[-1] - 2 * h:
    raise ValueError(f"gates ab must be [B, T, C]={bt} + [C] holding b and a in columns "
                     f"[{offset}, {offset} + 2H={offset + 2 * h}), got {ab.shape}")
  if a_log.shape != (h,) or dt_bias.shape != (h,):
    raise ValueError(f"A_log and dt_bias must be [H]=({h},), got {a_log.shape} and "
                     f"{dt_bias.shape}")
  return gates[0], a_log, dt_bias


def _gate_inputs(gates, q, offset: int):
  """(a, b, A_log, dt_bias) of gates = (ab, A_log, dt_bias) (see gated_delta_verify)."""
  ab, a_log, dt_bias = _validate_gates(gates, q, offset)
  h = q.shape[2]
  return ab[..., offset + h:offset + 2 * h], ab[..., offset:offset + h], a_log, dt_bias


def gate_values(a, b, a_log, dt_bias):
  """(g, beta) f32 [B, T, H] from the raw gate inputs (spec §3.6): what the model computes and
  what gated_delta_verify(gates=...) computes inside the kernel."""
  f32 = jnp.float32
  g = -jnp.exp(a_log.astype(f32)) * jax.nn.softplus(a.astype(f32) + dt_bias.astype(f32))
  # sigmoid in f32, rounded once to b's dtype (torch's b.sigmoid() on a bf16 b; XLA's bf16
  # logistic can land one ulp away from it, and the kernel computes it this way)
  return g, jax.nn.sigmoid(b.astype(f32)).astype(b.dtype).astype(f32)


# ---------------------------------------------------------------------------
# References (plain jnp, f32)
# ---------------------------------------------------------------------------


def _recurrent_step(s, k_t, v_t, g_t, b_t):
  """One token of spec §4.1 on [B, H, DK, DV]; returns the updated state."""
  s = jnp.exp(g_t)[..., None, None] * s
  pred = jnp.einsum("bhkv,bhk->bhv", s, k_t, precision=_HI)
  u = b_t[..., None] * (v_t - pred)
  return s + k_t[..., :, None] * u[..., None, :]


def _f32(*xs):
  return tuple(x.astype(jnp.float32) for x in xs)


@jax.jit
def recurrent_gated_delta_reference(q, k, v, g, beta, state):
  """Per-token recurrence (spec §4.1) with ``lax.scan``: the oracle.

  Same arguments as :func:`chunk_gated_delta`; returns (o in v.dtype,
  final_state f32).
  """
  _validate_tokens("", q, k, v, g, beta)
  _validate_state(state, q, v)
  qf, kf, vf, gf, bf = _f32(q, k, v, g, beta)

  def body(s, x):
    q_t, k_t, v_t, g_t, b_t = x
    s = _recurrent_step(s, k_t, v_t, g_t, b_t)
    return s, jnp.einsum("bhkv,bhk->bhv", s, q_t, precision=_HI)

  xs = tuple(jnp.moveaxis(x, 1, 0) for x in (qf, kf, vf, gf, bf))
  s, o = lax.scan(body, state.astype(jnp.float32), xs)
  return jnp.moveaxis(o, 0, 1).astype(v.dtype), s


def _unit_lower_solve(a, rhs):
  """(I + a)^-1 rhs for strictly lower-triangular a [..., C, C], rhs [..., C, N]: forward
  substitution, one row per step (the kernel's recurrence).

  Not `jax.scipy.linalg.solve_triangular`: on the CPU its LAPACK call splits the batch over
  the shared intra-op thread pool and waits for it inside a pool thread, which deadlocks when
  several devices run it at once (tensor-parallel programs on host devices).
  """
  def row(i, sol):
    upd = jnp.einsum("...j,...jn->...n", a[..., i, :], sol, precision=_HI)
    return sol.at[..., i, :].add(-upd)
  return lax.fori_loop(1, a.shape[-1], row, rhs)


@functools.partial(jax.jit, static_argnames=("chunk_size",))
def chunk_gated_delta_reference(q, k, v, g, beta, state, *, chunk_size=64):
  """Chunked WY form (spec §4.2) in jnp: ``lax.scan`` over chunks, f32.

  Same arguments/returns as :func:`chunk_gated_delta` (no kernel knobs).
  """
  _validate_tokens("", q, k, v, g, beta)
  _validate_state(state, q, v)
  b, t, h, dk = q.shape
  dv = v.shape[-1]
  c = chunk_size
  n = pl.cdiv(t, c)
  t_pad = n * c
  qf, kf, vf, gf, bf = (_chunk_pad(x, t_pad) for x in _f32(q, k, v, g, beta))

  def to_chunks(x):  # [B, T_pad, H, ...] -> [n, B, H, C, ...]
    x = x.reshape(b, n, c, h, *x.shape[3:])
    return jnp.moveaxis(jnp.moveaxis(x, 1, 0), 3, 2)

  qc, kc, vc, gc, bc = map(to_chunks, (qf, kf, vf, gf, bf))
  idx = jnp.arange(c)
  lower_incl = idx[:, None] >= idx[None, :]
  strict = idx[:, None] > idx[None, :]

  def body(s, x):
    qi, ki, vi, gi, bi = x  # [B, H, C, D] / [B, H, C]
    gam = jnp.cumsum(gi, axis=-1)
    diff = jnp.where(lower_incl, gam[..., :, None] - gam[..., None, :], -jnp.inf)
    decay = jnp.exp(diff)
    kk = jnp.einsum("bhik,bhjk->bhij", ki, ki, precision=_HI)
    a = jnp.where(strict, bi[..., :, None] * kk * decay, 0.0)
    big_gam = jnp.exp(gam)
    rhs = jnp.concatenate([vi * bi[..., None], ki * (bi * big_gam)[..., None]], axis=-1)
    sol = _unit_lower_solve(a, rhs)                      # (eye + a)^-1 rhs
    u, wk = sol[..., :dv], sol[..., dv:]
    v_new = u - jnp.einsum("bhik,bhkv->bhiv", wk, s, precision=_HI)
    qk = jnp.einsum("bhik,bhjk->bhij", qi, ki, precision=_HI) * decay
    o = (jnp.einsum("bhik,bhkv->bhiv", qi * big_gam[..., None], s, precision=_HI)
         + jnp.einsum("bhij,bhjv->bhiv", qk, v_new, precision=_HI))
    gam_last = gam[..., -1]
    k_dec = ki * jnp.exp(gam_last[..., None] - gam)[..., None]
    s = (jnp.exp(gam_last)[..., None, None] * s
         + jnp.einsum("bhik,bhiv->bhkv", k_dec, v_new, precision=_HI))
    return s, o

  s, o = lax.scan(body, state.astype(jnp.float32), (qc, kc, vc, gc, bc))
  o = jnp.moveaxis(o, 0, 1)  # [B, n, H, C, DV]
  o = jnp.moveaxis(o, 2, 3).reshape(b, t_pad, h, dv)
  return o[:, :t].astype(v.dtype), s


@functools.partial(jax.jit, static_argnames=("interpret", "tuning", "write_pend_v",
                                             "gate_offset", "write_pending", "norm_offset",
                                             "norm_eps", "qk_l2norm", "key_heads",
                                             "ab_dtype"))
def gated_delta_verify_reference(state, pend_k, pend_v, pend_g, pend_beta, n_pend,
                                 q, k, v, g, beta, *, live=None, gates=None, gate_offset=0,
                                 write_pend_v=False, write_pending=False, norm_weight=None,
                                 norm_offset=-1, norm_eps=1e-6, qk_l2norm=False,
                                 key_heads=0, ab_dtype=None, interpret=False, tuning=None):
  """jnp version of :func:`gated_delta_verify` (same signature and returns).

  Replays the pending slots with a masked loop (slots >= n_pend are selected
  away with ``jnp.where``, so NaN there cannot leak), then runs the new
  tokens with the recurrence. The loop runs max(n_pend) times, not once per
  pending slot: an engine sized for K drafts pays for the tokens it accepted,
  so a shallow step costs what it would on an engine with fewer slots.
  """
  del interpret, tuning
  if gates is not None and gates[0].ndim == 4:        # split partials: the GEMM's output
    if ab_dtype is None or gates[0].dtype != jnp.float32:
      raise ValueError("gates ab as split partials [S, B, T, C] must be f32 with ab_dtype "
                       "given")
    gates = (jnp.sum(gates[0], axis=0).astype(ab_dtype),) + tuple(gates[1:])
  if key_heads:
    h, dk, dv = state.shape[1:]
    bt, kd = q.shape[:2], key_heads * dk
    q, k, v = (q[..., :kd].reshape(bt + (key_heads, dk)),
               q[..., kd:2 * kd].reshape(bt + (key_heads, dk)),
               q[..., 2 * kd:].reshape(bt + (h, dv)).astype(jnp.float32))
    qk_l2norm = True
  if qk_l2norm:
    rep = v.shape[2] // q.shape[2]
    l2 = lambda x: x * lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + 1e-6)
    q = l2(jnp.repeat(q, rep, axis=2).astype(jnp.float32)) * (q.shape[-1] ** -0.5)
    k = l2(jnp.repeat(k, rep, axis=2).astype(jnp.float32))
  full = (pend_k, pend_v, pend_g, pend_beta)
  full_pend_v = pend_v
  b, t = q.shape[:2]
  if write_pending:
    pend_k, pend_g, pend_beta = pend_k[:b], pend_g[:b], pend_beta[:b]
  write_pend_v = write_pend_v or write_pending
  if gates is not None:
    if g is not None or beta is not None:
      raise ValueError("pass g = beta = None with gates (the kernel computes them)")
    g, beta = gate_values(*_gate_inputs(gates, q, gate_offset))
  if write_pend_v:
    pend_v = pend_v[:q.shape[0]]
  _validate_tokens("", q, k, v, g, beta)
  _validate_state(state, q, v, slots=True)
  slots = state
  state = state[:b]
  pk, pv, pg, pb = _f32(pend_k, pend_v, pend_g, pend_beta)
  n_pend = n_pend[:b]

  def replay(i, s):
    x = [lax.dynamic_index_in_dim(a, i, axis=1, keepdims=False) for a in (pk, pv, pg, pb)]
    s_new = _recurrent_step(s, *x)
    keep = (i < n_pend)[:, None, None, None]
    return jnp.where(keep, s_new, s)

  p = pend_k.shape[1]
  s_c = lax.fori_loop(0, jnp.minimum(jnp.max(n_pend, initial=0), p), replay,
                      state.astype(jnp.float32))
  o, _ = recurrent_gated_delta_reference(q, k, v, g, beta, s_c)
  if live is not None:
    o = jnp.where(live.astype(bool)[:, None, None, None], o, 0)
  if norm_weight is not None:
    ab = gates[0]
    h, dv = v.shape[2:]
    z = ab[..., norm_offset:norm_offset + h * dv].reshape(v.shape)
    o = _gated_rmsnorm(o.astype(ab.dtype), z, norm_weight, norm_eps)
  put = lambda buf, x: buf.at[:b, :t].set(x.astype(buf.dtype))
  if write_pending:
    return (o, slots.at[:b].set(s_c)) + tuple(put(buf, x) for buf, x in
                                              zip(full, (k, v, g, beta)))
  if write_pend_v:
    return o, slots.at[:b].set(s_c), put(full_pend_v, v)
  return o, slots.at[:b].set(s_c)


def _gated_rmsnorm(o, z, w, eps):
  """mtpjax.model.gated_rmsnorm (spec §3.1b): plain-weight RMSNorm, then the SiLU(z) gate."""
  dt = z.dtype
  xf = o.astype(jnp.float32)
  y = (xf * lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)).astype(dt)
  y = w.astype(dt) * y
  return (y.astype(jnp.float32) * jax.nn.silu(z.astype(jnp.float32))).astype(dt)
