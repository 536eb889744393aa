"""Load Hugging Face Qwen3.5 safetensors checkpoints into `mtpjax.params.Params`.

Accepts what Qwen ships (Qwen3.5-27B: `Qwen3_5ForConditionalGeneration`, sharded with
`model.safetensors.index.json`, text under `model.language_model.*`, `lm_head.weight`,
`mtp.*`, vision tower under `model.visual.*`) and text-only re-exports (`model.*`, one
`model.safetensors`, as `Qwen3_5ForCausalLM.save_pretrained` writes).

Tensors are read one at a time from memory-mapped files, cast on the host, moved to the device
and written into their leaf in place (projections that share an input are fused by rows into
one leaf, see params.py), so peak host memory stays near the largest
tensor (2.5 GB for 27B's embedding), not the 55 GB model. Each tensor's stored dtype is
respected (real checkpoints mix F32 and BF16) before the cast to the requested dtype; A_log stays
float32 (see params.FLOAT32_LEAVES).
"""

from __future__ import annotations

import json
import os
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import safe_open

from mtpjax.config import Config
from mtpjax.params import (Params, TensorSpec, abstract_params, hf_tensor_map, leaf_dtype,
                           leaf_shapes, replace_path)

TEXT_PREFIXES = ("model.language_model.", "model.")
IGNORED_PREFIXES = ("model.visual.", "visual.")
TOP_LEVEL = ("lm_head.weight",)


class CheckpointError(ValueError):
    """A checkpoint that does not match its config; the message names the tensor."""


def safetensors_files(path: str) -> dict[str, str]:
    """tensor name -> file, from the index when sharded, else from the single file(s)."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: no 'weight_map' object")
        out = {}
        for name, fname in weight_map.items():
            fpath = os.path.join(path, fname)
            if not os.path.exists(fpath):
                raise CheckpointError(f"tensor '{name}': shard file '{fname}' named in the "
                                      "index is missing")
            out[name] = fpath
        return out
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files and no model.safetensors.index.json in {path}")
    out = {}
    for fname in files:
        fpath = os.path.join(path, fname)
        with safe_open(fpath, framework="numpy") as f:
            for name in f.keys():
                out[name] = fpath
    return out


def canonical_name(name: str) -> str | None:
    """Checkpoint name -> name in `hf_tensor_map` terms, or None for ignored (vision) tensors."""
    if name.startswith(IGNORED_PREFIXES):
        return None
    if name.startswith("mtp.") or name in TOP_LEVEL:
        return name
    for prefix in TEXT_PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix):]
    return name  # reported as unknown by the caller


def plan(cfg: Config, files: dict[str, str]) -> list[tuple[TensorSpec, str, str]]:
    """Match checkpoint tensors to specs; raise CheckpointError on missing/unknown ones."""
    specs = {s.name: s for s in hf_tensor_map(cfg)}
    found: dict[str, tuple[str, str]] = {}
    unknown = []
    for name, fpath in files.items():
        canon = canonical_name(name)
        if canon is None:
            continue
        if canon == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # tied: the embedding is the head; a stored copy is redundant
        if canon.startswith("mtp.") and not cfg.has_mtp:
            unknown.append(name)
            continue
        if canon not in specs:
            unknown.append(name)
            continue
        if canon in found:
            raise CheckpointError(f"tensor '{name}': stored twice (also as '{found[canon][0]}')")
        found[canon] = (name, fpath)
    if unknown:
        raise CheckpointError(f"unknown tensor '{unknown[0]}' (and {len(unknown) - 1} more) not "
                              "in a Qwen3.5 checkpoint with this config")
    missing = [n for n in specs if n not in found]
    if missing:
        raise CheckpointError(f"missing tensor '{missing[0]}' (and {len(missing) - 1} more)")
    return [(specs[n], *found[n]) for n in specs]


def load_params(cfg: Config, path: str, dtype="float32", meshes: Sequence | None = None):
    """Read every tensor of the checkpoint at `path` into a Params tree of `dtype`.

    meshes: None -> one Params on the default device. Else a list of tensor-parallel meshes
    (tensor_parallel.make_meshes; None entries mean the default device) -> one Params per mesh,
    each leaf laid out on its mesh (tensor_parallel.place_leaf): every device receives only its
    shard, and each checkpoint tensor is read once whatever the number of replicas.

    Leaves are assembled one at a time on the host (a fused leaf from its row ranges) and
    placed as soon as they are complete, so peak host memory is about one leaf plus one tensor
    (2.5 GB for 27B's embedding), never the model.
    """
    from mtpjax import tensor_parallel
    files = safetensors_files(path)
    entries = plan(cfg, files)
    shapes = leaf_shapes(cfg)
    parts_left: dict[tuple, int] = {}
    for spec, _, _ in entries:
        parts_left[spec.path] = parts_left.get(spec.path, 0) + 1
    targets = [None] if meshes is None else list(meshes)
    trees = [abstract_params(cfg, dtype) for _ in targets]
    building: dict[tuple, np.ndarray] = {}
    handles: dict[str, object] = {}
    try:
        for spec, name, fpath in entries:
            if fpath not in handles:
                handles[fpath] = safe_open(fpath, framework="numpy").__enter__()
            f = handles[fpath]
            stored = f.get_slice(name).get_shape()
            if tuple(stored) != spec.shape:
                raise CheckpointError(f"tensor '{name}': shape {tuple(stored)} but the config "
                                      f"implies {spec.shape}")
            host = f.get_tensor(name)
            want = leaf_dtype(spec.path, dtype)
            if not (np.issubdtype(host.dtype, np.floating) or host.dtype == jnp.bfloat16):
                raise CheckpointError(f"tensor '{name}': stored dtype {host.dtype} is not a float")
            if spec.rows is None:
                leaf = host.astype(want, copy=False)
            else:
                if spec.path not in building:
                    building[spec.path] = np.empty(shapes[spec.path], want)
                building[spec.path][spec.rows[0]:spec.rows[1]] = host
                leaf = building[spec.path]
            del host
            parts_left[spec.path] -= 1
            if parts_left[spec.path] == 0:
                building.pop(spec.path, None)
                trees = [replace_path(t, spec.path,
                                      tensor_parallel.place_leaf(cfg, m, spec.path, leaf))
                         for t, m in zip(trees, targets)]
            del leaf
    finally:
        for h in handles.values():
            h.__exit__(None, None, None)
    if cfg.tie_word_embeddings:
        trees = [replace_path(t, ("lm_head",), None) for t in trees]
    return trees[0] if meshes is None else trees
