"""The gated delta rule in plain jnp: per-token recurrence, chunked (WY) form, pending replay.

Three forms side by side (spec §4), all float32:

* `recurrent_gated_delta` — the per-token recurrence of spec §4.1, the oracle.
* `chunk_gated_delta` — the chunked form of spec §4.2 (prefill): a `lax.scan` over chunks of
  64 tokens with batched matmuls inside a chunk.
* `replay_then_run` — the speculative step (verify k+1 tokens, or plain decode with k = 0).

Rollback without snapshots ("pending replay"). vLLM keeps k+1 copies of the recurrent state per
sequence and writes all of them every step; at 27B that is (k+1) x 144 MiB written per sequence
per step. We keep instead the committed state S from *before* the last verified block, plus that
block's small per-token inputs (k, v, g, beta: 48 heads x 258 floats per token per layer,
about 50 KiB per token for the 48 layers, vs 144 MiB for one state). A step then

  1. replays the first `n_pend` pending tokens (the ones the previous step accepted) onto S,
  2. runs the new block's T tokens from there, producing outputs but not storing the end state,
  3. writes back the committed state and stores the new block's inputs as the pending buffer.

The state is read once and written once per step whatever k is; rejected tokens cost nothing
(they are simply not replayed). Memory per sequence: one state + (k+1) token inputs. The
committed state lags one block behind, which is invisible to the caller: every read goes through
the replay.

State layout is HF/FLA's `[H, DK, DV]` (row = key dim).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def _step(S, k_t, v_t, g_t, beta_t):
    """One token of spec §4.1 for all (batch, head). S: [B, H, DK, DV]; k_t: [B, H, DK]."""
    S = S * jnp.exp(g_t)[..., None, None]
    pred = jnp.einsum("bhkv,bhk->bhv", S, k_t)
    u = beta_t[..., None] * (v_t - pred)
    return S + k_t[..., :, None] * u[..., None, :]


def recurrent_gated_delta(q, k, v, g, beta, state):
    """Per-token recurrence.

    Args: q, k [B, T, H, DK] (L2-normalised, q pre-scaled), v [B, T, H, DV], g, beta [B, T, H],
      state [B, H, DK, DV]; all float32.
    Returns: o [B, T, H, DV], final state [B, H, DK, DV].
    """
    def body(S, xs):
        q_t, k_t, v_t, g_t, b_t = xs
        S = _step(S, k_t, v_t, g_t, b_t)
        return S, jnp.einsum("bhkv,bhk->bhv", S, q_t)

    xs = tuple(jnp.moveaxis(a, 1, 0) for a in (q, k, v, g, beta))
    S, o = lax.scan(body, state, xs)
    return jnp.moveaxis(o, 0, 1), S


def chunk_gated_delta(q, k, v, g, beta, state, chunk_size: int = 64):
    """Chunked (WY) form of spec §4.2; same signature and result as `recurrent_gated_delta`.

    Padded tail positions get k = q = v = 0, beta = 0, g = 0, which leaves the state unchanged.
    """
    B, T, H, DK = k.shape
    DV = v.shape[-1]
    C = chunk_size
    n = -(-T // C)
    pad = n * C - T

    def prep(a):  # [B, T, H, ...] -> [n, B, H, C, ...]
        a = jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2))
        a = a.reshape((B, n, C) + a.shape[2:])
        return jnp.moveaxis(jnp.moveaxis(a, 1, 0), 3, 2)

    qc, kc, vc, gc, bc = (prep(a) for a in (q, k, v, g, beta))
    idx = jnp.arange(C)
    lower_eq = idx[:, None] >= idx[None, :]
    eye = jnp.eye(C, dtype=jnp.float32)
    hi = lax.Precision.HIGHEST

    def body(S, xs):
        q_c, k_c, v_c, g_c, b_c = xs                        # [B, H, C, D], g/b: [B, H, C]
        gam = jnp.cumsum(g_c, axis=-1)                      # [B, H, C]
        diff = jnp.where(lower_eq, gam[..., :, None] - gam[..., None, :], -jnp.inf)
        D = jnp.exp(diff)                                   # [B, H, C, C], 0 above diagonal
        kk = jnp.einsum("bhid,bhjd->bhij", k_c, k_c, precision=hi)
        A = jnp.where(idx[:, None] > idx[None, :], b_c[..., :, None] * kk * D, 0.0)
        M = eye + A
        rhs = jnp.concatenate([b_c[..., None] * v_c,
                               (b_c * jnp.exp(gam))[..., None] * k_c], axis=-1)
        sol = jax.scipy.linalg.solve_triangular(M, rhs, lower=True, unit_diagonal=True)
        U, Wk = sol[..., :DV], sol[..., DV:]
        Vnew = U - jnp.einsum("bhck,bhkv->bhcv", Wk, S, precision=hi)
        qk = jnp.einsum("bhid,bhjd->bhij", q_c, k_c, precision=hi) * D
        o = (jnp.exp(gam)[..., None] * jnp.einsum("bhck,bhkv->bhcv", q_c, S, precision=hi)
             + jnp.einsum("bhij,bhjv->bhiv", qk, Vnew, precision=hi))
        g_last = gam[..., -1:]                              # [B, H, 1]
        kw = k_c * jnp.exp(g_last - gam)[..., None]
        S = (jnp.exp(g_last)[..., None] * S
             + jnp.einsum("bhck,bhcv->bhkv", kw, Vnew, precision=hi))
        return S, o

    S, o = lax.scan(body, state, (qc, kc, vc, gc, bc))      # o: [n, B, H, C, DV]
    o = jnp.moveaxis(jnp.moveaxis(o, 0, 1), 3, 2).reshape(B, n * C, H, DV)
    return o[:, :T], S


def replay(state, pend_k, pend_v, pend_g, pend_beta, n_pend):
    """Apply the first n_pend[b] pending tokens of each lane to its committed state.

    state [B, H, DK, DV]; pend_k [B, P, H, DK]; pend_v [B, P, H, DV]; pend_g/beta [B, P, H];
    n_pend i32[B]. Slots at or beyond n_pend are skipped (they may hold anything, even NaN).
    """
    P = pend_k.shape[1]

    def body(S, xs):
        t, k_t, v_t, g_t, b_t = xs
        live = (t < n_pend)                                  # [B]
        S_new = _step(S, jnp.where(live[:, None, None], k_t, 0.0),
                      jnp.where(live[:, None, None], v_t, 0.0),
                      jnp.where(live[:, None], g_t, 0.0), jnp.where(live[:, None], b_t, 0.0))
        return jnp.where(live[:, None, None, None], S_new, S), None

    xs = (jnp.arange(P),) + tuple(jnp.moveaxis(a, 1, 0) for a in (pend_k, pend_v, pend_g, pend_beta))
    S, _ = lax.scan(body, state, xs)
    return S


def replay_then_run(state, pend_k, pend_v, pend_g, pend_beta, n_pend, q, k, v, g, beta):
    """The speculative/decode step: commit the accepted pending tokens, then run the new block.

    Returns (o [B, T, H, DV], committed state [B, H, DK, DV]); see the module docstring.
    """
    S = replay(state, pend_k, pend_v, pend_g, pend_beta, n_pend)
    o, _ = recurrent_gated_delta(q, k, v, g, beta, S)
    return o, S
