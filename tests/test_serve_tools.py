"""Tool calls in chat responses (mtpjax/serving/app.py on tool_parser): the tiny model's text is
random, so fixed generated texts go through the app's response builders -- the non-streamed
body (`final_body`) and the SSE events (`chat_chunks`) -- and must read as OpenAI's client
types, the stream reassembling to the non-streamed message."""

import asyncio
import dataclasses
import json

import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from mtpjax.serving.app import chat_chunks, final_body
from mtpjax.serving.parsing import ParsedRequest
from mtpjax.serving.online import Delta

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


class Handle:
    """What chat_chunks reads of a RequestHandle: Deltas in pieces, then the output."""

    def __init__(self, text, finish, size):
        self.output = Output(text, finish)
        self.pieces = [text[i:i + size] for i in range(0, len(text), size)]

    async def __aiter__(self):
        for p in self.pieces:
            yield Delta((0,), p)


def request(thinking, tools, stream=False):
    return ParsedRequest([1], None, (), stream, False, thinking, True, tools)


def body(text, thinking=False, tools=TOOLS, finish="stop"):
    b = final_body("chat", Output(text, finish), request(thinking, tools), HEAD)
    ChatCompletion.model_validate(b)
    return b


def stream(text, thinking=False, tools=TOOLS, finish="stop", size=3):
    async def collect():
        return [e async for e in chat_chunks(Handle(text, finish, size),
                                             request(thinking, tools, True), HEAD)]
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
