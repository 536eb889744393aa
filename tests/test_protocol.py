"""Request parsing (mtpjax/serving/protocol.py, parsing.py) on the tiny checkpoint's tokenizer
and chat template, without an engine: every field either works or gets a 400 that names it
(unknown and unimplemented fields included), the no-op values clients send are accepted, and
the defaults, the context checks and the chat rendering are what the server runs."""

import os

import pytest

from mtpjax.serving.chat_template import ChatTemplate, load_chat_template
from mtpjax.serving.parsing import ServerLimits, parse_chat, parse_completion
from mtpjax.serving.protocol import IGNORED, NOT_SUPPORTED, APIError, ChatCompletionRequest, \
    CompletionRequest
from mtpjax.text import Tokenizer, apply_chat_template

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CKPT = os.path.join(REPO, "checkpoints", "tiny")
LIMITS = ServerLimits("tiny", vocab_size=300, max_seq_len=128)
MSGS = [{"role": "user", "content": "Hello"}]


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_checkpoint(CKPT)


@pytest.fixture(scope="module")
def template():
    return load_chat_template(CKPT)


def chat(tok, template, **fields):
    return parse_chat({"model": "tiny", "messages": MSGS, **fields}, LIMITS, tok, template)


def completion(tok, **fields):
    return parse_completion({"model": "tiny", "prompt": "def f(x):", **fields}, LIMITS, tok)


def refused(fn, param, status=400, match=None):
    with pytest.raises(APIError) as e:
        fn()
    assert e.value.status == status and e.value.param == param, e.value
    assert set(e.value.body()["error"]) == {"message", "type", "param", "code"}
    if match is not None:
        assert match in e.value.message, e.value.message
    return e.value


# ------------------------------------------------------------------------------ what works
def test_chat_defaults_and_fields(tok, template):
    r = chat(tok, template)
    assert r.prompt_ids == tok.encode(apply_chat_template(MSGS, True, True))
    p = r.params
    assert (p.temperature, p.top_p, p.top_k) == (1.0, 1.0, 0)
    assert p.max_new_tokens == LIMITS.max_seq_len - len(r.prompt_ids)   # the rest of the context
    assert set(p.stop_token_ids) == set(tok.stop_ids()) and 0 <= p.seed < 2 ** 32
    assert (r.stop, r.stream, r.include_usage, r.enable_thinking, r.skip_special_tokens) == \
        ((), False, False, True, True)
    r = chat(tok, template, temperature=0, top_p=0.5, top_k=-1, seed=7, max_tokens=5,
             stop="\n", stream=True, stream_options={"include_usage": True},
             chat_template_kwargs={"enable_thinking": False}, skip_special_tokens=False,
             n=1, presence_penalty=0, frequency_penalty=0.0, logprobs=False, tools=[],
             tool_choice="none")
    p = r.params
    assert (p.temperature, p.top_p, p.top_k, p.seed, p.max_new_tokens) == (0.0, 0.5, 0, 7, 5)
    assert (r.stop, r.stream, r.include_usage, r.enable_thinking, r.skip_special_tokens) == \
        (("\n",), True, True, False, False)
    assert r.prompt_ids == tok.encode(apply_chat_template(MSGS, True, False))
    assert chat(tok, template, max_completion_tokens=3).params.max_new_tokens == 3


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather.",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string"}}}}}]


def test_tools_render_with_auto_and_not_with_none(tok, template):
    """tool_choice "auto" (the default with tools) renders the tools and asks the app to parse
    calls; "none" renders the chat without them and parses nothing."""
    wide = ServerLimits("tiny", vocab_size=300, max_seq_len=4096)
    for choice in (None, "auto"):
        fields = {"tools": TOOLS} if choice is None else {"tools": TOOLS, "tool_choice": choice}
        r = parse_chat({"model": "tiny", "messages": MSGS, **fields}, wide, tok, template)
        assert r.tools == TOOLS
        assert r.prompt_ids == tok.encode(template.render(MSGS, True, TOOLS))
        assert '"name": "get_weather"' in tok.decode(r.prompt_ids)
    plain = parse_chat({"model": "tiny", "messages": MSGS}, wide, tok, template)
    for fields in ({"tools": TOOLS, "tool_choice": "none"}, {"tools": []},
                   {"tool_choice": "auto"}):
        r = parse_chat({"model": "tiny", "messages": MSGS, **fields}, wide, tok, template)
        assert r.tools is None and r.prompt_ids == plain.prompt_ids, fields
    # "required" and a named function render and parse as "auto", under the tool-call grammar
    from mtpjax import grammar
    auto = parse_chat({"model": "tiny", "messages": MSGS, "tools": TOOLS}, wide, tok, template)
    for choice, name in (("required", None),
                         ({"type": "function", "function": {"name": "get_weather"}},
                          "get_weather")):
        r = parse_chat({"model": "tiny", "messages": MSGS, "tools": TOOLS, "tool_choice": choice},
                       wide, tok, template)
        assert r.tools == TOOLS and r.prompt_ids == auto.prompt_ids
        assert r.params.grammar == grammar.tool_call_grammar(TOOLS, name, thinking=True,
                                                             parallel=name is None)
    assert auto.params.grammar is None


def test_completion_defaults_and_prompts(tok):
    r = completion(tok)
    assert r.prompt_ids == tok.encode("def f(x):") and r.params.max_new_tokens == 16
    assert r.enable_thinking is None and r.params.stop_token_ids == ()
    for prompt in ([5, 6, 7], [[5, 6, 7]]):
        assert completion(tok, prompt=prompt).prompt_ids == [5, 6, 7]
    assert completion(tok, prompt=["x y"]).prompt_ids == tok.encode("x y")
    # the default 16 shrinks to the room left; an explicit max_tokens never does
    assert completion(tok, prompt=[1] * 120).params.max_new_tokens == 8
    assert completion(tok, echo=False, best_of=1, logprobs=None).params.max_new_tokens == 16


def test_chat_content_parts_and_tool_history(tok, template):
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hel"},
                                          {"type": "text", "text": "lo"}]}]
    assert parse_chat({"model": "tiny", "messages": parts}, LIMITS, tok, template).prompt_ids \
        == chat(tok, template).prompt_ids
    history = MSGS + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "a", "type": "function",
             "function": {"name": "f", "arguments": '{"q": "x", "n": 2}'}}]},
        {"role": "tool", "tool_call_id": "a", "content": "42"}]
    r = parse_chat({"model": "tiny", "messages": history}, LIMITS, tok, template)
    text = tok.decode(r.prompt_ids)
    assert "<function=f>\n<parameter=q>\nx\n</parameter>\n<parameter=n>\n2\n</parameter>" in text
    assert "<tool_response>\n42\n</tool_response>" in text
    # the hand-written fallback renders no tool calls: a 400 on messages, not a 500
    refused(lambda: parse_chat({"model": "tiny", "messages": history}, LIMITS, tok,
                               ChatTemplate()), "messages", match="tool_calls")


# ---------------------------------------------------------------------------- what is refused
@pytest.mark.parametrize("fields, param", [
    ({"temperature": -1}, "temperature"), ({"temperature": 2.5}, "temperature"),
    ({"temperature": "0.5"}, "temperature"), ({"temperature": True}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 0}, "top_p"), ({"top_k": -2}, "top_k"), ({"top_k": 1.5}, "top_k"),
    ({"seed": -1}, "seed"), ({"seed": 2 ** 32}, "seed"),
    ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": "8"}, "max_tokens"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"max_tokens": 4, "max_completion_tokens": 5}, None),
    ({"stop": [""]}, "stop"), ({"stop": 3}, "stop"), ({"stop": ["a", 1]}, "stop"),
    ({"stream": "yes"}, "stream"), ({"stream_options": {"include_usage": 1}}, "stream_options"),
    ({"stream_options": {"continuous_usage_stats": True}}, "stream_options"),
    ({"n": 0}, "n"), ({"n": 17}, "n"), ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"), ({"logprobs": 1}, "logprobs"),
    ({"tools": [{"type": "custom", "function": {"name": "f"}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "string"}}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "extra": 1}}]}, "tools"),
    ({"tools": {"type": "function"}}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "f"}}},
     "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "get_weather"}},
     "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"chat_template_kwargs": {"enable_thinking": "no"}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": []}, "chat_template_kwargs"),
    ({"skip_special_tokens": 1}, "skip_special_tokens"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"top_logprobs": 2}, "top_logprobs"), ({"top_logprobs": 21, "logprobs": True},
                                             "top_logprobs"),
    ({"logit_bias": {"1": 500}}, "logit_bias"), ({"logit_bias": {"x": 5}}, "logit_bias"),
    ({"logit_bias": {"300": 5}}, "logit_bias"),
    ({"user": 5}, "user"), ({"metadata": {"a": 1}}, "metadata"), ({"store": "yes"}, "store"),
    ({"service_tier": "fastest"}, "service_tier"),
    ({"chat_template_kwargs": {"enable_thinkng": False}}, "chat_template_kwargs"),
    ({"parallel_tool_calls": 1}, "parallel_tool_calls"),
    ({"min_p": 0.1}, "min_p"), ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"reasoning_effort": "low"}, "reasoning_effort"), ({"made_up": 1}, "made_up"),
])
def test_chat_field_refused_by_name(tok, template, fields, param):
    e = refused(lambda: chat(tok, template, **fields), param)
    if param is not None:
        assert f"'{param}" in e.message, e.message


@pytest.mark.parametrize("messages, match", [
    ([], "'messages'"), ("hi", "'messages'"), ([{"role": "bot", "content": "x"}], "role"),
    ([{"content": "x"}], "'messages[0].role' is required"),
    ([{"role": "user"}], "needs 'content'"), ([{"role": "user", "content": 3}], "content"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
     "only text parts"),
    ([{"role": "user", "content": "x", "name": "bob"}], "'messages[0].name' is not supported"),
    ([{"role": "assistant"}], "needs 'content' or 'tool_calls'"),
    ([{"role": "user", "content": "x", "tool_calls": []}], "belongs to assistant"),
    ([{"role": "user", "content": "x", "tool_call_id": "a"}], "belongs to tool"),
    ([{"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "{oops"}}]}],
     "arguments must be a JSON object"),
    ([{"role": "assistant", "content": "", "tool_calls": [
        {"type": "custom", "function": {"name": "f", "arguments": "{}"}}]}], "type"),
    ([{"role": "user", "content": "a"}, {"role": "system", "content": "b"}],
     "only allowed first"),
    ([{"role": "user", "content": "word " * 200}], "maximum context length"),
])
def test_bad_messages_are_a_400_on_messages(tok, template, messages, match):
    refused(lambda: parse_chat({"model": "tiny", "messages": messages}, LIMITS, tok, template),
            "messages", match=match)


@pytest.mark.parametrize("fields, param, match", [
    ({"prompt": ""}, "prompt", "empty"), ({"prompt": []}, "prompt", "empty"),
    ({"prompt": [1, 2, 999]}, "prompt", "outside the vocabulary"),
    ({"prompt": [1, True]}, "prompt", None), ({"prompt": ["a", "b"]}, "prompt", None),
    ({"prompt": [1] * 128}, "prompt", "maximum context length"),
    ({"max_tokens": 200}, "max_tokens", "maximum context length"),
    ({"echo": True}, "echo", None), ({"best_of": 2}, "best_of", None),
    ({"logprobs": 6}, "logprobs", None), ({"logprobs": True}, "logprobs", None),
    ({"n": 0}, "n", None), ({"suffix": "x"}, "suffix", "not supported"),
    ({"messages": MSGS}, "messages", "not a field"),
])
def test_completion_field_refused_by_name(tok, fields, param, match):
    refused(lambda: completion(tok, **fields), param, match=match)


def test_model_missing_is_400_and_unknown_is_404(tok, template):
    refused(lambda: parse_chat({"messages": MSGS}, LIMITS, tok, template), "model",
            match="required")
    e = refused(lambda: parse_chat({"model": "gpt-9", "messages": MSGS, "n": 5}, LIMITS, tok,
                                   template), "model", status=404)
    assert e.code == "model_not_found"
    refused(lambda: parse_chat([1], LIMITS, tok, template), None, match="JSON object")


def test_every_declared_field_is_implemented_or_no_op_only():
    """A field added to a request model must be decided on here: implemented (the parser
    reads it) or declared with its no-op value only."""
    implemented = {"model", "messages", "prompt", "temperature", "top_p", "top_k", "seed",
                   "stop", "stream", "stream_options", "skip_special_tokens", "max_tokens",
                   "max_completion_tokens", "chat_template_kwargs", "tools", "tool_choice",
                   "response_format", "n", "logprobs", "top_logprobs", "logit_bias",
                   "parallel_tool_calls", "presence_penalty", "frequency_penalty",
                   "repetition_penalty"}
    no_op_only = {"echo", "best_of"}
    declared = set(ChatCompletionRequest.model_fields) | set(CompletionRequest.model_fields)
    assert declared == implemented | no_op_only | IGNORED
    assert not declared & NOT_SUPPORTED


IGNORED_FIELDS = {"user": "u-17", "safety_identifier": "s-1", "metadata": {"team": "eval"},
                  "store": False, "service_tier": "auto", "prompt_cache_key": "conv-3"}


def test_harmless_openai_fields_are_accepted_and_change_nothing(tok, template):
    """user, metadata, store, ... (protocol.IGNORED) are accepted on both routes and the
    request is the one without them; README lists them."""
    assert set(IGNORED_FIELDS) == IGNORED
    with_fields = chat(tok, template, seed=1, **IGNORED_FIELDS)
    assert with_fields == chat(tok, template, seed=1)
    assert completion(tok, seed=1, **IGNORED_FIELDS) == completion(tok, seed=1)
    readme = open(os.path.join(REPO, "README.md"), encoding="utf-8").read()
    assert all(f"`{name}`" in readme for name in IGNORED), "README lists the ignored fields"


def test_unknown_template_kwargs_are_refused_by_name(tok, template):
    e = refused(lambda: chat(tok, template, chat_template_kwargs={"enable_thinking": False,
                                                                  "thinking_budget": 5}),
                "chat_template_kwargs")
    assert "thinking_budget" in e.message and "enable_thinking" in e.message, e.message


# ------------------------------------------------------------------ generation_config defaults
def test_sampling_defaults_come_from_generation_config(tok, template, tmp_path):
    """A request that leaves temperature / top_p / top_k / penalties out gets the checkpoint's
    generation_config.json values (the tiny ships its recommended sampling); one that sets
    them wins; without the file (or with --generation_config=none) OpenAI's defaults hold."""
    import json
    from mtpjax.generation_config import SamplingDefaults
    d = SamplingDefaults.of_checkpoint(CKPT)
    with open(os.path.join(CKPT, "generation_config.json")) as f:
        cfg = json.load(f)
    assert cfg["do_sample"] is True and d.temperature == cfg["temperature"] > 0
    assert (d.top_p, d.top_k, d.repetition_penalty) == (cfg["top_p"], cfg["top_k"],
                                                         cfg["repetition_penalty"])
    limits = ServerLimits("tiny", 300, 128, d)
    p = parse_chat({"model": "tiny", "messages": MSGS}, limits, tok, template).params
    assert (p.temperature, p.top_p, p.top_k, p.repetition_penalty) == (
        d.temperature, d.top_p, d.top_k, d.repetition_penalty)
    p = parse_completion({"model": "tiny", "prompt": "x", "temperature": 0.0, "top_k": 0,
                          "repetition_penalty": 1.0}, limits, tok).params
    assert (p.temperature, p.top_p, p.top_k, p.repetition_penalty) == (0.0, d.top_p, 0, 1.0)
    openai = chat(tok, template).params                      # ServerLimits' default: OpenAI's
    assert (openai.temperature, openai.top_p, openai.top_k) == (1.0, 1.0, 0)
    assert SamplingDefaults.resolve("none", CKPT) == SamplingDefaults()
    assert SamplingDefaults.of_checkpoint(str(tmp_path)) == SamplingDefaults()
    # transformers' do_sample: false is greedy, whatever temperature says
    greedy = SamplingDefaults.from_generation_config({"do_sample": False, "temperature": 0.7})
    assert greedy.temperature == 0.0
    for bad in ({"temperature": -1}, {"top_p": 0}, {"top_k": 2.5}, {"do_sample": "yes"},
                {"repetition_penalty": 0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SamplingDefaults.from_generation_config(bad)
    with pytest.raises(ValueError, match="generation_config"):
        SamplingDefaults.resolve("vllm", CKPT)
