"""`python -m experiments loop_check`: the serial and the overlapped loop side by side, on the
random VOCAB11 model (a short run: the cells' keys, their arithmetic and that both loops emit
the same tokens; the timing itself is measured by the command, not tested)."""

import pytest

from experiments import loop_runs as loop_check

from tiny_models import VOCAB11_CFG as CFG, VOCAB11_PARAMS as PARAMS


def test_cell_summary_is_per_step_medians():
    passes = [{"tokens_per_s": t, "host_s": h, "host_work_s": w, "step_s": s, "steps": n,
               "overlapped": o, "launches": 10}
              for t, h, w, s, n, o in ((100.0, 0.010, 0.020, 0.5, 10, 9),
                                       (300.0, 0.030, 0.040, 0.7, 10, 10),
                                       (200.0, 0.020, 0.030, 0.6, 10, 8))]
    c = loop_check.cell_summary(passes)
    assert c["tokens_per_s"] == 200.0 and c["steps"] == 10
    assert c["host_ms"] == pytest.approx(2.0) and c["host_work_ms"] == pytest.approx(3.0)
    assert c["step_ms"] == pytest.approx(60.0) and c["overlapped"] == pytest.approx(0.9)


def test_both_loops_same_tokens_and_the_overlapped_one_launches_ahead():
    prompts = [[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 2, 3, 4]]
    out = loop_check.run(CFG, PARAMS, prompts, [2], k=2, passes=1, requests_per_lane=1,
                         new_tokens=8, clock="wall", log=lambda line: None)
    rows = out["rows"]
    assert {(r["engine"], r["loop"]) for r in rows} == {
        (e, loop) for e in ("stock", "candidate") for loop in ("serial", "overlapped")}
    for r in rows:
        assert r["same_tokens"] and r["tokens_per_s"] > 0 and r["host_ms"] >= 0
        assert r["overlapped"] == 0 if r["loop"] == "serial" else r["overlapped"] > 0.5
