"""Parity with transformers' Qwen3_5ForCausalLM (torch reference kernels) on tiny random configs.

Each case is written by `save_pretrained`, loaded by our loader and compared in float32 on
sequences that cross the 64-token GDN chunk. Every parameter is perturbed from its init.
"""

import numpy as np
import pytest

import hf_fixtures as hx
import mtpjax

CASES = {
    # name: (config overrides, batch, seq)
    "base_70": (dict(), 2, 70),
    "tied_gqa4_130": (dict(tie_word_embeddings=True, num_attention_heads=8, num_key_value_heads=2,
                           head_dim=8), 1, 130),
    "mha_vheads3x_65": (dict(num_attention_heads=2, num_key_value_heads=2, linear_num_key_heads=1,
                             linear_num_value_heads=3, hidden_size=24), 3, 65),
    "eight_layers_pattern": (dict(num_hidden_layers=8,
                                  layer_types=["linear_attention", "full_attention"] * 4), 2, 40),
    "irregular_layers": (dict(num_hidden_layers=5,
                              layer_types=["full_attention", "linear_attention", "linear_attention",
                                           "full_attention", "linear_attention"]), 1, 67),
}


@pytest.mark.parametrize("name", list(CASES))
def test_logits_match_transformers(tmp_path, name):
    overrides, batch, seq = CASES[name]
    m, _ = hx.write_checkpoint(str(tmp_path), seed=len(name), **overrides)
    cfg, params = mtpjax.load_checkpoint(str(tmp_path), dtype="float32")
    tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, (batch, seq))
    ref = hx.hf_logits(m, tokens)
    out = np.asarray(mtpjax.forward_logits(cfg, params, tokens))
    assert out.shape == ref.shape and out.dtype == np.float32
    scale = np.abs(ref).max()
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-4 * scale)


def test_parity_is_sensitive_to_the_one_plus_norm(tmp_path):
    """The check above can fail: dropping `1+` from one norm weight moves logits far past 1e-4."""
    import dataclasses
    m, _ = hx.write_checkpoint(str(tmp_path), seed=3)
    cfg, params = mtpjax.load_checkpoint(str(tmp_path))
    tokens = np.random.default_rng(2).integers(0, cfg.vocab_size, (1, 20))
    ref = hx.hf_logits(m, tokens)
    broken = dataclasses.replace(params, final_norm=params.final_norm - 1.0)  # x*(w) not x*(1+w)
    out = np.asarray(mtpjax.forward_logits(cfg, broken, tokens))
    assert np.abs(out - ref).max() > 1e-2 * np.abs(ref).max()
