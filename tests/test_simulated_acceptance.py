"""Simulated acceptance (mtpjax/simulated_acceptance.py) and `experiments clock_check`: the
profiles reproduce the published table they cite, the draws follow the profile and are
seeded, and clock_check prices our programs at the profile's acceptance beside SGLang's TPOT,
labelled a comparison of engines."""

import json

import numpy as np
import pytest

from mtpjax import simulated_acceptance as sa
from mtpjax.cost_model import CostModel


@pytest.mark.parametrize("name,table", [("qwen3.5-27b-nothink", (1.90, 2.68, 3.28, 3.79)),
                                        ("qwen3.5-27b-think", (1.73, 2.21, 2.52, 2.72))])
def test_profiles_reproduce_the_published_table(name, table):
    p = sa.load(name)
    assert p.tokens_per_verify_step == table and "InferenceX" in p.source \
        and "#3304" in p.source
    for k, t in enumerate(table, start=1):
        assert p.tokens_per_step(k) == pytest.approx(t, abs=1e-9)
    assert p.tokens_per_step(0) == 1.0


def test_nothink_conditional_rates():
    assert sa.load("qwen3.5-27b-nothink").conditional() == pytest.approx(
        [0.90, 0.78 / 0.90, 0.60 / 0.78, 0.51 / 0.60])


def test_profile_must_be_a_prefix_chain(tmp_path):
    with pytest.raises(ValueError):
        sa.Profile("bad", (2.5,), "x")            # more than one token per draft
    with pytest.raises(ValueError):
        sa.Profile("bad", (1.5, 2.2), "x")        # the second draft adds more than the first
    with pytest.raises(ValueError):
        sa.load("no-such-profile")
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"name": "mine", "tokens_per_verify_step": [1.5, 1.8],
                                "source": "made up"}))
    assert sa.load(str(path)).conditional() == pytest.approx([0.5, 0.6])


@pytest.mark.parametrize("k", [1, 2, 4])
def test_draws_follow_the_profile_and_are_seeded(k):
    sim = sa.Simulator("qwen3.5-27b-nothink", seed=3)
    n = np.asarray([sim.draw(k, [k] * 100) for _ in range(200)])
    assert n.min() >= 0 and n.max() <= k
    assert 1 + n.mean() == pytest.approx(sim.profile.tokens_per_step(k), abs=0.03)
    again = sa.Simulator("qwen3.5-27b-nothink", seed=3)
    assert again.draw(k, [k] * 100) == list(n[0])


def test_draws_never_accept_an_empty_draft_slot():
    sim = sa.Simulator(sa.Profile("all", (2.0, 3.0, 4.0), "every draft accepted"))
    assert sim.draw(3, [3, 1, 0]) == [3, 1, 0]
    f = sim.forced(3, [0, 2], [3, 2], bucket=4)
    assert f.tolist() == [3, -1, 2, -1] and f.dtype == np.int32


def test_clock_check_prices_our_programs_beside_sglang(capsys):
    from experiments import clock_check
    r = clock_check.check()
    assert set(r["rows"]) == {1, 16} and "not a validation" in r["what"]
    model = CostModel(K=4)
    for lanes, sglang in ((1, 5.61), (16, 17.28)):
        v = r["rows"][lanes]
        assert v["sglang_tpot_ms"] == sglang and v["depth"] == 3
        mid = 1e3 * model.decode(3, lanes, [8192 + 512] * lanes).seconds
        assert v["step_ms"][1] == pytest.approx(mid)
        assert v["tpot_ms"][1] == pytest.approx(mid / 3.28)
        for key in ("step_ms", "tpot_ms", "tpot_with_prefills_ms", "stock_tpot_ms"):
            assert v[key][0] < v[key][1] < v[key][2], key
    # one request's own prefill is outside its TPOT; sixteen requests' replacements are not
    assert r["rows"][1]["tpot_with_prefills_ms"] == pytest.approx(r["rows"][1]["tpot_ms"])
    assert r["rows"][16]["tpot_with_prefills_ms"][1] > r["rows"][16]["tpot_ms"][1]
    text = clock_check.format_rows(r)
    assert "COMPARISON OF ENGINES" in text and "5.61" in text and "17.28" in text
