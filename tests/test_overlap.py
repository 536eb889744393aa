"""The overlapped loop (Engine(overlap=True), the default): step N+1 is planned and launched
before step N's tokens are read, and it changes no output.

On the trained tiny checkpoint (drafts accepted and rejected, past position 1), one mixed
batch runs through the serial loop (overlap=False) and the overlapped one: greedy, sampled
with log probabilities, a stop token that ends a request mid-run (the step already in flight
behind it must emit nothing), a small max_new_tokens (the lane waits rather than run past
its limit), penalties and a grammar (those lanes wait a step: their next step needs the
tokens on the host), and logit_bias. Tokens and finish reasons must be equal; log
probabilities equal to float32 rounding (a waiting lane changes which rows share a step).
The scheduler test checks the planning rules on the host alone.
"""

import os

import numpy as np
import pytest

import mtpjax
from mtpjax import grammar
from mtpjax.engine.kv_pool import PageAllocator
from mtpjax.engine.scheduler import Request, RequestStats, Scheduler
from mtpjax.sampling import SamplingParams
from mtpjax.text import Tokenizer

from tiny_models import assert_drafts_accepted_and_rejected

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CKPT = os.path.join(REPO, "checkpoints", "tiny")
ENGINE = dict(max_lanes=4, max_seq_len=128, prefill_chunk=32, prefill_buckets=[32])
TEXTS = ["def add(a, b):\n    return", "import os\nimport sys\n\ndef main():\n",
         "class Stack:\n    def __init__(self):\n", "for i in range(10):\n    print(",
         "def fib(n):\n    if n < 2:\n        return n\n"]


def _engine(overlap: bool):
    return mtpjax.Engine.from_checkpoint(CKPT, num_speculative_tokens=3, overlap=overlap,
                                         **ENGINE)


@pytest.fixture(scope="module")
def runs():
    tok = Tokenizer.from_checkpoint(CKPT)
    prompts = [tok.encode(t) for t in TEXTS]
    serial = _engine(False)
    # a stop token that ends a request mid-run: the 6th token greedy decoding gives prompt 0
    (probe,) = serial.generate([prompts[0]], SamplingParams(temperature=0.0,
                                                            max_new_tokens=12))
    stop = probe.token_ids[5]
    params = [SamplingParams(temperature=0.0, max_new_tokens=40),
              SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_new_tokens=40,
                             logprobs=2),
              SamplingParams(temperature=0.0, max_new_tokens=40, stop_token_ids=(stop,)),
              SamplingParams(temperature=0.0, max_new_tokens=7),
              SamplingParams(temperature=0.7, seed=5, max_new_tokens=30,
                             presence_penalty=0.5, repetition_penalty=1.2),
              SamplingParams(temperature=0.0, max_new_tokens=24,
                             grammar=grammar.json_object_grammar()),
              SamplingParams(temperature=1.0, seed=9, max_new_tokens=30,
                             logit_bias=((int(prompts[1][0]), 4.0),))]
    prompts = [prompts[0], prompts[1], prompts[0], prompts[2], prompts[3], prompts[4],
               prompts[2]]
    out = {}
    for overlap, e in ((False, serial), (True, _engine(True))):
        e.reset_timing()
        out[overlap] = (e, e.generate(prompts, params))
    return out, stop


def test_overlapped_loop_equals_the_serial_loop(runs):
    out, stop = runs
    (_, serial), (_, overlapped) = out[False], out[True]
    for a, b in zip(serial, overlapped):
        assert b.finish_reason == a.finish_reason and b.error is None
        assert b.token_ids == a.token_ids
        if a.logprobs is not None:
            np.testing.assert_allclose([t.logprob for t in b.logprobs],
                                       [t.logprob for t in a.logprobs], atol=1e-4)
    assert serial[2].finish_reason == "stop" and serial[2].token_ids[-1] == stop
    assert stop not in serial[2].token_ids[:-1]
    assert len(serial[3].token_ids) == 7 and serial[3].finish_reason == "length"
    assert_drafts_accepted_and_rejected(overlapped)


def test_overlapped_loop_launches_ahead_and_the_serial_one_does_not(runs):
    out, _ = runs
    (es, _), (eo, _) = out[False], out[True]
    assert es.timing["overlapped"] == 0
    # most launches queue behind a step still running (the waits of the grammar, penalty
    # and near-limit lanes, and the first launch, are the exceptions)
    assert eo.timing["overlapped"] >= 0.6 * eo.timing["launches"], eo.timing
    for e in (es, eo):
        s = e.stats()
        assert s["free_pages"] == s["total_pages"] and e._flight is None


def test_the_depth_policy_learns_only_from_steps_timed_alone():
    """A step queued behind another has no time of its own that the host can read (XLA:CPU
    may run the queued program before it wakes the host waiting on the one before: that one
    then looks long and the queued one free; on a loaded CPU the adaptive policy so rated
    depth 0 at 0.1 ms and never left it). So the policy's step costs come only from the steps
    it asks to time alone (`wants_timing`): launched when everything before them has ended,
    read before anything is launched behind them; the other steps stay overlapped."""
    from mtpjax.engine.depth import AdaptiveDepth
    e = mtpjax.Engine.from_checkpoint(
        CKPT, num_speculative_tokens=3, overlap=True, **ENGINE,
        speculation_policy=AdaptiveDepth(window=3, explore=1, sample_every=4))
    runner, policy = e.runner, e.policy
    flights, samples = [], []
    launch, collect, observe = runner.launch, runner.collect, policy.observe

    def spy_launch(batch, serial=True):
        flight = launch(batch, serial)
        if flight is not None:
            flights.append(flight)
        return flight

    def spy_collect(flight):
        spy_collect.last = flight
        return collect(flight)

    def spy_observe(view, depth, seconds, accepted, compiled):
        if not compiled:
            samples.append((spy_collect.last, depth, seconds))
        return observe(view, depth, seconds, accepted, compiled)

    runner.launch, runner.collect, policy.observe = spy_launch, spy_collect, spy_observe
    tok = Tokenizer.from_checkpoint(CKPT)
    outs = e.generate([tok.encode(t) for t in TEXTS[:3]],
                      SamplingParams(temperature=0.0, max_new_tokens=80))
    assert all(o.error is None and len(o.token_ids) == 80 for o in outs)
    timed = [f for f in flights if f.batch.timed]
    assert samples and len(timed) < len(flights), (len(timed), len(flights))
    for flight, depth, seconds in samples:
        assert flight.batch.timed and flight.batch.depth == depth
        i = next(j for j, f in enumerate(flights) if f is flight)
        # everything before it had ended when it launched; its outputs were read before
        # the next launch
        assert all(f.tail_seen is not None and f.tail_seen <= flight.launched
                   for f in flights[:i])
        assert flight.ready_seen is not None and flight.launched < flight.ready_seen
        if i + 1 < len(flights):
            assert flight.ready_seen <= flights[i + 1].launched
        assert seconds == flight.ready_seen - flight.launched
    # the steps it does not time still queue behind the one running
    assert e.timing["overlapped"] > len(flights) - 2 * len(timed), e.timing


def test_first_tokens_are_read_before_the_next_launch_where_the_host_is_the_device():
    """On XLA:CPU the device is the host's own cores: a step queued behind the one that gives
    requests their first tokens holds them, and the host's read of those tokens waited for
    both (the chat workload's candidate TTFT was one verify step longer overlapped than
    serial). So a step with joining lanes is committed before the next launch there; the
    other steps still overlap, and the wait for it is not counted as host work."""
    e = mtpjax.Engine.from_checkpoint(CKPT, num_speculative_tokens=3, overlap=True, **ENGINE)
    assert e.runner.host_is_device
    events = []
    launch = e.runner.launch

    def spy_launch(batch, serial=True):
        flight = launch(batch, serial)
        events.append(("launch", batch))
        return flight

    e.runner.launch = spy_launch
    open_host = e.runner.open_host

    def spy_open():
        events.append(("open", None))
        return open_host()

    e.runner.open_host = spy_open
    tok = Tokenizer.from_checkpoint(CKPT)
    prompts = [tok.encode(t) for t in TEXTS]
    got = set()

    def on_token(i, ids):
        if i not in got:
            got.add(i)
            events.append(("first", i))

    # more prompts than lanes: later requests join while others decode
    outs = e.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=12),
                      on_token=on_token)
    assert all(o.error is None for o in outs)
    joins = [i for i, (kind, b) in enumerate(events)
             if kind == "launch" and b.join_mask is not None and b.join_mask.any()]
    assert len(joins) >= 2, events
    for i in joins:
        # the next iteration reads them before its host segment opens (the wait for the
        # step is not host work) and before it launches anything
        n = int(events[i][1].join_mask.sum())
        after = events[i + 1:i + 2 + n]
        assert [kind for kind, _ in after] == ["first"] * n + ["open"], (i, events[i:i + n + 3])
    assert got == set(range(len(prompts)))
    assert e.timing["overlapped"] > 0, e.timing


class _Host:
    """A scheduler with two lanes' worth of pages, for planning without a device."""

    def __init__(self, **params):
        alloc = PageAllocator(num_pages=64, page_size=4, max_lanes=4, pages_per_lane=16)
        self.sched = Scheduler(alloc, num_draft_slots=2, max_seq_len=64, prefill_chunk=16)
        for i, p in enumerate(params.values()):
            self.sched.add(Request(i, [1, 2, 3, 4, 5], p, frozenset(),
                                   stats=RequestStats.for_depth(2)))

    def plan(self):
        """A plan, and its chunk recorded as the engine core does when it builds the step."""
        p = self.sched.schedule()
        for w in p.prefills:
            self.sched.prefill_done(w)
        return p


class _FakeConstraint:
    """Stands in for a grammar that allows everything (the scheduler asks whether a request
    has one, and feeds it the emitted tokens)."""
    stopped = False

    def consume(self, token):
        return None


def test_planning_past_a_step_in_flight():
    """Two plans without a commit between them (the overlapped loop): a plain lane runs
    again, planned at its position past the step in flight (depth + 1 tokens, the most it
    may emit), with pages for it; a lane that needs its tokens on the host waits."""
    plain = SamplingParams(temperature=0.0, max_new_tokens=40)
    h = _Host(plain=plain, penalized=SamplingParams(temperature=0.0, max_new_tokens=40,
                                                    presence_penalty=0.5),
              short=SamplingParams(temperature=0.0, max_new_tokens=6), grammar=plain)
    h.sched.queue[3].constraint = _FakeConstraint()
    while True:        # one lane joins per step: commit each step until all four run
        p = h.plan()
        if len(p.rows) == 4:
            break
        for r in p.rows:                    # one token each, as the engine would commit
            h.sched.decode_done(r.lane, [7] * (p.depth + 1), 0, p.depth)
    first = p                               # lane 3 joins, 0-2 decode; not committed
    assert first.depth > 0
    second = h.plan()                       # planned before `first` is committed
    ids = {r.request_id for r in second.rows}
    assert ids == {0, 2}, second.rows       # penalties and the grammar wait
    by_id = {r.request_id: r for r in first.rows}
    for r in second.rows:
        assert r.join_token is None         # in flight: it joined already
        assert r.pos == by_id[r.request_id].pos + first.depth + 1
        assert h.sched.alloc.capacity(r.lane) >= r.pos + second.depth + 1
    third = h.plan()                        # the 6-token lane may hit its limit in flight
    assert 2 not in {r.request_id for r in third.rows}
    assert 0 in {r.request_id for r in third.rows}
