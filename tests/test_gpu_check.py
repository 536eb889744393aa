"""`python -m experiments gpu_check` can fail: tests not run on a GPU, skips and fallbacks, a
float32 engine whose tokens differ from the CPU reference engine's, a kernel or step floor
target NOT MET and a clock constant not measured are not ok; and `gpu_check --smoke` (every
part, the engine part in interpret mode against the reference engine, the calibration at toy
sizes) runs on this CPU, is ok, and writes a well-formed calibration file. The calibration's
programs also compile deviceless for the H200, where its kernel chains count as launched.

The verdict logic is tested on crafted reports (gpu_check_report.py, pure functions); the
end-to-end runs are subprocesses started together (they overlap on 2 cores; the smoke run, the
longest, is about 2 min on 2 idle cores).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

import pytest

from experiments.gpu_check_report import (compare_tokens, engine_verdict, failures, finish,
                                          floor_target, kernel_target, parse_junit,
                                          pytest_problems)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT_S = 480   # a hang guard for the three runs overlapping on 2 cores
PARTS = ("pytest", "kernels", "calibrate", "engine", "model")


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
        # the happy path: every part, tiny, on this CPU (the calibration file named, as the
        # three runs share a folder)
        "smoke": ["--smoke", f"--calibration_out={tmp / 'smoke_calibration.json'}"],
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


# --------------------------------------------------------------------------------------------
# Floor targets, the engine gate and the verdict, on crafted reports
# --------------------------------------------------------------------------------------------

def _kernel_row(x_floor, floor_s=50e-6, kernel="paged_attention"):
    return {"kernel": kernel, "batch": 8, "q_len": 1, "context_len": 8192,
            "median_s": x_floor * floor_s, "floor_s": floor_s, "x_floor": x_floor,
            "achieved_gbps": 1.0}


def _step_target(program, x, applies=True):
    return {"program": program, "batch": 1, "context_len": 1024, "median_s": x * 10.68e-3,
            "weight_floor_s": 10.68e-3, "x_weight_floor": x,
            **floor_target(x, 1.15, applies, "interpret kernels on cpu")}


def _engine(ref_tokens, runs, expect_platforms=True):
    ref = {"dtype": "float32", "kernels": "reference", "platform": "cpu", "device": "cpu:0",
           "tokens": ref_tokens}
    out = []
    for dtype, tokens in runs:
        run = {"dtype": dtype, "kernels": "pallas", "gated": dtype == "float32",
               "platform": "gpu", "device": "cuda:0", "seconds": 1.0, "tokens": tokens}
        out.append(engine_verdict(ref, run))
    return {"checkpoint": "checkpoints/tiny", "k": 4, "expect_platforms": expect_platforms,
            "reference": ref, "runs": out}


REF = [[1, 2, 3, 4], [5, 6, 7]]


def _gpu_doc(**over):
    """A GPU run's report where everything passed: each test breaks one thing."""
    doc = {"roofline_applies": True, "pytest": {"passed": True},
           "kernels": [{**_kernel_row(1.2), "target": kernel_target(_kernel_row(1.2), 1.5,
                                                                    20e-6, True, "gpu")}],
           "engine": _engine(REF, [("float32", REF), ("bfloat16", REF)]),
           "model": {"kv_fallback": None, "results": [{"program": "decode", "median_s": 1}],
                     "weight_floor_targets": [_step_target("decode", 1.05),
                                              _step_target("verify", 1.10)]}}
    doc.update(over)
    return doc


def test_a_gpu_run_that_meets_every_target_is_ok():
    v = finish(_gpu_doc(), [], PARTS)
    assert v == {"failures": [], "failed_parts": [], "ok": True}


def test_kernel_target_met_not_met_none_and_na():
    assert kernel_target(_kernel_row(1.49), 1.5, 20e-6, True, "gpu")["status"] == "MET"
    t = kernel_target(_kernel_row(2.0), 1.5, 20e-6, True, "gpu")
    assert (t["met"], t["status"]) == (False, "NOT MET")
    # launch-bound shape (floor 5 us < 20 us) and a kernel with no target (maybe compute-bound)
    assert kernel_target(_kernel_row(9.0, floor_s=5e-6), 1.5, 20e-6, True, "gpu") is None
    assert kernel_target(_kernel_row(9.0, kernel="chunk_gated_delta"), 1.5, 20e-6, True,
                         "gpu") is None
    na = kernel_target(_kernel_row(9.0), 1.5, 20e-6, False, "cpu")
    assert na["met"] is None and na["status"].startswith("n/a")


def test_failures_lists_a_not_met_kernel_target_with_its_numbers():
    row = _kernel_row(2.0)
    doc = _gpu_doc(kernels=[{**row, "target": kernel_target(row, 1.5, 20e-6, True, "gpu")}])
    v = finish(doc, [], PARTS)
    assert v["ok"] is False and v["failed_parts"] == ["kernels"]
    assert v["failures"] == ["kernels: paged_attention B=8 q=1 ctx=8192: x2.000 of the floor, "
                             "target <= x1.5 NOT MET"]


def test_failures_lists_a_not_met_step_target_and_a_missing_one():
    m = _gpu_doc()["model"]
    doc = _gpu_doc(model={**m, "weight_floor_targets": [_step_target("decode", 1.05),
                                                          _step_target("verify", 1.30)]})
    v = finish(doc, [], PARTS)
    assert v["ok"] is False and v["failed_parts"] == ["model"]
    assert v["failures"] == ["model: verify B=1 C=1024 (weight floor): x1.300 of the floor, "
                             "target <= x1.15 NOT MET"]
    # on a GPU a step target that was never timed is not a pass either
    doc = _gpu_doc(model={**m, "weight_floor_targets": [_step_target("decode", 1.05)]})
    assert any("no verify step at B=1" in w for w in failures(doc))


def test_floor_targets_are_na_and_not_failures_off_a_gpu():
    m = _gpu_doc()["model"]
    row = _kernel_row(9.0)
    doc = _gpu_doc(roofline_applies=False,
                   kernels=[{**row, "target": kernel_target(row, 1.5, 20e-6, False, "cpu")}],
                   model={**m, "weight_floor_targets": [_step_target("decode", 700, False),
                                                        _step_target("verify", 900, False)]})
    assert finish(doc, [], PARTS)["ok"] is True
    # ... but an n/a target in a report that says the roofline applies is not ok
    doc["roofline_applies"] = True
    assert any("target not evaluated on a GPU run" in w for w in failures(doc))


def test_engine_comparison_on_a_crafted_mismatch():
    c = compare_tokens(REF, [[1, 2, 9, 4], [5, 6]])
    assert c["equal"] is False
    assert [p["first_divergence"] for p in c["per_prompt"]] == [2, 2]
    assert [(p["common_prefix"], p["reference_len"], p["len"]) for p in c["per_prompt"]] == [
        (2, 4, 4), (2, 3, 2)]
    assert c["agreement"] == pytest.approx((2 / 4 + 2 / 3) / 2)
    # a longer reply is not equal either, though its agreement is 1
    c = compare_tokens(REF, [[1, 2, 3, 4, 0], [5, 6, 7]])
    assert (c["equal"], c["agreement"]) == (False, 1.0)
    assert [p["first_divergence"] for p in c["per_prompt"]] == [4, None]
    assert compare_tokens(REF, [list(r) for r in REF])["equal"] is True
    with pytest.raises(ValueError, match="1 replies to compare with 2"):
        compare_tokens(REF, [[1]])
    ref = {"tokens": REF}
    bad = [[1, 2, 9, 4], [5, 6, 7]]
    assert engine_verdict(ref, {"gated": True, "tokens": bad})["verdict"] == "DIFFERENT"
    assert engine_verdict(ref, {"gated": False, "tokens": bad})["verdict"] == "differs (reported)"
    assert engine_verdict(ref, {"gated": True, "tokens": REF})["verdict"] == "equal"


def test_a_float32_engine_mismatch_makes_ok_false():
    bad = [[1, 2, 3, 4], [5, 8, 7]]
    v = finish(_gpu_doc(engine=_engine(REF, [("float32", bad), ("bfloat16", REF)])), [], PARTS)
    assert v["ok"] is False and v["failed_parts"] == ["engine"]
    assert v["failures"] == ["engine: float32 pallas greedy tokens differ from the CPU reference "
                             "engine's (prompt 1 at token 1; agreement 0.667)"]
    # bfloat16 is reported, not gated
    v = finish(_gpu_doc(engine=_engine(REF, [("float32", REF), ("bfloat16", bad)])), [], PARTS)
    assert v["ok"] is True


@pytest.mark.parametrize("change,expect", [
    (lambda e: e.update(runs=[r for r in e["runs"] if r["dtype"] != "float32"]),
     "no float32 engine was compared"),
    (lambda e: e["reference"].update(platform="gpu"), "reference engine ran on gpu"),
    (lambda e: e["runs"][0].update(platform="cpu"), "float32 pallas ran on cpu, not the GPU"),
    (lambda e: e["runs"].__setitem__(0, {"dtype": "float32", "kernels": "pallas", "gated": True,
                                          "skipped": "time budget"}),
     "float32 pallas: skipped (time budget)"),
    (lambda e: e["runs"].__setitem__(0, {"dtype": "float32", "kernels": "pallas", "gated": True,
                                          "error": "XlaRuntimeError: boom"}),
     "float32 pallas: XlaRuntimeError: boom"),
])
def test_the_engine_gate_is_not_passed_without_a_float32_gpu_run(change, expect):
    doc = _gpu_doc()
    change(doc["engine"])
    v = finish(doc, [], PARTS)
    assert v["ok"] is False and "engine" in v["failed_parts"]
    assert any(expect in w for w in v["failures"]), v["failures"]


def test_smoke_run_is_ok_and_reports_every_part(runs):
    rc, doc, text = runs["smoke"]
    assert rc == 0 and doc["ok"] is True, text[-4000:]
    assert doc["smoke"] is True and doc["failed_parts"] == [] and doc["failures"] == []
    assert doc["roofline_applies"] is False and "partial" not in doc
    assert doc["pytest"]["mode"] == "collect-only" and doc["pytest"]["counts"]["tests"] > 0
    assert {r["kernel"] for r in doc["kernels"]} == {
        "paged_attention", "gated_delta_verify", "chunk_gated_delta", "fp8_matmul"}
    assert all(r["median_s"] > 0 for r in doc["kernels"])
    # the engine part: the Pallas interpreter in float32 against the reference engine, both on
    # the CPU, greedy tokens equal (the gate), every prompt answered in full
    e = doc["engine"]
    ref = e["reference"]
    assert (ref["kernels"], ref["dtype"], ref["platform"]) == ("reference", "float32", "cpu")
    assert e["expect_platforms"] is False
    assert [(r["dtype"], r["kernels"], r["gated"]) for r in e["runs"]] == [
        ("float32", "interpret", True)]
    run = e["runs"][0]
    assert run["verdict"] == "equal" and run["comparison"]["agreement"] == 1.0
    assert run["tokens"] == ref["tokens"]
    assert [len(t) for t in ref["tokens"]] == [e["max_new_tokens"]] * len(e["prompts"])
    assert run["depth_steps"][e["k"]] > 0 and sum(run["depth_steps"][:e["k"]]) == 0
    # the model part: step targets n/a on a CPU (not failures); the cost model next to them
    m = doc["model"]
    assert m["kv"] == "paged" and m["kv_fallback"] is None
    assert {t["program"] for t in m["weight_floor_targets"]} == {"decode", "verify"}
    assert all(t["met"] is None and t["status"].startswith("n/a")
               for t in m["weight_floor_targets"])
    cm = m["cost_model"]
    assert cm["comparable"] is False and cm["layers"] == m["layers"]
    assert {r["program"].split(" ")[0] for r in cm["rows"]} == {"decode", "draft", "step"}
    assert all(r["predicted_s"] > 0 for r in cm["rows"])
    for part in ("gpu_check summary", "engine: checkpoints/tiny", "-> equal (gated",
                 "-> n/a", "cost model ("):
        assert part in text, part


# --------------------------------------------------------------------------------------------
# The calibrate part (experiments/gpu_calibration.py)
# --------------------------------------------------------------------------------------------

def test_smoke_run_writes_a_well_formed_calibration_file(runs):
    """--smoke: the calibration file beside the report has every key the clock reads, positive
    constants with their samples, the device and date, the decode step at 1 and 2 lanes beside
    the cost model; the clock refuses it (toy sizes), naming why."""
    from mtpjax.cost_model import (CALIBRATED, CalibrationError, check_calibration,
                                   load_calibration)
    rc, doc, text = runs["smoke"]
    path = doc["calibrate"]["file"]
    assert path.endswith("smoke_calibration.json") and doc["calibrate"]["errors"] == {}
    with open(path) as f:
        cal = json.load(f)
    check_calibration(cal, path, allow_smoke=True)
    assert cal["smoke"] is True and cal["partial"] is False
    assert cal["device"]["backend"] == "cpu" and cal["device"]["jax"] and cal["date"]
    for n in CALIBRATED:
        c = cal["constants"][n]
        assert c["value"] > 0 and all(x > 0 for x in c["samples"]) and c["how"], (n, c)
    # XLA:CPU fuses the chain into one loop (it drops the barriers): the count falls back to
    # the links, and says so (the H200's count: test_calibration_programs_compile_deviceless)
    raw = cal["constants"]["launch_s"]["raw"]
    assert raw["kernels_per_step_of_chain"] == (raw["kernels_2N"] - raw["kernels_N"]
                                                if raw["counted"] else raw["n"]), raw
    assert raw["counted"] or "assumed" in cal["constants"]["launch_s"]["how"]
    rows = cal["steps"]["rows"]
    assert [(r["batch"], r["program"]) for r in rows] == [(1, "decode"), (2, "decode")]
    for r in rows:
        assert r["median_s"] > 0 and r["predicted_s"] > 0 and r["predicted_s_published"] > 0
        assert r["calibrated_constants_used"] == sorted(CALIBRATED)
    assert {r["batch"] for r in doc["model"]["results"] if r["program"] == "decode"} == {1, 2}
    with pytest.raises(CalibrationError, match="smoke is true"):
        load_calibration(path)
    assert "calibrate -> " in text and "decode B=2" in text


def test_calibrate_in_process_at_smoke_size_and_with_no_time_left():
    """run_calibrate on this CPU: three positive constants (program_s less the kernel's launch
    cost); with the box already spent every constant is skipped, and each is a failure of
    the part, and the file made from it is refused naming the first."""
    import time as time_
    from experiments import gpu_calibration
    from mtpjax.cost_model import CalibrationError, check_calibration
    cal = gpu_calibration.run_calibrate(True, time_.monotonic() + 300, log=lambda *a: None)
    assert cal["errors"] == {}, cal["errors"]
    assert all(c["value"] > 0 for c in cal["constants"].values())
    p = cal["constants"]["program_s"]
    assert p["value"] == pytest.approx(statistics.median(
        [r - cal["constants"]["launch_s"]["value"] * p["raw"]["kernels"]
         for r in p["raw"]["call_round_medians_s"]]))
    none = gpu_calibration.run_calibrate(True, time_.monotonic() - 1, log=lambda *a: None)
    assert none["constants"] == {} and set(none["errors"].values()) == {"skipped (time budget)"}
    v = finish({"calibrate": none}, [], PARTS)
    assert v["failed_parts"] == ["calibrate"] and "calibrate: launch_s: skipped (time budget)" \
        in v["failures"]
    doc = gpu_calibration.calibration_doc({"device_kind": "NVIDIA H200"}, "2026-12-07", False,
                                          none, None, False)
    with pytest.raises(CalibrationError, match=r"hbm_bytes_per_s is missing \(the run says: "
                                               r"skipped \(time budget\)\)"):
        check_calibration(doc)


def test_step_rows_price_the_timed_steps_at_the_calibrated_constants():
    """Each timed decode step beside CostModel.decode(0, B) at the calibrated constants and at
    the published ones: a calibrated kernel cost 2.5 us above the published one raises the
    prediction by exactly kernels x 2.5 us; a lane count not timed is listed as such."""
    from experiments import gpu_calibration
    from mtpjax.config import qwen3_5_27b
    from mtpjax.cost_model import H200
    from mtpjax.h200_kernel_counts import COUNTS
    res = [{"program": "decode", "batch": b, "context_len": 1024, "median_s": 0.02,
            "min_s": 0.019, "p90_s": 0.021} for b in (1, 8)]
    res.append({"program": "decode", "batch": 32, "context_len": 1024, "skipped": "time budget"})
    rows = gpu_calibration.step_rows(qwen3_5_27b(), res, [1, 8, 32], 1024, weights="bf16",
                                     page_size=16, calibrated={"launch_s": H200.launch_s + 2.5e-6})
    table = COUNTS[("bf16", 0, 16)]                                   # the stock step's
    assert [r["predicted_kernels"] for r in rows[:2]] == [table[("decode", 0, b)] for b in (1, 8)]
    for r in rows[:2]:
        assert r["predicted_s"] - r["predicted_s_published"] == pytest.approx(
            r["predicted_kernels"] * 2.5e-6, rel=1e-9)
        assert r["x_predicted"] == pytest.approx(0.02 / r["predicted_s"])
        assert r["calibrated_constants_used"] == ["launch_s"]
    assert rows[2] == {"program": "decode", "batch": 32, "context_len": 1024, "layers": 64,
                       "skipped": "time budget"}


def test_calibration_programs_compile_deviceless_for_the_h200():
    """The GPU path lowers and compiles for an H200 (XLA's GPU pipeline, no device): the
    chains' kernels survive fusion (2N kernels are N more than N, about one per link), the
    reads and the one-kernel program are a few kernels each."""
    import jax
    from experiments import aot_programs, gpu_calibration
    from experiments.hlo_audit import traffic
    sh = jax.sharding.SingleDeviceSharding(aot_programs.target_device("h200"))
    counts = {}
    for name, (fn, args) in gpu_calibration.abstract_programs(smoke=False).items():
        args = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh) for a in args]
        counts[name] = traffic(fn.lower(*args).compile().as_text()).count()
    n = gpu_calibration.SIZES[False]["chain_n"]
    assert n <= counts["chain_N"] <= n + 4 and counts["chain_2N"] - counts["chain_N"] == n, counts
    assert max(counts[k] for k in ("read_S", "read_2S", "copy_S", "copy_2S", "tiny")) <= 3, counts
