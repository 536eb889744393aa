"""Engine sessions (start / submit / step / stop): requests submitted while others run get
the tokens `generate` gives them, invalid ones end at once with an error, stop() frees every
page. The online server (mtpjax/serving/online.py) is built on this."""

import numpy as np
import pytest

from mtpjax.engine import Engine
from mtpjax.sampling import SamplingParams

from tiny_models import VOCAB11_CFG as CFG, VOCAB11_PARAMS as PARAMS

rng = np.random.default_rng(7)
PROMPTS = [[int(t) for t in rng.integers(0, 11, rng.integers(1, 15))] for _ in range(12)]
PARAMS_ = [SamplingParams(max_new_tokens=int(n), temperature=float(t), seed=i)
           for i, (n, t) in enumerate(zip(rng.integers(2, 12, 12), rng.choice([0.0, 0.8], 12)))]


def engine():
    return Engine(CFG, PARAMS, num_speculative_tokens=2, max_lanes=4, max_seq_len=48,
                  prefill_chunk=8, page_size=4, num_pages=24, kernels="reference")


def test_requests_submitted_mid_run_match_generate():
    e = engine()
    want = [o.token_ids for o in e.generate(PROMPTS, PARAMS_)]
    streamed: dict[int, list[int]] = {}
    e.start(on_token=lambda i, ids: streamed.setdefault(i, []).extend(ids))
    done = {}
    nxt = 0
    while nxt < len(PROMPTS) or e.has_work():
        if nxt < len(PROMPTS):                 # one new request every iteration
            assert e.submit(100 + nxt, PROMPTS[nxt], PARAMS_[nxt]) is None
            nxt += 1
        done.update(e.step())
    assert e.stop() == {}
    assert sorted(done) == [100 + i for i in range(len(PROMPTS))]
    for i, w in enumerate(want):
        assert done[100 + i].token_ids == w, i
        assert streamed[100 + i] == w, i
    assert e.stats()["free_pages"] == e.num_pages      # free or only cached
    e.clear_prefix_cache()
    assert e.alloc.free_pages == e.num_pages
    e.alloc.check()


def test_bad_submit_errors_and_stop_cancels():
    e = engine()
    e.start()
    err = e.submit(0, [99], SamplingParams())
    assert err is not None and err.finish_reason == "error" and "outside the vocabulary" in err.error
    with pytest.raises(ValueError, match="already submitted"):
        e.submit(0, [1, 2], SamplingParams())
    assert e.submit(1, [1, 2, 3], SamplingParams(max_new_tokens=30)) is None
    e.step()
    e.step()
    left = e.stop()
    assert left[1].finish_reason == "cancelled"
    e.clear_prefix_cache()
    assert e.alloc.free_pages == e.num_pages
    with pytest.raises(RuntimeError, match="no session"):
        e.step()
