"""The gated delta rule as the model calls it: prefill (chunked) and step (pending replay).

The math lives once, in `pallas_kernels.gated_delta`: each Triton kernel beside its plain-jnp
reference (per-token recurrence, chunked WY form of spec §4.2, and the verify step). This module
picks the implementation (`kernels` = "reference" | "pallas" | "interpret") and documents the
rollback scheme the step implements.

Rollback without snapshots ("pending replay"). vLLM keeps k+1 copies of the recurrent state per
sequence and writes all of them every step. We keep instead the committed state S from *before*
the last verified block, plus that block's small per-token inputs (k, v, g, beta, float32). A
step then

  1. replays the first `n_pend` pending tokens (the ones the previous step accepted) onto S,
  2. runs the new block's T = k+1 tokens from there, producing outputs but not storing the end
     state,
  3. writes back the committed state and stores the new block's inputs as the pending buffer.

The state is read once and written once per step whatever k is; rejected tokens cost nothing
(they are simply not replayed). The committed state lags one block behind, which is invisible
to the caller: every read goes through the replay. The conv window works the same way: the
cache keeps KC-1+P raw inputs and the next block reads its KC-1 rows of history at offset n_pend.

Cost for Qwen3.5-27B (48 GDN layers, 48 value heads, DK = DV = 128), per sequence:

| | vLLM per-token slots | pending replay (this) |
|---|---|---|
| state memory | (k+1) x 144 MiB | 144 MiB + (k+1) x 2.27 MiB pending inputs |
| state bytes per step, k=1 | read 144 + write 288 = 432 MiB | read 144 + write 144 + 2 x 4.5 = 297 MiB |
| state bytes per step, k=3 | read 144 + write 576 = 720 MiB | 288 + 2 x 9.1 = 306 MiB |
| extra compute | none | replay of <= k+1 recurrent token updates (~0.26 GFLOP each) |

(pending inputs per token: 48 layers x 48 heads x (128 + 128 + 2) x 4 B = 2.27 MiB.) The
kernel and its naive "one snapshot per token" oracle are compared in
tests/test_kernel_gated_delta.py; the model-level rollback in tests/test_cache_paths.py.

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
         kernels: str = "reference", live=None, gates=None, gate_offset: int = 0,
         write_pend_v: bool = False, **fused):
    """Replay the n_pend accepted pending tokens, run the new block; (o, committed state).

    state may hold more lane slots than the block's B lanes (the first B are used); live
    bool[B] marks the lanes that run (the kernel neither reads nor writes an idle lane's state).
    gates = (ab, A_log, dt_bias) with g = beta = None: g and beta computed inside the call
    from b = ab[..., o:o+H], a = ab[..., o+H:o+2H], o = gate_offset;
    write_pend_v: pend_v (lane slots >= B allowed) comes back as a third result with the new
    block's v in its first T slots; `fused` (write_pending, norm_weight, norm_offset,
    norm_eps): every pending buffer written and the output norm applied inside (see
    pallas_kernels.gated_delta_verify).
    """
    fn = pk.gated_delta_verify_reference if kernels == "reference" else pk.gated_delta_verify
    extra = {} if kernels == "reference" else {"interpret": kernels == "interpret"}
    return fn(state, pend_k, pend_v, pend_g, pend_beta, n_pend, q, k, v, g, beta, live=live,
              gates=gates, gate_offset=gate_offset, write_pend_v=write_pend_v, **fused, **extra)
