"""FP8 weights: both checkpoint layouts, quantization at load time, parity with a float64
reference that dequantizes the stored FP8 tensors, speculation exactness, and clear errors.

The reference side is independent of the loader: the stored FP8 tensors are read back with
torch's safetensors reader (torch has float8_e4m3fn) and dequantized here, block by block, in
float64; target logits come from transformers' own model in float64 with those weights, MTP
logits from the float64 numpy MTP of test_mtp_reference.
"""

import dataclasses
import json
import os

import jax
import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.numpy import save_file

import hf_fixtures as hx
import mtpjax
from checkpoints.hf_loader import CheckpointError, load_params, quantize_params
from checkpoints.hf_writer import save_hf_checkpoint
from mtpjax import quant
from mtpjax.engine import Engine
from mtpjax.sampling import SamplingParams
from mtpjax.tensor_parallel import ShardingError
from test_mtp_reference import mtp_reference
from tiny_models import (TP_CFG, TP_PARAMS, VOCAB11_CFG, VOCAB11_PARAMS,
                         assert_drafts_accepted_and_rejected)

# Odd sizes: hidden 136 and intermediate 200 leave partial 128-blocks on both axes; the k/v
# projections (64 rows) end inside a block, so the fused qkv leaf gets per-row scales while
# the GDN [qkv | z] (256 + 128 rows) keeps 128 x 128 blocks.
ODD = dict(hidden_size=136, intermediate_size=200, num_attention_heads=2, num_key_value_heads=1,
           head_dim=64, linear_num_key_heads=2, linear_key_head_dim=32,
           linear_num_value_heads=4, linear_value_head_dim=32)
SCHEMES = {"qwen": quant.QWEN_FP8, "compressed": quant.COMPRESSED_FP8_DYNAMIC}


def _fp8_checkpoint(tmp_path, scheme, quantize_mtp=True, scale_dtype="float32", seed=5, **over):
    """A transformers-written dense checkpoint and an FP8 copy of it (our writer)."""
    dense = str(tmp_path / "dense")
    m, _ = hx.write_checkpoint(dense, seed=seed, **over)
    cfg, params = mtpjax.load_checkpoint(dense)
    fp8 = str(tmp_path / "fp8")
    save_hf_checkpoint(fp8, cfg, params, "float32", layout="text", quantization=scheme,
                       quantize_mtp=quantize_mtp, scale_dtype=scale_dtype)
    return m, cfg, dense, fp8


def _dequantized_state(path: str, scheme) -> dict[str, np.ndarray]:
    """Every tensor of an FP8 checkpoint as float64, FP8 ones times their expanded scale."""
    out = {}
    with safe_open(os.path.join(path, "model.safetensors"), framework="pt") as f:
        raw = {k: f.get_tensor(k) for k in f.keys()}
    for name, t in raw.items():
        if name.endswith(scheme.scale_suffix):
            continue
        w = t.to(torch.float64).numpy()
        if t.dtype == torch.float8_e4m3fn:
            s = raw[name[:-len("weight")] + scheme.scale_suffix].to(torch.float64).numpy()
            rb, cb = (128, 128) if scheme.method == "fp8" else (1, w.shape[1])  # as documented
            w = w * np.kron(s, np.ones((rb, cb)))[:w.shape[0], :w.shape[1]]
        out[name] = w
    return out


@pytest.mark.parametrize("case", ["qwen_tiny", "qwen_odd", "compressed_odd", "qwen_odd_bf16_scales"])
def test_fp8_logits_match_float64_dequantized_reference(tmp_path, case):
    scheme = SCHEMES[case.split("_")[0]]
    over = ODD if "odd" in case else {}
    scale_dtype = "bfloat16" if "bf16" in case else "float32"
    m, cfg, _, fp8 = _fp8_checkpoint(tmp_path, scheme, scale_dtype=scale_dtype, **over)
    cfg2, params = mtpjax.load_checkpoint(fp8)                  # weights="auto": stays FP8
    assert isinstance(params.layers[0].mlp.gate_up, quant.Fp8Weight)
    assert isinstance(params.mtp.fc, quant.Fp8Weight)
    assert not isinstance(params.layers[0].gdn.in_proj_ba, quant.Fp8Weight)
    sd = _dequantized_state(fp8, scheme)
    ref_model = m.double()
    ref_model.load_state_dict({k: torch.from_numpy(v) for k, v in sd.items()
                               if not k.startswith("mtp.")}, strict=True)
    tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 70))
    with torch.no_grad():
        out_ref = ref_model(torch.tensor(tokens)).logits.numpy()
        hid = ref_model.model(torch.tensor(tokens)).last_hidden_state.numpy()
    out = np.asarray(mtpjax.forward_logits(cfg2, params, tokens))
    np.testing.assert_allclose(out, out_ref, rtol=1e-4, atol=1e-4 * np.abs(out_ref).max())
    mtp = np.asarray(mtpjax.mtp_logits(cfg2, params, tokens))
    w = {k: v for k, v in sd.items() if k.startswith("mtp.")}
    for b in range(2):
        ref = mtp_reference(w, sd["model.embed_tokens.weight"], sd["lm_head.weight"], hid[b],
                            tokens[b], cfg)
        np.testing.assert_allclose(mtp[b], ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())


def test_fp8_parity_check_can_fail(tmp_path):
    """The comparison above is sensitive: using the undequantized (dense) weights of the
    original model instead of the FP8 ones misses by far more than its tolerance."""
    m, cfg, dense, fp8 = _fp8_checkpoint(tmp_path, quant.QWEN_FP8, **ODD)
    _, params = mtpjax.load_checkpoint(fp8)
    tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, (1, 30))
    out = np.asarray(mtpjax.forward_logits(cfg, params, tokens))
    dense_ref = hx.hf_logits(m, tokens)
    assert np.abs(out - dense_ref).max() > 1e-3 * np.abs(dense_ref).max()


def _leaves(tree):
    return [np.asarray(x).astype(np.float32) for x in jax.tree.leaves(tree)]


def test_quantize_at_load_equals_stored_fp8(tmp_path):
    """weights="fp8" on a dense checkpoint gives bit for bit the leaves of the Qwen-layout FP8
    checkpoint our writer makes from it (the same per-tensor 128 x 128 quantization)."""
    _, cfg, dense, fp8 = _fp8_checkpoint(tmp_path, quant.QWEN_FP8, quantize_mtp=False, **ODD)
    _, a = mtpjax.load_checkpoint(dense, weights="fp8")
    _, b = mtpjax.load_checkpoint(fp8)
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(_leaves(a), _leaves(b)):
        np.testing.assert_array_equal(x, y)
    assert not isinstance(a.mtp.fc, quant.Fp8Weight)          # default: the MTP head stays dense
    assert a.layers[0].gdn.in_proj.block == (128, 128)
    assert a.layers[3].attn.qkv.block == (1, 128)             # k/v end inside a block row
    _, c = mtpjax.load_checkpoint(dense, weights="fp8", mtp_weights="fp8")
    assert isinstance(c.mtp.fc, quant.Fp8Weight)
    _, d = mtpjax.load_checkpoint(fp8, weights="dense")
    assert not quant.has_fp8(d)
    # an FP8 weight holds what it replaces to within e4m3's half-ulp (2^-4 relative)
    w = quant.dequantize(np.asarray(a.layers[0].mlp.gate_up.q), np.asarray(
        a.layers[0].mlp.gate_up.scale), a.layers[0].mlp.gate_up.block)
    _, e = mtpjax.load_checkpoint(dense)
    orig = np.asarray(e.layers[0].mlp.gate_up, np.float64)
    assert np.abs(w - orig).max() <= 2 ** -4 * np.abs(orig).max()


@pytest.mark.parametrize("scheme", ["qwen", "compressed"])
def test_fp8_wrapper_layout_loads_like_text_layout(tmp_path, scheme):
    """The multimodal wrapper layout (model.language_model.*, config under text_config, the
    quantization_config at the top) loads to the same FP8 leaves as the text-only layout."""
    trees = []
    for layout in ("wrapper", "text"):
        path = str(tmp_path / layout)
        save_hf_checkpoint(path, VOCAB11_CFG, VOCAB11_PARAMS, "float32", layout=layout,
                           quantization=SCHEMES[scheme], quantize_mtp=True)
        trees.append(mtpjax.load_checkpoint(path)[1])
    assert quant.has_fp8(trees[0])
    assert jax.tree.structure(trees[0]) == jax.tree.structure(trees[1])
    for x, y in zip(_leaves(trees[0]), _leaves(trees[1])):
        np.testing.assert_array_equal(x, y)


def test_fp8_checkpoint_bytes_and_config(tmp_path):
    """The writer's FP8 file: float8 weights, their scales, the config naming what is dense."""
    _, cfg, _, fp8 = _fp8_checkpoint(tmp_path, quant.QWEN_FP8, quantize_mtp=False)
    with open(os.path.join(fp8, "config.json")) as f:
        qc = json.load(f)["quantization_config"]
    assert qc["quant_method"] == "fp8" and qc["weight_block_size"] == [128, 128]
    assert "model.layers.0.linear_attn.in_proj_a" in qc["modules_to_not_convert"]
    assert "mtp.fc" in qc["modules_to_not_convert"]
    assert not any("down_proj" in n for n in qc["modules_to_not_convert"] if not n.startswith("mtp."))
    with safe_open(os.path.join(fp8, "model.safetensors"), framework="pt") as f:
        assert f.get_tensor("model.layers.0.mlp.down_proj.weight").dtype == torch.float8_e4m3fn
        assert f.get_tensor("model.layers.0.linear_attn.in_proj_b.weight").dtype == torch.float32
        assert f.get_tensor("mtp.fc.weight").dtype == torch.float32
        s = f.get_tensor("model.layers.0.mlp.down_proj.weight_scale_inv")
        assert tuple(s.shape) == (1, 1)


# One FP8 tree and engine shape for the plain engines of this module (speculative and data
# parallel tests): they share their compiled programs.
FP8_KW = dict(max_lanes=2, max_seq_len=64, prefill_chunk=16)


def test_speculative_equals_plain_with_fp8():
    """Greedy and seeded sampling, FP8 target and FP8 head: k = 3 with the jnp FP8 matmul (two
    lanes), k = 2 with the Pallas kernel in interpret mode (one lane: one decode program, the
    costly interpret-mode compile, instead of one per lane bucket), all equal to plain
    decoding. (k = 1 ran here too, with a program set of its own to compile: its one draft
    is the first of k = 3's chain, through the same FP8 head and target matmuls.)"""
    qp = quantize_params(VOCAB11_CFG, VOCAB11_PARAMS, "fp8", "fp8")
    prompts = [[1, 2, 3, 4, 5], [3, 4, 5, 6, 7, 8, 9, 10], [7, 7, 7]]
    sp = [SamplingParams(max_new_tokens=12), SamplingParams(max_new_tokens=12, temperature=1.0,
                                                            seed=3),
          SamplingParams(max_new_tokens=12, temperature=0.8, top_k=5, top_p=0.9, seed=1)]
    kw = FP8_KW
    outs = lambda params, k, kernels="reference", lanes=2: Engine(
        VOCAB11_CFG, params, num_speculative_tokens=k, kernels=kernels,
        **dict(kw, max_lanes=lanes)).generate(prompts, sp)
    run = lambda *a, **k: [o.token_ids for o in outs(*a, **k)]
    plain = run(qp, 0)
    spec = outs(qp, 3)
    assert [o.token_ids for o in spec] == plain
    # a random head: drafts accepted and rejected (1 of 30 measured, none past position 1;
    # test_trained_head_fp8_spec_equals_plain below runs past it)
    assert_drafts_accepted_and_rejected(spec, past=0)
    assert run(qp, 2, "interpret", lanes=1) == plain
    assert run(VOCAB11_PARAMS, 0, lanes=1) != plain   # the FP8 model is another model: not vacuous


def test_engine_from_fp8_checkpoint(tmp_path):
    _, cfg, dense, fp8 = _fp8_checkpoint(tmp_path, quant.COMPRESSED_FP8_DYNAMIC, **ODD)
    eng = Engine.from_checkpoint(fp8, num_speculative_tokens=2, max_lanes=2, max_seq_len=64,
                                 prefill_chunk=16)
    assert quant.has_fp8(eng.params)
    st = eng.stats()
    assert st["weights"] == "fp8" and st["mtp_weights"] == "fp8"     # the writer quantized it
    dense_eng = Engine.from_checkpoint(dense, max_lanes=2, max_seq_len=64, prefill_chunk=16)
    assert dense_eng.stats()["weights"] == "float32"
    assert st["weight_bytes"] < 0.5 * dense_eng.stats()["weight_bytes"]  # 1 byte, not 4, a weight
    # the plain reference one request at a time (one lane: fewer programs to compile)
    eng2 = Engine.from_checkpoint(fp8, max_lanes=1, max_seq_len=64, prefill_chunk=16)
    p = [[1, 2, 3, 4], [5, 6, 7]]
    assert ([o.token_ids for o in eng.generate(p, SamplingParams(max_new_tokens=8))]
            == [o.token_ids for o in eng2.generate(p, SamplingParams(max_new_tokens=8))])


# ---------------------------------------------------------------------------- errors

def _rewrite(path, edit):
    f = os.path.join(path, "model.safetensors")
    with safe_open(f, framework="pt") as h:
        t = {k: h.get_tensor(k) for k in h.keys()}
    t = edit(t)
    from safetensors.torch import save_file as save_torch
    save_torch(t, f, metadata={"format": "pt"})


def test_fp8_errors_name_the_tensor(tmp_path):
    _, cfg, dense, fp8 = _fp8_checkpoint(tmp_path, quant.QWEN_FP8, quantize_mtp=False)
    name = "model.layers.1.mlp.up_proj.weight"

    def drop(t):
        t.pop(name + "_scale_inv")
        return t
    _rewrite(fp8, drop)
    with pytest.raises(CheckpointError, match=r"up_proj.weight'.*scale.*missing"):
        mtpjax.load_checkpoint(fp8)

    def misshape(t):
        t[name + "_scale_inv"] = torch.ones(2, 3)
        return t
    _rewrite(fp8, misshape)
    with pytest.raises(CheckpointError, match=r"up_proj.weight_scale_inv'.*shape \(2, 3\)"):
        mtpjax.load_checkpoint(fp8)

    def stray(t):
        t["model.layers.1.input_layernorm.weight_scale_inv"] = torch.ones(1, 1)
        return t
    _rewrite(fp8, stray)
    with pytest.raises(CheckpointError, match="input_layernorm.weight'.*not stored as FP8"):
        mtpjax.load_checkpoint(fp8)

    conf_path = os.path.join(fp8, "config.json")
    conf = json.load(open(conf_path))
    conf["quantization_config"]["quant_method"] = "awq"
    json.dump(conf, open(conf_path, "w"))
    with pytest.raises(quant.QuantError, match="quant_method.*'awq'"):
        mtpjax.load_checkpoint(fp8)
    del conf["quantization_config"]
    json.dump(conf, open(conf_path, "w"))
    with pytest.raises(CheckpointError, match="stored as FP8 but config.json has no"):
        mtpjax.load_checkpoint(fp8)
    with pytest.raises(quant.QuantError, match="weights must be one of"):
        mtpjax.load_checkpoint(dense, weights="int4")


def test_fp8_under_tensor_parallelism_is_refused():
    qp = quantize_params(TP_CFG, TP_PARAMS, "fp8")
    with pytest.raises(ShardingError, match="FP8 weights under tensor parallelism"):
        Engine(TP_CFG, qp, tp=2, max_lanes=1, max_seq_len=32, prefill_chunk=8)


def test_fp8_data_parallel_replicas():
    """dp = 2 (tp = 1 meshes): each replica holds the FP8 tree on its own device."""
    from mtpjax.data_parallel import make_engine
    # the FP8 tree and engine shape of test_speculative_equals_plain_with_fp8's plain engine:
    # `one` and the replica on the first device reuse its programs
    qp = quantize_params(VOCAB11_CFG, VOCAB11_PARAMS, "fp8", "fp8")
    prompts = [[1, 2, 3], [4, 5, 6, 7], [8, 9], [1, 1, 1, 2]]
    sp = SamplingParams(max_new_tokens=6)
    kw = FP8_KW
    one = [o.token_ids for o in Engine(VOCAB11_CFG, qp, **kw).generate(prompts, sp)]
    dp = make_engine(VOCAB11_CFG, qp, tp=1, dp=2, devices=jax.devices()[:2], **kw)
    assert [o.token_ids for o in dp.generate(prompts, sp)] == one


def test_trained_head_fp8_spec_equals_plain():
    """The trained tiny quantized to FP8 at load (target and head): its drafts land past the
    first position, so partial acceptance and multi-token replay run through the FP8 matmuls;
    greedy and seeded sampling equal plain FP8 decoding. One lane: one decode program per
    depth."""
    from mtpjax.text import Tokenizer
    ckpt = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        "checkpoints", "tiny")
    tok = Tokenizer.from_checkpoint(ckpt)
    prompts = [tok.encode(t) for t in ("Once upon a time, there was a little girl named",
                                       "The dog ran to the park and")]
    sp = [SamplingParams(max_new_tokens=24), SamplingParams(max_new_tokens=24, temperature=0.8,
                                                            seed=5)]
    kw = dict(weights="fp8", mtp_weights="fp8", max_lanes=1, max_seq_len=64, prefill_chunk=16,
              prefill_buckets=[16])
    plain = Engine.from_checkpoint(ckpt, num_speculative_tokens=0, **kw).generate(prompts, sp)
    eng = Engine.from_checkpoint(ckpt, num_speculative_tokens=3, **kw)
    assert quant.has_fp8(eng.params)
    spec = eng.generate(prompts, sp)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert_drafts_accepted_and_rejected(spec, past=1)
