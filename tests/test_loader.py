"""Checkpoint loading: layouts, shards, dtypes, and a clear error for each bad checkpoint."""

import json
import os

import jax
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import hf_fixtures as hx
import mtpjax
from checkpoints import CheckpointError
from mtpjax.config import ConfigError


def _all_tensors(path):
    out = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(path, f)))
    return out


def _rewrite(path, tensors, config=None, shards=2):
    for f in os.listdir(path):
        if f.endswith(".safetensors") or f.endswith(".index.json"):
            os.remove(os.path.join(path, f))
    names = sorted(tensors)
    weight_map = {}
    for i in range(shards):
        part = {n: tensors[n] for n in names[i::shards]}
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file(part, os.path.join(path, fname))
        weight_map.update({n: fname for n in part})
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    if config is not None:
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(config, f)


@pytest.fixture
def ckpt(tmp_path):
    m, _ = hx.write_checkpoint(str(tmp_path), seed=5)
    return str(tmp_path), m


def _wrapper_config(path):
    with open(os.path.join(path, "config.json")) as f:
        text = json.load(f)
    return {"model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"],
            "tie_word_embeddings": text["tie_word_embeddings"], "text_config": text,
            "vision_config": {"depth": 1}, "eos_token_id": 3}


def test_multimodal_layout_sharded_mixed_dtypes_and_vision_ignored(ckpt, tmp_path_factory):
    path, m = ckpt
    cfg0, _ = mtpjax.load_checkpoint(path)
    t = _all_tensors(path)
    # mixed storage: matrices in BF16, 1-D tensors (A_log, norms) in F32, as real checkpoints
    t = {n: (a.astype(ml_dtypes.bfloat16) if a.ndim >= 2 else a) for n, a in t.items()}
    # the same values, upcast, in the text-only layout: the expected result
    plain = str(tmp_path_factory.mktemp("plain"))
    for f in ("config.json",):
        with open(os.path.join(path, f)) as src, open(os.path.join(plain, f), "w") as dst:
            dst.write(src.read())
    _rewrite(plain, {n: a.astype(np.float32) for n, a in t.items()}, shards=1)
    wrapped = {("model.language_model." + n[len("model."):] if n.startswith("model.") else n): a
               for n, a in t.items()}
    wrapped["model.visual.blocks.0.attn.qkv.weight"] = np.ones((3, 3), np.float32)
    wrapped["model.visual.merger.weight"] = np.ones((2,), ml_dtypes.bfloat16)
    _rewrite(path, wrapped, _wrapper_config(path), shards=3)

    cfg, params = mtpjax.load_checkpoint(path, dtype="float32")
    cfg_p, params_p = mtpjax.load_checkpoint(plain, dtype="float32")
    assert cfg.layer_types == cfg0.layer_types and cfg.eos_token_ids == (3,)
    assert params.embed.dtype == np.float32
    jax.tree.map(np.testing.assert_array_equal, params, params_p)
    tokens = np.random.default_rng(0).integers(0, 97, (1, 30))
    np.testing.assert_array_equal(mtpjax.forward_logits(cfg, params, tokens),
                                  mtpjax.forward_logits(cfg_p, params_p, tokens))
    _, params_b = mtpjax.load_checkpoint(path, dtype="bfloat16")
    assert params_b.embed.dtype == jax.numpy.bfloat16
    assert params_b.layers[0].gdn.A_log.dtype == np.float32  # decay rate stays float32
    np.testing.assert_array_equal(np.asarray(params_b.mtp.fc.astype(np.float32)),
                                  np.asarray(params.mtp.fc))


def _mutate(path, fn):
    t = _all_tensors(path)
    fn(t)
    _rewrite(path, t)


def test_missing_tensor_is_named(ckpt):
    path, _ = ckpt
    _mutate(path, lambda t: t.pop("model.layers.2.linear_attn.A_log"))
    with pytest.raises(CheckpointError, match=r"missing tensor 'layers\.2\.linear_attn\.A_log'"):
        mtpjax.load_checkpoint(path)


def test_missing_mtp_tensor_is_named(ckpt):
    path, _ = ckpt
    _mutate(path, lambda t: t.pop("mtp.fc.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensor 'mtp\.fc\.weight'"):
        mtpjax.load_checkpoint(path)


def test_unknown_tensor_is_named(ckpt):
    path, _ = ckpt
    _mutate(path, lambda t: t.__setitem__("model.layers.0.mlp.extra_bias", np.zeros(3, np.float32)))
    with pytest.raises(CheckpointError, match=r"unknown tensor 'model\.layers\.0\.mlp\.extra_bias'"):
        mtpjax.load_checkpoint(path)


def test_misshapen_tensor_is_named(ckpt):
    path, _ = ckpt
    def f(t):
        t["model.layers.3.self_attn.q_proj.weight"] = t["model.layers.3.self_attn.q_proj.weight"][:-1]
    _mutate(path, f)
    with pytest.raises(CheckpointError, match=r"tensor 'model\.layers\.3\.self_attn\.q_proj\.weight': shape"):
        mtpjax.load_checkpoint(path)


def test_missing_shard_file_is_named(ckpt):
    path, _ = ckpt
    os.remove(os.path.join(path, "mtp.safetensors"))
    with pytest.raises(CheckpointError, match="shard file 'mtp.safetensors'"):
        mtpjax.load_checkpoint(path)


@pytest.mark.parametrize("edit,match", [
    (lambda c: c.update(model_type="llama"), "model_type"),
    (lambda c: c.update(num_key_value_heads=3), "num_key_value_heads"),
    (lambda c: c.update(layer_types=["linear_attention"] * 3), "layer_types"),
    (lambda c: c.update(layer_types=["sliding_attention"] * 4), "layer_types"),
    (lambda c: c.update(hidden_size=-4), "hidden_size"),
    (lambda c: c.pop("vocab_size"), "vocab_size"),
    (lambda c: c.update(linear_num_value_heads=3), "linear_num_value_heads"),
    (lambda c: c.update(rope_parameters={"rope_type": "yarn", "factor": 4.0}), "rope_type"),
    (lambda c: c.update(hidden_act="gelu"), "hidden_act"),
    (lambda c: c.update(mtp_num_hidden_layers=2), "mtp_num_hidden_layers"),
])
def test_bad_config_names_the_key(ckpt, edit, match):
    path, _ = ckpt
    with open(os.path.join(path, "config.json")) as f:
        c = json.load(f)
    edit(c)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(c, f)
    with pytest.raises(ConfigError, match=match):
        mtpjax.load_checkpoint(path)


def test_bad_dtype_and_tokens_are_rejected(ckpt):
    path, _ = ckpt
    with pytest.raises(ValueError, match="dtype"):
        mtpjax.load_checkpoint(path, dtype="float16")
    cfg, params = mtpjax.load_checkpoint(path)
    with pytest.raises(ValueError, match="token_ids"):
        mtpjax.forward_logits(cfg, params, np.zeros((3,), np.int32))
    with pytest.raises(ValueError, match="at least 2"):
        mtpjax.mtp_logits(cfg, params, np.zeros((1, 1), np.int32))


def test_loaded_params_do_not_alias_the_checkpoint_file(tmp_path, monkeypatch):
    """The reader memory-maps the file, and jax.device_put on the CPU backend aliases a numpy
    buffer it can (an aligned one) instead of copying it: a leaf built from a mapped view
    would change when the file changes and outlive nothing but the mapping. Every host array
    the loader places must own its memory, and overwriting the file after loading must leave
    the params as loaded."""
    import gc
    import mmap
    from mtpjax import tensor_parallel

    def mapped(a):
        while a is not None:
            if isinstance(a, (np.memmap, mmap.mmap)):
                return True
            a = getattr(a, "base", None)
        return False

    placed = []
    real = tensor_parallel.place_leaf
    monkeypatch.setattr(tensor_parallel, "place_leaf",
                        lambda cfg, mesh, path, host: placed.append(mapped(host)) or
                        real(cfg, mesh, path, host))
    path = str(tmp_path / "ckpt")
    hx.write_checkpoint(path, seed=3)
    cfg, params = mtpjax.load_checkpoint(path, "float32")
    assert placed and not any(placed), f"{sum(placed)} of {len(placed)} leaves are mapped views"
    before = [np.array(x) for x in jax.tree.leaves(params)]
    for name in os.listdir(path):
        if name.endswith(".safetensors"):
            f = os.path.join(path, name)
            size = os.path.getsize(f)
            with open(f, "r+b") as fh:
                fh.seek(size // 2)
                fh.write(b"\x7f" * (size - size // 2))
    gc.collect()
    for a, b in zip(before, [np.array(x) for x in jax.tree.leaves(params)]):
        np.testing.assert_array_equal(a, b)
