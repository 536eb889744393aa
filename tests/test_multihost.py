"""Multi-host tensor parallelism: 2 processes on localhost, 4 CPU devices each, one tp = 8
engine spanning both (jax.distributed + gloo collectives), token-identical to one process."""

import json
import os
import socket
import subprocess
import sys

from mtpjax.engine import Engine
from tiny_models import TP_CFG, TP_ENGINE_KW, TP_PARAMS, TP_PROMPTS, TP_SAMPLING

WORKER = os.path.join(os.path.dirname(__file__), "multihost_worker.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_run_one_tensor_parallel_engine():
    k, tp, nproc = 1, 8, 2
    addr = f"127.0.0.1:{_free_port()}"
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"--xla_force_host_platform_device_count={tp // nproc}")
    procs = [subprocess.Popen([sys.executable, WORKER, addr, str(nproc), str(i), str(tp), str(k)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=env) for i in range(nproc)]
    results = []
    try:
        # the one-process reference compiles while the workers start up and compile
        ref = Engine(TP_CFG, TP_PARAMS, num_speculative_tokens=k, **TP_ENGINE_KW).generate(
            TP_PROMPTS, TP_SAMPLING)
        for p in procs:
            out, _ = p.communicate(timeout=300)
            assert p.returncode == 0, out[-3000:]
            line = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
            assert line, out[-3000:]
            results.append(json.loads(line[-1][len("RESULT "):]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert sorted(r["process"] for r in results) == [0, 1]
    for r in results:
        assert r["devices"] == tp
        assert r["tokens"] == [o.token_ids for o in ref]
