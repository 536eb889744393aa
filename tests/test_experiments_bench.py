"""`python -m experiments bench` runs end to end on CPU and emits JSON (`gpu_check --smoke`:
tests/test_gpu_check.py).

It runs as a subprocess (it parses absl flags and owns its JAX process).

`bench --sweep=lanes` (experiments/depth_sweep.py): its pure functions run in this process on
the tiny random VOCAB11 model (a sweep of the real checkpoint compiles ~10 engine programs of
an 8-layer model, minutes of CPU); the flag wiring is checked by a CLI run that must refuse a
bad depth before building anything.

`bench --sweep=ttft --clock=h200`: TTFT of the tiny checkpoint's engine on the H200 clock
against the 27B prefill's roofline, at small sizes (prompts of 64 and 128 tokens, 64-token
chunks).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from experiments import depth_sweep

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
        "ttft": ["bench", "--sweep=ttft", "--clock=h200", "--ttft_prompts=64,128",
                 "--prefill_chunk=64", "--num_speculative_tokens=1", f"--out={tmp / 'ttft.json'}"],
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


def test_ttft_sweep_json(runs):
    """Prompts of 64 and 128 tokens, 64-token chunks, K = 1: one row each with the clock's
    TTFT (at least the 27B prefill's roofline: the clock prices every chunk and the step that
    samples the first token, plus host time) and its split; a longer prompt takes longer."""
    from mtpjax.cost_model import CostModel
    stdout_doc, doc, text = runs["ttft"]
    assert stdout_doc == doc
    assert doc["sweep"] == "ttft" and doc["clock"] == "h200" and doc["prefill_chunk"] == 64
    rows = doc["ttft"]
    assert [r["prompt_tokens"] for r in rows] == [64, 128]
    m = CostModel(K=1)
    for r in rows:
        for key in ("prompt_tokens", "ttft_ms", "roofline_ms", "ratio", "prefill_chunks",
                    "prefill_ms", "first_step_ms", "overhead_ms", "host_ms"):
            assert key in r, key
        assert r["ttft_ms"] >= r["roofline_ms"] > 0, r
        assert r["roofline_ms"] == pytest.approx(1e3 * m.prefill_roofline(r["prompt_tokens"]))
        assert r["ratio"] == pytest.approx(r["ttft_ms"] / r["roofline_ms"])
        # the clock's split: chunks alone + the step that samples + the host time between
        assert r["ttft_ms"] == pytest.approx(r["prefill_ms"] + r["first_step_ms"] + r["host_ms"])
        assert r["host_ms"] >= 0 and r["first_step_ms"] > 0
        assert 0 < r["overhead_ms"] < r["prefill_ms"] + r["first_step_ms"]
    # 63 tokens prefill in the step the last one joins; 127: one chunk alone, one riding
    assert [r["prefill_chunks"] for r in rows] == [1, 2]
    assert rows[0]["prefill_ms"] == 0 < rows[1]["prefill_ms"]
    assert rows[1]["ttft_ms"] > rows[0]["ttft_ms"]
    assert "roof_ms" in text


def test_ttft_sweep_needs_the_h200_clock():
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    p = subprocess.run([sys.executable, "-m", "experiments", "bench", "--sweep=ttft",
                        "--out="], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=TIMEOUT_S)
    assert p.returncode != 0 and "--clock=h200" in p.stderr


# --------------------------------------------------------------------------------------------
# bench --sweep=lanes
# --------------------------------------------------------------------------------------------

def test_sweep_flag_values():
    assert depth_sweep.parse_depths(["0", "2", " Adaptive", "1"]) == [0, 2, "adaptive", 1]
    assert depth_sweep.adaptive_k([0, 2, "adaptive", 1]) == 2
    assert depth_sweep.parse_lanes(["1", "16", "4"]) == [1, 16, 4]
    for bad, msg in ((["0", "fast"], "unknown depth 'fast'"), (["-1"], ">= 0, got -1"),
                     (["1", "1"], "listed twice"), (["adaptive"], "must be >= 1"),
                     (["0", "adaptive"], "must be >= 1"), ([], "at least one")):
        with pytest.raises(ValueError, match=msg):
            depth_sweep.parse_depths(bad)
    for bad, msg in ((["0"], ">= 1, got 0"), (["x"], "not an integer"), (["2", "2"], "twice")):
        with pytest.raises(ValueError, match=msg):
            depth_sweep.parse_lanes(bad)


def test_sweep_cli_rejects_bad_depth():
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    p = subprocess.run([sys.executable, "-m", "experiments", "bench", "--sweep=lanes",
                        "--sweep_depths=0,2,deep", "--out="], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=TIMEOUT_S)
    assert p.returncode != 0
    assert "--sweep_depths: unknown depth 'deep'" in p.stderr
    assert "model:" not in p.stdout          # refused before loading anything


def test_heldout_prompts():
    from mtpjax.text import Tokenizer
    tok = Tokenizer.from_checkpoint(os.path.join(ROOT, "checkpoints", "tiny"))
    five = depth_sweep.heldout_prompts(tok, 5, 16, seed=3)
    assert [len(p) for p in five] == [16] * 5
    assert all(0 <= t < tok.vocab_size for p in five for t in p)
    assert len({tuple(p) for p in five}) == 5
    assert depth_sweep.heldout_prompts(tok, 2, 16, seed=3) == five[:2]   # prefix-stable
    assert depth_sweep.heldout_prompts(tok, 2, 16, seed=4) != five[:2]


def test_sweep_table_and_numbers():
    """1 lane x depths 0,1,adaptive, 2 interleaved passes, on the VOCAB11 random model.

    One lane count keeps it to ~25 s of CPU (nearly all compiling: every engine shape compiles
    its own prefill and decode programs); test_sweep_table_layout covers several rows."""
    from tiny_models import VOCAB11_CFG, VOCAB11_PARAMS
    lanes, depths, rpl, new, passes = [1], [0, 1, "adaptive"], 2, 6, 2
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(0, VOCAB11_CFG.vocab_size, 5)] for _ in range(4)]
    log = []
    res = depth_sweep.run_sweep(VOCAB11_CFG, VOCAB11_PARAMS, prompts, lanes=lanes,
                                depths=depths, requests_per_lane=rpl, new_tokens=new,
                                passes=passes, kernels="reference", log=log.append)
    cells = {(c["lanes"], c["depth"]): c for c in res["cells"]}
    assert set(cells) == {(L, d) for L in lanes for d in depths}
    assert res["settings"]["adaptive_k"] == 1
    for (L, d), c in cells.items():
        k = 1 if d == "adaptive" else d
        assert c["num_speculative_tokens"] == k
        assert c["policy"] == ("adaptive" if d == "adaptive" else "fixed")
        assert len(c["passes"]) == passes
        for p in c["passes"]:
            # every request generated exactly `new` tokens (stop tokens off), and the pass's
            # count is the outputs' lengths
            assert p["output_lengths"] == [new] * (L * rpl)
            assert p["tokens"] == sum(p["output_lengths"])
            assert p["tokens_per_s"] == pytest.approx(p["tokens"] / p["seconds"])
            assert sum(p["depth_steps"]) == p["steps"] > 0
            assert "token_ids" not in p
        assert c["tokens"] == passes * L * rpl * new
        assert c["tokens_per_s"] == pytest.approx(
            float(np.median([p["tokens_per_s"] for p in c["passes"]])))
        base = cells[L, 0]["tokens_per_s"]
        assert c["ratio_vs_depth0"] == pytest.approx(c["tokens_per_s"] / base)
        assert len(c["depth_steps"]) == k + 1 and sum(c["depth_steps"]) == c["steps"]
        assert c["steps"] == sum(p["steps"] for p in c["passes"])
        if d != "adaptive":                     # a fixed engine with a full pool runs depth d
            assert c["depth_steps"][d] == c["steps"]
        if c["verify_steps"]:
            assert c["tokens_per_verify_step"] == pytest.approx(
                (c["accepted_tokens"] + c["verify_steps"]) / c["verify_steps"])
            assert 1 <= c["tokens_per_verify_step"] <= k + 1
        else:
            assert c["tokens_per_verify_step"] is None
        if d != 0:
            assert c["same_tokens_as_depth0"] == 1.0   # greedy speculation is lossless
        if d == "adaptive":
            assert {"chosen", "costs_ms", "pooled_acceptance"} <= set(c["policy_report"])
    # speculation did accept drafts (VOCAB11 drafts land often)
    assert cells[1, 1]["accepted_tokens"] > 0
    # passes interleave: pass 1 in the flag's order, pass 2 reversed
    order = [(line.split()[0], line.split()[1] if "adaptive" in line else line.split()[2])
             for line in log if " pass " in line]
    assert order == [(f"lanes={L}", str(d)) for L in lanes
                     for d in depths + depths[::-1]]
    # ONE markdown table: header, separator, one row per lane count, a cell per depth
    table = depth_sweep.format_table(res)
    rows = [r for r in table.splitlines() if r.startswith("|")]
    assert rows[0] == "| lanes | depth 0 | depth 1 | adaptive |"
    assert rows[1] == "|---:|---:|---:|---:|"
    assert len(rows) == 2 + len(lanes)
    for L, row in zip(lanes, rows[2:]):
        parts = [x.strip() for x in row.strip("|").split("|")]
        assert parts[0] == str(L) and len(parts) == 1 + len(depths)
        for d, text in zip(depths, parts[1:]):
            c = cells[L, d]
            assert text.startswith(f"{c['tokens_per_s']:.1f} ({c['ratio_vs_depth0']:.2f}x)")
            if d == "adaptive":
                assert text.endswith(" · d" + "/".join(map(str, c["depth_steps"])))
    assert any(rows[-1] in entry for entry in log)   # the row was logged when it was done


def test_sweep_on_the_h200_clock_prices_the_27b_and_keeps_the_tokens():
    """clock="h200": each cell's engine times itself on its own VirtualClock, so a pass takes
    at least its steps' modelled 27B price (a tiny-model step here takes a few ms; the 27B
    step about 16 ms), and greedy speculation stays lossless. Same shapes as
    test_sweep_table_and_numbers: no new programs."""
    from mtpjax.cost_model import CostModel
    from tiny_models import VOCAB11_CFG, VOCAB11_PARAMS
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(0, VOCAB11_CFG.vocab_size, 5)] for _ in range(4)]
    res = depth_sweep.run_sweep(VOCAB11_CFG, VOCAB11_PARAMS, prompts, lanes=[1],
                                depths=[0, 1], requests_per_lane=2, new_tokens=6, passes=1,
                                kernels="reference", log=lambda line: None, clock="h200")
    assert res["settings"]["clock"] == "h200"
    cells = {c["depth"]: c for c in res["cells"]}
    for d, c in cells.items():
        floor = CostModel(K=d).decode(d, 1, [0]).seconds   # the cheapest step of this depth
        for p in c["passes"]:
            assert p["seconds"] >= p["steps"] * floor, (d, p["seconds"], p["steps"], floor)
            assert p["seconds"] < p["steps"] * floor * 3 + 1.0   # modelled, not this CPU's compiles
    assert cells[1]["same_tokens_as_depth0"] == 1.0
    with pytest.raises(ValueError, match="--clock must be one of"):
        depth_sweep.make_engine(VOCAB11_CFG, VOCAB11_PARAMS, 1, 0, [0], 32, "reference",
                                clock="tpu")


def _cell(lanes, depth, tps, base, tpv=None, hist=(5,)):
    return {"lanes": lanes, "depth": depth, "tokens_per_s": tps, "ratio_vs_depth0": tps / base,
            "tokens_per_verify_step": tpv, "depth_steps": list(hist)}


def test_sweep_table_layout():
    res = {"settings": {"lanes": [1, 4], "depths": [0, 2, "adaptive"], "passes": 2,
                        "adaptive_k": 2},
           "cells": [_cell(1, 0, 50.0, 50.0), _cell(1, 2, 75.0, 50.0, 2.5, (0, 0, 9)),
                     _cell(1, "adaptive", 70.0, 50.0, 2.25, (1, 2, 7)),
                     _cell(4, 0, 200.0, 200.0), _cell(4, 2, 180.0, 200.0, 1.5, (0, 0, 30)),
                     _cell(4, "adaptive", 210.0, 200.0, None, (30, 0, 0))]}
    table = depth_sweep.format_table(res).splitlines()
    assert table[:4] == [
        "| lanes | depth 0 | depth 2 | adaptive |",
        "|---:|---:|---:|---:|",
        "| 1 | 50.0 (1.00x) · - | 75.0 (1.50x) · 2.50/step "
        "| 70.0 (1.40x) · 2.25/step · d1/2/7 |",
        "| 4 | 200.0 (1.00x) · - | 180.0 (0.90x) · 1.50/step | 210.0 (1.05x) · - · d30/0/0 |"]
    assert "median of 2 pass(es)" in table[-1] and "depth 0/1/.../2" in table[-1]
