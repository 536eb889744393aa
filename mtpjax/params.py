"""Parameter pytrees for Qwen3.5 + MTP, their abstract shapes, and the HF tensor-name map.

Layers of the same kind are *stacked* along a leading axis (all Gated DeltaNet layers in one
pytree, all full-attention layers in another) so that the forward pass is a `lax.scan` over
repeats of the layer pattern: compile time then does not grow with depth (64 layers for 27B).

Linear weights keep the PyTorch/HF orientation `[out, in]` (y = x @ W.T, done with einsum), so
loading a checkpoint is a copy, never a transpose of a 2.5 GB matrix on the host.

`hf_tensor_map(cfg)` is the single source of truth tying every checkpoint tensor name to a leaf
of `Params` (and a row of a stacked leaf), with its expected shape. Loading, saving, parameter
counting and the tests all go through it.
"""

from __future__ import annotations

import dataclasses
from typing import Iterator, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from mtpjax.config import Config


def _pytree(cls):
    """Register a dataclass as a pytree whose fields are all children."""
    cls = dataclasses.dataclass(frozen=True)(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    return jax.tree_util.register_dataclass(cls, data_fields=names, meta_fields=[])


@_pytree
class MlpParams:
    gate_proj: jax.Array  # [I, H]
    up_proj: jax.Array    # [I, H]
    down_proj: jax.Array  # [H, I]


@_pytree
class AttnParams:
    q_proj: jax.Array  # [2*NQ*HD, H]  query and sigmoid gate, interleaved per head (spec §3.4)
    k_proj: jax.Array  # [NKV*HD, H]
    v_proj: jax.Array  # [NKV*HD, H]
    o_proj: jax.Array  # [H, NQ*HD]
    q_norm: jax.Array  # [HD]  1+w
    k_norm: jax.Array  # [HD]  1+w


@_pytree
class GdnParams:
    in_proj_qkv: jax.Array  # [2*NK*DK + NV*DV, H]  rows [q | k | v]
    in_proj_z: jax.Array    # [NV*DV, H]
    in_proj_b: jax.Array    # [NV, H]
    in_proj_a: jax.Array    # [NV, H]
    conv1d: jax.Array       # [CONV_DIM, 1, KC]  tap KC-1 = current token
    A_log: jax.Array        # [NV]   kept float32 whatever the model dtype (spec gotcha 11/15)
    dt_bias: jax.Array      # [NV]
    norm: jax.Array         # [DV]   plain weight (not 1+w)
    out_proj: jax.Array     # [H, NV*DV]


@_pytree
class FullLayer:
    """A decoder layer with gated full attention. Stacked: every leaf has a leading [n] axis."""
    input_layernorm: jax.Array           # [(n,) H]
    post_attention_layernorm: jax.Array  # [(n,) H]
    attn: AttnParams
    mlp: MlpParams


@_pytree
class LinearLayer:
    """A decoder layer with a Gated DeltaNet mixer. Stacked like FullLayer."""
    input_layernorm: jax.Array
    post_attention_layernorm: jax.Array
    gdn: GdnParams
    mlp: MlpParams


@_pytree
class MtpParams:
    pre_fc_norm_embedding: jax.Array  # [H] 1+w
    pre_fc_norm_hidden: jax.Array     # [H] 1+w
    fc: jax.Array                     # [H, 2H]  columns [embedding half | hidden half]
    layer: FullLayer                  # one full-attention layer, not stacked
    norm: jax.Array                   # [H] 1+w


@_pytree
class Params:
    embed: jax.Array              # [V, H]
    final_norm: jax.Array         # [H] 1+w
    lm_head: jax.Array | None     # [V, H]; None when tied to `embed`
    full: FullLayer               # stacked over the full-attention layers
    linear: LinearLayer           # stacked over the Gated DeltaNet layers
    mtp: MtpParams | None


# Leaves that stay float32 whatever dtype the model runs in. A_log is exponentiated into the
# decay rate and HF notes that a low-precision A_log gives -inf (spec gotcha 11, 15).
FLOAT32_LEAVES = ("A_log",)


class TensorSpec(NamedTuple):
    """One checkpoint tensor: where it goes in `Params` and the shape it must have."""
    name: str                 # HF name without the text prefix, e.g. "layers.3.self_attn.q_proj.weight"
    path: tuple[str, ...]     # attribute path into Params, e.g. ("full", "attn", "q_proj")
    index: int | None         # row of the stacked leaf, or None for unstacked leaves
    shape: tuple[int, ...]


def _mlp_specs(cfg: Config):
    h, i = cfg.hidden_size, cfg.intermediate_size
    yield "mlp.gate_proj.weight", ("mlp", "gate_proj"), (i, h)
    yield "mlp.up_proj.weight", ("mlp", "up_proj"), (i, h)
    yield "mlp.down_proj.weight", ("mlp", "down_proj"), (h, i)


def _full_layer_specs(cfg: Config):
    h, nq, nkv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    yield "input_layernorm.weight", ("input_layernorm",), (h,)
    yield "post_attention_layernorm.weight", ("post_attention_layernorm",), (h,)
    yield "self_attn.q_proj.weight", ("attn", "q_proj"), (2 * nq * hd, h)
    yield "self_attn.k_proj.weight", ("attn", "k_proj"), (nkv * hd, h)
    yield "self_attn.v_proj.weight", ("attn", "v_proj"), (nkv * hd, h)
    yield "self_attn.o_proj.weight", ("attn", "o_proj"), (h, nq * hd)
    yield "self_attn.q_norm.weight", ("attn", "q_norm"), (hd,)
    yield "self_attn.k_norm.weight", ("attn", "k_norm"), (hd,)
    yield from _mlp_specs(cfg)


def _linear_layer_specs(cfg: Config):
    h, nv, dv = cfg.hidden_size, cfg.linear_num_value_heads, cfg.linear_value_head_dim
    yield "input_layernorm.weight", ("input_layernorm",), (h,)
    yield "post_attention_layernorm.weight", ("post_attention_layernorm",), (h,)
    yield "linear_attn.in_proj_qkv.weight", ("gdn", "in_proj_qkv"), (cfg.conv_dim, h)
    yield "linear_attn.in_proj_z.weight", ("gdn", "in_proj_z"), (nv * dv, h)
    yield "linear_attn.in_proj_b.weight", ("gdn", "in_proj_b"), (nv, h)
    yield "linear_attn.in_proj_a.weight", ("gdn", "in_proj_a"), (nv, h)
    yield "linear_attn.conv1d.weight", ("gdn", "conv1d"), (cfg.conv_dim, 1, cfg.linear_conv_kernel_dim)
    yield "linear_attn.A_log", ("gdn", "A_log"), (nv,)
    yield "linear_attn.dt_bias", ("gdn", "dt_bias"), (nv,)
    yield "linear_attn.norm.weight", ("gdn", "norm"), (dv,)
    yield from _mlp_specs(cfg)
    yield "linear_attn.out_proj.weight", ("gdn", "out_proj"), (h, nv * dv)


def hf_tensor_map(cfg: Config) -> Iterator[TensorSpec]:
    """Every tensor a Qwen3.5 text checkpoint (+ MTP) holds, in a canonical order.

    Names are relative to the text prefix for text tensors ("embed_tokens.weight", "layers.N...",
    "norm.weight"); "lm_head.weight" and "mtp.*" are top-level names.
    """
    h, v = cfg.hidden_size, cfg.vocab_size
    yield TensorSpec("embed_tokens.weight", ("embed",), None, (v, h))
    for layer_id, kind in enumerate(cfg.layer_types):
        if kind == "full_attention":
            stack, idx, specs = "full", cfg.full_layer_ids.index(layer_id), _full_layer_specs(cfg)
        else:
            stack, idx, specs = "linear", cfg.linear_layer_ids.index(layer_id), _linear_layer_specs(cfg)
        for name, path, shape in specs:
            yield TensorSpec(f"layers.{layer_id}.{name}", (stack,) + path, idx, shape)
    yield TensorSpec("norm.weight", ("final_norm",), None, (h,))
    if not cfg.tie_word_embeddings:
        yield TensorSpec("lm_head.weight", ("lm_head",), None, (v, h))
    if cfg.has_mtp:
        yield TensorSpec("mtp.pre_fc_norm_embedding.weight", ("mtp", "pre_fc_norm_embedding"), None, (h,))
        yield TensorSpec("mtp.pre_fc_norm_hidden.weight", ("mtp", "pre_fc_norm_hidden"), None, (h,))
        yield TensorSpec("mtp.fc.weight", ("mtp", "fc"), None, (h, 2 * h))
        for name, path, shape in _full_layer_specs(cfg):
            yield TensorSpec(f"mtp.layers.0.{name}", ("mtp", "layer") + path, None, shape)
        yield TensorSpec("mtp.norm.weight", ("mtp", "norm"), None, (h,))


def leaf_dtype(spec_path: tuple[str, ...], dtype) -> jnp.dtype:
    return jnp.dtype(jnp.float32) if spec_path[-1] in FLOAT32_LEAVES else jnp.dtype(dtype)


def _build(cfg: Config, leaf_fn) -> Params:
    """Assemble a Params tree; leaf_fn(path, stacked_count_or_None, shape, spec) -> leaf."""
    leaves: dict[tuple[str, ...], object] = {}
    counts = {"full": cfg.num_full_layers, "linear": cfg.num_linear_layers}
    for spec in hf_tensor_map(cfg):
        if spec.path in leaves:
            continue
        n = counts[spec.path[0]] if spec.index is not None else None
        leaves[spec.path] = leaf_fn(spec.path, n, spec.shape)

    def sub(prefix: tuple[str, ...], cls):
        kw = {}
        for f in dataclasses.fields(cls):
            p = prefix + (f.name,)
            if p in leaves:
                kw[f.name] = leaves[p]
            else:
                kw[f.name] = sub(p, _CHILD_TYPES[(cls, f.name)])
        return cls(**kw)

    full = sub(("full",), FullLayer) if cfg.num_full_layers else _empty_stack(cfg, FullLayer)
    linear = sub(("linear",), LinearLayer) if cfg.num_linear_layers else _empty_stack(cfg, LinearLayer)
    return Params(
        embed=leaves[("embed",)],
        final_norm=leaves[("final_norm",)],
        lm_head=leaves.get(("lm_head",)),
        full=full,
        linear=linear,
        mtp=sub(("mtp",), MtpParams) if cfg.has_mtp else None,
    )


_CHILD_TYPES = {
    (FullLayer, "attn"): AttnParams, (FullLayer, "mlp"): MlpParams,
    (LinearLayer, "gdn"): GdnParams, (LinearLayer, "mlp"): MlpParams,
    (MtpParams, "layer"): FullLayer,
}


def _empty_stack(cfg: Config, cls):
    raise NotImplementedError(
        f"configs without any {'full-attention' if cls is FullLayer else 'linear-attention'} "
        "layer are not supported")


def abstract_params(cfg: Config, dtype="bfloat16") -> Params:
    """ShapeDtypeStructs for every leaf: drives eval_shape, orbax restore and counting."""
    def leaf(path, n, shape):
        full_shape = (n,) + shape if n is not None else shape
        return jax.ShapeDtypeStruct(full_shape, leaf_dtype(path, dtype))
    return _build(cfg, leaf)


def init_params(cfg: Config, key: jax.Array, dtype="float32", scale: float = 0.02) -> Params:
    """Random params (tests, synthetic benchmarks, training from scratch).

    Norm weights are perturbed away from their HF init (0 for 1+w norms, 1 for the gated norm)
    so that a dropped `1+` or a wrong norm shows up in parity tests.
    """
    counter = [0]

    def leaf(path, n, shape):
        counter[0] += 1
        k = jax.random.fold_in(key, counter[0])
        full_shape = (n,) + shape if n is not None else shape
        name = path[-1]
        dt = leaf_dtype(path, dtype)
        if name == "A_log":
            x = jnp.log(jax.random.uniform(k, full_shape, minval=1.0, maxval=16.0))
        elif name == "dt_bias":
            x = jax.random.uniform(k, full_shape, minval=-1.0, maxval=1.0)
        elif name == "norm" and path[-2] == "gdn":
            x = 1.0 + 0.1 * jax.random.normal(k, full_shape)
        elif len(shape) == 1:  # 1+w norms
            x = 0.1 * jax.random.normal(k, full_shape)
        elif name == "conv1d":
            x = jax.random.normal(k, full_shape) * (1.0 / np.sqrt(shape[-1]))
        else:
            x = jax.random.normal(k, full_shape) * scale
        return x.astype(dt)
    return _build(cfg, leaf)


def count_params(tree: Params) -> int:
    return int(sum(np.prod(x.shape) for x in jax.tree.leaves(tree)))


def get_path(tree, path: tuple[str, ...]):
    for p in path:
        tree = getattr(tree, p)
    return tree


def replace_path(tree, path: tuple[str, ...], value):
    if len(path) == 1:
        return dataclasses.replace(tree, **{path[0]: value})
    child = getattr(tree, path[0])
    return dataclasses.replace(tree, **{path[0]: replace_path(child, path[1:], value)})
