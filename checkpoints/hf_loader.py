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

FP8 checkpoints (config.json `quantization_config`, see mtpjax/quant.py): Qwen's block-wise
`fp8` (`*.weight` float8_e4m3fn + `*.weight_scale_inv` per 128 x 128 block) and
compressed-tensors FP8 (`*.weight_scale` per output channel, per tensor or per block). Every
FP8 tensor's scale is checked (present, right shape) before it is used. `weights` picks what
the linears become: "auto" keeps what is stored, "fp8" quantizes dense linears per tensor at
load (quant.quantize), "dense" dequantizes; `mtp_weights` does the same for the MTP head
("auto": as stored, except dense when `weights="fp8"` quantizes a dense checkpoint).
"""

from __future__ import annotations

import json
import os
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from checkpoints.safetensors_io import FP8_DTYPES, SafetensorsFile
from mtpjax import quant
from mtpjax.config import Config
from mtpjax.params import (Params, TensorSpec, abstract_params, get_path, hf_tensor_map,
                           leaf_dtype, leaf_shapes, replace_path)

TEXT_PREFIXES = ("model.language_model.", "model.")
IGNORED_PREFIXES = ("model.visual.", "visual.")
TOP_LEVEL = ("lm_head.weight",)


class CheckpointError(quant.QuantError):
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
        for name in SafetensorsFile(fpath).keys():
            out[name] = fpath
    return out


class FileSource:
    """Tensors of a checkpoint folder: name -> (stored dtype, shape, array on demand)."""

    def __init__(self, path: str):
        self._files = safetensors_files(path)
        self._open: dict[str, SafetensorsFile] = {}

    def _f(self, name: str) -> SafetensorsFile:
        fpath = self._files[name]
        if fpath not in self._open:
            self._open[fpath] = SafetensorsFile(fpath)
        return self._open[fpath]

    def names(self) -> list[str]:
        return list(self._files)

    def dtype(self, name: str) -> str:
        return self._f(name).dtype(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._f(name).shape(name)

    def get(self, name: str) -> np.ndarray:
        return self._f(name).get(name)


_ST_NAMES = {np.dtype(np.float32): "F32", np.dtype(np.float64): "F64",
             np.dtype(np.float16): "F16", np.dtype(jnp.bfloat16): "BF16",
             np.dtype(quant.FP8): "F8_E4M3"}


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


SCALE_SUFFIXES = ("weight_scale_inv", "weight_scale")
SKIPPED_SUFFIXES = ("input_scale",)   # static activation scales: weight-only FP8 needs none


class Entry(NamedTuple):
    spec: TensorSpec
    name: str                 # name in the checkpoint
    scale: str | None         # its FP8 scale tensor, when stored as FP8


def plan(cfg: Config, src, split_ba: bool = False,
         scheme: quant.Scheme | None = None) -> list[Entry]:
    """Match checkpoint tensors to specs; raise CheckpointError on missing/unknown ones, and
    on FP8 tensors without their scale (or scales without their FP8 tensor)."""
    specs = {s.name: s for s in hf_tensor_map(cfg, split_ba)}
    found: dict[str, str] = {}
    scales: dict[str, str] = {}
    unknown = []
    for name in src.names():
        canon = canonical_name(name)
        if canon is None:
            continue
        base, _, suffix = canon.rpartition(".")
        if suffix in SKIPPED_SUFFIXES:
            continue
        if suffix in SCALE_SUFFIXES:
            scales[base + ".weight"] = name
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
            raise CheckpointError(f"tensor '{name}': stored twice (also as '{found[canon]}')")
        found[canon] = name
    if unknown:
        raise CheckpointError(f"unknown tensor '{unknown[0]}' (and {len(unknown) - 1} more) not "
                              "in a Qwen3.5 checkpoint with this config")
    missing = [n for n in specs if n not in found]
    if missing:
        raise CheckpointError(f"missing tensor '{missing[0]}' (and {len(missing) - 1} more)")
    out = []
    for canon, spec in specs.items():
        name = found[canon]
        fp8 = src.dtype(name) in FP8_DTYPES
        scale = scales.pop(canon, None)
        if fp8:
            if scheme is None:
                raise CheckpointError(f"tensor '{name}': stored as FP8 but config.json has no "
                                      "quantization_config")
            want = name[:-len("weight")] + scheme.scale_suffix
            if scale is None or scale != want:
                raise CheckpointError(f"tensor '{name}': stored as FP8 but its scale '{want}' "
                                      "is missing")
        elif scale is not None:
            raise CheckpointError(f"tensor '{scale}': a scale for '{name}', which is not stored "
                                  f"as FP8 ({src.dtype(name)})")
        out.append(Entry(spec, name, scale if fp8 else None))
    if scales:
        extra = next(iter(scales.values()))
        raise CheckpointError(f"tensor '{extra}': a scale for a weight this checkpoint does not "
                              "have")
    return out


def read_config(path: str) -> dict:
    cfg_path = os.path.join(path, "config.json")
    if not os.path.exists(cfg_path):
        return {}
    with open(cfg_path) as f:
        return json.load(f)


def load_params(cfg: Config, path: str, dtype="float32", meshes: Sequence | None = None,
                weights: str = "auto", mtp_weights: str = "auto"):
    """Read every tensor of the checkpoint at `path` into a Params tree of `dtype`.

    meshes: None -> one Params on the default device. Else a list of tensor-parallel meshes
    (tensor_parallel.make_meshes; None entries mean the default device) -> one Params per mesh,
    each leaf laid out on its mesh (tensor_parallel.place_leaf): every device receives only its
    shard, and each checkpoint tensor is read once whatever the number of replicas.

    weights / mtp_weights: "auto" | "fp8" | "dense", see the module docstring.

    Leaves are assembled one at a time on the host (a fused leaf from its row ranges) and
    placed as soon as they are complete, so peak host memory is about one leaf plus one tensor
    (2.5 GB for 27B's embedding), never the model.
    """
    scheme = quant.scheme_from_config(read_config(path))
    return build_params(cfg, FileSource(path), dtype, meshes, weights, mtp_weights, scheme)


def _leaf_mode(path: tuple, weights: str, mtp_weights: str) -> str:
    """"fp8" | "dense" | "auto" (as stored) for one leaf."""
    if path[-1] not in quant.FP8_LEAVES:
        return "dense"
    if path[0] == "mtp":
        if mtp_weights != "auto":
            return mtp_weights
        return "dense" if weights == "fp8" else weights
    return weights


def build_params(cfg: Config, src, dtype="float32", meshes: Sequence | None = None,
                 weights: str = "auto", mtp_weights: str = "auto",
                 scheme: quant.Scheme | None = None):
    """load_params over any tensor source (FileSource, ParamsSource)."""
    from mtpjax import tensor_parallel
    quant.check_weights_option(weights, mtp_weights)
    targets = [None] if meshes is None else list(meshes)
    prelim = plan(cfg, src, False, scheme) if weights == "auto" else None
    if weights == "fp8":
        split_ba = True
    elif weights == "auto":
        split_ba = any(e.scale is not None and e.spec.name.endswith("in_proj_qkv.weight")
                       for e in prelim)
    else:
        split_ba = False
    entries = plan(cfg, src, split_ba, scheme) if split_ba or prelim is None else prelim
    parts: dict[tuple, list[Entry]] = {}
    for e in entries:
        parts.setdefault(e.spec.path, []).append(e)
    fp8_leaves = {p for p, es in parts.items() if _leaf_fp8(p, es, weights, mtp_weights)}
    if fp8_leaves:
        for m in targets:
            if m is not None and m.shape[tensor_parallel.TP_AXIS] > 1:
                raise tensor_parallel.ShardingError(
                    "FP8 weights under tensor parallelism (tp > 1) are not supported yet; use "
                    "tp=1 (an FP8 27B fits one H200) or weights='dense'")
    shapes = leaf_shapes(cfg, split_ba)
    trees = [abstract_params(cfg, dtype, frozenset(fp8_leaves)) for _ in targets]
    for path, es in parts.items():
        if path in fp8_leaves:
            pieces = [_fp8_part(src, e, scheme) for e in es]
            q, scale, block = quant.fuse(pieces) if len(pieces) > 1 else pieces[0]
            leaf = quant.Fp8Weight(q, scale, block)
            del pieces
            placed = [_place_fp8(m, leaf) for m in targets]
        else:
            want = leaf_dtype(path, dtype)
            if es[0].spec.rows is None:
                host = _dense_part(src, es[0], scheme, want)
            else:
                host = np.empty(shapes[path], want)
                for e in es:
                    host[e.spec.rows[0]:e.spec.rows[1]] = _dense_part(src, e, scheme, want)
            placed = [tensor_parallel.place_leaf(cfg, m, path, host) for m in targets]
            del host
        trees = [replace_path(t, path, x) for t, x in zip(trees, placed)]
    if cfg.tie_word_embeddings:
        trees = [replace_path(t, ("lm_head",), None) for t in trees]
    return trees[0] if meshes is None else trees


def _leaf_fp8(path: tuple, es: list[Entry], weights: str, mtp_weights: str) -> bool:
    mode = _leaf_mode(path, weights, mtp_weights)
    if mode == "auto":
        return all(e.scale is not None for e in es)
    return mode == "fp8"


def _checked(src, e: Entry) -> np.ndarray:
    stored = src.shape(e.name)
    if tuple(stored) != e.spec.shape:
        raise CheckpointError(f"tensor '{e.name}': shape {tuple(stored)} but the config "
                              f"implies {e.spec.shape}")
    host = src.get(e.name)
    if not (np.issubdtype(host.dtype, np.floating) or host.dtype in (jnp.bfloat16, quant.FP8)):
        raise CheckpointError(f"tensor '{e.name}': stored dtype {host.dtype} is not a float")
    # A copy in memory, one tensor at a time: a memory-mapped view handed to jax.device_put
    # on the CPU backend is aliased, not copied, and dangles (a segfault) once the file's
    # mapping closes (tests/test_loader.py).
    return np.array(host)


def _scale(src, e: Entry, scheme: quant.Scheme) -> tuple[np.ndarray, tuple[int, int]]:
    """The FP8 tensor's scale as float32 [nbo, nbi] and its block, checked against its shape."""
    shape = e.spec.shape
    if len(shape) != 2:
        raise CheckpointError(f"tensor '{e.name}': FP8 is only supported for 2-D weights, got "
                              f"shape {shape}")
    s = np.array(src.get(e.scale))          # a copy, not the mapped view (see _checked)
    want = scheme.scale_shape(shape)
    if scheme.strategy == "tensor" and s.size == 1:
        s = s.reshape(1, 1)
    if tuple(s.shape) != want:
        raise CheckpointError(f"tensor '{e.scale}': shape {tuple(s.shape)}, but weight "
                              f"'{e.name}' {list(shape)} with {scheme.strategy} scales "
                              f"{scheme.block_for(shape)} needs {want}")
    s = s.astype(np.float32)
    if not np.all(np.isfinite(s)):
        raise CheckpointError(f"tensor '{e.scale}': non-finite scales")
    return s, scheme.block_for(shape)


def _fp8_part(src, e: Entry, scheme):
    """(q, scale, block) of one checkpoint tensor: as stored, or quantized per tensor."""
    host = _checked(src, e)
    if e.scale is not None:
        s, block = _scale(src, e, scheme)
        return np.ascontiguousarray(host), s, block
    return (*quant.quantize(host.astype(np.float32), quant.DEFAULT_BLOCK), quant.DEFAULT_BLOCK)


def _dense_part(src, e: Entry, scheme, want) -> np.ndarray:
    host = _checked(src, e)
    if e.scale is not None:
        s, block = _scale(src, e, scheme)
        return quant.dequantize(host, s, block).astype(want)
    return host.astype(want, copy=False)


def _place_fp8(mesh, leaf: quant.Fp8Weight) -> quant.Fp8Weight:
    if mesh is None:
        put = jax.device_put
    else:
        from jax.sharding import NamedSharding, PartitionSpec
        sharding = NamedSharding(mesh, PartitionSpec())
        put = lambda x: jax.device_put(x, sharding)
    return quant.Fp8Weight(put(leaf.q), put(leaf.scale), leaf.block)


class ParamsSource:
    """The checkpoint tensors of an in-memory dense Params tree, fetched one at a time from
    its leaves (a fused leaf's row range): quantizing a 27B tree in memory holds about one leaf
    on the host, never the model."""

    def __init__(self, cfg: Config, params: Params):
        self._params = params
        self._specs = {("model." + s.name if not (s.name.startswith("mtp.")
                                                   or s.name == "lm_head.weight") else s.name): s
                       for s in hf_tensor_map(cfg)}
        self._cached: tuple[tuple, np.ndarray] | None = None

    def names(self) -> list[str]:
        return list(self._specs)

    def dtype(self, name: str) -> str:
        leaf = get_path(self._params, self._specs[name].path)
        return _ST_NAMES.get(np.dtype(leaf.dtype), str(leaf.dtype))

    def shape(self, name: str) -> tuple[int, ...]:
        return self._specs[name].shape

    def get(self, name: str) -> np.ndarray:
        spec = self._specs[name]
        if self._cached is None or self._cached[0] != spec.path:
            self._cached = None
            self._cached = (spec.path, np.asarray(get_path(self._params, spec.path)))
        host = self._cached[1]
        return host if spec.rows is None else host[spec.rows[0]:spec.rows[1]]


def quantize_params(cfg: Config, params: Params, weights: str = "fp8",
                    mtp_weights: str = "auto") -> Params:
    """In-memory dense Params with their linears made FP8, exactly as
    `load_params(weights=..., mtp_weights=...)` loads a dense checkpoint holding them (each
    tensor quantized from its stored values; leaves fetched one at a time)."""
    if quant.has_fp8(params):
        raise quant.QuantError("quantize_params expects dense params (no Fp8Weight leaves)")
    dtype = params.embed.dtype
    return build_params(cfg, ParamsSource(cfg, params), str(np.dtype(dtype)), None, weights,
                        mtp_weights)
