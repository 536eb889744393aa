"""`python -m experiments bench` and `gpu_check --smoke` run end to end on CPU and emit JSON.

Both run as subprocesses (they parse absl flags and own their JAX process), started together
so the two compile-bound runs overlap; the whole file takes well under 90 s on 2 cores.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT_S = 240  # a hang guard; the runs take ~40-60 s on 2 idle cores


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bench")
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    cmds = {
        "bench": ["bench", "--synthetic=tiny", "--layers=4", "--batch_sizes=1",
                  "--context_lens=16", "--num_speculative_tokens=2", "--iters=2",
                  f"--out={tmp / 'bench.json'}"],
        "gpu_check": ["gpu_check", "--smoke", f"--out={tmp / 'gpu_check.json'}"],
    }
    procs = {name: subprocess.Popen([sys.executable, "-m", "experiments", *args], cwd=ROOT,
                                    env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True)
             for name, args in cmds.items()}
    out = {}
    for name, p in procs.items():
        try:
            text, err = p.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            for q in procs.values():
                q.kill()
            pytest.fail(f"{name} took over {TIMEOUT_S} s")
        assert p.returncode == 0, f"{name} exited {p.returncode}:\n{(text + err)[-4000:]}"
        last = text.strip().splitlines()[-1]   # the last *stdout* line is the JSON document
        with open(tmp / f"{name}.json") as f:
            out[name] = (json.loads(last), json.load(f), text)
    return out


def test_bench_json(runs):
    stdout_doc, file_doc, text = runs["bench"]
    assert stdout_doc == file_doc, "the last stdout line must be the --out document"
    doc = file_doc
    for key in ("command", "date", "device", "model", "kernels", "num_speculative_tokens",
                "iters", "hbm_gbps", "roofline_applies", "roofline_note", "results",
                "speculative"):
        assert key in doc, key
    assert doc["device"]["backend"] == "cpu" and doc["roofline_applies"] is False
    assert doc["kv"] == "contiguous" and all(r["kv"] == "contiguous" for r in doc["results"])
    assert "NOT meaningful" in doc["roofline_note"]
    assert doc["model"]["target_weight_bytes"] > doc["model"]["mtp_weight_bytes"] > 0
    rows = doc["results"]
    assert {(r["program"], r["batch"]) for r in rows} == {
        (p, 1) for p in ("decode", "verify", "draft")}
    for r in rows:
        assert r["tokens_per_lane"] == (3 if r["program"] == "verify" else 1)
        for key in ("median_s", "min_s", "p90_s", "first_call_s", "tokens_per_s", "floor_s",
                    "bw_fraction", "x_floor", "weight_floor_s", "achieved_gbps"):
            assert r[key] > 0, (r["program"], key)
        b = r["bytes"]
        assert b["total"] == b["weights"] + b["kv"] + b["gdn_state"]
        assert (b["gdn_state"] > 0) == (r["program"] != "draft")
        assert r["tokens_per_s"] == pytest.approx(r["batch"] * r["tokens_per_lane"]
                                                  / r["median_s"])
    assert len(doc["speculative"]) == 1
    for s in doc["speculative"]:
        assert s["spec_step_estimate_s"] == pytest.approx(s["verify_s"] + 2 * s["draft_s"])
        assert s["break_even_tokens_per_step"] > 0
    assert "step programs [roofline of an H200; not this device]" in text


def test_gpu_check_smoke_json(runs):
    stdout_doc, file_doc, text = runs["gpu_check"]
    assert stdout_doc == file_doc
    doc = file_doc
    assert doc["ok"] is True and doc["smoke"] is True and doc["failed_parts"] == []
    for key in ("command", "date", "device", "pytest", "kernels", "model", "elapsed_s",
                "hbm_gbps", "roofline_applies"):
        assert key in doc, key
    assert doc["pytest"]["mode"] == "collect-only" and doc["pytest"]["passed"]
    kernels = {r["kernel"] for r in doc["kernels"]}
    assert kernels == {"paged_attention", "gated_delta_verify", "chunk_gated_delta", "fp8_matmul"}
    for r in doc["kernels"]:
        assert r["median_s"] > 0 and r["bytes"] > 0 and r["x_floor"] > 0
    m = doc["model"]
    assert m["kernels"] == "interpret" and m["name"] == "tiny"
    assert m["kv"] == "paged" and m["kv_fallback"] is None
    assert {r["program"] for r in m["results"]} == {"decode", "verify", "draft"}
    assert all(r["median_s"] > 0 for r in m["results"])
    assert {t["program"] for t in m["weight_floor_targets"]} == {"decode", "verify"}
    assert "gpu_check summary" in text
