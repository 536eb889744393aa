"""Save / restore converted params with orbax-checkpoint.

A converted checkpoint is a folder holding the text `config.json` (plus tokenizer and
generation config copied from the source, when present) and an orbax `params/` tree of the
already-cast arrays, so later loads skip safetensors parsing and dtype conversion.
"""

from __future__ import annotations

import dataclasses
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


def _stored(params: Params) -> dict:
    """What a converted folder holds: the checkpoint's leaves by Params field, without the
    engine-built draft head (Params.draft: not a checkpoint tensor), so folders written before
    that field existed restore as they are."""
    return {f.name: getattr(params, f.name) for f in dataclasses.fields(Params)
            if f.name != "draft"}


def _params(stored: dict) -> Params:
    return Params(**stored)


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
    ckpt.save(target, _stored(params))
    ckpt.wait_until_finished()
    with open(os.path.join(path, MARKER), "w") as f:
        json.dump({"dtype": dtype, "source": source, "layout": LAYOUT}, f)


def restore_converted(path: str, meshes=None):
    """(cfg, params, stored dtype) from a converted folder.

    meshes: None -> params on the default device. Else a list of tensor-parallel meshes
    (tensor_parallel.make_meshes) -> (cfg, [params per mesh], dtype): orbax restores each leaf
    straight onto the mesh, split along the axis its tensor-parallel layout shards (replicated
    when that axis does not divide), then one jitted gather per leaf reorders it into the
    shard-major layout on the devices. The model never sits whole on one device or the host.
    """
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
    if meshes is None:
        params = _params(ckpt.restore(os.path.join(path, "params"), _stored(abstract)))
        return cfg, params, dtype
    out = []
    for mesh in meshes:
        out.append(_restore_on_mesh(ckpt, os.path.join(path, "params"), cfg, abstract, mesh))
    return cfg, out, dtype


def _restore_on_mesh(ckpt, folder: str, cfg: Config, abstract: Params, mesh) -> Params:
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    from mtpjax import tensor_parallel as tpar
    from mtpjax.params import get_path, leaf_shapes, replace_path

    if mesh is None:
        return _params(ckpt.restore(folder, _stored(abstract)))
    tp = tpar.mesh_tp(mesh)
    target = tpar.sharded_abstract_params(cfg, mesh, jax.tree.leaves(abstract)[0].dtype)
    staged = abstract
    for lp in leaf_shapes(cfg):
        a = get_path(abstract, lp)
        lay = tpar.layout_index(cfg, tp, lp)
        spec = P()
        if lay is not None and a.shape[lay[0]] % tp == 0:
            spec = P(*([None] * lay[0] + [tpar.TP_AXIS]))
        staged = replace_path(staged, lp, jax.ShapeDtypeStruct(
            a.shape, a.dtype, sharding=NamedSharding(mesh, spec)))
    params = _params(ckpt.restore(folder, _stored(staged)))
    for lp in leaf_shapes(cfg):
        lay = tpar.layout_index(cfg, tp, lp)
        want = get_path(target, lp).sharding
        x = get_path(params, lp)
        if lay is None:
            y = jax.device_put(x, want)
        else:
            axis, idx = lay
            def relayout(x, idx=jnp.asarray(idx), axis=axis):
                y = jnp.take(x, jnp.maximum(idx, 0), axis=axis)
                shape = [1] * y.ndim
                shape[axis] = idx.shape[0]
                return jnp.where((idx >= 0).reshape(shape), y, jnp.zeros((), y.dtype))
            y = jax.jit(relayout, out_shardings=want)(x)
        params = replace_path(params, lp, y)
        del x
    return params
