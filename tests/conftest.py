"""Test session set-up: the JAX platform, float32 matmuls, the tests folder on sys.path.

Platform. By default the tests run on CPU (JAX_PLATFORMS=cpu), in float32, without grabbing a
GPU. MTPJAX_TEST_PLATFORM chooses otherwise:
  cpu (default)  JAX_PLATFORMS=cpu unless JAX_PLATFORMS is already set
  gpu / cuda     JAX_PLATFORMS=cuda unless already set, and the session stops with an error
                 unless JAX comes up on a GPU (the kernel tests' `...Compiled` subclasses
                 exist only there; `python -m experiments gpu_check` runs them this way)
  auto           leave JAX's own platform choice alone
An explicitly set JAX_PLATFORMS always wins. The backend the session ran on is shown in the
header and recorded as the `jax_backend` property of a --junitxml report.
"""

import os
import sys

import pytest

PLATFORMS = {"cpu": "cpu", "gpu": "cuda", "cuda": "cuda", "auto": None}
REQUESTED = os.environ.get("MTPJAX_TEST_PLATFORM", "cpu").strip().lower()
if REQUESTED not in PLATFORMS:
    raise pytest.UsageError(f"MTPJAX_TEST_PLATFORM={REQUESTED!r}: choose one of "
                            f"{', '.join(PLATFORMS)}")
if PLATFORMS[REQUESTED]:
    os.environ.setdefault("JAX_PLATFORMS", PLATFORMS[REQUESTED])
# Eight host devices for the tensor / data parallel tests (tests/test_mesh.py); the other tests
# run on the first. Only for the CPU platform, before JAX starts.
CPU_DEVICES = 8
if os.environ.get("JAX_PLATFORMS") == "cpu" and "host_platform_device_count" not in \
        os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={CPU_DEVICES}").strip()
sys.path.insert(0, os.path.dirname(__file__))

# One persistent compilation cache for the whole test session, shared by the pytest-xdist
# workers and by the `python -m experiments` subprocesses tests start (they read
# MTPJAX_COMPILATION_CACHE_DIR): the modules build engines of the same few tiny shapes, and
# each module drops its compiled programs (below), so without it every module compiled the
# same programs again. Fresh per session (the controller process makes it and removes it at
# the end; the workers inherit the variable), so nothing leaks between runs; the tests that
# check caching itself (test_compilation_cache, test_main_job) set their own folders.
SESSION_CACHE_ENV = "MTPJAX_TEST_SESSION_CACHE"
if SESSION_CACHE_ENV not in os.environ:
    import tempfile
    os.environ[SESSION_CACHE_ENV] = tempfile.mkdtemp(prefix="mtpjax-test-cache-")
    _OWNS_SESSION_CACHE = True
else:
    _OWNS_SESSION_CACHE = False
os.environ.setdefault("MTPJAX_COMPILATION_CACHE_DIR", os.environ[SESSION_CACHE_ENV])

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
jax.config.update("jax_enable_compilation_cache", True)
jax.config.update("jax_compilation_cache_dir", os.environ[SESSION_CACHE_ENV])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


def _backend() -> str:
    try:
        return jax.default_backend()
    except Exception as e:  # noqa: BLE001 - e.g. JAX_PLATFORMS=cuda without a GPU (jax
        # 0.10 raises an AssertionError once its plugin failed to initialise)
        raise pytest.UsageError(f"MTPJAX_TEST_PLATFORM={REQUESTED}, JAX_PLATFORMS="
                                f"{os.environ.get('JAX_PLATFORMS')}: JAX has no such backend "
                                f"here ({type(e).__name__}: {e})") from e


def pytest_sessionstart(session):
    backend = _backend()
    if REQUESTED in ("gpu", "cuda") and backend != "gpu":
        raise pytest.UsageError(f"MTPJAX_TEST_PLATFORM={REQUESTED} but JAX runs on {backend} "
                                f"(JAX_PLATFORMS={os.environ.get('JAX_PLATFORMS')})")


def pytest_report_header(config):
    return [f"jax backend: {_backend()} (MTPJAX_TEST_PLATFORM={REQUESTED}, "
            f"JAX_PLATFORMS={os.environ.get('JAX_PLATFORMS')})"]


@pytest.fixture(scope="session", autouse=True)
def _record_jax_backend(record_testsuite_property):
    record_testsuite_property("jax_backend", _backend())


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drop every compiled program after each test module. One pytest process compiles a few
    thousand XLA programs, and each CPU executable keeps memory mappings for its code: the
    suite ran into the kernel's per-process limit (vm.max_map_count, 65530), and XLA's CPU
    compiler segfaulted mid-suite in whatever test compiled next (here test_judge). Modules
    share few programs, so recompiling those costs little."""
    yield
    jax.clear_caches()
    import gc
    gc.collect()


def pytest_unconfigure(config):
    if _OWNS_SESSION_CACHE and not hasattr(config, "workerinput"):
        import shutil
        shutil.rmtree(os.environ[SESSION_CACHE_ENV], ignore_errors=True)
