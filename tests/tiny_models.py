"""Shared tiny random models for engine tests.

VOCAB11: a vocabulary of 11 makes random-weight MTP drafts land often enough that the
accept, rollback and redraft paths all run.
"""

import jax

from mtpjax.config import Config
from mtpjax.params import init_params

VOCAB11_CFG = Config(
    vocab_size=11, hidden_size=32, intermediate_size=40,
    layer_types=("linear_attention", "linear_attention", "full_attention"),
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=10000.0,
    partial_rotary_factor=0.5, linear_num_key_heads=2, linear_num_value_heads=4,
    linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
    tie_word_embeddings=False, mtp_num_hidden_layers=1)
VOCAB11_PARAMS = init_params(VOCAB11_CFG, jax.random.key(1), "float32", scale=0.3)
