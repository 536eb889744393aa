"""--weights / --mtp_weights (FP8 or dense linears), shared by every sub-command that loads a
model. `define()` is idempotent (tests import several sub-command modules)."""

from __future__ import annotations

from absl import flags

FLAGS = flags.FLAGS
CHOICES = ["auto", "fp8", "dense"]


def define() -> None:
    if "weights" in FLAGS:
        return
    flags.DEFINE_enum("weights", "auto", CHOICES, "linears: auto = as the checkpoint stores them "
                      "(an FP8 checkpoint stays FP8), fp8 = quantize block-wise at load time, "
                      "dense = the model dtype (mtpjax/quant.py)")
    flags.DEFINE_enum("mtp_weights", "auto", CHOICES, "the MTP head's linears: auto = as "
                      "stored, but dense when --weights=fp8 quantizes a dense checkpoint")
