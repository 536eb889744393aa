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
def _lark_str(s: str) -> str:
    return json.dumps(s)


def _param_rule(rule: str, pname: str, schema: Any) -> str:
    """Lark for one qwen3_coder `<parameter=P>` element: a string parameter's value is text
    without "<" up to the closing tag (one of its `enum` / its `const` when the schema has
    them, within its minLength / maxLength when it has those: then a newline, which the parser
    drops, before the tag); any other type's is JSON following its schema (what
    serving.tool_parser.convert_value reads back)."""
    types = schema.get("type") if isinstance(schema, dict) else None
    types = set(types) if isinstance(types, list) else ({types} if types else set())
    head = _lark_str(f"<parameter={pname}>\n")
    tail = '"\\n</parameter>\\n"'
    if not types or "string" in types:     # free text without "<" (the closing tag's)
        values = schema.get("enum") if "enum" in schema else (
            [schema["const"]] if "const" in schema else None)
        if isinstance(values, list) and values and all(isinstance(v, str) for v in values) \
                and types <= {"string"}:
            return f'{rule}: {head} ({" | ".join(_lark_str(v) for v in values)}) {tail}\n'
        lo, hi = schema.get("minLength"), schema.get("maxLength")
        if types == {"string"} and (isinstance(lo, int) or isinstance(hi, int)):
            lo = lo if isinstance(lo, int) and lo > 0 else 0
            hi = f"{hi}" if isinstance(hi, int) and hi >= 0 else ""
            # The value and its closing newline are one lexeme: with the newline in the tail,
            # the lexer (greedy) would take a newline after a short value into the value and
            # the value could only end at maxLength.
            return f'{rule}: {head} /[^<]{{{lo},{hi}}}\\n/ "</parameter>\\n"\n'
        return f'{rule}: {head} /[^<]*/ "</parameter>\\n"\n'
    sub = {**schema, "x-guidance": {**JSON_LAYOUT, **schema.get("x-guidance", {})}}
    return (f'{rule}: {head} {rule}_v {tail}\n'
            f'{rule}_v: %json {json.dumps(sub)}\n')


def tool_call_grammar(tools: list[dict], name: str | None = None,
                      thinking: bool = False, parallel: bool = False) -> str:
    """The grammar of one qwen3_coder XML tool call (serving/tool_parser.py's format) of one of
    `tools` (OpenAI tool dicts), or of the function `name`: `<tool_call>`, `<function=NAME>`,
    the schema's required parameters and any of its optional ones, in the schema's order, each
    value following its schema, `</function>`, `</tool_call>`. With parallel, one or more such
    calls (each of any of the tools), separated by a newline as the chat template writes an
    assistant's calls; the model ends the reply after any of them. With thinking, free
    reasoning up to `</think>` and a blank line come first. ValueError for an unknown name or
    a schema llguidance cannot compile."""
    fns = {t["function"]["name"]: t["function"].get("parameters") or {} for t in tools}
    if name is not None:
        if name not in fns:
            raise ValueError(f"no tool named {name!r} among {sorted(fns)}")
        fns = {name: fns[name]}
    if not fns:
        raise ValueError("tool calls need at least one tool")
    rules, alts = [], []
    for i, (fname, params) in enumerate(fns.items()):
        props = params.get("properties") or {}
        required = set(params.get("required") or ())
        if params.get("additionalProperties", True) is not False and not props:
            props = {}
        parts = []
        for j, (pname, ps) in enumerate(props.items()):
            if not isinstance(pname, str) or not pname or any(c in pname for c in "<>\n"):
                raise ValueError(f"tool {fname!r}: parameter name {pname!r} cannot be written "
                                 "as a qwen3_coder <parameter=...> tag")
            if isinstance(ps, dict) and ps.get("type") not in (None, "string"):
                json_schema_grammar(ps)          # the parameter's schema compiles
            rule = f"p{i}_{j}"
            rules.append(_param_rule(rule, pname, ps if isinstance(ps, dict) else {}))
            parts.append(rule if pname in required else f"{rule}?")
        head = _lark_str(f"<function={fname}>\n")
        rules.append(f'f{i}: {head} {" ".join(parts)} "</function>\\n"\n')
        alts.append(f"f{i}")
    call = f'call: "<tool_call>\\n" ({" | ".join(alts)}) "</tool_call>"\n'
    if parallel:
        call += 'calls: call ("\\n" call)*\n'
    calls = "calls" if parallel else "call"
    if thinking:
        start = (f'start: think "\\n\\n" {calls}\n'
                 f'think[suffix={_lark_str(THINK_END)}]: /(?s:.*)/\n')
    else:
        start = f"start: {calls}\n"
    lark = start + call + "".join(rules)
    return check_grammar(_llg().LLMatcher.grammar_from_lark(lark))
