"""The checkpoint's chat template (mtpjax/serving/chat_template.py): the tiny checkpoint's
Qwen3.5-style template rendered by our module equals transformers' apply_chat_template on the
same template for every conversation shape a server sees (system + user, multi-turn with
reasoning, tools with assistant tool calls and tool responses, parallel calls, thinking off);
it equals the hand-written ChatML where both apply; and the loading order, the fallback, the
sandbox and the refusals."""

import json
import os

import jinja2
import pytest

from mtpjax.serving.chat_template import ChatTemplate, ChatTemplateError, \
    TemplateVariableError, load_chat_template, render_jinja
from mtpjax.text import apply_chat_template

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CKPT = os.path.join(REPO, "checkpoints", "tiny")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city (°C) <today>",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}}
SHELL = {"type": "function", "function": {
    "name": "run", "description": "Run a shell command",
    "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}}}


def call(name, args, i="c0"):
    return {"id": i, "type": "function", "function": {"name": name, "arguments": args}}


HISTORY = [
    {"role": "system", "content": "  You are brief.\n"},
    {"role": "user", "content": "\n Hi there  "},
    {"role": "assistant", "content": "<think>\nthe user greets\n</think>\n\nHello!"},
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "4", "reasoning_content": "\n  add them \n"},
]
TOOL_TURNS = [
    {"role": "system", "content": "Use tools when they help."},
    {"role": "user", "content": "Weather in Paris, and list files?"},
    {"role": "assistant", "content": "Checking both.", "reasoning_content": "two tools",
     "tool_calls": [call("get_weather", {"city": "Paris", "days": 2, "opts": {"x": [1, True]}}),
                    call("run", {"cmd": "ls -l\n| head"}, "c1")]},
    {"role": "tool", "tool_call_id": "c0", "content": "sunny, 21°C"},
    {"role": "tool", "tool_call_id": "c1", "content": " a.txt\nb.txt "},
]
CASES = {   # name: (messages, tools, enable_thinking or None = not passed)
    "system_user": (HISTORY[:2], None, None),
    "multi_turn_reasoning": (HISTORY, None, True),
    "reasoning_then_new_query": (HISTORY + [{"role": "user", "content": "thanks"}], None, None),
    "thinking_off": (HISTORY[:2], None, False),
    "tools_no_system": (HISTORY[1:2], [WEATHER], True),
    "tools_and_calls": (TOOL_TURNS, [WEATHER, SHELL], None),
    "parallel_calls_no_content": (TOOL_TURNS[:2] + [
        {"role": "assistant", "content": None,
         "tool_calls": [call("get_weather", {"city": "Nice"}), call("get_weather",
                                                                    {"city": "Oslo"}, "c1")]},
        {"role": "tool", "content": "rain"}, {"role": "tool", "content": "snow"}],
        [WEATHER], False),
    "tool_turn_then_answer": (TOOL_TURNS + [{"role": "assistant", "content": "Sunny; 2 files."},
                                            {"role": "user", "content": "ok"}], [WEATHER], True),
    "content_parts": ([{"role": "user", "content": [{"type": "text", "text": "a "},
                                                    {"type": "text", "text": "b"}]}], None, None),
}


@pytest.fixture(scope="module")
def template():
    return load_chat_template(CKPT)


@pytest.fixture(scope="module")
def hf_tokenizer():
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(CKPT)


def test_the_tiny_checkpoint_ships_its_template(template):
    assert template.origin == os.path.join(CKPT, "chat_template.jinja")
    assert template.special_tokens == {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    assert "<tool_call>" in template.source and "<tool_response>" in template.source


@pytest.mark.parametrize("name", sorted(CASES))
def test_equals_transformers_apply_chat_template(template, hf_tokenizer, name):
    messages, tools, thinking = CASES[name]
    kw = {} if thinking is None else {"enable_thinking": thinking}
    for gen in (True, False):
        ours = template.render(messages, gen, tools, kw)
        theirs = hf_tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                                  add_generation_prompt=gen, **kw)
        assert ours == theirs, name
        # and with the template passed explicitly (not the one transformers loaded)
        assert ours == hf_tokenizer.apply_chat_template(
            messages, tools=tools, chat_template=template.source, tokenize=False,
            add_generation_prompt=gen, **kw)


def test_tool_calls_render_in_the_qwen3_coder_format(template):
    messages, tools, _ = CASES["tools_and_calls"]
    text = template.render(messages, True, tools)
    assert text.startswith("<|im_start|>system\n# Tools\n")
    assert "\n" + json.dumps(WEATHER, ensure_ascii=False) + "\n" in text   # one JSON line each
    assert text.count("<|im_start|>system") == 1
    assert "</IMPORTANT>\n\nUse tools when they help.<|im_end|>\n" in text
    assert ("Checking both.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
            "</parameter>\n<parameter=days>\n2\n</parameter>\n<parameter=opts>\n"
            '{"x": [1, true]}\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n'
            "<function=run>\n<parameter=cmd>\nls -l\n| head\n</parameter>\n</function>\n"
            "</tool_call><|im_end|>\n") in text
    assert text.endswith("<|im_start|>user\n<tool_response>\nsunny, 21°C\n</tool_response>\n"
                         "<tool_response>\na.txt\nb.txt\n</tool_response><|im_end|>\n"
                         "<|im_start|>assistant\n<think>\n")
    # the reasoning of the turn after the last real query (tool responses are not queries)
    assert "<|im_start|>assistant\n<think>\ntwo tools\n</think>\n\nChecking both." in text


@pytest.mark.parametrize("name", [n for n in CASES if CASES[n][1] is None])
def test_equals_the_hand_written_chatml_without_tools(template, name):
    messages, _, thinking = CASES[name]
    for gen in (True, False):
        assert template.render(messages, gen, None, {} if thinking is None else {
            "enable_thinking": thinking}) == apply_chat_template(
            [{**m, "content": "".join(p["text"] for p in m["content"])}
             if isinstance(m["content"], list) else m for m in messages],
            gen, True if thinking is None else thinking)


@pytest.mark.parametrize("messages, match", [
    ([{"role": "user", "content": "a"}, {"role": "system", "content": "b"}], "only allowed first"),
    ([{"role": "bot", "content": "x"}], "Unknown role bot"),
    ([], "No messages"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}],
     "Only text content parts"),
    ([{"role": "assistant", "content": "", "tool_calls": [call("f", '{"a": 1}')]}],
     "arguments must be an object"),
])
def test_the_template_refuses_with_its_message(template, messages, match):
    with pytest.raises(ChatTemplateError, match=match):
        template.render(messages)


@pytest.mark.parametrize("name", ["messages", "tools", "documents", "add_generation_prompt"])
def test_reserved_variables_are_refused(template, name):
    with pytest.raises(TemplateVariableError, match=name):
        template.render(HISTORY[:2], True, None, {name: []})


def test_the_sandbox_blocks_python_internals():
    evil = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(ChatTemplateError):
        render_jinja(evil, [{"role": "user", "content": "x"}])
    mutate = "{% set x = messages.append(1) %}{{ messages | length }}"
    with pytest.raises(ChatTemplateError):                        # immutable sandbox
        render_jinja(mutate, [{"role": "user", "content": "x"}])


def test_tojson_keeps_unicode_and_html_and_key_order():
    out = render_jinja("{{ tools[0] | tojson }}|{{ tools[0] | tojson(indent=2) }}",
                       [{"role": "user", "content": "x"}], tools=[{"b": "<é>", "a": 1}])
    assert out == '{"b": "<é>", "a": 1}|' + json.dumps({"b": "<é>", "a": 1}, indent=2,
                                                        ensure_ascii=False)


def test_variables_special_tokens_and_generation_tag():
    src = ("{{ bos_token }}|{{ eos_token }}|{{ add_generation_prompt }}|{{ flavour }}|"
           "{% generation %}{{ messages[0].thinking }}{% endgeneration %}")
    t = ChatTemplate(src, {"bos_token": "<s>", "eos_token": "</s>"}, "test")
    out = t.render([{"role": "assistant", "content": "a", "reasoning_content": "r"}], False,
                   None, {"flavour": "x"})
    assert out == "<s>|</s>|False|x|r"                     # reasoning aliased as `thinking`
    assert t.render([{"role": "user", "content": "a"}], variables={"eos_token": "E"}).split(
        "|")[1] == "E"


def test_loading_order(tmp_path):
    """chat_template.jinja wins over tokenizer_config.json's; a named list takes "default";
    neither: the hand-written ChatML, which takes no tools and only enable_thinking."""
    config = {"eos_token": {"content": "<|im_end|>", "special": True}, "bos_token": None,
              "chat_template": [{"name": "tool_use", "template": "T"},
                                {"name": "default", "template": "D{{ eos_token }}"}]}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    t = load_chat_template(str(tmp_path))
    assert t.render([{"role": "user", "content": "x"}]) == "D<|im_end|>"
    assert t.origin.endswith("tokenizer_config.json")
    (tmp_path / "chat_template.jinja").write_text("J")
    assert load_chat_template(str(tmp_path)).render([{"role": "user", "content": "x"}]) == "J"

    bare = load_chat_template(str(tmp_path / "missing"))
    assert bare.source is None
    msgs = [{"role": "user", "content": "Hello"}]
    assert bare.render(msgs, variables={"enable_thinking": False}) == apply_chat_template(
        msgs, True, False)
    with pytest.raises(ChatTemplateError, match="renders no tools"):
        bare.render(msgs, tools=[WEATHER])
    with pytest.raises(TemplateVariableError, match="only 'enable_thinking'"):
        bare.render(msgs, variables={"flavour": 1})


def test_a_broken_template_fails_at_load(tmp_path):
    (tmp_path / "chat_template.jinja").write_text("{% if %}")
    with pytest.raises(ChatTemplateError, match="does not compile"):
        load_chat_template(str(tmp_path))


def test_the_template_is_package_data():
    """pyproject's package data for checkpoints covers the template file."""
    import fnmatch
    import tomllib
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        patterns = tomllib.load(f)["tool"]["setuptools"]["package-data"]["checkpoints"]
    assert any(fnmatch.fnmatch("tiny/chat_template.jinja", p) for p in patterns)
    assert jinja2.__version__ == "3.1.6"
