"""Tiny random Qwen3.5 checkpoints in the real HF layout, written by transformers itself.

Every parameter is perturbed away from its HF init (1+w norm weights start at zero, the gated
norm at one), so a dropped `1+`, a swapped gate or a transposed block changes the logits.
MTP tensors (which transformers does not model) are added with random values under `mtp.*`.
"""

from __future__ import annotations

import json
import os

import numpy as np
import torch
from safetensors.numpy import save_file
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig


def tiny_hf_config(**overrides) -> Qwen3_5TextConfig:
    kw = dict(
        vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
        linear_value_head_dim=12, linear_conv_kernel_dim=4,
        max_position_embeddings=512, tie_word_embeddings=False, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                         "partial_rotary_factor": 0.25, "mrope_section": [1, 1, 0],
                         "mrope_interleaved": True},
        mtp_num_hidden_layers=1,
    )
    kw.update(overrides)
    return Qwen3_5TextConfig(**kw)


def perturbed_model(hf_cfg, seed: int = 0) -> Qwen3_5ForCausalLM:
    torch.manual_seed(seed)
    m = Qwen3_5ForCausalLM(hf_cfg).to(torch.float32).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.log(torch.rand(p.shape, generator=gen) * 15 + 1))
            elif p.ndim == 1:
                p.add_(0.2 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.25 / np.sqrt(p.shape[-1]) ** 0.5)
    return m


def mtp_tensors(hf_cfg, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed + 7)
    h, i = hf_cfg.hidden_size, hf_cfg.intermediate_size
    nq, nkv, hd = hf_cfg.num_attention_heads, hf_cfg.num_key_value_heads, hf_cfg.head_dim
    shapes = {
        "mtp.pre_fc_norm_embedding.weight": (h,), "mtp.pre_fc_norm_hidden.weight": (h,),
        "mtp.fc.weight": (h, 2 * h), "mtp.norm.weight": (h,),
        "mtp.layers.0.input_layernorm.weight": (h,),
        "mtp.layers.0.post_attention_layernorm.weight": (h,),
        "mtp.layers.0.self_attn.q_proj.weight": (2 * nq * hd, h),
        "mtp.layers.0.self_attn.k_proj.weight": (nkv * hd, h),
        "mtp.layers.0.self_attn.v_proj.weight": (nkv * hd, h),
        "mtp.layers.0.self_attn.o_proj.weight": (h, nq * hd),
        "mtp.layers.0.self_attn.q_norm.weight": (hd,),
        "mtp.layers.0.self_attn.k_norm.weight": (hd,),
        "mtp.layers.0.mlp.gate_proj.weight": (i, h), "mtp.layers.0.mlp.up_proj.weight": (i, h),
        "mtp.layers.0.mlp.down_proj.weight": (h, i),
    }
    out = {}
    for name, shape in shapes.items():
        if len(shape) == 1:
            out[name] = (0.2 * rng.standard_normal(shape)).astype(np.float32)
        else:
            out[name] = (rng.standard_normal(shape) * 0.5 / np.sqrt(shape[-1])).astype(np.float32)
    return out


def write_checkpoint(path: str, seed: int = 0, with_mtp: bool = True, **cfg_overrides):
    """save_pretrained a perturbed tiny model (+ MTP tensors); returns (hf_model, mtp_dict)."""
    hf_cfg = tiny_hf_config(**cfg_overrides)
    if not with_mtp:
        hf_cfg.mtp_num_hidden_layers = 0
    m = perturbed_model(hf_cfg, seed)
    m.save_pretrained(path, safe_serialization=True)
    mtp = mtp_tensors(hf_cfg, seed) if with_mtp else {}
    if with_mtp:
        save_file(mtp, os.path.join(path, "mtp.safetensors"))
        _reindex(path)
    return m, mtp


def _reindex(path: str):
    """Write a model.safetensors.index.json covering every *.safetensors file in path."""
    from safetensors import safe_open
    weight_map = {}
    for fname in sorted(os.listdir(path)):
        if fname.endswith(".safetensors"):
            with safe_open(os.path.join(path, fname), framework="numpy") as f:
                for k in f.keys():
                    weight_map[k] = fname
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)


def hf_logits(m, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return m(torch.tensor(tokens, dtype=torch.long)).logits.float().numpy()
