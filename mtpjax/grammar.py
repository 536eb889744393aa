"""Constrained decoding (structured output) through llguidance, exact under speculation.

A request whose `SamplingParams.grammar` is set (a llguidance grammar: `json_schema_grammar`,
`json_object_grammar`, or any grammar `LLMatcher` takes) gets a `Constraint`: an llguidance
matcher over its generated tokens, kept on the host beside the request. Each decode step the
engine hands the device one packed token bitmask per verify position (`step_masks`), and the
step's verification samples from the target distribution with the disallowed tokens' logits set
to -inf (steps._verify, `apply_bitmask`).

What is masked where, and why the output is that of non-speculative constrained decoding:

* Verify row j of a depth-d step (0 <= j <= d) is the target's distribution for the token after
  the committed tokens and drafts d_1..d_j. Its mask is the grammar state after exactly those
  tokens: the host advances the matcher through d_1..d_j (the drafts the device holds, read
  back before the step), takes a mask per row, and rolls the matcher back. So row j samples
  from the masked target distribution of that context, which is what constrained plain
  decoding samples there, with the same position-keyed uniform (sampling.verify): token for
  token the same, greedy (the masked argmax) or seeded.
* Row j is only ever emitted when d_1..d_j were all accepted, i.e. each d_i was the token row
  i-1 sampled from its masked distribution. A draft the grammar rejects (its bit is 0 in the
  previous row's mask) therefore can never be accepted, and the rows after it can never be
  emitted: the host stops advancing there and gives those rows the all-allowed mask (any mask
  would do). A draft that is a stop token ends the request when accepted, so the rows after it
  are never emitted either.
* The drafts are masked on the host, one step late: the MTP chain runs on the device after the
  step's acceptance (the first draft follows the correction token, sampled in the same step),
  where the grammar is not, so it drafts the unmasked argmax. A step with a constrained lane
  also records each draft's best draft-head rows (steps.LaneState.candidates), and before the
  next step the host walks the lane's drafts through its grammar (`Constraint.masked_drafts`):
  a draft the grammar allows stays; a forbidden one becomes its first allowed candidate (the
  masked argmax of the draft logits whenever one of the candidates is allowed) or, when none
  is, the grammar's only allowed token if it has one (a forced token: the masked argmax
  whatever the logits); the walk goes on from the corrected draft. The engine writes the
  corrected drafts into the lane state and takes the masks of the rows from them. Any draft
  is lossless (the masked target gives a forbidden one probability 0), so this changes
  acceptance only, never the output (`Engine(mask_drafts=False)` verifies the raw drafts,
  for comparison: tests/test_structured_output.py).
* Stop tokens: the engine's EOS ids are the llguidance tokenizer's EOS tokens, allowed only
  where the grammar accepts. When an emitted token leaves the grammar stopped (nothing more
  can follow, e.g. a JSON object's closing brace), the request ends with finish_reason "stop"
  at that token (scheduler `_emit`), in plain and speculative decoding alike.

Unconstrained lanes get the all-allowed mask (-1 words); a step whose lanes are all
unconstrained skips the masking on the device (lax.cond), and the mask input is always present,
so the number of compiled programs does not change.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

import jax
import jax.numpy as jnp


def _llg():
    import llguidance
    return llguidance


def words(vocab_size: int) -> int:
    """int32 words of a packed token bitmask over vocab_size tokens (bit v%32 of word v//32)."""
    return (int(vocab_size) + 31) // 32


# ----------------------------------------------------------------------------- grammar specs
def check_grammar(grammar: str, tokenizer=None) -> str:
    """The grammar, or ValueError with llguidance's message when it is not valid."""
    if not isinstance(grammar, str) or not grammar:
        raise ValueError(f"grammar must be a non-empty llguidance grammar string, got "
                         f"{type(grammar).__name__}")
    llg = _llg()
    try:
        is_error, msgs = llg.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
    except Exception as e:    # noqa: BLE001  (malformed grammar JSON raises)
        raise ValueError(f"invalid grammar: {e}") from None
    if is_error:
        raise ValueError(f"invalid grammar: {msgs[0] if msgs else 'unknown error'}")
    return grammar


# JSON layout: no free whitespace (a model may otherwise pad forever with spaces and newlines,
# all of it valid JSON), the separators of Python's json.dumps. A schema's "x-guidance" key
# (llguidance's JsonCompileOptions) overrides these.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def json_schema_grammar(schema: dict | str) -> str:
    """The llguidance grammar of a JSON schema (a dict or its JSON text); ValueError when the
    schema is not one llguidance can compile (an unknown type, a bad $ref, ...). The output
    is laid out as JSON_LAYOUT says."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
    if not isinstance(schema, dict):
        raise ValueError(f"a JSON schema must be an object, got {type(schema).__name__}")
    try:
        grammar = _llg().LLMatcher.grammar_from_json_schema(schema, defaults=JSON_LAYOUT)
    except Exception as e:    # noqa: BLE001
        raise ValueError(f"invalid JSON schema: {e}") from None
    try:
        return check_grammar(grammar)
    except ValueError as e:
        raise ValueError(str(e).replace("invalid grammar", "invalid JSON schema")) from None


def json_object_grammar() -> str:
    """Any JSON object (OpenAI's response_format {"type": "json_object"})."""
    return json_schema_grammar({"type": "object"})


THINK_END = "</think>"


def after_thinking(schema: dict | str) -> str:
    """A thinking model's grammar for a JSON reply: free reasoning text up to the first
    `</think>` (the chat template opened `<think>` in the prompt), a blank line, then JSON
    following the schema (laid out as JSON_LAYOUT says). The reasoning cannot contain
    `</think>` before its end. (`suffix=`, not `stop=`: llguidance cannot roll back a
    `stop=` lexeme, and speculative decoding rolls the matcher back after every step.)"""
    json_schema_grammar(schema)          # the schema's own errors, named as such
    if isinstance(schema, str):
        schema = json.loads(schema)
    schema = {**schema, "x-guidance": {**JSON_LAYOUT, **schema.get("x-guidance", {})}}
    lark = (f'start: think "\\n\\n" json\n'
            f'think[suffix={json.dumps(THINK_END)}]: /(?s:.*)/\n'
            f'json: %json {json.dumps(schema)}\n')
    return check_grammar(_llg().LLMatcher.grammar_from_lark(lark))


# ------------------------------------------------------------------------------ tokenizer
def make_tokenizer(source: Any, vocab_size: int, eos_ids) -> Any:
    """An llguidance LLTokenizer over vocab_size ids (the model's: ids past the tokenizer's own
    are padding rows, never allowed) with the engine's EOS ids as its EOS tokens.

    source: an LLTokenizer (returned as is), a path to a tokenizer.json or a checkpoint folder,
    an mtpjax.text.Tokenizer or a `tokenizers.Tokenizer`."""
    llg = _llg()
    if isinstance(source, llg.LLTokenizer):
        return source
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        if os.path.isdir(path):
            path = os.path.join(path, "tokenizer.json")
        with open(path) as f:
            text = f.read()
    else:
        tok = getattr(source, "_tok", source)       # text.Tokenizer wraps tokenizers.Tokenizer
        if not hasattr(tok, "to_str"):
            raise TypeError(f"cannot build a grammar tokenizer from {type(source).__name__}")
        text = tok.to_str()
    eos = [int(i) for i in eos_ids]
    return llg.LLTokenizer(text, n_vocab=int(vocab_size), eos_token=eos or None)


# ------------------------------------------------------------------------------ constraint
class Constraint:
    """One request's grammar state on the host: an llguidance matcher over the tokens the
    request has emitted (see the module docstring)."""

    def __init__(self, tokenizer, grammar: str, vocab_size: int):
        llg = _llg()
        self.matcher = llg.LLMatcher(tokenizer, grammar, log_level=0)
        if self.matcher.is_error():
            raise ValueError(f"invalid grammar: {self.matcher.get_error()}")
        self.words = words(vocab_size)

    def _fill(self, row: np.ndarray) -> None:
        self.matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.size * row.itemsize)

    def mask(self) -> np.ndarray:
        """The packed mask (int32 [words]) of the next token."""
        row = np.zeros(self.words, np.int32)
        self._fill(row)
        return row

    def step_masks(self, drafts, stops=frozenset()) -> np.ndarray:
        """int32 [len(drafts) + 1, words]: row j masks the token after the emitted tokens and
        drafts[:j]. Past a draft that row j-1 disallows, or a stop token, the rows are
        all-allowed (they can never be emitted). The matcher is left as it was."""
        return self._walk([int(t) for t in drafts], None, stops)

    def masked_drafts(self, drafts, candidates, stops=frozenset()):
        """(drafts, step_masks of them): the drafts with each one the grammar forbids replaced
        by the first of its candidates (int [len(drafts), c], best first, -1: none) the
        grammar allows after the drafts before it, or, when none is and the grammar allows
        exactly one token there, by that token; left as it was when neither (verification
        rejects it). A draft is corrected only where it has candidates (a real draft).

        Why this is the masked draft: the first allowed of a draft's c best draft rows is the
        argmax of the draft logits masked by the grammar whenever any of the c is allowed (a
        better-scoring allowed token would be among them), and a lone allowed token is the
        masked argmax whatever the logits. The walk goes on after a correction: the later
        drafts were chained (on the device) from the unmasked token, so their candidates
        answer a slightly different context, but an allowed proposal can be accepted and a
        forbidden one never (any draft is lossless: verification samples from the masked
        target). The matcher is left as it was."""
        fixed = [int(t) for t in drafts]
        masks = self._walk(fixed, np.asarray(candidates), stops)
        return fixed, masks

    def _walk(self, drafts: list, candidates, stops):
        d = len(drafts)
        out = np.full((d + 1, self.words), -1, np.int32)
        n = 0
        try:
            for j in range(d + 1):
                self._fill(out[j])
                if j == d:
                    break
                t = drafts[j]
                if candidates is not None and not allowed(out[j], t) and candidates[j, 0] >= 0:
                    t = drafts[j] = _masked_choice(out[j], candidates[j], t)
                if t in stops or not allowed(out[j], t) or not self.matcher.consume_token(t):
                    break
                n += 1
        finally:
            if n and not self.matcher.rollback(n):
                raise RuntimeError(f"grammar rollback failed: {self.matcher.get_error()}")
        return out

    def consume(self, token: int) -> str | None:
        """Advance by an emitted token; None, or the error when the grammar rejects it."""
        if self.matcher.consume_token(int(token)) and not self.matcher.is_error():
            return None
        return f"the grammar rejected token {int(token)}: {self.matcher.get_error()}"

    @property
    def stopped(self) -> bool:
        """Nothing more can follow (e.g. a JSON value's end): the request is done."""
        return self.matcher.is_stopped()

    @property
    def accepting(self) -> bool:
        return self.matcher.is_accepting()


def _masked_choice(mask: np.ndarray, candidates, draft: int) -> int:
    """Constraint.masked_drafts' pick for a forbidden draft: the first candidate the packed
    mask allows, else the mask's only allowed token, else the draft."""
    for c in candidates:
        if c >= 0 and allowed(mask, int(c)):
            return int(c)
    nz = np.flatnonzero(mask)
    if len(nz) == 1:
        word = int(mask[nz[0]]) & 0xFFFFFFFF
        if word & (word - 1) == 0:                # one bit set: a forced token
            return int(nz[0]) * 32 + word.bit_length() - 1
    return draft


def allowed(mask: np.ndarray, token: int) -> bool:
    """Whether a packed mask (int32 [words]) allows token."""
    w = token >> 5
    return 0 <= w < mask.shape[-1] and bool((int(mask[w]) >> (token & 31)) & 1)


def unpack(mask: np.ndarray, vocab_size: int) -> np.ndarray:
    """bool [..., vocab_size] of a packed mask [..., words] (host side, tests)."""
    bits = np.unpackbits(np.ascontiguousarray(mask).view(np.uint8), axis=-1, bitorder="little")
    return bits[..., :vocab_size].astype(bool)


# ---------------------------------------------------------------------------- device side
def apply_bitmask(logits: jax.Array, mask: jax.Array) -> jax.Array:
    """logits [..., V] with the tokens a packed mask [..., ceil(V/32)] int32 disallows set to
    -inf. A row of all -1 words leaves its logits as they are."""
    V = logits.shape[-1]
    bits = jnp.repeat(mask, 32, axis=-1)[..., :V]
    shift = jnp.tile(jnp.arange(32, dtype=jnp.int32), mask.shape[-1])[:V]
    keep = jnp.bitwise_and(jnp.right_shift(bits, shift), 1) != 0
    return jnp.where(keep, logits, -jnp.inf)


def constrained(mask: jax.Array) -> jax.Array:
    """bool: whether a mask [B, k+1, W] disallows anything (some lane is constrained)."""
    return jnp.any(mask != -1)


# ------------------------------------------------------------------------------ tool calls
# JSON Schema keywords, as llguidance 1.9.1 treats them. ENFORCED: it compiles them into the
# grammar (its compiler refuses the keywords it knows and does not implement -- "not",
# "if"/"then"/"else", "uniqueItems", "contains", "propertyNames", "dependentRequired",
# "unevaluatedProperties", ... -- with "Unimplemented keys", and an unknown "format"; a oneOf it
# cannot prove equal to an anyOf). It passes over any other key without a word, so a tool
# schema keyword in neither set below is refused here by name (`unenforced_keyword`).
ENFORCED = frozenset({
    "type", "enum", "const", "anyOf", "oneOf", "allOf", "$ref", "$defs", "definitions",
    "properties", "required", "additionalProperties", "patternProperties", "minProperties",
    "maxProperties", "items", "prefixItems", "minItems", "maxItems", "minLength", "maxLength",
    "pattern", "format", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
    "multipleOf"})
# Keys that do not restrict a value (JSON Schema 2020-12 annotations, OpenAPI's nullable, which
# only widens a schema, and "x-" extensions): left to the prompt.
ANNOTATIONS = frozenset({
    "title", "description", "default", "examples", "deprecated", "readOnly", "writeOnly",
    "$comment", "$schema", "$id", "$anchor", "contentEncoding", "contentMediaType", "nullable"})
# Keywords that restrict only values of a type other than string: vacuous for a value written
# as raw text (always a string).
_NOT_STRING = frozenset({
    "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "items",
    "prefixItems", "minItems", "maxItems", "properties", "required", "additionalProperties",
    "patternProperties", "minProperties", "maxProperties"})
_TEXT = frozenset({"type", "enum", "const", "minLength", "maxLength", "pattern", "format"})
# `format` on a raw text value: RFC 3339 / 4122 / 2673 forms as regexes (ASCII digits); the
# other formats llguidance knows in JSON (email, hostname, ipv6, duration, uri, ...) are
# refused by name on raw text. tests/test_structured_output.py checks each against
# llguidance's own JSON-mode format on the same strings.
_OCTET = "(?:25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])"
_DATE = ("[0-9]{4}-(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])|(?:0[469]|11)-"
         "(?:0[1-9]|[12][0-9]|30)|02-(?:0[1-9]|[12][0-9]))")     # Feb 29 in any year
_TIME = ("(?:[01][0-9]|2[0-3]):[0-5][0-9]:(?:[0-5][0-9]|60)(?:\\.[0-9]+)?"
         "(?:[Zz]|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])")
TEXT_FORMATS = {
    "date": _DATE,
    "time": _TIME,
    "date-time": f"{_DATE}[Tt]{_TIME}",
    "uuid": "[0-9a-fA-F]{8}-(?:[0-9a-fA-F]{4}-){3}[0-9a-fA-F]{12}",
    "ipv4": f"(?:{_OCTET}\\.){{3}}{_OCTET}",
}
# The function's parameters schema: the call writes its properties as <parameter=...> elements.
_FUNCTION = frozenset({"type", "properties", "required", "additionalProperties", "$defs",
                       "definitions"})
# A raw text value ends at the first "</parameter>" (the parser's rule), and its call at the
# first "</tool_call>": a value holds neither.
PARAM_END = "\n</parameter>\n"
RAW_FORBIDDEN = ("</parameter>", "</tool_call>")


def _lark_str(s: str) -> str:
    return json.dumps(s)


def _avoiding(words) -> str:
    """A regex (llguidance's dialect, "/" escaped for a Lark /.../ literal) of the strings that
    contain none of words (each starts with "<" and has no other "<"). Written out as the
    automaton that tracks the longest begun word, not as `~/.*word.*/`: llguidance's lexer
    gives up ("too many expressions") on that negation beside a length bound and the
    PARAM_END suffix."""
    def esc(c):
        return "\\/" if c == "/" else ("\\" + c if c in "\\.^$|?*+()[]{}-&~#" else c)

    def branches(tails, closed):
        """After '<' and a begun word: the ways on. closed: back to no word begun (any
        character that begins no word continues); else the text may end here."""
        firsts = sorted({t[0] for t in tails})
        alts = ["[^<" + "".join(esc(c) for c in firsts) + "]"] if closed else []
        for c in firsts:
            rest = [t[1:] for t in tails if t[0] == c]
            if "" in rest:                     # the word would be complete
                continue
            inner = branches(rest, closed)
            alts.append(esc(c) + (f"(?:{inner})" if closed else f"(?:{inner})?"))
        return "|".join(alts)
    tails = [w[1:] for w in words]
    return (f"(?:[^<]|<+(?:{branches(tails, True)}))*"
            f"(?:<+(?:{branches(tails, False)})?)?")


def _is_note(key: str) -> bool:
    return key in ANNOTATIONS or key.startswith("x-")


def unenforced_keyword(schema: Any, path: str = "") -> tuple[str, str] | None:
    """(where, keyword) of the first keyword of a JSON schema (and its sub-schemas) that
    llguidance does not enforce and that is not an annotation; None when there is none."""
    if not isinstance(schema, dict):
        return None
    for key in schema:
        if not _is_note(key) and key not in ENFORCED:
            return path, key
    for key in ("properties", "patternProperties", "$defs", "definitions"):
        for name, sub in (schema.get(key) or {}).items():
            if (found := unenforced_keyword(sub, f"{path}.{key}.{name}")) is not None:
                return found
    for key in ("anyOf", "oneOf", "allOf", "prefixItems"):
        for j, sub in enumerate(schema.get(key) or ()):
            if (found := unenforced_keyword(sub, f"{path}.{key}[{j}]")) is not None:
                return found
    for key in ("additionalProperties", "items"):
        if (found := unenforced_keyword(schema.get(key), f"{path}.{key}")) is not None:
            return found
    return None


def _search_regex(pattern: str) -> str:
    """A Lark regex that matches the whole of a string iff JSON Schema's `pattern` (unanchored,
    as ECMA-262's RegExp.test) matches somewhere in it; ValueError for anchors this cannot
    place (inside groups or alternatives). The regex dialect is llguidance's (Rust regex)."""
    out, depth, in_class, bar, anchors, i = [], 0, False, False, [], 0
    while i < len(pattern):
        c = pattern[i]
        if c == "\\" and i + 1 < len(pattern):
            out.append(pattern[i:i + 2])
            i += 2
            continue
        if in_class:
            in_class = c != "]"
        elif c == "[":
            in_class = True
        elif c == "(":
            depth += 1
        elif c == ")":
            depth -= 1
        elif c == "|" and depth == 0:
            bar = True
        elif c in "^$":
            anchors.append(i)
        out.append({"/": "\\/", "\n": "\\n", "\r": "\\r"}.get(c, c))
        i += 1
    start = 0 in anchors and pattern[0] == "^"
    end = len(pattern) - 1 in anchors and pattern[-1] == "$"
    inner = set(anchors) - ({0} if start else set()) - ({len(pattern) - 1} if end else set())
    if inner or (bar and (start or end)):
        raise ValueError("anchors (^, $) only at the very start or end of the whole pattern "
                         "can be enforced")
    core = "".join(out[1 if start else 0:len(out) - 1 if end else len(out)])
    return ("" if start else "(?s:.*)") + f"(?:{core})" + ("" if end else "(?s:.*)")


def _text_values(schema: dict) -> list | None:
    if "enum" in schema:
        return list(schema["enum"]) if isinstance(schema["enum"], list) else None
    return [schema["const"]] if "const" in schema else None


def _text_rule(rule: str, head: str, where: str, schema: dict) -> str:
    """Lark of a parameter written as raw text: any text (newlines, "<" and all) but the
    closing tags RAW_FORBIDDEN, ended by PARAM_END (a `suffix=` lexeme: it ends at the first
    PARAM_END, and it rolls back, which a `stop=` lexeme does not), within the schema's
    minLength / maxLength (characters), `pattern` and `format` (TEXT_FORMATS); or one of its
    enum / its const (those of them the other keywords allow)."""
    for key in schema:
        if not (_is_note(key) or key in _TEXT or key in _NOT_STRING):
            raise ValueError(f"{where}: keyword {key!r} cannot be enforced on a string "
                             "parameter, which the call writes as raw text")
    fmt = schema.get("format")
    if fmt is not None and fmt not in TEXT_FORMATS:
        raise ValueError(f"{where}: keyword 'format' {fmt!r} cannot be enforced on a string "
                         f"parameter, which the call writes as raw text (these can: "
                         f"{', '.join(TEXT_FORMATS)}; or write a 'pattern')")
    lo, hi = schema.get("minLength", 0), schema.get("maxLength")
    for name, v in (("minLength", lo), ("maxLength", hi)):
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
            raise ValueError(f"{where}: {name!r} must be an integer >= 0, got {v!r}")
    pattern = schema.get("pattern")
    if pattern is not None and not isinstance(pattern, str):
        raise ValueError(f"{where}: 'pattern' must be a string, got {pattern!r}")
    values = _text_values(schema)
    if values is not None:
        import re
        ok = [v for v in values if isinstance(v, str) and lo <= len(v) <= (hi if hi is not None
              else len(v)) and (pattern is None or re.search(pattern, v))
              and (fmt is None or re.fullmatch(TEXT_FORMATS[fmt], v))]
        if not ok:
            raise ValueError(f"{where}: none of its enum / const values is a string its "
                             "schema allows")
        bad = [v for v in ok if any(f in v for f in RAW_FORBIDDEN)]
        if bad:
            raise ValueError(f"{where}: enum / const value {bad[0]!r} holds a closing tag and "
                             "cannot be written as raw text")
        alts = " | ".join(_lark_str(v) for v in ok)
        return f'{rule}: {_lark_str(head)} ({alts}) {_lark_str(PARAM_END)}\n'
    parts = [f"/(?s:.{{{lo},{'' if hi is None else hi}}})/" if lo or hi is not None
             else "/(?s:.*)/"]
    if pattern is not None:
        try:
            regex = _search_regex(pattern)
            check_grammar(_llg().LLMatcher.grammar_from_lark(f"start: v\nv: /{regex}/\n"))
        except ValueError as e:
            why = [ln for ln in str(e).splitlines() if ln.startswith("error:")]
            raise ValueError(f"{where}: 'pattern' {pattern!r} cannot be enforced: "
                             f"{why[0] if why else str(e).splitlines()[0]}") from None
        parts.append(f"/{regex}/")
    if fmt is not None:
        parts.append(f"/{TEXT_FORMATS[fmt]}/")
    parts.append(f"/{_avoiding(RAW_FORBIDDEN)}/")
    return (f'{rule}: {_lark_str(head)} {rule}_v\n'
            f'{rule}_v[suffix={_lark_str(PARAM_END)}]: {" & ".join(parts)}\n')


def _param_rule(rule: str, fname: str, pname: str, schema: Any, defs: dict) -> str:
    """Lark for one qwen3_coder `<parameter=P>` element: a value written as raw text
    (serving.tool_parser.written_as_text: a string type, or no type and no composition) is
    `_text_rule`'s; any other is JSON following its schema (with the parameters' $defs, for
    its $refs), llguidance's %json, what serving.tool_parser.convert_value reads back.
    ValueError naming the tool, the parameter and the keyword that cannot be enforced."""
    from mtpjax.serving.tool_parser import written_as_text
    where = f"tool {fname!r}, parameter {pname!r}"
    if schema is True or schema == {}:
        schema = {}
    if not isinstance(schema, dict):
        raise ValueError(f"{where}: its schema must be an object, got {json.dumps(schema)}")
    head = f"<parameter={pname}>\n"
    if written_as_text(schema):
        return _text_rule(rule, head, where, schema)
    sub = {**schema, "x-guidance": {**JSON_LAYOUT, **schema.get("x-guidance", {})}}
    for key, value in defs.items():
        sub.setdefault(key, value)
    found = unenforced_keyword(sub)
    if found is not None:
        raise ValueError(f"{where}: keyword {found[1]!r}{' at ' + found[0] if found[0] else ''}"
                         " cannot be enforced (llguidance does not implement it)")
    try:
        json_schema_grammar(sub)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    return (f'{rule}: {_lark_str(head)} {rule}_v {_lark_str(PARAM_END)}\n'
            f'{rule}_v: %json {json.dumps(sub)}\n')


def _function_rules(i: int, fname: str, params: Any) -> list[str]:
    """Lark of `<function=NAME>`, the parameters in the schema's order (the required ones,
    any of the others), `</function>` (rule f{i}); ValueError naming what cannot be enforced."""
    if not isinstance(params, dict):
        raise ValueError(f"tool {fname!r}: parameters must be a JSON schema object")
    for key in params:
        if not (_is_note(key) or key in _FUNCTION):
            raise ValueError(f"tool {fname!r}: parameters keyword {key!r} cannot be enforced "
                             "on a tool call (one <parameter=...> element per property)")
    props = params.get("properties") or {}
    required = params.get("required") or []
    missing = [r for r in required if r not in props]
    if missing:
        raise ValueError(f"tool {fname!r}: 'required' names {missing[0]!r}, which is not one "
                         "of its 'properties' (a call writes only those)")
    defs = {k: params[k] for k in ("$defs", "definitions") if k in params}
    rules, parts = [], []
    for j, (pname, ps) in enumerate(props.items()):
        if not isinstance(pname, str) or not pname or any(c in pname for c in "<>\n"):
            raise ValueError(f"tool {fname!r}: parameter name {pname!r} cannot be written "
                             "as a qwen3_coder <parameter=...> tag")
        rule = f"p{i}_{j}"
        rules.append(_param_rule(rule, fname, pname, ps, defs))
        parts.append(rule if pname in required else f"{rule}?")
    rules.append(f'f{i}: {_lark_str(f"<function={fname}>" + chr(10))} {" ".join(parts)} '
                 '"</function>\\n"\n')
    return rules


def tool_call_grammar(tools: list[dict], name: str | None = None, thinking: bool = False,
                      parallel: bool = False, auto: bool = False,
                      content: dict | None = None) -> str:
    """The grammar of qwen3_coder XML tool calls (serving/tool_parser.py's format) of `tools`
    (OpenAI tool dicts), or of the function `name`: `<tool_call>`, `<function=NAME>`, the
    schema's required parameters and any of its optional ones, in the schema's order, each
    value following its schema (`_param_rule`), `</function>`, `</tool_call>`.

    One call; with parallel, one or more, separated by a newline as the chat template writes
    an assistant's calls (the model ends the reply after any of them). With auto (tool_choice
    "auto" with a strict tool, or with a response_format), the calls are optional: the reply
    is either free text without `<tool_call>`, or free text and then the calls -- or, with
    content (a JSON schema: the response_format's), either that JSON or the calls. With
    thinking, free reasoning up to `</think>` and a blank line come first. ValueError for an
    unknown name, or naming the tool, parameter and keyword that cannot be enforced."""
    fns = {t["function"]["name"]: t["function"].get("parameters") or {} for t in tools}
    if name is not None:
        if name not in fns:
            raise ValueError(f"no tool named {name!r} among {sorted(fns)}")
        fns = {name: fns[name]}
    if not fns:
        raise ValueError("tool calls need at least one tool")
    rules = []
    for i, (fname, params) in enumerate(fns.items()):
        rules += _function_rules(i, fname, params)
    fn = " | ".join(f"f{i}" for i in range(len(fns)))
    more = ' ("\\n" call)*' if parallel else ""
    lark = (f'calls: call{more}\n'
            f'call: "<tool_call>\\n" fn "</tool_call>"\n'
            f'fn: {fn}\n')
    if not auto:
        reply = "calls"
    elif content is not None:
        json_schema_grammar(content)          # the schema's own errors, named as such
        content = {**content, "x-guidance": {**JSON_LAYOUT, **content.get("x-guidance", {})}}
        reply = "reply"
        lark += f'reply: content | calls\ncontent: %json {json.dumps(content)}\n'
    else:
        # text without a call, or text up to the first "<tool_call>" (a suffix= lexeme: no
        # "<tool_call>" before it, as the parser takes the first one) and then the calls
        reply = "reply"
        no_call = f"/{_avoiding(['<tool_call>'])}/"
        lark += (f'reply: TEXT? | pre fn "</tool_call>"{more}\n'
                 f'TEXT: /(?s:.+)/ & {no_call}\n'
                 f'pre[suffix="<tool_call>\\n"]: {no_call}\n')
    if thinking:
        start = (f'start: think "\\n\\n" {reply}\n'
                 f'think[suffix={_lark_str(THINK_END)}]: /(?s:.*)/\n')
    else:
        start = f"start: {reply}\n"
    lark = start + lark + "".join(rules)
    return check_grammar(_llg().LLMatcher.grammar_from_lark(lark))
