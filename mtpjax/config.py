"""Model configuration: one small frozen, hashable dataclass built from a checkpoint's config.json.

The config is passed to jitted functions as a static argument, so it must be hashable and
immutable. It covers both layouts Qwen3.5 checkpoints ship in: the multimodal wrapper
(`model_type: qwen3_5`, text settings nested under `text_config`, as Qwen3.5-27B ships) and the
text-only export (`model_type: qwen3_5_text`). Every consistency rule the model relies on is
checked here, so a bad config fails at load time with the key named, not deep inside XLA.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, Mapping

FULL = "full_attention"
LINEAR = "linear_attention"


class ConfigError(ValueError):
    """A checkpoint config that this engine cannot run; the message names the key."""


@dataclasses.dataclass(frozen=True)
class Config:
    """Qwen3.5 dense text model + MTP head.

    Names follow HF's `Qwen3_5TextConfig` where one exists, so that reading the spec and the
    code side by side is easy.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    layer_types: tuple[str, ...]
    # gated full attention
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float
    partial_rotary_factor: float
    # Gated DeltaNet
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    # misc
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    mtp_num_hidden_layers: int = 1
    max_position_embeddings: int = 262144
    eos_token_ids: tuple[int, ...] = ()
    # Set only on the per-shard config of a tensor-parallel step (tensor_parallel.shard_config):
    # head counts and intermediate_size are then one shard's, and the model reduces its
    # row-parallel outputs (and vocabulary-sharded embedding / lm_head) over this mesh axis.
    tp_axis: str | None = None

    def __post_init__(self):
        _check(self)

    # ---- derived sizes (spec §1.2) ----
    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def full_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL)

    @property
    def linear_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == LINEAR)

    @property
    def num_full_layers(self) -> int:
        return len(self.full_layer_ids)

    @property
    def num_linear_layers(self) -> int:
        return len(self.linear_layer_ids)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def gqa_group(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.linear_key_dim + self.linear_value_dim

    @property
    def has_mtp(self) -> bool:
        return self.mtp_num_hidden_layers > 0

    @property
    def layer_period(self) -> int:
        """Smallest p such that layer_types is layer_types[:p] repeated (the layer pattern)."""
        n = self.num_layers
        for p in range(1, n + 1):
            if n % p == 0 and self.layer_types == self.layer_types[:p] * (n // p):
                return p
        return n

    @classmethod
    def from_hf(cls, raw: Mapping[str, Any], generation_config: Mapping[str, Any] | None = None
                ) -> "Config":
        """Build from a parsed config.json (wrapper or text-only layout)."""
        return _from_hf(raw, generation_config)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> "Config":
        cfg_path = os.path.join(path, "config.json")
        if not os.path.exists(cfg_path):
            raise ConfigError(f"no config.json in checkpoint folder {path!s}")
        with open(cfg_path) as f:
            raw = json.load(f)
        gen = None
        gen_path = os.path.join(path, "generation_config.json")
        if os.path.exists(gen_path):
            with open(gen_path) as f:
                gen = json.load(f)
        return _from_hf(raw, gen)

    def to_hf_text_config(self) -> dict[str, Any]:
        """The text-only (`qwen3_5_text`) config.json this config round-trips through."""
        return {
            "model_type": "qwen3_5_text",
            "architectures": ["Qwen3_5ForCausalLM"],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "layer_types": list(self.layer_types),
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "linear_num_key_heads": self.linear_num_key_heads,
            "linear_num_value_heads": self.linear_num_value_heads,
            "linear_key_head_dim": self.linear_key_head_dim,
            "linear_value_head_dim": self.linear_value_head_dim,
            "linear_conv_kernel_dim": self.linear_conv_kernel_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "mtp_num_hidden_layers": self.mtp_num_hidden_layers,
            "max_position_embeddings": self.max_position_embeddings,
            "hidden_act": "silu",
            "attn_output_gate": True,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": self.rope_theta,
                "partial_rotary_factor": self.partial_rotary_factor,
            },
            "eos_token_id": list(self.eos_token_ids) or None,
        }


def _check(c: Config) -> None:
    def need(ok: bool, key: str, msg: str):
        if not ok:
            raise ConfigError(f"config key '{key}': {msg}")

    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads",
                "num_key_value_heads", "head_dim", "linear_num_key_heads",
                "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
                "linear_conv_kernel_dim", "max_position_embeddings"):
        v = getattr(c, key)
        need(isinstance(v, int) and not isinstance(v, bool) and v > 0, key,
             f"must be a positive integer, got {v!r}")
    need(len(c.layer_types) > 0, "layer_types", "must list at least one layer")
    bad = [t for t in c.layer_types if t not in (FULL, LINEAR)]
    need(not bad, "layer_types", f"unsupported layer type(s) {sorted(set(bad))}; "
         f"expected '{FULL}' or '{LINEAR}'")
    need(c.num_attention_heads % c.num_key_value_heads == 0, "num_key_value_heads",
         f"num_attention_heads={c.num_attention_heads} is not a multiple of "
         f"num_key_value_heads={c.num_key_value_heads}")
    need(c.linear_num_value_heads % c.linear_num_key_heads == 0, "linear_num_value_heads",
         f"{c.linear_num_value_heads} is not a multiple of linear_num_key_heads="
         f"{c.linear_num_key_heads}")
    need(0.0 < c.partial_rotary_factor <= 1.0, "partial_rotary_factor",
         f"must be in (0, 1], got {c.partial_rotary_factor}")
    rd = c.head_dim * c.partial_rotary_factor
    need(rd == int(rd) and int(rd) % 2 == 0, "partial_rotary_factor",
         f"head_dim * partial_rotary_factor = {rd} must be an even integer")
    need(math.isfinite(c.rope_theta) and c.rope_theta > 0, "rope_theta",
         f"must be positive, got {c.rope_theta}")
    need(0 < c.rms_norm_eps < 1, "rms_norm_eps", f"must be in (0, 1), got {c.rms_norm_eps}")
    need(c.mtp_num_hidden_layers in (0, 1), "mtp_num_hidden_layers",
         f"only 0 or 1 MTP layers are supported, got {c.mtp_num_hidden_layers}")
    for e in c.eos_token_ids:
        need(0 <= e < c.vocab_size, "eos_token_id", f"id {e} outside vocab_size {c.vocab_size}")


def _as_ids(v) -> tuple[int, ...]:
    if v is None:
        return ()
    if isinstance(v, int):
        return (v,)
    return tuple(int(x) for x in v)


_SUPPORTED_TEXT = ("qwen3_5_text",)
_SUPPORTED_WRAPPER = ("qwen3_5",)


def _from_hf(raw: Mapping[str, Any], gen: Mapping[str, Any] | None) -> Config:
    model_type = raw.get("model_type")
    if model_type in _SUPPORTED_WRAPPER:
        if not isinstance(raw.get("text_config"), Mapping):
            raise ConfigError("config key 'text_config': missing or not an object in a "
                              f"'{model_type}' (multimodal wrapper) config")
        t = dict(raw["text_config"])
        t.setdefault("tie_word_embeddings", raw.get("tie_word_embeddings", False))
        top_eos = raw.get("eos_token_id")
    elif model_type in _SUPPORTED_TEXT:
        t = dict(raw)
        top_eos = None
    else:
        raise ConfigError(f"config key 'model_type': unsupported value {model_type!r}; expected "
                          f"one of {_SUPPORTED_WRAPPER + _SUPPORTED_TEXT}")

    def get(key, default=None, required=True):
        if key in t and t[key] is not None:
            return t[key]
        if required and default is None:
            raise ConfigError(f"config key '{key}': missing")
        return default

    act = t.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"config key 'hidden_act': only 'silu' is supported, got {act!r}")
    if t.get("attention_bias", False):
        raise ConfigError("config key 'attention_bias': true is not supported (Qwen3.5 has none)")
    if t.get("mlp_only_layers"):
        raise ConfigError("config key 'mlp_only_layers': non-empty lists are not supported")
    if t.get("mtp_use_dedicated_embeddings", False):
        raise ConfigError("config key 'mtp_use_dedicated_embeddings': true is not supported")
    if "num_experts" in t and t.get("num_experts"):
        raise ConfigError("config key 'num_experts': MoE Qwen3.5 variants are not supported")

    n_layers = int(get("num_hidden_layers"))
    interval = int(t.get("full_attention_interval") or 4)
    layer_types = t.get("layer_types")
    if layer_types is None:
        layer_types = [FULL if (i + 1) % interval == 0 else LINEAR for i in range(n_layers)]
    if len(layer_types) != n_layers:
        raise ConfigError(f"config key 'layer_types': has {len(layer_types)} entries but "
                          f"num_hidden_layers is {n_layers}")

    rope = dict(t.get("rope_parameters") or {})
    legacy = t.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", legacy.get("rope_type", legacy.get("type", "default")))
    if rope_type != "default":
        raise ConfigError(f"config key 'rope_parameters.rope_type': only 'default' is supported, "
                          f"got {rope_type!r}")
    theta = rope.get("rope_theta", t.get("rope_theta", 10000.0))
    prf = rope.get("partial_rotary_factor", t.get("partial_rotary_factor", 0.25))

    eos = _as_ids(gen.get("eos_token_id")) if gen else ()
    if not eos:
        eos = _as_ids(top_eos) or _as_ids(t.get("eos_token_id"))

    hidden = int(get("hidden_size"))
    n_heads = int(get("num_attention_heads"))
    return Config(
        vocab_size=int(get("vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(get("intermediate_size")),
        layer_types=tuple(layer_types),
        num_attention_heads=n_heads,
        num_key_value_heads=int(get("num_key_value_heads")),
        head_dim=int(get("head_dim", hidden // n_heads)),
        rope_theta=float(theta),
        partial_rotary_factor=float(prf),
        linear_num_key_heads=int(get("linear_num_key_heads")),
        linear_num_value_heads=int(get("linear_num_value_heads")),
        linear_key_head_dim=int(get("linear_key_head_dim")),
        linear_value_head_dim=int(get("linear_value_head_dim")),
        linear_conv_kernel_dim=int(get("linear_conv_kernel_dim", 4)),
        rms_norm_eps=float(get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(t.get("tie_word_embeddings", False)),
        mtp_num_hidden_layers=int(t.get("mtp_num_hidden_layers", 0) or 0),
        max_position_embeddings=int(get("max_position_embeddings", 262144)),
        eos_token_ids=tuple(e for e in eos if 0 <= e < int(get("vocab_size"))),
    )


def qwen3_5_27b() -> Config:
    """Qwen3.5-27B text model + MTP (spec §1.2)."""
    return Config(
        vocab_size=248320, hidden_size=5120, intermediate_size=17408,
        layer_types=tuple(FULL if (i + 1) % 4 == 0 else LINEAR for i in range(64)),
        num_attention_heads=24, num_key_value_heads=4, head_dim=256,
        rope_theta=1e7, partial_rotary_factor=0.25,
        linear_num_key_heads=16, linear_num_value_heads=48,
        linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
        rms_norm_eps=1e-6, tie_word_embeddings=False, mtp_num_hidden_layers=1,
        max_position_embeddings=262144, eos_token_ids=(248046, 248044),
    )
