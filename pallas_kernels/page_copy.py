"""One KV page copied onto another in every pool at once (Pallas, Triton backend).

A prefix-cache hit on a speculative engine may have to rewrite the MTP KV of the entry's
last cached page (mtpjax/engine/snapshots.py, the copy on write): page ``src`` is copied to
the lane's own page ``dst`` in every KV pool, the 16 full-attention layers' and the MTP
layer's. XLA made that four kernels a pool (a slice and an update of K and of V): 68 of the
171 kernels of the 27B restore, every restore, for 17 pages of data. This is one kernel:

- grid ``(NKV,)``: one program per kv head; it copies the head's ``[page_size, HD]`` rows of
  page ``src`` to page ``dst`` in each pool, a static loop over the pools;
- the pools are aliased to the outputs (updated in place: donate them at the jit boundary);
  every other page is left as it is, bit for bit;
- ``src == dst`` is a no-op copy (the restore's "no rewrite": page 0 onto itself), so the
  program is one whatever the hit, as the restore wants (no branch, no new program key).

``copy_page_reference`` is the same in plain jnp (XLA's slice and update per array).
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr


def _kernel(src_ref, dst_ref, *refs):
  n = len(refs) // 2
  ins, outs = refs[:n], refs[n:]
  s, d = src_ref[0], dst_ref[0]
  for x, y in zip(ins, outs):      # [num_pages, page_size, HD] of this kv head
    y[d] = x[s]


def _validate(pools, src, dst, interpret):
  if not pools:
    raise ValueError("copy_page needs at least one pool")
  shape, dtype = pools[0].shape, pools[0].dtype
  if len(shape) != 4:
    raise ValueError(f"a pool must be [NKV, num_pages, page_size, HD], got shape {shape}")
  for p in pools:
    if p.shape != shape or p.dtype != dtype:
      raise ValueError(f"every pool must be {dtype}{shape} (one kernel copies them all), "
                       f"got {p.dtype}{p.shape}")
  for name, x in (("src", src), ("dst", dst)):
    if jnp.shape(x) != () or jnp.result_type(x) != jnp.int32:
      raise ValueError(f"{name} must be an int32 scalar page id, got "
                       f"{jnp.result_type(x)}{jnp.shape(x)}")
  _, _, ps, hd = shape
  if not interpret and (ps & (ps - 1) or hd & (hd - 1)):
    raise ValueError(f"the Triton kernel needs a power-of-two page_size and HD (its tensors), "
                     f"got {ps}, {hd}")


@functools.partial(jax.jit, static_argnames=("interpret", "num_warps"))
def copy_page(pools: Sequence[jax.Array], src, dst, *, interpret: bool = False,
              num_warps: int = 4) -> tuple[jax.Array, ...]:
  """Copy page `src` to page `dst` in every pool: one kernel.

  Args:
    pools: K and V pools, each [NKV, num_pages, page_size, HD], one shape and dtype.
    src, dst: int32 scalars, page ids in [0, num_pages) (the caller's: the restore clamps
      them, and an equal pair copies nothing).
  Returns:
    the pools, page dst now page src's rows (in place when donated).
  Raises:
    ValueError: on pools of different shapes or dtypes, non-scalar page ids, or on the
      Triton path a page_size or HD that is not a power of two.
  """
  pools = tuple(pools)
  _validate(pools, src, dst, interpret)
  nkv, num_pages, ps, hd = pools[0].shape
  n = len(pools)
  spec = pl.BlockSpec((None, num_pages, ps, hd), lambda h: (h, 0, 0, 0))
  scalar = pl.BlockSpec((1,), lambda h: (0,))
  return tuple(pl.pallas_call(
      _kernel,
      grid=(nkv,),
      in_specs=[scalar, scalar] + [spec] * n,
      out_specs=[spec] * n,
      out_shape=[jax.ShapeDtypeStruct(p.shape, p.dtype) for p in pools],
      input_output_aliases={2 + i: i for i in range(n)},
      compiler_params=pltr.CompilerParams(num_warps=num_warps, num_stages=1),
      interpret=interpret,
      name=f"copy_page_x{n}",
  )(jnp.reshape(src, (1,)), jnp.reshape(dst, (1,)), *pools))


def copy_page_reference(pools: Sequence[jax.Array], src, dst) -> tuple[jax.Array, ...]:
  """copy_page in plain jnp: a slice of page src and an update at page dst, per pool."""
  return tuple(lax.dynamic_update_slice_in_dim(p, lax.dynamic_slice_in_dim(p, src, 1, axis=1),
                                               dst, axis=1) for p in pools)
