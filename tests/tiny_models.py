"""Shared tiny random models for engine tests.

VOCAB11: a vocabulary of 11 makes random-weight MTP drafts land often enough that the
accept, rollback and redraft paths all run.
"""

import jax

from mtpjax.config import Config
from mtpjax.params import init_params
from mtpjax.sampling import SamplingParams

VOCAB11_CFG = Config(
    vocab_size=11, hidden_size=32, intermediate_size=40,
    layer_types=("linear_attention", "linear_attention", "full_attention"),
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=10000.0,
    partial_rotary_factor=0.5, linear_num_key_heads=2, linear_num_value_heads=4,
    linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
    tie_word_embeddings=False, mtp_num_hidden_layers=1)
VOCAB11_PARAMS = init_params(VOCAB11_CFG, jax.random.key(1), "float32", scale=0.3)

# For tensor parallelism (tests/test_mesh.py, tests/test_multihost.py): 8 q heads, 2 KV heads
# (replicated for tp 4, 8), 2 GDN key heads (replicated for tp 4, 8), 8 GDN value heads,
# intermediate 48, and a vocabulary of 13 that no tp divides (padding).
TP_CFG = Config(
    vocab_size=13, hidden_size=32, intermediate_size=48,
    layer_types=("linear_attention", "linear_attention", "full_attention"),
    num_attention_heads=8, num_key_value_heads=2, head_dim=16, rope_theta=10000.0,
    partial_rotary_factor=0.5, linear_num_key_heads=2, linear_num_value_heads=8,
    linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
    tie_word_embeddings=False, mtp_num_hidden_layers=1)
TP_PARAMS = init_params(TP_CFG, jax.random.key(7), "float32", scale=0.3)
TP_PROMPTS = [[1, 2, 3, 4, 5], [3, 4, 5, 6, 7, 8, 9, 10, 11], [7, 7, 7], [12, 0, 5, 9]]
TP_SAMPLING = [SamplingParams(max_new_tokens=14),
               SamplingParams(max_new_tokens=14, temperature=1.0, seed=3),
               SamplingParams(max_new_tokens=14, temperature=0.8, top_k=5, top_p=0.9, seed=11),
               SamplingParams(max_new_tokens=14, temperature=1.3, top_p=0.7, seed=5)]
TP_ENGINE_KW = dict(max_lanes=2, max_seq_len=64, prefill_chunk=16, prefill_buckets=[16])


def assert_drafts_accepted_and_rejected(outputs, past: int = 1) -> dict:
    """A spec == plain test proves something only where the verify path both accepted and
    rejected drafts, and accepted some past draft position `past` (the 1-based positions after
    the first: the rollback of a partly accepted block and the replay of several pending
    tokens). Sums each output's RequestStats; returns the totals for the caller's message."""
    acc, tried = [], []
    for o in outputs:
        for j, (a, t) in enumerate(zip(o.stats.accepted_per_position,
                                       o.stats.tried_per_position)):
            if j >= len(acc):
                acc.append(0)
                tried.append(0)
            acc[j] += a
            tried[j] += t
    totals = {"accepted_per_position": acc, "tried_per_position": tried}
    assert sum(acc) > 0, f"no draft was accepted: {totals}"
    assert sum(tried) > sum(acc), f"no draft was rejected: {totals}"
    assert sum(acc[past:]) > 0, f"no draft accepted past position {past}: {totals}"
    return totals
