"""`python -m experiments [judge|generate|bench|convert|train_tiny|gpu_check|aot|speed|mesh|serve|serve_bench|draft_vocab|draft_vocab_sweep|clock_check|cpu_flags|loop_check|ttft_check|llama_cpp] [--flags]`.

Each sub-command is a module of this package that defines its absl flags at import time (or in
a `define_flags()`, called here, when tests import the module) and a `main(argv)`; only the
chosen module is imported, so flag names never collide.

Second runs start fast: JAX's persistent compilation cache is on for every sub-command. Every
compiled program (however small: the thresholds are off, so CPU programs are cached too) is
written to `--compilation_cache_dir` (default `$MTPJAX_COMPILATION_CACHE_DIR`, else
`~/.cache/mtpjax/jax_cache`), and a later run with the same programs, jax version and device
loads them instead of compiling. `--nocompilation_cache` (or `--compilation_cache=false`)
turns it off: nothing is read or written. `aot` reports compile times, so there the cache is
off unless `--compilation_cache` is given. At exit one line on stderr counts the hits and the
new entries.
"""

import glob
import importlib
import logging
import os
import sys

from absl import app, flags

COMMANDS = ("judge", "generate", "bench", "convert", "train_tiny", "gpu_check", "aot", "speed",
            "mesh", "serve", "serve_bench", "draft_vocab", "draft_vocab_sweep", "clock_check",
            "cpu_flags", "loop_check", "ttft_check", "llama_cpp")
DEFAULT = "judge"
CACHE_OFF_BY_DEFAULT = ("aot",)   # it measures compile time
CACHE_ENV = "MTPJAX_COMPILATION_CACHE_DIR"
DEFAULT_CACHE_DIR = os.path.join("~", ".cache", "mtpjax", "jax_cache")

flags.DEFINE_boolean("compilation_cache", True, "JAX's persistent compilation cache (compiled "
                     "programs reused across runs)")
flags.DEFINE_string("compilation_cache_dir", None, f"where the compilation cache lives "
                    f"(default: ${CACHE_ENV}, else {DEFAULT_CACHE_DIR})")
FLAGS = flags.FLAGS


def _split(argv):
    if len(argv) > 1 and not argv[1].startswith("-"):
        cmd, rest = argv[1], argv[2:]
    else:
        cmd, rest = DEFAULT, argv[1:]
    if cmd not in COMMANDS:
        sys.exit(f"unknown sub-command {cmd!r}; choose one of {', '.join(COMMANDS)}")
    return cmd, rest


def cache_dir(flag_value: str | None) -> str:
    """The flag, else $MTPJAX_COMPILATION_CACHE_DIR, else ~/.cache/mtpjax/jax_cache."""
    path = flag_value or os.environ.get(CACHE_ENV) or DEFAULT_CACHE_DIR
    return os.path.abspath(os.path.expanduser(path))


def configure_compilation_cache(enabled: bool, path: str) -> dict:
    """Set JAX's persistent cache up (before anything compiles); returns live counters."""
    import jax
    counts = {"hits": 0, "writes": 0, "dir": path if enabled else None}
    if not enabled:
        jax.config.update("jax_enable_compilation_cache", False)
        return counts
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)   # no size threshold

    def on_event(event, **_):
        if event == "/jax/compilation_cache/cache_hits":
            counts["hits"] += 1
        elif event == "/jax/compilation_cache/cache_misses":   # recorded as an entry is written
            counts["writes"] += 1

    jax.monitoring.register_event_listener(on_event)
    return counts


GPU_COMMANDS = ("gpu_check",)   # these look for a GPU whatever the machine seems to have


def has_nvidia_gpu() -> bool:
    """An NVIDIA device node exists (a GPU the CUDA plugin could use)."""
    return bool(glob.glob("/dev/nvidia[0-9]*"))


def quiet_backend_discovery(cmd: str) -> None:
    """Keep JAX's backend discovery out of the output of a CPU run.

    With the `test` or `aot` extra installed, JAX finds the CUDA plugin and, on a machine
    without a GPU, prints "Unable to load cuDNN" with a traceback before any output; it also
    logs at INFO that it found no libtpu. Where no NVIDIA device exists and JAX_PLATFORMS is
    not set, the run is on the CPU: say so (JAX_PLATFORMS=cpu), so neither is tried. Backend
    messages below WARNING are dropped everywhere. `aot` sets JAX_PLATFORMS=cpu itself (a
    deviceless compile loads the CUDA compiler, not the runtime)."""
    if "JAX_PLATFORMS" not in os.environ and cmd not in GPU_COMMANDS and not has_nvidia_gpu():
        os.environ["JAX_PLATFORMS"] = "cpu"
    logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)


def main_entry():
    cmd, rest = _split(sys.argv)
    quiet_backend_discovery(cmd)
    module = importlib.import_module(f"experiments.{cmd}")
    if hasattr(module, "define_flags"):      # flags kept out of import time (llama_cpp)
        module.define_flags()

    def main(argv):
        enabled = FLAGS.compilation_cache
        if cmd in CACHE_OFF_BY_DEFAULT and not FLAGS["compilation_cache"].present:
            enabled = False
        counts = configure_compilation_cache(enabled, cache_dir(FLAGS.compilation_cache_dir))
        from experiments import mesh_flags
        if mesh_flags.defined():
            mesh_flags.setup()
        try:
            return module.main(argv)
        finally:
            if counts["dir"]:
                print(f"[compilation cache] {counts['hits']} hits, {counts['writes']} new "
                      f"entries in {counts['dir']}", file=sys.stderr, flush=True)

    app.run(main, argv=[f"experiments {cmd}"] + rest)


if __name__ == "__main__":
    main_entry()
