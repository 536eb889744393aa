"""Structured output (mtpjax/grammar.py): grammar-constrained decoding through llguidance, exact
under speculation.

On the bundled tiny checkpoint (a small Python-code model: its JSON is poor, the grammar makes
it valid): the speculative engine's constrained output equals the stock engine's constrained
output token for token, greedy and seeded; every reply parses and matches its schema, and
without the grammar it does not. The host-side mask builder gives each verify row the grammar
state after the drafts before it, and all-allowed rows past a draft the grammar rejects.
Masked drafts: the drafts a constrained lane's verification gets are grammar-valid wherever a
draft candidate is, which raises acceptance without changing a token, and leaves the
unconstrained lanes of the batch as they were. The server maps response_format json_object /
json_schema onto the grammar.
"""

import dataclasses
import json
import os

import jax
import numpy as np
import pytest

import mtpjax
from mtpjax import grammar, steps
from mtpjax.sampling import SamplingParams
from mtpjax.text import Tokenizer

from json_schema_check import matches
from tiny_models import assert_drafts_accepted_and_rejected

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CKPT = os.path.join(REPO, "checkpoints", "tiny")
K = 3
# Lane buckets 1 and 3, not 1, 2, 3: bucket 2 runs the same code as bucket 1 (a step over
# fewer lane slots than the engine has) and was two more decode programs to compile per
# engine, on this 4096-token model most of the module's time (runs() checks both buckets ran).
ENGINE = dict(max_lanes=3, max_seq_len=128, prefill_chunk=32, prefill_buckets=[32],
              lane_buckets=[1, 3])
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["name", "age", "ok", "tags"],
    "additionalProperties": False,
}
TEXTS = ["def f(x):\n    return", "# a JSON record\nrecord = ", "import os\n"]
_ENGINES = {}


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_checkpoint(CKPT)


def engine(k):
    if k not in _ENGINES:
        _ENGINES[k] = mtpjax.Engine.from_checkpoint(CKPT, num_speculative_tokens=k, **ENGINE)
    return _ENGINES[k]


def test_the_validator_refuses_what_the_schema_does():
    ok = {"name": "Ada", "age": 36, "ok": True, "tags": ["a", "c"]}
    assert matches(ok, SCHEMA)
    for bad in ({**ok, "age": 121}, {**ok, "age": True}, {**ok, "ok": 1}, {**ok, "name": "x" * 11},
                {**ok, "tags": ["a", "b", "c", "a"]}, {**ok, "tags": ["d"]}, {**ok, "more": 1},
                {k: v for k, v in ok.items() if k != "tags"}, [ok]):
        assert not matches(bad, SCHEMA), bad
    with pytest.raises(ValueError, match="pattern"):
        matches("x", {"type": "string", "pattern": "x"})     # not checked: refused


PARAMS = [SamplingParams(max_new_tokens=80)] + [
    SamplingParams(temperature=1.0, seed=s, max_new_tokens=80) for s in (1, 2, 3)]


@pytest.fixture(scope="module")
def runs(tok):
    """{(k, params index): outputs over TEXTS}, constrained by SCHEMA's grammar."""
    g = grammar.json_schema_grammar(SCHEMA)
    prompts = [tok.encode(t) for t in TEXTS]
    out = {(k, i): engine(k).generate(prompts, dataclasses.replace(p, grammar=g))
           for k in (0, K) for i, p in enumerate(PARAMS)}
    for k in (0, K):        # both lane buckets ran: all lanes busy, and one lane left
        assert {("decode", k, 1), ("decode", k, 3)} <= set(engine(k).stats()["programs"])
    return out


@pytest.mark.parametrize("i", range(len(PARAMS)), ids=["greedy", "seed1", "seed2", "seed3"])
def test_speculative_constrained_equals_plain_constrained(runs, tok, i):
    plain, spec = runs[(0, i)], runs[(K, i)]
    for a, b in zip(plain, spec):
        assert b.token_ids == a.token_ids
        assert b.finish_reason == a.finish_reason == "stop", (a.finish_reason, a.error)
        v = json.loads(tok.decode(a.token_ids))
        assert matches(v, SCHEMA), v


def test_speculation_ran_and_drafts_were_rejected_and_accepted(runs):
    outs = [o for i in range(len(PARAMS)) for o in runs[(K, i)]]
    drafted = sum(o.stats.drafted_tokens for o in outs)
    accepted = sum(o.stats.accepted_tokens for o in outs)
    assert 0 < accepted < drafted, (accepted, drafted)
    assert_drafts_accepted_and_rejected(outs)


# ---------------------------------------------------------------------------- masked drafts
def _acceptance(outs):
    return (sum(o.stats.accepted_tokens for o in outs),
            sum(o.stats.drafted_tokens for o in outs))


@pytest.fixture(scope="module")
def unmasked(tok):
    """{params index: outputs over TEXTS} of the K-draft engine with mask_drafts off (the MTP's
    drafts verified as they are), constrained by SCHEMA's grammar."""
    g, e = grammar.json_schema_grammar(SCHEMA), engine(K)
    prompts = [tok.encode(t) for t in TEXTS]
    e.mask_drafts = False
    try:
        return {i: e.generate(prompts, dataclasses.replace(p, grammar=g))
                for i, p in enumerate(PARAMS)}
    finally:
        e.mask_drafts = True


def test_masked_drafts_raise_acceptance_and_keep_the_output(runs, unmasked):
    """Masking the drafts by the grammar (the default) changes no token and accepts more
    of them on this workload (an unmasked draft is mostly a token the grammar forbids, which
    verification must reject; the rates are printed, run with -s)."""
    for i in range(len(PARAMS)):
        assert [o.token_ids for o in runs[(K, i)]] == [o.token_ids for o in unmasked[i]]
    masked = _acceptance([o for i in range(len(PARAMS)) for o in runs[(K, i)]])
    plain = _acceptance([o for outs in unmasked.values() for o in outs])
    print(f"constrained acceptance: masked drafts {masked[0]}/{masked[1]} = "
          f"{masked[0] / masked[1]:.3f}, unmasked {plain[0]}/{plain[1]} = "
          f"{plain[0] / plain[1]:.3f}")
    assert masked[0] / masked[1] > 2 * plain[0] / plain[1], (masked, plain)


def test_verified_drafts_are_grammar_valid_where_a_candidate_is(tok, monkeypatch):
    """Every draft a constrained lane's verification gets is allowed by the grammar at its
    position (the verify row's mask before it) whenever one of its candidates is, and the
    host did correct some drafts (the check saw the corrections at all)."""
    e, g = engine(K), grammar.json_schema_grammar(SCHEMA)
    seen = {"checked": 0, "fixed": 0}
    real_masked = grammar.Constraint.masked_drafts

    def counting(self, drafts, candidates, stops=frozenset()):
        fixed, masks = real_masked(self, drafts, candidates, stops)
        seen["fixed"] += sum(a != int(b) for a, b in zip(fixed, drafts))
        return fixed, masks
    real_step = steps.decode_step

    def checking(cfg, params, cache, state, lanes, active, table, join, chunk, allowed,
                 extras, **kw):
        drafts, cands, masks, flag, joins = (np.asarray(x) for x in (
            state.drafts, state.candidates, allowed, extras.constrained, join.mask))
        for b in np.flatnonzero(flag & ~joins):
            for j in range(kw["k"]):
                if (masks[b, j] == -1).all():       # past the grammar walk's end
                    break
                if any(c >= 0 and grammar.allowed(masks[b, j], int(c)) for c in cands[b, j]):
                    assert grammar.allowed(masks[b, j], int(drafts[b, j])), (b, j)
                    seen["checked"] += 1
        return real_step(cfg, params, cache, state, lanes, active, table, join, chunk,
                         allowed, extras, **kw)
    monkeypatch.setattr(grammar.Constraint, "masked_drafts", counting)
    monkeypatch.setattr(steps, "decode_step", checking)
    e.generate([tok.encode(t) for t in TEXTS],
               [dataclasses.replace(p, grammar=g) for p in PARAMS[:3]])
    assert seen["checked"] > 20 and seen["fixed"] > 10, seen


def test_masked_drafts_leave_unconstrained_lanes_alone(tok):
    """In a batch mixing constrained and unconstrained lanes, the unconstrained lane's drafts
    (its acceptance per position) and tokens are the same with masked drafts on and off."""
    e, g = engine(K), grammar.json_schema_grammar(SCHEMA)
    prompts = [tok.encode(t) for t in TEXTS]
    mixed = [SamplingParams(max_new_tokens=30, grammar=g), SamplingParams(max_new_tokens=30),
             SamplingParams(temperature=1.0, seed=4, max_new_tokens=30, grammar=g)]
    on = e.generate(prompts, mixed)
    e.mask_drafts = False
    try:
        off = e.generate(prompts, mixed)
    finally:
        e.mask_drafts = True
    assert [o.token_ids for o in on] == [o.token_ids for o in off]
    assert on[1].stats.accepted_per_position == off[1].stats.accepted_per_position
    assert on[1].stats.drafted_tokens == off[1].stats.drafted_tokens > 0
    assert _acceptance([on[0], on[2]]) != _acceptance([off[0], off[2]])


def test_masked_drafts_take_the_first_allowed_candidate(tok, llt):
    """Constraint.masked_drafts: an allowed draft stays; a forbidden one becomes its first
    allowed candidate, or the grammar's only allowed token when no candidate is allowed; the
    walk goes on after a correction; a draft without candidates (-1) stays; the masks are
    step_masks of the corrected drafts and the matcher is left where it was."""
    c = grammar.Constraint(llt, grammar.json_schema_grammar(SCHEMA), 4096)
    brace, quote, name = tok.encode("{")[0], tok.encode('"')[0], tok.token_to_id("name")
    x, y = tok.encode("x")[0], tok.encode("y")[0]
    none = [-1] * 8
    before = c.mask().copy()
    cands = np.array([[x, brace] + [-1] * 6,      # x forbidden: '{', the first allowed
                      [y] + [x] * 7,              # none allowed, '"' forced: '"'
                      [x, name] + [-1] * 6,       # 'name' allowed after '{"'
                      none])
    fixed, masks = c.masked_drafts([x, y, x, x], cands)
    assert fixed == [brace, quote, name, x]
    np.testing.assert_array_equal(masks, c.step_masks(fixed))
    np.testing.assert_array_equal(c.mask(), before)
    fixed, _ = c.masked_drafts([brace, quote, x], np.array([[y] * 8, none, none]))
    assert fixed == [brace, quote, x]             # allowed drafts stay; no candidates: kept


def test_without_the_grammar_the_output_is_no_json(tok):
    outs = engine(0).generate([tok.encode(t) for t in TEXTS], SamplingParams(max_new_tokens=40))
    for o in outs:
        with pytest.raises(json.JSONDecodeError):
            json.loads(tok.decode(o.token_ids))


def test_constrained_requests_add_no_program(tok):
    """The masks are an input of every decode program: constrained and unconstrained steps, in
    one batch or apart, run the same compiled programs."""
    e = engine(K)
    prompts = [tok.encode(t) for t in TEXTS]
    g = grammar.json_object_grammar()
    e.generate(prompts, SamplingParams(max_new_tokens=12))
    before = steps.decode_step._cache_size()
    mixed = [SamplingParams(max_new_tokens=12, grammar=g), SamplingParams(max_new_tokens=12),
             SamplingParams(temperature=1.0, seed=4, max_new_tokens=12, grammar=g)]
    outs = e.generate(prompts, mixed)
    assert steps.decode_step._cache_size() == before
    assert tok.decode(outs[0].token_ids).startswith("{")
    # the masked drafts' corrections (written to the lane state by the host) keep the state
    # placed as the engine's programs were compiled for: committed or not is part of a
    # program's key, and a committed state after warmup recompiled every program it flows
    # through (measured: 4 decode_step compiles on a warmed engine's first constrained run)
    fresh = mtpjax.Engine(e.cfg, e.params, num_speculative_tokens=K, **ENGINE).state
    assert ([x.committed for x in jax.tree.leaves(e.state)]
            == [x.committed for x in jax.tree.leaves(fresh)])


def test_grammar_errors():
    with pytest.raises(ValueError, match="invalid JSON schema"):
        grammar.json_schema_grammar({"type": "objectx"})
    with pytest.raises(ValueError, match="not valid JSON"):
        grammar.json_schema_grammar("{oops")
    with pytest.raises(ValueError, match="grammar"):
        SamplingParams(grammar=3)
    with pytest.raises(ValueError, match="invalid grammar"):
        grammar.check_grammar("not a grammar {")


def test_a_grammar_needs_a_grammar_tokenizer(tok):
    e = engine(0)
    src, e.core._grammar_src, e.core._grammar_tok = e.core._grammar_src, None, None
    try:
        (out,) = e.generate([tok.encode("x = ")], SamplingParams(
            grammar=grammar.json_object_grammar()))
    finally:
        e.core._grammar_src = src
    assert out.finish_reason == "error" and "grammar tokenizer" in out.error


# ------------------------------------------------------------------------- the mask builder
@pytest.fixture(scope="module")
def llt(tok):
    return grammar.make_tokenizer(CKPT, 4096, tok.stop_ids())


def _allowed_ids(mask):
    return set(np.flatnonzero(grammar.unpack(mask, 4096)).tolist())


def test_step_masks_follow_the_drafts_and_stop_at_a_rejected_one(tok, llt):
    c = grammar.Constraint(llt, grammar.json_schema_grammar(SCHEMA), 4096)
    brace, quote, name = tok.encode("{")[0], tok.encode('"')[0], tok.token_to_id("name")
    bad = tok.encode("x")[0]
    assert name is not None
    before = c.mask().copy()
    assert _allowed_ids(before) == {brace}
    m = c.step_masks([brace, quote, bad, quote], stops=frozenset(tok.stop_ids()))
    assert m.shape == (5, grammar.words(4096))
    assert _allowed_ids(m[0]) == {brace}
    assert _allowed_ids(m[1]) == {quote}                # '{' then '"name"...' (compact layout)
    row2 = _allowed_ids(m[2])
    assert name in row2 and bad not in row2             # after '{"': the key, not "x"
    # draft 3 ("x") is rejected by row 2: rows 3 and 4 can never be emitted: all allowed
    assert (m[3] == -1).all() and (m[4] == -1).all()
    # the matcher is where it was
    np.testing.assert_array_equal(c.mask(), before)
    # a stop token is allowed only where the grammar accepts; rows after it are all allowed
    stop = tok.stop_ids()[0]
    assert stop not in _allowed_ids(m[0])
    json_obj = grammar.Constraint(llt, grammar.json_object_grammar(), 4096)
    for t in tok.encode("{}"):
        assert json_obj.consume(t) is None
    assert json_obj.stopped


def test_masked_verify_samples_only_allowed_tokens():
    """apply_bitmask -> sampling.verify: greedy takes the masked argmax, sampled draws never
    leave the mask, and an all -1 mask changes nothing."""
    from mtpjax import sampling
    rng = np.random.default_rng(0)
    B, k1, V = 2, 3, 70
    logits = jax.numpy.asarray(rng.normal(size=(B, k1, V)).astype(np.float32))
    allow = rng.random((B, k1, V)) < 0.2
    allow[..., 5] = True
    packed = np.packbits(np.pad(allow, ((0, 0), (0, 0), (0, 96 - V))), axis=-1,
                         bitorder="little").view(np.int32)
    np.testing.assert_array_equal(grammar.unpack(packed, V), allow)
    masked = grammar.apply_bitmask(logits, jax.numpy.asarray(packed))
    assert np.isneginf(np.asarray(masked)[~allow]).all()
    np.testing.assert_array_equal(np.asarray(masked)[allow], np.asarray(logits)[allow])
    drafts = jax.numpy.full((B, k1 - 1), 5, jax.numpy.int32)
    for temp in (0.0, 1.0):
        for seed in range(20):
            lanes = sampling.LaneSampling.from_params(
                [SamplingParams(temperature=temp, seed=seed)] * B)
            _, toks = sampling.verify(masked, drafts, lanes, jax.numpy.arange(B) + 7)
            for b, row in enumerate(np.asarray(toks)):
                for j, t in enumerate(row):
                    if t >= 0:
                        assert allow[b, j, t]
                        if temp == 0:
                            assert t == np.argmax(np.where(allow[b, j], logits[b, j], -np.inf))
    ones = jax.numpy.full((B, k1, 3), -1, jax.numpy.int32)
    np.testing.assert_array_equal(np.asarray(grammar.apply_bitmask(logits, ones)), logits)
    assert not bool(grammar.constrained(ones)) and bool(grammar.constrained(packed))


def test_thinking_grammar_allows_reasoning_then_json(tok, llt):
    g = grammar.after_thinking(SCHEMA)
    ok = 'hmm, a </ thing\n</think>\n\n{"name": "x", "age": 3, "ok": true, "tags": ["a"]}'
    c = grammar.Constraint(llt, g, 4096)
    for t in tok.encode(ok):
        assert c.consume(t) is None, tok.decode([t])
    assert c.stopped
    c = grammar.Constraint(llt, g, 4096)
    errs = [c.consume(t) for t in tok.encode("x</think>\n\nnope")]
    assert any(errs)


# ------------------------------------------------------------------------------- the server
@pytest.fixture(scope="module")
def http(tok):
    """The app on the K-draft engine (in process, FastAPI's TestClient)."""
    from fastapi.testclient import TestClient
    from mtpjax.serving.app import Server, build_app
    from mtpjax.serving.chat_template import load_chat_template
    from mtpjax.serving.online import OnlineEngine
    from mtpjax.serving.parsing import ServerLimits
    online = OnlineEngine(engine(K), tok).start()
    try:
        yield TestClient(build_app(Server(online, tok, ServerLimits("tiny", 4096, 128),
                                          load_chat_template(CKPT))))
    finally:
        online.shutdown()


def _chat(http, response_format, thinking=False, **extra):
    return http.post("/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "user", "content": "Give me a record."}],
        "response_format": response_format, "max_tokens": 90, "seed": 3,
        "chat_template_kwargs": {"enable_thinking": thinking}, **extra})


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_server_json_schema(http, temperature):
    r = _chat(http, {"type": "json_schema", "json_schema": {
        "name": "record", "schema": SCHEMA, "strict": True}}, temperature=temperature)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert matches(json.loads(choice["message"]["content"]), SCHEMA)


def test_server_json_object(http):
    r = _chat(http, {"type": "json_object"}, temperature=0.0, max_tokens=60)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    content = choice["message"]["content"]
    if choice["finish_reason"] == "stop":
        assert isinstance(json.loads(content), dict)
    else:                                 # cut by max_tokens: a JSON object's beginning
        assert choice["finish_reason"] == "length" and content.startswith("{")


def test_server_text_format_is_free(http):
    r = _chat(http, {"type": "text"}, temperature=0.0, max_tokens=8)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("fmt, match", [
    ({"type": "json_schema", "json_schema": {"name": "r", "schema": {"type": "objectx"}}},
     "response_format.json_schema.schema"),
    ({"type": "json_schema"}, "needs 'json_schema'"),
    ({"type": "json_schema", "json_schema": {"schema": {}}}, "name"),
    ({"type": "yaml"}, "response_format"),
    ({"type": "json_object", "extra": 1}, "response_format"),
])
def test_server_bad_response_format_is_a_400_naming_it(http, fmt, match):
    r = _chat(http, fmt)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "response_format" and match in err["message"], err


def test_parsing_maps_response_format_to_the_grammar(tok):
    from mtpjax.serving.chat_template import load_chat_template
    from mtpjax.serving.parsing import ServerLimits, parse_chat
    template, limits = load_chat_template(CKPT), ServerLimits("tiny", 4096, 128)

    def parsed(rf, thinking):
        return parse_chat({"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                           "response_format": rf,
                           "chat_template_kwargs": {"enable_thinking": thinking}},
                          limits, tok, template).params.grammar
    assert parsed({"type": "text"}, False) is None
    assert parsed({"type": "json_object"}, False) == grammar.json_object_grammar()
    rf = {"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA, "strict": True}}
    assert parsed(rf, False) == grammar.json_schema_grammar(SCHEMA)
    assert parsed(rf, True) == grammar.after_thinking(SCHEMA)


def test_tool_call_grammar_parses_and_follows_the_schema(tok, llt):
    """The grammar of tool_choice "required" / a named function (served end to end in
    tests/test_serve_tools.py): a qwen3_coder XML call the tool parser reads, with the schema's
    required parameters and typed values."""
    from mtpjax.serving.tool_parser import parse_tool_calls
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"},
                                         "days": {"type": "integer", "minimum": 1,
                                                  "maximum": 7}},
        "required": ["city", "days"]}}}, {"type": "function", "function": {"name": "noop"}}]
    text = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
            "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>")
    c = grammar.Constraint(llt, grammar.tool_call_grammar(tools), 4096)
    assert all(c.consume(t) is None for t in tok.encode(text)) and c.stopped
    _, calls = parse_tool_calls(text, tools)
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris", "days": 3}
    for bad in ("<tool_call>\n<function=get_weather>\n<parameter=days>\n",      # city missing
                "<tool_call>\n<function=get_weather>\n<parameter=city>\nP\n</parameter>\n"
                "<parameter=days>\n9",                                          # days > 7
                "<tool_call>\n<function=noop>\n"):                              # not named
        c = grammar.Constraint(llt, grammar.tool_call_grammar(tools, "get_weather"), 4096)
        assert any(c.consume(t) for t in tok.encode(bad)), bad
    with pytest.raises(ValueError, match="no tool named"):
        grammar.tool_call_grammar(tools, "nope")


def test_tool_call_grammar_string_constraints(tok, llt):
    """A string parameter's enum / const / maxLength bound its value (free text otherwise)."""
    from mtpjax.serving.tool_parser import parse_tool_calls
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"u": {"type": "string", "enum": ["c", "f"]},
                                         "s": {"type": "string", "maxLength": 3}},
        "required": ["u", "s"]}}}]
    g = grammar.tool_call_grammar(tools)
    text = ("<tool_call>\n<function=f>\n<parameter=u>\nc\n</parameter>\n<parameter=s>\na\nb"
            "\n</parameter>\n</function>\n</tool_call>")
    c = grammar.Constraint(llt, g, 4096)
    assert all(c.consume(t) is None for t in tok.encode(text)) and c.stopped
    assert json.loads(parse_tool_calls(text, tools)[1][0]["function"]["arguments"]) == \
        {"u": "c", "s": "a\nb"}
    for bad in ("<tool_call>\n<function=f>\n<parameter=u>\nk",
                "<tool_call>\n<function=f>\n<parameter=u>\nc\n</parameter>\n<parameter=s>\n"
                "abcd"):
        c = grammar.Constraint(llt, g, 4096)
        assert any(c.consume(t) for t in tok.encode(bad)), bad


@pytest.mark.parametrize("lo,hi", [(1, 3), (0, 5), (2, None)])
def test_tool_call_grammar_string_length_closes_anywhere_within_bounds(tok, llt, lo, hi):
    """A bounded string parameter may close at any length in [minLength, maxLength], not only
    at maxLength (a greedy lexer took the newline after a short value into the value), and
    the mask offers the closing tag as soon as the value is long enough."""
    bounds = {"minLength": lo} | ({} if hi is None else {"maxLength": hi})
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"s": {"type": "string", **bounds}},
        "required": ["s"]}}}]
    g = grammar.tool_call_grammar(tools)
    head = "<tool_call>\n<function=f>\n<parameter=s>\n"
    for n in range(0, (hi if hi is not None else lo + 4) + 3):
        text = head + "x" * n + "\n</parameter>\n</function>\n</tool_call>"
        c = grammar.Constraint(llt, g, 4096)
        ok = all(c.consume(t) is None for t in tok.encode(text)) and c.stopped
        assert ok == (lo <= n and (hi is None or n <= hi)), (n, lo, hi)
        if hi is None or n <= hi:       # the mask offers each token of the closing tag
            c = grammar.Constraint(llt, g, 4096)
            assert all(c.consume(t) is None for t in tok.encode(head + "x" * n))
            offered = True
            for t in tok.encode("\n</parameter>\n"):
                offered = offered and grammar.allowed(c.mask(), t) and c.consume(t) is None
            assert offered == (n >= lo), (n, lo, hi)


@pytest.mark.parametrize("which", ["json", "tool_call"])
def test_thinking_grammars_roll_back(tok, llt, which):
    """Speculative decoding rolls the matcher back after every step: the reasoning part of the
    thinking grammars must allow it (llguidance refuses to roll back a `stop=` lexeme)."""
    g = grammar.after_thinking(SCHEMA) if which == "json" else grammar.tool_call_grammar(
        [{"type": "function", "function": {"name": "f"}}], thinking=True)
    ids = tok.encode("a plan\n</think>\n\n")
    c = grammar.Constraint(llt, g, 4096)
    assert c.consume(ids[0]) is None
    masks = c.step_masks(ids[1:])          # advances through the drafts and rolls back
    assert all(grammar.allowed(masks[j], t) for j, t in enumerate(ids[1:]))
    assert all(c.consume(t) is None for t in ids[1:])


# ------------------------------------------- tool arguments as the schema says (issue 38)
def _call_text(name, **params):
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def _accepts(llt, tok, g, text):
    c = grammar.Constraint(llt, g, 4096)
    return all(c.consume(t) is None for t in tok.encode(text)) and c.accepting


WRITE = [{"type": "function", "function": {"name": "write_file", "parameters": {
    "type": "object", "properties": {"path": {"type": "string", "pattern": r"^[\w./-]+$"},
                                     "text": {"type": "string"}},
    "required": ["path", "text"], "additionalProperties": False}}}]
ANY_TEXT = ["<html>\n  <p>a < b && c > d</p>\n</html>\n", "List<Map<K, V>> xs;", "",
            "\n\nblank lines\n\n", "</function> and </think> are fine", "<parameter=path>"]


@pytest.mark.parametrize("mode", ["required", "named", "thinking", "auto_strict"])
def test_string_arguments_hold_any_text_in_every_mode(tok, llt, mode):
    """A string argument may hold any text ('<', tags, newlines), and parses back to exactly
    that text; only the closing tags it would end at are refused."""
    from mtpjax.serving.tool_parser import parse_tool_calls
    g = grammar.tool_call_grammar(WRITE, "write_file" if mode == "named" else None,
                                  thinking=mode == "thinking", auto=mode == "auto_strict")
    pre = "plan\n</think>\n\n" if mode == "thinking" else ""
    for value in ANY_TEXT:
        call = _call_text("write_file", path="a/b.html", text=value)
        assert _accepts(llt, tok, g, pre + call), value
        (got,) = parse_tool_calls(call, WRITE)[1]
        assert json.loads(got["function"]["arguments"]) == {"path": "a/b.html", "text": value}
    for value in ("a</parameter>b", "x</tool_call>"):
        assert not _accepts(llt, tok, g, pre + _call_text("write_file", path="a", text=value))


def test_string_argument_rolls_back(tok, llt):
    """Speculative decoding rolls the matcher back after every step: the value's suffix=
    lexeme allows it."""
    ids = tok.encode(_call_text("write_file", path="p", text="a <b>\nc"))
    c = grammar.Constraint(llt, grammar.tool_call_grammar(WRITE), 4096)
    for i in range(0, len(ids), 4):
        masks = c.step_masks(ids[i:i + 4])
        assert all(grammar.allowed(masks[j], t) for j, t in enumerate(ids[i:i + 4]))
        assert all(c.consume(t) is None for t in ids[i:i + 4])
    assert c.stopped


@pytest.mark.parametrize("schema, good, bad", [
    ({"type": "string", "pattern": "ab"}, ["ab", "xaby", "<ab>"], ["a", "ba"]),
    ({"type": "string", "pattern": "^a+$"}, ["a", "aaa"], ["ab", "ba", ""]),
    ({"type": "string", "pattern": "^v\\d"}, ["v1", "v2 <x>"], ["xv1"]),
    ({"type": "string", "pattern": "[0-9]{2}$", "maxLength": 4}, ["12", "a<12"], ["123a", "aa123"]),
    ({"anyOf": [{"type": "integer"}, {"type": "null"}]}, ["3", "null"], ['"s"', "x"]),
    ({"oneOf": [{"type": "integer"}, {"type": "boolean"}]}, ["3", "true"], ['"s"']),
    ({"type": "object", "properties": {"d": {"type": "string", "format": "date"}},
      "required": ["d"], "additionalProperties": False},
     ['{"d": "2024-01-31"}'], ['{"d": "soon"}', '{"d": "2024-01-31", "e": 1}']),
    ({"$ref": "#/$defs/pos"}, ["2"], ["-1"]),
], ids=["unanchored", "anchored", "start", "end_len", "anyOf", "oneOf", "format", "ref"])
def test_tool_call_grammar_enforces_schema_keywords(tok, llt, schema, good, bad):
    """pattern (JSON Schema's: unanchored unless ^ / $) on raw text; anyOf, oneOf, $ref (to
    the parameters' $defs), format and additionalProperties inside JSON values."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"v": schema}, "required": ["v"],
        "$defs": {"pos": {"type": "integer", "minimum": 0}}}}}]
    g = grammar.tool_call_grammar(tools)
    for v in good:
        assert _accepts(llt, tok, g, _call_text("f", v=v)), v
    for v in bad:
        assert not _accepts(llt, tok, g, _call_text("f", v=v)), v


def test_additional_properties_false_at_the_parameters_level(tok, llt):
    g = grammar.tool_call_grammar(WRITE)
    extra = _call_text("write_file", path="p", text="t", mode="w")
    assert not _accepts(llt, tok, g, extra)
    assert not _accepts(llt, tok, g, _call_text("write_file", path="a b", text="t"))  # pattern


@pytest.mark.parametrize("params, match", [
    ({"properties": {"d": {"type": "string", "format": "email"}}},
     "parameter 'd': keyword 'format' 'email'"),
    ({"properties": {"s": {"type": "string", "anyOf": [{"maxLength": 2}]}}},
     "parameter 's': keyword 'anyOf'"),
    ({"properties": {"xs": {"type": "array", "uniqueItems": True}}},
     "parameter 'xs': keyword 'uniqueItems'"),
    ({"properties": {"o": {"type": "object", "properties": {"a": {"maxLenght": 3}}}}},
     "parameter 'o': keyword 'maxLenght' at .properties.a"),
    ({"properties": {"n": {"type": "integer", "not": {"const": 3}}}},
     "parameter 'n': keyword 'not'"),
    ({"properties": {"s": {"type": "string", "pattern": "a|^b"}}}, "parameter 's': 'pattern'"),
    ({"properties": {"s": {"type": "string", "pattern": "(?<=a)b"}}}, "look-around"),
    ({"properties": {"s": {"enum": ["</parameter>"]}}}, "closing tag"),
    ({"properties": {"r": {"$ref": "#/$defs/d"}}, "$defs": {"d": {"type": "integer",
                                                                  "exclusiveMax": 3}}},
     "parameter 'r': keyword 'exclusiveMax' at .$defs.d"),
    ({"properties": {}, "minProperties": 1}, "parameters keyword 'minProperties'"),
    ({"properties": {}, "anyOf": [{"required": ["a"]}]}, "parameters keyword 'anyOf'"),
    ({"properties": {"a": {}}, "required": ["b"]}, "'required' names 'b'"),
], ids=lambda x: x if isinstance(x, str) and len(x) < 40 else None)
def test_tool_call_grammar_refuses_a_keyword_it_cannot_enforce_by_name(params, match):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", **params}}}]
    with pytest.raises(ValueError, match="tool 'f'") as e:
        grammar.tool_call_grammar(tools)
    assert match in str(e.value), str(e.value)


def test_auto_grammar_free_text_or_text_then_calls(tok, llt):
    """tool_choice "auto" with a strict tool: free text, or free text and then calls that
    follow their schemas; "<tool_call>" only as a call's start (where the parser reads one)."""
    g = grammar.tool_call_grammar(WRITE, auto=True, parallel=True)
    call = _call_text("write_file", path="p", text="<b>")
    for text in ("", "Just text, a < b.", "Writing it.\n\n" + call, call + "\n" + call):
        assert _accepts(llt, tok, g, text), text
    for text in ("see <tool_call> here", "x " + call + " and more",
                 _call_text("write_file", path="p q", text="t"),
                 _call_text("write_file", text="t")):
        assert not _accepts(llt, tok, g, text), text


def test_response_format_with_tools_is_that_json_or_calls(tok, llt):
    g = grammar.tool_call_grammar(WRITE, auto=True, content=SCHEMA, thinking=True)
    js = '{"name": "x", "age": 3, "ok": true, "tags": ["a"]}'
    pre = "hm\n</think>\n\n"
    assert _accepts(llt, tok, g, pre + js)
    assert _accepts(llt, tok, g, pre + _call_text("write_file", path="p", text="t"))
    for text in ("plain", '{"name": 1}', "ok " + _call_text("write_file", path="p", text="t")):
        assert not _accepts(llt, tok, g, pre + text), text


FORMAT_SAMPLES = {
    "date": ["2024-01-31", "2024-02-29", "2023-02-29", "2024-02-30", "2024-04-31", "2024-13-01",
             "2024-1-01", "x"],
    "time": ["12:30:00Z", "12:30:00+02:00", "12:30:00.5z", "23:59:60Z", "25:00:00Z",
             "12:30:00", "12:30:00.Z"],
    "date-time": ["2024-01-31T12:30:00Z", "2024-01-31t12:30:00.123+05:30",
                  "2024-01-31 12:30:00Z", "2024-01-31T12:30:00"],
    "uuid": ["123e4567-e89b-12d3-a456-426614174000", "123E4567-E89B-12D3-A456-426614174000",
             "123e4567e89b12d3a456426614174000", "g23e4567-e89b-12d3-a456-426614174000"],
    "ipv4": ["1.2.3.4", "255.255.255.255", "256.1.1.1", "01.2.3.4", "1.2.3"],
}


@pytest.mark.parametrize("fmt", sorted(grammar.TEXT_FORMATS))
def test_raw_text_formats_agree_with_llguidance_json_formats(tok, llt, fmt):
    """A string parameter's `format` (raw text, grammar.TEXT_FORMATS) allows what llguidance's
    JSON-mode format allows, on each sample; and each format has accepted and refused ones."""
    json_g = grammar.json_schema_grammar({"type": "string", "format": fmt})
    call_g = grammar.tool_call_grammar([{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {
            "v": {"type": "string", "format": fmt}}, "required": ["v"]}}}])
    got = {v: _accepts(llt, tok, call_g, _call_text("f", v=v)) for v in FORMAT_SAMPLES[fmt]}
    assert got == {v: _accepts(llt, tok, json_g, json.dumps(v)) for v in FORMAT_SAMPLES[fmt]}
    assert any(got.values()) and not all(got.values())


def test_json_arguments_parse_back_even_holding_a_closing_tag(tok, llt):
    """A JSON argument's strings may hold `</parameter>` and `</tool_call>` (llguidance's JSON
    allows them): the parser ends a JSON value where its JSON ends and a call at the first
    `</tool_call>` where it parses, so the call parses back to what the grammar allowed (the
    parser took the first of each and lost the call)."""
    from mtpjax.serving.tool_parser import parse_tool_calls
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"o": {"type": "object", "properties": {
            "html": {"type": "string"}}, "required": ["html"], "additionalProperties": False},
            "s": {"type": "string"}}, "required": ["o", "s"]}}}]
    g = grammar.tool_call_grammar(tools)
    value = {"html": "<p>a</parameter>\n</tool_call></p>"}
    text = _call_text("f", o=json.dumps(value), s="x")
    assert _accepts(llt, tok, g, text)
    (call,) = parse_tool_calls(text, tools)[1]
    assert json.loads(call["function"]["arguments"]) == {"o": value, "s": "x"}


@pytest.mark.parametrize("hi", [100, 5000, 100_000])
def test_a_large_max_length_closes_at_any_length(tok, llt, hi):
    """A string parameter with a large maxLength (and a pattern) closes after a short value
    too: the closing tags are kept out of the value by a written-out automaton
    (grammar._avoiding), not by a negation, which llguidance's lexer gave up on here ("too
    many expressions constructed") for any bound above a few dozen."""
    for schema in ({"type": "string", "maxLength": hi},
                   {"type": "string", "maxLength": hi, "pattern": "^[^#]*$"}):
        g = grammar.tool_call_grammar([{"type": "function", "function": {
            "name": "f", "parameters": {"type": "object", "properties": {"v": schema}}}}])
        for n in (0, 5, 300):
            value = ("a <b>\n" * 60)[:n]
            assert _accepts(llt, tok, g, _call_text("f", v=value)) == (n <= hi), (n, schema)
