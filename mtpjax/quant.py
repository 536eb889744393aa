"""FP8 weights: the block-scaled weight pytree, host-side quantization, and which leaves use it.

What a quantized linear holds (`Fp8Weight`): `q` float8_e4m3fn `[O, I]` and float32 `scale`
`[ceil(O/bo), ceil(I/bi)]`; the weight it stands for is `q[o, i] * scale[o // bo, i // bi]`
exactly (Qwen's FP8 release: block (128, 128), `weight_scale_inv`; llm-compressor's
FP8_DYNAMIC: per output channel, block (1, I), `weight_scale`). The matmul reads `q` and the
scales and never dequantizes a whole weight (`pallas_kernels/fp8_matmul.py`): weight-only FP8,
activations stay in the model dtype, for decode and prefill alike (prefill is compute-bound;
an FP8 x FP8 tensor-core path for it is future work).

Which linears are FP8 when quantizing a dense checkpoint at load time (`weights="fp8"`), the
same set Qwen's FP8 release quantizes: attention q/k/v/o, GDN in_proj_qkv / in_proj_z /
out_proj, MLP gate/up/down, each HF tensor quantized on its own with 128 x 128 blocks (scale =
block amax / 448). They stay in the model dtype: embeddings, lm_head, every norm, the GDN
conv1d, A_log, dt_bias and in_proj_a / in_proj_b (tiny, and they set the decay and the write
strength), and by default the whole MTP head (`mtp_weights`), whose acceptance users report
suffers when it is quantized; the judge measures both.

Fused leaves: parts whose row counts are multiples of the block rows share block scales; when
a part boundary falls inside a block (tiny test configs) the scales are expanded to one per
row (block (1, bi)), which is exact too. The GDN in_proj is split into [qkv | z] (FP8) and
[b | a] (`GdnParams.in_proj_ba`, dense) when its qkv is FP8.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

FP8 = ml_dtypes.float8_e4m3fn
FP8_MAX = 448.0
DEFAULT_BLOCK = (128, 128)
WEIGHTS = ("auto", "fp8", "dense")          # Engine.from_checkpoint(weights=...), --weights
# Params leaf names that may hold an Fp8Weight (the linears of the checkpoint's quantized set).
FP8_LEAVES = ("qkv", "o_proj", "in_proj", "out_proj", "gate_up", "down_proj", "fc")
# HF tensor names (suffixes) a quantized checkpoint may store in FP8.
FP8_TENSORS = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight",
               "in_proj_qkv.weight", "in_proj_z.weight", "out_proj.weight", "gate_proj.weight",
               "up_proj.weight", "down_proj.weight", "fc.weight")
IMPLS = ("reference", "pallas", "interpret")


class QuantError(ValueError):
    """A quantized checkpoint or option that cannot be used; the message names the problem."""


@dataclasses.dataclass(frozen=True)
class Fp8Weight:
    """A linear weight [O, I] stored as FP8 with block scales (see module docstring).

    block and impl are static (part of the tree structure): impl picks the matmul
    (`pallas_kernels.fp8_matmul` "pallas" / "interpret", or its jnp "reference").
    """
    q: jax.Array                     # float8_e4m3fn [O, I]
    scale: jax.Array                 # float32 [ceil(O/bo), ceil(I/bi)]
    block: tuple[int, int] = DEFAULT_BLOCK
    impl: str = "reference"

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.q.shape)


jax.tree_util.register_dataclass(Fp8Weight, data_fields=["q", "scale"],
                                 meta_fields=["block", "impl"])


def is_fp8(x) -> bool:
    return isinstance(x, Fp8Weight)


def fp8_dense(x, w: Fp8Weight):
    """y = x @ dequant(w).T: x [..., I] -> [..., O] in x.dtype (f32 accumulation)."""
    from pallas_kernels.fp8_matmul import fp8_matmul, fp8_matmul_reference
    if w.impl == "reference":
        return fp8_matmul_reference(x, w.q, w.scale, w.block)
    return fp8_matmul(x, w.q, w.scale, w.block, interpret=w.impl == "interpret")


def set_impl(tree, impl: str):
    """The same tree with every Fp8Weight's matmul set to impl (see IMPLS)."""
    if impl not in IMPLS:
        raise ValueError(f"fp8 matmul impl must be one of {IMPLS}, got {impl!r}")
    return jax.tree.map(lambda w: dataclasses.replace(w, impl=impl) if is_fp8(w) else w, tree,
                        is_leaf=is_fp8)


def has_fp8(tree) -> bool:
    return any(is_fp8(x) for x in jax.tree.leaves(tree, is_leaf=is_fp8))


# ------------------------------------------------------------------------------------------
# Host-side (numpy) quantization and dequantization
# ------------------------------------------------------------------------------------------

def expand_scale(scale: np.ndarray, block: tuple[int, int], shape: tuple[int, int]) -> np.ndarray:
    """[nbo, nbi] block scales -> [O, I] per element (host; for references and dequantizing)."""
    bo, bi = block
    return np.repeat(np.repeat(scale, bo, axis=0), bi, axis=1)[:shape[0], :shape[1]]


def dequantize(q: np.ndarray, scale: np.ndarray, block: tuple[int, int],
               dtype=np.float64) -> np.ndarray:
    """The weight an FP8 tensor stands for, q * scale block by block, computed in float64."""
    w = q.astype(np.float64) * expand_scale(np.asarray(scale, np.float64), block, q.shape)
    return w.astype(dtype)


def quantize(w: np.ndarray, block: tuple[int, int] = DEFAULT_BLOCK
             ) -> tuple[np.ndarray, np.ndarray]:
    """Block-wise FP8 of a 2-D weight: scale = block amax / 448 (1 for all-zero blocks), q =
    round-to-nearest-even(w / scale). Returns (q float8_e4m3fn [O, I], scale float32)."""
    w = np.asarray(w, np.float32)
    if w.ndim != 2:
        raise QuantError(f"only 2-D weights are quantized, got shape {w.shape}")
    bo, bi = block
    O, I = w.shape
    nbo, nbi = -(-O // bo), -(-I // bi)
    pad = np.zeros((nbo * bo, nbi * bi), np.float32)
    pad[:O, :I] = np.abs(w)
    amax = pad.reshape(nbo, bo, nbi, bi).max(axis=(1, 3))
    scale = np.where(amax > 0, amax / FP8_MAX, 1.0).astype(np.float32)
    scaled = w / expand_scale(scale, block, w.shape)
    q = np.clip(scaled, -FP8_MAX, FP8_MAX).astype(FP8)
    return q, scale


def fuse(parts: list[tuple[np.ndarray, np.ndarray, tuple[int, int]]]
         ) -> tuple[np.ndarray, np.ndarray, tuple[int, int]]:
    """Stack FP8 parts (q, scale, block) by rows into one leaf (fused projections).

    Keeps block scales when every part but the last fills whole block rows; otherwise
    expands them to one scale row per weight row (block (1, bi)), which is exact.
    """
    blocks = {b for _, _, b in parts}
    ins = {q.shape[1] for q, _, _ in parts}
    if len(ins) != 1:
        raise QuantError(f"fused FP8 parts have different input sizes {sorted(ins)}")
    bis = {b[1] for b in blocks}
    if len(bis) != 1:
        raise QuantError(f"fused FP8 parts have different input block sizes {sorted(bis)}")
    bi = bis.pop()
    q = np.concatenate([p[0] for p in parts], axis=0)
    if len(blocks) == 1:
        bo = next(iter(blocks))[0]
        if all(p[0].shape[0] % bo == 0 for p in parts[:-1]):
            return q, np.concatenate([p[1] for p in parts], axis=0).astype(np.float32), (bo, bi)
    rows = [np.repeat(s, b[0], axis=0)[:p.shape[0]] for p, s, b in parts]
    return q, np.concatenate(rows, axis=0).astype(np.float32), (1, bi)


# ------------------------------------------------------------------------------------------
# Checkpoint formats
# ------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Scheme:
    """How a quantized checkpoint stores its FP8 weights (from config.json)."""
    method: str                       # "fp8" (Qwen / DeepSeek block-wise) | "compressed-tensors"
    scale_suffix: str                 # tensor name suffix of the scale replacing ".weight"
    strategy: str                     # "block" | "channel" | "tensor"
    block: tuple[int, int] | None     # for "block"
    not_converted: tuple[str, ...]    # modules_to_not_convert / ignore (informational)

    def block_for(self, shape: tuple[int, int]) -> tuple[int, int]:
        if self.strategy == "block":
            return self.block
        if self.strategy == "channel":
            return (1, shape[1])
        return (shape[0], shape[1])

    def scale_shape(self, shape: tuple[int, int]) -> tuple[int, int]:
        bo, bi = self.block_for(shape)
        return (-(-shape[0] // bo), -(-shape[1] // bi))


def scheme_from_config(raw: Mapping[str, Any]) -> Scheme | None:
    """Parse config.json's `quantization_config` (top level, or under text_config); None when
    the checkpoint is not quantized. Raises QuantError on a method or format it cannot load."""
    qc = raw.get("quantization_config")
    if qc is None and isinstance(raw.get("text_config"), Mapping):
        qc = raw["text_config"].get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, Mapping):
        raise QuantError("config key 'quantization_config': not an object")
    method = qc.get("quant_method")
    if method == "fp8":
        fmt = qc.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise QuantError(f"quantization_config 'fmt': only 'e4m3' is supported, got {fmt!r}")
        bs = qc.get("weight_block_size")
        if bs is None:
            strategy, block = "tensor", None
        else:
            if not (isinstance(bs, (list, tuple)) and len(bs) == 2
                    and all(isinstance(b, int) and b > 0 for b in bs)):
                raise QuantError(f"quantization_config 'weight_block_size': expected two positive "
                                 f"ints, got {bs!r}")
            strategy, block = "block", (int(bs[0]), int(bs[1]))
        return Scheme("fp8", "weight_scale_inv", strategy, block,
                      tuple(qc.get("modules_to_not_convert") or ()))
    if method == "compressed-tensors":
        groups = qc.get("config_groups") or {}
        if not isinstance(groups, Mapping) or len(groups) != 1:
            raise QuantError("quantization_config 'config_groups': exactly one group is "
                             f"supported, got {len(groups) if isinstance(groups, Mapping) else groups!r}")
        w = next(iter(groups.values())).get("weights") or {}
        if w.get("type") != "float" or int(w.get("num_bits", 0)) != 8:
            raise QuantError(f"compressed-tensors weights: only 8-bit float (FP8) is supported, "
                             f"got type={w.get('type')!r} num_bits={w.get('num_bits')!r}")
        strategy = w.get("strategy")
        block = None
        if strategy == "block":
            bs = w.get("block_structure")
            if not (isinstance(bs, (list, tuple)) and len(bs) == 2):
                raise QuantError(f"compressed-tensors 'block_structure': expected [rows, cols], "
                                 f"got {bs!r}")
            block = (int(bs[0]), int(bs[1]))
        elif strategy not in ("channel", "tensor"):
            raise QuantError(f"compressed-tensors weight strategy {strategy!r} is not supported "
                             "(channel, tensor or block)")
        return Scheme("compressed-tensors", "weight_scale", strategy, block,
                      tuple(qc.get("ignore") or ()))
    raise QuantError(f"quantization_config 'quant_method': {method!r} is not supported "
                     "(supported: 'fp8', 'compressed-tensors')")


def scheme_config(scheme: Scheme) -> dict[str, Any]:
    """The config.json `quantization_config` object for a scheme (the checkpoint writer's)."""
    if scheme.method == "fp8":
        out = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
               "modules_to_not_convert": list(scheme.not_converted)}
        if scheme.strategy == "block":
            out["weight_block_size"] = list(scheme.block)
        return out
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False,
               "strategy": scheme.strategy}
    if scheme.strategy == "block":
        weights["block_structure"] = list(scheme.block)
    return {"quant_method": "compressed-tensors", "format": "float-quantized",
            "config_groups": {"group_0": {
                "targets": ["Linear"], "weights": weights,
                "input_activations": {"num_bits": 8, "type": "float", "strategy": "token",
                                      "dynamic": True, "symmetric": True}}},
            "ignore": list(scheme.not_converted)}


QWEN_FP8 = Scheme("fp8", "weight_scale_inv", "block", DEFAULT_BLOCK, ())
COMPRESSED_FP8_DYNAMIC = Scheme("compressed-tensors", "weight_scale", "channel", None, ())


def check_weights_option(weights: str, mtp_weights: str) -> None:
    if weights not in WEIGHTS:
        raise QuantError(f"weights must be one of {WEIGHTS}, got {weights!r}")
    if mtp_weights not in WEIGHTS:
        raise QuantError(f"mtp_weights must be one of {WEIGHTS}, got {mtp_weights!r}")
