"""pallas_kernels.add_rmsnorm: residual add + zero-centred RMSNorm in one kernel.

* the interpreted kernel == the jnp reference (bf16 rows, ragged row counts, H not a power of
  two); the residual output bit for bit (one rounded add), the normed rows within a bf16 ulp;
* the reference == the model's own ``h + d`` then ``rmsnorm_1p`` in one program, bit for bit
  (the CPU path runs it);
* rows are independent: a NaN row poisons only itself;
* it lowers for CUDA at the 27B's width (H = 5120: 5 chunks of 1024) with and without the add.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtpjax.model import rmsnorm_1p
from pallas_kernels.rmsnorm import add_rmsnorm, add_rmsnorm_reference, row_chunk

EPS = 1e-6


def _rows(rng, shape, dtype=jnp.bfloat16, scale=1.0):
  return jnp.asarray(scale * rng.standard_normal(shape), dtype)


@pytest.mark.parametrize("shape", [(1, 1, 96), (2, 5, 96), (7, 80), (3, 1, 256)],
                         ids=["decode", "verify-ragged", "rows", "tiny-width"])
@pytest.mark.parametrize("add", [True, False], ids=["add", "norm-only"])
def test_interpreted_kernel_matches_reference(shape, add):
  rng = np.random.default_rng(sum(shape))
  h = _rows(rng, shape, scale=3.0)
  d = _rows(rng, shape) if add else None
  w = _rows(rng, shape[-1:], scale=0.1)
  h1, n1 = add_rmsnorm(h, d, w, eps=EPS, interpret=True)
  h2, n2 = add_rmsnorm_reference(h, d, w, eps=EPS)
  assert h1.dtype == n1.dtype == h.dtype and h1.shape == n1.shape == h.shape
  np.testing.assert_array_equal(np.asarray(h1, np.float32), np.asarray(h2, np.float32))
  np.testing.assert_allclose(np.asarray(n1, np.float32), np.asarray(n2, np.float32),
                             rtol=1e-2, atol=1e-2)
  # at most one bf16 ulp apart (the sum of squares in another order)
  ulp = np.abs(np.asarray(n2, np.float32)) * 2.0 ** -7 + 1e-30
  assert (np.abs(np.asarray(n1, np.float32) - np.asarray(n2, np.float32)) <= ulp).all()


def test_reference_is_the_models_add_then_norm_bit_for_bit():
  rng = np.random.default_rng(3)
  h, d = _rows(rng, (4, 3, 256), scale=4.0), _rows(rng, (4, 3, 256))
  w = _rows(rng, (256,), scale=0.1)
  s, n = add_rmsnorm_reference(h, d, w, eps=EPS)

  @jax.jit            # as the model runs them: inside one program (XLA may keep the bf16
  def model(h, d, w):  # sum in f32 for the norm, xla_allow_excess_precision)
    h = h + d
    return h, rmsnorm_1p(h, w, EPS)

  want_s, want_n = model(h, d, w)
  np.testing.assert_array_equal(np.asarray(s, np.float32), np.asarray(want_s, np.float32))
  np.testing.assert_array_equal(np.asarray(n, np.float32), np.asarray(want_n, np.float32))


def test_a_nan_row_poisons_only_itself():
  rng = np.random.default_rng(4)
  h, d = np.array(_rows(rng, (5, 96), jnp.float32)), _rows(rng, (5, 96), jnp.float32)
  h[2] = np.nan
  s, n = add_rmsnorm(jnp.asarray(h), d, jnp.zeros((96,), jnp.float32), eps=EPS,
                     interpret=True)
  s, n = np.asarray(s), np.asarray(n)
  assert np.isnan(n[2]).all() and np.isnan(s[2]).all()
  assert np.isfinite(np.delete(n, 2, axis=0)).all()


def test_rejects():
  h = jnp.zeros((2, 32), jnp.bfloat16)
  with pytest.raises(ValueError, match="d must match"):
    add_rmsnorm(h, jnp.zeros((2, 32), jnp.float32), jnp.zeros(32), eps=EPS, interpret=True)
  with pytest.raises(ValueError, match="w must be"):
    add_rmsnorm(h, h, jnp.zeros(16), eps=EPS, interpret=True)
  with pytest.raises(ValueError, match="divisible by 16"):
    add_rmsnorm(jnp.zeros((2, 24)), None, jnp.zeros(24), eps=EPS)


def test_row_chunk():
  assert [row_chunk(x) for x in (5120, 256, 96, 8192)] == [1024, 256, 32, 2048]


@pytest.mark.parametrize("n", [1, 5, 64])
@pytest.mark.parametrize("add", [True, False], ids=["add", "norm-only"])
def test_lowers_for_cuda_at_27b_width(n, add):
  sds = jax.ShapeDtypeStruct
  h = sds((n, 5120), jnp.bfloat16)
  w = sds((5120,), jnp.bfloat16)
  fn = jax.jit(lambda h, d, w: add_rmsnorm(h, d, w, eps=EPS))
  text = fn.trace(h, h if add else None, w).lower(lowering_platforms=("cuda",)).as_text()
  assert "__gpu$xla.gpu.triton" in text
  assert ("add_rmsnorm_c1024" if add else "rmsnorm_c1024") in text


@pytest.mark.parametrize("splits,shape", [(4, (1, 1, 96)), (8, (2, 5, 96)), (2, (7, 80))])
def test_split_partials_are_summed_then_rounded_then_added(splits, shape):
  """d f32 [S, ..., H]: the S partial sums of the added GEMM output; kernel == reference ==
  the GEMM's rounded output added (h + sum(d).astype(h.dtype))."""
  rng = np.random.default_rng(splits)
  h = _rows(rng, shape, scale=3.0)
  d = jnp.asarray(rng.standard_normal((splits,) + shape), jnp.float32)
  w = _rows(rng, shape[-1:], scale=0.1)
  h1, n1 = add_rmsnorm(h, d, w, eps=EPS, interpret=True)
  h2, n2 = add_rmsnorm_reference(h, d, w, eps=EPS)
  _, n3 = add_rmsnorm_reference(h, jnp.sum(d, axis=0).astype(h.dtype), w, eps=EPS)
  np.testing.assert_array_equal(np.asarray(h2, np.float32),
                                np.asarray(h + jnp.sum(d, axis=0).astype(h.dtype), np.float32))
  np.testing.assert_array_equal(np.asarray(n2, np.float32), np.asarray(n3, np.float32))
  for a, b in ((h1, h2), (n1, n2)):   # the kernel sums the partials in another order
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                               rtol=1e-2, atol=1e-2)


def test_split_partials_are_checked():
  h = jnp.zeros((2, 32), jnp.bfloat16)
  with pytest.raises(ValueError, match="split partials"):
    add_rmsnorm(h, jnp.zeros((4, 2, 32), jnp.bfloat16), jnp.zeros(32), eps=EPS, interpret=True)


@pytest.mark.parametrize("n", [1, 5])
def test_split_partials_lower_for_cuda_at_27b_width(n):
  sds = jax.ShapeDtypeStruct
  fn = jax.jit(lambda h, d, w: add_rmsnorm(h, d, w, eps=EPS))
  text = fn.trace(sds((n, 5120), jnp.bfloat16), sds((8, n, 5120), jnp.float32),
                  sds((5120,), jnp.bfloat16)).lower(lowering_platforms=("cuda",)).as_text()
  assert "add_rmsnorm_s8_c1024" in text
