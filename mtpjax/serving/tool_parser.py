"""Tool calls out of generated text, in Qwen3.5's qwen3_coder XML format (the format the
checkpoint's chat template renders and asks for):

    <tool_call>
    <function=NAME>
    <parameter=P>
    VALUE
    </parameter>
    </function>
    </tool_call>

The rule, shared by `parse_tool_calls` (a whole text) and `ToolCallStream` (text deltas):

* a block is the text from `<tool_call>` to the next `</tool_call>` (or, while it opens a
  function of the tools and does not parse, to a later one where it does: a JSON argument's
  string may hold `</tool_call>`; `_block_end`); it is a call when it holds
  exactly one `<function=NAME>...</function>` (whitespace around it only) with NAME one of the
  request's tools, and nothing but `<parameter=P>...</parameter>` elements (and whitespace)
  inside the function. Any other block (unknown name, garbage, no `</tool_call>` before the
  text ends) stays in the content as written: the parser never raises;
* a parameter value ends at the first `</parameter>` (a JSON value where its JSON ends, when
  `\n</parameter>` follows: its strings may hold the tag, `_parameters`), loses one leading
  and one trailing newline (the template writes them) and is read as its JSON schema says
  (`written_as_text`): raw text stays a string ("string" or a type list with it, no type, a
  parameter the schema does not name); anything else (integer, number, boolean, object,
  array, and a schema with no type that composes: anyOf, oneOf, allOf, $ref, or a non-string
  enum / const) goes through `json.loads`, falling back to the raw string; "null" is None for
  a non-string type. grammar.tool_call_grammar writes values by the same rule, so a value the
  grammar allows parses back to itself. `arguments` is the JSON object of the parameters, in
  order (a repeated name: the last value wins);
* a forced call (tool_choice "required" / named: `partial`) that the text ends inside is a
  call with the parameters written so far (`parse_partial_block`); no markup is content;
* content is the text outside the calls, with the whitespace that separates text from a call
  dropped (the segment before a call loses its trailing whitespace, the segment after it its
  leading whitespace) -- vLLM's qwen3_coder parser strips the same way; text without calls is
  returned unchanged. Empty content is None.

The stream holds back what is not decided yet: text that may be the start of `<tool_call>`,
trailing whitespace that may precede a call, and a whole block until its `</tool_call>` (a
block that opens a function and does not parse there: until one where it does, or the end). A
call is emitted when its block closes: one delta with index, id, type and function.name
(arguments ""), then one delta with the arguments. So the concatenated deltas of any split of
a text equal `parse_tool_calls` of the whole text (call ids aside).
"""

from __future__ import annotations

import dataclasses
import json
import re
import secrets
from typing import Any, Iterable

START, END = "<tool_call>", "</tool_call>"
PARAM_CLOSE = "\n</parameter>"
_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*)</function>\s*", re.S)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.S)
_PARAMETER_OPEN = re.compile(r"<parameter=([^>\n]+)>")
_FUNCTION_OPEN = re.compile(r"\s*<function=([^>\n]+)>")
_JSON_TYPES = frozenset({"integer", "number", "boolean", "object", "array", "null"})


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def tool_schemas(tools: Iterable[dict] | None) -> dict[str, dict]:
    """{function name: its parameters schema} of OpenAI tool dicts."""
    out = {}
    for t in tools or ():
        fn = t["function"]
        out[fn["name"]] = fn.get("parameters") or {}
    return out


def _types(schema: Any) -> set[str]:
    t = schema.get("type") if isinstance(schema, dict) else None
    if isinstance(t, str):
        return {t}
    if isinstance(t, list):
        return {x for x in t if isinstance(x, str)}
    return set()


def written_as_text(schema: Any) -> bool:
    """Whether a parameter's value is written as raw text (and read back as a string) rather
    than as JSON: its type is "string" or includes it, or a type this parser does not know;
    with no type, unless the schema composes (anyOf, oneOf, allOf, $ref) or its enum / const
    holds a non-string (those are JSON). grammar.tool_call_grammar writes values by the same
    rule, so a forced call's value parses back to what the grammar allowed."""
    types = _types(schema)
    if types:
        return "string" in types or not types & _JSON_TYPES
    if not isinstance(schema, dict):
        return True
    if any(k in schema for k in ("anyOf", "oneOf", "allOf", "$ref")):
        return False
    values = schema.get("enum") if "enum" in schema else (
        [schema["const"]] if "const" in schema else [])
    return not isinstance(values, list) or all(isinstance(v, str) for v in values)


def convert_value(raw: str, schema: Any) -> Any:
    """A parameter's text as its schema says (see the module docstring)."""
    if written_as_text(schema):
        return raw
    types = _types(schema)
    s = raw.strip()
    if s.lower() == "null":
        return None
    if "boolean" in types and s.lower() in ("true", "false"):
        return s.lower() == "true"
    try:
        return json.loads(s)
    except (json.JSONDecodeError, ValueError, RecursionError):
        return raw


def _parameters(body: str, props: dict) -> list[tuple[str, str]] | None:
    """The (name, raw value) of each `<parameter=P>...</parameter>` element of a function's
    body, or None when anything but elements and whitespace is there. A value ends at the
    first `</parameter>`, but a JSON value (a parameter the schema names, not written as
    text) ends where its JSON does when `\n</parameter>` follows it: a JSON string may hold
    `</parameter>`, as the grammar allows."""
    out, pos, decoder = [], 0, json.JSONDecoder()
    while True:
        m = _PARAMETER_OPEN.search(body, pos)
        if m is None:
            return out if not body[pos:].strip() else None
        if body[pos:m.start()].strip():
            return None
        name, start, close = m.group(1), m.end(), -1
        if name in props and not written_as_text(props[name]):
            at = start + body.startswith("\n", start)
            try:
                _, end = decoder.raw_decode(body, at)
                if body.startswith(PARAM_CLOSE, end):
                    close = end + 1
            except (json.JSONDecodeError, ValueError, RecursionError):
                pass
        if close < 0:
            close = body.find("</parameter>", start)
            if close < 0:
                return None
        out.append((name, body[start:close]))
        pos = close + len("</parameter>")


def parse_block(inner: str, schemas: dict[str, dict]) -> tuple[str, str] | None:
    """(name, arguments JSON) of the text between <tool_call> and </tool_call>, or None when
    it is not a call of one of the tools."""
    m = _FUNCTION.fullmatch(inner)
    if m is None or m.group(1) not in schemas:
        return None
    name, body = m.group(1), m.group(2)
    props = schemas[name].get("properties") if isinstance(schemas[name], dict) else None
    props = props if isinstance(props, dict) else {}
    params = _parameters(body, props)
    if params is None:                            # garbage (or a second function) inside
        return None
    args = {}
    for p, raw in params:
        raw = raw.removeprefix("\n").removesuffix("\n")
        args[p] = convert_value(raw, props.get(p))
    return name, json.dumps(args, ensure_ascii=False)


def parse_partial_block(inner: str, schemas: dict[str, dict],
                        name: str | None = None) -> tuple[str, str] | None:
    """(name, arguments JSON) of a call cut off before its `</tool_call>` (inner: the text after
    `<tool_call>`): the parameters written so far, the last one with the value it had when the
    text ended (less a trailing piece of its closing tag). The function is the one its tag
    names, or, while the tag is unfinished, `name` (a named tool_choice) or the one tool
    whose tag it can still become; None when none is known."""
    head = inner.lstrip()
    m = re.match(r"<function=([^>\n]+)>", head)
    if m is not None:
        name, body = m.group(1), head[m.end():]
    else:
        if name is None:
            fits = [n for n in schemas if f"<function={n}>".startswith(head)]
            name = fits[0] if len(fits) == 1 else None
        body = ""
    if name not in schemas:
        return None
    props = schemas[name].get("properties") if isinstance(schemas[name], dict) else None
    props = props if isinstance(props, dict) else {}
    args, pos = {}, 0
    for p in _PARAMETER.finditer(body):
        args[p.group(1)] = convert_value(
            p.group(2).removeprefix("\n").removesuffix("\n"), props.get(p.group(1)))
        pos = p.end()
    last = re.search(r"<parameter=([^>\n]+)>", body[pos:])
    if last is not None:
        raw = body[pos:][last.end():].removeprefix("\n")
        for k in range(min(len(raw), len(PARAM_CLOSE)), 0, -1):
            if PARAM_CLOSE.startswith(raw[-k:]):       # a closing tag begun
                raw = raw[:-k]
                break
        args[last.group(1)] = convert_value(raw, props.get(last.group(1)))
    return name, json.dumps(args, ensure_ascii=False)


def _call(name: str, arguments: str, call_id: str) -> dict:
    return {"id": call_id, "type": "function",
            "function": {"name": name, "arguments": arguments}}


def parse_tool_calls(text: str, tools: Iterable[dict] | None, partial: bool = False,
                     name: str | None = None) -> tuple[str | None, list[dict]]:
    """(content or None, calls) of a whole generated text; calls are OpenAI tool_calls
    entries {id, type: "function", function: {name, arguments: JSON string}}. partial (a
    forced call, tool_choice "required" / named `name`): a block the text ends in is a call
    with the arguments written so far (`parse_partial_block`), and a trailing piece of
    `<tool_call>` is dropped: no markup is left in the content."""
    schemas = tool_schemas(tools)
    content, calls, seg, pos, after_call = "", [], "", 0, False

    def close_segment(seg: str, before_call: bool) -> str:
        if after_call:
            seg = seg.lstrip()
        return seg.rstrip() if before_call else seg

    while True:
        i = text.find(START, pos)
        j, call = _block_end(text, i, schemas) if i >= 0 else (-1, None)
        if partial and i >= 0 and (j < 0 or call is None and _may_be_call(
                text[i + len(START):j], schemas)):    # a forced call cut off
            content += close_segment(seg + text[pos:i], True)
            call = parse_partial_block(text[i + len(START):], schemas, name)
            if call is not None:
                calls.append(_call(*call, new_call_id()))
            break
        if j < 0:                                      # no (closed) block left
            rest = text[pos:]
            if partial:
                rest = rest[:len(rest) - _partial_start(rest)]
            content += close_segment(seg + rest, False)
            break
        seg += text[pos:i]
        if call is None:
            seg += text[i:j + len(END)]
        else:
            content += close_segment(seg, True)
            calls.append(_call(*call, new_call_id()))
            seg, after_call = "", True
        pos = j + len(END)
    return content or None, calls


def _may_be_call(inner: str, schemas: dict) -> bool:
    """Whether a block's text (after <tool_call>) opens a function of the tools."""
    m = _FUNCTION_OPEN.match(inner)
    return m is not None and m.group(1) in schemas


def _block_end(text: str, i: int, schemas: dict) -> tuple[int, tuple[str, str] | None]:
    """(where the block that starts at i ends, its (name, arguments) or None): at the first
    `</tool_call>` after which it parses as a call -- a later one only while the block opens
    a function of the tools, for a JSON argument's string may hold `</tool_call>` -- else at
    the first; (-1, None) when none follows."""
    first = j = text.find(END, i + len(START))
    while j >= 0:
        call = parse_block(text[i + len(START):j], schemas)
        if call is not None:
            return j, call
        if not _may_be_call(text[i + len(START):j], schemas):
            break
        j = text.find(END, j + len(END))
    return first, None


def _partial_start(s: str) -> int:
    """Length of the longest suffix of s that is a proper prefix of START."""
    for k in range(min(len(s), len(START) - 1), 0, -1):
        if START.startswith(s[-k:]):
            return k
    return 0


@dataclasses.dataclass
class ToolCallStream:
    """Streaming `parse_tool_calls` (with its partial and name): `push(text)` and, at the end,
    `flush()` return (content delta, OpenAI tool_calls delta entries) that became final."""
    tools: dataclasses.InitVar[Iterable[dict] | None]
    partial: bool = False
    name: str | None = None
    schemas: dict = dataclasses.field(init=False)
    num_calls: int = 0
    _buf: str = ""
    _in_block: bool = False
    _after_call: bool = False      # no non-whitespace content since the last call
    _ws: str = ""                  # trailing whitespace held: it is dropped before a call
    _scan: int = len(START)        # where in the held block the next </tool_call> is sought
    _first_end: int = -1           # the held block's first </tool_call>, where it did not parse

    def __post_init__(self, tools):
        self.schemas = tool_schemas(tools)

    def _outside(self, s: str) -> str:
        """Content text s (outside calls) -> what can be released now."""
        if self._after_call:
            s = s.lstrip()
            if not s:
                return ""
            self._after_call = False
        s = self._ws + s
        body = s.rstrip()
        self._ws = s[len(body):]
        return body

    def _emit(self, name: str, arguments: str) -> list[dict]:
        """A call's deltas: index, id, type and name (arguments ""), then the arguments."""
        self._ws, self._after_call = "", True
        deltas = [{"index": self.num_calls, "id": new_call_id(), "type": "function",
                   "function": {"name": name, "arguments": ""}},
                  {"index": self.num_calls, "function": {"arguments": arguments}}]
        self.num_calls += 1
        return deltas

    def push(self, piece: str) -> tuple[str, list[dict]]:
        self._buf += piece
        content, deltas = "", []
        while True:
            if not self._in_block:
                i = self._buf.find(START)
                if i < 0:
                    keep = _partial_start(self._buf)
                    content += self._outside(self._buf[:len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep:]
                    return content, deltas
                content += self._outside(self._buf[:i])
                self._buf, self._in_block = self._buf[i:], True
            j = self._buf.find(END, self._scan)
            if j < 0:
                return content, deltas
            call = parse_block(self._buf[len(START):j], self.schemas)
            if call is None and _may_be_call(self._buf[len(START):j], self.schemas):
                self._first_end = j if self._first_end < 0 else self._first_end
                self._scan = j + len(END)      # a later </tool_call> may close it (_block_end)
                continue
            block, self._buf = self._buf[:j + len(END)], self._buf[j + len(END):]
            self._in_block, self._scan, self._first_end = False, len(START), -1
            if call is None:
                content += self._outside(block)
                continue
            deltas += self._emit(*call)

    def flush(self) -> tuple[str, list[dict]]:
        """The held text at the end of the output: an unclosed block stays content, or, with
        partial, is a call with the arguments so far (a piece of `<tool_call>` is dropped)."""
        rest, in_block, self._buf, self._in_block = self._buf, self._in_block, "", False
        first_end, self._first_end, self._scan = self._first_end, -1, len(START)
        if self.partial and in_block:
            self._ws = ""
            call = parse_partial_block(rest[len(START):], self.schemas, self.name)
            return "", (self._emit(*call) if call is not None else [])
        if in_block and first_end >= 0:     # it never parsed: content to its first end, and
            cut = first_end + len(END)      # what follows is read again
            content = self._outside(rest[:cut])
            more, deltas = self.push(rest[cut:])
            last, last_deltas = self.flush()
            return content + more + last, deltas + last_deltas
        if self.partial:
            rest = rest[:len(rest) - _partial_start(rest)]
        content = self._outside(rest) + self._ws
        self._ws = ""
        return content, []
