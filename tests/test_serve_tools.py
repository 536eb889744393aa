"""Tool calls in chat responses (mtpjax/serving/app.py on tool_parser): the tiny model's text is
random, so fixed generated texts go through the app's response builders -- the non-streamed
body (`final_body`) and the SSE events (`chat_chunks`) -- and must read as OpenAI's client
types, the stream reassembling to the non-streamed message.

tool_choice "required" and a named function constrain decoding (grammar.tool_call_grammar), so
there even the tiny model's reply is a call: end to end on the bundled checkpoint (the app on a
speculative engine, FastAPI's TestClient), the reply is a parsed call, finish_reason
"tool_calls", streamed or not, whose arguments follow the function's schema; the speculative
engine's call is the plain engine's, token for token. Parallel tool calls: "required" allows
one or more calls (parallel_tool_calls, OpenAI's default), each parsed into its own tool call
(indexes 0..n-1 when streamed); parallel_tool_calls false and a named function allow one.
"""

import asyncio
import dataclasses
import json
import os

import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from mtpjax.serving.app import chat_chunks, final_body
from mtpjax.serving.parsing import ParsedRequest
from mtpjax.serving.online import Delta
from mtpjax.serving.tool_parser import parse_tool_calls

from json_schema_check import matches

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"},
                                     "days": {"type": "integer"}}}}}]
CALL = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>")
HEAD = {"id": "chatcmpl-test", "created": 0, "model": "tiny"}


@dataclasses.dataclass
class Output:
    text: str
    finish_reason: str
    prompt_tokens: int = 5
    completion_tokens: int = 7
    error: str | None = None
    cached_tokens: int = 0


class Handle:
    """What chat_chunks reads of a RequestHandle: Deltas in pieces, then the output."""

    def __init__(self, text, finish, size):
        self.output = Output(text, finish)
        self.pieces = [text[i:i + size] for i in range(0, len(text), size)]

    async def __aiter__(self):
        for p in self.pieces:
            yield Delta((0,), p)


def request(thinking, tools, stream=False, parallel=True, forced=False, name=None):
    return ParsedRequest([1], None, (), stream, False, thinking, True, tools,
                         parallel_tool_calls=parallel, forced_call=forced, forced_name=name)


def body(text, thinking=False, tools=TOOLS, finish="stop", parallel=True, forced=False,
         name=None):
    b = final_body("chat", Output(text, finish), request(thinking, tools, parallel=parallel,
                                                         forced=forced, name=name), HEAD)
    ChatCompletion.model_validate(b)
    return b


def stream(text, thinking=False, tools=TOOLS, finish="stop", size=3, parallel=True,
           forced=False, name=None):
    async def collect():
        return [e async for e in chat_chunks(Handle(text, finish, size),
                                             request(thinking, tools, True, parallel, forced,
                                                     name), HEAD)]
    events = asyncio.run(collect())
    assert events[-1] == "data: [DONE]\n\n"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    for c in chunks:
        ChatCompletionChunk.model_validate(c)
    return chunks


def reassemble(chunks):
    """The message and finish_reason a client builds from the chunks."""
    msg, calls, finish = {"content": "", "reasoning_content": ""}, {}, None
    for c in chunks:
        (choice,) = c["choices"]
        d = choice["delta"]
        msg["content"] += d.get("content") or ""
        msg["reasoning_content"] += d.get("reasoning_content") or ""
        for t in d.get("tool_calls", []):
            if "id" in t:
                calls[t["index"]] = {"id": t["id"], "type": t["type"],
                                     "function": {"name": t["function"]["name"],
                                                  "arguments": ""}}
            calls[t["index"]]["function"]["arguments"] += t["function"]["arguments"]
        finish = choice["finish_reason"] or finish
    msg["tool_calls"] = [calls[i] for i in sorted(calls)]
    return msg, finish


def without_ids(calls):
    return [c["function"] for c in calls]


@pytest.mark.parametrize("thinking", [False, True])
def test_a_call_after_text_and_reasoning(thinking):
    text = ("I should look it up.\n</think>\n\n" if thinking else "") + "Checking.\n\n" + CALL
    b = body(text, thinking)
    (choice,) = b["choices"]
    msg = choice["message"]
    assert choice["finish_reason"] == "tool_calls"
    # the reasoning split keeps the newlines after </think> (as vLLM's qwen3 parser); the
    # tool parser drops only the whitespace next to a call
    assert msg["content"] == ("\n\n" if thinking else "") + "Checking."
    assert msg.get("reasoning_content") == ("I should look it up.\n" if thinking else None)
    (call,) = msg["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Oslo", "days": 3}
    for size in (1, 3, 1000):
        got, finish = reassemble(stream(text, thinking, size=size))
        assert finish == "tool_calls"
        assert got["content"] == msg["content"]
        assert got["reasoning_content"] == (msg.get("reasoning_content") or "")
        assert without_ids(got["tool_calls"]) == without_ids(msg["tool_calls"])


def test_parallel_calls_only_content_is_null():
    text = CALL + "\n" + CALL.replace("Oslo", "Bergen")
    msg = body(text)["choices"][0]["message"]
    assert msg["content"] is None
    assert [json.loads(c["function"]["arguments"])["city"] for c in msg["tool_calls"]] == \
        ["Oslo", "Bergen"]
    got, finish = reassemble(stream(text, size=2))
    assert finish == "tool_calls" and got["content"] == ""
    assert without_ids(got["tool_calls"]) == without_ids(msg["tool_calls"])
    indexes = [t["index"] for c in stream(text, size=2) for t in
               c["choices"][0]["delta"].get("tool_calls", [])]
    assert indexes == [0, 0, 1, 1]


def test_parallel_tool_calls_false_returns_the_first_call():
    text = CALL + "\n" + CALL.replace("Oslo", "Bergen")
    (call,) = body(text, parallel=False)["choices"][0]["message"]["tool_calls"]
    assert json.loads(call["function"]["arguments"])["city"] == "Oslo"
    got, finish = reassemble(stream(text, size=2, parallel=False))
    assert finish == "tool_calls" and without_ids(got["tool_calls"]) == [call["function"]]


def test_no_call_unclosed_call_and_no_tools_are_plain_content():
    for text, tools, finish in [("Just words.", TOOLS, "stop"),
                                ("Hm " + CALL[:40], TOOLS, "length"),
                                (CALL, None, "stop")]:
        b = body(text, tools=tools, finish=finish)
        msg = b["choices"][0]["message"]
        assert msg["content"] == text and "tool_calls" not in msg
        assert b["choices"][0]["finish_reason"] == finish
        got, got_finish = reassemble(stream(text, tools=tools, finish=finish))
        assert (got["content"], got["tool_calls"], got_finish) == (text, [], finish)


@pytest.mark.parametrize("thinking", [False, True])
@pytest.mark.parametrize("cut, want", [
    (96, {"city": "Oslo", "days": 3}), (60, {"city": "Oslo"}), (55, {"city": "Osl"}),
    (50, {}), (25, {}), (14, {})], ids=["in_days_tag", "in_city_tag", "in_city", "in_param",
                                       "in_name", "in_function_tag"])
def test_a_forced_call_cut_off_by_max_tokens_is_a_call_with_finish_length(thinking, cut, want):
    """tool_choice "required" / named, output cut by max_tokens: tool_calls with the arguments
    written so far, finish_reason "length", no markup in the content, streamed and not.
    (Today's code returned the XML as content, tool_calls null.)"""
    text = ("plan\n</think>\n\n" if thinking else "") + CALL[:cut]
    for name in (None, "get_weather"):
        b = body(text, thinking, finish="length", forced=True, name=name)
        (choice,) = b["choices"]
        msg = choice["message"]
        assert choice["finish_reason"] == "length"
        assert msg["content"] in (None, "\n\n"), msg       # thinking: the blank line
        (call,) = msg["tool_calls"]
        assert call["function"]["name"] == "get_weather"
        assert json.loads(call["function"]["arguments"]) == want
        for size in (1, 4, 1000):
            got, finish = reassemble(stream(text, thinking, finish="length", size=size,
                                            forced=True, name=name))
            assert finish == "length" and got["content"] == (msg["content"] or "")
            assert without_ids(got["tool_calls"]) == without_ids(msg["tool_calls"])


def test_a_complete_forced_call_then_cut_drops_the_partial_marker():
    text = CALL + "\n<tool_"
    b = body(text, finish="length", forced=True)
    assert b["choices"][0]["finish_reason"] == "length"
    assert b["choices"][0]["message"]["content"] is None
    got, finish = reassemble(stream(text, finish="length", size=2, forced=True))
    assert (got["content"], finish) == ("", "length") and len(got["tool_calls"]) == 1


# ------------------------------------------------- tool_choice "required" / named, end to end
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CKPT = os.path.join(REPO, "checkpoints", "tiny")
# The tools' system turn is ~320 tokens: a 512-token context leaves room for the call.
ENGINE = dict(max_lanes=2, max_seq_len=512, prefill_chunk=64, prefill_buckets=[64])
K = 3
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 20},
    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}
FORCED_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
                {"type": "function", "function": {"name": "noop", "description": "Nothing."}}]
SCHEMAS = {t["function"]["name"]: t["function"].get("parameters", {"type": "object"})
           for t in FORCED_TOOLS}
_ENGINES = {}


def test_the_validator_refuses_what_the_schema_does():
    assert matches({"city": "Oslo", "days": 3, "unit": "celsius"}, WEATHER)
    for bad in ({"city": "Oslo"}, {"city": "Oslo", "days": 9}, {"city": "x" * 21, "days": 1},
                {"city": "Oslo", "days": 1, "unit": "kelvin"}, {"city": 1, "days": 1},
                {"city": "Oslo", "days": 1, "wind": True}, {"city": "Oslo", "days": True}):
        assert not matches(bad, WEATHER), bad


def engine(k):
    import mtpjax
    if k not in _ENGINES:
        _ENGINES[k] = mtpjax.Engine.from_checkpoint(CKPT, num_speculative_tokens=k, **ENGINE)
    return _ENGINES[k]


def test_speculative_forced_call_equals_plain():
    """One seeded "required" request: the K-draft engine's tokens are the plain engine's. (Runs
    before the `served` fixture opens the K-draft engine's online session.)"""
    from mtpjax.serving.chat_template import load_chat_template
    from mtpjax.serving.parsing import ServerLimits, parse_chat
    from mtpjax.text import Tokenizer
    tok, template = Tokenizer.from_checkpoint(CKPT), load_chat_template(CKPT)
    r = parse_chat(forced_body("required", temperature=1.0, seed=11, parallel_tool_calls=False), ServerLimits(
        "tiny", 4096, ENGINE["max_seq_len"]), tok, template)
    (spec,) = engine(K).generate([r.prompt_ids], r.params)
    (plain,) = engine(0).generate([r.prompt_ids], r.params)
    assert spec.token_ids == plain.token_ids and spec.finish_reason == "stop"
    assert spec.stats.drafted_tokens > 0
    _, calls = parse_tool_calls(tok.decode(spec.token_ids), FORCED_TOOLS)
    check_call(calls[0])


@pytest.mark.parametrize("mode", ["strict", "response_format"])
def test_speculative_auto_grammar_equals_plain(mode):
    """"auto" with a strict tool / with a response_format decodes under a grammar (free text or
    calls; the JSON or calls): the K-draft engine's tokens are the plain engine's, and the
    reply parses (a call following its schema, or the JSON). (Runs before `served`.)"""
    from mtpjax.serving.chat_template import load_chat_template
    from mtpjax.serving.parsing import ServerLimits, parse_chat
    from mtpjax.text import Tokenizer
    tok, template = Tokenizer.from_checkpoint(CKPT), load_chat_template(CKPT)
    tools = [FORCED_TOOLS[0] | {"function": FORCED_TOOLS[0]["function"] | {"strict": True}},
             FORCED_TOOLS[1]]
    extra = {"tools": tools} if mode == "strict" else {"response_format": {
        "type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER}}}
    body = forced_body("auto", temperature=1.0, seed=5, max_tokens=60) | extra
    r = parse_chat(body, ServerLimits("tiny", 4096, ENGINE["max_seq_len"]), tok, template)
    assert r.params.grammar is not None
    (spec,) = engine(K).generate([r.prompt_ids], r.params)
    (plain,) = engine(0).generate([r.prompt_ids], r.params)
    assert spec.token_ids == plain.token_ids and spec.error is None
    assert spec.stats.drafted_tokens > 0
    text = tok.decode(spec.token_ids)
    content, calls = parse_tool_calls(text, tools)
    for call in calls:
        check_call(call)
    if mode == "response_format" and not calls and spec.finish_reason == "stop":
        assert matches(json.loads(content), WEATHER)


def test_parallel_call_grammar_allows_several_calls_that_parse():
    """tool_call_grammar(parallel=True): one or more calls, newline-separated as the template
    writes them; each parses into a tool call whose arguments follow its schema. Without
    parallel, the grammar ends after the first call."""
    from mtpjax import grammar
    from mtpjax.text import Tokenizer
    tok = Tokenizer.from_checkpoint(CKPT)
    llt = grammar.make_tokenizer(CKPT, 4096, tok.stop_ids())
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "days": {
        "type": "integer", "minimum": 1, "maximum": 7}}, "required": ["city", "days"]}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": schema}},
             FORCED_TOOLS[1]]
    weather = ("<tool_call>\n<function=get_weather>\n<parameter=city>\n{}\n</parameter>\n"
               "<parameter=days>\n{}\n</parameter>\n</function>\n</tool_call>")
    noop = "<tool_call>\n<function=noop>\n</function>\n</tool_call>"
    text = "\n".join([weather.format("Oslo", 2), noop, weather.format("Rome", 7)])
    c = grammar.Constraint(llt, grammar.tool_call_grammar(tools, parallel=True), 4096)
    assert all(c.consume(t) is None for t in tok.encode(text)) and c.accepting
    content, calls = parse_tool_calls(text, tools)
    args = [(x["function"]["name"], json.loads(x["function"]["arguments"])) for x in calls]
    assert content is None and args == [("get_weather", {"city": "Oslo", "days": 2}),
                                        ("noop", {}), ("get_weather", {"city": "Rome", "days": 7})]
    assert all(matches(a, schema if n == "get_weather" else {}) for n, a in args)
    one = grammar.Constraint(llt, grammar.tool_call_grammar(tools), 4096)
    assert any(one.consume(t) for t in tok.encode(text))      # a second call is refused
    bad = grammar.Constraint(llt, grammar.tool_call_grammar(tools, parallel=True), 4096)
    assert any(bad.consume(t) for t in tok.encode(weather.format("Oslo", 2) + "\nhi"))


def test_engine_under_a_grammar_forcing_several_calls():
    """The engine decoding under the parallel grammar with the stop tokens biased away (so the
    grammar's only way on after a call is another call): the reply parses into two or more
    calls, each following its function's schema; the K-draft engine's tokens are the plain
    engine's. (Runs before the `served` fixture opens the K-draft engine's session.)"""
    from mtpjax import grammar
    from mtpjax.sampling import SamplingParams
    from mtpjax.text import Tokenizer
    tok = Tokenizer.from_checkpoint(CKPT)
    sp = SamplingParams(max_new_tokens=300, grammar=grammar.tool_call_grammar(
        FORCED_TOOLS, parallel=True), logit_bias=tuple((t, -100.0) for t in tok.stop_ids()))
    prompt = tok.encode("# Weather in Oslo and Rome\n")   # short: room for several calls
    (spec,) = engine(K).generate([prompt], sp)
    (plain,) = engine(0).generate([prompt], sp)
    assert spec.token_ids == plain.token_ids
    _, calls = parse_tool_calls(tok.decode(spec.token_ids), FORCED_TOOLS)
    assert len(calls) >= 2, tok.decode(spec.token_ids)
    for call in calls:
        check_call(call)


@pytest.fixture(scope="module")
def served():
    """(TestClient of the app on the K-draft engine, its tokenizer, its chat template)."""
    from fastapi.testclient import TestClient
    from mtpjax.serving.app import Server, build_app
    from mtpjax.serving.chat_template import load_chat_template
    from mtpjax.serving.online import OnlineEngine
    from mtpjax.serving.parsing import ServerLimits
    from mtpjax.text import Tokenizer
    tok, template = Tokenizer.from_checkpoint(CKPT), load_chat_template(CKPT)
    online = OnlineEngine(engine(K), tok).start()
    try:
        yield TestClient(build_app(Server(online, tok, ServerLimits("tiny", 4096,
                                                                    ENGINE["max_seq_len"]),
                                          template))), tok, template
    finally:
        online.shutdown()


def forced_body(choice, **extra):
    return {"model": "tiny", "messages": [{"role": "user", "content": "Weather in Oslo?"}],
            "tools": FORCED_TOOLS, "tool_choice": choice, "max_tokens": 110, "seed": 3,
            "chat_template_kwargs": {"enable_thinking": False}, **extra}


def post(http, body):
    r = http.post("/v1/chat/completions", json=body)
    if not body.get("stream"):
        return r.status_code, r.json()
    assert r.status_code == 200, r.text
    events = [e for e in r.text.split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    for c in chunks:
        ChatCompletionChunk.model_validate(c)
    return 200, chunks


def check_call(call, name=None):
    fn = call["function"]
    assert fn["name"] in SCHEMAS and (name is None or fn["name"] == name), fn
    args = json.loads(fn["arguments"])
    assert matches(args, SCHEMAS[fn["name"]]), args
    return fn["name"], args


NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.mark.parametrize("choice, parallel", [
    ("required", True), ("required", False), (NAMED, True),
    ({"type": "function", "function": {"name": "noop"}}, True)],
                         ids=["required", "required_single", "named", "named_noop"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_forced_call_is_a_parsed_call_following_the_schema(served, choice, parallel,
                                                          temperature):
    """One call ("required" with parallel_tool_calls false, a named function), or one or more
    ("required", parallel by default): the tiny model rarely stops after a call, so there a
    further call may be cut short by max_tokens: it comes back as a call with the arguments
    so far and finish_reason "length", never as markup in the content."""
    http = served[0]
    several = choice == "required" and parallel
    kw = dict(temperature=temperature, parallel_tool_calls=parallel)
    status, b = post(http, forced_body(choice, **kw))
    assert status == 200, b
    ChatCompletion.model_validate(b)
    (c,) = b["choices"]
    content, calls = c["message"]["content"], c["message"]["tool_calls"]
    cut = c["finish_reason"] == "length"
    assert c["finish_reason"] == "tool_calls" or (several and cut), c
    assert content is None and (several or len(calls) == 1), c
    for i, call in enumerate(calls):
        if cut and i == len(calls) - 1:          # the call max_tokens cut: its name is right
            assert call["function"]["name"] in SCHEMAS
            continue
        name, args = check_call(call, None if choice == "required" else
                                choice["function"]["name"])
        if name == "noop":
            assert args == {}
    _, chunks = post(http, forced_body(choice, stream=True, **kw))
    msg, finish = reassemble(chunks)
    assert finish == c["finish_reason"] and msg["content"] == ""
    assert without_ids(msg["tool_calls"]) == without_ids(calls)
    indexes = [t["index"] for ch in chunks for t in ch["choices"][0]["delta"].get(
        "tool_calls", []) if "id" in t]
    assert indexes == list(range(len(calls)))


@pytest.mark.parametrize("fields, param, match", [
    ({"tool_choice": "required"}, "tool_choice", "needs 'tools'"),
    ({"tool_choice": NAMED}, "tool_choice", "needs 'tools'"),
    ({"tools": [], "tool_choice": "required"}, "tool_choice", "needs 'tools'"),
    ({"tools": FORCED_TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "not one of 'tools'"),
    ({"tools": FORCED_TOOLS, "tool_choice": {"type": "function"}}, "tool_choice", "function"),
    ({"tools": FORCED_TOOLS, "tool_choice": "sometimes"}, "tool_choice", "required"),
    ({"tools": FORCED_TOOLS, "tool_choice": "required", "response_format": {
        "type": "json_object"}}, "response_format", "tool_choice"),
    ({"tools": FORCED_TOOLS, "tool_choice": NAMED, "response_format": {
        "type": "json_schema", "json_schema": {"name": "r", "schema": {}}}},
     "response_format", "one grammar per request"),
])
def test_forced_call_errors_are_a_400_naming_the_field(served, fields, param, match):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], **fields}
    status, b = post(served[0], body)
    assert status == 400, b
    err = b["error"]
    assert err["param"] == param and f"'{param}'" in err["message"], err
    assert match in err["message"], err


def test_forced_call_grammar_follows_thinking(served):
    """The parsed request's grammar is tool_call_grammar(tools, name, thinking) and the tools
    are rendered and parsed as with "auto"."""
    from mtpjax import grammar
    from mtpjax.serving.parsing import ServerLimits, parse_chat
    _, tok, template = served
    limits = ServerLimits("tiny", 4096, ENGINE["max_seq_len"])
    auto = parse_chat(forced_body("auto"), limits, tok, template)
    assert auto.params.grammar is None
    for choice, name in (("required", None), (NAMED, "get_weather")):
        for thinking in (False, True):
            r = parse_chat(forced_body(choice, chat_template_kwargs={
                "enable_thinking": thinking}), limits, tok, template)
            assert r.params.grammar == grammar.tool_call_grammar(
                FORCED_TOOLS, name, thinking=thinking, parallel=name is None)
            assert r.tools == FORCED_TOOLS
            if not thinking:
                assert r.prompt_ids == auto.prompt_ids
    # parallel_tool_calls false: "required" is one call; a named function is one call anyway
    for choice, name in (("required", None), (NAMED, "get_weather")):
        for parallel in (False, True):
            r = parse_chat(forced_body(choice, parallel_tool_calls=parallel), limits, tok,
                           template)
            assert r.params.grammar == grammar.tool_call_grammar(
                FORCED_TOOLS, name, parallel=parallel and name is None)
            assert r.parallel_tool_calls == (parallel and name is None)


# ------------------------------------------------- schemas, strict, response_format (issue 38)
def _parse(**fields):
    from mtpjax.serving.chat_template import load_chat_template
    from mtpjax.serving.parsing import ServerLimits, parse_chat
    from mtpjax.text import Tokenizer
    tok, template = Tokenizer.from_checkpoint(CKPT), load_chat_template(CKPT)
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
            "chat_template_kwargs": {"enable_thinking": False}, **fields}
    return parse_chat(body, ServerLimits("tiny", 4096, ENGINE["max_seq_len"]), tok, template)


def _tool(params, strict=None, name="f"):
    fn = {"name": name, "parameters": {"type": "object", **params}}
    return {"type": "function", "function": fn | ({} if strict is None else {"strict": strict})}


@pytest.mark.parametrize("params, match", [
    ({"properties": {"to": {"type": "string", "format": "email"}}},
     "tool 'f', parameter 'to': keyword 'format' 'email'"),
    ({"properties": {"xs": {"type": "array", "contains": {"type": "integer"}}}},
     "tool 'f', parameter 'xs': keyword 'contains'"),
    ({"properties": {"o": {"type": "object", "propertyNames": {"maxLength": 2}}}},
     "tool 'f', parameter 'o': keyword 'propertyNames'"),
    ({"properties": {}, "patternProperties": {"^x": {}}}, "parameters keyword 'patternProperties'"),
])
@pytest.mark.parametrize("choice, strict", [("required", None), ("auto", True)])
def test_a_keyword_no_grammar_enforces_is_a_400_naming_it(params, match, choice, strict):
    """Forced calls and strict tools: a schema keyword the call's grammar cannot enforce is a
    400 on 'tools' naming the tool, the parameter and the keyword (today: silently dropped)."""
    from mtpjax.serving.protocol import APIError
    with pytest.raises(APIError) as e:
        _parse(tools=[_tool(params, strict)], tool_choice=choice)
    assert e.value.param == "tools" and match in e.value.message, e.value.message
    # "auto" without strict constrains nothing: the schema is the prompt's, and no 400
    assert _parse(tools=[_tool(params)], tool_choice="auto").params.grammar is None


def test_strict_under_auto_constrains_the_calls():
    """tools[].function.strict true under "auto": the reply is free text or text and calls
    whose arguments follow the schemas (grammar.tool_call_grammar(auto=True)); strict false or
    absent leaves "auto" free."""
    from mtpjax import grammar
    strict = [FORCED_TOOLS[0] | {"function": FORCED_TOOLS[0]["function"] | {"strict": True}},
              FORCED_TOOLS[1]]
    r = _parse(tools=strict)
    assert r.params.grammar == grammar.tool_call_grammar(r.tools, parallel=True, auto=True)
    assert not r.forced_call
    assert _parse(tools=FORCED_TOOLS).params.grammar is None
    loose = [FORCED_TOOLS[0] | {"function": FORCED_TOOLS[0]["function"] | {"strict": False}}]
    assert _parse(tools=loose).params.grammar is None


def test_response_format_with_tools_allows_the_call():
    """response_format with tools under "auto": the reply is the JSON or tool calls (today a
    call was impossible); with "none" it is the JSON alone; forced: a 400 naming it."""
    from mtpjax import grammar
    from mtpjax.serving.protocol import APIError
    rf = {"type": "json_schema", "json_schema": {"name": "r", "schema": WEATHER}}
    r = _parse(tools=FORCED_TOOLS, response_format=rf)
    assert r.params.grammar == grammar.tool_call_grammar(r.tools, parallel=True, auto=True,
                                                         content=WEATHER)
    assert _parse(tools=FORCED_TOOLS, response_format=rf, tool_choice="none").params.grammar \
        == grammar.json_schema_grammar(WEATHER)
    with pytest.raises(APIError) as e:
        _parse(tools=FORCED_TOOLS, response_format=rf, tool_choice="required")
    assert e.value.param == "response_format" and "tool_choice" in e.value.message
    bad = {"type": "json_schema", "json_schema": {"name": "r", "schema": {"type": "objectx"}}}
    with pytest.raises(APIError) as e:
        _parse(tools=FORCED_TOOLS, response_format=bad)
    assert e.value.param == "response_format"


def test_served_forced_call_cut_by_max_tokens(served):
    """End to end: a forced call that max_tokens cuts is tool_calls with finish "length", its
    content free of markup, streamed the same."""
    http = served[0]
    for choice in ("required", NAMED):
        status, b = post(http, forced_body(choice, max_tokens=12, parallel_tool_calls=False))
        assert status == 200, b
        (c,) = b["choices"]
        assert c["finish_reason"] == "length" and c["message"]["content"] is None, c
        (call,) = c["message"]["tool_calls"]
        assert call["function"]["name"] == ("get_weather" if choice == NAMED else
                                             call["function"]["name"]) and \
            call["function"]["name"] in SCHEMAS
        assert isinstance(json.loads(call["function"]["arguments"]), dict)
        _, chunks = post(http, forced_body(choice, max_tokens=12, parallel_tool_calls=False,
                                           stream=True))
        msg, finish = reassemble(chunks)
        assert finish == "length" and msg["content"] == ""
        assert without_ids(msg["tool_calls"]) == without_ids(c["message"]["tool_calls"])


def test_served_response_format_with_tools(served):
    """"auto" + response_format + tools: the reply is a parsed call or the schema's JSON (or,
    cut by max_tokens, the beginning of either)."""
    http = served[0]
    rf = {"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER}}
    for temperature in (0.0, 1.0):
        status, b = post(http, forced_body("auto", response_format=rf, max_tokens=110,
                                           temperature=temperature))
        assert status == 200, b
        (c,) = b["choices"]
        if c["message"].get("tool_calls"):
            check_call(c["message"]["tool_calls"][0])
        elif c["finish_reason"] == "stop":
            assert matches(json.loads(c["message"]["content"]), WEATHER)
        else:
            assert c["message"]["content"].startswith(("{", "<tool_call>")), c
