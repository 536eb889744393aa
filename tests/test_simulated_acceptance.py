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


# ---------------------------------------------------------------- the step and the engine

def test_forced_accept_emits_drafts_then_the_targets_token():
    """steps._forced_accept on hand-made rows: lane 0 really accepted 1 of 2 drafts (t0 = d0,
    correction t1); forced to 2 it emits d0, d1 and then t1 (the target never sampled row 2,
    so the real correction stands in); forced to 0 it emits t0; -1 leaves the lane as the
    target decided."""
    import jax.numpy as jnp
    from mtpjax.steps import _forced_accept
    n_acc = jnp.asarray([1, 1, 1, 0])
    out = jnp.asarray([[5, 6, -1], [5, 6, -1], [5, 6, -1], [9, -1, -1]])
    drafts = jnp.asarray([[5, 8], [5, 8], [5, 8], [4, 4]])
    n, toks = _forced_accept(n_acc, out, drafts, jnp.asarray([2, 0, -1, 1]))
    assert n.tolist() == [2, 0, 1, 1]
    assert toks.tolist() == [[5, 8, 6], [5, -1, -1], [5, 6, -1], [4, 9, -1]]


def _engine(**kw):
    import mtpjax
    from tiny_models import TP_CFG, TP_ENGINE_KW, TP_PARAMS
    return mtpjax.Engine(TP_CFG, TP_PARAMS, num_speculative_tokens=2, **TP_ENGINE_KW, **kw)


def test_simulated_rejection_is_plain_decoding():
    """A profile that accepts nothing: every step emits the target's own token at row 0, so
    the output is greedy plain decoding token for token: the forced rollback leaves the cache,
    the GDN replay and the positions as a real rejection does."""
    from tiny_models import TP_PROMPTS
    from mtpjax import SamplingParams
    sp = SamplingParams(max_new_tokens=12)
    import mtpjax
    from tiny_models import TP_CFG, TP_ENGINE_KW, TP_PARAMS
    plain = mtpjax.Engine(TP_CFG, TP_PARAMS, **TP_ENGINE_KW).generate(TP_PROMPTS, sp)
    never = sa.Profile("never", (1.0, 1.0), "accepts nothing")
    e = _engine(simulate_acceptance=never)
    outs = e.generate(TP_PROMPTS, sp)
    for a, b in zip(plain, outs):
        assert b.token_ids == a.token_ids
        assert b.stats.accepted_tokens == 0 and b.stats.verify_steps > 0
    assert e.stats()["simulated_acceptance"]["profile"] == "never"


def test_simulated_acceptance_drives_the_counts_and_the_policy():
    """A profile that accepts every draft: each verify step accepts all of a lane's real
    drafts (what the tiny model's drafts are does not matter), the requests run to their
    length, and the adaptive policy's pooled acceptance is the profile's (1.0)."""
    from tiny_models import TP_PROMPTS
    from mtpjax import SamplingParams
    always = sa.Profile("always", (2.0, 3.0), "accepts every draft")
    e = _engine(simulate_acceptance=always, speculation_policy="adaptive")
    outs = e.generate(TP_PROMPTS, SamplingParams(max_new_tokens=12))
    for o in outs:
        st = o.stats
        assert o.error is None and len(o.token_ids) == 12
        assert st.verify_steps > 0 and st.accepted_tokens == st.drafted_tokens
    assert e.policy.report()["pooled_acceptance"][0] > 0.9
