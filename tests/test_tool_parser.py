"""The qwen3_coder tool-call parser (mtpjax/serving/tool_parser.py): whole texts, and streams
split at every position give the same content and calls."""

import json

import pytest

from mtpjax.serving.tool_parser import ToolCallStream, parse_tool_calls

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"},
                                         "days": {"type": "integer"}}}}},
    {"type": "function", "function": {"name": "calc", "parameters": {
        "type": "object", "properties": {
            "x": {"type": "number"}, "exact": {"type": "boolean"},
            "opts": {"type": "object"}, "items": {"type": "array"},
            "note": {"type": ["string", "null"]}, "n": {"type": ["integer", "null"]}}}}},
]


def block(name, **params):
    """A call as the checkpoint's template renders it."""
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


WEATHER = block("get_weather", city="Oslo", days="3")


def plain(calls):
    """calls without their random ids, arguments parsed."""
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def streamed(text, cuts):
    """(content or None, calls) of text pushed in pieces cut at the positions in cuts."""
    s = ToolCallStream(TOOLS)
    content, calls = "", {}
    bounds = [0, *cuts, len(text)]
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    for out in [s.push(p) for p in pieces] + [s.flush()]:
        content += out[0]
        for d in out[1]:
            if "id" in d:                       # a call's first delta
                assert d["index"] == len(calls) and d["type"] == "function"
                assert d["function"]["arguments"] == ""
                calls[d["index"]] = {"id": d["id"], "type": "function",
                                     "function": {"name": d["function"]["name"],
                                                  "arguments": ""}}
            else:
                calls[d["index"]]["function"]["arguments"] += d["function"]["arguments"]
    return content or None, [calls[i] for i in range(len(calls))]


CASES = {
    "plain": ("Just an answer.\n", "Just an answer.\n", []),
    "call only": (WEATHER, None, [("get_weather", {"city": "Oslo", "days": 3})]),
    "text before": ("Let me check.\n\n" + WEATHER, "Let me check.",
                    [("get_weather", {"city": "Oslo", "days": 3})]),
    "parallel": (WEATHER + "\n" + block("calc", x="2.5", exact="true"), None,
                 [("get_weather", {"city": "Oslo", "days": 3}),
                  ("calc", {"x": 2.5, "exact": True})]),
    "typed": (block("calc", x="1e3", exact="False", opts='{"a": [1, 2]}', items="[1, \"b\"]",
                    note="null", n="null"), None,
              [("calc", {"x": 1000.0, "exact": False, "opts": {"a": [1, 2]}, "items": [1, "b"],
                         "note": "null", "n": None})]),
    "fallback to raw": (block("calc", x="about 3", opts="{oops", items="[1,"), None,
                        [("calc", {"x": "about 3", "opts": "{oops", "items": "[1,"})]),
    "string kept": (block("get_weather", city="  42\nlines  ", days="07x"), None,
                    [("get_weather", {"city": "  42\nlines  ", "days": "07x"})]),
    "unknown param": (block("get_weather", unit="C"), None, [("get_weather", {"unit": "C"})]),
    "no params": ("<tool_call>\n<function=calc>\n</function>\n</tool_call>", None,
                  [("calc", {})]),
    "text after": (WEATHER + "\n\n  done.  ", "done.  ",
                   [("get_weather", {"city": "Oslo", "days": 3})]),
    "unclosed": ("Hi <tool_call>\n<function=get_weather>\n<parameter=city>\nOs",
                 "Hi <tool_call>\n<function=get_weather>\n<parameter=city>\nOs", []),
    "unknown function": ("x " + block("launch", code="1") + " y",
                         "x " + block("launch", code="1") + " y", []),
    "garbage inside": ("<tool_call>\n<function=calc>\nhello\n</function>\n</tool_call>",
                       "<tool_call>\n<function=calc>\nhello\n</function>\n</tool_call>", []),
    "no function": ("<tool_call>nonsense</tool_call>", "<tool_call>nonsense</tool_call>", []),
    "bad then good": ("<tool_call>bad</tool_call>\n" + WEATHER, "<tool_call>bad</tool_call>",
                      [("get_weather", {"city": "Oslo", "days": 3})]),
    "call, bad, text": (WEATHER + " <tool_call>?</tool_call> end",
                        "<tool_call>?</tool_call> end",
                        [("get_weather", {"city": "Oslo", "days": 3})]),
    "lone markers": ("a </tool_call> <tool_c b <tool_call", "a </tool_call> <tool_c b <tool_call",
                     []),
    "json holding a tag": (block("calc", opts='{"a": "</parameter> <x>"}', x="1"), None,
                           [("calc", {"opts": {"a": "</parameter> <x>"}, "x": 1})]),
    "json holding the end": (block("calc", opts='{"a": "</tool_call> x"}') + " after",
                             "after", [("calc", {"opts": {"a": "</tool_call> x"}})]),
    "call never closing, then a call": (
        "<tool_call>\n<function=calc>\nhi\n</function>\n</tool_call> and " + WEATHER + " z",
        "<tool_call>\n<function=calc>\nhi\n</function>\n</tool_call> andz",
        [("get_weather", {"city": "Oslo", "days": 3})]),
    "unicode": ("Prüfe… " + block("get_weather", city="Zürich"), "Prüfe…",
                [("get_weather", {"city": "Zürich"})]),
}


@pytest.mark.parametrize("name", CASES)
def test_whole_text(name):
    text, content, calls = CASES[name]
    got_content, got_calls = parse_tool_calls(text, TOOLS)
    assert got_content == content
    assert plain(got_calls) == calls
    for c in got_calls:
        assert set(c) == {"id", "type", "function"} and c["type"] == "function"
        assert c["id"].startswith("call_") and isinstance(c["function"]["arguments"], str)
    assert len({c["id"] for c in got_calls}) == len(got_calls)


@pytest.mark.parametrize("name", CASES)
def test_stream_split_anywhere_equals_whole_text(name):
    text = CASES[name][0]
    content, calls = parse_tool_calls(text, TOOLS)
    want = (content, [c["function"] for c in calls])
    for cut in range(len(text) + 1):                     # two pieces, every position
        got_content, got_calls = streamed(text, [cut])
        assert (got_content, [c["function"] for c in got_calls]) == want, cut
    got_content, got_calls = streamed(text, range(1, len(text)))   # one character at a time
    assert (got_content, [c["function"] for c in got_calls]) == want


def test_stream_holds_only_what_is_undecided():
    s = ToolCallStream(TOOLS)
    assert s.push("Sure <tool") == ("Sure", [])         # " <tool" may start a call
    assert s.push("bar> ok") == (" <toolbar> ok", [])
    assert s.push("\n\n<tool_call>\n<function=calc>\n") == ("", [])
    content, deltas = s.push("</function>\n</tool_call>")
    assert content == "" and deltas[0]["function"]["name"] == "calc"
    assert [d["index"] for d in deltas] == [0, 0] and deltas[1]["function"]["arguments"] == "{}"
    assert s.flush() == ("", [])


def test_no_tools_means_no_calls():
    assert parse_tool_calls(WEATHER, None) == (WEATHER, [])


# ------------------------------------------- raw text values and forced calls cut off
def test_string_values_hold_any_text_but_the_closing_tags():
    """A string value may hold '<', tags of its own, newlines: it ends at the first
    </parameter> (what grammar.tool_call_grammar allows it to hold, and no more)."""
    for value in ("a < b", "<html>\n<p>x</p>\n</html>", "List<int> xs;\n\n", "<parameter=x>",
                  "</function>", "\n"):
        text = block("get_weather", city=value, days="2")
        content, calls = parse_tool_calls(text, TOOLS)
        assert content is None and plain(calls) == [("get_weather", {"city": value, "days": 2})]
        assert streamed(text, range(1, len(text)))[1][0]["function"] == calls[0]["function"]


def test_values_are_text_or_json_by_one_rule():
    from mtpjax.serving.tool_parser import convert_value, written_as_text
    text = [{"type": "string"}, {"type": ["string", "null"]}, {}, {"description": "x"},
            {"enum": ["a", "b"]}, {"type": "made-up"}]
    json_ = [{"type": "integer"}, {"anyOf": [{"type": "integer"}, {"type": "string"}]},
             {"oneOf": [{"type": "integer"}]}, {"$ref": "#/$defs/a"}, {"enum": ["a", 1]},
             {"const": 3}, {"type": ["integer", "null"]}]
    assert all(written_as_text(s) for s in text)
    assert not any(written_as_text(s) for s in json_)
    assert convert_value("3", {"anyOf": [{"type": "integer"}, {"type": "string"}]}) == 3
    assert convert_value('"3"', {"anyOf": [{"type": "integer"}, {"type": "string"}]}) == "3"
    assert convert_value("3", {"type": "string"}) == "3"


CUT = "<tool_call>\n<function=get_weather>\n<parameter=city>\nOs"


@pytest.mark.parametrize("text, want", [
    (CUT, [("get_weather", {"city": "Os"})]),
    (CUT + "lo\n</param", [("get_weather", {"city": "Oslo"})]),
    (block("get_weather", city="Oslo") + "\n<tool_call>\n<function=calc>\n<parameter=x>\n2.5",
     [("get_weather", {"city": "Oslo"}), ("calc", {"x": 2.5})]),
    ("<tool_call>\n<function=get_w", [("get_weather", {})]),   # the only tool it can become
    ("<tool_call>\n<function=", []),                           # two tools: no call
    (WEATHER + "\n<tool_c", [("get_weather", {"city": "Oslo", "days": 3})]),
])
def test_a_forced_call_cut_off_is_a_call_and_no_markup(text, want):
    """partial (tool_choice "required" / named): the block the text ends in is a call with
    the arguments so far; nothing of the markup is content; the stream gives the same."""
    content, calls = parse_tool_calls(text, TOOLS, partial=True)
    assert content is None and plain(calls) == want
    s = ToolCallStream(TOOLS, partial=True)
    outs = [s.push(text[i:i + 3]) for i in range(0, len(text), 3)] + [s.flush()]
    assert "".join(o[0] for o in outs) == ""
    args = {}
    for d in (d for o in outs for d in o[1]):
        args[d["index"]] = args.get(d["index"], "") + d["function"]["arguments"]
    assert [json.loads(args[i]) for i in sorted(args)] == [w[1] for w in want]
    # without partial ("auto"), the unclosed block stays content as written
    assert parse_tool_calls(CUT, TOOLS)[0] == CUT


def test_a_named_forced_call_cut_in_its_tag_is_that_function():
    _, calls = parse_tool_calls("<tool_call>\n<func", TOOLS, partial=True, name="calc")
    assert plain(calls) == [("calc", {})]
