"""Save / restore converted params with orbax-checkpoint.

A converted checkpoint is a folder holding the text `config.json` (plus tokenizer and
generation config copied from the source, when present) and an orbax `params/` tree of the
already-cast arrays, so later loads skip safetensors parsing and dtype conversion.
"""

from __future__ import annotations

import json
import os
import shutil

import jax
import orbax.checkpoint as ocp

from mtpjax.config import Config
from mtpjax.params import Params, abstract_params

MARKER = "mtpjax_converted.json"
# The Params layout a converted folder holds (params.py: per-layer leaves, fused projections).
# Folders written for an older layout are refused with a message instead of a restore error.
LAYOUT = "per-layer-fused/2"
SIDECARS = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def is_orbax_checkpoint(path: str) -> bool:
    return os.path.exists(os.path.join(path, MARKER))


def save_converted(path: str, cfg: Config, params: Params, dtype: str, source: str | None = None):
    path = os.path.abspath(path)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg.to_hf_text_config(), f, indent=2)
    if source:
        for name in SIDECARS:
            if os.path.exists(os.path.join(source, name)):
                shutil.copy(os.path.join(source, name), os.path.join(path, name))
    target = os.path.join(path, "params")
    if os.path.exists(target):
        shutil.rmtree(target)
    ckpt = ocp.StandardCheckpointer()
    ckpt.save(target, params)
    ckpt.wait_until_finished()
    with open(os.path.join(path, MARKER), "w") as f:
        json.dump({"dtype": dtype, "source": source, "layout": LAYOUT}, f)


def restore_converted(path: str) -> tuple[Config, Params, str]:
    path = os.path.abspath(path)
    with open(os.path.join(path, MARKER)) as f:
        marker = json.load(f)
    dtype = marker["dtype"]
    if marker.get("layout") != LAYOUT:
        raise ValueError(f"{path} was converted for params layout {marker.get('layout')!r}, this "
                         f"version reads {LAYOUT!r}: convert the HF checkpoint again")
    cfg = Config.from_pretrained(path)
    abstract = abstract_params(cfg, dtype)
    ckpt = ocp.StandardCheckpointer()
    params = ckpt.restore(os.path.join(path, "params"), abstract)
    return cfg, params, dtype
