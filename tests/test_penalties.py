"""presence / frequency / repetition penalties: exact under speculation (spec == plain, token
for token, greedy and seeded, fixed and random depths, with preemption), equal to a
teacher-forced numpy reference, effective (a penalty changes the output), validated; tensor
parallelism; the server's fields and its 400s."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mtpjax
from mtpjax import sampling
from mtpjax.api import forward_logits
from mtpjax.sampling import LaneSampling, SamplingParams

from test_depth import RandomDepth
from tiny_models import VOCAB11_CFG as CFG, VOCAB11_PARAMS as PARAMS
from tiny_models import assert_drafts_accepted_and_rejected

RNG = np.random.default_rng(5)
PROMPTS = [list(map(int, RNG.integers(0, 11, n))) for n in (3, 21, 9, 1)]
PEN = dict(presence_penalty=0.7, frequency_penalty=0.4, repetition_penalty=1.5)
# test_logprobs' shapes, its lane buckets 1 and 3 too (bucket 2 ran the same code as bucket 1
# with one more program per depth to compile: 3 more for the random depths alone)
ENGINE_KW = dict(max_lanes=3, max_seq_len=96, prefill_chunk=16, lane_buckets=[1, 3])
ENGINES = {}


def engine(k, **kw):
    """K = 0 or 3 engines of test_logprobs' shapes: in one session they share its programs
    (and every engine here of the same K shares them: a policy or a page budget is no
    shape)."""
    if kw:
        return mtpjax.Engine(CFG, PARAMS, num_speculative_tokens=k, **ENGINE_KW, **kw)
    if k not in ENGINES:
        ENGINES[k] = mtpjax.Engine(CFG, PARAMS, num_speculative_tokens=k, **ENGINE_KW)
    return ENGINES[k]


def params_for(base: SamplingParams):
    """One per prompt: seeds base.seed + i, lane 2 without penalties (a mixed batch), lane 3
    with a negative presence penalty and a repetition penalty below 1 (rewards repeats)."""
    ps = [dataclasses.replace(base, seed=base.seed + i, **PEN) for i in range(len(PROMPTS))]
    ps[2] = dataclasses.replace(ps[2], presence_penalty=0.0, frequency_penalty=0.0,
                                repetition_penalty=1.0)
    ps[3] = dataclasses.replace(ps[3], presence_penalty=-0.8, frequency_penalty=0.3,
                                repetition_penalty=0.7)
    return ps


def reference_tokens(prompt, out, sp: SamplingParams):
    """The tokens a plain sampler picks from the teacher-forced target logits with the
    penalties applied in numpy (counts of out[:i] and the prompt's tokens at output i):
    greedy argmax, or the library's position-keyed sampler for a seeded request."""
    V = CFG.vocab_size
    logits = np.asarray(forward_logits(CFG, PARAMS, np.asarray([prompt + out], np.int32))[0])
    bias = np.zeros(V, np.float32)
    for i, b in sp.logit_bias:
        bias[i] = b
    in_prompt = np.isin(np.arange(V), prompt)
    f32 = np.float32
    picks = []
    for i in range(len(out)):
        x = logits[len(prompt) - 1 + i] + bias
        c = np.bincount(np.asarray(out[:i], np.int64), minlength=V).astype(f32)
        r = f32(sp.repetition_penalty)
        x = np.where((c > 0) | in_prompt, np.where(x > 0, x / r, x * r), x)
        x = x - f32(sp.frequency_penalty) * c - f32(sp.presence_penalty) * (c > 0)
        if sp.temperature == 0:
            picks.append(int(np.argmax(x)))
        else:
            picks.append(int(sampling.sample(jnp.asarray(x[None], jnp.float32),
                                             LaneSampling.from_params([sp]),
                                             jnp.asarray([len(prompt) + i], jnp.int32))[0]))
    return picks


@pytest.mark.parametrize("sp", [
    SamplingParams(max_new_tokens=20),
    SamplingParams(temperature=1.0, seed=7, max_new_tokens=20),
    SamplingParams(temperature=0.8, top_k=5, top_p=0.9, seed=13, max_new_tokens=20,
                   logit_bias={4: 1.5, 6: -1.0}),
], ids=["greedy", "sampled", "top_k_top_p_bias"])
def test_spec_equals_plain_and_reference(sp):
    ps = params_for(sp)
    plain = engine(0).generate(PROMPTS, ps)
    fixed = engine(3).generate(PROMPTS, ps)
    policy = RandomDepth(11)
    rand = engine(3, speculation_policy=policy).generate(PROMPTS, ps)
    assert policy.seen == {0, 1, 2, 3}
    for e in (engine(0), engine(3)):      # both lane buckets ran (3 busy lanes, then 1)
        assert {("decode", e.k, 1), ("decode", e.k, 3)} <= set(e.stats()["programs"])
    # drafts accepted and rejected; a random head's rarely land past position 1 at top-k /
    # top-p (measured: 13 of 101 first drafts, none after): the trained head does that, with
    # penalties, in test_logprobs.test_trained_head_spec_equals_plain_with_penalties_bias_...
    assert_drafts_accepted_and_rejected(fixed + rand, past=0)
    for prompt, p, a, b, c in zip(PROMPTS, ps, plain, fixed, rand):
        assert a.finish_reason == "length"
        assert b.token_ids == a.token_ids
        assert c.token_ids == a.token_ids
        assert reference_tokens(prompt, a.token_ids, p) == a.token_ids
    # the penalties change the output (so the comparisons above could fail)
    free = engine(0).generate(PROMPTS, [dataclasses.replace(p, presence_penalty=0.0,
                                                            frequency_penalty=0.0,
                                                            repetition_penalty=1.0)
                                        for p in ps])
    assert free[2].token_ids == plain[2].token_ids        # the unpenalised lane
    assert all(f.token_ids != a.token_ids for f, a in zip(free[:2] + free[3:],
                                                          plain[:2] + plain[3:]))


def test_each_penalty_alone_is_exact_and_acts():
    """Each penalty by itself: spec == plain, == the reference, and != unpenalised greedy."""
    free = engine(0).generate(PROMPTS, SamplingParams(max_new_tokens=16))
    # (the strong ones also catch, in greedy, a step that forgets the drafts before a row)
    for pen in (dict(presence_penalty=2.0), dict(frequency_penalty=2.0),
                dict(repetition_penalty=3.0), dict(frequency_penalty=-1.0)):
        sp = SamplingParams(max_new_tokens=16, **pen)
        plain, spec = engine(0).generate(PROMPTS, sp), engine(3).generate(PROMPTS, sp)
        for prompt, f, a, b in zip(PROMPTS, free, plain, spec):
            assert b.token_ids == a.token_ids, pen
            assert reference_tokens(prompt, a.token_ids, sp) == a.token_ids, pen
        assert any(f.token_ids != a.token_ids for f, a in zip(free, plain)), pen


def test_preemption_keeps_penalties_exact():
    """A pool too small for every lane: preempted requests re-prefill prompt + output and
    their history (prompt length unchanged) carries on; outputs equal the roomy engine's."""
    ps = params_for(SamplingParams(temperature=1.0, seed=3, max_new_tokens=40))
    roomy = engine(3).generate(PROMPTS, ps)
    e = engine(3)
    # the serial loop: the overlapped one runs a penalised lane every other step (it waits
    # for its tokens), which holds fewer pages at once and may never preempt here
    tight = engine(3, num_pages=8, lane_slots=e.lane_slots, pool_pages=e.pool_pages,
                   overlap=False)
    outs = tight.generate(PROMPTS, ps)
    assert tight.stats()["preemptions"] > 0
    assert [o.token_ids for o in outs] == [o.token_ids for o in roomy]


def test_penalties_add_no_program():
    """After warm-up, steps with and without penalised lanes (and mixed ones) compile
    nothing: the penalties ride in the always-passed steps.Extras (fixed shapes per lane
    bucket), and the warm-up plan is the one without penalties."""
    from jax._src import dispatch, monitoring
    from mtpjax import steps
    e = engine(0)
    e.warmup()
    plan = e.stats()["programs"]
    traced = steps.decode_step._cache_size()   # in memory: a persistent-cache hit counts too
    assert traced >= 3                          # lane buckets 1, 3 and a mixed step, depth 0
    compiled = []

    def on_compile(event, _secs, fun_name=None, **_):
        if event == dispatch.BACKEND_COMPILE_EVENT:
            compiled.append(fun_name)

    monitoring.register_event_duration_secs_listener(on_compile)
    try:
        e.generate(PROMPTS, params_for(SamplingParams(temperature=1.0, max_new_tokens=6)))
        e.generate(PROMPTS, SamplingParams(max_new_tokens=6))
        e.generate(PROMPTS[:1], SamplingParams(max_new_tokens=6, repetition_penalty=1.2))
        jax.jit(lambda x: x + 1)(1.0)              # a positive control: this one compiles
    finally:
        monitoring.unregister_event_duration_listener(on_compile)
    assert "jit(<lambda>)" in compiled
    assert not {"jit(decode_step)", "jit(prefill_chunk)"} & set(compiled), compiled
    assert e.stats()["programs"] == plan
    assert steps.decode_step._cache_size() == traced


def test_validation_errors():
    for name in ("presence_penalty", "frequency_penalty"):
        for bad in (2.5, -2.01, float("nan"), float("inf"), True, "1", None):
            with pytest.raises(ValueError, match=name):
                SamplingParams(**{name: bad})
        assert getattr(SamplingParams(**{name: -2}), name) == -2
    for bad in (0, -1.0, float("inf"), float("nan"), False):
        with pytest.raises(ValueError, match="repetition_penalty"):
            SamplingParams(repetition_penalty=bad)
    assert not SamplingParams().penalized
    assert SamplingParams(repetition_penalty=1.1).penalized
    assert SamplingParams(presence_penalty=-0.1).penalized


def test_tensor_parallel_penalties_match_one_device():
    """tp = 2: the greedy fast branch (argmax on sharded logits) must give way to a
    penalised lane; the penalties apply to the gathered logits, the same on every shard."""
    from tiny_models import TP_CFG, TP_ENGINE_KW, TP_PARAMS, TP_PROMPTS
    assert len(jax.devices()) >= 2, "conftest should give the CPU 8 devices"
    params = [SamplingParams(max_new_tokens=10, frequency_penalty=1.0),
              SamplingParams(max_new_tokens=10, presence_penalty=1.5, repetition_penalty=2.0),
              SamplingParams(max_new_tokens=10, temperature=1.0, seed=2,
                             frequency_penalty=0.5, repetition_penalty=1.3),
              SamplingParams(max_new_tokens=10)]
    kw = dict(TP_ENGINE_KW, max_lanes=2)
    ref = mtpjax.Engine(TP_CFG, TP_PARAMS, num_speculative_tokens=1, **kw).generate(
        TP_PROMPTS, params)
    out = mtpjax.Engine(TP_CFG, TP_PARAMS, num_speculative_tokens=1, tp=2, **kw).generate(
        TP_PROMPTS, params)
    for a, b in zip(ref, out):
        assert b.token_ids == a.token_ids
    free = mtpjax.Engine(TP_CFG, TP_PARAMS, num_speculative_tokens=1, tp=2, **kw).generate(
        TP_PROMPTS[:2], SamplingParams(max_new_tokens=10))
    assert [o.token_ids for o in free] != [o.token_ids for o in out[:2]]


# ------------------------------------------------------------------------------- the server
import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CKPT = os.path.join(REPO, "checkpoints", "tiny")
MSGS = [{"role": "user", "content": "Tell me a story about a cat."}]


@pytest.fixture(scope="module")
def http():
    """The app on a K = 2 engine of the tiny checkpoint (in process, FastAPI's TestClient),
    the shapes of test_logprobs' server."""
    from fastapi.testclient import TestClient
    from mtpjax.serving.app import Server, build_app
    from mtpjax.serving.chat_template import load_chat_template
    from mtpjax.serving.online import OnlineEngine
    from mtpjax.serving.parsing import ServerLimits
    from mtpjax.text import Tokenizer
    tok = Tokenizer.from_checkpoint(CKPT)
    eng = mtpjax.Engine.from_checkpoint(CKPT, num_speculative_tokens=2, max_lanes=3,
                                        max_seq_len=128, prefill_chunk=32, prefill_buckets=[32])
    online = OnlineEngine(eng, tok).start()
    try:
        yield TestClient(build_app(Server(online, tok, ServerLimits("tiny", eng.cfg.vocab_size,
                                                                    128),
                                          load_chat_template(CKPT)))), tok, eng
    finally:
        online.shutdown()


def _post(http, route, **kw):
    client = http[0]
    body = {"model": "tiny", "max_tokens": 24, "temperature": 0.0, **kw}
    if route == "chat":
        body = {"messages": MSGS, "chat_template_kwargs": {"enable_thinking": False}, **body}
    r = client.post("/v1/chat/completions" if route == "chat" else "/v1/completions",
                    json=body)
    return r


def _text(r):
    assert r.status_code == 200, r.text
    return [c["message"]["content"] if "message" in c else c["text"]
            for c in r.json()["choices"]]


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_server_accepts_penalties(http, route):
    """The three fields work on both routes: they change the reply, n > 1 siblings each
    equal the single request with seed + i (each its own token history)."""
    extra = {} if route == "chat" else {"prompt": "The cat sat on the"}
    pen = dict(presence_penalty=1.0, frequency_penalty=0.5, repetition_penalty=1.4)
    (text,) = _text(_post(http, route, **extra, **pen))
    assert text != _text(_post(http, route, **extra))[0]
    sampled = dict(extra, temperature=1.0, seed=5, max_tokens=12, **pen)
    both = _text(_post(http, route, n=2, **sampled))
    assert both == [_text(_post(http, route, **dict(sampled, seed=5 + i)))[0]
                    for i in range(2)]
    # the no-op values clients often send explicitly
    assert _text(_post(http, route, presence_penalty=0, frequency_penalty=0.0,
                       repetition_penalty=1, **extra)) == _text(_post(http, route, **extra))


def test_parsing_maps_penalties_to_sampling_params():
    from mtpjax.serving.chat_template import load_chat_template
    from mtpjax.serving.parsing import ServerLimits, parse_chat, parse_completion
    from mtpjax.text import Tokenizer
    tok, limits = Tokenizer.from_checkpoint(CKPT), ServerLimits("tiny", 300, 128)
    r = parse_chat({"model": "tiny", "messages": MSGS, "presence_penalty": -2,
                    "frequency_penalty": 1.5, "repetition_penalty": 1.2}, limits, tok,
                   load_chat_template(CKPT))
    p = r.params
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (-2, 1.5, 1.2)
    p = parse_completion({"model": "tiny", "prompt": "x"}, limits, tok).params
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0, 0, 1)
    assert not p.penalized
    p = parse_completion({"model": "tiny", "prompt": "x", "frequency_penalty": 2.0}, limits,
                         tok).params
    assert p.frequency_penalty == 2.0 and p.penalized


@pytest.mark.parametrize("fields, param", [
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"presence_penalty": "0.5"}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"frequency_penalty": True}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"repetition_penalty": -1.0}, "repetition_penalty"),
])
@pytest.mark.parametrize("route", ["chat", "completions"])
def test_server_bad_penalties_name_the_field(http, route, fields, param):
    extra = {} if route == "chat" else {"prompt": "x"}
    r = _post(http, route, **extra, **fields)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and param in err["message"]
