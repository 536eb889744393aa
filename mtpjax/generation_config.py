"""Sampling defaults from a checkpoint's `generation_config.json`, as vLLM applies them.

Model makers publish the sampling their model is meant to run with there (Qwen3.5: temperature
0.6, top_p 0.95, top_k 20 with thinking on). A request that leaves a field out gets the
checkpoint's value rather than OpenAI's (temperature 1.0, top_p 1.0, no top_k), which for a
small or reasoning model is often a much worse reply; a field the request sets always wins.
`python -m experiments serve --generation_config=none` (vLLM: `--generation-config vllm`) and
`experiments generate --generation_config=none` go back to OpenAI's defaults.

Read: temperature, top_p, top_k, repetition_penalty, presence_penalty, frequency_penalty, and
`do_sample` as transformers reads it: `do_sample: false` means greedy (temperature 0), whatever
temperature says. Any other key (eos ids, max_new_tokens, ...) is not a sampling default.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Mapping

FILE = "generation_config.json"


@dataclasses.dataclass(frozen=True)
class SamplingDefaults:
    """What a request that sets none of these gets; `source` says where they came from."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                      # 0: off
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    source: str = "OpenAI's defaults"

    @staticmethod
    def from_generation_config(cfg: Mapping[str, Any], source: str = FILE) -> "SamplingDefaults":
        """The defaults a generation_config.json dict sets (module docstring); a value of the
        wrong type or range is a ValueError that names the key and the file."""
        out: dict[str, Any] = {}
        for key, kind, ok in (
                ("temperature", float, lambda v: 0 <= v <= 2),
                ("top_p", float, lambda v: 0 < v <= 1),
                ("top_k", int, lambda v: v >= -1),
                ("presence_penalty", float, lambda v: -2 <= v <= 2),
                ("frequency_penalty", float, lambda v: -2 <= v <= 2),
                ("repetition_penalty", float, lambda v: v > 0)):
            if cfg.get(key) is None:
                continue
            v = cfg[key]
            if isinstance(v, bool) or not isinstance(v, (int, float)) or \
                    (kind is int and not isinstance(v, int)) or not ok(v):
                raise ValueError(f"{source}: {key} = {v!r} is not a valid sampling default")
            out[key] = kind(v)
        if "top_k" in out:
            out["top_k"] = max(out["top_k"], 0)          # -1 and 0 both mean off
        do_sample = cfg.get("do_sample")
        if do_sample is not None and not isinstance(do_sample, bool):
            raise ValueError(f"{source}: do_sample = {do_sample!r} must be a boolean")
        if do_sample is False:
            out["temperature"] = 0.0                     # transformers: greedy
        return SamplingDefaults(**out, source=source)

    @staticmethod
    def of_checkpoint(folder: str) -> "SamplingDefaults":
        """The checkpoint folder's generation_config.json defaults (OpenAI's without one)."""
        path = os.path.join(folder, FILE)
        if not os.path.isfile(path):
            return SamplingDefaults()
        with open(path, encoding="utf-8") as f:
            try:
                cfg = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}: not valid JSON: {e}") from None
        if not isinstance(cfg, dict):
            raise ValueError(f"{path}: must be a JSON object")
        return SamplingDefaults.from_generation_config(cfg, path)

    @staticmethod
    def resolve(mode: str, folder: str) -> "SamplingDefaults":
        """mode "auto": the checkpoint's; "none": OpenAI's."""
        if mode == "auto":
            return SamplingDefaults.of_checkpoint(folder)
        if mode == "none":
            return SamplingDefaults()
        raise ValueError(f"generation_config must be 'auto' (the checkpoint's "
                         f"generation_config.json) or 'none' (OpenAI's defaults), got {mode!r}")
