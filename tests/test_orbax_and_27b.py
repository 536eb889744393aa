"""Orbax round trip of converted params, the `convert` command, and a weight-free 27B check."""

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np

import hf_fixtures as hx
import mtpjax
from mtpjax import model
from mtpjax.params import abstract_params, count_params


def test_orbax_round_trip_is_exact(tmp_path):
    src = str(tmp_path / "hf")
    hx.write_checkpoint(src, seed=6, tie_word_embeddings=True)
    cfg, params = mtpjax.load_checkpoint(src, dtype="bfloat16")
    out = str(tmp_path / "converted")
    r = subprocess.run([sys.executable, "-m", "experiments", "convert", f"--checkpoint={src}",
                        f"--out={out}", "--dtype=bfloat16"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    cfg2, params2 = mtpjax.load_checkpoint(out, dtype="bfloat16")
    assert cfg2 == cfg
    assert params2.lm_head is None and params2.embed.dtype == jnp.bfloat16
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                 params, params2)
    assert jax.tree.structure(params) == jax.tree.structure(params2)


def test_qwen3_5_27b_shapes_and_parameter_counts():
    cfg = mtpjax.qwen3_5_27b()
    abstract = abstract_params(cfg, "bfloat16")
    total, mtp = count_params(abstract), count_params(abstract.mtp)
    assert total - mtp == 26_895_998_464          # spec §2.5: 26.90 B text
    assert mtp == 424_699_392                     # 0.42 B MTP
    assert cfg.num_linear_layers == 48 and cfg.full_layer_ids[:2] == (3, 7)
    assert cfg.layer_period == 4

    B, T = 1, 8
    cache = jax.eval_shape(lambda: model.init_cache(cfg, B, 64, 2, "bfloat16"))

    def fwd(params, cache, tokens):
        seg = model.Segment(jnp.zeros(B, jnp.int32), jnp.full(B, T, jnp.int32))
        h, cache = model.forward(cfg, params, cache, tokens, seg, "chunk")
        hm, cache = model.mtp_forward(cfg, params, cache, h, tokens, seg)
        return model.lm_head(params, h[:, -1]), model.lm_head(params, hm[:, -1]), cache

    tokens = jax.ShapeDtypeStruct((B, T), jnp.int32)
    logits, mlogits, new_cache = jax.eval_shape(fwd, abstract, cache, tokens)
    assert logits.shape == (B, 248320) and logits.dtype == jnp.float32
    assert mlogits.shape == (B, 248320)
    assert [c.state.shape for c in new_cache.gdn] == [(B, 48, 128, 128)] * 48
    assert all(c.state.dtype == jnp.float32 for c in new_cache.gdn)
    assert [kv.k.shape for kv in new_cache.kv] == [(B, 64, 4, 256)] * 17   # 16 layers + MTP
    # 144 MiB of recurrent state per sequence (spec §9)
    assert sum(c.state.size for c in new_cache.gdn) * 4 // B == 144 * 2 ** 20
