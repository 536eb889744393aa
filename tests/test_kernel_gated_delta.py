"""Gated delta rule kernels vs references and a naive snapshot oracle.

* ``chunk_gated_delta`` (Pallas, interpret mode) and
  ``chunk_gated_delta_reference`` == ``recurrent_gated_delta_reference`` for T
  not a multiple of the chunk, a nonzero initial state and correlated keys.
* ``gated_delta_verify`` == a naive oracle that keeps one full state snapshot
  per pending token and selects index ``n_pend`` (the vLLM/SGLang scheme),
  for every ``n_pend`` in 0..P across lanes, with NaN in the pending slots
  beyond ``n_pend``; and a multi-round speculative simulation == plain
  recurrence over the accepted tokens.

``INTERPRET = True`` on CPU; on a GPU backend a compiled subclass is defined
too (and on CPU it is not defined, so nothing is skipped).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import (
    GatedDeltaTuning,
    chunk_gated_delta,
    chunk_gated_delta_reference,
    gated_delta_verify,
    gated_delta_verify_reference,
    recurrent_gated_delta_reference,
)
from pallas_kernels.gated_delta import gate_values

F32_TOL = 1e-5
BF16_TOL = 2e-2


def make_tokens(rng, b, t, h, dk, dv, *, correlated=False):
  """q, k (L2-normalised, q scaled), v, g <= 0, beta in (0, 1); numpy f32."""
  q = rng.standard_normal((b, t, h, dk))
  k = rng.standard_normal((b, t, h, dk))
  if correlated:  # keys close to a shared direction: stresses the (I + A)^-1 solve
    k = 0.2 * k + rng.standard_normal((1, 1, h, dk))
  q = q / np.linalg.norm(q, axis=-1, keepdims=True) * dk ** -0.5
  k = k / np.linalg.norm(k, axis=-1, keepdims=True)
  v = rng.standard_normal((b, t, h, dv))
  g = -0.3 * np.exp(rng.standard_normal((b, t, h)))
  beta = 1.0 / (1.0 + np.exp(-rng.standard_normal((b, t, h))))
  return tuple(x.astype(np.float32) for x in (q, k, v, g, beta))


def make_state(rng, b, h, dk, dv):
  return (0.5 * rng.standard_normal((b, h, dk, dv))).astype(np.float32)


def _np_step(s, k, v, g, beta):
  """Spec §4.1 for one token on [H, DK, DV] in float64."""
  s = np.exp(g)[:, None, None] * s
  pred = np.einsum("hkv,hk->hv", s, k)
  u = beta[:, None] * (v - pred)
  return s + k[:, :, None] * u[:, None, :]


def naive_verify_oracle(state, pend, n_pend, new):
  """One full state snapshot per pending token; select index n_pend[b]."""
  pk, pv, pg, pb = (np.asarray(x, np.float64) for x in pend)
  q, k, v, g, beta = (np.asarray(x, np.float64) for x in new)
  b, p = pk.shape[:2]
  t = q.shape[1]
  o = np.zeros(v.shape)
  s_c = np.zeros(state.shape)
  for i in range(b):
    snaps = [np.asarray(state[i], np.float64)]
    with np.errstate(invalid="ignore", over="ignore"):  # NaN slots -> NaN snapshots
      for j in range(p):
        snaps.append(_np_step(snaps[-1], pk[i, j], pv[i, j], pg[i, j], pb[i, j]))
    s = snaps[int(n_pend[i])]
    s_c[i] = s
    for j in range(t):
      s = _np_step(s, k[i, j], v[i, j], g[i, j], beta[i, j])
      o[i, j] = np.einsum("hkv,hk->hv", s, q[i, j])
  return o, s_c


class TestGatedDelta:
  INTERPRET = True

  # -- chunked prefill -------------------------------------------------------

  @pytest.mark.parametrize("t,chunk,correlated,block_v", [
      (37, 16, True, 16),  # 3 chunks, short tail, correlated keys, DV split in 2
      (5, 16, False, 32),  # T < chunk, one DV block
  ])
  def test_chunk_kernel_matches_recurrent(self, t, chunk, correlated, block_v):
    rng = np.random.default_rng(t + chunk + correlated)
    b, h, dk, dv = 2, 3, 16, 32
    toks = make_tokens(rng, b, t, h, dk, dv, correlated=correlated)
    s0 = make_state(rng, b, h, dk, dv)
    o_ref, s_ref = recurrent_gated_delta_reference(*toks, s0)
    o, s = chunk_gated_delta(*toks, s0, chunk_size=chunk, interpret=self.INTERPRET,
                             tuning=GatedDeltaTuning(block_v=block_v))
    assert o.shape == (b, t, h, dv) and s.shape == (b, h, dk, dv)
    np.testing.assert_allclose(o, o_ref, atol=F32_TOL, rtol=F32_TOL)
    np.testing.assert_allclose(s, s_ref, atol=F32_TOL, rtol=F32_TOL)

  def test_chunk_right_padding_is_a_noop(self):
    """Ragged prefill: lane 1 has 20 real tokens, padded with g = beta = 0."""
    rng = np.random.default_rng(37)
    b, t, h, dk, dv, n_real = 2, 37, 3, 16, 32, 20
    q, k, v, g, beta = make_tokens(rng, b, t, h, dk, dv, correlated=True)
    g[1, n_real:] = 0.0
    beta[1, n_real:] = 0.0
    s0 = make_state(rng, b, h, dk, dv)
    o, s = chunk_gated_delta(q, k, v, g, beta, s0, chunk_size=16,
                             interpret=self.INTERPRET, tuning=GatedDeltaTuning(block_v=16))
    o_ref, s_ref = recurrent_gated_delta_reference(
        *(x[1:, :n_real] for x in (q, k, v, g, beta)), s0[1:])
    np.testing.assert_allclose(o[1:, :n_real], o_ref, atol=F32_TOL, rtol=F32_TOL)
    np.testing.assert_allclose(s[1:], s_ref, atol=F32_TOL, rtol=F32_TOL)

  def test_chunk_kernel_bf16_inputs(self):
    rng = np.random.default_rng(5)
    b, t, h, dk, dv = 1, 40, 2, 32, 32
    q, k, v, g, beta = make_tokens(rng, b, t, h, dk, dv)
    s0 = make_state(rng, b, h, dk, dv)
    q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in (q, k, v))
    o_ref, s_ref = recurrent_gated_delta_reference(q, k, v, g, beta, s0)
    o, s = chunk_gated_delta(q, k, v, g, beta, s0, chunk_size=16,
                             interpret=self.INTERPRET)
    assert o.dtype == jnp.bfloat16 and s.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(o, np.float32), np.asarray(o_ref, np.float32),
                               atol=BF16_TOL, rtol=BF16_TOL)
    np.testing.assert_allclose(s, s_ref, atol=1e-4, rtol=1e-4)  # state math is f32

  # -- verify / decode -------------------------------------------------------

  @pytest.mark.parametrize("p", [4, 3], ids=["k3", "k2"])
  def test_verify_matches_snapshot_oracle(self, p):
    """Lanes take every n_pend in 0..P; pending slots >= n_pend hold NaN."""
    rng = np.random.default_rng(p)
    t, h, dk, dv = p, 2, 16, 32
    b = p + 1
    n_pend = np.arange(b, dtype=np.int32)  # 0, 1, ..., P
    pend = list(make_tokens(rng, b, p, h, dk, dv)[1:])  # k, v, g, beta
    for i in range(b):
      for x in pend:
        x[i, n_pend[i]:] = np.nan
    new = make_tokens(rng, b, t, h, dk, dv)
    s0 = make_state(rng, b, h, dk, dv)
    o_want, s_want = naive_verify_oracle(s0, pend, n_pend, new)
    args = (jnp.asarray(s0), *map(jnp.asarray, pend), jnp.asarray(n_pend),
            *map(jnp.asarray, new))
    for fn in (functools.partial(gated_delta_verify, interpret=self.INTERPRET,
                                 tuning=GatedDeltaTuning(block_v=16)),
               gated_delta_verify_reference):
      o, s = fn(*args)
      assert np.isfinite(np.asarray(o)).all() and np.isfinite(np.asarray(s)).all()
      np.testing.assert_allclose(o, o_want, atol=F32_TOL, rtol=F32_TOL)
      np.testing.assert_allclose(s, s_want, atol=F32_TOL, rtol=F32_TOL)

  def test_decode_is_verify_with_one_token(self):
    rng = np.random.default_rng(9)
    b, h, dk, dv = 2, 3, 16, 16
    pend = make_tokens(rng, b, 1, h, dk, dv)[1:]
    new = make_tokens(rng, b, 1, h, dk, dv)
    s0 = make_state(rng, b, h, dk, dv)
    n_pend = np.asarray([1, 1], np.int32)
    o, s = gated_delta_verify(jnp.asarray(s0), *map(jnp.asarray, pend),
                              jnp.asarray(n_pend), *map(jnp.asarray, new),
                              interpret=self.INTERPRET)
    o_want, s_want = naive_verify_oracle(s0, pend, n_pend, new)
    np.testing.assert_allclose(o, o_want, atol=F32_TOL, rtol=F32_TOL)
    np.testing.assert_allclose(s, s_want, atol=F32_TOL, rtol=F32_TOL)

  def test_speculative_rounds_equal_plain_recurrence(self):
    """Prefill, then rounds of k+1 verify tokens with random acceptance; the
    outputs at accepted positions and the final committed state must equal a
    plain recurrence over the accepted token stream."""
    rng = np.random.default_rng(21)
    b, h, dk, dv, k_drafts, rounds = 2, 2, 16, 16, 3, 4
    t = k_drafts + 1
    prompt = make_tokens(rng, b, 9, h, dk, dv)
    _, state = recurrent_gated_delta_reference(
        *prompt, jnp.zeros((b, h, dk, dv), jnp.float32))
    pend = [jnp.zeros((b, t, h, d), jnp.float32) for d in (dk, dv)]
    pend += [jnp.zeros((b, t, h), jnp.float32)] * 2
    n_pend = jnp.zeros((b,), jnp.int32)
    stream = [[np.asarray(x[i]) for x in prompt] for i in range(b)]
    outs = [[] for _ in range(b)]
    step = jax.jit(functools.partial(gated_delta_verify, interpret=self.INTERPRET),
                   donate_argnames=("state",))
    for _ in range(rounds):
      new = make_tokens(rng, b, t, h, dk, dv)
      o, state = step(state, *pend, n_pend, *map(jnp.asarray, new))
      accepted = rng.integers(0, t, size=b)  # accepted drafts (0..k) per lane
      for i in range(b):
        n = int(accepted[i]) + 1  # + the bonus/corrected token
        outs[i].append(np.asarray(o[i, :n]))
        for j, x in enumerate(new):
          stream[i][j] = np.concatenate([stream[i][j], x[i, :n]])
      pend = list(map(jnp.asarray, new[1:]))
      n_pend = jnp.asarray(accepted + 1, jnp.int32)
    # Commit the last round with a dummy decode step.
    dummy = make_tokens(rng, b, 1, h, dk, dv)
    _, state = step(state, *pend, n_pend, *map(jnp.asarray, dummy))
    for i in range(b):
      toks = [jnp.asarray(x[None]) for x in stream[i]]
      o_ref, s_ref = recurrent_gated_delta_reference(
          *toks, jnp.zeros((1, h, dk, dv), jnp.float32))
      n_prompt = 9
      np.testing.assert_allclose(np.concatenate(outs[i]), o_ref[0, n_prompt:],
                                 atol=F32_TOL, rtol=F32_TOL)
      np.testing.assert_allclose(state[i], s_ref[0], atol=F32_TOL, rtol=F32_TOL)

  def test_verify_bf16_inputs(self):
    rng = np.random.default_rng(13)
    b, p, h, dk, dv = 2, 4, 2, 32, 32
    pend = [jnp.asarray(x) for x in make_tokens(rng, b, p, h, dk, dv)[1:]]
    new = [jnp.asarray(x) for x in make_tokens(rng, b, p, h, dk, dv)]
    pend[0], pend[1] = pend[0].astype(jnp.bfloat16), pend[1].astype(jnp.bfloat16)
    for i in range(3):
      new[i] = new[i].astype(jnp.bfloat16)
    s0 = jnp.asarray(make_state(rng, b, h, dk, dv))
    n_pend = jnp.asarray([2, 4], jnp.int32)
    o, s = gated_delta_verify(s0, *pend, n_pend, *new, interpret=self.INTERPRET)
    o_ref, s_ref = gated_delta_verify_reference(s0, *pend, n_pend, *new)
    assert o.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(o, np.float32), np.asarray(o_ref, np.float32),
                               atol=BF16_TOL, rtol=BF16_TOL)
    np.testing.assert_allclose(s, s_ref, atol=1e-5, rtol=1e-5)

  def test_verify_runs_b_lanes_of_a_larger_state_and_skips_idle_lanes(self):
    """An engine step passes its whole state (S slots) for a bucket of B lanes: slots >= B
    and idle lanes must come back bit for bit (NaN-poisoned here, so a read-and-rewrite
    would also show), live lanes must match the reference on their own slots."""
    rng = np.random.default_rng(21)
    b, slots, p, h, dk, dv = 3, 5, 2, 2, 16, 32
    pend = [jnp.asarray(x) for x in make_tokens(rng, b, p, h, dk, dv)[1:]]
    new = [jnp.asarray(x) for x in make_tokens(rng, b, 2, h, dk, dv)]
    s_all = make_state(rng, slots, h, dk, dv)
    s_all[1] = np.nan                       # lane 1 idle: its slot must stay NaN
    s_all[b:] = np.nan                      # slots past the bucket: untouched
    live = jnp.asarray([True, False, True])
    n_pend = jnp.asarray([2, 0, 1], jnp.int32)
    o, s = gated_delta_verify(jnp.asarray(s_all), *pend, n_pend, *new, live=live,
                              interpret=self.INTERPRET)
    assert s.shape == (slots, h, dk, dv)
    assert np.isnan(np.asarray(s)[1]).all() and np.isnan(np.asarray(s)[b:]).all()
    assert not np.isnan(np.asarray(o)).any() and not np.asarray(o)[1].any()
    s_live = jnp.asarray(np.where(np.isnan(s_all[:b]), 0.0, s_all[:b]))
    o_ref, s_ref = gated_delta_verify_reference(s_live, *pend, n_pend, *new)
    for i in (0, 2):
      np.testing.assert_allclose(o[i], o_ref[i], atol=F32_TOL, rtol=F32_TOL)
      np.testing.assert_allclose(s[i], s_ref[i], atol=F32_TOL, rtol=F32_TOL)


  @pytest.mark.parametrize("t,p", [(3, 3), (1, 4), (2, 5)], ids=["k2", "decode", "ragged"])
  def test_verify_gates_and_pending_values_inside_the_kernel(self, t, p):
    """gates=(a, b, A_log, dt_bias): the kernel computes g and beta as the model does
    (gate_values), and write_pend_v=True stores the new block's v as the next pending values
    after the replay read the old ones, in place. Checked against the plain call on
    gate_values and against the reference with the same options; bf16 gate inputs as in
    the model; pending slots >= n_pend, the pend_v rows past T and the lane slots past the
    bucket hold NaN (never read; past-T rows and slots past B must come back as they were).
    """
    rng = np.random.default_rng(31 + t)
    b, slots, h, dk, dv = 3, 4, 2, 16, 32
    n_pend = np.asarray([0, min(1, p), p], np.int32)
    pk, pv, pg, pb = make_tokens(rng, b, p, h, dk, dv)[1:]
    for i in range(b):
      for x in (pk, pv, pg, pb):
        x[i, n_pend[i]:] = np.nan
    pv_all = np.full((slots, p, h, dv), np.nan, np.float32)
    pv_all[:b] = pv
    q, k, v, _, _ = make_tokens(rng, b, t, h, dk, dv)
    bf = jnp.bfloat16
    a = jnp.asarray(rng.standard_normal((b, t, h)), bf)
    braw = jnp.asarray(rng.standard_normal((b, t, h)), bf)
    a_log = jnp.asarray(rng.standard_normal(h), jnp.float32)
    dt_bias = jnp.asarray(rng.standard_normal(h), bf)
    g, beta = gate_values(a, braw, a_log, dt_bias)
    s0 = jnp.asarray(make_state(rng, b, h, dk, dv))
    pend = tuple(map(jnp.asarray, (pk, pv, pg, pb)))
    new = tuple(map(jnp.asarray, (q, k, v)))
    o_want, s_want = gated_delta_verify(s0, *pend, jnp.asarray(n_pend), *new, g, beta,
                                        interpret=self.INTERPRET,
                                        tuning=GatedDeltaTuning(block_v=16))
    off = 3                   # b and a inside a wider tensor, as in the model's projection
    ab = jnp.concatenate([jnp.asarray(rng.standard_normal((b, t, off)), bf), braw, a,
                          jnp.full((b, t, 2), jnp.nan, bf)], axis=-1)
    kw = dict(gates=(ab, a_log, dt_bias), gate_offset=off, write_pend_v=True)
    for fn in (functools.partial(gated_delta_verify, interpret=self.INTERPRET,
                                 tuning=GatedDeltaTuning(block_v=16)),
               gated_delta_verify_reference):
      o, s, pv_new = fn(s0, pend[0], jnp.asarray(pv_all), *pend[2:], jnp.asarray(n_pend),
                        *new, None, None, **kw)
      assert np.isfinite(np.asarray(o)).all() and np.isfinite(np.asarray(s)).all()
      np.testing.assert_allclose(o, o_want, atol=F32_TOL, rtol=F32_TOL)
      np.testing.assert_allclose(s, s_want, atol=F32_TOL, rtol=F32_TOL)
      pv_new = np.asarray(pv_new)
      np.testing.assert_array_equal(pv_new[:b, :t], v)
      np.testing.assert_array_equal(pv_new[:b, t:], pv_all[:b, t:])   # NaN where it was
      assert np.isnan(pv_new[b:]).all()

  @pytest.mark.parametrize("t,p", [(3, 3), (1, 4), (2, 5)], ids=["k2", "decode", "ragged"])
  @pytest.mark.parametrize("norm", [False, True, "partials"],
                           ids=["pending", "pending+norm", "pending+norm+partials"])
  def test_verify_one_program_per_head_writes_every_pending_buffer(self, t, p, norm):
    """write_pending=True (one program per head): all four pending buffers take the new
    block (k, v as passed, g and beta as computed from the gates) in place after the replay;
    norm_weight: the outputs come back through the GDN output norm with z read from the
    in-projection rows. Against the plain call + gate_values + the model's gated_rmsnorm;
    NaN in unread pending slots, in rows past T and in lane slots past the bucket; an idle
    lane (live False) comes back zeros and keeps its state."""
    from mtpjax.model import gated_rmsnorm
    rng = np.random.default_rng(41 + t + 7 * bool(norm))
    b, slots, h, dk, dv = 3, 4, 2, 16, 32
    n_pend = np.asarray([0, min(1, p), p], np.int32)
    pend = list(make_tokens(rng, b, p, h, dk, dv)[1:])
    for i in range(b):
      for x in pend:
        x[i, n_pend[i]:] = np.nan
    pend_all = []
    for x in pend:
      y = np.full((slots,) + x.shape[1:], np.nan, np.float32)
      y[:b] = x
      pend_all.append(y)
    q, k, v, _, _ = make_tokens(rng, b, t, h, dk, dv)
    bf = jnp.bfloat16
    braw = jnp.asarray(rng.standard_normal((b, t, h)), bf)
    a = jnp.asarray(rng.standard_normal((b, t, h)), bf)
    z = jnp.asarray(rng.standard_normal((b, t, h * dv)), bf)
    ab = jnp.concatenate([jnp.asarray(rng.standard_normal((b, t, 5)), bf), z, braw, a,
                          jnp.full((b, t, 3), jnp.nan, bf)], axis=-1)
    a_log = jnp.asarray(rng.standard_normal(h), jnp.float32)
    dt_bias = jnp.asarray(rng.standard_normal(h), bf)
    w = jnp.asarray(1.0 + 0.1 * rng.standard_normal(dv), bf)
    g, beta = gate_values(a, braw, a_log, dt_bias)
    s0 = jnp.asarray(make_state(rng, b, h, dk, dv))
    live = jnp.asarray([True, True, True])
    o_want, s_want = gated_delta_verify_reference(s0, *map(jnp.asarray, pend),
                                                  jnp.asarray(n_pend), *map(jnp.asarray,
                                                                            (q, k, v)), g, beta)
    if norm:
      o_want = gated_rmsnorm(o_want.astype(bf), z.reshape(b, t, h, dv), w, 1e-6)
    kw = dict(gates=(ab, a_log, dt_bias), gate_offset=5 + h * dv, write_pending=True,
              live=live)
    if norm:
      kw.update(norm_weight=w, norm_offset=5)
    if norm == "partials":     # ab as 3 f32 split partials whose sum is ab exactly
      abf = ab.astype(jnp.float32)
      part = jnp.stack([abf - 1.0, jnp.full_like(abf, 0.5), jnp.full_like(abf, 0.5)])
      kw.update(gates=(part, a_log, dt_bias), ab_dtype=bf)
    for fn in (functools.partial(gated_delta_verify, interpret=self.INTERPRET),
               gated_delta_verify_reference):
      o, s, *new_pend = fn(s0, *map(jnp.asarray, pend_all), jnp.asarray(n_pend),
                           *map(jnp.asarray, (q, k, v)), None, None, **kw)
      assert np.isfinite(np.asarray(o, np.float32)).all()
      tol = dict(atol=2e-2, rtol=2e-2) if norm else dict(atol=F32_TOL, rtol=F32_TOL)
      np.testing.assert_allclose(np.asarray(o, np.float32), np.asarray(o_want, np.float32),
                                 **tol)
      np.testing.assert_allclose(s, s_want, atol=F32_TOL, rtol=F32_TOL)
      for got, old, x in zip(new_pend, pend_all, (k, v, g, beta)):
        got = np.asarray(got)
        np.testing.assert_allclose(got[:b, :t], np.asarray(x), atol=1e-6, rtol=1e-6)
        np.testing.assert_array_equal(got[:b, t:], old[:b, t:])
        assert np.isnan(got[b:]).all()

  @pytest.mark.parametrize("t", [1, 3], ids=["decode", "k2"])
  @pytest.mark.parametrize("packed", [False, True], ids=["qkv", "packed"])
  def test_verify_normalises_raw_key_head_rows_inside(self, t, packed):
    """qk_l2norm=True: q and k come as the raw [B, T, HK, DK] key-head rows (value head h
    reads key head h // (H / HK)); the kernel L2-normalises them, scales q and stores the
    normalised k as pending. key_heads=HK: the same from the packed [q | k | v] rows (the
    model's conv output). Against the plain per-head call on the model's expanded,
    normalised q and k."""
    rng = np.random.default_rng(51 + t)
    b, p, hk, rep, dk, dv = 2, 4, 2, 3, 16, 32
    h = hk * rep
    n_pend = np.asarray([1, p], np.int32)
    pend = [jnp.asarray(x) for x in make_tokens(rng, b, p, h, dk, dv)[1:]]
    bf = jnp.bfloat16
    q = jnp.asarray(rng.standard_normal((b, t, hk, dk)), bf)
    k = jnp.asarray(rng.standard_normal((b, t, hk, dk)), bf)
    v = jnp.asarray(rng.standard_normal((b, t, h, dv)), bf).astype(jnp.float32)
    ab = jnp.asarray(rng.standard_normal((b, t, 2 * h)), bf)
    a_log = jnp.asarray(rng.standard_normal(h), jnp.float32)
    dt_bias = jnp.asarray(rng.standard_normal(h), bf)
    l2 = lambda x: x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + 1e-6)
    qx = l2(jnp.repeat(q, rep, axis=2).astype(jnp.float32)) * dk ** -0.5
    kx = l2(jnp.repeat(k, rep, axis=2).astype(jnp.float32))
    s0 = jnp.asarray(make_state(rng, b, h, dk, dv))
    kw = dict(gates=(ab, a_log, dt_bias), write_pending=True)
    want = gated_delta_verify_reference(s0, *pend, jnp.asarray(n_pend), qx, kx, v, None, None,
                                        **kw)
    for fn in (functools.partial(gated_delta_verify, interpret=self.INTERPRET),
               gated_delta_verify_reference):
      if packed:
        qkv = jnp.concatenate([q.reshape(b, t, -1), k.reshape(b, t, -1),
                               v.reshape(b, t, -1).astype(bf)], axis=-1)
        got = fn(s0, *pend, jnp.asarray(n_pend), qkv, None, None, None, None,
                 key_heads=hk, **kw)
      else:
        got = fn(s0, *pend, jnp.asarray(n_pend), q, k, v, None, None, qk_l2norm=True, **kw)
      for x, y in zip(got, want):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=F32_TOL, rtol=F32_TOL)

  def test_verify_gates_reject_g_and_beta(self):
    a = jnp.zeros((1, 1, 4), jnp.float32)
    args = _verify_args(b=1, p=1, t=1)
    with pytest.raises(ValueError, match="g = beta = None"):
      gated_delta_verify(**args, gates=(a, jnp.zeros(2), jnp.zeros(2)),
                         interpret=self.INTERPRET)
    args.update(g=None, beta=None)
    with pytest.raises(ValueError, match="holding b and a"):
      gated_delta_verify(**args, gates=(a, jnp.zeros(2), jnp.zeros(2)), gate_offset=1,
                         interpret=self.INTERPRET)


if jax.default_backend() == "gpu":

  class TestGatedDeltaCompiled(TestGatedDelta):
    INTERPRET = False


def test_chunk_reference_matches_recurrent_in_f32_and_f64_structure():
  rng = np.random.default_rng(1)
  b, t, h, dk, dv = 1, 150, 2, 16, 8
  toks = make_tokens(rng, b, t, h, dk, dv, correlated=True)
  s0 = make_state(rng, b, h, dk, dv)
  o_ref, s_ref = recurrent_gated_delta_reference(*toks, s0)
  for c in (64, 7):
    o, s = chunk_gated_delta_reference(*toks, s0, chunk_size=c)
    np.testing.assert_allclose(o, o_ref, atol=F32_TOL, rtol=F32_TOL)
    np.testing.assert_allclose(s, s_ref, atol=F32_TOL, rtol=F32_TOL)


def test_verify_state_is_updated_in_place_under_donation():
  rng = np.random.default_rng(2)
  b, p, h, dk, dv = 1, 2, 1, 16, 16
  pend = [jnp.asarray(x) for x in make_tokens(rng, b, p, h, dk, dv)[1:]]
  new = [jnp.asarray(x) for x in make_tokens(rng, b, p, h, dk, dv)]
  state = jnp.asarray(make_state(rng, b, h, dk, dv))
  step = jax.jit(functools.partial(gated_delta_verify, interpret=True),
                 donate_argnames=("state",))
  _, new_state = step(state, *pend, jnp.asarray([1], jnp.int32), *new)
  assert state.is_deleted()
  assert new_state.shape == (b, h, dk, dv)


# ---------------------------------------------------------------------------
# Input validation
# ---------------------------------------------------------------------------


def _verify_args(b=2, p=2, t=2, h=2, dk=16, dv=16):
  z = lambda *s: jnp.zeros(s, jnp.float32)
  return dict(state=z(b, h, dk, dv), pend_k=z(b, p, h, dk), pend_v=z(b, p, h, dv),
              pend_g=z(b, p, h), pend_beta=z(b, p, h), n_pend=jnp.zeros((b,), jnp.int32),
              q=z(b, t, h, dk), k=z(b, t, h, dk), v=z(b, t, h, dv), g=z(b, t, h),
              beta=z(b, t, h))


VERIFY_BAD = {
    "state_shape": (dict(state=jnp.zeros((2, 2, 16, 8))), "state must be"),
    "state_must_be_f32": (dict(state=jnp.zeros((2, 2, 16, 16), jnp.bfloat16)), "float32"),
    "q_k_same_shape": (dict(k=jnp.zeros((2, 2, 2, 8))), "same shape"),
    "g_shape": (dict(g=jnp.zeros((2, 3, 2))), "g and beta"),
    "beta_must_be_f32": (dict(beta=jnp.zeros((2, 2, 2), jnp.bfloat16)), "beta must be"),
    "pending_batch": (dict(pend_k=jnp.zeros((3, 2, 2, 16)), pend_v=jnp.zeros((3, 2, 2, 16)),
                           pend_g=jnp.zeros((3, 2, 2)), pend_beta=jnp.zeros((3, 2, 2))),
                      "batch"),
    "pending_head_dim": (dict(pend_k=jnp.zeros((2, 2, 2, 8))), "head dims"),
    "n_pend_int32": (dict(n_pend=jnp.zeros((2,), jnp.float32)), "n_pend"),
    "n_pend_shape": (dict(n_pend=jnp.zeros((3,), jnp.int32)), "n_pend"),
}


@pytest.mark.parametrize("name", sorted(VERIFY_BAD))
def test_verify_rejects(name):
  over, msg = VERIFY_BAD[name]
  a = _verify_args()
  a.update(over)
  with pytest.raises(ValueError, match=msg):
    gated_delta_verify(**a, interpret=True)


def _chunk_args(b=1, t=8, h=2, dk=16, dv=16):
  z = lambda *s: jnp.zeros(s, jnp.float32)
  return dict(q=z(b, t, h, dk), k=z(b, t, h, dk), v=z(b, t, h, dv), g=z(b, t, h),
              beta=z(b, t, h), state=z(b, h, dk, dv))


CHUNK_BAD = {
    "v_shape": (dict(v=jnp.zeros((1, 7, 2, 16))), "v must be"),
    "state_shape": (dict(state=jnp.zeros((1, 3, 16, 16))), "state must be"),
    "g_must_be_f32": (dict(g=jnp.zeros((1, 8, 2), jnp.bfloat16)), "g must be"),
}


@pytest.mark.parametrize("name", sorted(CHUNK_BAD))
def test_chunk_rejects(name):
  over, msg = CHUNK_BAD[name]
  a = _chunk_args()
  a.update(over)
  with pytest.raises(ValueError, match=msg):
    chunk_gated_delta(**a, chunk_size=16, interpret=True)


def test_chunk_compiled_needs_power_of_two_chunk():
  with pytest.raises(ValueError, match="power-of-two chunk_size"):
    jax.jit(functools.partial(chunk_gated_delta, chunk_size=24)).trace(**_chunk_args())


def test_chunk_size_should_be_positive():
  with pytest.raises(ValueError, match="chunk_size"):
    chunk_gated_delta(**_chunk_args(), chunk_size=0, interpret=True)


def test_compiled_needs_power_of_two_dv():
  a = _chunk_args()
  a.update(v=jnp.zeros((1, 8, 2, 48)), state=jnp.zeros((1, 2, 16, 48)))
  with pytest.raises(ValueError, match="power-of-two DV"):
    jax.jit(functools.partial(chunk_gated_delta, chunk_size=16)).trace(**a)


@pytest.mark.parametrize("field,value", [("block_v", 24), ("num_warps", 0),
                                         ("num_stages", 0)])
def test_tuning_rejects(field, value):
  with pytest.raises(ValueError, match=field):
    GatedDeltaTuning(**{field: value})


# ---------------------------------------------------------------------------
# Lowering for CUDA (Triton) at Qwen3.5-27B shapes (H=48, DK=DV=128)
# ---------------------------------------------------------------------------

H, DK, DV = 48, 128, 128
_sds = jax.ShapeDtypeStruct


@pytest.mark.parametrize("b,t", [(1, 256), (2, 100)], ids=["t256", "t100-ragged"])
def test_chunk_lowers_for_cuda_at_27b_shapes(b, t):
  bf, f32 = jnp.bfloat16, jnp.float32
  args = (_sds((b, t, H, DK), bf), _sds((b, t, H, DK), bf), _sds((b, t, H, DV), bf),
          _sds((b, t, H), f32), _sds((b, t, H), f32), _sds((b, H, DK, DV), f32))
  fn = jax.jit(functools.partial(chunk_gated_delta, chunk_size=64),
               donate_argnames=("state",))
  text = fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert "__gpu$xla.gpu.triton" in text and "chunk_gated_delta_c64" in text


@pytest.mark.parametrize("b,t", [(8, 4), (8, 1), (1, 8), (8, 3), (2, 5)],
                         ids=["verify-k3", "decode", "verify-k7", "verify-k2", "verify-k4"])
def test_verify_lowers_for_cuda_at_27b_shapes(b, t):
  bf, f32 = jnp.bfloat16, jnp.float32
  p = t
  args = (_sds((b, H, DK, DV), f32), _sds((b, p, H, DK), bf), _sds((b, p, H, DV), bf),
          _sds((b, p, H), f32), _sds((b, p, H), f32), _sds((b,), jnp.int32),
          _sds((b, t, H, DK), bf), _sds((b, t, H, DK), bf), _sds((b, t, H, DV), bf),
          _sds((b, t, H), f32), _sds((b, t, H), f32))
  fn = jax.jit(gated_delta_verify, donate_argnames=("state",))
  text = fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert "__gpu$xla.gpu.triton" in text and "gated_delta_verify_" in text
  assert "tf.aliasing_output" in text  # the state buffer is updated in place


@pytest.mark.parametrize("b,t", [(1, 1), (1, 5), (8, 3)], ids=["decode", "verify-k4", "verify-k2"])
def test_fused_verify_lowers_for_cuda_at_27b_shapes(b, t):
  """gates inside and the pending values written by the kernel, at the 27B's widths: state
  and pend_v both updated in place (two aliased outputs), a lane bucket of a larger cache."""
  bf, f32 = jnp.bfloat16, jnp.float32
  p, slots = 5, max(b, 2)
  args = (_sds((slots, H, DK, DV), f32), _sds((b, p, H, DK), f32), _sds((slots, p, H, DV), f32),
          _sds((b, p, H), f32), _sds((b, p, H), f32), _sds((b,), jnp.int32),
          _sds((b, t, H, DK), bf), _sds((b, t, H, DK), bf), _sds((b, t, H, DV), bf))
  proj = 2 * 16 * DK + H * DV + 2 * H       # the 27B's GDN in-projection: [qkv | z | b | a]
  gates = (_sds((b, t, proj), bf), _sds((H,), f32), _sds((H,), bf))

  def fn(state, pk, pv, pg, pb, n, q, k, v, gates):
    return gated_delta_verify(state, pk, pv, pg, pb, n, q, k, v, None, None, gates=gates,
                              gate_offset=proj - 2 * H, write_pend_v=True)

  text = jax.jit(fn, donate_argnums=(0, 2)).trace(*args, gates).lower(
      lowering_platforms=("cuda",)).as_text()
  assert "__gpu$xla.gpu.triton" in text and "gated_delta_verify_gated_pv_" in text
  assert text.count("tf.aliasing_output") == 2, "state and pend_v in place"


@pytest.mark.parametrize("b,t", [(1, 1), (1, 5), (8, 3)], ids=["decode", "verify-k4", "verify-k2"])
@pytest.mark.parametrize("l2", [False, True, "packed", "partials"],
                         ids=["", "qk-l2norm", "packed", "packed+partials"])
def test_per_head_verify_lowers_for_cuda_at_27b_shapes(b, t, l2):
  """The one-program-per-head form (every pending buffer written in place, the output norm
  inside) at the 27B's widths: five aliased outputs (state and the four pending buffers)."""
  bf, f32 = jnp.bfloat16, jnp.float32
  p, slots = 5, max(b, 2)
  args = (_sds((slots, H, DK, DV), f32), _sds((slots, p, H, DK), f32),
          _sds((slots, p, H, DV), f32), _sds((slots, p, H), f32), _sds((slots, p, H), f32),
          _sds((b,), jnp.int32), _sds((b, t, 16 if l2 else H, DK), bf),
          _sds((b, t, 16 if l2 else H, DK), bf), _sds((b, t, H, DV), bf))
  proj = 2 * 16 * DK + H * DV + 2 * H
  gates = (_sds((b, t, proj), bf), _sds((H,), f32), _sds((H,), bf))

  def fn(state, pk, pv, pg, pb, n, q, k, v, gates, w):
    kw = dict(gates=gates, gate_offset=proj - 2 * H, write_pending=True, norm_weight=w,
              norm_offset=2 * 16 * DK)
    if l2 == "packed":       # the conv output [q | k | v] as the kernel's one qkv operand
      return gated_delta_verify(state, pk, pv, pg, pb, n, gates[0][..., :2 * 16 * DK + H * DV],
                                None, None, None, None, key_heads=16, **kw)
    if l2 == "partials":     # and the in-projection as 4 f32 split-K partials
      parts = jnp.stack([gates[0].astype(f32)] * 4)
      kw["gates"] = (parts,) + gates[1:]
      return gated_delta_verify(state, pk, pv, pg, pb, n, gates[0][..., :2 * 16 * DK + H * DV],
                                None, None, None, None, key_heads=16, ab_dtype=bf, **kw)
    return gated_delta_verify(state, pk, pv, pg, pb, n, q, k, v, None, None, qk_l2norm=l2,
                              **kw)

  text = jax.jit(fn, donate_argnums=(0, 1, 2, 3, 4)).trace(
      *args, gates, _sds((DV,), bf)).lower(lowering_platforms=("cuda",)).as_text()
  assert ("gated_delta_verify_gated_pend_norm" + ("_l2" if l2 else "") + "_bv128_w8") in text
  assert text.count("tf.aliasing_output") == 5, "state and the pending buffers in place"


def test_compiled_block_v_below_16_is_rejected():
  """Triton dots need every dimension >= 16: a value block of 8 must be refused on the
  compiled path (interpret mode has no such limit)."""
  from pallas_kernels import GatedDeltaTuning
  rng = np.random.default_rng(5)
  q, k, v, g, beta = map(jnp.asarray, make_tokens(rng, 1, 4, 2, 16, 32))
  s0 = jnp.asarray(make_state(rng, 1, 2, 16, 32))
  small = GatedDeltaTuning(block_v=8, num_warps=4, num_stages=1)
  with pytest.raises(ValueError, match="block_v >= 16"):
    jax.jit(lambda *a: chunk_gated_delta(*a, tuning=small)).trace(
        q, k, v, g, beta, s0).lower(lowering_platforms=("cuda",))
  o, _ = chunk_gated_delta(q, k, v, g, beta, s0, tuning=small, interpret=True)
  assert o.shape == (1, 4, 2, 32)
