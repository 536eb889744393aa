"""mtpjax: Qwen3.5 + MTP self-speculative decoding as whole-step XLA programs."""

from mtpjax import xla_cpu as _xla_cpu

_xla_cpu.apply()      # the benchmark's XLA:CPU settings, before JAX's backend starts

from mtpjax.config import Config, ConfigError, qwen3_5_27b
from mtpjax.api import forward_logits, load_checkpoint, mtp_logits

__all__ = ["Config", "ConfigError", "qwen3_5_27b", "forward_logits", "load_checkpoint",
           "mtp_logits"]
from mtpjax.engine import Engine, RequestOutput, RequestStats  # noqa: E402
from mtpjax.sampling import SamplingParams  # noqa: E402
from mtpjax.data_parallel import DataParallelEngine, make_engine  # noqa: E402

__all__ += ["Engine", "RequestOutput", "RequestStats", "SamplingParams", "DataParallelEngine",
            "make_engine"]
from mtpjax.text import (StreamDecoder, TextEngine, TextOutput, Tokenizer,  # noqa: E402
                         apply_chat_template)

__all__ += ["StreamDecoder", "TextEngine", "TextOutput", "Tokenizer", "apply_chat_template"]
