"""The OpenAI-compatible HTTP app (FastAPI) on one continuously running engine (`online`), and
`load_server`, which builds the engine, tokenizer and chat template from a `ServerConfig`.

Routes: `POST /v1/chat/completions` and `POST /v1/completions` (streaming with SSE, or not),
`GET /v1/models`, `GET /health` (200 "ok"; 503 "rebuilding" while the engine re-creates its
device state after a failed step, 503 "unavailable" while the breaker is open after
consecutive failed steps (faults.py), 503 "engine stopped"), `GET /metrics` (prometheus_client;
`metrics`).

Request flow:
  1. read the JSON body and parse it (`parsing`: pydantic models, the checkpoint's chat
     template, context checks); any problem -> HTTP 400 with an OpenAI-style body
     {"error": {"message", "type", "param", "code"}}, an unknown model -> 404;
  2. `OnlineEngine.add` and wait until the engine took it (its own checks, e.g. prompt too long,
     -> 400 before any byte of the response is sent);
  3. stream `Delta`s as SSE chunks or collect them; chat output goes through the reasoning
     split (`<think>...</think>` -> `reasoning_content`, as vLLM's qwen3 parser), then, for a
     request with tools (tool_choice "auto", "required" or a named function: the last two
     decode under the tool-call grammar, so the call parses and its arguments follow the
     schema), the tool-call parser (`tool_parser`: qwen3_coder
     XML -> `tool_calls`, finish_reason "tool_calls"; a forced call cut off by max_tokens:
     the arguments so far, finish_reason "length", no markup in content); a
     `response_format` json_object / json_schema request decodes under its grammar
     (mtpjax/grammar.py), so its content is JSON;
  4. a client that disconnects cancels its request: its pages return at the next engine step.

`n` > 1: the request becomes n sibling engine requests submitted together (choice i samples
with seed + i, `ParsedRequest.sibling_params`); with the prefix cache on (the default) the
first prefills the prompt and the others wait for its entry at the prompt's last page boundary
and prefill only the tokens after it (scheduler `_awaits_prefix`); the body has n choices
(index 0..n-1), a stream interleaves the choices' chunks as they come (`merged_chunks`), usage
counts the prompt once and every choice's tokens. Usage has `prompt_tokens_details.
cached_tokens` (the prompt tokens the prefix cache served), streamed or not. `logprobs`
(chat: logprobs + top_logprobs; completions: logprobs 0..5) come from the engine
(SamplingParams.logprobs: the raw model distribution's, exact under speculation) in OpenAI's
shapes (`chat_logprobs`, `completion_logprobs`); streamed, each chunk carries its tokens'.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import secrets
import time
from typing import Any, AsyncIterator, Callable

from fastapi import Request   # at module level: FastAPI resolves the handlers' annotations here

from mtpjax.generation_config import SamplingDefaults
from mtpjax.serving import metrics as metrics_lib
from mtpjax.serving.chat_template import ChatTemplate, load_chat_template
from mtpjax.serving.faults import BreakerConfig, FaultInjection, Unavailable
from mtpjax.serving.online import OnlineEngine, RequestHandle
from mtpjax.serving.parsing import ParsedRequest, ServerLimits, parse_chat, parse_completion
from mtpjax.serving.protocol import APIError
from mtpjax.serving.tool_parser import ToolCallStream, parse_tool_calls

FINISH = {"stop": "stop", "length": "length", "cancelled": "abort", "error": "error"}


# ------------------------------------------------------------------------ responses
def usage(out, more=()) -> dict:
    """OpenAI's usage of a request: the prompt once, the completion tokens of every choice,
    and prompt_tokens_details.cached_tokens, the prompt tokens the prefix cache served (the
    hit boundary; 0 on a miss). With n > 1 they are the first choice's, as the prompt is
    counted once: the other choices reuse what the first prefilled for this same request."""
    completion = out.completion_tokens + sum(o.completion_tokens for o in more)
    return {"prompt_tokens": out.prompt_tokens, "completion_tokens": completion,
            "total_tokens": out.prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": out.cached_tokens}}


# ------------------------------------------------------------------------ logprobs
def _token_text(tokenizer, token: int) -> str:
    if tokenizer is None:
        return str(token)
    return tokenizer.decode([token])


def chat_logprobs(records, tokenizer) -> dict | None:
    """OpenAI's chat choice.logprobs of engine TokenLogprobs: {"content": [{token, logprob,
    bytes, top_logprobs: [{token, logprob, bytes}]}]} (None when not asked)."""
    if records is None:
        return None

    def entry(t, lp):
        s = _token_text(tokenizer, t)
        return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}
    return {"content": [{**entry(r.token, r.logprob),
                         "top_logprobs": [entry(t, lp) for t, lp in r.top]} for r in records]}


def completion_logprobs(records, tokenizer, offset: int = 0) -> dict | None:
    """OpenAI's completions choice.logprobs: {tokens, token_logprobs, top_logprobs (one
    {token: logprob} object per position), text_offset (where each token's text starts in
    the choice's text, from `offset`)}."""
    if records is None:
        return None
    tokens, offsets = [], []
    for r in records:
        offsets.append(offset)
        tokens.append(_token_text(tokenizer, r.token))
        offset += len(tokens[-1])
    return {"tokens": tokens, "token_logprobs": [r.logprob for r in records],
            "top_logprobs": [{_token_text(tokenizer, t): lp for t, lp in r.top}
                             for r in records],
            "text_offset": offsets}


def chat_message(text: str, thinking: bool, tools: list[dict] | None = None,
                 parallel: bool = True, forced: bool = False,
                 forced_name: str | None = None) -> dict:
    """The assistant message of a generated text: the reasoning split first, then (with tools)
    the tool calls out of the content (`tool_parser`; all of them, indexes 0..n-1, or only the
    first when the request's parallel_tool_calls is false). forced (tool_choice "required" /
    the named function forced_name): a call cut off by max_tokens is a call with the
    arguments written so far, and no tool-call markup is left in the content."""
    from mtpjax.text import split_reasoning
    reasoning, content = split_reasoning(text, thinking)
    msg = {"role": "assistant", "content": content}
    if thinking:
        msg["reasoning_content"] = reasoning
    if tools:
        msg["content"], calls = parse_tool_calls(content or "", tools, partial=forced,
                                                 name=forced_name)
        calls = calls if parallel else calls[:1]
        if calls:
            msg["tool_calls"] = calls
    return msg


def finish_reason(out, called: bool, forced: bool = False) -> str:
    """OpenAI's finish_reason; "tool_calls" when the output called a tool (as vLLM: also when
    it ran into max_tokens after the call), but "length" for a forced call (tool_choice
    "required" / named) that max_tokens cut off: its arguments may be incomplete."""
    if forced and out.finish_reason == "length":
        return "length"
    if called and out.finish_reason in ("stop", "length"):
        return "tool_calls"
    return FINISH[out.finish_reason]


def sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _engine_error(out) -> APIError:
    return APIError(out.error or "engine error", status=500, type="server_error")


async def chat_chunks(handle: RequestHandle, req: ParsedRequest, head: dict, tokenizer=None,
                      index: int = 0, tail: bool = True) -> AsyncIterator[str]:
    """The SSE events of a streamed chat: a role chunk, reasoning/content/tool-call deltas, the
    finish chunk, usage (when asked), [DONE]. Content goes through the reasoning split, then
    (with tools) through the tool-call stream. With logprobs asked, each delta's tokens' log
    probabilities ride in the chunk of that delta (a chunk with an empty delta when its text
    is held back). index: the choice's; tail=False leaves out usage and [DONE] (n > 1: the
    caller adds them once)."""
    from mtpjax.text import ReasoningStream
    split = ReasoningStream(req.enable_thinking)
    calls = ToolCallStream(req.tools, req.forced_call, req.forced_name) if req.tools else None

    def chunk(delta, finish=None, logprobs=None):
        return sse({**head, "object": "chat.completion.chunk",
                    "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                                 "finish_reason": finish}]})

    def delta_of(reasoning, content, flush=False):
        tool_calls = []
        if calls is not None:
            content, tool_calls = calls.push(content)
            if flush:
                more, more_calls = calls.flush()
                content, tool_calls = content + more, tool_calls + more_calls
            if not req.parallel_tool_calls:   # the first call only (index 0)
                tool_calls = [c for c in tool_calls if c["index"] == 0]
        d = {}
        if reasoning:
            d["reasoning_content"] = reasoning
        if content:
            d["content"] = content
        if tool_calls:
            d["tool_calls"] = tool_calls
        return d

    yield chunk({"role": "assistant", "content": ""})
    async for d in handle:
        piece = delta_of(*split.push(d.text))
        lps = getattr(d, "logprobs", None)
        if piece or lps:
            yield chunk(piece, logprobs=chat_logprobs(lps, tokenizer))
    piece = delta_of(*split.flush(), flush=True)
    if piece:
        yield chunk(piece)
    out = handle.output
    if out.finish_reason == "error":
        yield sse(_engine_error(out).body())
    else:
        yield chunk({}, finish_reason(out, calls is not None and calls.num_calls > 0,
                                      req.forced_call))
        if req.include_usage and tail:
            yield sse({**head, "object": "chat.completion.chunk", "choices": [],
                       "usage": usage(out)})
    if tail:
        yield "data: [DONE]\n\n"


async def completion_chunks(handle: RequestHandle, req: ParsedRequest, head: dict,
                            tokenizer=None, index: int = 0,
                            tail: bool = True) -> AsyncIterator[str]:
    """The SSE events of a streamed completion (see chat_chunks for logprobs, index, tail)."""
    def chunk(text, finish=None, logprobs=None):
        return sse({**head, "object": "text_completion",
                    "choices": [{"index": index, "text": text, "logprobs": logprobs,
                                 "finish_reason": finish}]})

    offset = 0
    async for d in handle:
        lps = getattr(d, "logprobs", None)
        if d.text or lps:
            yield chunk(d.text, logprobs=completion_logprobs(lps, tokenizer, offset))
            offset += len(d.text)
    out = handle.output
    if out.finish_reason == "error":
        yield sse(_engine_error(out).body())
    else:
        yield chunk("", FINISH[out.finish_reason])
        if req.include_usage and tail:
            yield sse({**head, "object": "text_completion", "choices": [], "usage": usage(out)})
    if tail:
        yield "data: [DONE]\n\n"


async def merged_chunks(kind: str, handles: list, req: ParsedRequest, head: dict,
                        tokenizer=None) -> AsyncIterator[str]:
    """The SSE events of a streamed request with n choices: each choice's chunks (its index
    in them) interleaved as they come, then usage over all choices (when asked), [DONE]."""
    make = chat_chunks if kind == "chat" else completion_chunks
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i, h):
        try:
            async for event in make(h, req, head, tokenizer, i, tail=False):
                await queue.put(event)
        finally:
            await queue.put(None)
    tasks = [asyncio.ensure_future(pump(i, h)) for i, h in enumerate(handles)]
    try:
        left = len(tasks)
        while left:
            event = await queue.get()
            if event is None:
                left -= 1
            else:
                yield event
    finally:
        for t in tasks:
            t.cancel()
    outs = [h.output for h in handles]
    if req.include_usage and all(o is not None and o.finish_reason != "error" for o in outs):
        obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
        yield sse({**head, "object": obj, "choices": [], "usage": usage(outs[0], outs[1:])})
    yield "data: [DONE]\n\n"


def final_body(kind: str, out, req: ParsedRequest, head: dict, tokenizer=None) -> dict:
    """The JSON body of a finished non-streamed request (out: its output, or the outputs of
    its n choices)."""
    outs = list(out) if isinstance(out, (list, tuple)) else [out]
    choices = []
    for i, o in enumerate(outs):
        lps = getattr(o, "logprobs", None)
        if kind == "chat":
            msg = chat_message(o.text, req.enable_thinking, req.tools,
                               req.parallel_tool_calls, req.forced_call, req.forced_name)
            choices.append({"index": i, "message": msg,
                            "logprobs": chat_logprobs(lps, tokenizer),
                            "finish_reason": finish_reason(o, "tool_calls" in msg,
                                                           req.forced_call)})
        else:
            choices.append({"index": i, "text": o.text,
                            "logprobs": completion_logprobs(lps, tokenizer),
                            "finish_reason": FINISH[o.finish_reason]})
    obj = "chat.completion" if kind == "chat" else "text_completion"
    return {**head, "object": obj, "choices": choices, "usage": usage(outs[0], outs[1:])}


# ------------------------------------------------------------------------------- app
@dataclasses.dataclass
class Server:
    online: Any                 # OnlineEngine (started)
    tokenizer: Any              # text.Tokenizer
    limits: ServerLimits
    template: ChatTemplate = dataclasses.field(default_factory=ChatTemplate)
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))

    def parse_chat(self, body: Any) -> ParsedRequest:
        return parse_chat(body, self.limits, self.tokenizer, self.template)

    def parse_completion(self, body: Any) -> ParsedRequest:
        return parse_completion(body, self.limits, self.tokenizer)


async def _json_body(request: Request) -> Any:
    raw = await request.body()
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(f"the request body is not valid JSON: {e}", code="invalid_json")


async def _started(online: OnlineEngine, req: ParsedRequest) -> list[RequestHandle]:
    """Hand the request's n choices to the engine (sibling requests, submitted together: the
    scheduler prefills their prompt once) and wait until it took them (a refusal -> 400, the
    other siblings cancelled)."""
    if not online.alive:
        raise APIError("the engine is not running", status=503, type="server_error")
    try:
        handles = [online.add(req.prompt_ids, p, stop=req.stop,
                              skip_special_tokens=req.skip_special_tokens)
                   for p in req.sibling_params()]
    except Unavailable as e:
        raise APIError(f"server unavailable: {e}", status=503, type="server_error",
                       code="service_unavailable") from None
    for h in handles:
        rejected = await h.wait_queued()
        if rejected is not None:
            for other in handles:
                other.cancel()
            msg = rejected.error or "rejected"
            if msg.startswith("server unavailable"):    # the breaker opened while it queued
                raise APIError(msg, status=503, type="server_error",
                               code="service_unavailable")
            code = "context_length_exceeded" if msg.startswith("prompt too long") else None
            raise APIError(msg, None, code)
    return handles


async def _finished(request: Request, handle: RequestHandle):
    """The final output, or None when the client went away (the request is cancelled)."""
    waiter = asyncio.ensure_future(handle.aresult())
    try:
        while True:
            done, _ = await asyncio.wait({waiter}, timeout=0.25)
            if done:
                return waiter.result()
            if await request.is_disconnected():
                handle.cancel()
                return None
    finally:
        if not waiter.done():
            waiter.cancel()
        if not handle.done:
            handle.cancel()


def _streaming(request: Request, events: AsyncIterator[str], handles):
    from fastapi.responses import StreamingResponse
    handles = handles if isinstance(handles, list) else [handles]

    async def watch():
        """A client that leaves while its request waits or is between tokens is noticed
        here; one that leaves mid-write, by the write failing."""
        while not all(h.done for h in handles):
            if await request.is_disconnected():
                for h in handles:
                    h.cancel()
                return
            await asyncio.sleep(0.2)

    async def wrapped():
        watcher = asyncio.ensure_future(watch())
        try:
            async for piece in events:
                yield piece
        finally:                        # done, or the client is gone
            watcher.cancel()
            for h in handles:
                if not h.done:
                    h.cancel()
    return StreamingResponse(wrapped(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


def build_app(server: Server):
    """The FastAPI app around a started OnlineEngine."""
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, Response
    from starlette.exceptions import HTTPException as StarletteHTTPException

    app = FastAPI(title="mtpjax", docs_url=None, redoc_url=None, openapi_url=None)
    limits, online = server.limits, server.online
    registry = metrics_lib.make_registry(online.stats, limits.model)

    def error(e: APIError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, exc):
        return error(APIError(str(exc.detail), code=None, status=exc.status_code,
                              type="invalid_request_error" if exc.status_code < 500
                              else "server_error"))

    async def run(request: Request, parse: Callable[[Any], ParsedRequest], kind: str):
        try:
            req = parse(await _json_body(request))
            handles = await _started(online, req)
        except APIError as e:
            return error(e)
        rid = (f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{handles[0].id:06d}"
               f"{secrets.token_hex(6)}")
        head = {"id": rid, "created": int(time.time()), "model": limits.model}
        tok = server.tokenizer
        if req.stream:
            if len(handles) == 1:
                events = (chat_chunks if kind == "chat" else completion_chunks)(
                    handles[0], req, head, tok)
            else:
                events = merged_chunks(kind, handles, req, head, tok)
            return _streaming(request, events, handles)
        outs = []
        for h in handles:
            out = await _finished(request, h)
            if out is None:
                for other in handles:
                    other.cancel()
                return JSONResponse({}, status_code=499)
            outs.append(out)
        for out in outs:
            if out.finish_reason == "error":
                for other in handles:
                    other.cancel()
                return error(_engine_error(out))
        return JSONResponse(final_body(kind, outs, req, head, tok))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await run(request, server.parse_chat, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await run(request, server.parse_completion, "completion")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": limits.model, "object": "model",
                                            "created": server.created, "owned_by": "mtpjax",
                                            "max_model_len": limits.max_seq_len}]}

    @app.get("/health")
    async def health():
        """200 while requests are served; 503 while the device state is rebuilt after a
        failed step (requests wait meanwhile) and once the engine stopped."""
        state = online.health
        if state == "ok":
            return JSONResponse({"status": "ok"})
        if state == "rebuilding":
            return JSONResponse({"status": "rebuilding", "detail": "re-creating the device "
                                 "state after a failed engine step; requests wait"},
                                status_code=503)
        if state == "unavailable":
            return JSONResponse({"status": "unavailable", "detail": online.unavailable_reason},
                                status_code=503)
        body = {"status": "engine stopped"}
        if online.fatal_error is not None:
            body["detail"] = f"{type(online.fatal_error).__name__}: {online.fatal_error}"
        return JSONResponse(body, status_code=503)

    @app.get("/metrics")
    async def metrics(request: Request):
        body, content_type = metrics_lib.render(registry, request.headers.get("accept"))
        return Response(body, media_type=content_type)

    return app


# -------------------------------------------------------------------------- loading
@dataclasses.dataclass(frozen=True)
class ServerConfig:
    """Everything `load_server` needs (experiments/serve.py fills it from its flags)."""
    checkpoint: str = "checkpoints/tiny"
    served_model_name: str | None = None    # default: the checkpoint folder's name
    num_speculative_tokens: int = 4
    adaptive: bool = True
    max_lanes: int = 8
    max_seq_len: int = 1024
    prefill_chunk: int = 64
    prefill_buckets: tuple[int, ...] | None = None
    page_size: int = 16
    num_pages: int = 0                      # 0 = every lane at full context
    prefix_cache: bool = True
    prefix_snapshots: int = 0               # GDN snapshot slots; 0 = the engine's default
    snapshot_every_blocks: int = 4          # the prefix cache's doubling grid starts here (pages)
    dtype: str = "float32"
    kernels: str | None = None
    tp: int = 1
    dp: int = 1
    weights: str = "auto"
    mtp_weights: str = "auto"
    warmup: bool = True
    max_consecutive_failures: int = 3       # failed steps in a row that open the breaker
    probe_interval_s: float = 1.0           # how often the open breaker probes
    fault_injection: str = ""               # test aid: "fail_steps:A-B" (faults.FaultInjection)
    generation_config: str = "auto"         # sampling defaults: "auto" (the checkpoint's) | "none"


def load_server(cfg: ServerConfig, warmup: Callable[[Any], None] | None = None) -> Server:
    """Tokenizer, chat template, engine and a started OnlineEngine. warmup(engine), when
    cfg.warmup, compiles before serving (default: `Engine.warmup()` without progress lines).
    Problems with the checkpoint or the config raise SystemExit with a message."""
    import mtpjax
    from mtpjax.serving.chat_template import ChatTemplateError
    from mtpjax.text import Tokenizer

    path = cfg.checkpoint
    if not os.path.isdir(path):
        raise SystemExit(f"checkpoint folder not found: {path}; pass --checkpoint=DIR")
    if cfg.dp != 1:
        raise SystemExit("serve runs one engine (--dp=1); use --tp to split a model")
    try:
        tok = Tokenizer.from_checkpoint(path)
        template = load_chat_template(path)
    except (FileNotFoundError, ValueError, ChatTemplateError) as e:
        raise SystemExit(str(e))
    model_cfg = mtpjax.Config.from_pretrained(path)
    if tok.vocab_size > model_cfg.vocab_size:
        raise SystemExit(f"tokenizer has {tok.vocab_size} ids but the model's vocab_size is "
                         f"{model_cfg.vocab_size}")
    max_seq_len = max(2, min(cfg.max_seq_len, model_cfg.max_position_embeddings))
    if cfg.prefix_snapshots < 0:
        raise SystemExit(f"--prefix_snapshots must be >= 0 (0: the default), got "
                         f"{cfg.prefix_snapshots}")
    if cfg.snapshot_every_blocks < 1:
        raise SystemExit(f"--snapshot_every_blocks must be >= 1, got {cfg.snapshot_every_blocks}")
    engine = mtpjax.Engine.from_checkpoint(
        path, cfg.dtype, cfg.num_speculative_tokens, tp=cfg.tp, max_lanes=cfg.max_lanes,
        max_seq_len=max_seq_len, prefill_chunk=cfg.prefill_chunk, page_size=cfg.page_size,
        prefill_buckets=list(cfg.prefill_buckets) if cfg.prefill_buckets else None,
        num_pages=cfg.num_pages or None, kernels=cfg.kernels, weights=cfg.weights,
        mtp_weights=cfg.mtp_weights, prefix_cache=cfg.prefix_cache,
        prefix_snapshots=cfg.prefix_snapshots or None,
        snapshot_every_blocks=cfg.snapshot_every_blocks,
        speculation_policy="adaptive" if cfg.adaptive else "fixed")
    try:      # structured output's tokenizer, built now rather than at the first such request
        engine.grammar_tokenizer
    except Exception:   # noqa: BLE001  (each constrained request then ends with the error)
        pass
    if cfg.warmup:
        (warmup or (lambda e: e.warmup()))(engine)
    name = cfg.served_model_name or os.path.basename(os.path.normpath(path))
    try:
        breaker = BreakerConfig(cfg.max_consecutive_failures, cfg.probe_interval_s)
        faults = FaultInjection.parse(cfg.fault_injection)
        defaults = SamplingDefaults.resolve(cfg.generation_config, path)
    except ValueError as e:
        raise SystemExit(str(e))
    online = OnlineEngine(engine, tok, breaker=breaker, fault_injection=faults).start()
    return Server(online, tok, ServerLimits(name, model_cfg.vocab_size, max_seq_len, defaults),
                  template)
