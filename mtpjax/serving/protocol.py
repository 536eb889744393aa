"""The OpenAI request bodies as pydantic v2 models, and the OpenAI-style error.

Why strict models: a client (an agent framework, most often) that sends a field this server
does not implement must hear so, not get an answer that quietly ignored it. So every model
forbids unknown fields, and the OpenAI fields the engine does not implement yet are either left
out (a 400 "'suffix' is not supported by this server") or declared with only their
no-op value allowed (echo, best_of), which clients often send explicitly. `n` (1..MAX_N
choices: sibling requests, seeds seed, seed + 1, ...), `logprobs` / `top_logprobs` (chat;
completions: `logprobs` 0..5), `logit_bias` ({"token id": bias in [-100, 100]}, at most
300), `presence_penalty` / `frequency_penalty` (in [-2, 2]) and vLLM's `repetition_penalty`
(> 0) are implemented. Structured output: `response_format` {"type": "text" | "json_object" |
"json_schema"} (chat); the JSON ones constrain decoding with a grammar
(parsing.response_grammar, mtpjax/grammar.py), and so do `tool_choice` "required" and a named
function (parsing.tool_grammar): one grammar per request, so these do not go together (under
"auto" the two combine: the reply is the JSON or tool calls). `tools[].function.strict` true
constrains "auto" calls to their schemas (parsing.tool_grammar).
Validation is strict (no "1" -> 1, no true -> 1): a number is a JSON number.

`validate_request(cls, body)` turns the first pydantic error into an `APIError` (HTTP 400) whose
`param` is the top-level field and whose message names the field path, e.g.
"'temperature' must be a number in [0, 2], got 3" or "'messages[1].role': Input should be ...".
Checks that need the engine (context length, vocabulary, the model name) live in `parsing`.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, \
    field_validator, model_validator

# OpenAI (and vLLM) request fields this server knows of but does not implement: refused with
# "not supported" rather than "unknown". Any other extra field is refused as unknown.
NOT_SUPPORTED = frozenset({
    "audio", "function_call", "functions", "modalities",
    "prediction", "reasoning_effort",
    "suffix", "web_search_options", "verbosity",
    "min_p", "min_tokens",
    "ignore_eos", "stop_token_ids", "include_stop_str_in_output", "guided_json", "guided_regex",
    "guided_choice", "guided_grammar", "structured_outputs", "name", "continuous_usage_stats",
    "documents", "chat_template", "add_generation_prompt", "continue_final_message",
})


# OpenAI request fields that change nothing a self-hosted server returns: accepted (typed as
# OpenAI types them) and ignored, as vLLM does. `user` / `safety_identifier`: an end-user id
# for OpenAI's abuse monitoring; `metadata` / `store`: OpenAI's stored completions;
# `service_tier`: OpenAI's processing tier; `prompt_cache_key`: OpenAI's cache routing hint
# (this server's prefix cache keys on the tokens). README lists them.
IGNORED = frozenset({"user", "safety_identifier", "metadata", "store", "service_tier",
                     "prompt_cache_key"})


@dataclasses.dataclass
class APIError(Exception):
    """An OpenAI-style error: HTTP status and the body's error fields."""
    message: str
    param: str | None = None
    code: str | None = None
    status: int = 400
    type: str = "invalid_request_error"

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


# ------------------------------------------------------------------------------ chat messages
class FunctionCall(_Strict):
    name: str = Field(min_length=1)
    # A JSON object, as a string (OpenAI) or already parsed; templates need the object.
    arguments: dict[str, Any]

    @field_validator("arguments", mode="before")
    @classmethod
    def parse_arguments(cls, v: Any) -> Any:
        if isinstance(v, str):
            try:
                v = json.loads(v) if v.strip() else {}
            except json.JSONDecodeError as e:
                raise ValueError(f"arguments must be a JSON object, got invalid JSON ({e})")
        if not isinstance(v, dict):
            raise ValueError(f"arguments must be a JSON object, got {json.dumps(v)[:80]}")
        return v


class ToolCall(_Strict):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


def _text_of(v: Any) -> Any:
    """A message content: a string, or the OpenAI list of {"type": "text", "text": ...} parts
    joined (images and other parts are refused: this server reads text only)."""
    if v is None or isinstance(v, str):
        return v
    if isinstance(v, list):
        texts = []
        for j, p in enumerate(v):
            if not (isinstance(p, dict) and p.get("type") == "text" and set(p) == {"type", "text"}
                    and isinstance(p["text"], str)):
                raise ValueError(f"content part {j}: only text parts {{\"type\": \"text\", "
                                 f"\"text\": ...}} are supported, got {json.dumps(p)[:80]}")
            texts.append(p["text"])
        return "".join(texts)
    raise ValueError(f"content must be a string or a list of text parts, got "
                     f"{json.dumps(v)[:80]}")


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = None
    reasoning_content: str | None = None   # assistant turns of a thinking model (vLLM's name)
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None        # tool turns: responses render in order, by position

    @field_validator("content", mode="before")
    @classmethod
    def join_text_parts(cls, v: Any) -> Any:
        return _text_of(v)

    @model_validator(mode="after")
    def fields_fit_the_role(self) -> "ChatMessage":
        if self.role != "assistant" and self.content is None:
            raise ValueError(f"a {self.role} message needs 'content'")
        if self.role == "assistant" and self.content is None and not self.tool_calls:
            raise ValueError("an assistant message needs 'content' or 'tool_calls'")
        for name in ("reasoning_content", "tool_calls"):
            if getattr(self, name) is not None and self.role != "assistant":
                raise ValueError(f"'{name}' belongs to assistant messages, not {self.role}")
        if self.tool_call_id is not None and self.role != "tool":
            raise ValueError(f"'tool_call_id' belongs to tool messages, not {self.role}")
        return self

    def template_dict(self) -> dict:
        """The message as chat templates read it: no None fields (transformers drops them too),
        tool call arguments as objects."""
        return self.model_dump(exclude_none=True)


# -------------------------------------------------------------------------------------- tools
class FunctionDefinition(_Strict):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None      # a JSON schema of an object
    # true: the arguments follow the schema exactly (forced calls always do; under "auto" a
    # strict tool makes the reply's calls follow their schemas: parsing.tool_grammar)
    strict: bool | None = None

    @field_validator("parameters", mode="after")
    @classmethod
    def an_object_schema(cls, v: dict | None) -> dict | None:
        if v is not None and v.get("type", "object") != "object":
            raise ValueError(f"parameters must be a JSON schema of type \"object\", got "
                             f"type {_show(v.get('type'))}")
        if v is not None and not isinstance(v.get("properties", {}), dict):
            raise ValueError("parameters.properties must be an object")
        return v


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str = Field(min_length=1)


class NamedToolChoice(_Strict):
    """tool_choice {"type": "function", "function": {"name": NAME}}: call NAME."""
    type: Literal["function"]
    function: NamedFunction


TOOL_CHOICES = ("none", "auto", "required")


# ------------------------------------------------------------------------- structured output
class JsonSchemaFormat(_Strict):
    """OpenAI's response_format.json_schema: the reply is JSON following `schema`. Decoding is
    always constrained by it (so `strict` false or absent is served as strict)."""
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None

    @property
    def schema_or_any(self) -> dict:
        return {"type": "object"} if self.schema_ is None else self.schema_


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def schema_with_its_type(self) -> "ResponseFormat":
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type \"json_schema\" needs 'json_schema': {\"name\": ..., "
                             "\"schema\": {...}}")
        if self.type != "json_schema" and self.json_schema is not None:
            raise ValueError(f"'json_schema' belongs to type \"json_schema\", not "
                             f"\"{self.type}\"")
        return self


# ----------------------------------------------------------------------------------- requests
class StreamOptions(_Strict):
    include_usage: bool = False


MAX_N = 16           # choices per request (`n`)


def _logit_bias(v: Any) -> Any:
    """OpenAI's logit_bias: {"token id": bias} -> a dict of int ids to float biases."""
    if v is None:
        return None
    if not isinstance(v, dict):
        raise ValueError(f"must be an object {{\"token id\": bias}}, got {_show(v)}")
    if len(v) > 300:
        raise ValueError(f"has {len(v)} entries, at most 300 are allowed")
    out = {}
    for key, bias in v.items():
        try:
            tid = int(key) if isinstance(key, str) and key.strip().lstrip("-").isdigit() \
                else None
        except ValueError:
            tid = None
        if tid is None or tid < 0:
            raise ValueError(f"keys must be token ids (strings of integers >= 0), got "
                             f"{_show(key)}")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) \
                or not -100 <= bias <= 100:
            raise ValueError(f"values must be numbers in [-100, 100], got {_show(bias)} for "
                             f"token id {key}")
        if tid in out:
            raise ValueError(f"names token id {tid} twice")
        out[tid] = float(bias)
    return out


def _stop(v: Any) -> Any:
    if v is None:
        return ()
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise ValueError("must be a non-empty string or a list of non-empty strings")
    return tuple(stops)


class _Sampling(_Strict):
    """Fields both routes share: the model, sampling, stop strings, streaming."""
    model: str = Field(min_length=1, description="a model id (see GET /v1/models)")
    # None (left out): the checkpoint's generation_config.json default (parsing,
    # mtpjax/generation_config.py), OpenAI's (1.0, 1.0, off) with --generation_config=none
    temperature: float | None = Field(None, ge=0.0, le=2.0, description="a number in [0, 2]")
    top_p: float | None = Field(None, gt=0.0, le=1.0, description="a number in (0, 1]")
    top_k: int | None = Field(None, ge=-1, description="-1, 0 (off) or a positive integer")
    seed: int | None = Field(None, ge=0, lt=2 ** 32, description="an integer in [0, 2**32)")
    stop: tuple[str, ...] = Field((), description="a non-empty string or a list of non-empty "
                                                  "strings")
    stream: bool = False
    stream_options: StreamOptions | None = None
    skip_special_tokens: bool = True       # vLLM extension: special tokens in the output text
    n: int | None = Field(None, ge=1, le=MAX_N, description=f"an integer in [1, {MAX_N}]")
    # {"token id": bias}: added to the logits before sampling (SamplingParams.logit_bias)
    logit_bias: dict[int, float] | None = None
    # penalties on tokens seen so far (SamplingParams.presence_penalty, ...): OpenAI's two,
    # on the output's tokens, and vLLM's repetition_penalty, on the prompt's and output's
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0, allow_inf_nan=False,
                                           description="a number in [-2, 2]")
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0, allow_inf_nan=False,
                                            description="a number in [-2, 2]")
    repetition_penalty: float | None = Field(None, gt=0.0, allow_inf_nan=False,
                                             description="a finite number > 0")
    # accepted and ignored (IGNORED): OpenAI's types, so a malformed one is still a 400
    user: str | None = Field(None, description="a string")
    safety_identifier: str | None = Field(None, description="a string")
    metadata: dict[str, str] | None = Field(None, description="an object of string values")
    store: bool | None = Field(None, description="a boolean")
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = Field(
        None, description="one of 'auto', 'default', 'flex', 'scale', 'priority'")
    prompt_cache_key: str | None = Field(None, description="a string")

    @field_validator("stop", mode="before")
    @classmethod
    def stop_as_tuple(cls, v: Any) -> Any:
        return _stop(v)

    @field_validator("logit_bias", mode="before")
    @classmethod
    def bias_by_id(cls, v: Any) -> Any:
        return _logit_bias(v)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1, description="a non-empty list of "
                                                                  "{role, content} objects")
    max_tokens: int | None = Field(None, ge=1, description="a positive integer")
    max_completion_tokens: int | None = Field(None, ge=1, description="a positive integer")
    # Template variables (vLLM's name), e.g. {"enable_thinking": false}.
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    # the chosen tokens' log probabilities (of the raw model distribution), and with
    # top_logprobs that many most likely tokens at each position
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20, description="an integer in [0, 20]")
    # Tool calling (qwen3_coder XML, `tool_parser`): "auto" (the default) renders the tools and
    # parses calls out of the output; "none" renders the chat without them (the model cannot
    # call what it is not shown) and parses nothing. "required" (a call of one of the tools)
    # and a named function (a call of that one) render and parse as "auto" and constrain
    # decoding to one such call whose arguments follow the function's parameters schema
    # (grammar.tool_call_grammar). parallel_tool_calls (OpenAI's default true): "required" may
    # make one or more calls (false: exactly one); a named function is always one call, as
    # OpenAI's; with "auto" and false, only the reply's first call is returned.
    tools: list[Tool] | None = None
    parallel_tool_calls: bool = True
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    response_format: ResponseFormat | None = None

    @field_validator("tool_choice", mode="before")
    @classmethod
    def a_known_choice(cls, v: Any) -> Any:
        if v is None or (isinstance(v, str) and v in TOOL_CHOICES):
            return v
        if isinstance(v, dict):
            try:
                return NamedToolChoice.model_validate(v)
            except ValidationError as e:
                err = e.errors(include_url=False)[0]
                where = _path(tuple(err["loc"]))
                raise ValueError(f"must be \"none\", \"auto\", \"required\" or {{\"type\": "
                                 f"\"function\", \"function\": {{\"name\": ...}}}}; "
                                 f"{where + ': ' if where else ''}"
                                 f"{err['msg'].removeprefix('Value error, ')}") from None
        raise ValueError(f"must be \"none\", \"auto\", \"required\" or {{\"type\": "
                         f"\"function\", \"function\": {{\"name\": ...}}}}, got {_show(v)}")

    @field_validator("tool_choice", mode="after")
    @classmethod
    def forced_calls_have_their_tool(cls, v: Any, info: ValidationInfo) -> Any:
        if v is None or v in ("none", "auto"):
            return v
        tools = info.data.get("tools")
        if "tools" not in info.data:      # the tools' own error is reported first
            return v
        what = "\"required\"" if v == "required" else f"function {v.function.name!r}"
        if not tools:
            raise ValueError(f"{what} needs 'tools' to call")
        names = [t.function.name for t in tools]
        if v != "required" and v.function.name not in names:
            raise ValueError(f"names function {v.function.name!r}, which is not one of "
                             f"'tools' ({', '.join(names)})")
        return v

    @field_validator("response_format", mode="after")
    @classmethod
    def one_grammar(cls, v: ResponseFormat | None, info: ValidationInfo) -> Any:
        choice = info.data.get("tool_choice")
        if v is not None and v.type != "text" and choice not in (None, "none", "auto"):
            raise ValueError(f"{v.type!r} cannot be combined with tool_choice "
                             f"{_show(choice if isinstance(choice, str) else choice.model_dump())}"
                             " (one grammar per request: the forced tool call's)")
        return v

    @property
    def forced_tool(self) -> tuple[bool, str | None]:
        """(whether decoding is constrained to a tool call, the function's name or None for
        any of the tools)."""
        c = self.tool_choice
        if isinstance(c, NamedToolChoice):
            return True, c.function.name
        return c == "required", None

    @property
    def parallel_calls(self) -> bool:
        """Whether the reply may hold several tool calls: parallel_tool_calls, and no named
        function (which OpenAI calls exactly once)."""
        return self.parallel_tool_calls and not isinstance(self.tool_choice, NamedToolChoice)

    @property
    def active_tools(self) -> list[dict] | None:
        """The tools the template renders and the output is parsed for (None: no tools)."""
        if not self.tools or self.tool_choice == "none":
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]

    @field_validator("top_logprobs", mode="after")
    @classmethod
    def top_needs_logprobs(cls, v: int | None, info: ValidationInfo) -> Any:
        if v is not None and v > 0 and not info.data.get("logprobs"):
            raise ValueError("needs 'logprobs': true")
        return v

    @property
    def num_logprobs(self) -> int | None:
        """SamplingParams.logprobs: None (off) or the top entries per token."""
        return (self.top_logprobs or 0) if self.logprobs else None

    @model_validator(mode="after")
    def one_max(self) -> "ChatCompletionRequest":
        if self.max_tokens is not None and self.max_completion_tokens is not None \
                and self.max_tokens != self.max_completion_tokens:
            raise ValueError("max_tokens and max_completion_tokens disagree; send one")
        return self

    @property
    def max_new_tokens(self) -> tuple[str, int | None]:
        """(the field the client used, its value or None)."""
        if self.max_completion_tokens is not None:
            return "max_completion_tokens", self.max_completion_tokens
        return "max_tokens", self.max_tokens

    @property
    def enable_thinking(self) -> bool:
        return self.chat_template_kwargs.get("enable_thinking", True)

    @field_validator("chat_template_kwargs", mode="after")
    @classmethod
    def thinking_is_bool(cls, v: dict) -> dict:
        if not isinstance(v.get("enable_thinking", True), bool):
            raise ValueError("needs a boolean 'enable_thinking'")
        return v


def _prompt(v: Any) -> Any:
    """A string or a list of token ids; a batch of one ([str] or [[ids]]) is that prompt."""
    if isinstance(v, list) and len(v) == 1 and isinstance(v[0], (str, list)):
        v = v[0]
    if isinstance(v, str) and v:
        return v
    if isinstance(v, list) and v and all(isinstance(t, int) and not isinstance(t, bool)
                                         for t in v):
        return v
    if v == "" or v == []:
        raise ValueError("is empty")
    raise ValueError("must be a string or a list of token ids (one prompt: no batches)")


class CompletionRequest(_Sampling):
    prompt: str | list[int] = Field(description="a string or a list of token ids")
    max_tokens: int = Field(16, ge=1, description="a positive integer")
    echo: Literal[False] | None = Field(None, description="false (echo is not supported)")
    best_of: Literal[1] | None = Field(None, description="1 (best_of is not supported)")
    # the chosen tokens' log probabilities and the `logprobs` most likely at each position
    logprobs: int | None = Field(None, ge=0, le=5, description="an integer in [0, 5]")

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs

    @field_validator("prompt", mode="before")
    @classmethod
    def one_prompt(cls, v: Any) -> Any:
        return _prompt(v)


# --------------------------------------------------------------------------------- validation
def _path(loc: tuple) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _show(v: Any) -> str:
    try:
        return json.dumps(v)[:80]
    except (TypeError, ValueError):
        return repr(v)[:80]


def error_of(cls: type[BaseModel], err: dict) -> APIError:
    """The APIError for one pydantic error of a request model: param is the top-level field."""
    loc = tuple(err["loc"])
    param = str(loc[0]) if loc else None
    path = _path(loc)
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] == "extra_forbidden":
        name = str(loc[-1])
        why = "is not supported by this server" if name in NOT_SUPPORTED or len(loc) > 1 \
            else "is not a field of this request"
        return APIError(f"'{path}' {why}", param, "unsupported_field")
    if err["type"] == "missing":
        return APIError(f"'{path}' is required", param)
    if err["type"] == "value_error" and len(loc) == 1:     # our validators: "must be ..."
        return APIError(f"'{path}' {msg}", param)
    field = cls.model_fields.get(param) if len(loc) == 1 else None
    if field is not None and field.description:
        return APIError(f"'{path}' must be {field.description}, got {_show(err.get('input'))}",
                        param)
    return APIError(f"'{path}': {msg}" if path else msg, param)


def validate_request(cls: type[BaseModel], body: Any) -> Any:
    """The request model of a parsed JSON body, or the APIError of its first problem."""
    if not isinstance(body, dict):
        raise APIError("the request body must be a JSON object", code="invalid_json")
    try:
        return cls.model_validate(body)
    except ValidationError as e:
        raise error_of(cls, e.errors(include_url=False)[0]) from None
