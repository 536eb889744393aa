"""`python -m experiments serve [--checkpoint=checkpoints/tiny] [--host=127.0.0.1] [--port=8000]`

An OpenAI-compatible HTTP server (FastAPI + uvicorn) on one continuously running engine
(mtpjax/serving/online.py): requests join and leave the running batch as they arrive and end.

Routes: `POST /v1/chat/completions` and `POST /v1/completions` (streaming with SSE, or not),
`GET /v1/models`, `GET /health`, `GET /metrics` (Prometheus text format).

Request flow:
  1. parse and check the JSON body (pure functions below; any problem -> HTTP 400 with an
     OpenAI-style body {"error": {"message", "type", "param", "code"}}, unknown model -> 404);
  2. chat: render the messages with Qwen3.5's ChatML template (spec §7, mtpjax.text;
     `chat_template_kwargs: {"enable_thinking": false}` closes the think block) and stop on
     `<|im_end|>` / `<|endoftext|>`; completions: the prompt text or token ids as given;
  3. `OnlineEngine.add` and wait until the engine took it (its own checks, e.g. prompt too long,
     -> 400 before any byte of the response is sent);
  4. stream `Delta`s as SSE chunks or collect them; chat output goes through the reasoning
     split (`<think>...</think>` -> `reasoning_content`, as vLLM's qwen3 parser);
  5. a client that disconnects cancels its request: its pages return at the next engine step.

Sampling: temperature (default 1.0), top_p, top_k (vLLM extension, -1 or 0 = off), max_tokens
(or max_completion_tokens; default: the rest of the context for chat, 16 for completions),
seed (default: random), stop (string or list, cut exactly), n = 1 only. A request with a seed
gets the tokens `TextEngine` gives the same prompt and seed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import os
import secrets
import sys
import time
from typing import Any

from absl import flags
from fastapi import Request   # at module level: FastAPI resolves the handlers' annotations here

from experiments import mesh_flags, weight_flags

FLAGS = flags.FLAGS
mesh_flags.define()
weight_flags.define()
flags.DEFINE_string("checkpoint", "checkpoints/tiny", "checkpoint folder with tokenizer.json")
flags.DEFINE_string("host", "127.0.0.1", "address to listen on")
flags.DEFINE_integer("port", 8000, "port to listen on")
flags.DEFINE_string("served_model_name", None, "the model id clients send (default: the "
                    "checkpoint folder's name)")
flags.DEFINE_integer("num_speculative_tokens", 4, "MTP draft slots K (0 = no speculation)")
flags.DEFINE_boolean("adaptive", True, "choose each step's draft depth 0..K from measured step "
                     "time and acceptance (mtpjax/depth.py); else always K")
flags.DEFINE_integer("max_lanes", 8, "requests decoded together; more wait in the queue")
flags.DEFINE_integer("max_seq_len", 1024, "context limit per request (prompt + output)")
flags.DEFINE_integer("prefill_chunk", 64, "prefill chunk length")
flags.DEFINE_list("prefill_buckets", None, "padded prefill chunk lengths, one compiled program "
                  "each (default 8, 16, ..., prefill_chunk)")
flags.DEFINE_integer("page_size", 16, "KV page size in tokens")
flags.DEFINE_integer("num_pages", 0, "KV pool pages; 0 = every lane at full context")
flags.DEFINE_boolean("prefix_cache", True, "reuse cached prompt prefixes across requests")
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "compute dtype")
flags.DEFINE_string("kernels", None, "gdn/attention kernels (default: pallas on GPU, "
                    "reference elsewhere)")
flags.DEFINE_boolean("warmup", True, "compile every program a run can launch before serving "
                     "(Engine.warmup: every depth and lane bucket, every prefill chunk bucket, "
                     "lane moves, snapshots), so no request waits on a compile")
flags.DEFINE_string("log_level", "warning", "uvicorn log level")


# ------------------------------------------------------------------------------- errors
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


# --------------------------------------------------------------------- request parsing
@dataclasses.dataclass(frozen=True)
class ServerLimits:
    """What request checks need to know about the engine."""
    model: str
    vocab_size: int
    max_seq_len: int


@dataclasses.dataclass(frozen=True)
class ParsedRequest:
    prompt_ids: list[int]
    params: Any                  # SamplingParams
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    enable_thinking: bool | None  # chat only; None for completions
    skip_special_tokens: bool


def _get(body: dict, name: str, kinds, default=None, allow_none: bool = True):
    v = body.get(name, default)
    if v is None and allow_none:
        return default
    if isinstance(v, bool) and bool not in kinds:
        raise APIError(f"'{name}' must be {_kind_names(kinds)}, got {json.dumps(v)}", name)
    if not isinstance(v, kinds):
        raise APIError(f"'{name}' must be {_kind_names(kinds)}, got {json.dumps(v)[:80]}", name)
    return v


def _kind_names(kinds) -> str:
    names = {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
             list: "a list", dict: "an object"}
    return " or ".join(names.get(k, k.__name__) for k in kinds)


def check_model(body: dict, limits: ServerLimits) -> None:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise APIError("'model' is required (a string); see GET /v1/models", "model")
    if model != limits.model:
        raise APIError(f"The model '{model}' does not exist; this server serves "
                       f"'{limits.model}'", "model", "model_not_found", status=404)


def parse_stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise APIError("'stop' must be a non-empty string or a list of non-empty strings",
                       "stop")
    return tuple(stop)


def _reject_unsupported(body: dict) -> None:
    n = body.get("n", 1)
    if n is not None and (isinstance(n, bool) or n != 1):
        raise APIError(f"only n = 1 is supported, got {json.dumps(n)}", "n")
    for name in ("presence_penalty", "frequency_penalty"):
        v = body.get(name)
        if v not in (None, 0, 0.0):
            raise APIError(f"'{name}' is not supported (must be 0 or absent)", name)
    if body.get("logprobs") not in (None, False, 0):
        raise APIError("'logprobs' is not supported", "logprobs")
    if body.get("tools"):
        raise APIError("'tools' are not supported by this server", "tools")
    if body.get("echo"):
        raise APIError("'echo' is not supported", "echo")
    if body.get("best_of") not in (None, 1):
        raise APIError("'best_of' is not supported (must be 1 or absent)", "best_of")


def parse_sampling(body: dict, prompt_len: int, limits: ServerLimits, default_max: int | None,
                   stop_token_ids: tuple[int, ...] = ()):
    """SamplingParams from the OpenAI fields; APIError (400, naming the field) when wrong."""
    from mtpjax.sampling import SamplingParams
    room = limits.max_seq_len - prompt_len
    if room < 1:
        raise APIError(f"This model's maximum context length is {limits.max_seq_len} tokens; "
                       f"the prompt has {prompt_len}", "messages" if default_max is None
                       else "prompt", "context_length_exceeded")
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None \
        else "max_tokens"
    max_tokens = _get(body, name, (int,), room if default_max is None else min(default_max, room))
    if max_tokens < 1:
        raise APIError(f"'{name}' must be >= 1, got {max_tokens}", name)
    if max_tokens > room:
        raise APIError(f"This model's maximum context length is {limits.max_seq_len} tokens; "
                       f"the prompt has {prompt_len} and {name} = {max_tokens} asks for "
                       f"{prompt_len + max_tokens}", name, "context_length_exceeded")
    temperature = float(_get(body, "temperature", (int, float), 1.0))
    top_p = float(_get(body, "top_p", (int, float), 1.0))
    top_k = _get(body, "top_k", (int,), 0)
    if top_k == -1:
        top_k = 0
    seed = _get(body, "seed", (int,), None)
    if seed is None:
        seed = secrets.randbits(32)
    checks = [("temperature", math.isfinite(temperature) and 0.0 <= temperature <= 2.0,
               "a number in [0, 2]"),
              ("top_p", 0.0 < top_p <= 1.0, "a number in (0, 1]"),
              ("top_k", top_k >= 0, "-1, 0 (off) or a positive integer"),
              ("seed", 0 <= seed < 2 ** 32, "an integer in [0, 2**32)")]
    for field, ok, want in checks:
        if not ok:
            raise APIError(f"'{field}' must be {want}, got {json.dumps(body.get(field))}", field)
    return SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p,
                          max_new_tokens=max_tokens, seed=seed, stop_token_ids=stop_token_ids)


def _stream_options(body: dict) -> tuple[bool, bool]:
    stream = _get(body, "stream", (bool,), False)
    opts = _get(body, "stream_options", (dict,), {})
    include = bool(opts.get("include_usage", False)) if opts else False
    return stream, include


def _text_parts(i: int, msg) -> Any:
    """A message whose content is a list of {"type": "text", "text": ...} parts, as the OpenAI
    API allows, with the parts joined; other messages as they are."""
    if not isinstance(msg, dict) or not isinstance(msg.get("content"), list):
        return msg
    parts = msg["content"]
    if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
               for p in parts):
        raise APIError(f"message {i}: only text content parts are supported", "messages")
    return {**msg, "content": "".join(p["text"] for p in parts)}


def parse_chat(body: dict, limits: ServerLimits, tokenizer) -> ParsedRequest:
    from mtpjax.text import apply_chat_template
    check_model(body, limits)
    _reject_unsupported(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError("'messages' must be a non-empty list of {role, content} objects",
                       "messages")
    messages = [_text_parts(i, m) for i, m in enumerate(messages)]
    kwargs = _get(body, "chat_template_kwargs", (dict,), {})
    thinking = kwargs.get("enable_thinking", True)
    if not isinstance(thinking, bool):
        raise APIError("'chat_template_kwargs.enable_thinking' must be a boolean",
                       "chat_template_kwargs")
    try:
        text = apply_chat_template(messages, True, thinking)
    except (ValueError, KeyError, TypeError) as e:
        raise APIError(f"invalid messages: {e}", "messages")
    ids = tokenizer.encode(text)
    stream, include = _stream_options(body)
    params = parse_sampling(body, len(ids), limits, None, tokenizer.stop_ids())
    return ParsedRequest(ids, params, parse_stop(body), stream, include, thinking,
                         _get(body, "skip_special_tokens", (bool,), True))


def parse_completion(body: dict, limits: ServerLimits, tokenizer) -> ParsedRequest:
    check_model(body, limits)
    _reject_unsupported(body)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]                      # a batch of one
    if isinstance(prompt, str):
        ids = tokenizer.encode(prompt)
    elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool)
                                          for t in prompt):
        ids = list(prompt)
        bad = [t for t in ids if not 0 <= t < limits.vocab_size]
        if bad:
            raise APIError(f"token id {bad[0]} in 'prompt' is outside the vocabulary "
                           f"[0, {limits.vocab_size})", "prompt")
    else:
        raise APIError("'prompt' must be a string or a list of token ids (one prompt: n = 1, "
                       "no batches)", "prompt")
    if not ids:
        raise APIError("'prompt' is empty", "prompt")
    stream, include = _stream_options(body)
    params = parse_sampling(body, len(ids), limits, 16)
    return ParsedRequest(ids, params, parse_stop(body), stream, include, None,
                         _get(body, "skip_special_tokens", (bool,), True))


# ------------------------------------------------------------------------ responses
FINISH = {"stop": "stop", "length": "length", "cancelled": "abort", "error": "error"}


def usage(out) -> dict:
    return {"prompt_tokens": out.prompt_tokens, "completion_tokens": out.completion_tokens,
            "total_tokens": out.prompt_tokens + out.completion_tokens}


def chat_message(text: str, thinking: bool) -> dict:
    from mtpjax.text import split_reasoning
    reasoning, content = split_reasoning(text, thinking)
    msg = {"role": "assistant", "content": content}
    if thinking:
        msg["reasoning_content"] = reasoning
    return msg


def sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


# --------------------------------------------------------------------------- metrics
def render_prometheus(st, model: str) -> str:
    """Prometheus text exposition (format 0.0.4) of an online.OnlineStats."""
    lines: list[str] = []

    def metric(name, kind, help_, samples):
        lines.append(f"# HELP {name} {help_}")
        lines.append(f"# TYPE {name} {kind}")
        for labels, value in samples:
            lab = ",".join(f'{k}="{v}"' for k, v in {"model": model, **labels}.items())
            lines.append(f"{name}{{{lab}}} {float(value):.10g}")

    e = st.engine
    metric("mtpjax_requests_running", "gauge", "Requests in an engine lane.",
           [({}, st.running)])
    metric("mtpjax_requests_waiting", "gauge", "Requests queued for a lane.", [({}, st.waiting)])
    metric("mtpjax_requests_finished_total", "counter", "Finished requests by finish reason.",
           [({"finish_reason": r}, n) for r, n in sorted(st.finished.items())] or
           [({"finish_reason": "stop"}, 0)])
    metric("mtpjax_prompt_tokens_total", "counter", "Prompt tokens of accepted requests.",
           [({}, st.prompt_tokens)])
    metric("mtpjax_generation_tokens_total", "counter", "Tokens committed by the engine.",
           [({}, st.generation_tokens)])
    metric("mtpjax_verify_steps_total", "counter", "Decode steps that verified drafts "
           "(finished requests).", [({}, st.verify_steps)])
    metric("mtpjax_draft_tokens_total", "counter", "Draft tokens verified.",
           [({}, st.drafted_tokens)])
    metric("mtpjax_accepted_tokens_total", "counter", "Draft tokens accepted.",
           [({}, st.accepted_tokens)])
    metric("mtpjax_tokens_per_verify_step", "gauge", "Tokens committed per verifying decode "
           "step (accepted drafts + 1).", [({}, st.tokens_per_verify_step)])
    pos = [{"position": str(j + 1)} for j in range(len(st.tried_per_position))]
    metric("mtpjax_draft_accepted_total", "counter", "Accepted drafts by draft position.",
           list(zip(pos, st.accepted_per_position)))
    metric("mtpjax_draft_tried_total", "counter", "Verified drafts by draft position (earlier "
           "drafts accepted).", list(zip(pos, st.tried_per_position)))
    metric("mtpjax_draft_acceptance_rate", "gauge", "Conditional acceptance by draft position.",
           [(p, a / t if t else 0.0) for p, a, t in
            zip(pos, st.accepted_per_position, st.tried_per_position)])
    from mtpjax.serving.online import ITERATION_BUCKETS
    lines.append("# HELP mtpjax_iteration_seconds Engine iteration (one step: admission, a "
                 "prefill chunk, a decode step) wall time.")
    lines.append("# TYPE mtpjax_iteration_seconds histogram")
    acc = 0
    for le, n in zip(ITERATION_BUCKETS, st.iteration_buckets):
        acc += n
        lines.append(f'mtpjax_iteration_seconds_bucket{{model="{model}",le="{le}"}} {acc}')
    lines.append(f'mtpjax_iteration_seconds_bucket{{model="{model}",le="+Inf"}} {st.iterations}')
    lines.append(f'mtpjax_iteration_seconds_sum{{model="{model}"}} {st.iteration_seconds:.6f}')
    lines.append(f'mtpjax_iteration_seconds_count{{model="{model}"}} {st.iterations}')
    metric("mtpjax_decode_step_seconds_total", "counter", "Time in decode step programs.",
           [({}, e.get("step_s", 0.0))])
    metric("mtpjax_decode_steps_total", "counter", "Decode steps.", [({}, e.get("steps", 0))])
    metric("mtpjax_decode_steps_by_depth_total", "counter", "Decode steps by draft depth.",
           [({"depth": str(d)}, n) for d, n in enumerate(e.get("depth_steps", []))])
    metric("mtpjax_prefill_seconds_total", "counter", "Time in prefill chunk programs.",
           [({}, e.get("prefill_s", 0.0))])
    metric("mtpjax_prefill_chunks_total", "counter", "Prefill chunks.",
           [({}, e.get("prefill_chunks", 0))])
    metric("mtpjax_kv_free_pages", "gauge", "KV pages free (or held only by the prefix cache).",
           [({}, e.get("free_pages", 0))])
    metric("mtpjax_kv_total_pages", "gauge", "KV pages in the pool.",
           [({}, e.get("total_pages", 0))])
    metric("mtpjax_preemptions_total", "counter", "Requests preempted (recomputed later).",
           [({}, e.get("preemptions", 0))])
    metric("mtpjax_engine_errors_total", "counter", "Engine steps that raised.",
           [({}, st.engine_errors)])
    pc = e.get("prefix_cache")
    if isinstance(pc, dict):
        for key, v in sorted(pc.items()):
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                metric(f"mtpjax_prefix_cache_{key}", "gauge", f"Prefix cache: {key}.",
                       [({}, v)])
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------- app
@dataclasses.dataclass
class Server:
    online: Any                 # OnlineEngine
    tokenizer: Any              # text.Tokenizer
    limits: ServerLimits
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))


def build_app(server: Server):
    """The FastAPI app around a started OnlineEngine."""
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException

    app = FastAPI(title="mtpjax", docs_url=None, redoc_url=None, openapi_url=None)
    limits, online = server.limits, server.online

    def error(e: APIError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, exc):
        return error(APIError(str(exc.detail), code=None, status=exc.status_code,
                              type="invalid_request_error" if exc.status_code < 500
                              else "server_error"))

    async def body_of(request: Request) -> dict:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(f"the request body is not valid JSON: {e}", code="invalid_json")
        if not isinstance(body, dict):
            raise APIError("the request body must be a JSON object", code="invalid_json")
        return body

    async def start(req: ParsedRequest):
        if not online.alive:
            raise APIError("the engine is not running", status=503, type="server_error")
        handle = online.add(req.prompt_ids, req.params, stop=req.stop,
                            skip_special_tokens=req.skip_special_tokens)
        rejected = await handle.wait_queued()
        if rejected is not None:
            msg = rejected.error or "rejected"
            code = "context_length_exceeded" if msg.startswith("prompt too long") else None
            raise APIError(msg, None, code)
        return handle

    async def finished(request: Request, handle):
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

    def streaming(request: Request, gen, handle):
        async def watch():
            """A client that leaves while its request waits or is between tokens is noticed
            here; one that leaves mid-write, by the write failing."""
            while not handle.done:
                if await request.is_disconnected():
                    handle.cancel()
                    return
                await asyncio.sleep(0.2)

        async def wrapped():
            watcher = asyncio.ensure_future(watch())
            try:
                async for piece in gen:
                    yield piece
            finally:                        # done, or the client is gone
                watcher.cancel()
                if not handle.done:
                    handle.cancel()
        return StreamingResponse(wrapped(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    async def run(request: Request, parse, kind: str):
        try:
            req = parse(await body_of(request), limits, server.tokenizer)
            handle = await start(req)
        except APIError as e:
            return error(e)
        rid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{handle.id:06d}{secrets.token_hex(6)}"
        head = {"id": rid, "created": int(time.time()), "model": limits.model}
        if req.stream:
            gen = (_chat_chunks if kind == "chat" else _completion_chunks)(handle, req, head)
            return streaming(request, gen, handle)
        out = await finished(request, handle)
        if out is None:
            return JSONResponse({}, status_code=499)
        if out.finish_reason == "error":
            return error(APIError(out.error or "engine error", status=500, type="server_error"))
        if kind == "chat":
            choice = {"index": 0, "message": chat_message(out.text, req.enable_thinking),
                      "logprobs": None, "finish_reason": FINISH[out.finish_reason]}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": out.text, "logprobs": None,
                      "finish_reason": FINISH[out.finish_reason]}
            obj = "text_completion"
        return JSONResponse({**head, "object": obj, "choices": [choice], "usage": usage(out)})

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await run(request, parse_chat, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await run(request, parse_completion, "completion")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": limits.model, "object": "model",
                                            "created": server.created, "owned_by": "mtpjax",
                                            "max_model_len": limits.max_seq_len}]}

    @app.get("/health")
    async def health():
        ok = online.alive
        return JSONResponse({"status": "ok" if ok else "engine stopped"},
                            status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(render_prometheus(online.stats(), limits.model),
                                 media_type="text/plain; version=0.0.4")

    return app


async def _chat_chunks(handle, req: ParsedRequest, head: dict):
    from mtpjax.text import ReasoningStream
    split = ReasoningStream(req.enable_thinking)

    def chunk(delta, finish=None):
        return sse({**head, "object": "chat.completion.chunk",
                    "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                 "finish_reason": finish}]})

    def delta_of(reasoning, content):
        d = {}
        if reasoning:
            d["reasoning_content"] = reasoning
        if content:
            d["content"] = content
        return d

    yield chunk({"role": "assistant", "content": ""})
    async for d in handle:
        piece = delta_of(*split.push(d.text))
        if piece:
            yield chunk(piece)
    piece = delta_of(*split.flush())
    if piece:
        yield chunk(piece)
    out = handle.output
    if out.finish_reason == "error":
        yield sse(APIError(out.error or "engine error", status=500, type="server_error").body())
    else:
        yield chunk({}, FINISH[out.finish_reason])
        if req.include_usage:
            yield sse({**head, "object": "chat.completion.chunk", "choices": [],
                       "usage": usage(out)})
    yield "data: [DONE]\n\n"


async def _completion_chunks(handle, req: ParsedRequest, head: dict):
    def chunk(text, finish=None):
        return sse({**head, "object": "text_completion",
                    "choices": [{"index": 0, "text": text, "logprobs": None,
                                 "finish_reason": finish}]})

    async for d in handle:
        if d.text:
            yield chunk(d.text)
    out = handle.output
    if out.finish_reason == "error":
        yield sse(APIError(out.error or "engine error", status=500, type="server_error").body())
    else:
        yield chunk("", FINISH[out.finish_reason])
        if req.include_usage:
            yield sse({**head, "object": "text_completion", "choices": [], "usage": usage(out)})
    yield "data: [DONE]\n\n"


# ------------------------------------------------------------------------------ main
def load_server(flag_values=FLAGS) -> Server:
    """Tokenizer, engine and a started OnlineEngine from the flags."""
    import mtpjax
    from mtpjax.serving.online import OnlineEngine
    from mtpjax.text import Tokenizer

    f = flag_values
    path = f.checkpoint
    if not os.path.isdir(path):
        raise SystemExit(f"checkpoint folder not found: {path}; pass --checkpoint=DIR")
    if f.dp != 1:
        raise SystemExit("serve runs one engine (--dp=1); use --tp to split a model")
    try:
        tok = Tokenizer.from_checkpoint(path)
    except (FileNotFoundError, ValueError) as e:
        raise SystemExit(str(e))
    cfg = mtpjax.Config.from_pretrained(path)
    max_seq_len = max(2, min(f.max_seq_len, cfg.max_position_embeddings))
    engine = mtpjax.Engine.from_checkpoint(
        path, f.dtype, f.num_speculative_tokens, tp=f.tp, max_lanes=f.max_lanes,
        max_seq_len=max_seq_len, prefill_chunk=f.prefill_chunk, page_size=f.page_size,
        prefill_buckets=[int(b) for b in f.prefill_buckets] if f.prefill_buckets else None,
        num_pages=f.num_pages or None, kernels=f.kernels, weights=f.weights,
        mtp_weights=f.mtp_weights, prefix_cache=f.prefix_cache,
        speculation_policy="adaptive" if f.adaptive else "fixed")
    if tok.vocab_size > cfg.vocab_size:
        raise SystemExit(f"tokenizer has {tok.vocab_size} ids but the model's vocab_size is "
                         f"{cfg.vocab_size}")
    if f.warmup:
        from experiments.progress import Progress, program_name
        t0 = time.perf_counter()
        log = Progress("serve")
        plan = engine.warmup_plan()
        log(f"compiling the {len(plan)} programs a run can launch (a first run on a CPU takes "
            "a few seconds each; later runs load them from the compilation cache)")
        done = iter(range(1, len(plan) + 1))
        n = engine.warmup(progress=lambda key, sec: log(
            f"compiling {next(done)}/{len(plan)}: {program_name(key)} {sec:.1f} s"))
        print(f"[serve] warmup: {n} programs in {time.perf_counter() - t0:.1f}s",
              file=sys.stderr, flush=True)
    name = f.served_model_name or os.path.basename(os.path.normpath(path))
    online = OnlineEngine(engine, tok).start()
    return Server(online, tok, ServerLimits(name, cfg.vocab_size, max_seq_len))


def main(argv):
    if len(argv) > 1:
        raise SystemExit(f"unexpected arguments: {' '.join(argv[1:])}")
    import uvicorn
    t0 = time.perf_counter()
    server = load_server()
    e = server.online.engine
    print(f"[serve] {FLAGS.checkpoint} as '{server.limits.model}': k={e.k}, lanes="
          f"{e.max_lanes}, context {e.max_seq_len}, {e.num_pages} pages of {e.page_size}, "
          f"kernels={e.kernels}, ready in {time.perf_counter() - t0:.1f}s; listening on "
          f"http://{FLAGS.host}:{FLAGS.port}", file=sys.stderr, flush=True)
    try:
        uvicorn.run(build_app(server), host=FLAGS.host, port=FLAGS.port,
                    log_level=FLAGS.log_level, timeout_graceful_shutdown=5)
    finally:
        server.online.shutdown()
