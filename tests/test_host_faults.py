"""One request's host-side error is its own (issue 37, item 4).

Each kind of per-request host state is made to raise for one request, mid-generation: its
grammar walk (the masks before a step), its penalties' history, its output processing (an
on_token callback, where a text layer cuts stop strings), and its input to the depth policy.
That request ends with finish_reason "error" and a message naming the part that failed, and
keeps the tokens it had (a prefix of its fault-free output); every other request gets its
fault-free tokens, the session goes on and every page comes back. A device-step failure is
not a request's: the step raises, the session stops, and `reset_device_state` rebuilds the
device state, after which the same requests give the same tokens.
"""

import jax
import numpy as np
import pytest

from mtpjax.engine import FINISH_ERROR, Engine, SpeculationPolicy
from mtpjax.sampling import SamplingParams

from tiny_models import VOCAB11_CFG as CFG, VOCAB11_PARAMS as PARAMS

K = 2
VICTIM = 1
rng = np.random.default_rng(11)
PROMPTS = [[int(t) for t in rng.integers(0, 11, n)] for n in (5, 9, 3, 12, 7)]
SAMPLING = [SamplingParams(max_new_tokens=12, temperature=t, seed=i)
            for i, t in enumerate((0.0, 0.8, 0.0, 0.8, 0.0))]
SAMPLING[VICTIM] = SamplingParams(max_new_tokens=12, temperature=0.8, seed=VICTIM,
                                  presence_penalty=0.5)


class Policy:
    """The fixed policy (depth K where the pages allow), raising on the victim's input from
    scheduler iteration `after` on when armed."""

    def __init__(self, armed=False, after=4):
        self.armed, self.after, self.fixed = armed, after, SpeculationPolicy()

    def __call__(self, view):
        if self.armed and view.step >= self.after and any(
                ln.request_id == VICTIM for ln in view.lanes):
            raise ZeroDivisionError("injected: a policy input of the victim")
        return self.fixed(view)


def make_engine(policy=None):
    return Engine(CFG, PARAMS, num_speculative_tokens=K, max_lanes=4, max_seq_len=48,
                  prefill_chunk=8, page_size=4, kernels="reference",
                  speculation_policy=policy or Policy())


@pytest.fixture(scope="module")
def engine():
    return make_engine()


@pytest.fixture(scope="module")
def reference(engine):
    outs = engine.generate(PROMPTS, SAMPLING)
    assert all(o.finish_reason != FINISH_ERROR for o in outs)
    return [o.token_ids for o in outs]


class Grammar:
    """A constraint that allows every token and raises at its `fail_at`-th mask walk."""

    def __init__(self, fail_at=3):
        self.calls, self.fail_at, self.stopped = 0, fail_at, False

    def _walk(self, drafts):
        self.calls += 1
        if self.calls >= self.fail_at:
            raise KeyError("injected: a grammar walk")
        return np.full((len(drafts) + 1, (CFG.vocab_size + 31) // 32), -1, np.int32)

    def step_masks(self, drafts, stops=frozenset()):
        return self._walk(list(drafts))

    def masked_drafts(self, drafts, candidates, stops=frozenset()):
        return [int(t) for t in drafts], self._walk(list(drafts))

    def consume(self, token):
        return None


def run(engine, inject=None, on_token=None):
    """A session over PROMPTS with inject(engine) after the submits; outputs by index."""
    engine.start(on_token)
    for i, (p, sp) in enumerate(zip(PROMPTS, SAMPLING)):
        assert engine.submit(i, p, sp) is None
    if inject is not None:
        inject(engine)
    done = {}
    while engine.has_work():
        done.update(engine.step())
    assert engine.stop() == {}
    return [done[i] for i in range(len(PROMPTS))]


def check(outs, reference, part):
    for i, (o, want) in enumerate(zip(outs, reference)):
        if i == VICTIM:
            assert o.finish_reason == FINISH_ERROR and part in o.error, (o.finish_reason,
                                                                          o.error)
            assert o.token_ids == want[:len(o.token_ids)]
        else:
            assert o.finish_reason != FINISH_ERROR and o.token_ids == want, i


def all_pages_back(engine):
    return engine.stats()["free_pages"] == engine.num_pages


def test_a_grammar_walk_that_raises_ends_only_its_request(engine, reference):
    grammar = Grammar()

    def inject(e):
        next(r for r in e._sched.queue if r.id == VICTIM).constraint = grammar
    check(run(engine, inject), reference, "grammar")
    assert grammar.calls >= 3                      # it ran a few steps before failing
    assert all_pages_back(engine)


def test_a_penalties_history_that_raises_ends_only_its_request(engine, reference, monkeypatch):
    real = engine.core._write_history

    def write(lane, req):
        if req.id == VICTIM and len(req.out) >= 3:
            raise IndexError("injected: a penalties' history")
        return real(lane, req)
    monkeypatch.setattr(engine.core, "_write_history", write)
    outs = run(engine)
    check(outs, reference, "penalties")
    assert len(outs[VICTIM].token_ids) >= 3
    assert all_pages_back(engine)


def test_output_processing_that_raises_ends_only_its_request(engine, reference):
    seen = {}

    def on_token(rid, ids):      # e.g. a stop-string cutter failing on this request's text
        seen[rid] = seen.get(rid, 0) + len(ids)
        if rid == VICTIM and seen[rid] >= 3:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected: output processing")
    outs = run(engine, on_token=on_token)
    check(outs, reference, "output processing")
    assert all_pages_back(engine)


def test_a_policy_input_that_raises_ends_only_its_request(reference):
    e = make_engine(Policy(armed=True))
    check(run(e), reference, "depth policy")
    assert all_pages_back(e)


def test_a_policy_that_raises_on_everyone_still_fails_the_step(reference):
    class Broken:
        def __call__(self, view):
            raise RuntimeError("injected: the policy itself")
    e = make_engine(Broken())
    with pytest.raises(RuntimeError, match="the policy itself"):
        run(e)
    left = e.stop()          # the session stays open after a failed plan, as it always has
    assert sorted(left) == list(range(len(PROMPTS))) and all_pages_back(e)


def test_a_device_step_failure_still_rebuilds_the_device_state(engine, reference):
    real, fired = engine.runner._program, []

    def program(key, run_, *args, **kw):
        out = real(key, run_, *args, **kw)
        if key[0] in ("decode", "mixed") and not fired:
            fired.append(key)
            jax.block_until_ready(out)
            raise RuntimeError("injected: the device step")
        return out
    engine.runner._program = program
    try:
        with pytest.raises(RuntimeError, match="the device step"):
            run(engine)
    finally:
        del engine.runner._program
    assert fired and engine._sched is None
    engine.reset_device_state()
    assert [o.token_ids for o in run(engine)] == reference
    assert all_pages_back(engine)
