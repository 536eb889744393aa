"""A request body -> what the engine runs: prompt ids, `SamplingParams`, stop strings.

Pure functions of (body, limits, tokenizer, chat template); every problem is an `APIError`
(400 naming the field, 404 for an unknown model) raised before the engine sees the request.
The order: the model name (404 first, as OpenAI and vLLM answer), the body's shape and values
(`protocol`), the chat rendered with the checkpoint's template (`chat_template`), then the
checks that need the engine's sizes: token ids inside the vocabulary, prompt + max_tokens
inside the context.

Sampling defaults: the checkpoint's generation_config.json (`ServerLimits.defaults`,
mtpjax/generation_config.py: temperature, top_p, top_k and the penalties a request leaves out;
OpenAI's temperature 1.0, top_p 1.0, top_k off without one), seed random (a request
with a seed gets the tokens `TextEngine` gives the same prompt and seed), max_tokens the rest
of the context for chat and 16 for completions. Chat stops on the tokenizer's `<|im_end|>` /
`<|endoftext|>` as well. Tools: with tool_choice "auto" (the default) the template renders them
and `ParsedRequest.tools` asks the app to parse calls; "none" renders the chat without them.
"required" and a named function render and parse as "auto", and the request's grammar is
qwen3_coder tool calls (one or more of any of the tools with parallel_tool_calls, OpenAI's
default, else one; one call of the named function) whose arguments follow the
function's parameters schema, after free reasoning when thinking is on (`tool_grammar`,
grammar.tool_call_grammar): the reply is that call, finish_reason "tool_calls" (a call cut
off by max_tokens: the arguments so far, "length"; `ParsedRequest.forced_call`). "auto" with a
`strict` tool, or with a response_format, is constrained too: free text or text and then
calls, or that JSON or calls. A schema keyword the grammar cannot enforce is a 400 on 'tools'
naming the tool, the parameter and the keyword.
Structured output: `response_format` json_object / json_schema becomes the request's grammar
(`response_grammar`, SamplingParams.grammar): the content is JSON (following the schema),
after free reasoning when thinking is on; a schema llguidance cannot compile is a 400 on
'response_format'.
"""

from __future__ import annotations

import dataclasses
import secrets
from typing import Any

from mtpjax.generation_config import SamplingDefaults
from mtpjax.sampling import SamplingParams
from mtpjax.serving.chat_template import ChatTemplate, ChatTemplateError, \
    TemplateVariableError
from mtpjax.serving.protocol import APIError, ChatCompletionRequest, CompletionRequest, \
    validate_request


@dataclasses.dataclass(frozen=True)
class ServerLimits:
    """What request checks need to know about the engine."""
    model: str
    vocab_size: int
    max_seq_len: int
    defaults: SamplingDefaults = SamplingDefaults()   # what a request leaves out


@dataclasses.dataclass(frozen=True)
class ParsedRequest:
    prompt_ids: list[int]
    params: SamplingParams
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    enable_thinking: bool | None  # chat only; None for completions
    skip_special_tokens: bool
    tools: list[dict] | None = None   # chat with tools (not "none"): parse calls for these
    n: int = 1                        # choices: sibling requests with seeds seed + i
    parallel_tool_calls: bool = True  # several calls may be returned (else only the first)
    forced_call: bool = False         # tool_choice "required" / named: the reply is calls
    forced_name: str | None = None    # the named tool_choice's function

    def sibling_params(self) -> list[SamplingParams]:
        """The SamplingParams of the n choices: choice i samples with seed + i (mod 2**32),
        so choice 0 is the request alone and choice i the request with seed + i; submitted
        together, they prefill the prompt once (the scheduler's `_awaits_prefix`)."""
        p = self.params
        return [dataclasses.replace(p, seed=(p.seed + i) % 2 ** 32) for i in range(self.n)]


def check_model(body: Any, limits: ServerLimits) -> None:
    """404 for a model this server does not serve (a missing model is the 400 of protocol)."""
    model = body.get("model") if isinstance(body, dict) else None
    if isinstance(model, str) and model and model != limits.model:
        raise APIError(f"The model '{model}' does not exist; this server serves "
                       f"'{limits.model}'", "model", "model_not_found", status=404)


def sampling_params(req: ChatCompletionRequest | CompletionRequest, prompt_len: int,
                    limits: ServerLimits, max_field: str, max_tokens: int | None,
                    default_max: int | None, prompt_field: str,
                    stop_token_ids: tuple[int, ...] = (),
                    grammar: str | None = None) -> SamplingParams:
    """SamplingParams of a validated request. max_tokens: what the client asked for (None:
    default_max, capped by the context; None again: the rest of the context)."""
    room = limits.max_seq_len - prompt_len
    if room < 1:
        raise APIError(f"This model's maximum context length is {limits.max_seq_len} tokens; "
                       f"the prompt has {prompt_len}", prompt_field, "context_length_exceeded")
    if max_tokens is not None and max_tokens > room:
        raise APIError(f"This model's maximum context length is {limits.max_seq_len} tokens; "
                       f"the prompt has {prompt_len} and {max_field} = {max_tokens} asks for "
                       f"{prompt_len + max_tokens}", max_field, "context_length_exceeded")
    bias = req.logit_bias or {}
    bad = [t for t in bias if not 0 <= t < limits.vocab_size]
    if bad:
        raise APIError(f"'logit_bias' token id {bad[0]} is outside the vocabulary "
                       f"[0, {limits.vocab_size})", "logit_bias")
    d = limits.defaults
    pick = lambda v, default: default if v is None else v
    return SamplingParams(temperature=pick(req.temperature, d.temperature),
                          top_k=max(pick(req.top_k, d.top_k), 0), top_p=pick(req.top_p, d.top_p),
                          max_new_tokens=max_tokens if max_tokens is not None else
                          room if default_max is None else min(default_max, room),
                          seed=secrets.randbits(32) if req.seed is None else req.seed,
                          stop_token_ids=stop_token_ids, grammar=grammar,
                          logprobs=req.num_logprobs, logit_bias=tuple(sorted(bias.items())),
                          presence_penalty=pick(req.presence_penalty, d.presence_penalty),
                          frequency_penalty=pick(req.frequency_penalty, d.frequency_penalty),
                          repetition_penalty=pick(req.repetition_penalty, d.repetition_penalty))


def response_grammar(req: ChatCompletionRequest) -> str | None:
    """The grammar of a chat request's response_format (None: free text): any JSON object, or
    JSON following the json_schema's schema; with thinking on, free reasoning up to
    `</think>` first (mtpjax/grammar.py). 400 on 'response_format' for a schema llguidance
    cannot compile."""
    rf = req.response_format
    if rf is None or rf.type == "text":
        return None
    from mtpjax import grammar
    schema = {"type": "object"} if rf.type == "json_object" else rf.json_schema.schema_or_any
    try:
        return (grammar.after_thinking(schema) if req.enable_thinking
                else grammar.json_schema_grammar(schema))
    except ValueError as e:
        where = "response_format" if rf.type == "json_object" else \
            "response_format.json_schema.schema"
        raise APIError(f"'{where}': {e}", "response_format") from None


def tool_grammar(req: ChatCompletionRequest) -> str | None:
    """The grammar of a chat request's tools (None: no tools, "none", or "auto" with neither a
    strict tool nor a response_format: calls are parsed out of free text, not constrained).

    * tool_choice "required" / a named function: qwen3_coder tool calls, one or more of any of
      the tools ("required" with parallel_tool_calls, OpenAI's default) or one (of the named
      function, or parallel_tool_calls false);
    * "auto" with a tool whose `strict` is true: free text without `<tool_call>`, or free
      text and then such calls (every call in the reply follows its function's schema);
    * "auto" with a response_format json_object / json_schema: that JSON, or such calls;

    after free reasoning up to `</think>` when thinking is on (grammar.tool_call_grammar).
    400 on 'tools' naming the tool, parameter and keyword a grammar cannot enforce; on
    'response_format' for its own schema."""
    tools = req.active_tools
    if not tools:
        return None
    forced, name = req.forced_tool
    rf = req.response_format
    content = None
    if rf is not None and rf.type != "text":
        response_grammar(req)              # the response_format's own errors, named as such
        content = {"type": "object"} if rf.type == "json_object" else \
            rf.json_schema.schema_or_any
    strict = any(t.function.strict for t in req.tools)
    if not (forced or strict or content is not None):
        return None
    from mtpjax import grammar
    try:
        return grammar.tool_call_grammar(tools, name, thinking=req.enable_thinking,
                                         parallel=req.parallel_calls, auto=not forced,
                                         content=content)
    except ValueError as e:
        raise APIError(f"'tools': {e}", "tools") from None


def render_chat(req: ChatCompletionRequest, template: ChatTemplate) -> str:
    """The prompt text of a validated chat request (400 on 'messages' when the template
    refuses the conversation, on 'chat_template_kwargs' when it refuses a variable)."""
    messages = [m.template_dict() for m in req.messages]
    try:
        template.check_variables(req.chat_template_kwargs)
        return template.render(messages, True, req.active_tools, req.chat_template_kwargs)
    except TemplateVariableError as e:
        raise APIError(f"'chat_template_kwargs': {e}", "chat_template_kwargs") from None
    except ChatTemplateError as e:
        raise APIError(f"'messages': the chat template refused them: {e}", "messages") from None


def parse_chat(body: Any, limits: ServerLimits, tokenizer,
               template: ChatTemplate) -> ParsedRequest:
    check_model(body, limits)
    req = validate_request(ChatCompletionRequest, body)
    ids = tokenizer.encode(render_chat(req, template))
    field, max_tokens = req.max_new_tokens
    params = sampling_params(req, len(ids), limits, field, max_tokens, None, "messages",
                             tokenizer.stop_ids(), tool_grammar(req) or response_grammar(req))
    return ParsedRequest(ids, params, req.stop, req.stream, req.include_usage,
                         req.enable_thinking, req.skip_special_tokens, req.active_tools,
                         req.n or 1, req.parallel_calls, *req.forced_tool)


def parse_completion(body: Any, limits: ServerLimits, tokenizer) -> ParsedRequest:
    check_model(body, limits)
    req = validate_request(CompletionRequest, body)
    if isinstance(req.prompt, str):
        ids = tokenizer.encode(req.prompt)
    else:
        ids = list(req.prompt)
        bad = [t for t in ids if not 0 <= t < limits.vocab_size]
        if bad:
            raise APIError(f"token id {bad[0]} in 'prompt' is outside the vocabulary "
                           f"[0, {limits.vocab_size})", "prompt")
    if not ids:
        raise APIError("'prompt' encodes to no tokens", "prompt")
    asked = req.max_tokens if "max_tokens" in req.model_fields_set else None
    params = sampling_params(req, len(ids), limits, "max_tokens", asked, req.max_tokens,
                             "prompt")
    return ParsedRequest(ids, params, req.stop, req.stream, req.include_usage, None,
                         req.skip_special_tokens, n=req.n or 1)
