"""Residual add + zero-centred RMSNorm in one kernel (Pallas, Triton backend).

Between two decoder blocks the model computes ``h = h + d`` (the residual add of the block
just run) and ``x = rmsnorm_1p(h, w)`` (the next block's input norm). XLA on the H200 makes
three kernels of that (the add, the sum-of-squares reduction, the scaling), twice per
decoder layer; this kernel is one, with both results as outputs:

1. grid: one program per token row of ``h`` [N, H];
2. pass 1 walks the row in power-of-two chunks (Triton tensors must be powers of two; the
   27B's H = 5120 is 5 chunks of 1024): ``s = h + d`` rounded to h's dtype (what the bf16
   add gives), stored as the new residual, and its f32 sum of squares;
3. pass 2 recomputes ``s`` from the inputs (no read of what other threads stored) and
   writes ``s * rsqrt(mean(s^2) + eps) * (1 + w)`` in f32, rounded once to h's dtype (spec
   §3.1a, the order of ``mtpjax.model.rmsnorm_1p``).

``d = None``: no add (the first layer's input norm); only the normed row is written.
``d`` f32 [S, ..., H]: the S split-K partial sums of the GEMM whose output is added (the
caller splits the contraction: mtpjax.model.dense_partials); the kernel sums them in f32 and
rounds once to h's dtype (what the GEMM's own output would be) before the add, so the
GEMM needs no reduction kernel of its own.
``add_rmsnorm_reference`` is the same in plain jnp: exactly the model's ops.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

MAX_CHUNK = 2048


def row_chunk(hidden: int) -> int:
  """The largest power of two dividing ``hidden``, at most MAX_CHUNK: the kernel's load
  width."""
  return min(hidden & -hidden, MAX_CHUNK)


def _kernel(*refs, eps: float, chunk: int, n_chunks: int, has_add: bool, splits: int = 0):
  if has_add:
    h_ref, d_ref, w_ref, out_h_ref, out_n_ref = refs
  else:
    h_ref, w_ref, out_n_ref = refs
  hidden = chunk * n_chunks

  def summed(c):
    sl = pl.ds(c * chunk, chunk)
    s = h_ref[sl]
    if has_add:
      if splits:
        d = d_ref[0, sl]
        for j in range(1, splits):
          d = d + d_ref[j, sl]
        d = d.astype(h_ref.dtype)
      else:
        d = d_ref[sl]
      s = (s.astype(jnp.float32) + d.astype(jnp.float32)).astype(h_ref.dtype)
    return sl, s

  acc = jnp.zeros((), jnp.float32)
  for c in range(n_chunks):
    sl, s = summed(c)
    if has_add:
      out_h_ref[sl] = s
    sf = s.astype(jnp.float32)
    acc = acc + jnp.sum(sf * sf)
  r = lax.rsqrt(acc / hidden + eps)
  for c in range(n_chunks):
    sl, s = summed(c)
    y = s.astype(jnp.float32) * r
    out_n_ref[sl] = (y * (1.0 + w_ref[sl].astype(jnp.float32))).astype(out_n_ref.dtype)


@functools.partial(jax.jit, static_argnames=("eps", "interpret", "num_warps"))
def add_rmsnorm(h: jax.Array, d: jax.Array | None, w: jax.Array, *, eps: float,
                interpret: bool = False, num_warps: int = 4):
  """(h + d, rmsnorm_1p(h + d, w)) in one kernel; with d None, (h, rmsnorm_1p(h, w)).

  Args:
    h, d: [..., H] of one dtype (the residual stream and the block output added to it);
      or d f32 [S, ..., H], the S partial sums of that output (summed, then rounded to h's
      dtype, then added).
    w: [H], the norm's zero-centred weight (any float dtype; read as f32).
    eps: the norm's epsilon (static).
    interpret: run the Pallas interpreter.
  Returns:
    (the new residual [..., H] in h's dtype, the normed rows [..., H] in h's dtype).
  """
  hidden = h.shape[-1]
  splits = 0
  if d is not None and d.ndim == h.ndim + 1:
    if d.shape[1:] != h.shape or d.dtype != jnp.float32:
      raise ValueError(f"split partials d must be f32[S, {', '.join(map(str, h.shape))}], "
                       f"got {d.dtype}{list(d.shape)}")
    splits = d.shape[0]
  elif d is not None and (d.shape != h.shape or d.dtype != h.dtype):
    raise ValueError(f"d must match h {h.dtype}{list(h.shape)}, got {d.dtype}{list(d.shape)}")
  if w.shape != (hidden,):
    raise ValueError(f"w must be [H]=[{hidden}], got {list(w.shape)}")
  chunk = hidden if interpret else row_chunk(hidden)
  if not interpret and chunk < 16:
    raise ValueError(f"the Triton kernel needs H divisible by 16, got H={hidden}")
  lead = h.shape[:-1]
  n = 1
  for x in lead:
    n *= x
  rows = [h.reshape(n, hidden)]
  row_spec = pl.BlockSpec((None, hidden), lambda i: (i, 0))
  in_specs = [row_spec]
  if d is not None:
    rows.append(d.reshape((splits, n, hidden) if splits else (n, hidden)))
    in_specs.append(pl.BlockSpec((splits, None, hidden), lambda i: (0, i, 0)) if splits
                    else row_spec)
  w_spec = pl.BlockSpec((hidden,), lambda i: (0,))
  out = jax.ShapeDtypeStruct((n, hidden), h.dtype)
  has_add = d is not None
  res = pl.pallas_call(
      functools.partial(_kernel, eps=eps, chunk=chunk, n_chunks=hidden // chunk,
                        has_add=has_add, splits=splits),
      grid=(n,),
      in_specs=in_specs + [w_spec],
      out_specs=[row_spec] * (2 if has_add else 1),
      out_shape=[out] * (2 if has_add else 1),
      compiler_params=pltr.CompilerParams(num_warps=num_warps, num_stages=1),
      interpret=interpret,
      name=(f"add_rmsnorm_s{splits}_c{chunk}" if splits else f"add_rmsnorm_c{chunk}")
      if has_add else f"rmsnorm_c{chunk}",
  )(*rows, w)
  if has_add:
    return res[0].reshape(h.shape), res[1].reshape(h.shape)
  return h, res[0].reshape(h.shape)


@functools.partial(jax.jit, static_argnames=("eps", "interpret", "num_warps"))
def add_rmsnorm_reference(h, d, w, *, eps: float, interpret: bool = False, num_warps: int = 4):
  """jnp version of :func:`add_rmsnorm` (same signature and returns): the model's ops."""
  del interpret, num_warps
  if d is not None and d.ndim == h.ndim + 1:
    d = jnp.sum(d, axis=0).astype(h.dtype)
  if d is not None:
    h = h + d
  xf = h.astype(jnp.float32)
  y = xf * lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
  return h, (y * (1.0 + w.astype(jnp.float32))).astype(h.dtype)
