"""Parameter pytrees for Qwen3.5 + MTP, their abstract shapes, and the HF tensor-name map.

Layout: one pytree per decoder layer, in model order (`Params.layers`), and projections that
read the same input fused into one matrix at load time:

  attention  qkv      = [q_proj (query+gate interleaved per head) | k_proj | v_proj]
  GDN        in_proj  = [in_proj_qkv | in_proj_z | in_proj_b | in_proj_a]
  MLP        gate_up  = [gate_proj | up_proj]

Why per-layer arrays and not stacked `[n_layers, ...]` leaves under a `lax.scan`: compiled for
the GPU, slicing a layer out of a stacked weight inside the step program became a
device-to-device copy of every weight every step (97 GB per 27B step against a 51 GB weight
floor, see ../shared/notes/h200_aot.md). A Python loop over per-layer arrays hands each GEMM
its weight buffer as is. Why fused: XLA's dot merger otherwise concatenates the projections
that share an input into a fresh matrix per layer per step; a matrix fused once at load time
is read in place by one GEMM.

Linear weights keep the PyTorch/HF orientation `[out, in]` (y = x @ W.T, done with einsum), so
loading a checkpoint is a copy into rows of a leaf, never a transpose on the host.

`hf_tensor_map(cfg)` is the single source of truth tying every checkpoint tensor name to a leaf
of `Params` (a path, and a row range for fused leaves), with its expected shape. Loading,
saving, parameter counting and the tests all go through it.
"""

from __future__ import annotations

import dataclasses
from typing import Iterator, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from mtpjax.config import FULL, Config


def _pytree(cls):
    """Register a dataclass as a pytree whose fields are all children."""
    cls = dataclasses.dataclass(frozen=True)(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    return jax.tree_util.register_dataclass(cls, data_fields=names, meta_fields=[])


@_pytree
class MlpParams:
    gate_up: jax.Array    # [2I, H]  rows [gate_proj | up_proj]
    down_proj: jax.Array  # [H, I]


@_pytree
class AttnParams:
    qkv: jax.Array     # [2*NQ*HD + 2*NKV*HD, H]  rows [q_proj | k_proj | v_proj]; q_proj holds
                       # query and sigmoid gate interleaved per head (spec §3.4)
    o_proj: jax.Array  # [H, NQ*HD]
    q_norm: jax.Array  # [HD]  1+w
    k_norm: jax.Array  # [HD]  1+w


@_pytree
class GdnParams:
    in_proj: jax.Array      # [CONV_DIM + NV*DV + 2*NV, H]  rows [qkv | z | b | a]; qkv rows [q | k | v]
    conv1d: jax.Array       # [CONV_DIM, 1, KC]  tap KC-1 = current token
    A_log: jax.Array        # [NV]   kept float32 whatever the model dtype (spec gotcha 11/15)
    dt_bias: jax.Array      # [NV]
    norm: jax.Array         # [DV]   plain weight (not 1+w)
    out_proj: jax.Array     # [H, NV*DV]
    # [2*NV, H] rows [b | a], only when in_proj is FP8 (then in_proj is [qkv | z]): b and a
    # stay in the model dtype (see quant.py). None otherwise.
    in_proj_ba: jax.Array | None = None


@_pytree
class FullLayer:
    """A decoder layer with gated full attention."""
    input_layernorm: jax.Array           # [H]
    post_attention_layernorm: jax.Array  # [H]
    attn: AttnParams
    mlp: MlpParams


@_pytree
class LinearLayer:
    """A decoder layer with a Gated DeltaNet mixer."""
    input_layernorm: jax.Array
    post_attention_layernorm: jax.Array
    gdn: GdnParams
    mlp: MlpParams


@_pytree
class MtpParams:
    pre_fc_norm_embedding: jax.Array  # [H] 1+w
    pre_fc_norm_hidden: jax.Array     # [H] 1+w
    fc: jax.Array                     # [H, 2H]  columns [embedding half | hidden half]
    layer: FullLayer                  # one full-attention layer
    norm: jax.Array                   # [H] 1+w


@_pytree
class DraftHead:
    """The MTP's draft head over a draft vocabulary (mtpjax/draft_vocab.py): the lm_head rows
    of N token ids, gathered at load time, so a draft's argmax reads N x H, not V x H. Not a
    checkpoint tensor: built by the engine from the lm_head it loaded (so it is in the
    lm_head's dtype) and a token-id list; rows padded to a multiple of tp (id -1, zero row),
    split by rows over the tp shards like the lm_head's vocabulary."""
    weight: jax.Array  # [N, H]  lm_head rows of `ids` (of the embedding when tied)
    ids: jax.Array     # i32[N]  ascending token ids; -1: padding (never drafted)


@_pytree
class Params:
    embed: jax.Array              # [V, H]
    final_norm: jax.Array         # [H] 1+w
    lm_head: jax.Array | None     # [V, H]; None when tied to `embed`
    layers: tuple                 # FullLayer | LinearLayer per decoder layer, model order
    mtp: MtpParams | None
    draft: DraftHead | None = None  # the draft vocabulary's head; None: drafts over all of V


# Leaves that stay float32 whatever dtype the model runs in. A_log is exponentiated into the
# decay rate and HF notes that a low-precision A_log gives -inf (spec gotcha 11, 15).
FLOAT32_LEAVES = ("A_log",)


class TensorSpec(NamedTuple):
    """One checkpoint tensor: where it goes in `Params` and the shape it must have."""
    name: str                    # HF name without the text prefix, e.g. "layers.3.self_attn.q_proj.weight"
    path: tuple                  # path into Params, e.g. ("layers", 3, "attn", "qkv")
    rows: tuple[int, int] | None  # row range of a fused leaf, None when the tensor is the leaf
    shape: tuple[int, ...]       # the stored tensor's shape


def _fused(prefix: str, path: tuple, parts):
    """Specs of tensors stacked by rows into one leaf: parts = [(name, rows, in_dim)]."""
    off = 0
    for name, n, d in parts:
        yield TensorSpec(prefix + name, path, (off, off + n), (n, d))
        off += n


def _mlp_specs(cfg: Config, prefix: str, path: tuple):
    h, i = cfg.hidden_size, cfg.intermediate_size
    yield from _fused(prefix, path + ("mlp", "gate_up"),
                      [("mlp.gate_proj.weight", i, h), ("mlp.up_proj.weight", i, h)])
    yield TensorSpec(prefix + "mlp.down_proj.weight", path + ("mlp", "down_proj"), None, (h, i))


def _norm_specs(cfg: Config, prefix: str, path: tuple):
    h = cfg.hidden_size
    yield TensorSpec(prefix + "input_layernorm.weight", path + ("input_layernorm",), None, (h,))
    yield TensorSpec(prefix + "post_attention_layernorm.weight",
                     path + ("post_attention_layernorm",), None, (h,))


def _full_layer_specs(cfg: Config, prefix: str, path: tuple):
    h, nq, nkv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    yield from _norm_specs(cfg, prefix, path)
    a = path + ("attn",)
    yield from _fused(prefix, a + ("qkv",), [("self_attn.q_proj.weight", 2 * nq * hd, h),
                                             ("self_attn.k_proj.weight", nkv * hd, h),
                                             ("self_attn.v_proj.weight", nkv * hd, h)])
    yield TensorSpec(prefix + "self_attn.o_proj.weight", a + ("o_proj",), None, (h, nq * hd))
    yield TensorSpec(prefix + "self_attn.q_norm.weight", a + ("q_norm",), None, (hd,))
    yield TensorSpec(prefix + "self_attn.k_norm.weight", a + ("k_norm",), None, (hd,))
    yield from _mlp_specs(cfg, prefix, path)


def _linear_layer_specs(cfg: Config, prefix: str, path: tuple, split_ba: bool = False):
    h, nv, dv = cfg.hidden_size, cfg.linear_num_value_heads, cfg.linear_value_head_dim
    yield from _norm_specs(cfg, prefix, path)
    g = path + ("gdn",)
    la = "linear_attn."
    qkvz = [(la + "in_proj_qkv.weight", cfg.conv_dim, h), (la + "in_proj_z.weight", nv * dv, h)]
    ba = [(la + "in_proj_b.weight", nv, h), (la + "in_proj_a.weight", nv, h)]
    if split_ba:
        yield from _fused(prefix, g + ("in_proj",), qkvz)
        yield from _fused(prefix, g + ("in_proj_ba",), ba)
    else:
        yield from _fused(prefix, g + ("in_proj",), qkvz + ba)
    yield TensorSpec(prefix + la + "conv1d.weight", g + ("conv1d",), None,
                     (cfg.conv_dim, 1, cfg.linear_conv_kernel_dim))
    yield TensorSpec(prefix + la + "A_log", g + ("A_log",), None, (nv,))
    yield TensorSpec(prefix + la + "dt_bias", g + ("dt_bias",), None, (nv,))
    yield TensorSpec(prefix + la + "norm.weight", g + ("norm",), None, (dv,))
    yield from _mlp_specs(cfg, prefix, path)
    yield TensorSpec(prefix + la + "out_proj.weight", g + ("out_proj",), None, (h, nv * dv))


def hf_tensor_map(cfg: Config, split_ba: bool = False) -> Iterator[TensorSpec]:
    """Every tensor a Qwen3.5 text checkpoint (+ MTP) holds, in a canonical order.

    Names are relative to the text prefix for text tensors ("embed_tokens.weight", "layers.N...",
    "norm.weight"); "lm_head.weight" and "mtp.*" are top-level names. split_ba: the GDN b and
    a projections go to their own leaf `in_proj_ba` (FP8 layout, see quant.py).
    """
    h, v = cfg.hidden_size, cfg.vocab_size
    yield TensorSpec("embed_tokens.weight", ("embed",), None, (v, h))
    for i, kind in enumerate(cfg.layer_types):
        if kind == FULL:
            yield from _full_layer_specs(cfg, f"layers.{i}.", ("layers", i))
        else:
            yield from _linear_layer_specs(cfg, f"layers.{i}.", ("layers", i), split_ba)
    yield TensorSpec("norm.weight", ("final_norm",), None, (h,))
    if not cfg.tie_word_embeddings:
        yield TensorSpec("lm_head.weight", ("lm_head",), None, (v, h))
    if cfg.has_mtp:
        m = ("mtp",)
        yield TensorSpec("mtp.pre_fc_norm_embedding.weight", m + ("pre_fc_norm_embedding",), None, (h,))
        yield TensorSpec("mtp.pre_fc_norm_hidden.weight", m + ("pre_fc_norm_hidden",), None, (h,))
        yield TensorSpec("mtp.fc.weight", m + ("fc",), None, (h, 2 * h))
        yield from _full_layer_specs(cfg, "mtp.layers.0.", m + ("layer",))
        yield TensorSpec("mtp.norm.weight", m + ("norm",), None, (h,))


def leaf_shapes(cfg: Config, split_ba: bool = False) -> dict[tuple, tuple[int, ...]]:
    """Params leaf path -> leaf shape (fused leaves: the row ranges of their tensors summed)."""
    out: dict[tuple, tuple[int, ...]] = {}
    for s in hf_tensor_map(cfg, split_ba):
        if s.rows is None:
            out[s.path] = s.shape
        else:
            rows = max(s.rows[1], out.get(s.path, (0,))[0])
            out[s.path] = (rows,) + s.shape[1:]
    return out


def leaf_dtype(spec_path: tuple[str, ...], dtype) -> jnp.dtype:
    return jnp.dtype(jnp.float32) if spec_path[-1] in FLOAT32_LEAVES else jnp.dtype(dtype)


def _build(cfg: Config, leaf_fn, split_ba: bool = False) -> Params:
    """Assemble a Params tree; leaf_fn(path, shape) -> leaf, for every leaf path."""
    leaves = {p: leaf_fn(p, s) for p, s in leaf_shapes(cfg, split_ba).items()}

    def sub(prefix: tuple, cls):
        kw = {}
        for f in dataclasses.fields(cls):
            p = prefix + (f.name,)
            if p in leaves:
                kw[f.name] = leaves[p]
            elif (cls, f.name) in _CHILD_TYPES:
                kw[f.name] = sub(p, _CHILD_TYPES[(cls, f.name)])
            # else: an optional leaf this layout does not have (GdnParams.in_proj_ba)
        return cls(**kw)

    layers = tuple(sub(("layers", i), FullLayer if kind == FULL else LinearLayer)
                   for i, kind in enumerate(cfg.layer_types))
    return Params(
        embed=leaves[("embed",)],
        final_norm=leaves[("final_norm",)],
        lm_head=leaves.get(("lm_head",)),
        layers=layers,
        mtp=sub(("mtp",), MtpParams) if cfg.has_mtp else None,
    )


_CHILD_TYPES = {
    (FullLayer, "attn"): AttnParams, (FullLayer, "mlp"): MlpParams,
    (LinearLayer, "gdn"): GdnParams, (LinearLayer, "mlp"): MlpParams,
    (MtpParams, "layer"): FullLayer,
}


def fp8_paths(cfg: Config, weights: str = "dense", mtp_weights: str = "dense") -> frozenset:
    """Leaf paths that hold an FP8 weight when quantizing at load time (quant.py's set):
    weights "fp8" -> every linear of quant.FP8_LEAVES, the MTP head's only if mtp_weights is
    "fp8"; "dense" -> none."""
    from mtpjax.quant import FP8_LEAVES
    if weights != "fp8":
        return frozenset()
    return frozenset(p for p in leaf_shapes(cfg, split_ba=True)
                     if p[-1] in FP8_LEAVES and (p[0] != "mtp" or mtp_weights == "fp8"))


def fp8_block(cfg: Config, path: tuple, split_ba: bool = True, block=None) -> tuple[int, int]:
    """The block an FP8 leaf has after fusing its parts (quant.fuse): the checkpoint block if
    every part but the last fills whole block rows, else one scale row per weight row."""
    from mtpjax.quant import DEFAULT_BLOCK
    bo, bi = block or DEFAULT_BLOCK
    parts = [s for s in hf_tensor_map(cfg, split_ba) if s.path == path]
    ok = all((s.rows is None or s.rows[1] - s.rows[0]) % bo == 0 for s in parts[:-1])
    return (bo, bi) if ok else (1, bi)


def abstract_params(cfg: Config, dtype="bfloat16", fp8: frozenset = frozenset()) -> Params:
    """ShapeDtypeStructs for every leaf: drives eval_shape, orbax restore and counting.
    fp8: leaf paths stored as quant.Fp8Weight (see fp8_paths), with 128 x 128 blocks."""
    from mtpjax.quant import FP8, Fp8Weight
    split = any(p[-1] == "in_proj" for p in fp8)

    def leaf(path, shape):
        if path not in fp8:
            return jax.ShapeDtypeStruct(shape, leaf_dtype(path, dtype))
        bo, bi = fp8_block(cfg, path, split)
        return Fp8Weight(jax.ShapeDtypeStruct(shape, FP8),
                         jax.ShapeDtypeStruct((-(-shape[0] // bo), -(-shape[1] // bi)),
                                              jnp.float32), (bo, bi))
    return _build(cfg, leaf, split)


def init_params(cfg: Config, key: jax.Array, dtype="float32", scale: float = 0.02) -> Params:
    """Random params (tests, synthetic benchmarks, training from scratch).

    Norm weights are perturbed away from their HF init (0 for 1+w norms, 1 for the gated norm)
    so that a dropped `1+` or a wrong norm shows up in parity tests.
    """
    counter = [0]

    def leaf(path, shape):
        counter[0] += 1
        k = jax.random.fold_in(key, counter[0])
        name = path[-1]
        dt = leaf_dtype(path, dtype)
        if name == "A_log":
            x = jnp.log(jax.random.uniform(k, shape, minval=1.0, maxval=16.0))
        elif name == "dt_bias":
            x = jax.random.uniform(k, shape, minval=-1.0, maxval=1.0)
        elif name == "norm" and path[-2] == "gdn":
            x = 1.0 + 0.1 * jax.random.normal(k, shape)
        elif len(shape) == 1:  # 1+w norms
            x = 0.1 * jax.random.normal(k, shape)
        elif name == "conv1d":
            x = jax.random.normal(k, shape) * (1.0 / np.sqrt(shape[-1]))
        else:
            x = jax.random.normal(k, shape) * scale
        return x.astype(dt)
    return _build(cfg, leaf)


def count_params(tree: Params) -> int:
    return int(sum(np.prod(x.shape) for x in jax.tree.leaves(tree)))


def get_path(tree, path: tuple):
    """Follow a leaf path: names are attributes, ints index tuples (Params.layers)."""
    for p in path:
        tree = tree[p] if isinstance(p, int) else getattr(tree, p)
    return tree


def replace_path(tree, path: tuple, value):
    head, rest = path[0], path[1:]
    child = get_path(tree, (head,))
    new = value if not rest else replace_path(child, rest, value)
    if isinstance(head, int):
        return tree[:head] + (new,) + tree[head + 1:]
    return dataclasses.replace(tree, **{head: new})
