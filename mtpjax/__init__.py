"""mtpjax: Qwen3.5 + MTP self-speculative decoding as whole-step XLA programs.

The names below load on first use (PEP 562), so that importing a host-only module
(`mtpjax.engine.core`, `mtpjax.engine.scheduler`) does not import JAX.
"""

from mtpjax import xla_cpu as _xla_cpu

_xla_cpu.apply()      # the benchmark's XLA:CPU settings, before JAX's backend starts

import importlib

_NAMES = {
    "Config": "mtpjax.config", "ConfigError": "mtpjax.config", "qwen3_5_27b": "mtpjax.config",
    "forward_logits": "mtpjax.api", "load_checkpoint": "mtpjax.api", "mtp_logits": "mtpjax.api",
    "Engine": "mtpjax.engine", "RequestOutput": "mtpjax.engine", "RequestStats": "mtpjax.engine",
    "SamplingParams": "mtpjax.sampling_params",
    "DataParallelEngine": "mtpjax.data_parallel", "make_engine": "mtpjax.data_parallel",
    "from_checkpoint": "mtpjax.data_parallel",
    "StreamDecoder": "mtpjax.text", "TextEngine": "mtpjax.text", "TextOutput": "mtpjax.text",
    "Tokenizer": "mtpjax.text", "apply_chat_template": "mtpjax.text",
}
__all__ = list(_NAMES)


def __getattr__(name: str):
    if name in _NAMES:
        value = getattr(importlib.import_module(_NAMES[name]), name)
        globals()[name] = value
        return value
    try:                   # a submodule: `import mtpjax; mtpjax.steps` as before
        return importlib.import_module(f"mtpjax.{name}")
    except ModuleNotFoundError as e:
        if e.name != f"mtpjax.{name}":
            raise
        raise AttributeError(f"module 'mtpjax' has no attribute {name!r}") from None


def __dir__():
    return sorted(set(globals()) | set(_NAMES))
