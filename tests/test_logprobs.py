"""logprobs / top_logprobs and logit_bias: exact under speculation (spec == plain), equal to an
independent teacher-forced reference, validated; and the server's OpenAI shapes, n > 1."""

import dataclasses

import jax
import numpy as np
import pytest

import mtpjax
from mtpjax.api import forward_logits
from mtpjax.sampling import SamplingParams

from tiny_models import VOCAB11_CFG as CFG, VOCAB11_PARAMS as PARAMS
from tiny_models import assert_drafts_accepted_and_rejected

RNG = np.random.default_rng(3)
PROMPTS = [list(map(int, RNG.integers(0, 11, n))) for n in (3, 21, 9, 1)]
ENGINES = {}
# Lane buckets 1 and 3, not the default 1, 2, 3: bucket 2 runs the same code as bucket 1 (a
# step over fewer lane slots than the engine has), one decode program less to compile per
# engine and depth. test_penalties' engines have the same shapes (they share the programs).
LANE_BUCKETS = [1, 3]


def engine(k):
    if k not in ENGINES:
        ENGINES[k] = mtpjax.Engine(CFG, PARAMS, num_speculative_tokens=k, max_lanes=3,
                                   max_seq_len=96, prefill_chunk=16, lane_buckets=LANE_BUCKETS)
    return ENGINES[k]


def reference_logprobs(prompt, out):
    """log_softmax of the teacher-forced target logits at each output position."""
    logits = forward_logits(CFG, PARAMS, np.asarray([prompt + out], np.int32))[0]
    lp = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    return lp[len(prompt) - 1:len(prompt) - 1 + len(out)]


U32 = 2.0 ** -24          # float32 unit roundoff


def logprob_bound(prompt, out, cfg=CFG, params=PARAMS):
    """The most two float32 programs may disagree on a log probability of `out` after `prompt`
    when they sum in different orders, as a verify row and a single row do (GEMM vs GEMV
    blocking, the GDN's verify vs step form): derived from the arithmetic, not measured.

    Reassociating a float32 sum of n terms moves it by at most 2 gamma_n sum|terms|
    (gamma_n = n u / (1 - n u), Higham, Accuracy and Stability, 3.1). A logit z_v = sum_i h_i
    w_iv comes after L residual blocks whose inputs the RMSNorms keep at unit scale, each block's
    reductions no longer than n (the longest contraction: hidden, intermediate, a head's
    width x heads, the context), so to first order |dz_v| <= 2 (L + 1) gamma_n S with
    S = max_v sum_i |h_i w_iv| at the lm_head (from the teacher-forced reference's hidden
    states). log p_t = z_t - logsumexp(z) moves by at most |dz_t| + max_v |dz_v|, so
    |d log p| <= 4 (L + 1) gamma_n S. On the tiny test model it is ~1e-4; the measured
    differences are 3e-5 (tests/test_logprobs.py on a CI machine) and below.
    """
    from mtpjax.api import _forward_hidden
    tokens = np.asarray([prompt + out], np.int32)
    h, _ = _forward_hidden(cfg, params, jax.numpy.asarray(tokens))
    h = np.asarray(h[0], np.float64)[len(prompt) - 1:]                     # [T, H]
    w = np.asarray(params.embed if params.lm_head is None else params.lm_head, np.float64)
    w = w.T if w.shape[0] == cfg.vocab_size else w                           # [H, V]
    S = float((np.abs(h) @ np.abs(w)).max())
    n = max(cfg.hidden_size, cfg.intermediate_size, len(prompt) + len(out),
            cfg.num_attention_heads * cfg.head_dim,
            cfg.linear_num_value_heads * cfg.linear_value_head_dim)
    gamma = n * U32 / (1 - n * U32)
    return 4 * (cfg.num_layers + 1) * gamma * S


def check_same(a, b, n_top, tol=1e-5):
    assert b.token_ids == a.token_ids
    assert len(a.logprobs) == len(b.logprobs) == len(a.token_ids)
    for x, y, t in zip(a.logprobs, b.logprobs, a.token_ids):
        assert x.token == y.token == t
        np.testing.assert_allclose(y.logprob, x.logprob, rtol=tol, atol=tol)
        assert len(x.top) == len(y.top) == n_top
        assert [i for i, _ in y.top] == [i for i, _ in x.top]
        np.testing.assert_allclose([v for _, v in y.top], [v for _, v in x.top],
                                   rtol=tol, atol=tol)


@pytest.mark.parametrize("k", [2, 3])
@pytest.mark.parametrize("sp", [
    SamplingParams(max_new_tokens=16, logprobs=4),
    SamplingParams(temperature=1.0, seed=5, max_new_tokens=16, logprobs=3),
    SamplingParams(temperature=0.8, top_k=4, top_p=0.9, seed=9, max_new_tokens=16, logprobs=0),
], ids=["greedy", "sampled", "top_k_top_p"])
def test_logprobs_spec_equals_plain_and_reference(k, sp):
    params = [dataclasses.replace(sp, seed=sp.seed + i) for i in range(len(PROMPTS))]
    plain, spec = engine(0).generate(PROMPTS, params), engine(k).generate(PROMPTS, params)
    assert_drafts_accepted_and_rejected(spec)
    for e in (engine(0), engine(k)):      # both lane buckets ran (3 busy lanes, then 1)
        assert {("decode", e.k, 1), ("decode", e.k, 3)} <= set(e.stats()["programs"])
    for prompt, a, b in zip(PROMPTS, plain, spec):
        check_same(a, b, sp.logprobs, tol=logprob_bound(prompt, a.token_ids))
        ref = reference_logprobs(prompt, a.token_ids)
        for j, (rec, t) in enumerate(zip(b.logprobs, b.token_ids)):
            np.testing.assert_allclose(rec.logprob, ref[j, t], atol=1e-3)
            want = np.argsort(-ref[j], kind="stable")[:sp.logprobs]
            np.testing.assert_allclose([v for _, v in rec.top], ref[j, want], atol=1e-3)
            # the chosen token is at most as likely as the most likely one
            if rec.top:
                assert rec.logprob <= rec.top[0][1] + 1e-6
                assert [v for _, v in rec.top] == sorted((v for _, v in rec.top), reverse=True)


def test_logprobs_off_by_default_and_mixed_batches():
    plain = engine(2).generate(PROMPTS, [SamplingParams(max_new_tokens=8, logprobs=2),
                                         SamplingParams(max_new_tokens=8), 
                                         SamplingParams(max_new_tokens=8, logprobs=0),
                                         SamplingParams(max_new_tokens=8)])
    assert plain[1].logprobs is None and plain[3].logprobs is None
    assert len(plain[0].logprobs) == 8 and len(plain[0].logprobs[0].top) == 2
    assert plain[2].logprobs[0].top == ()
    alone = engine(2).generate([PROMPTS[1]], SamplingParams(max_new_tokens=8))[0]
    assert alone.token_ids == plain[1].token_ids


def test_logprobs_stop_token_truncates_records():
    free = engine(0).generate([PROMPTS[1]], SamplingParams(max_new_tokens=20))[0]
    stop = free.token_ids[5]
    sp = SamplingParams(max_new_tokens=20, stop_token_ids=(stop,), logprobs=1)
    a, b = engine(0).generate([PROMPTS[1]], sp)[0], engine(3).generate([PROMPTS[1]], sp)[0]
    assert a.finish_reason == "stop" and a.token_ids[-1] == stop
    check_same(a, b, 1, tol=logprob_bound(PROMPTS[1], a.token_ids))


# ------------------------------------------------------------------------------ logit_bias
def test_logit_bias_makes_greedy_pick_the_token():
    base = engine(0).generate(PROMPTS[:2], SamplingParams(max_new_tokens=10))
    tok = next(t for t in range(11) if t not in base[0].token_ids + base[1].token_ids) \
        if any(t not in base[0].token_ids + base[1].token_ids for t in range(11)) else 3
    sp = SamplingParams(max_new_tokens=10, logit_bias={tok: 100.0})
    for k in (0, 2):
        outs = engine(k).generate(PROMPTS[:2], sp)
        for o in outs:
            assert o.token_ids == [tok] * 10
    # a large negative bias bans the greedy token
    banned = base[0].token_ids[0]
    out = engine(2).generate([PROMPTS[0]], SamplingParams(max_new_tokens=10,
                                                          logit_bias={banned: -100}))[0]
    assert banned not in out.token_ids


# k = 2 and 3: the engines of the tests above (a k = 1 engine here was one more set of
# programs to compile; one draft or a chain of them, the bias applies to the verify logits alike)
@pytest.mark.parametrize("k", [2, 3])
def test_logit_bias_sampled_spec_equals_plain(k):
    bias = {1: 3.0, 4: -2.5, 7: 1.5}
    params = [SamplingParams(temperature=1.0, seed=20 + i, max_new_tokens=16, logit_bias=bias,
                             logprobs=2) for i in range(len(PROMPTS))]
    plain, spec = engine(0).generate(PROMPTS, params), engine(k).generate(PROMPTS, params)
    assert_drafts_accepted_and_rejected(spec)
    for prompt, a, b in zip(PROMPTS, plain, spec):
        check_same(a, b, 2, tol=logprob_bound(prompt, a.token_ids))
    # the bias changes the output (the test could fail)
    unbiased = engine(0).generate(PROMPTS, [dataclasses.replace(p, logit_bias=())
                                            for p in params])
    assert any(u.token_ids != a.token_ids for u, a in zip(unbiased, plain))
    # logprobs are the raw distribution's: those of the unbiased reference
    for prompt, a in zip(PROMPTS, plain):
        ref = reference_logprobs(prompt, a.token_ids)
        np.testing.assert_allclose([r.logprob for r in a.logprobs],
                                   ref[np.arange(len(a.token_ids)), a.token_ids], atol=1e-3)


def test_validation_errors():
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=21)
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=-1)
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=True)
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={1: 101.0})
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={1: float("nan")})
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={-1: 1.0})
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={i: 1.0 for i in range(301)})
    with pytest.raises(ValueError, match="twice"):
        SamplingParams(logit_bias=[(1, 1.0), (1, 2.0)])
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias=5)
    sp = SamplingParams(logit_bias={3: 1, 1: -1.5})
    assert sp.logit_bias == ((1, -1.5), (3, 1)) and hash(sp)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        SamplingParams(logit_bias={11: 1.0}).validate(11)
    out = engine(0).generate([[1, 2]], SamplingParams(logit_bias={50: 1.0}))[0]
    assert out.finish_reason == "error" and "logit_bias" in out.error


# ------------------------------------------------------------------------------- the server
import json
import math
import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CKPT = os.path.join(REPO, "checkpoints", "tiny")
SERVE_ENGINE = dict(max_lanes=3, max_seq_len=128, prefill_chunk=32, prefill_buckets=[32])
MSGS = [{"role": "user", "content": "Tell me a story."}]


@pytest.fixture(scope="module")
def http():
    """The app on a K = 2 engine of the tiny checkpoint (in process, FastAPI's TestClient)."""
    from fastapi.testclient import TestClient
    from mtpjax.serving.app import Server, build_app
    from mtpjax.serving.chat_template import load_chat_template
    from mtpjax.serving.online import OnlineEngine
    from mtpjax.serving.parsing import ServerLimits
    from mtpjax.text import Tokenizer
    tok = Tokenizer.from_checkpoint(CKPT)
    eng = mtpjax.Engine.from_checkpoint(CKPT, num_speculative_tokens=2, **SERVE_ENGINE)
    online = OnlineEngine(eng, tok).start()
    try:
        yield TestClient(build_app(Server(online, tok, ServerLimits("tiny", eng.cfg.vocab_size,
                                                                    128),
                                          load_chat_template(CKPT)))), tok
    finally:
        online.shutdown()


def chat(http, **kw):
    client, _ = http
    body = {"model": "tiny", "messages": MSGS, "max_tokens": 12, "seed": 4,
            "chat_template_kwargs": {"enable_thinking": False}, **kw}
    return client.post("/v1/chat/completions", json=body)


def sse_events(r):
    assert r.status_code == 200, r.text
    lines = [ln.removeprefix("data: ") for ln in r.text.splitlines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(ln) for ln in lines[:-1]]


def test_server_chat_logprobs(http):
    r = chat(http, logprobs=True, top_logprobs=3, temperature=1.0)
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    content = choice["logprobs"]["content"]
    assert len(content) == r.json()["usage"]["completion_tokens"] > 0
    for e in content:
        assert set(e) == {"token", "logprob", "bytes", "top_logprobs"}
        assert e["bytes"] == list(e["token"].encode())
        tops = [t["logprob"] for t in e["top_logprobs"]]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        assert e["logprob"] <= tops[0] + 1e-6 and e["logprob"] <= 0
        assert sum(math.exp(v) for v in tops) <= 1 + 1e-5
    # the same request without logprobs: the same text; logprobs null
    plain = chat(http, temperature=1.0).json()["choices"][0]
    assert plain["logprobs"] is None
    assert plain["message"]["content"] == choice["message"]["content"]
    # streaming carries the same records, chunk by chunk
    events = sse_events(chat(http, logprobs=True, top_logprobs=3, temperature=1.0,
                             stream=True))
    streamed = [e for ev in events for ch in ev["choices"] if ch.get("logprobs")
                for e in ch["logprobs"]["content"]]
    assert [e["token"] for e in streamed] == [e["token"] for e in content]
    np.testing.assert_allclose([e["logprob"] for e in streamed],
                               [e["logprob"] for e in content], atol=1e-6)
    # logprobs without top_logprobs: the chosen token's only
    e0 = chat(http, logprobs=True).json()["choices"][0]["logprobs"]["content"][0]
    assert e0["top_logprobs"] == []


def test_server_completion_logprobs(http):
    client, _ = http
    body = {"model": "tiny", "prompt": "def f(x):", "max_tokens": 8, "seed": 1, "logprobs": 2}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    lp = choice["logprobs"]
    n = r.json()["usage"]["completion_tokens"]
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == n
    assert all(len(t) <= 2 for t in lp["top_logprobs"])
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    assert all(v <= 0 for v in lp["token_logprobs"])
    events = sse_events(client.post("/v1/completions", json={**body, "stream": True}))
    toks = [t for ev in events for ch in ev["choices"] if ch.get("logprobs")
            for t in ch["logprobs"]["tokens"]]
    assert toks == lp["tokens"]


def test_server_n_choices_equal_single_requests_with_seed_plus_i(http):
    r = chat(http, n=3, temperature=1.0, seed=11, max_tokens=10)
    assert r.status_code == 200, r.text
    b = r.json()
    assert [c["index"] for c in b["choices"]] == [0, 1, 2]
    singles = [chat(http, temperature=1.0, seed=11 + i, max_tokens=10).json()
               for i in range(3)]
    assert [c["message"]["content"] for c in b["choices"]] == \
        [s["choices"][0]["message"]["content"] for s in singles]
    assert len({c["message"]["content"] for c in b["choices"]}) > 1, "seeds made no difference"
    assert b["usage"]["completion_tokens"] == sum(s["usage"]["completion_tokens"]
                                                  for s in singles)
    assert b["usage"]["prompt_tokens"] == singles[0]["usage"]["prompt_tokens"]
    # streamed: chunks of the three choices, each reassembling to its single request
    events = sse_events(chat(http, n=3, temperature=1.0, seed=11, max_tokens=10, stream=True,
                             stream_options={"include_usage": True}))
    texts = {i: "" for i in range(3)}
    finishes = {}
    for ev in events:
        for ch in ev["choices"]:
            texts[ch["index"]] += ch["delta"].get("content") or ""
            if ch["finish_reason"]:
                finishes[ch["index"]] = ch["finish_reason"]
    assert [texts[i] for i in range(3)] == [c["message"]["content"] for c in b["choices"]]
    assert set(finishes) == {0, 1, 2}
    assert events[-1]["usage"]["completion_tokens"] == b["usage"]["completion_tokens"]
    # completions too
    client, _ = http
    c = client.post("/v1/completions", json={"model": "tiny", "prompt": "x = ", "n": 2,
                                             "seed": 3, "max_tokens": 6, "temperature": 1.0})
    assert [ch["index"] for ch in c.json()["choices"]] == [0, 1]


def test_server_logit_bias(http):
    client, tok = http
    t = tok.encode(" banana")[0]
    r = chat(http, logit_bias={str(t): 100}, temperature=0.0, max_tokens=5, logprobs=True)
    assert r.status_code == 200, r.text
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert [e["token"] for e in content] == [tok.decode([t])] * 5
    assert r.json()["choices"][0]["message"]["content"] == tok.decode([t] * 5)
    # without the bias the greedy reply is another one (the test could fail)
    assert chat(http, temperature=0.0, max_tokens=5).json()["choices"][0]["message"][
        "content"] != tok.decode([t] * 5)
    c = client.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 4,
                                             "temperature": 0.0, "logit_bias": {str(t): 100}})
    assert c.json()["choices"][0]["text"] == tok.decode([t] * 4)


@pytest.mark.parametrize("fields, param", [
    ({"logit_bias": {"abc": 1}}, "logit_bias"), ({"logit_bias": {"1": 101}}, "logit_bias"),
    ({"logit_bias": {"99999999": 1}}, "logit_bias"), ({"logit_bias": [1]}, "logit_bias"),
    ({"logprobs": 1}, "logprobs"), ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"), ({"n": 0}, "n"), ({"n": 17}, "n"),
])
def test_server_bad_values_name_the_field(http, fields, param):
    r = chat(http, **fields)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and param in r.json()["error"]["message"]


def test_server_bad_completion_logprobs(http):
    client, _ = http
    for v in (6, -1, True):
        r = client.post("/v1/completions", json={"model": "tiny", "prompt": "x",
                                                 "logprobs": v})
        assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs", r.text


def test_parsing_maps_the_fields_to_sampling_params():
    from mtpjax.serving.chat_template import load_chat_template
    from mtpjax.serving.parsing import ServerLimits, parse_chat, parse_completion
    from mtpjax.text import Tokenizer
    tok, limits = Tokenizer.from_checkpoint(CKPT), ServerLimits("tiny", 300, 128)
    r = parse_chat({"model": "tiny", "messages": MSGS, "logprobs": True, "top_logprobs": 3,
                    "logit_bias": {"7": 2, "5": -1.5}, "n": 3, "seed": 2 ** 32 - 2}, limits,
                   tok, load_chat_template(CKPT))
    assert r.params.logprobs == 3 and r.params.logit_bias == ((5, -1.5), (7, 2.0)) and r.n == 3
    assert [p.seed for p in r.sibling_params()] == [2 ** 32 - 2, 2 ** 32 - 1, 0]
    r = parse_chat({"model": "tiny", "messages": MSGS, "logprobs": False}, limits, tok,
                   load_chat_template(CKPT))
    assert r.params.logprobs is None and r.n == 1 and r.params.logit_bias == ()
    r = parse_completion({"model": "tiny", "prompt": "x", "logprobs": 0}, limits, tok)
    assert r.params.logprobs == 0


def test_tensor_parallel_logprobs_and_bias_match_one_device():
    """tp = 2: the greedy fast branch (no logits gather) must give way to a bias, and the
    log probabilities are gathered over the vocabulary shards."""
    from tiny_models import TP_CFG, TP_ENGINE_KW, TP_PARAMS, TP_PROMPTS
    assert len(jax.devices()) >= 2, "conftest should give the CPU 8 devices"
    params = [SamplingParams(max_new_tokens=8, logprobs=3),
              SamplingParams(max_new_tokens=8, logit_bias={5: 100.0}),
              SamplingParams(max_new_tokens=8, temperature=1.0, seed=2, logprobs=1,
                             logit_bias={2: 3.0, 9: -4.0}),
              SamplingParams(max_new_tokens=8, logit_bias={12: 100.0}, logprobs=0)]
    kw = dict(TP_ENGINE_KW, max_lanes=2)
    ref = mtpjax.Engine(TP_CFG, TP_PARAMS, num_speculative_tokens=1, **kw).generate(
        TP_PROMPTS, params)
    out = mtpjax.Engine(TP_CFG, TP_PARAMS, num_speculative_tokens=1, tp=2, **kw).generate(
        TP_PROMPTS, params)
    assert out[1].token_ids == [5] * 8 and out[3].token_ids == [12] * 8
    for prompt, a, b, p in zip(TP_PROMPTS, ref, out, params):
        assert b.token_ids == a.token_ids
        if p.logprobs is not None:     # tp sums each projection's shards in another order
            check_same(a, b, p.logprobs,
                       tol=logprob_bound(list(prompt), a.token_ids, TP_CFG, TP_PARAMS))


# ------------------------------------------------------------- the trained head, every feature
TRAINED_KW = dict(max_lanes=3, max_seq_len=128, prefill_chunk=32, prefill_buckets=[32])
TRAINED_TEXTS = ["Once upon a time, there was a little girl named Lily. She",
                 "The dog ran to the park and", "Tom and Sue went to the store to buy"]


def test_trained_head_spec_equals_plain_with_penalties_bias_and_logprobs():
    """The trained tiny's MTP head (the server fixture's engine shapes, so its programs are
    shared): its drafts land past the first position, so the verify path runs partial
    acceptance, rollback and multi-token replay with penalties, logit_bias and logprobs on;
    the tokens equal plain decoding's and the log probabilities agree within the float32
    bound (logprob_bound)."""
    from mtpjax.text import Tokenizer
    tok = Tokenizer.from_checkpoint(CKPT)
    prompts = [tok.encode(t) for t in TRAINED_TEXTS]
    params = [SamplingParams(max_new_tokens=24, logprobs=2, presence_penalty=0.4,
                             logit_bias={int(tok.encode(" the")[0]): -1.5}),
              SamplingParams(max_new_tokens=24, temperature=0.7, seed=3, logprobs=1,
                             frequency_penalty=0.3, repetition_penalty=1.1),
              SamplingParams(max_new_tokens=24, temperature=0.9, top_k=20, top_p=0.9, seed=8,
                             logprobs=0, logit_bias={int(tok.encode(".")[0]): 2.0})]
    plain = mtpjax.Engine.from_checkpoint(CKPT, num_speculative_tokens=0,
                                          **TRAINED_KW).generate(prompts, params)
    eng = mtpjax.Engine.from_checkpoint(CKPT, num_speculative_tokens=2, **TRAINED_KW)
    spec = eng.generate(prompts, params)
    assert_drafts_accepted_and_rejected(spec, past=1)
    for prompt, p, a, b in zip(prompts, params, plain, spec):
        check_same(a, b, p.logprobs, tol=logprob_bound(prompt, a.token_ids, eng.cfg, eng.params))
    # the penalties and the bias act (the comparison above could fail)
    free = mtpjax.Engine.from_checkpoint(CKPT, num_speculative_tokens=0, **TRAINED_KW).generate(
        prompts, [dataclasses.replace(p, logit_bias=(), presence_penalty=0.0,
                                      frequency_penalty=0.0, repetition_penalty=1.0)
                  for p in params])
    assert any(f.token_ids != a.token_ids for f, a in zip(free, plain))
