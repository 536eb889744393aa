"""The online engine (mtpjax/serving/online.py): requests added from other threads while the loop
runs get exactly the tokens `Engine.generate` gives them; cancelled ones free their pages; stop
strings cut the text exactly, streaming included; bad requests end with an error and leave the
others alone. Also the text-level helpers the server uses: the stop-string cutter and the
reasoning split."""

import asyncio
import threading
import time

import numpy as np
import pytest

from mtpjax.engine import Engine
from mtpjax.serving.online import OnlineEngine, StopStringCutter
from mtpjax.sampling import SamplingParams
from mtpjax.text import StreamDecoder, split_reasoning, ReasoningStream

from tiny_models import VOCAB11_CFG as CFG, VOCAB11_PARAMS as PARAMS

ALPHABET = "abcdefghij|"          # token i decodes to ALPHABET[i]: text positions = token positions


class CharTokenizer:
    """One character per token, so expected texts and cut points are computed by hand."""

    def decode(self, ids, skip_special_tokens=False):
        return "".join(ALPHABET[i] for i in ids)

    def stream(self, skip_special_tokens=False):
        return StreamDecoder(self, skip_special_tokens)


rng = np.random.default_rng(3)
PROMPTS = [[int(t) for t in rng.integers(0, 11, rng.integers(2, 12))] for _ in range(8)]
SAMPLING = [SamplingParams(max_new_tokens=int(n), temperature=float(t), top_k=int(k), seed=i)
            for i, (n, t, k) in enumerate(zip(rng.integers(4, 14, 8), rng.choice([0.0, 0.9], 8),
                                              rng.choice([0, 4], 8)))]


@pytest.fixture(scope="module")
def engine():
    return Engine(CFG, PARAMS, num_speculative_tokens=1, max_lanes=2, max_seq_len=48,
                  prefill_chunk=16, prefill_buckets=[16], page_size=4, num_pages=16,
                  kernels="reference")


@pytest.fixture(scope="module")
def reference(engine):
    return [o.token_ids for o in engine.generate(PROMPTS, SAMPLING)]


def all_pages_back(engine):
    """Every page free or held only by the prefix cache, and free once that is dropped."""
    if engine.stats()["free_pages"] != engine.num_pages:
        return False
    engine.clear_prefix_cache()
    return engine.alloc.free_pages == engine.num_pages


def wait_free(online, engine, timeout=20.0):
    t0 = time.time()
    while time.time() - t0 < timeout:
        st = online.stats().engine
        if st.get("free_pages") == engine.num_pages and online.stats().running == 0:
            return st["free_pages"]
        time.sleep(0.02)
    return online.stats().engine.get("free_pages")


def test_concurrent_adds_match_generate(engine, reference):
    """Half the requests are read with plain iterators on their own threads, half with async
    iterators on an asyncio loop; they arrive staggered while others run."""
    got: dict[int, tuple] = {}
    with OnlineEngine(engine, CharTokenizer()) as online:
        handles = []

        def read_sync(i, h):
            deltas = list(h)
            got[i] = ([t for d in deltas for t in d.token_ids], h.result())

        async def read_async(pairs):
            async def one(i, h):
                ids = [t async for d in h for t in d.token_ids]
                got[i] = (ids, await h.aresult())
            await asyncio.gather(*(one(i, h) for i, h in pairs))

        threads = []
        for i in range(0, 8, 2):
            h = online.add(PROMPTS[i], SAMPLING[i])
            threads.append(threading.Thread(target=read_sync, args=(i, h)))
            threads[-1].start()
            time.sleep(0.01 * i)
        pairs = [(i, online.add(PROMPTS[i], SAMPLING[i])) for i in range(1, 8, 2)]
        asyncio.run(read_async(pairs))
        for t in threads:
            t.join(60)
        for i, want in enumerate(reference):
            streamed, out = got[i]
            assert streamed == want, i
            assert out.token_ids == want, i
            assert out.text == "".join(ALPHABET[t] for t in want), i
            assert out.finish_reason == "length" and out.error is None
            assert out.completion_tokens == SAMPLING[i].max_new_tokens
            assert out.prompt_tokens == len(PROMPTS[i])
        assert wait_free(online, engine) == engine.num_pages
        st = online.stats()
        assert st.finished == {"length": 8}
        assert st.generation_tokens == sum(len(w) for w in reference)
        assert st.prompt_tokens == sum(map(len, PROMPTS))
        assert st.iterations > 0 and sum(st.iteration_buckets) <= st.iterations
        assert sum(st.tried_per_position) > 0     # k = 1: some drafts were verified
    assert all_pages_back(engine)


def test_cancel_frees_pages_and_others_continue(engine, reference):
    with OnlineEngine(engine) as online:
        long = online.add([1, 2, 3], SamplingParams(max_new_tokens=40, temperature=1.0, seed=9))
        other = online.add(PROMPTS[0], SAMPLING[0])
        first = next(iter(long))
        assert len(first.token_ids) >= 1
        long.cancel()
        out = long.result(30)
        assert out.finish_reason == "cancelled"
        assert 1 <= len(out.token_ids) < 40
        assert other.result(30).token_ids == reference[0]
        assert wait_free(online, engine) == engine.num_pages


def test_stop_strings_cut_exactly(engine, reference):
    """The stop string is chosen inside the reference text; the expected cut is computed with
    str.find: the text ends just before it, the ids at the token that completed it."""
    i = max(range(8), key=lambda j: len(reference[j]))
    full = "".join(ALPHABET[t] for t in reference[i])
    stop = full[4:6]
    at = full.find(stop)
    with OnlineEngine(engine, CharTokenizer()) as online:
        h = online.add(PROMPTS[i], SAMPLING[i], stop=["zz", stop])
        deltas = list(h)
        out = h.result()
        nostop = online.add(PROMPTS[i], SAMPLING[i], stop=["never"]).result(30)
        assert wait_free(online, engine) == engine.num_pages
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full[:at]
    assert "".join(d.text for d in deltas) == full[:at]
    assert out.token_ids == reference[i][:at + len(stop)]
    assert [t for d in deltas for t in d.token_ids] == out.token_ids
    assert nostop.text == full and nostop.finish_reason == "length"


def test_bad_requests_end_with_errors_and_do_not_disturb(engine, reference):
    with OnlineEngine(engine) as online:
        good = online.add(PROMPTS[1], SAMPLING[1])
        bad = [online.add([99], SamplingParams()),                       # outside the vocab
               online.add(list(range(10)) * 5, SamplingParams()),        # longer than 48
               online.add([], SamplingParams()),
               online.add([1, 2], SamplingParams(stop_token_ids=(50,)))]
        outs = [b.result(30) for b in bad]
        assert [o.finish_reason for o in outs] == ["error"] * 4
        assert "outside the vocabulary" in outs[0].error
        assert "prompt too long" in outs[1].error
        assert "empty prompt" in outs[2].error
        assert "invalid sampling parameters" in outs[3].error
        assert good.result(30).token_ids == reference[1]
        assert online.stats().finished == {"error": 4, "length": 1}
        with pytest.raises(ValueError, match="need a tokenizer"):
            online.add([1], SamplingParams(), stop=["x"])


def test_a_failing_step_ends_its_requests_and_serving_goes_on(engine, reference):
    real_step, calls = engine.step, []

    def step():
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("injected step failure")
        return real_step()

    engine.step = step
    try:
        with OnlineEngine(engine) as online:
            out = online.add(PROMPTS[2], SAMPLING[2]).result(30)
            assert out.finish_reason == "error" and "injected step failure" in out.error
            assert online.stats().engine_errors == 1
            assert online.add(PROMPTS[3], SAMPLING[3]).result(30).token_ids == reference[3]
            assert wait_free(online, engine) == engine.num_pages
    finally:
        del engine.step
    assert all_pages_back(engine)


def test_shutdown_cancels_running_requests(engine):
    online = OnlineEngine(engine).start()
    h = online.add([4, 5, 6], SamplingParams(max_new_tokens=40))
    next(iter(h))
    online.shutdown()
    assert h.result(5).finish_reason == "cancelled"
    assert all_pages_back(engine)
    with pytest.raises(RuntimeError, match="not running"):
        online.add([1], SamplingParams())


# ------------------------------------------------------------------- text-level helpers
def run_cutter(stops, pieces):
    c = StopStringCutter(stops)
    out = [c.push(p) for p in pieces]
    out.append(c.flush())
    return out, c.hit


def test_stop_string_cutter_holds_back_possible_starts():
    assert run_cutter(["</s>"], ["ab<", "/", "s", ">tail"]) == (["ab", "", "", "", ""], "</s>")
    # a held prefix that turns out not to be a stop string is released, none of it lost
    assert run_cutter(["</s>"], ["ab<", "/x", "y"]) == (["ab", "</x", "y", ""], None)
    assert run_cutter(["</s>"], ["ab</"]) == (["ab", "</"], None)
    # the earliest stop wins, whatever the order of the list
    assert run_cutter(["cd", "b"], ["abcd"]) == (["a", ""], "b")
    assert run_cutter(["xx"], ["ax", "xb", "more"]) == (["a", "", "", ""], "xx")
    with pytest.raises(ValueError, match="non-empty"):
        StopStringCutter([""])


@pytest.mark.parametrize("text, thinking, want", [
    ("plan</think>\n\nanswer", True, ("plan", "\n\nanswer")),
    ("<think>plan</think>answer", True, ("plan", "answer")),
    ("still thinking", True, ("still thinking", None)),
    ("</think>answer", True, (None, "answer")),
    ("plan</think>", True, ("plan", None)),
    ("answer </think> x", False, (None, "answer </think> x")),
    ("a</thi", True, ("a</thi", None)),
])
def test_split_reasoning(text, thinking, want):
    assert split_reasoning(text, thinking) == want
    # streamed one character at a time, the deltas add up to the same split
    s = ReasoningStream(thinking)
    parts = [s.push(ch) for ch in text] + [s.flush()]
    r = "".join(p[0] for p in parts) or None
    c = "".join(p[1] for p in parts) or None
    assert (r, c) == want
