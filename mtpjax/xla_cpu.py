"""The XLA:CPU settings the engine runs with, chosen by a benchmark, not by the user.

On a CPU a decode step of a small model is per-kernel overhead more than arithmetic, and XLA's
runtime settings move it (issue 36: 350 tokens/s by default, 396 with the Eigen thread pool
off, 437 with the legacy runtime, one run each). `python -m experiments cpu_flags` times the
CANDIDATES below in fresh processes, interleaved, on the bundled checkpoint at batch 1 and 8;
CHOSEN holds the candidate that beat the default at both (empty: none did, in that run; see
RESULTS.md for the table). `apply()` runs when `mtpjax` is imported: it adds CHOSEN's flags
to XLA_FLAGS for the CPU backend, unless the user's XLA_FLAGS already sets that flag (the
user's value wins) or MTPJAX_XLA_CPU_FLAGS=none. XLA reads XLA_FLAGS when its backend starts,
so an import of mtpjax after JAX has already run something cannot change it; `apply` says so
by returning False.
"""

from __future__ import annotations

import os

ENV_OFF = "MTPJAX_XLA_CPU_FLAGS"        # "none": leave XLA_FLAGS as the user set it

CANDIDATES: dict[str, tuple[str, ...]] = {
    "default": (),
    "no_eigen_threads": ("--xla_cpu_multi_thread_eigen=false",),
    "legacy_runtime": ("--xla_cpu_use_thunk_runtime=false",),
    "legacy_no_eigen": ("--xla_cpu_use_thunk_runtime=false",
                        "--xla_cpu_multi_thread_eigen=false"),
}

# The benchmark's pick (experiments/cpu_flags.py; RESULTS.md, "XLA:CPU settings").
CHOSEN: tuple[str, ...] = ()


def _name(flag: str) -> str:
    return flag.lstrip("-").split("=", 1)[0]


def _backend_started() -> bool:
    try:
        from jax._src import xla_bridge
        return bool(xla_bridge.backends_are_initialized())
    except (ImportError, AttributeError):
        return False


def apply(environ=os.environ, chosen: tuple[str, ...] | None = None,
          backend_started: bool | None = None) -> bool:
    """Add `chosen` (default CHOSEN) to XLA_FLAGS (module docstring); True when XLA_FLAGS
    changed. backend_started: whether JAX's backends already run (default: asked of JAX)."""
    chosen = CHOSEN if chosen is None else chosen
    if environ.get(ENV_OFF, "").strip().lower() == "none" or not chosen:
        return False
    platforms = environ.get("JAX_PLATFORMS", "")
    if platforms and "cpu" not in platforms.split(","):
        return False
    if _backend_started() if backend_started is None else backend_started:
        return False                      # too late: XLA read XLA_FLAGS when it started
    current = environ.get("XLA_FLAGS", "")
    have = {_name(f) for f in current.split()}
    add = [f for f in chosen if _name(f) not in have]
    if not add:
        return False
    environ["XLA_FLAGS"] = " ".join([current, *add]).strip()
    return True
