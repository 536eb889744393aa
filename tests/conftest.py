import os
import sys

# Tests run on CPU in float32; keep XLA from grabbing every core for a tiny model.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(__file__))

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
