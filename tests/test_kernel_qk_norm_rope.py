"""The attention layer's fused kernels: pallas_kernels.qk_norm_rope_write (split, q/k norms,
partial RoPE, the KV write in place, q folded for the attention kernel) and
pallas_kernels.paged_attention_gated (the attention kernel, then one kernel that merges its
splits and applies the sigmoid gate).

* the interpreted prologue == its jnp reference on ragged lanes (an idle lane, a short one)
  with NaN-poisoned pool memory: the pools bit for bit (NaN where nothing was written),
  the folded queries within a bf16 ulp (the norm's sum of squares in another order);
* the reference == the model's own ops (_split_qkv, write_kv, the fold) bit for bit;
* a page id outside the pool drops that token's write (as write_kv does);
* the interpreted gated attention == its reference, split and unsplit, poisoned pools;
* mtpjax.model._attend_gated on the "interpret" path == the reference path;
* both kernels lower for CUDA at the 27B's attention widths (Triton custom calls);
* the wrappers reject bad shapes with ValueErrors.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import (
    PagedAttentionTuning,
    paged_attention_gated,
    paged_attention_gated_reference,
    qk_norm_rope_fits,
    qk_norm_rope_write,
    qk_norm_rope_write_reference,
    write_kv,
)
from pallas_kernels.paged_attention import query_rows
from pallas_kernels.qk_norm_rope import head_pieces
from pallas_kernels.tuned_block_sizes import get_paged_attention_tuning

EPS = 1e-6
PAGE = 4


def _rope_tables(pos, rd, dtype):
  inv = 10000.0 ** (-np.arange(0, rd, 2) / rd)
  ang = np.asarray(pos, np.float64)[..., None] * inv
  ang = np.concatenate([ang, ang], -1)
  return jnp.asarray(np.cos(ang), dtype), jnp.asarray(np.sin(ang), dtype)


def _case(seed, *, b=3, t=3, nq=6, nkv=2, hd=64, rd=32, pages_per_lane=4, dtype=jnp.bfloat16,
          q_lens=(3, 1, 0), starts=(5, 9, 2)):
  """Random projection, norm weights, RoPE tables; a pool whose slots at or past each lane's
  new length (and every unused page) are NaN; a permuted page table (unused entries out of
  range, as the engine leaves them)."""
  rng = np.random.default_rng(seed)
  num_pages = b * pages_per_lane + 2
  qkv = jnp.asarray(2.0 * rng.standard_normal((b, t, (2 * nq + 2 * nkv) * hd)), dtype)
  qn = jnp.asarray(0.2 * rng.standard_normal(hd), dtype)
  kn = jnp.asarray(0.2 * rng.standard_normal(hd), dtype)
  starts, q_lens = np.asarray(starts[:b]), np.asarray(q_lens[:b])
  kv_lens = starts + q_lens
  perm = rng.permutation(num_pages)
  table = np.full((b, pages_per_lane), num_pages, np.int32)
  k = np.full((nkv, num_pages, PAGE, hd), np.nan, np.float32)
  v = np.full((nkv, num_pages, PAGE, hd), np.nan, np.float32)
  for i in range(b):
    n = -(-int(starts[i] + t) // PAGE)
    table[i, :n] = perm[i * pages_per_lane:i * pages_per_lane + n]
    for p in range(int(starts[i])):
      k[:, table[i, p // PAGE], p % PAGE] = rng.standard_normal((nkv, hd))
      v[:, table[i, p // PAGE], p % PAGE] = rng.standard_normal((nkv, hd))
  cos, sin = _rope_tables(starts[:, None] + np.arange(t)[None], rd, dtype)
  return dict(qkv=qkv, q_norm=qn, k_norm=kn, cos=cos, sin=sin,
              k_pages=jnp.asarray(k, dtype), v_pages=jnp.asarray(v, dtype),
              page_tables=jnp.asarray(table), kv_lens=jnp.asarray(kv_lens, jnp.int32),
              q_lens=jnp.asarray(q_lens, jnp.int32)), dict(num_q_heads=nq, rotary_dim=rd,
                                                           eps=EPS)


def _f32(x):
  return np.asarray(x, np.float32)


def _within_ulp(got, want):
  got, want = _f32(got), _f32(want)
  assert np.isnan(got).sum() == 0 and np.isnan(want).sum() == 0
  ulp = np.abs(want) * 2.0 ** -7 + 1e-30
  assert (np.abs(got - want) <= ulp).all(), np.abs(got - want).max()


@pytest.mark.parametrize("t,nq,nkv,q_lens", [(1, 6, 2, (1, 1, 0)), (5, 4, 4, (5, 2, 0)),
                                             (2, 8, 1, (2, 2, 1))],
                         ids=["decode-g3", "verify-ragged-g1", "g8"])
def test_interpreted_prologue_matches_reference(t, nq, nkv, q_lens):
  args, kw = _case(t + nq, t=t, nq=nq, nkv=nkv, q_lens=q_lens)
  qf1, k1, v1 = qk_norm_rope_write(**args, **kw, interpret=True)
  qf2, k2, v2 = qk_norm_rope_write_reference(**args, **kw)
  assert qf1.shape == qf2.shape and qf1.dtype == args["qkv"].dtype
  np.testing.assert_array_equal(_f32(v1), _f32(v2))          # NaN where nothing was written
  nan = np.isnan(_f32(k2))
  np.testing.assert_array_equal(np.isnan(_f32(k1)), nan)
  _within_ulp(_f32(k1)[~nan], _f32(k2)[~nan])
  _within_ulp(qf1, qf2)
  rows = t * (nq // nkv)
  assert (_f32(qf1)[:, :, rows:] == 0).all()                 # padding rows are zeros
  # only the new valid tokens were written: every other slot is as it was
  old = _f32(args["k_pages"])
  changed = ~(np.isnan(old) & np.isnan(_f32(k1))) & (old != _f32(k1))
  assert changed.any(axis=(0, 3)).sum() == sum(q_lens)


def test_reference_is_the_models_split_norm_rope_write_and_fold_bit_for_bit():
  from mtpjax.config import qwen3_5_27b
  from mtpjax.model import _split_qkv
  from mtpjax.params import AttnParams
  args, kw = _case(11, t=3, nq=6, nkv=2, hd=64, rd=32)
  cfg = dataclasses.replace(qwen3_5_27b(), num_attention_heads=6, num_key_value_heads=2,
                            head_dim=64, partial_rotary_factor=0.5)
  assert cfg.rotary_dim == 32
  p = AttnParams(qkv=None, o_proj=None, q_norm=args["q_norm"], k_norm=args["k_norm"])

  @jax.jit
  def model(a):
    q, _, k, v = _split_qkv(cfg, p, a["qkv"], a["cos"], a["sin"])
    kp, vp = write_kv(a["k_pages"], a["v_pages"], k, v, a["page_tables"], a["kv_lens"],
                      a["q_lens"])
    b, t = q.shape[:2]
    qf = q.reshape(b, t, 2, 3, 64).transpose(0, 2, 1, 3, 4).reshape(b, 2, t * 3, 64)
    return qf, kp, vp

  qf, kp, vp = qk_norm_rope_write_reference(**args, **kw)
  want_qf, want_k, want_v = model(args)
  np.testing.assert_array_equal(_f32(qf)[:, :, :9], _f32(want_qf))
  np.testing.assert_array_equal(_f32(kp), _f32(want_k))
  np.testing.assert_array_equal(_f32(vp), _f32(want_v))


def test_a_page_id_outside_the_pool_drops_the_write():
  args, kw = _case(5, t=1, q_lens=(1, 1, 1))
  table = np.array(args["page_tables"])
  pos = int(args["kv_lens"][1]) - 1
  table[1, pos // PAGE] = -3                       # a corrupt entry: negative ids must not wrap
  args["page_tables"] = jnp.asarray(table)
  _, k1, v1 = qk_norm_rope_write(**args, **kw, interpret=True)
  _, k2, v2 = qk_norm_rope_write_reference(**args, **kw)
  np.testing.assert_array_equal(_f32(v1), _f32(v2))
  old, new = _f32(args["v_pages"]), _f32(v1)
  changed = ~(np.isnan(old) & np.isnan(new)) & (old != new)
  assert changed.any(axis=(0, 3)).sum() == 2      # lanes 0 and 2 only


@pytest.mark.parametrize("splits", [None, 1], ids=["split", "one-split"])
@pytest.mark.parametrize("t,q_lens", [(1, (1, 1, 0)), (3, (3, 1, 0))], ids=["decode", "ragged"])
def test_interpreted_gated_attention_matches_reference(t, q_lens, splits):
  args, kw = _case(20 + t, t=t, q_lens=q_lens)
  qf, kp, vp = qk_norm_rope_write_reference(**args, **kw)
  tuning = PagedAttentionTuning(pages_per_compute_block=1, k_splits=splits)
  call = dict(num_q_heads=kw["num_q_heads"], sm_scale=64 ** -0.5, tuning=tuning)
  pos = (qf, kp, vp, args["page_tables"], args["kv_lens"], args["q_lens"], args["qkv"])
  got = paged_attention_gated(*pos, **call, interpret=True)
  want = paged_attention_gated_reference(*pos, **call)
  assert got.shape == (3, t, 6 * 64) and got.dtype == jnp.bfloat16
  assert np.isfinite(_f32(got)).all()
  np.testing.assert_allclose(_f32(got), _f32(want), rtol=2e-2, atol=2e-2)
  for b, n in enumerate(q_lens):                    # rows past q_len are zeros
    assert (_f32(got)[b, n:] == 0).all()


def test_attend_gated_interpret_path_matches_reference_path():
  from mtpjax import model
  from mtpjax.config import qwen3_5_27b
  from mtpjax.params import AttnParams
  args, _ = _case(31, t=2, nq=4, nkv=2, hd=64, rd=32, q_lens=(2, 1, 0))
  cfg = dataclasses.replace(qwen3_5_27b(), num_attention_heads=4, num_key_value_heads=2,
                            head_dim=64, partial_rotary_factor=0.5)
  p = AttnParams(qkv=None, o_proj=None, q_norm=args["q_norm"], k_norm=args["k_norm"])
  kv = model.PagedKV(args["k_pages"], args["v_pages"], PAGE)
  seg = model.Segment(args["kv_lens"] - args["q_lens"], args["q_lens"], args["page_tables"])
  out = {}
  for kernels in ("reference", "interpret"):
    out[kernels] = model._attend_gated(cfg, p, args["qkv"], kv, seg, args["cos"], args["sin"],
                                       kernels)
  (o1, kv1), (o2, kv2) = out["interpret"], out["reference"]
  np.testing.assert_allclose(_f32(o1), _f32(o2), rtol=2e-2, atol=2e-2)
  np.testing.assert_array_equal(np.isnan(_f32(kv1.k)), np.isnan(_f32(kv2.k)))
  np.testing.assert_array_equal(_f32(kv1.v), _f32(kv2.v))


@pytest.mark.parametrize("t", [1, 5])
def test_lowers_for_cuda_at_the_27b_widths(t):
  """NQ 24, NKV 4, HD 256, RD 64 (pieces 32 + 32 + 128 + 64), 1k context of 16-token pages."""
  sds = jax.ShapeDtypeStruct
  b, nq, nkv, hd, page, ppl = 2, 24, 4, 256, 16, 65
  assert head_pieces(hd, 64) == [(0, 32), (32, 32), (64, 128), (192, 64)]
  bf = jnp.bfloat16
  qkv = sds((b, t, (2 * nq + 2 * nkv) * hd), bf)
  pool = sds((nkv, b * ppl, page, hd), bf)
  i32 = functools.partial(sds, dtype=jnp.int32)
  _, rows = query_rows(t, nq // nkv, get_paged_attention_tuning(hd, page, t * nq // nkv))
  pro = jax.jit(functools.partial(qk_norm_rope_write, num_q_heads=nq, rotary_dim=64, eps=EPS),
                donate_argnums=(5, 6))
  text = pro.trace(qkv, sds((hd,), bf), sds((hd,), bf), sds((b, t, 64), bf),
                   sds((b, t, 64), bf), pool, pool, i32((b, ppl)), i32((b,)), i32((b,))).lower(
                       lowering_platforms=("cuda",)).as_text()
  assert "__gpu$xla.gpu.triton" in text and f"qk_norm_rope_write_t{t}_g6" in text
  att = jax.jit(functools.partial(paged_attention_gated, num_q_heads=nq, sm_scale=hd ** -0.5))
  text = att.trace(sds((b, nkv, rows, hd), bf), pool, pool, i32((b, ppl)), i32((b,)),
                   i32((b,)), qkv).lower(lowering_platforms=("cuda",)).as_text()
  assert "paged_attention_" in text and "attention_merge_gate_s" in text


def test_rejects():
  args, kw = _case(1, t=1)
  with pytest.raises(ValueError, match="columns"):
    qk_norm_rope_write(**dict(args, qkv=args["qkv"][..., :-64]), **kw, interpret=True)
  odd, odd_kw = _case(1, t=1, rd=24)
  with pytest.raises(ValueError, match="rotary_dim / 2 a power of two"):
    qk_norm_rope_write(**odd, **odd_kw, interpret=False)
  assert qk_norm_rope_fits(16, 16, False) and qk_norm_rope_fits(3, 24, True)
  assert not qk_norm_rope_fits(17, 64, True) and not qk_norm_rope_fits(1, 24, False)
  big = jnp.zeros((3, 17, args["qkv"].shape[-1]), jnp.bfloat16)
  with pytest.raises(ValueError, match="T must lie in 1..16"):
    qk_norm_rope_write(**dict(args, qkv=big), **kw, interpret=True)
  qf = jnp.zeros((3, 2, 8, 64), jnp.bfloat16)
  with pytest.raises(ValueError, match="must hold 16 rows"):
    paged_attention_gated(qf, args["k_pages"], args["v_pages"], args["page_tables"],
                          args["kv_lens"], args["q_lens"], args["qkv"], num_q_heads=6,
                          sm_scale=1.0, interpret=True)
