"""--tp / --dp and the multi-host flags, shared by every sub-command that builds an engine.

`define()` is called by those modules at import (only the chosen sub-command's module is
imported, and a repeated call is a no-op, so tests may import several). `setup()` runs in
`experiments/__main__.py` before anything touches a JAX backend:
  * multi-host: with --coordinator_address, `jax.distributed.initialize` joins the processes
    (every process runs the same command with its own --process_id; see README "Multi-host");
  * on CPU, JAX shows one device unless told otherwise: when tp x dp needs more, the CPU
    client is given that many (per process) host devices (`jax_num_cpu_devices`), unless
    XLA_FLAGS already sets --xla_force_host_platform_device_count.
"""

from __future__ import annotations

import os

from absl import flags

FLAGS = flags.FLAGS


def define() -> None:
    if "tp" in FLAGS:
        return
    flags.DEFINE_integer("tp", 1, "tensor-parallel degree: each weight and cache split over tp "
                         "devices (Megatron layout, mtpjax/tensor_parallel.py)")
    flags.DEFINE_integer("dp", 1, "data-parallel replicas, each on its own tp devices with its "
                         "own lanes and KV page pool")
    flags.DEFINE_string("coordinator_address", None, "multi-host: host:port of process 0 "
                        "(jax.distributed.initialize); unset: one process")
    flags.DEFINE_integer("num_processes", None, "multi-host: number of processes")
    flags.DEFINE_integer("process_id", None, "multi-host: this process's id, 0..num_processes-1")


def defined() -> bool:
    return "tp" in FLAGS


def setup() -> None:
    """Join the processes (multi-host) and size the CPU device count; before JAX starts."""
    import jax
    procs = 1
    if FLAGS.coordinator_address:
        if FLAGS.num_processes is None or FLAGS.process_id is None:
            raise SystemExit("--coordinator_address needs --num_processes and --process_id")
        jax.distributed.initialize(coordinator_address=FLAGS.coordinator_address,
                                   num_processes=FLAGS.num_processes,
                                   process_id=FLAGS.process_id)
        procs = FLAGS.num_processes
    setup_devices(-(-FLAGS.tp * FLAGS.dp // procs))


def setup_devices(need: int) -> None:
    """At least `need` host CPU devices in this process (before JAX's backends start)."""
    import jax
    if need > 1 and "host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        try:
            jax.config.update("jax_num_cpu_devices", need)
        except (AttributeError, RuntimeError):   # older JAX, or the backend already started
            pass
