"""The gated delta rule as the model calls it: prefill (chunked) and step (pending replay).

The math lives once, in `pallas_kernels.gated_delta`: each Triton kernel beside its plain-jnp
reference (per-token recurrence, chunked WY form of spec §4.2, and the verify step). This module
picks the implementation (`kernels` = "reference" | "pallas" | "interpret") and documents the
rollback scheme the step implements.

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

import pallas_kernels as pk

KERNELS = ("reference", "pallas", "interpret")


def check_kernels(kernels: str) -> None:
    if kernels not in KERNELS:
        raise ValueError(f"kernels must be one of {KERNELS}, got {kernels!r}")


def prefill(q, k, v, g, beta, state, kernels: str = "reference"):
    """Chunked delta rule from `state` (no pending tokens); returns (o, end state).

    q, k [B, T, H, DK]; v [B, T, H, DV]; g, beta [B, T, H]; state [B, H, DK, DV] float32.
    """
    if kernels == "reference":
        return pk.chunk_gated_delta_reference(q, k, v, g, beta, state)
    return pk.chunk_gated_delta(q, k, v, g, beta, state, interpret=kernels == "interpret")


def step(state, pend_k, pend_v, pend_g, pend_beta, n_pend, q, k, v, g, beta,
         kernels: str = "reference"):
    """Replay the n_pend accepted pending tokens, run the new block; (o, committed state)."""
    fn = pk.gated_delta_verify_reference if kernels == "reference" else pk.gated_delta_verify
    extra = {} if kernels == "reference" else {"interpret": kernels == "interpret"}
    return fn(state, pend_k, pend_v, pend_g, pend_beta, n_pend, q, k, v, g, beta, **extra)
