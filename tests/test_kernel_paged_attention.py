"""Paged attention kernel == jnp reference, and write_kv == its loop spec.

Runs the Pallas kernel in interpret mode on CPU (``INTERPRET = True``). On a
GPU backend a subclass that flips ``INTERPRET`` is defined as well; on CPU it
is not defined at all, so nothing is skipped. Unused pages, slots beyond
``kv_len`` and query rows beyond ``q_len`` are NaN-poisoned: any read that
leaks into the output shows up as NaN.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import (
    PagedAttentionTuning,
    paged_attention,
    paged_attention_reference,
    validate_paged_inputs_dynamic,
    write_kv,
    write_kv_reference,
)

F32_TOL = 1e-5
BF16_TOL = 3e-2


def make_case(seed, *, kv_lens, q_lens, tq, nq, nkv, hd, page_size, pages_per_lane,
              spare_pages=3, dtype=np.float32):
  """Random inputs with a permuted page table and NaN everywhere unused."""
  rng = np.random.default_rng(seed)
  b = len(kv_lens)
  kv_lens = np.asarray(kv_lens, np.int32)
  q_lens = np.asarray(q_lens, np.int32)
  num_pages = b * pages_per_lane + spare_pages
  k_pages = rng.standard_normal((nkv, num_pages, page_size, hd)).astype(np.float32)
  v_pages = rng.standard_normal((nkv, num_pages, page_size, hd)).astype(np.float32)
  table = rng.permutation(num_pages)[: b * pages_per_lane].reshape(b, pages_per_lane)
  table = table.astype(np.int32)
  used = np.zeros((num_pages, page_size), bool)
  for i in range(b):
    for pos in range(kv_lens[i]):
      used[table[i, pos // page_size], pos % page_size] = True
    # Entries past the lane's pages are garbage that must never be followed.
    n_pages = -(-int(kv_lens[i]) // page_size)
    table[i, n_pages:] = rng.integers(-5, num_pages + 5, pages_per_lane - n_pages)
  k_pages[:, ~used] = np.nan
  v_pages[:, ~used] = np.nan
  q = rng.standard_normal((b, tq, nq, hd)).astype(np.float32)
  for i in range(b):
    q[i, q_lens[i]:] = np.nan
  cast = lambda x: jnp.asarray(x, dtype)
  return (cast(q), cast(k_pages), cast(v_pages), jnp.asarray(table),
          jnp.asarray(kv_lens), jnp.asarray(q_lens))


# (kv_lens, q_lens, Tq): decode (q_len 1), verify (k+1 = 4) and a prefill chunk,
# ragged and page-crossing, with an idle lane (q_len 0) in the verify case.
CASES = {
    "decode": ([3, 17, 33], [1, 1, 1], 1),
    "verify": ([4, 17, 33, 9], [4, 3, 4, 0], 4),
    "prefill": ([21, 33], [21, 13], 24),
}


class TestPagedAttention:
  INTERPRET = True

  def run(self, args, sm_scale, tuning=None):
    return paged_attention(*args, sm_scale=sm_scale, interpret=self.INTERPRET,
                           tuning=tuning)

  def check(self, args, sm_scale, tol, tuning=None):
    out = self.run(args, sm_scale, tuning)
    ref = paged_attention_reference(*args, sm_scale=sm_scale)
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert np.isfinite(out).all(), "NaN/inf leaked into the kernel output"
    assert np.isfinite(ref).all(), "NaN/inf leaked into the reference output"
    q_lens = np.asarray(args[5])
    for i, ql in enumerate(q_lens):
      np.testing.assert_array_equal(out[i, ql:], 0.0)
    np.testing.assert_allclose(out, ref, atol=tol, rtol=tol)

  @pytest.mark.parametrize("case,nq,nkv", [
      ("decode", 4, 4), ("decode", 12, 2), ("verify", 4, 2), ("verify", 12, 2),
      ("prefill", 4, 4), ("prefill", 12, 2)])
  def test_matches_reference(self, case, nq, nkv):
    kv_lens, q_lens, tq = CASES[case]
    hd, page_size = 32, 8
    args = make_case(100 * len(case) + 10 * nq + nkv, kv_lens=kv_lens, q_lens=q_lens, tq=tq,
                     nq=nq, nkv=nkv, hd=hd, page_size=page_size, pages_per_lane=5)
    self.check(args, hd ** -0.5, F32_TOL)

  @pytest.mark.parametrize(
      "page_size,tuning",
      [
          (4, PagedAttentionTuning(pages_per_compute_block=4, k_splits=1)),
          (4, PagedAttentionTuning(pages_per_compute_block=4, k_splits=3)),
          (16, PagedAttentionTuning(pages_per_compute_block=1, k_splits=None)),
          (8, PagedAttentionTuning(max_block_rows=16, pages_per_compute_block=2,
                                   k_splits=2)),
      ],
      ids=["p4-one-split", "p4-three-splits", "p16-auto-splits", "p8-rowblocks-splits"],
  )
  def test_block_sizes(self, page_size, tuning):
    # q_len 5 with G = 6 -> 30 rows: one row block of 32, or two of 16.
    hd = 32
    pages_per_lane = -(-40 // page_size)
    args = make_case(7, kv_lens=[3, 17, 40], q_lens=[1, 5, 5], tq=5, nq=12, nkv=2,
                     hd=hd, page_size=page_size, pages_per_lane=pages_per_lane)
    self.check(args, hd ** -0.5, F32_TOL, tuning)

  def test_bf16(self):
    hd = 64
    args = make_case(3, kv_lens=[5, 33], q_lens=[4, 4], tq=4, nq=12, nkv=2, hd=hd,
                     page_size=16, pages_per_lane=3, dtype=jnp.bfloat16)
    out = self.run(args, hd ** -0.5)
    assert out.dtype == jnp.bfloat16
    self.check(args, hd ** -0.5, BF16_TOL)

  def test_write_then_attend_is_dense_causal_attention(self):
    """Prefill 11 tokens, then a 4-token verify block: == dense attention."""
    rng = np.random.default_rng(11)
    nq, nkv, hd, page_size, ppl = 4, 2, 32, 4, 4
    n0, n1 = 11, 4
    num_pages = 2 * ppl
    k_pages = jnp.full((nkv, num_pages, page_size, hd), jnp.nan, jnp.float32)
    v_pages = jnp.full_like(k_pages, jnp.nan)
    table = jnp.asarray(rng.permutation(num_pages)[:ppl][None].astype(np.int32))
    q_all = rng.standard_normal((1, n0 + n1, nq, hd)).astype(np.float32)
    k_all = rng.standard_normal((1, n0 + n1, nkv, hd)).astype(np.float32)
    v_all = rng.standard_normal((1, n0 + n1, nkv, hd)).astype(np.float32)
    outs = []
    for start, n in ((0, n0), (n0, n1)):
      sl = slice(start, start + n)
      kv_lens = jnp.asarray([start + n], jnp.int32)
      q_lens = jnp.asarray([n], jnp.int32)
      k_pages, v_pages = write_kv(k_pages, v_pages, k_all[:, sl], v_all[:, sl], table,
                                  kv_lens, q_lens)
      outs.append(self.run((jnp.asarray(q_all[:, sl]), k_pages, v_pages, table,
                            kv_lens, q_lens), hd ** -0.5))
    out = np.concatenate([np.asarray(o) for o in outs], axis=1)
    # Dense causal GQA attention in numpy.
    g = nq // nkv
    kk = np.repeat(k_all, g, axis=2)
    vv = np.repeat(v_all, g, axis=2)
    s = np.einsum("bthd,bshd->bhts", q_all, kk) * hd ** -0.5
    n = n0 + n1
    s = np.where(np.tril(np.ones((n, n), bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    dense = np.einsum("bhts,bshd->bthd", p, vv)
    np.testing.assert_allclose(out, dense, atol=F32_TOL, rtol=F32_TOL)


  @pytest.mark.parametrize("tuning", [
      None, PagedAttentionTuning(pages_per_compute_block=2, k_splits=2)],
      ids=["one-split", "two-splits"])
  def test_corrupt_page_table_poisons_only_the_rows_that_need_it(self, tuning):
    """A needed page id outside the pool makes exactly the rows that need it NaN.

    Every page of the pool holds data (no spare pages, full lanes), so a kernel that clamped
    the id would read another lane's page and return finite numbers."""
    page_size, ppl, hd = 8, 4, 32
    full = ppl * page_size
    # lane 2: rows at positions 23 and 24; only row 1 needs page 3 (positions 24..31).
    args = make_case(5, kv_lens=[full, full, 25, full], q_lens=[2, 2, 2, 0], tq=2, nq=4,
                     nkv=2, hd=hd, page_size=page_size, pages_per_lane=ppl, spare_pages=0)
    q, k_pages, v_pages, table, kv_lens, q_lens = args
    num_pages = k_pages.shape[1]
    clean = np.asarray(paged_attention_reference(*args, sm_scale=hd ** -0.5))
    bad = np.array(table)
    bad[1, 1] = num_pages + 3  # a clamp would read page num_pages - 1
    bad[2, 3] = -1             # a clamp would read page 0
    bad[3, 0] = -7             # lane 3 is idle (q_len 0): it needs no page
    args = (q, k_pages, v_pages, jnp.asarray(bad), kv_lens, q_lens)
    for out in (self.run(args, hd ** -0.5, tuning),
                paged_attention_reference(*args, sm_scale=hd ** -0.5)):
      out = np.asarray(out)
      np.testing.assert_allclose(out[0], clean[0], atol=F32_TOL, rtol=F32_TOL)
      assert np.isnan(out[1]).all(), "lane 1 read a page outside the pool without NaN"
      np.testing.assert_allclose(out[2, 0], clean[2, 0], atol=F32_TOL, rtol=F32_TOL)
      assert np.isnan(out[2, 1]).all(), "lane 2 row 1 read a page outside the pool"
      np.testing.assert_array_equal(out[3], 0.0)


if jax.default_backend() == "gpu":

  class TestPagedAttentionCompiled(TestPagedAttention):
    INTERPRET = False


# ---------------------------------------------------------------------------
# write_kv
# ---------------------------------------------------------------------------


def _write_case(seed, dtype=jnp.float32):
  rng = np.random.default_rng(seed)
  nkv, hd, page_size, ppl, b, tq = 2, 8, 4, 5, 3, 6
  num_pages = b * ppl + 2
  k_pages = np.full((nkv, num_pages, page_size, hd), np.nan, np.float32)
  v_pages = np.full_like(k_pages, np.nan)
  table = rng.permutation(num_pages)[: b * ppl].reshape(b, ppl).astype(np.int32)
  kv_lens = np.asarray([3, 17, 9], np.int32)  # including the new tokens
  q_lens = np.asarray([3, 6, 0], np.int32)  # lane 0 prefill, 1 crosses pages, 2 idle
  k_new = rng.standard_normal((b, tq, nkv, hd)).astype(np.float32)
  v_new = rng.standard_normal((b, tq, nkv, hd)).astype(np.float32)
  return tuple(jnp.asarray(x) for x in (k_pages, v_pages)) + (
      jnp.asarray(k_new, dtype), jnp.asarray(v_new, dtype), jnp.asarray(table),
      jnp.asarray(kv_lens), jnp.asarray(q_lens))


def test_write_kv_matches_loop_spec_and_leaves_rest_untouched():
  args = _write_case(0)
  k_ref, v_ref = write_kv_reference(*args)
  fn = jax.jit(write_kv, donate_argnames=("k_pages", "v_pages"))
  k_out, v_out = fn(*args)
  k_out, v_out = np.asarray(k_out), np.asarray(v_out)
  # Exact equality, NaN positions included (untouched memory is still NaN).
  np.testing.assert_array_equal(k_out, k_ref)
  np.testing.assert_array_equal(v_out, v_ref)
  written = ~np.isnan(k_out[0, ..., 0])
  assert written.sum() == 3 + 6  # lane 2 (q_len 0) wrote nothing


def test_write_kv_drops_writes_to_pages_outside_the_pool():
  """Corrupt entries write nothing: -2 must not wrap around to page num_pages - 2 (a spare
  page here, NaN, that must stay NaN) and num_pages + 5 must not be clamped."""
  k_pages, v_pages, k_new, v_new, table, kv_lens, q_lens = _write_case(0)
  num_pages = k_pages.shape[1]
  bad = np.array(table)
  assert num_pages - 2 not in bad
  bad[1, 2] = -2               # lane 1 writes positions 11..16: pages 2, 3, 4
  bad[0, 0] = num_pages + 5    # lane 0 writes positions 0..2: page 0
  k_out, v_out = write_kv(k_pages, v_pages, k_new, v_new, jnp.asarray(bad), kv_lens, q_lens)
  # expected: the clean writes, minus those of the two corrupt entries
  k_ref, v_ref = write_kv_reference(k_pages, v_pages, k_new, v_new, table, kv_lens, q_lens)
  for ref in (k_ref, v_ref):
    ref[:, int(table[1, 2]), 3] = np.nan      # position 11 = page 2, slot 3
    ref[:, int(table[0, 0]), :3] = np.nan     # positions 0..2
  np.testing.assert_array_equal(np.asarray(k_out), k_ref)
  np.testing.assert_array_equal(np.asarray(v_out), v_ref)
  assert np.isnan(np.asarray(k_out)[:, num_pages - 2]).all()


def test_write_kv_bf16_pool_casts():
  k_pages, v_pages, k_new, v_new, table, kv_lens, q_lens = _write_case(1)
  k_pages = k_pages.astype(jnp.bfloat16)
  v_pages = v_pages.astype(jnp.bfloat16)
  k_out, v_out = write_kv(k_pages, v_pages, k_new, v_new, table, kv_lens, q_lens)
  assert k_out.dtype == jnp.bfloat16 and v_out.dtype == jnp.bfloat16
  k_ref, v_ref = write_kv_reference(k_pages, v_pages, k_new.astype(jnp.bfloat16),
                                    v_new.astype(jnp.bfloat16), table, kv_lens, q_lens)
  np.testing.assert_array_equal(np.asarray(k_out, np.float32), k_ref.astype(np.float32))
  np.testing.assert_array_equal(np.asarray(v_out, np.float32), v_ref.astype(np.float32))


# ---------------------------------------------------------------------------
# Input validation
# ---------------------------------------------------------------------------


def _valid_args():
  b, tq, nq, nkv, hd, ps, ppl, n_pages = 2, 4, 4, 2, 16, 4, 3, 8
  return dict(
      q=jnp.zeros((b, tq, nq, hd)),
      k_pages=jnp.zeros((nkv, n_pages, ps, hd)),
      v_pages=jnp.zeros((nkv, n_pages, ps, hd)),
      page_tables=jnp.zeros((b, ppl), jnp.int32),
      kv_lens=jnp.full((b,), 4, jnp.int32),
      q_lens=jnp.full((b,), 4, jnp.int32),
  )


def _bad(**over):
  a = _valid_args()
  a.update(over)
  return a


BAD_INPUTS = {
    "q_must_be_4d": (_bad(q=jnp.zeros((2, 4, 64))), "q must be"),
    "k_v_pages_same_shape": (_bad(v_pages=jnp.zeros((2, 8, 4, 32))), "same shape"),
    "head_dims_must_match": (_bad(k_pages=jnp.zeros((2, 8, 4, 32)),
                                  v_pages=jnp.zeros((2, 8, 4, 32))), "head_dim"),
    "heads_divisible_by_kv_heads": (_bad(q=jnp.zeros((2, 4, 3, 16))), "divisible"),
    "page_tables_batch": (_bad(page_tables=jnp.zeros((3, 3), jnp.int32)), "page_tables"),
    "page_tables_int32": (_bad(page_tables=jnp.zeros((2, 3), jnp.float32)), "int32"),
    "kv_lens_shape": (_bad(kv_lens=jnp.zeros((3,), jnp.int32)), "kv_lens"),
    "q_lens_int32": (_bad(q_lens=jnp.zeros((2,), jnp.float32)), "int32"),
}


@pytest.mark.parametrize("name", sorted(BAD_INPUTS))
def test_paged_attention_rejects(name):
  kwargs, msg = BAD_INPUTS[name]
  q = kwargs.pop("q")
  with pytest.raises(ValueError, match=msg):
    paged_attention(q, **kwargs, sm_scale=1.0, interpret=True)


def test_paged_attention_compiled_needs_power_of_two_page_size():
  a = _bad(k_pages=jnp.zeros((2, 8, 3, 16)), v_pages=jnp.zeros((2, 8, 3, 16)))
  with pytest.raises(ValueError, match="power-of-two page_size"):
    jax.jit(functools.partial(paged_attention, sm_scale=1.0)).trace(**a)


@pytest.mark.parametrize("field,value", [("max_block_rows", 8), ("max_block_rows", 48),
                                         ("pages_per_compute_block", 3), ("k_splits", 0),
                                         ("num_warps", 3), ("num_stages", 0)])
def test_tuning_rejects(field, value):
  with pytest.raises(ValueError, match=field):
    PagedAttentionTuning(**{field: value})


def test_compiled_key_block_should_be_at_least_16_tokens():
  """Triton dots need every dimension >= 16: a 2 x 4-token key block is rejected."""
  a = _valid_args()   # page_size 4, head_dim 16
  fn = functools.partial(paged_attention, sm_scale=1.0,
                         tuning=PagedAttentionTuning(pages_per_compute_block=2))
  with pytest.raises(ValueError, match="key block .* at least 16 tokens"):
    jax.jit(fn).trace(**a)
  # the interpreter has no such limit; and a 4 x 4 block is fine compiled
  jax.jit(functools.partial(fn, interpret=True)).trace(**a)
  jax.jit(functools.partial(paged_attention, sm_scale=1.0,
                            tuning=PagedAttentionTuning(pages_per_compute_block=4))).trace(**a)


def test_compiled_key_block_is_not_cut_below_16_by_a_short_table():
  """A short page table (2 pages of 4) no longer shrinks the compiled key block to 8 tokens."""
  a = _bad(page_tables=jnp.zeros((2, 2), jnp.int32))
  text = jax.jit(functools.partial(paged_attention, sm_scale=1.0)).trace(**a).lower(
      lowering_platforms=("cuda",)).as_text()
  assert "__gpu$xla.gpu.triton" in text
  from pallas_kernels.paged_attention import _key_block_pages
  tuning = PagedAttentionTuning(pages_per_compute_block=16)
  assert _key_block_pages(tuning, 4, 2, interpret=False) * 4 == 16
  assert _key_block_pages(tuning, 4, 2, interpret=True) == 2


def test_compiled_head_dim_should_be_at_least_16():
  a = _bad(q=jnp.zeros((2, 4, 4, 8)), k_pages=jnp.zeros((2, 8, 4, 8)),
           v_pages=jnp.zeros((2, 8, 4, 8)))
  with pytest.raises(ValueError, match="head_dim >= 16"):
    jax.jit(functools.partial(paged_attention, sm_scale=1.0)).trace(**a)


def test_tuning_table_entries_are_valid_for_triton():
  from pallas_kernels import PAGED_ATTENTION_TABLE
  for (hd, page_size, _), t in PAGED_ATTENTION_TABLE.items():
    assert hd >= 16 and t.pages_per_compute_block * page_size >= 16


def test_tuning_table_lookup():
  from pallas_kernels import get_paged_attention_tuning
  decode = get_paged_attention_tuning(256, 16, 4 * 6)
  prefill = get_paged_attention_tuning(256, 16, 256 * 6)
  assert decode.pages_per_compute_block * 16 == 64
  assert prefill.num_warps == 8
  fallback = get_paged_attention_tuning(64, 4)
  assert fallback.pages_per_compute_block * 4 == 64


def test_write_kv_rejects_mismatched_heads():
  k_pages, v_pages, k_new, v_new, table, kv_lens, q_lens = _write_case(0)
  with pytest.raises(ValueError, match="NKV/HD"):
    write_kv(k_pages, v_pages, k_new[:, :, :1], v_new[:, :, :1], table, kv_lens, q_lens)
  with pytest.raises(ValueError, match="int32"):
    write_kv(k_pages, v_pages, k_new, v_new, table, kv_lens.astype(jnp.float32), q_lens)


@pytest.mark.parametrize("kv,ql,msg", [([4, 4], [5, 1], r"\[0, Tq"),
                                       ([2, 4], [3, 1], "<= kv_lens"),
                                       ([13, 4], [1, 1], "pages_per_lane")])
def test_dynamic_validation(kv, ql, msg):
  a = _valid_args()
  with pytest.raises(ValueError, match=msg):
    validate_paged_inputs_dynamic(a["q"], a["k_pages"], a["page_tables"],
                                  np.asarray(kv, np.int32), np.asarray(ql, np.int32))


def test_dynamic_validation_page_ids():
  a = _valid_args()
  table = np.zeros((2, 3), np.int32)
  table[1, 0] = 8  # pool has 8 pages
  with pytest.raises(ValueError, match="outside"):
    validate_paged_inputs_dynamic(a["q"], a["k_pages"], table, np.asarray([4, 4], np.int32),
                                  np.asarray([1, 1], np.int32))
  validate_paged_inputs_dynamic(a["q"], a["k_pages"], a["page_tables"], a["kv_lens"],
                                a["q_lens"])


# ---------------------------------------------------------------------------
# Lowering for CUDA (Triton) at Qwen3.5-27B shapes, on this CPU machine
# ---------------------------------------------------------------------------

NQ, NKV, HD, PAGE = 24, 4, 256, 16


@pytest.mark.parametrize("b,tq,pages_per_lane,tuning,dtype", [
    (8, 1, 256, None, jnp.bfloat16),  # decode, 4k context, auto splits
    (4, 4, 256, None, jnp.bfloat16),  # verify k = 3: 24 rows -> one block of 32
    (4, 4, 256, None, jnp.float32),  # f32 (IEEE dots)
    (1, 256, 64, None, jnp.bfloat16),  # prefill chunk: 24 row blocks, auto splits
    (1, 256, 64, PagedAttentionTuning(k_splits=1), jnp.bfloat16),  # no split
], ids=["decode", "verify", "verify-f32", "prefill", "prefill-nosplit"])
def test_lowers_for_cuda_at_27b_shapes(b, tq, pages_per_lane, tuning, dtype):
  sds = jax.ShapeDtypeStruct
  num_pages = b * pages_per_lane
  args = (sds((b, tq, NQ, HD), dtype),
          sds((NKV, num_pages, PAGE, HD), dtype),
          sds((NKV, num_pages, PAGE, HD), dtype),
          sds((b, pages_per_lane), jnp.int32), sds((b,), jnp.int32), sds((b,), jnp.int32))
  fn = functools.partial(paged_attention, sm_scale=HD ** -0.5, tuning=tuning)
  text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert "__gpu$xla.gpu.triton" in text
  assert "paged_attention_" in text


def test_write_kv_lowers_for_cuda_with_donation():
  sds = jax.ShapeDtypeStruct
  b, tq = 4, 4
  pool = sds((NKV, 1024, PAGE, HD), jnp.bfloat16)
  new = sds((b, tq, NKV, HD), jnp.bfloat16)
  fn = jax.jit(write_kv, donate_argnames=("k_pages", "v_pages"))
  lowered = fn.trace(pool, pool, new, new, sds((b, 256), jnp.int32), sds((b,), jnp.int32),
                     sds((b,), jnp.int32)).lower(lowering_platforms=("cuda",))
  assert "tf.aliasing_output" in lowered.as_text()
