"""`python -m experiments convert --checkpoint=HF_DIR --out=DIR --dtype=bfloat16`.

Loads an HF safetensors checkpoint tensor by tensor, casts it, and saves the params with
orbax-checkpoint (plus config/tokenizer sidecars) so later loads are one restore. Converted
folders hold dense params: an FP8 checkpoint is dequantized on the way (load it as HF to keep
it FP8, or load the converted folder with weights="fp8" to quantize it again).
"""

from absl import flags

import mtpjax
from checkpoints import save_converted
from mtpjax.params import count_params

FLAGS = flags.FLAGS
flags.DEFINE_string("checkpoint", None, "HF checkpoint folder (config.json + safetensors)")
flags.DEFINE_string("out", None, "output folder for the converted (orbax) checkpoint")
flags.DEFINE_enum("dtype", "bfloat16", ["float32", "bfloat16"], "dtype to store")
flags.mark_flags_as_required(["checkpoint", "out"])


def main(argv):
    del argv
    cfg, params = mtpjax.load_checkpoint(FLAGS.checkpoint, FLAGS.dtype, weights="dense",
                                         mtp_weights="dense")
    save_converted(FLAGS.out, cfg, params, FLAGS.dtype, source=FLAGS.checkpoint)
    print(f"converted {count_params(params):,} params ({FLAGS.dtype}) -> {FLAGS.out}")
