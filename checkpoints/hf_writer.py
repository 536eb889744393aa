"""Write `mtpjax.params.Params` as a Hugging Face Qwen3.5 safetensors checkpoint.

The inverse of `checkpoints.hf_loader`: every tensor named by `hf_tensor_map(cfg)` is taken from
its leaf (a row range of a fused leaf) and stored under its HF name, so `load_checkpoint` on the result gives back
the same params (exactly, when stored as float32).

Two layouts, matching what the loader accepts:

* "wrapper" (what Qwen ships for Qwen3.5-27B): text tensors under `model.language_model.*`,
  config.json of `model_type: qwen3_5` with the text settings nested under `text_config`.
* "text" (what `Qwen3_5ForCausalLM.save_pretrained` writes): text tensors under `model.*`,
  config.json of `model_type: qwen3_5_text`.

In both, `lm_head.weight` is written only when the embeddings are not tied, and the MTP head is
stored under `mtp.*`.

`quantization` writes an FP8 checkpoint (mtpjax/quant.py): quant.QWEN_FP8 (Qwen's release:
`weight_scale_inv` per 128 x 128 block) or quant.COMPRESSED_FP8_DYNAMIC (llm-compressor:
`weight_scale` per output channel), each of the linears Qwen quantizes stored as
float8_e4m3fn plus its scale, the MTP linears too when `quantize_mtp`, and config.json's
`quantization_config` naming what stays dense. A_log stays float32 (real checkpoints store it so; a bf16 A_log loses the
decay rate, spec gotcha 11/15); every other tensor is stored in `dtype`.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any, Mapping

import jax.numpy as jnp
import numpy as np
from safetensors.numpy import save_file

from mtpjax import quant
from mtpjax.config import Config
from mtpjax.params import FLOAT32_LEAVES, Params, get_path, hf_tensor_map

LAYOUTS = ("wrapper", "text")
TEXT_PREFIX = {"wrapper": "model.language_model.", "text": "model."}
_DTYPES = {"float32": np.float32, "bfloat16": jnp.bfloat16, "float16": np.float16}


def hf_config(cfg: Config, layout: str = "wrapper") -> dict[str, Any]:
    """The config.json for `cfg` in the given layout."""
    text = cfg.to_hf_text_config()
    if text.get("eos_token_id") is None:
        text.pop("eos_token_id", None)
    if layout == "text":
        return text
    if layout != "wrapper":
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    out = {
        "model_type": "qwen3_5",
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "text_config": text,
    }
    if "eos_token_id" in text:
        out["eos_token_id"] = text["eos_token_id"]
    return out


def fp8_tensor(name: str, quantize_mtp: bool) -> bool:
    """Whether a quantized checkpoint stores this HF tensor in FP8 (Qwen's set, see quant.py)."""
    if name.startswith("mtp.") and not quantize_mtp:
        return False
    return name.endswith(quant.FP8_TENSORS)


def hf_state_dict(cfg: Config, params: Params, dtype: str = "bfloat16",
                  layout: str = "wrapper", quantization: quant.Scheme | None = None,
                  quantize_mtp: bool = False, scale_dtype: str = "float32"
                  ) -> dict[str, np.ndarray]:
    """HF tensor name -> host array, in `hf_tensor_map` order (FP8 weights followed by their
    scale when `quantization` is given)."""
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {tuple(_DTYPES)}, got {dtype!r}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    prefix = TEXT_PREFIX[layout]
    host_leaves: dict[tuple[str, ...], np.ndarray] = {}
    out: dict[str, np.ndarray] = {}
    for spec in hf_tensor_map(cfg):
        if spec.path not in host_leaves:
            leaf = get_path(params, spec.path)
            if leaf is None:
                raise ValueError(f"tensor '{spec.name}': params leaf {'.'.join(spec.path)} is None")
            host_leaves[spec.path] = np.asarray(leaf)
        x = host_leaves[spec.path]
        if spec.rows is not None:
            x = x[spec.rows[0]:spec.rows[1]]
        if tuple(x.shape) != spec.shape:
            raise ValueError(f"tensor '{spec.name}': params shape {tuple(x.shape)} but the config "
                             f"implies {spec.shape}")
        top_level = spec.name.startswith("mtp.") or spec.name == "lm_head.weight"
        name = spec.name if top_level else prefix + spec.name
        if quantization is not None and fp8_tensor(spec.name, quantize_mtp):
            q, scale = quant.quantize(x.astype(np.float32), quantization.block_for(x.shape))
            out[name] = q
            out[name[:-len("weight")] + quantization.scale_suffix] = scale.astype(
                _DTYPES[scale_dtype])
            continue
        want = np.float32 if spec.path[-1] in FLOAT32_LEAVES else _DTYPES[dtype]
        out[name] = np.ascontiguousarray(x.astype(want))
    return out


def not_converted(cfg: Config, quantize_mtp: bool, layout: str = "wrapper") -> list[str]:
    """Module names (as stored) of the linears a quantized checkpoint keeps dense."""
    out = ["lm_head"] if not cfg.tie_word_embeddings else []
    for spec in hf_tensor_map(cfg):
        if spec.name.endswith((".in_proj_a.weight", ".in_proj_b.weight")):
            out.append(TEXT_PREFIX[layout] + spec.name[:-len(".weight")])
        elif (spec.name.startswith("mtp.") and len(spec.shape) == 2 and not quantize_mtp
              and spec.name.endswith(quant.FP8_TENSORS)):
            out.append(spec.name[:-len(".weight")])
    return out


def save_hf_checkpoint(path: str, cfg: Config, params: Params, dtype: str = "bfloat16",
                       tokenizer_json: str | None = None,
                       generation_config: Mapping[str, Any] | None = None,
                       layout: str = "wrapper", quantization: quant.Scheme | None = None,
                       quantize_mtp: bool = False, scale_dtype: str = "float32"
                       ) -> dict[str, str]:
    """Write config.json + model.safetensors (+ tokenizer.json, generation_config.json).

    tokenizer_json: a path to a tokenizer.json to copy, or the JSON text itself.
    Returns {file name: absolute path} of what was written.
    """
    os.makedirs(path, exist_ok=True)
    written = {}
    tensors = hf_state_dict(cfg, params, dtype, layout, quantization, quantize_mtp, scale_dtype)
    st_path = os.path.join(path, "model.safetensors")
    save_file(tensors, st_path, metadata={"format": "pt"})
    written["model.safetensors"] = st_path
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path, "w") as f:
        conf = hf_config(cfg, layout)
        conf["torch_dtype"] = dtype
        if quantization is not None:
            import dataclasses
            scheme = dataclasses.replace(quantization,
                                         not_converted=tuple(not_converted(cfg, quantize_mtp, layout)))
            conf["quantization_config"] = quant.scheme_config(scheme)
        json.dump(conf, f, indent=2)
        f.write("\n")
    written["config.json"] = cfg_path
    if tokenizer_json is not None:
        tok_path = os.path.join(path, "tokenizer.json")
        if not tokenizer_json.lstrip().startswith("{"):
            if os.path.abspath(tokenizer_json) != os.path.abspath(tok_path):
                shutil.copy(tokenizer_json, tok_path)
        else:
            with open(tok_path, "w") as f:
                f.write(tokenizer_json)
        written["tokenizer.json"] = tok_path
    if generation_config is not None:
        gen_path = os.path.join(path, "generation_config.json")
        with open(gen_path, "w") as f:
            json.dump(dict(generation_config), f, indent=2)
            f.write("\n")
        written["generation_config.json"] = gen_path
    # A stale index from an earlier sharded save would shadow the single file.
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        os.remove(index)
    return {k: os.path.abspath(v) for k, v in written.items()}
