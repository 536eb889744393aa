"""The online engine survives its own failures (mtpjax/serving/online.py, issue 25 item 6):

- a step that fails inside its device program (the program ran, so its donated buffers are
  gone) or runs out of device memory, at the step or again while the device state is being
  re-created: the requests the step held end with an error, the device state is rebuilt
  (`Engine.reset_device_state`) and later requests get exactly the tokens an undisturbed
  engine gives them;
- requests still waiting in the queue when a step fails go into the new session and finish
  normally;
- /health answers 503 "rebuilding" while the device state is re-created, 200 after;
- cancel() from many threads while sessions stop and restart raises nothing;
- a detokenizer that raises ends its own request ("error", naming the detokenizer), not the
  others;
- the scheduler's id bookkeeping (duplicate ids, cancellations) stays bounded over 100,000
  requests.
"""

import contextlib
import random
import threading
import time

import jax
import numpy as np
import pytest

from mtpjax import tensor_parallel
from mtpjax.engine import Engine
from mtpjax.engine.kv_pool import PageAllocator
from mtpjax.sampling import SamplingParams
from mtpjax.engine.scheduler import RECENT_IDS, Request, Scheduler
from mtpjax.serving.online import OnlineEngine
from mtpjax.text import StreamDecoder

from tiny_models import VOCAB11_CFG as CFG, VOCAB11_PARAMS as PARAMS

ALPHABET = "abcdefghij|"          # token i decodes to ALPHABET[i]
OOM = jax.errors.JaxRuntimeError(
    "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1073741824 bytes.")

rng = np.random.default_rng(11)
PROMPTS = [[int(t) for t in rng.integers(0, 11, rng.integers(2, 12))] for _ in range(8)]
SAMPLING = [SamplingParams(max_new_tokens=int(n), temperature=float(t), seed=i)
            for i, (n, t) in enumerate(zip(rng.integers(8, 14, 8), rng.choice([0.0, 0.9], 8)))]
ENGINE_KW = dict(num_speculative_tokens=1, max_lanes=2, max_seq_len=48, prefill_chunk=16,
                 prefill_buckets=[16], page_size=4, num_pages=16, kernels="reference")


class CharTokenizer:
    """One character per token; `bad` (an id) makes decode raise, as a broken tokenizer
    (or a tokenizer file that does not match the model) would."""

    def __init__(self, bad: int | None = None):
        self.bad = bad

    def decode(self, ids, skip_special_tokens=False):
        if self.bad in ids:
            raise ValueError(f"no text for token {self.bad}")
        return "".join(ALPHABET[i] for i in ids)

    def stream(self, skip_special_tokens=False):
        return StreamDecoder(self, skip_special_tokens)


@pytest.fixture(scope="module")
def engine():
    return Engine(CFG, PARAMS, **ENGINE_KW)


@pytest.fixture(scope="module")
def reference(engine):
    return [o.token_ids for o in engine.generate(PROMPTS, SAMPLING)]


def all_pages_back(engine):
    if engine.stats()["free_pages"] != engine.num_pages:
        return False
    engine.clear_prefix_cache()
    engine.alloc.check()
    return engine.alloc.free_pages == engine.num_pages


def is_step(key):
    return key[0] in ("decode", "mixed")


@contextlib.contextmanager
def failing_program(engine, exc, when=is_step):
    """The first program launch whose key satisfies when(key) runs for real (its donated
    cache and lane state are deleted) and then raises exc. Yields a list that gets, when it
    fired, how many of the old device arrays the program deleted."""
    real, fired = engine.runner._program, []

    def program(key, run, *args, **kw):
        if fired or not when(key):
            return real(key, run, *args, **kw)
        before = jax.tree.leaves((engine.cache, engine.state))
        jax.block_until_ready(real(key, run, *args, **kw))
        fired.append(sum(x.is_deleted() for x in before))
        raise exc

    engine.runner._program = program
    try:
        yield fired
    finally:
        del engine.runner._program


# ------------------------------------------------------------------ device state rebuilt
def test_reset_device_state_rebuilds_what_the_constructor_built(engine, reference):
    engine.generate(PROMPTS[:3], SAMPLING[:3])         # pages and snapshots in the cache
    assert engine.prefix.entries and engine.alloc.held_pages
    old = jax.tree.leaves((engine.cache, engine.state, engine.snaps))
    lookups = engine.prefix.stats.lookups
    engine.start()
    with pytest.raises(RuntimeError, match="needs no open session"):
        engine.reset_device_state()
    engine.stop()
    engine.reset_device_state()
    new = jax.tree.leaves((engine.cache, engine.state, engine.snaps))
    assert all(x.is_deleted() for x in old)             # freed before the new ones were made
    assert [(x.shape, x.dtype) for x in new] == [(x.shape, x.dtype) for x in old]
    assert not engine.prefix.entries and engine.alloc.free_pages == engine.num_pages
    assert engine.prefix.stats.lookups == lookups       # counters over the engine's life
    engine.alloc.check()
    assert [o.token_ids for o in engine.generate(PROMPTS, SAMPLING)] == reference


def test_a_step_failing_inside_its_device_program_is_recovered(engine, reference):
    with failing_program(engine, RuntimeError("injected failure after the program")) as fired:
        with OnlineEngine(engine) as online:
            out = online.add(PROMPTS[0], SAMPLING[0]).result(60)
            assert out.finish_reason == "error" and "injected failure" in out.error
            assert fired and fired[0] > 0            # the old buffers really are gone
            later = {i: online.add(PROMPTS[i], SAMPLING[i]) for i in (1, 2, 3)}
            for i, h in later.items():
                got = h.result(60)
                assert (got.finish_reason, got.error) == ("length", None), i
                assert got.token_ids == reference[i], i
            st = online.stats()
            assert (st.engine_errors, st.device_rebuilds) == (1, 1)
            assert online.health == "ok"
    assert all_pages_back(engine)


def test_out_of_memory_at_the_step_and_at_the_rebuild_is_recovered(engine, reference,
                                                                   monkeypatch):
    real_init, inits = tensor_parallel.init_paged_cache, []

    def init_paged_cache(*args, **kw):
        inits.append(1)
        if len(inits) == 1:
            raise OOM
        return real_init(*args, **kw)

    monkeypatch.setattr(tensor_parallel, "init_paged_cache", init_paged_cache)
    with failing_program(engine, OOM):
        with OnlineEngine(engine, rebuild_backoff_s=0.01) as online:
            out = online.add(PROMPTS[4], SAMPLING[4]).result(60)
            assert out.finish_reason == "error" and "RESOURCE_EXHAUSTED" in out.error
            got = online.add(PROMPTS[5], SAMPLING[5]).result(60)
            assert got.token_ids == reference[5] and got.finish_reason == "length"
            assert len(inits) == 2       # the first rebuild ran out of memory, the second worked
            assert online.stats().device_rebuilds == 1
    assert all_pages_back(engine)


def test_a_rebuild_that_keeps_failing_stops_the_loop_with_errors(engine, reference,
                                                                 monkeypatch):
    from fastapi.testclient import TestClient
    from mtpjax.serving.app import Server, build_app
    from mtpjax.serving.parsing import ServerLimits

    def init_paged_cache(*args, **kw):
        raise OOM

    monkeypatch.setattr(tensor_parallel, "init_paged_cache", init_paged_cache)
    try:
        with failing_program(engine, OOM):
            online = OnlineEngine(engine, rebuild_attempts=2, rebuild_backoff_s=0.01).start()
            out = online.add(PROMPTS[0], SAMPLING[0]).result(60)
            assert out.finish_reason == "error"
            online._thread.join(60)
            assert online.health == "stopped" and not online.ready
            assert "could not be rebuilt" in str(online.fatal_error)
            client = TestClient(build_app(Server(online, None, ServerLimits("t", 11, 48))))
            r = client.get("/health")
            assert r.status_code == 503 and r.json()["status"] == "engine stopped"
            assert "RESOURCE_EXHAUSTED" in r.json()["detail"]
            with pytest.raises(RuntimeError, match="not running"):
                online.add(PROMPTS[1], SAMPLING[1])
    finally:
        monkeypatch.undo()
        engine.reset_device_state()              # the module's engine serves the next tests
    assert engine.generate([PROMPTS[1]], SAMPLING[1])[0].token_ids == reference[1]


# ------------------------------------------------------------ queued requests go on
def test_only_the_requests_the_failed_step_held_fail(engine, reference):
    held = {}

    def when(key):      # a step with both lanes busy and requests waiting behind them
        c = engine.session_counts()
        if not (is_step(key) and c["running"] == 2 and c["waiting"] >= 2):
            return False
        sched = engine._sched
        held["lanes"] = sorted(ln.req.id for ln in sched.lanes if ln is not None)
        held["queue"] = sorted(r.id for r in sched.queue)
        return True

    with failing_program(engine, RuntimeError("injected"), when) as fired:
        with OnlineEngine(engine) as online:
            handles = [online.add(PROMPTS[i], SAMPLING[i]) for i in range(6)]
            outs = [h.result(120) for h in handles]
            assert online.stats().finished == {"error": 2, "length": 4}
    assert fired and len(held["queue"]) >= 2
    for i, (h, out) in enumerate(zip(handles, outs)):
        if h.id in held["lanes"]:
            assert out.finish_reason == "error" and "injected" in out.error, i
        else:
            assert (out.finish_reason, out.error) == ("length", None), i
            assert out.token_ids == reference[i], i
    assert all_pages_back(engine)


# ------------------------------------------------------------------------ /health
def test_health_says_rebuilding_while_the_device_state_is_rebuilt(engine, reference):
    from fastapi.testclient import TestClient
    from mtpjax.serving.app import Server, build_app
    from mtpjax.serving.parsing import ServerLimits

    entered, release = threading.Event(), threading.Event()
    real_reset = engine.reset_device_state

    def slow_reset():
        entered.set()
        assert release.wait(60)
        real_reset()

    engine.reset_device_state = slow_reset
    try:
        with failing_program(engine, RuntimeError("injected")):
            with OnlineEngine(engine) as online:
                client = TestClient(build_app(Server(online, None,
                                                     ServerLimits("tiny", 11, 48))))
                assert client.get("/health").json() == {"status": "ok"}
                failed = online.add(PROMPTS[0], SAMPLING[0])
                assert entered.wait(60)
                r = client.get("/health")
                assert r.status_code == 503 and r.json()["status"] == "rebuilding"
                assert online.health == "rebuilding" and not online.ready
                waits = online.add(PROMPTS[1], SAMPLING[1])     # arrives meanwhile: waits
                assert failed.result(60).finish_reason == "error"
                time.sleep(0.1)
                assert not waits.done
                release.set()
                assert waits.result(60).token_ids == reference[1]
                r = client.get("/health")
                assert r.status_code == 200 and r.json() == {"status": "ok"}
    finally:
        release.set()
        del engine.reset_device_state
    assert all_pages_back(engine)


# --------------------------------------------------------------------- cancel races
class _YieldingSession:
    """Engine._sched as a data descriptor that yields the GIL on every read, so another
    thread's stop() can land between any two reads (as it can on free-threaded Python or
    at any switch interval)."""

    def __get__(self, obj, owner=None):
        if obj is None:
            return self
        time.sleep(0)
        return obj.__dict__.get("_sched_value")

    def __set__(self, obj, value):
        obj.__dict__["_sched_value"] = value


class RacyEngine(Engine):
    _sched = _YieldingSession()


def test_cancel_from_many_threads_while_sessions_stop_and_restart():
    e = RacyEngine(CFG, PARAMS, **ENGINE_KW)
    errors, done = [], threading.Event()

    def spam(seed):
        r = random.Random(seed)
        while not done.is_set():
            try:
                e.cancel(r.randrange(8))
            except Exception as ex:  # noqa: BLE001 - the test's finding
                errors.append(ex)
                return

    threads = [threading.Thread(target=spam, args=(s,)) for s in range(8)]
    for t in threads:
        t.start()
    try:
        for i in range(300):
            e.start()
            assert e.submit(i % 8, PROMPTS[i % 8], SAMPLING[i % 8]) is None
            e.stop()
            if errors:
                break
    finally:
        done.set()
        for t in threads:
            t.join(10)
    assert errors == []


def test_online_cancel_from_many_threads_while_the_session_restarts(engine, reference):
    errors, done = [], threading.Event()
    with failing_program(engine, RuntimeError("injected")):
        with OnlineEngine(engine) as online:

            def spam(seed):
                r = random.Random(seed)
                while not done.is_set():
                    try:
                        online.cancel(r.randrange(100, 200))     # ids no request has
                    except Exception as ex:  # noqa: BLE001 - the test's finding
                        errors.append(ex)
                        return

            threads = [threading.Thread(target=spam, args=(s,)) for s in range(6)]
            for t in threads:
                t.start()
            try:
                handles = [online.add(PROMPTS[i], SAMPLING[i]) for i in range(4)]
                handles[3].cancel()
                outs = [h.result(120) for h in handles]
                assert online.add(PROMPTS[5], SAMPLING[5]).result(60).token_ids == reference[5]
            finally:
                done.set()
                for t in threads:
                    t.join(10)
            assert online.alive and online.stats().engine_errors == 1
    assert errors == []
    assert {o.finish_reason for o in outs} <= {"error", "length", "cancelled"}
    assert "error" in {o.finish_reason for o in outs}
    assert all_pages_back(engine)


# ---------------------------------------------------------------- detokenizer errors
def test_a_detokenizer_error_ends_only_its_own_request(engine, reference):
    # a token that one reference output has (after its first token) and another lacks
    bad, i, j = next((t, i, j) for i, a in enumerate(reference) for t in a[1:]
                     for j, b in enumerate(reference) if t not in b)
    with OnlineEngine(engine, CharTokenizer(bad)) as online:
        hi, hj = online.add(PROMPTS[i], SAMPLING[i]), online.add(PROMPTS[j], SAMPLING[j])
        oi, oj = hi.result(60), hj.result(60)
        later = online.add(PROMPTS[j], SAMPLING[j]).result(60)
        st = online.stats()
    assert oi.finish_reason == "error" and "detokenizer" in oi.error
    assert f"no text for token {bad}" in oi.error
    cut = reference[i].index(bad)
    assert oi.token_ids == reference[i][:cut]             # what was streamed before it
    assert oi.text == "".join(ALPHABET[t] for t in reference[i][:cut])
    for o in (oj, later):
        assert (o.finish_reason, o.error) == ("length", None)
        assert o.token_ids == reference[j]
        assert o.text == "".join(ALPHABET[t] for t in reference[j])
    assert st.engine_errors == 0 and st.finished == {"error": 1, "length": 2}
    assert all_pages_back(engine)


# ---------------------------------------------------------------- bounded bookkeeping
N = 100_000


def test_scheduler_bookkeeping_stays_bounded():
    """100,000 requests through the scheduler without a device: a third finish (prefill,
    then one decoded token), a third are cancelled while queued, a third are refused at
    submit; each step also cancels an ended id and an id never submitted."""
    alloc = PageAllocator(8, 4, 2, 4)
    sched = Scheduler(alloc, num_draft_slots=0, max_seq_len=16, prefill_chunk=8)
    one = SamplingParams(max_new_tokens=1)
    most = 0
    for i in range(N):
        kind = i % 3
        if kind == 2:
            sched.refused(i)
        else:
            sched.add(Request(i, [1, 2], one, frozenset()))
            if kind == 1:
                sched.cancel(i)
            batch = sched.schedule()
            if kind == 0:
                sched.prefill_done(*batch.prefills)
                sched.decode_done(batch.rows[0].lane, [5], 0, 0)
        sched.cancel(i - 1)                  # ended
        sched.cancel(N + i)                  # never submitted
        assert sched.finished.pop(i, None) is not None or kind == 2
        most = max(most, len(sched.cancelled))
    assert not sched.has_work()
    assert most <= 1 and len(sched.cancelled) == 0
    assert len(sched.ids) == RECENT_IDS
    assert N - 1 in sched.ids and 0 not in sched.ids
    alloc.check()
    assert alloc.free_pages == 8


def test_engine_session_refuses_live_and_recent_ids_with_bounded_sets(engine):
    engine.start()
    try:
        assert engine.submit(0, PROMPTS[0], SAMPLING[0]) is None       # stays queued: live
        for i in range(1, N):
            err = engine.submit(i, [99], SamplingParams())              # refused at once
            assert err is not None and err.finish_reason == "error"
            engine.cancel(i)
            engine.cancel(N + i)
        sched = engine._sched
        assert len(sched.ids) <= RECENT_IDS + 1 and len(sched.cancelled) == 0
        for rid in (0, N - 1):          # the live request, and a recently ended one
            with pytest.raises(ValueError, match="already submitted"):
                engine.submit(rid, [1, 2], SamplingParams())
        engine.cancel(0)
        assert sched.cancelled == {0}
    finally:
        engine.stop()
    assert all_pages_back(engine)


# ------------------------------------------------------------------ the breaker (issue 38)
def test_fault_injection_and_breaker_settings_are_checked():
    from mtpjax.serving.faults import BreakerConfig, FaultInjection
    assert FaultInjection.parse("") is None and FaultInjection.parse(None) is None
    assert FaultInjection.parse("fail_steps:3-5") == FaultInjection(3, 5)
    assert FaultInjection.parse("fail_steps:4") == FaultInjection(4, 4)
    assert [FaultInjection(3, 5).fails(i) for i in (2, 3, 5, 6)] == [False, True, True, False]
    for bad in ("fail_steps:0-2", "fail_steps:5-3", "fail:1-2", "fail_steps:a"):
        with pytest.raises(ValueError, match="fault_injection"):
            FaultInjection.parse(bad)
    with pytest.raises(ValueError, match="max_consecutive_failures"):
        BreakerConfig(0)
    with pytest.raises(ValueError, match="probe_interval_s"):
        BreakerConfig(3, 0.0)


def test_a_persistent_fault_opens_the_breaker_and_a_probe_closes_it(engine, reference):
    """Steps 1..6 fail: the third in a row opens the breaker (health "unavailable", /health
    503, new requests refused with 503, the queued one ends "error"); probes 4..6 fail and
    are recovered from; probe 7 completes, the breaker closes and requests get the tokens of
    an undisturbed engine, with no restart."""
    from fastapi.testclient import TestClient
    from mtpjax.serving.app import Server, build_app
    from mtpjax.serving.faults import BreakerConfig, FaultInjection, Unavailable
    from mtpjax.serving.parsing import ServerLimits

    online = OnlineEngine(engine, breaker=BreakerConfig(3, 0.2),
                          fault_injection=FaultInjection(1, 6))
    with online:
        client = TestClient(build_app(Server(online, None, ServerLimits("tiny", 11, 48))))
        t0 = time.perf_counter()
        first = online.add(PROMPTS[0], SAMPLING[0]).result(60)
        assert first.finish_reason == "error" and "server unavailable" in first.error
        assert "3 consecutive engine steps failed" in first.error
        assert "injected device fault" in first.error
        r = client.get("/health")
        assert r.status_code == 503 and r.json()["status"] == "unavailable", r.json()
        assert time.perf_counter() - t0 < 10        # the target: shown within 10 s
        with pytest.raises(Unavailable):
            online.add(PROMPTS[1], SAMPLING[1])
        r = client.post("/v1/completions", json={"model": "tiny", "prompt": PROMPTS[1],
                                                 "max_tokens": 4})
        assert r.status_code == 503 and r.json()["error"]["code"] == "service_unavailable"
        st = online.stats()
        assert st.breaker_open and st.breaker_opens == 1 and st.consecutive_failures >= 3
        deadline = time.perf_counter() + 60          # probes 4, 5, 6 fail; 7 completes
        while online.health != "ok" and time.perf_counter() < deadline:
            time.sleep(0.05)
        assert online.health == "ok" and client.get("/health").status_code == 200
        got = online.add(PROMPTS[2], SAMPLING[2]).result(60)
        assert (got.finish_reason, got.token_ids) == ("length", reference[2])
        st = online.stats()
        assert not st.breaker_open and st.consecutive_failures == 0 and st.breaker_opens == 1
        assert st.probes == 4 and st.engine_errors == 6 and st.device_rebuilds == 6
    assert all_pages_back(engine)


def test_a_transient_fault_heals_without_opening_the_breaker(engine, reference):
    from mtpjax.serving.faults import BreakerConfig, FaultInjection
    with OnlineEngine(engine, breaker=BreakerConfig(3, 0.2),
                      fault_injection=FaultInjection(3, 4)) as online:
        handles = {i: online.add(PROMPTS[i], SAMPLING[i]) for i in range(4)}
        outs = {i: h.result(60) for i, h in handles.items()}
        for i, out in outs.items():           # a request the failed steps held ends "error";
            if out.finish_reason != "error":  # every other gets its undisturbed tokens
                assert out.token_ids == reference[i], i
        assert any(o.finish_reason == "error" for o in outs.values())
        later = online.add(PROMPTS[5], SAMPLING[5]).result(60)
        assert later.token_ids == reference[5]
        st = online.stats()
        assert st.engine_errors == 2 and st.breaker_opens == 0 and not st.breaker_open
        assert online.health == "ok"
    assert all_pages_back(engine)
