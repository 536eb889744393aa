"""Speculative engine == stock engine, token for token (float32), greedy and sampled.

A vocabulary of 11 makes random-weight MTP drafts land often enough that the accept,
rollback and redraft paths all run (the test asserts that they did).
"""

import dataclasses

import jax
import numpy as np
import pytest

import mtpjax
from mtpjax.sampling import SamplingParams

from tiny_models import VOCAB11_CFG as CFG, VOCAB11_PARAMS as PARAMS
RNG = np.random.default_rng(0)
PROMPTS = [list(RNG.integers(0, 11, n)) for n in (3, 21, 9, 40, 1)]
ENGINES = {}


def engine(k):
    if k not in ENGINES:
        ENGINES[k] = mtpjax.Engine(CFG, PARAMS, num_speculative_tokens=k, max_lanes=3,
                                   max_seq_len=96, prefill_chunk=16)
    return ENGINES[k]


def run(k, params):
    return engine(k).generate(PROMPTS, params)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_greedy_speculative_equals_greedy_plain(k):
    sp = SamplingParams(temperature=0.0, max_new_tokens=24)
    plain, spec = run(0, sp), run(k, sp)
    for a, b in zip(plain, spec):
        assert a.finish_reason == b.finish_reason == "length"
        assert b.token_ids == a.token_ids
        assert len(a.token_ids) == 24
    accepted = sum(o.stats.accepted_tokens for o in spec)
    assert accepted > 0, "no draft was ever accepted: the accept path was not exercised"
    st = spec[1].stats
    assert st.drafted_tokens == k * st.verify_steps
    assert st.accepted_per_position[0] >= max(st.accepted_per_position)
    assert sum(st.accepted_per_position) == st.accepted_tokens
    # prefill emits 1, each step 1 + accepted; the last step may overshoot max_new_tokens
    assert st.verify_steps + st.accepted_tokens + 1 - k <= len(spec[1].token_ids)
    assert len(spec[1].token_ids) <= st.verify_steps + st.accepted_tokens + 1


def test_stop_tokens_end_both_engines_at_the_same_place():
    plain_free = run(0, SamplingParams(max_new_tokens=30))
    # stop on a token that appears mid-way in a reply
    stop = plain_free[1].token_ids[7]
    sp = SamplingParams(max_new_tokens=30, stop_token_ids=(stop,))
    plain, spec = run(0, sp), run(2, sp)
    for a, b in zip(plain, spec):
        assert b.token_ids == a.token_ids and b.finish_reason == a.finish_reason
    assert plain[1].finish_reason == "stop" and plain[1].token_ids[-1] == stop
    assert len(plain[1].token_ids) <= 8


@pytest.mark.parametrize("sp", [
    SamplingParams(temperature=1.0, seed=7, max_new_tokens=20),
    SamplingParams(temperature=0.7, top_k=3, seed=8, max_new_tokens=20),
    SamplingParams(temperature=1.3, top_p=0.8, seed=9, max_new_tokens=20),
    SamplingParams(temperature=0.9, top_k=5, top_p=0.9, seed=10, max_new_tokens=20),
], ids=["temperature", "top_k", "top_p", "top_k_top_p"])
def test_sampled_speculative_equals_sampled_plain(sp):
    params = [dataclasses.replace(sp, seed=sp.seed + i) for i in range(len(PROMPTS))]
    plain, spec = run(0, params), run(1, params)
    for a, b in zip(plain, spec):
        assert b.token_ids == a.token_ids
    assert sum(o.stats.accepted_tokens for o in spec) > 0
    # and the seed matters (the test could fail): another seed gives another reply
    other = run(0, [dataclasses.replace(p, seed=p.seed + 100) for p in params])
    assert any(o.token_ids != a.token_ids for o, a in zip(other, plain))


def test_mixed_per_request_params_in_one_batch():
    params = [SamplingParams(temperature=0.0, max_new_tokens=12),
              SamplingParams(temperature=1.0, seed=3, max_new_tokens=15),
              SamplingParams(temperature=0.8, top_k=2, seed=4, max_new_tokens=9),
              SamplingParams(temperature=0.0, max_new_tokens=5),
              SamplingParams(temperature=1.0, top_p=0.5, seed=5, max_new_tokens=11)]
    plain, spec = run(0, params), run(3, params)
    for a, b, p in zip(plain, spec, params):
        assert b.token_ids == a.token_ids and len(a.token_ids) == p.max_new_tokens
    # each request's reply does not depend on its batch mates: run them alone
    for i in (1, 4):
        alone = engine(1).generate([PROMPTS[i]], params[i])[0]
        assert alone.token_ids == plain[i].token_ids
