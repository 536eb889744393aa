"""The judge: its arithmetic on known inputs, an end-to-end run, and a broken candidate failing."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import judge, judge_gate as gate
from judge_fixtures import write_judge_checkpoint
from mtpjax import sampling

SMALL = dict(passes=1, solo_requests=2, team_lanes=2, team_requests=4, busy_lanes=2, prompt_tokens=16,
             busy_requests=6, max_new_tokens=12, gate_prompts=8, fidelity_tokens=8,
             progress=False)


def test_interval_rule():
    assert not gate.interval_outside(0.0, 0.0, 0.05)
    assert not gate.interval_outside(0.06, 0.01, 0.05)      # interval touches the band
    assert gate.interval_outside(0.2, 0.01, 0.05)
    assert gate.interval_outside(-0.2, 0.01, 0.05)


def test_agreements_and_lengths():
    assert gate.greedy_agreement([[1, 2, 3, 4]], [[1, 2, 9, 9]]) == 0.5
    assert gate.sampled_agreement([[1, 2, 3]], [[1, 5, 3, 4]]) == 0.5
    same = gate.length_ratio([10, 12, 8], [10, 12, 8])
    assert same == {"ratio": 1.0, "low": 1.0, "high": 1.0}
    long = gate.length_ratio([20, 24, 16, 22], [10, 12, 8, 11])
    assert long["low"] > 1.5
    assert gate.geomean([1.0, 4.0]) == pytest.approx(2.0)
    g, se = gate.paired_gap([1.0, 2.0, 3.0], [0.0, 1.0, 2.0])
    assert g == pytest.approx(1.0) and se == pytest.approx(0.0)


def _measured(**over):
    m = {"memory": {"candidate_mib": 10.0, "stock_mib": 9.0}, "fidelity": 1e-6,
         "likelihood": {"gap": 0.0, "se": 0.01}, "argmax": {"gap": 0.0, "se": 0.001},
         "greedy_agreement": 1.0, "sampled_agreement": 1.0,
         "lengths": {"solo": {"ratio": 1.0, "low": 0.98, "high": 1.02}},
         "ratios": {"solo": {"passes": [1.2], "ratio": 1.2}, "team": {"passes": [1.1], "ratio": 1.1}}}
    m.update(over)
    return m


@pytest.mark.parametrize("over,reason", [
    ({}, None),
    ({"memory": {"candidate_mib": 5000.0, "stock_mib": 9.0}}, "memory"),
    ({"fidelity": 0.5}, "fidelity"),
    ({"likelihood": {"gap": -0.3, "se": 0.01}}, "likelihood"),
    ({"argmax": {"gap": 0.2, "se": 0.01}}, "argmax"),
    ({"lengths": {"solo": {"ratio": 1.5, "low": 1.3, "high": 1.7}}}, "lengths"),
])
def test_gate_reason_names_the_first_failed_check(over, reason):
    v = gate.evaluate(_measured(**over), gate.Limits())
    assert v["reason"] == reason
    assert (v["score"] == 0.0) == (reason is not None)
    assert v["specscore"] == pytest.approx(np.sqrt(1.2 * 1.1))


def test_greedy_floor_is_optional():
    m = _measured(greedy_agreement=0.5)
    assert gate.evaluate(m, gate.Limits())["reason"] is None
    assert gate.evaluate(m, gate.Limits(greedy_agreement_floor=0.9))["reason"] == "greedy_agreement"


@pytest.fixture(scope="module")
def peaky_ckpt(tmp_path_factory):
    return write_judge_checkpoint(str(tmp_path_factory.mktemp("judge_ckpt")), peaky=40.0)


def test_judge_end_to_end_card(peaky_ckpt, tmp_path):
    jc = judge.JudgeConfig(checkpoint=peaky_ckpt, out_dir=str(tmp_path), **SMALL)
    card = judge.run_judge(jc)
    on_disk = json.load(open(tmp_path / "card.json"))
    for key in ("ratios", "specscore", "greedy_agreement", "likelihood", "argmax", "fidelity",
                "lengths", "memory", "acceptance", "limits", "reason", "score",
                "sampled_agreement", "throughput", "step_time_ms", "settings"):
        assert key in on_disk, key
    assert set(on_disk["ratios"]) == {"solo", "team", "busy"}
    assert card["reason"] is None, card["checks"]
    assert card["sampled_agreement"] == 1.0 and card["greedy_agreement"] == 1.0
    assert card["fidelity"] < 1e-3
    for w in ("solo", "team", "busy"):
        assert 1.0 <= card["acceptance"][w] <= 2.0
    assert (tmp_path / "card.md").exists() and (tmp_path / "throughput.png").exists()
    assert (tmp_path / "acceptance.png").exists()


def _always_accept(real_verify):
    """The classic broken sampler: every draft is accepted without checking it."""
    def verify(target_logits, drafts, lanes, first_position):
        K = drafts.shape[1]
        last = sampling.sample(target_logits[:, K], lanes, first_position + K)
        tokens = jnp.concatenate([drafts, last[:, None]], axis=1)
        return jnp.full((drafts.shape[0],), K, jnp.int32), tokens
    return verify


def test_judge_fails_a_candidate_whose_sampler_always_accepts(peaky_ckpt, tmp_path, monkeypatch):
    monkeypatch.setattr(sampling, "verify", _always_accept(sampling.verify))
    jax.clear_caches()   # the step programs must be traced again with the broken sampler
    try:
        jc = judge.JudgeConfig(checkpoint=peaky_ckpt, out_dir=str(tmp_path), **SMALL)
        card = judge.run_judge(jc)
    finally:
        monkeypatch.undo()
        jax.clear_caches()
    assert card["reason"] == "likelihood", (card["reason"], card["likelihood"], card["argmax"])
    assert card["score"] == 0.0
    assert card["sampled_agreement"] < 0.9 and card["greedy_agreement"] < 1.0
