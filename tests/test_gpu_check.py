"""`python -m experiments gpu_check` can fail: tests not run on a GPU, skips and fallbacks are
not ok. (The happy path, `gpu_check --smoke`, is in test_experiments_bench.py.)

The end-to-end runs are subprocesses started together (they overlap on 2 cores).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from experiments.gpu_check_report import failures, parse_junit, pytest_problems

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT_S = 300


def _junit(tmp_path, cases: str, backend="gpu") -> str:
    p = tmp_path / "junit.xml"
    p.write_text(f'<testsuites><testsuite name="pytest"><properties><property name="jax_backend" '
                 f'value="{backend}"/></properties>{cases}</testsuite></testsuites>')
    return str(p)


COMPILED_OK = ('<testcase classname="tests.test_kernel_paged_attention.TestPagedAttentionCompiled"'
               ' name="test_bf16"/>')


def test_parse_junit_counts_compiled_skipped_and_backend(tmp_path):
    c = parse_junit(_junit(tmp_path, COMPILED_OK + (
        '<testcase classname="tests.x.TestGatedDeltaCompiled" name="test_a"><skipped/></testcase>'
        '<testcase classname="tests.x" name="test_b"><failure/></testcase>'), backend="cpu"))
    assert (c["tests"], c["compiled"], c["skipped"], c["failed"], c["backend"]) == (
        3, 2, 1, 1, "cpu")
    assert c["skipped_tests"] == ["tests.x.TestGatedDeltaCompiled.test_a"]


@pytest.mark.parametrize("rc,cases,backend,expect", [
    (0, COMPILED_OK, "gpu", None),
    (0, COMPILED_OK, "cpu", "tests ran on cpu"),
    (0, '<testcase classname="tests.x" name="test_interp"/>', "gpu", "no compiled"),
    (0, COMPILED_OK + '<testcase classname="tests.xCompiled" name="t"><skipped/></testcase>',
     "gpu", "1 skipped"),
    (5, "", "gpu", "no test matched"),
    (4, "", None, "did not start on a GPU"),
])
def test_pytest_part_is_ok_only_for_compiled_tests_all_run_on_a_gpu(tmp_path, rc, cases,
                                                                    backend, expect):
    counts = parse_junit(_junit(tmp_path, cases, backend or ""))
    why = pytest_problems(rc, False, counts, smoke=False)
    if expect is None:
        assert why == []
    else:
        assert any(expect in w for w in why), why


def test_any_skip_or_fallback_is_a_failure():
    good = {"pytest": {"passed": True}, "kernels": [{"kernel": "paged_attention", "median_s": 1}],
            "model": {"kv_fallback": None, "results": [{"program": "decode", "median_s": 1}]}}
    assert failures(good) == []
    skip_k = dict(good, kernels=[{"kernel": "paged_attention B=1", "skipped": "time budget"}])
    assert failures(skip_k) == ["kernels: paged_attention B=1: skipped (time budget)"]
    fell = dict(good, model={"kv_fallback": "kv=paged failed (X)", "results": []})
    assert "fell back to contiguous" in failures(fell)[0]
    skip_m = dict(good, model={"results": [{"program": "verify", "batch": 8, "context_len": 1024,
                                            "skipped": "time budget"}]})
    assert failures(skip_m) == ["model: verify B=8 C=1024 skipped (time budget)"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gpu_check")
    cmds = {
        # kernel tests that are not the compiled ones, on this CPU: must not count as a pass
        "cpu_tests": ["--parts=pytest", "--pytest_k=test_tuning_rejects"],
        # every kernel timing skipped (no budget) and paged attention failing (page size 0):
        # the model part falls back to contiguous KV
        "skip_fallback": ["--smoke", "--parts=kernels,model", "--kernels_budget_s=0",
                          "--page_size=0", "--programs=decode", "--iters=1"],
    }
    procs = {name: subprocess.Popen(
        [sys.executable, "-m", "experiments", "gpu_check", *args, f"--out={tmp / name}.json"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for name, args in cmds.items()}
    out = {}
    for name, p in procs.items():
        try:
            text, _ = p.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            for q in procs.values():
                q.kill()
            pytest.fail(f"{name} took over {TIMEOUT_S} s")
        with open(tmp / f"{name}.json") as f:
            out[name] = (p.returncode, json.load(f), text)
    return out


def test_kernel_tests_that_ran_on_cpu_are_not_a_pass(runs):
    rc, doc, text = runs["cpu_tests"]
    assert rc == 1 and doc["ok"] is False
    p = doc["pytest"]
    assert p["passed"] is False, p
    assert "did not start on a GPU" in p["why"] or "no compiled" in p["why"], p["why"]


def test_skipped_kernels_and_a_paged_fallback_are_not_ok(runs):
    rc, doc, text = runs["skip_fallback"]
    assert rc == 1 and doc["ok"] is False, text[-3000:]
    assert doc["model"]["kv"] == "contiguous" and doc["model"]["kv_fallback"]
    assert set(doc["failed_parts"]) == {"kernels", "model"}
    assert any("fell back to contiguous" in w for w in doc["failures"])
    assert sum("skipped (time budget)" in w for w in doc["failures"]) == len(doc["kernels"])
    assert "NOT OK: model: paged attention failed" in text


def _pytest_with(tmp_path, **env_over):
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS",
                                                            "MTPJAX_TEST_PLATFORM")}
    env.update(env_over)
    xml = tmp_path / "probe.xml"
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        "tests/test_kernel_paged_attention.py", "-k", "test_tuning_rejects",
                        f"--junitxml={xml}"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=TIMEOUT_S)
    backend = parse_junit(str(xml))["backend"] if xml.exists() else None
    return p.returncode, backend, p.stdout + p.stderr


def test_conftest_runs_the_tests_on_a_gpu_when_asked(tmp_path):
    """MTPJAX_TEST_PLATFORM=gpu: on a GPU the tests run there; elsewhere the session stops
    with an error. It used to pin them to CPU whatever was asked (so the compiled kernel tests
    never ran on a GPU)."""
    rc, backend, out = _pytest_with(tmp_path, MTPJAX_TEST_PLATFORM="gpu")
    if rc == 0:
        assert backend == "gpu", out[-2000:]
    else:
        assert rc == 4 and "MTPJAX_TEST_PLATFORM=gpu" in out, out[-2000:]


def test_conftest_defaults_to_cpu_and_respects_jax_platforms(tmp_path):
    rc, backend, out = _pytest_with(tmp_path)
    assert (rc, backend) == (0, "cpu"), out[-2000:]
    rc, backend, out = _pytest_with(tmp_path, MTPJAX_TEST_PLATFORM="auto", JAX_PLATFORMS="cpu")
    assert (rc, backend) == (0, "cpu"), out[-2000:]
