"""The engine package's layout rules (issue 37, "the split"), each with a positive control.

- The engine core, the scheduler and the batch record import no JAX, directly or not.
- The model runner imports neither the core nor the façade (nor data_parallel).
- The façade does not import data_parallel (DataParallelEngine is built on it).
- No module left behind as a shim; the façade stays under 400 lines.
"""

import ast
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENGINE = os.path.join(ROOT, "mtpjax", "engine")


def loaded_after(module: str, probes: list[str]) -> list[str]:
    """The probes that are in sys.modules after a fresh interpreter imports `module`."""
    code = (f"import sys, importlib; importlib.import_module({module!r}); "
            f"print(','.join(p for p in {probes!r} if p in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, check=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    return [p for p in out.stdout.strip().split(",") if p]


def imported_modules(source: str, package: str = "mtpjax.engine") -> set[str]:
    """Every module a source file imports, `from a import b` counted as a and a.b."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if node.level:                 # relative: from .core import x
                mod = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1]
                               + ([mod] if mod else []))
            found.add(mod)
            found |= {f"{mod}.{a.name}" for a in node.names}
    return found


def forbidden(source: str, banned: set[str]) -> set[str]:
    return {m for m in imported_modules(source) if m in banned}


RUNNER_BANNED = {"mtpjax.engine.core", "mtpjax.engine.engine", "mtpjax.engine.Engine",
                 "mtpjax.engine.EngineCore", "mtpjax.data_parallel", "mtpjax.engine.scheduler"}


def read(name: str) -> str:
    with open(os.path.join(ENGINE, name)) as f:
        return f.read()


@pytest.mark.parametrize("module", ["mtpjax.engine.core", "mtpjax.engine.scheduler",
                                    "mtpjax.engine.batch"])
def test_host_modules_import_no_jax(module):
    assert loaded_after(module, ["jax", "jaxlib"]) == []


def test_the_jax_probe_sees_jax_positive_control():
    assert "jax" in loaded_after("mtpjax.engine.runner", ["jax"])


def test_runner_imports_neither_core_nor_facade():
    assert forbidden(read("runner.py"), RUNNER_BANNED) == set()
    assert loaded_after("mtpjax.engine.runner", ["mtpjax.engine.core", "mtpjax.engine.engine",
                                                 "mtpjax.data_parallel"]) == []


def test_import_checker_flags_a_runner_that_calls_back_positive_control():
    for bad in ("from mtpjax.engine.core import EngineCore",
                "from mtpjax.engine import core",
                "import mtpjax.engine.engine",
                "from .core import EngineCore",
                "def f():\n    from mtpjax.data_parallel import DataParallelEngine"):
        assert forbidden(bad, RUNNER_BANNED), bad
    assert not forbidden("from mtpjax.engine import snapshots", RUNNER_BANNED)


def test_facade_does_not_import_data_parallel():
    assert forbidden(read("engine.py"), {"mtpjax.data_parallel"}) == set()
    assert loaded_after("mtpjax.engine.engine", ["mtpjax.data_parallel"]) == []
    # positive control: data_parallel is built on the façade
    assert "mtpjax.engine.engine" in loaded_after("mtpjax.data_parallel",
                                                  ["mtpjax.engine.engine"])


def test_no_module_left_behind_and_the_facade_is_small():
    for old in ("engine.py", "scheduler.py", "kv_pool.py", "prefix_cache.py", "snapshots.py",
                "depth.py"):
        assert not os.path.exists(os.path.join(ROOT, "mtpjax", old)), old
    with open(os.path.join(ENGINE, "engine.py")) as f:
        assert len(f.readlines()) <= 400
    from mtpjax import Engine
    from mtpjax.engine.engine import Engine as Facade
    assert Engine is Facade
