"""Public entry points for the model: checkpoint loading and teacher-forced logits."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from mtpjax import model
from mtpjax.config import Config
from mtpjax.params import Params

DTYPES = ("float32", "bfloat16")


def load_checkpoint(path: str, dtype: str = "float32", meshes=None, weights: str = "auto",
                    mtp_weights: str = "auto"):
    """(cfg, params) from an HF checkpoint folder or an orbax folder made by `convert`.

    meshes: None (params on the default device), or a list of tensor-parallel meshes
    (`tensor_parallel.make_meshes`) -> (cfg, [params laid out on each mesh]); each leaf goes
    from the files to its shards one leaf at a time (see checkpoints.hf_loader.load_params).
    weights / mtp_weights: "auto" (what the checkpoint stores), "fp8" (quantize the linears
    at load time; the MTP head stays dense unless mtp_weights="fp8") or "dense"
    (see mtpjax/quant.py).
    """
    from checkpoints import is_orbax_checkpoint, load_params, restore_converted
    from mtpjax import quant
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    quant.check_weights_option(weights, mtp_weights)
    if is_orbax_checkpoint(path):      # converted folders hold dense params
        cfg, params, stored = restore_converted(path, meshes)
        if stored != dtype:
            cast = lambda p: cast_params(p, dtype)
            params = cast(params) if meshes is None else [cast(p) for p in params]
        if weights == "fp8" or mtp_weights == "fp8":
            from checkpoints.hf_loader import quantize_params
            if meshes is not None:
                raise ValueError("quantizing an orbax checkpoint at load time works on one "
                                 "device (meshes=None); load the HF checkpoint instead")
            params = quantize_params(cfg, params, weights, mtp_weights)
        return cfg, params
    cfg = Config.from_pretrained(path)
    return cfg, load_params(cfg, path, dtype, meshes, weights, mtp_weights)


def cast_params(params: Params, dtype: str) -> Params:
    from mtpjax.params import FLOAT32_LEAVES
    def cast(path, x):
        name = getattr(path[-1], "name", "")
        return x if name in FLOAT32_LEAVES else x.astype(dtype)
    return jax.tree_util.tree_map_with_path(cast, params)


def _check_tokens(cfg: Config, token_ids, min_len: int = 1):
    t = jnp.asarray(token_ids)
    if t.ndim != 2 or not jnp.issubdtype(t.dtype, jnp.integer):
        raise ValueError(f"token_ids must be an integer array [B, T], got {t.dtype}{list(t.shape)}")
    if t.shape[1] < min_len:
        raise ValueError(f"token_ids needs at least {min_len} tokens per row, got {t.shape[1]}")
    return t.astype(jnp.int32)


@partial(jax.jit, static_argnames=("cfg",))
def _forward_hidden(cfg: Config, params: Params, tokens):
    B, T = tokens.shape
    cache = model.init_cache(cfg, B, T, 1, params.embed.dtype)
    h, _ = model.forward(cfg, params, cache, tokens, model.Segment.full(B, T), mode="chunk")
    return h, cache


@partial(jax.jit, static_argnames=("cfg",))
def _forward_logits(cfg: Config, params: Params, tokens):
    h, _ = _forward_hidden(cfg, params, tokens)
    return model.lm_head(params, h)


@partial(jax.jit, static_argnames=("cfg",))
def _mtp_logits(cfg: Config, params: Params, tokens):
    B, T = tokens.shape
    h, cache = _forward_hidden(cfg, params, tokens)
    h_mtp, _ = model.mtp_forward(cfg, params, cache, h[:, :-1], tokens[:, 1:],
                                 model.Segment.full(B, T - 1))
    return model.lm_head(params, h_mtp)


def forward_logits(cfg: Config, params: Params, token_ids) -> jax.Array:
    """Teacher-forced target logits, no cache: int [B, T] -> float32 [B, T, V]."""
    return _forward_logits(cfg, params, _check_tokens(cfg, token_ids))


def mtp_logits(cfg: Config, params: Params, token_ids) -> jax.Array:
    """Teacher-forced MTP logits: int [B, T] -> float32 [B, T-1, V].

    Row p is the MTP output for (post-final-norm target hidden at p, embedding of token p+1)
    at position p, i.e. its prediction of token p+2.
    """
    if params.mtp is None:
        raise ValueError("this checkpoint has no MTP head (mtp_num_hidden_layers = 0)")
    return _mtp_logits(cfg, params, _check_tokens(cfg, token_ids, min_len=2))
