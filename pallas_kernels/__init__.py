"""Pallas kernels (Triton backend) for the Qwen3.5 inference engine.

Each kernel module holds the kernel body, a jitted wrapper that validates its
inputs with ``ValueError``s, and a plain-jnp ``*_reference`` with the same
signature. Tuning knobs live in :mod:`pallas_kernels.tuned_block_sizes`.
"""

from pallas_kernels.fp8_matmul import fp8_matmul, fp8_matmul_reference
from pallas_kernels.gated_delta import (
    chunk_gated_delta,
    chunk_gated_delta_reference,
    gate_values,
    gated_delta_verify,
    gated_delta_verify_reference,
    recurrent_gated_delta_reference,
)
from pallas_kernels.paged_attention import (
    paged_attention,
    paged_attention_gated,
    paged_attention_gated_reference,
    paged_attention_reference,
    query_rows,
    validate_paged_inputs_dynamic,
    write_kv,
    write_kv_reference,
)
from pallas_kernels.page_copy import copy_page, copy_page_reference
from pallas_kernels.qk_norm_rope import (
    MAX_TOKENS as QK_MAX_TOKENS,
    fits as qk_norm_rope_fits,
    qk_norm_rope_write,
    qk_norm_rope_write_reference,
)
from pallas_kernels.rmsnorm import add_rmsnorm, add_rmsnorm_reference
from pallas_kernels.tuned_block_sizes import (
    FP8_MATMUL_TABLE,
    GATED_DELTA_TABLE,
    PAGED_ATTENTION_TABLE,
    Fp8MatmulTuning,
    GatedDeltaTuning,
    PagedAttentionTuning,
    get_fp8_matmul_tuning,
    get_gated_delta_tuning,
    get_paged_attention_tuning,
)

__all__ = [
    "add_rmsnorm",
    "add_rmsnorm_reference",
    "FP8_MATMUL_TABLE",
    "GATED_DELTA_TABLE",
    "PAGED_ATTENTION_TABLE",
    "Fp8MatmulTuning",
    "GatedDeltaTuning",
    "PagedAttentionTuning",
    "chunk_gated_delta",
    "chunk_gated_delta_reference",
    "fp8_matmul",
    "fp8_matmul_reference",
    "gate_values",
    "gated_delta_verify",
    "gated_delta_verify_reference",
    "get_fp8_matmul_tuning",
    "get_gated_delta_tuning",
    "get_paged_attention_tuning",
    "paged_attention",
    "paged_attention_gated",
    "paged_attention_gated_reference",
    "paged_attention_reference",
    "qk_norm_rope_fits",
    "qk_norm_rope_write",
    "qk_norm_rope_write_reference",
    "query_rows",
    "QK_MAX_TOKENS",
    "recurrent_gated_delta_reference",
    "validate_paged_inputs_dynamic",
    "write_kv",
    "write_kv_reference",
]
