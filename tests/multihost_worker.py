"""One process of the 2-process tensor-parallel run in tests/test_multihost.py.

usage: python multihost_worker.py COORDINATOR NUM_PROCESSES PROCESS_ID TP K
Joins the processes (jax.distributed), runs an Engine with tensor parallelism over every
process's devices on the TP test model, and prints the tokens as one JSON line after RESULT.
"""

import json
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(__file__))

import jax  # noqa: E402

coordinator, nproc, pid, tp, k = sys.argv[1], *map(int, sys.argv[2:6])
jax.config.update("jax_default_matmul_precision", "highest")
jax.distributed.initialize(coordinator_address=coordinator, num_processes=nproc,
                           process_id=pid)

from mtpjax.engine import Engine  # noqa: E402
from tiny_models import TP_CFG, TP_ENGINE_KW, TP_PARAMS, TP_PROMPTS, TP_SAMPLING  # noqa: E402

assert len(jax.devices()) == tp and len(jax.local_devices()) == tp // nproc, jax.devices()
eng = Engine(TP_CFG, TP_PARAMS, num_speculative_tokens=k, tp=tp, **TP_ENGINE_KW)
outs = eng.generate(TP_PROMPTS, TP_SAMPLING)
print("RESULT " + json.dumps({"process": jax.process_index(), "tokens": [o.token_ids for o in outs],
                              "devices": len(jax.devices())}), flush=True)
