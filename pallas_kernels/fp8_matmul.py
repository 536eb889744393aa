"""Weight-only FP8 matmul with block scales: y = x @ (q * scale).T, never dequantizing q whole.

Weights are stored as ``q`` float8_e4m3fn ``[O, I]`` plus float32 ``scale``
``[ceil(O / bo), ceil(I / bi)]`` for ``block = (bo, bi)``: the dequantized weight is
``q[o, i] * scale[o // bo, i // bi]`` (Qwen's block-wise FP8 is ``(128, 128)``; per-output-
channel FP8, as llm-compressor writes it, is ``(1, I)``; a fused leaf whose parts do not start
on a block row is stored with ``bo = 1``). Edge blocks may be partial.

Why not ``dense(x, q.astype(bf16) * scale_expanded)``: XLA's GPU pipeline fuses the convert of
``q`` into its Triton GEMM, but not the block-broadcast scale multiply, so that form writes a
dequantized bf16 copy of every weight to HBM each step (3x the bytes of reading fp8; see
RESULTS.md). Per input block ``j`` the scale is a constant over the contraction, so

    y[t, o] = sum_j scale[o // bo, j] * (x[t, block j] . q[o, block j])

is exact up to float32 summation order. The reference below computes it with one batched
einsum over the full input blocks (``q`` is only converted elementwise, which XLA fuses into
the GEMM) plus one for a partial tail block; its temporary is ``[T, I / bi, O]`` float32, fine
for the CPU and small decode batches. The Pallas kernel does the same per tile in registers.

The kernel (:func:`fp8_matmul`, Pallas on the Triton backend; ``pltr.CompilerParams`` is always
passed, since without it jax sends a ``pallas_call`` on CUDA to Mosaic GPU):

* ``x`` is flattened to ``T`` rows. The rows are padded to a power of two ``BT >= 16`` (the
  Triton dot minimum) when that fits ``tuning.block_t``, else tiled by ``block_t``; padding and
  tail rows are masked loads (read as 0) and masked stores, so ``x`` is never copied.
* Grid ``(ceil(T / BT), ceil(O / BO))``, token tiles fastest (consecutive programs share a weight
  tile). Each program loops over the input dimension in steps of ``BK``: a masked load of an
  fp8 ``[BO, BK]`` tile of ``q`` (out-of-range rows/columns read as 0), converted to ``x``'s
  dtype in registers (exact for e4m3 / e5m2 -> bf16 / f16 / f32), one dot with f32
  accumulation, and the partial times the scale of its (output block, input block): a scalar
  per tile when ``bo % BO == 0``, else a ``[BO]`` vector gathered per output row
  (``scale[o // bo, j]``, any ``bo``; ``bo = 1`` is per-row). With one input block (``nbi ==
  1``, e.g. per-channel ``(1, I)``) the scale is applied once after the loop.
* ``BK`` must not straddle input blocks: with ``nbi > 1`` it is the largest power of two dividing
  ``bi`` (capped by ``tuning.block_k``), and a ``bi`` whose largest power-of-two divisor is below
  16 is rejected (ValueError naming the block). With ``nbi == 1`` any ``I`` works (masked tail).
* Nothing weight-sized is materialised: the only output is ``y``; ``q`` and ``scale`` are read
  in place.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from pallas_kernels.tuned_block_sizes import (
    TRITON_MIN_DOT,
    Fp8MatmulTuning,
    get_fp8_matmul_tuning,
    next_pow2,
)

_FP8_DTYPES = (jnp.float8_e4m3fn, jnp.float8_e5m2)
_X_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)


def _check(x, q, scale, block):
    if q.ndim != 2:
        raise ValueError(f"fp8 weight must be 2-D [out, in], got shape {q.shape}")
    out, inn = q.shape
    bo, bi = block
    if bo < 1 or bi < 1:
        raise ValueError(f"block sizes must be positive, got {block}")
    want = (-(-out // bo), -(-inn // bi))
    if tuple(scale.shape) != want:
        raise ValueError(f"scale shape {tuple(scale.shape)} does not match weight {q.shape} "
                         f"with block {block}: expected {want}")
    if x.shape[-1] != inn:
        raise ValueError(f"x has {x.shape[-1]} features, weight expects {inn}")


def row_scales(scale, block, out: int):
    """scale [ceil(O/bo), nbi] -> float32 [O, nbi]: each output row's scale per input block."""
    bo, _ = block
    s = scale.astype(jnp.float32)
    return s if bo == 1 else jnp.repeat(s, bo, axis=0)[:out]


def fp8_matmul_reference(x, q, scale, block):
    """x [..., I] (bf16 or f32); q float8_e4m3fn [O, I]; scale [ceil(O/bo), ceil(I/bi)].

    Returns y [..., O] in x.dtype: float32 accumulation, one rounding at the end.
    """
    _check(x, q, scale, block)
    out, inn = q.shape
    _, bi = block
    lead = x.shape[:-1]
    x2 = x.reshape(-1, inn)
    sr = row_scales(scale, block, out)                                   # [O, nbi]
    wdt = x.dtype
    full = inn // bi
    y = jnp.zeros((x2.shape[0], out), jnp.float32)
    if full:
        xb = x2[:, :full * bi].reshape(-1, full, bi)
        qb = q[:, :full * bi].reshape(out, full, bi).astype(wdt)
        p = jnp.einsum("tji,oji->tjo", xb, qb, preferred_element_type=jnp.float32)
        y = y + jnp.einsum("tjo,oj->to", p, sr[:, :full])
    if inn % bi:
        p = jnp.einsum("ti,oi->to", x2[:, full * bi:], q[:, full * bi:].astype(wdt),
                       preferred_element_type=jnp.float32)
        y = y + p * sr[:, full]
    return y.astype(x.dtype).reshape(*lead, out)


# ---------------------------------------------------------------------------
# Pallas (Triton) kernel
# ---------------------------------------------------------------------------


def _pow2_divisor(n: int) -> int:
    """Largest power of two dividing n (n >= 1)."""
    return n & -n


def _plan(t: int, out: int, inn: int, block, tuning: Fp8MatmulTuning):
    """Static tile sizes (BT, BO, BK) and scale mode; ValueError for unsupported blocks."""
    bo, bi = block
    nbi = -(-inn // bi)
    bt = next_pow2(max(t, TRITON_MIN_DOT))
    if bt > tuning.block_t:
        bt = tuning.block_t
    bo_tile = tuning.block_o
    if nbi == 1:
        bk = min(tuning.block_k, next_pow2(max(inn, TRITON_MIN_DOT)))
    else:
        bk = min(tuning.block_k, _pow2_divisor(bi))
        if bk < TRITON_MIN_DOT:
            raise ValueError(
                f"fp8_matmul: unsupported block {tuple(block)} for in_features {inn}: with "
                f"{nbi} input blocks the input step must divide bi={bi}, and its largest "
                f"power-of-two divisor {_pow2_divisor(bi)} is below the Triton dot minimum "
                f"{TRITON_MIN_DOT} (use bi = a multiple of 16, or one input block bi >= I)")
    scalar_scale = bo % bo_tile == 0
    return bt, bo_tile, bk, scalar_scale, nbi


def _tile_mask(rows, cols, shape):
    """bool[shape] from optional row [R] and column [C] masks; None when both are None (a
    full tile: the load or store needs no mask)."""
    if rows is None and cols is None:
        return None
    m = jnp.ones(shape, jnp.bool_)
    if rows is not None:
        m = m & rows[:, None]
    if cols is not None:
        m = m & cols[None, :]
    return m


def _fp8_matmul_kernel(x_ref, q_ref, s_ref, o_ref, *, t: int, out: int, inn: int, bo: int,
                       bi: int, nbi: int, bt: int, bo_tile: int, bk: int, scalar_scale: bool,
                       precision):
    """One (token tile, output tile): y[t0:t0+BT, o0:o0+BO] = sum_k s * (x_k . q_k^T)."""
    t0 = pl.program_id(0) * bt
    o0 = pl.program_id(1) * bo_tile
    n_k = -(-inn // bk)
    cdt = x_ref.dtype

    rows = t0 + lax.broadcasted_iota(jnp.int32, (bt,), 0)
    ochs = o0 + lax.broadcasted_iota(jnp.int32, (bo_tile,), 0)
    row_mask = rows < t if t % bt else None          # static: no mask when tiles are full
    och_mask = ochs < out if out % bo_tile else None
    k_tail = inn % bk != 0

    def scale_of(col):
        """f32 scalar (bo % BO == 0) or [BO] (per output row) scale of input block col."""
        if scalar_scale:
            return s_ref[o0 // bo, col]
        srow = jnp.minimum(ochs // bo, s_ref.shape[0] - 1)   # clamped: masked rows only
        return pltr.load(s_ref.at[srow, jnp.full((bo_tile,), col, jnp.int32)])

    def apply(acc, s):
        return acc * (s if scalar_scale else s[None, :])

    def body(k, acc):
        k0 = k * bk
        if k_tail:
            cols = k0 + lax.broadcasted_iota(jnp.int32, (bk,), 0)
            col_ok = cols < inn
        else:
            col_ok = None
        x_mask = _tile_mask(row_mask, col_ok, (bt, bk))
        q_mask = _tile_mask(och_mask, col_ok, (bo_tile, bk))
        xt = pltr.load(x_ref.at[pl.ds(t0, bt), pl.ds(k0, bk)], mask=x_mask,
                       other=None if x_mask is None else 0)
        qt = pltr.load(q_ref.at[pl.ds(o0, bo_tile), pl.ds(k0, bk)], mask=q_mask,
                       other=None if q_mask is None else 0)
        part = lax.dot_general(xt, qt.astype(cdt), (((1,), (1,)), ((), ())),
                               preferred_element_type=jnp.float32, precision=precision)
        if nbi == 1:
            return acc + part
        return acc + apply(part, scale_of(k0 // bi))

    acc = lax.fori_loop(0, n_k, body, jnp.zeros((bt, bo_tile), jnp.float32))
    if nbi == 1:
        acc = apply(acc, scale_of(0))
    y_mask = _tile_mask(row_mask, och_mask, (bt, bo_tile))
    pltr.store(o_ref.at[pl.ds(t0, bt), pl.ds(o0, bo_tile)], acc.astype(o_ref.dtype),
               mask=y_mask)


@functools.partial(jax.jit, static_argnames=("block", "interpret", "tuning"))
def _fp8_matmul(x, q, scale, *, block, interpret, tuning):
    out, inn = q.shape
    bo, bi = block
    lead = x.shape[:-1]
    x2 = x.reshape(-1, inn)
    t = x2.shape[0]
    if t == 0:
        return jnp.zeros((*lead, out), x.dtype)
    if tuning is None:
        tuning = get_fp8_matmul_tuning(t, out, inn)
    bt, bo_tile, bk, scalar_scale, nbi = _plan(t, out, inn, block, tuning)
    kernel = functools.partial(
        _fp8_matmul_kernel, t=t, out=out, inn=inn, bo=bo, bi=bi, nbi=nbi, bt=bt,
        bo_tile=bo_tile, bk=bk, scalar_scale=scalar_scale,
        precision=lax.Precision.HIGHEST if x.dtype == jnp.float32 else None)
    grid = (pl.cdiv(t, bt), pl.cdiv(out, bo_tile))
    whole = lambda shape: pl.BlockSpec(shape, lambda i, j: (0,) * len(shape))
    s32 = scale.astype(jnp.float32)
    y = pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=[whole(x2.shape), whole(q.shape), whole(s32.shape)],
        out_specs=whole((t, out)),
        out_shape=jax.ShapeDtypeStruct((t, out), x.dtype),
        compiler_params=pltr.CompilerParams(num_warps=tuning.num_warps,
                                            num_stages=tuning.num_stages),
        interpret=interpret,
        name=(f"fp8_matmul_bt{bt}_bo{bo_tile}_bk{bk}_{'scalar' if scalar_scale else 'row'}"
              f"scale_w{tuning.num_warps}_s{tuning.num_stages}"),
    )(x2, q, s32)
    return y.reshape(*lead, out)


def fp8_matmul(x, q, scale, block, *, interpret: bool = False,
               tuning: Fp8MatmulTuning | None = None):
    """Pallas (Triton) weight-only FP8 matmul: same contract as :func:`fp8_matmul_reference`.

    Args:
      x: [..., I] bf16 / f16 / f32 activations (leading dims are flattened to T rows).
      q: [O, I] float8_e4m3fn (or float8_e5m2) weight.
      scale: [ceil(O / bo), ceil(I / bi)] scales (cast to float32).
      block: (bo, bi) weight block of one scale.
      interpret: run the Pallas interpreter (CPU tests).
      tuning: tile sizes; ``None`` looks up ``tuned_block_sizes.get_fp8_matmul_tuning``.

    Returns:
      [..., O] in x.dtype: float32 accumulation, rounded once.

    Raises:
      ValueError: shape mismatches (as the reference), unsupported dtypes, and blocks the
        kernel cannot tile (several input blocks whose ``bi`` has no power-of-two divisor
        >= 16).
    """
    block = tuple(int(b) for b in block)
    if len(block) != 2:
        raise ValueError(f"block must be (bo, bi), got {block}")
    _check(x, q, scale, block)
    if q.dtype not in _FP8_DTYPES:
        raise ValueError(f"fp8_matmul: q must be float8_e4m3fn or float8_e5m2, got {q.dtype}")
    if x.dtype not in _X_DTYPES:
        raise ValueError(f"fp8_matmul: x must be bfloat16, float16 or float32, got {x.dtype}")
    if tuning is not None and not isinstance(tuning, Fp8MatmulTuning):
        raise ValueError(f"tuning must be an Fp8MatmulTuning or None, got {type(tuning)}")
    return _fp8_matmul(x, q, scale, block=block, interpret=bool(interpret), tuning=tuning)
