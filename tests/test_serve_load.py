"""Load and faults (issue 25 item 7): 64 concurrent agent loops, driven by the official `openai`
client, against the real server (uvicorn on a socket, the app of mtpjax/serving/app.py, the
tiny checkpoint on a speculative engine), while clients walk away and device steps fail.

Each loop is an agent turn pair: a chat with tools (tool_choice "required", a named function:
both decode under the tool-call grammar, so the call parses; or "auto") -> the call (the
model's, or a made-up one when the reply had none) and a `role: tool` result -> a final answer,
plain or with response_format json_schema (structured output; with the tools under "auto":
the JSON or a call). Requests stream or not. Some
clients disconnect: a stream closed after its first delta, a request with a short timeout.
Engine programs fail on a fixed schedule (two decode steps, a prefill chunk alone, a snapshot
save; `FaultInjector`, as tests/test_serving_faults.py injects them: the program runs, deleting
its donated buffers, then raises), and the injector records which requests each failed step
held.

Then:
- every request ended with a result or a clean error: a 500 whose JSON error body names the
  injected failure, for a request the failed step held, or the client's own timeout or close;
  no hang (everything is bounded), no other status, no traceback in the server's log;
- nothing leaked: /metrics shows free KV pages == total pages and every snapshot slot free or
  holding a cached prefix (none pending); after shutdown, with the prefix cache cleared, the
  page allocator checks clean with every page and slot free;
- every request no client or failure disturbed got what the offline engine
  (`Engine.generate`, the same prompt and SamplingParams) gives: the same content or tool call,
  finish_reason and completion tokens; replies under a grammar follow their schema.

Deterministic where it matters: the loops' choices come from seeded generators and the
assertions are invariants (which requests a failure hits depends on timing, and each one is
checked against what happened to it). MTPJAX_LOAD_SEED=N draws other loops. Budget: about a
minute on a 2-core CPU, most of it compiling the three step programs and the offline reference
run.
"""

import asyncio
import dataclasses
import json
import logging
import os
import random
import socket
import threading
import time
import urllib.request

import jax
import openai
import pytest

import mtpjax
from mtpjax.serving.app import Server, build_app, chat_message, finish_reason
from mtpjax.serving.chat_template import load_chat_template
from mtpjax.serving.online import OnlineEngine
from mtpjax.serving.parsing import ServerLimits, parse_chat
from mtpjax.text import Tokenizer

from json_schema_check import matches

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CKPT = os.path.join(REPO, "checkpoints", "tiny")
# One lane bucket and a fixed depth: three step programs to compile (decode, mixed, prefill).
ENGINE = dict(num_speculative_tokens=1, speculation_policy="fixed", max_lanes=8, lane_buckets=[8],
              max_seq_len=512, prefill_chunk=64, prefill_buckets=[64])
N_LOOPS = 64
SEED = int(os.environ.get("MTPJAX_LOAD_SEED", 25))     # another seed: another schedule
# (program kind, n): the n-th launch of that kind (counted from the start of the load) fails
FAULTS = (("prefill", 2), ("step", 25), ("snapshot", 6), ("step", 110))
CLIENT_TIMEOUT_S = 90.0          # no request may take longer: a hang fails the test
LOAD_TIMEOUT_S = 150.0

LOOKUP = {"type": "object", "properties": {"key": {"type": "string", "enum": ["a", "b", "c"]}},
          "required": ["key"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "Find a key.",
                                           "parameters": LOOKUP}}]
ANSWER = {"type": "object", "properties": {"found": {"type": "boolean"}},
          "required": ["found"], "additionalProperties": False}


# ------------------------------------------------------------------------ fault injection
def program_kind(key) -> str:
    return "step" if key[0] in ("decode", "mixed") else key[0]


@dataclasses.dataclass
class Fault:
    kind: str
    key: tuple
    held: set          # prompts (tuples of ids) of the requests the failed step held


class FaultInjector:
    """Replaces engine.runner._program: for each faults[i] = (kind, n), the n-th launch of a
    program of that kind (or the first one after it, when no engine step has succeeded since
    the last fault) runs for real (its donated buffers are deleted) and then raises. Faults
    never fail two engine steps in a row: how the kinds interleave depends on the schedule
    (shared prefixes prefill fewer chunks), and the server gives up after 3 consecutive
    failed steps. Each fired fault records the prompts of the requests the step held: those
    in a lane, and queued ones that already have tokens (preempted) -- what the online
    engine fails after a step raises."""

    def __init__(self, engine, faults):
        self.engine, self.faults = engine, list(faults)
        self.counts: dict[str, int] = {}
        self.fired: list[Fault] = []
        self._real = engine.runner._program
        self._real_step = engine.step
        self._ok_steps = 1                 # engine steps that succeeded since the last fault

    def __enter__(self):
        self.engine.runner._program = self._program
        self.engine.step = self._step
        return self

    def __exit__(self, *exc):
        del self.engine.runner._program
        del self.engine.step

    def _step(self):
        out = self._real_step()
        self._ok_steps += 1
        return out

    def _program(self, key, run, *args, **kw):
        kind = program_kind(key)
        self.counts[kind] = n = self.counts.get(kind, 0) + 1
        due = next((f for f in self.faults if f[0] == kind and f[1] <= n), None)
        if due is None or not self._ok_steps:
            return self._real(key, run, *args, **kw)
        self.faults.remove(due)
        self._ok_steps = 0
        sched = self.engine._sched
        held = {tuple(ln.req.prompt) for ln in sched.lanes if ln is not None}
        held |= {tuple(r.prompt) for r in sched.queue if r.out}
        jax.block_until_ready(self._real(key, run, *args, **kw))
        self.fired.append(Fault(kind, key, held))
        raise RuntimeError(f"injected fault {len(self.fired)} ({kind} program {key})")


# ------------------------------------------------------------------------------ the server
def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


LOGGERS = ("uvicorn", "uvicorn.error", "asyncio", "mtpjax")


class ErrorLog(logging.Handler):
    """Collects the server's error records: an exception in the app (uvicorn.error), a task
    that died with nobody awaiting it (asyncio)."""

    def __init__(self):
        super().__init__(logging.ERROR)
        self.records = []

    def emit(self, record):
        self.records.append(self.format(record))


@dataclasses.dataclass
class Live:
    base: str
    engine: object
    online: OnlineEngine
    tok: Tokenizer
    template: object
    limits: ServerLimits
    errors: ErrorLog


@pytest.fixture(scope="module")
def live():
    """The app on a started OnlineEngine, served by uvicorn on a free port (its own thread),
    the engine's step programs compiled first."""
    import uvicorn
    tok, template = Tokenizer.from_checkpoint(CKPT), load_chat_template(CKPT)
    engine = mtpjax.Engine.from_checkpoint(CKPT, **ENGINE)
    limits = ServerLimits("tiny", engine.cfg.vocab_size, engine.max_seq_len)
    warm = [parse_chat(body(i, 0, choice, 0.0, 40), limits, tok, template) for i, choice in
            enumerate(("required", "auto", "auto"))]
    engine.generate([r.prompt_ids for r in warm], [r.params for r in warm])   # compiles
    online = OnlineEngine(engine, tok).start()
    app = build_app(Server(online, tok, limits, template))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, lifespan="off",
                                           log_level="warning", timeout_graceful_shutdown=5))
    errors = ErrorLog()
    for name in LOGGERS:
        logging.getLogger(name).addHandler(errors)
    thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
    thread.start()
    t0 = time.time()
    while not server.started:
        assert thread.is_alive() and time.time() - t0 < 30, "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield Live(f"http://127.0.0.1:{port}", engine, online, tok, template, limits, errors)
    finally:
        server.should_exit = True
        thread.join(30)
        online.shutdown()
        for name in LOGGERS:
            logging.getLogger(name).removeHandler(errors)


def get(url):
    with urllib.request.urlopen(url, timeout=30) as r:
        return r.status, r.read().decode()


# ------------------------------------------------------------------------------ the loops
def body(loop, turn, choice, temperature, max_tokens, history=(), response_format=None):
    """A chat request of loop `loop`'s turn (the user's question names the loop: every prompt
    is unique, so a prompt identifies its request)."""
    msgs = [{"role": "user", "content": f"Look up the key for item {loop}, then tell me."},
            *history]
    b = {"model": "tiny", "messages": msgs, "tools": TOOLS, "tool_choice": choice,
         "max_tokens": max_tokens, "temperature": temperature, "seed": 1000 * turn + loop,
         "chat_template_kwargs": {"enable_thinking": False}}
    if response_format is not None:
        b["response_format"] = response_format
    return b


@dataclasses.dataclass
class Result:
    """What one request came to, as the client saw it."""
    loop: int
    turn: int
    body: dict
    stream: bool
    plan: str                       # "none", "close" (after close_after chunks) or "timeout"
    close_after: int = 1
    outcome: str = ""               # "ok", "http_error", "stream_error", "timeout", "closed"
    status: int | None = None
    error: object = None
    content: str = ""
    calls: list = dataclasses.field(default_factory=list)    # [(name, arguments JSON)]
    finish: str | None = None
    completion_tokens: int | None = None
    parsed: object = None           # the server's parse of body (parsing.ParsedRequest)

    @property
    def disturbed_by_client(self) -> bool:
        return self.outcome in ("timeout", "closed")


def plan_of(rng) -> dict:
    """How one request is sent: stream or not, and the client's disturbance: none, "close"
    (the stream, after close_after chunks: 1 is the role chunk only) or "timeout" (a short
    one: the request may still be queued, or decoding, or done)."""
    plan = rng.choices(["none", "close", "timeout"], [6, 1, 1])[0]
    return dict(plan=plan, stream=plan == "close" or rng.random() < 0.5,
                close_after=rng.choice([1, 2, 4]),
                timeout=rng.uniform(0.05, 2.5) if plan == "timeout" else CLIENT_TIMEOUT_S)


async def send(client, res: Result, timeout: float) -> Result:
    """Send res.body as res says (stream, plan) and record what came back in res."""
    kw = {k: v for k, v in res.body.items() if k != "chat_template_kwargs"}
    kw.update(timeout=timeout, extra_body={
        "chat_template_kwargs": res.body["chat_template_kwargs"]})
    try:
        if not res.stream:
            r = await client.chat.completions.create(**kw)
            (c,) = r.choices
            res.content = c.message.content or ""
            res.calls = [(t.function.name, t.function.arguments)
                         for t in c.message.tool_calls or ()]
            res.finish, res.completion_tokens = c.finish_reason, r.usage.completion_tokens
            res.outcome = "ok"
            return res
        stream = await client.chat.completions.create(
            stream=True, stream_options={"include_usage": True}, **kw)
        calls, chunks = {}, 0
        async for chunk in stream:
            chunks += 1
            if chunk.usage is not None:
                res.completion_tokens = chunk.usage.completion_tokens
            for ch in chunk.choices:
                d = ch.delta
                res.content += d.content or ""
                for t in d.tool_calls or ():
                    name, args = calls.get(t.index, ("", ""))
                    fn = t.function
                    calls[t.index] = (name + (fn and fn.name or ""),
                                      args + (fn and fn.arguments or ""))
                res.finish = ch.finish_reason or res.finish
            if res.plan == "close" and chunks >= res.close_after and res.finish is None:
                await stream.close()
                res.outcome = "closed"
                return res
        res.calls = [calls[i] for i in sorted(calls)]
        res.outcome = "ok"
    except openai.APITimeoutError:
        res.outcome = "timeout"
    except openai.APIStatusError as e:
        res.outcome, res.status, res.error = "http_error", e.status_code, e.body
    except openai.APIError as e:        # an error event in the stream
        res.outcome, res.error = "stream_error", e.body
    return res


async def agent_loop(client, loop: int, results: list) -> None:
    rng = random.Random(SEED * 1000 + loop)
    temperature = rng.choice([0.0, 0.9])
    choice = rng.choices(["required", {"type": "function", "function": {"name": "lookup"}},
                          "auto"], [3, 1, 1])[0]
    how = plan_of(rng)
    first = Result(loop, 0, body(loop, 0, choice, temperature, 40 if choice != "auto" else 8),
                   how["stream"], how["plan"], how["close_after"])
    results.append(first)
    await send(client, first, how["timeout"])
    if first.outcome == "ok" and first.calls:
        (name, args), call_id = first.calls[0], f"call_{loop}"
    else:                               # no call: the agent makes one up and goes on
        name, args, call_id = "lookup", json.dumps({"key": rng.choice("abc")}), f"made_{loop}"
    history = [{"role": "assistant", "content": None, "tool_calls": [
                   {"id": call_id, "type": "function",
                    "function": {"name": name, "arguments": args}}]},
               {"role": "tool", "tool_call_id": call_id,
                "content": f"{rng.choice(['found', 'missing'])} ({loop})"}]
    structured = rng.random() < 0.4
    rf = ({"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER,
                                                  "strict": True}} if structured else None)
    how = plan_of(rng)
    # 48 tokens: room for the whole JSON or tool call (the tiny's take ~25 under the grammar);
    # at 16 most ran out at "length" and one schedule left no structured reply to check
    final = Result(loop, 1, body(loop, 1, "auto", temperature, 48 if structured else 6, history,
                                 rf), how["stream"], how["plan"], how["close_after"])
    results.append(final)
    await send(client, final, how["timeout"])


async def run_load(base: str) -> list[Result]:
    results: list[Result] = []
    async with openai.AsyncOpenAI(base_url=base + "/v1", api_key="none", max_retries=0,
                                  timeout=CLIENT_TIMEOUT_S) as client:
        await asyncio.wait_for(asyncio.gather(*(agent_loop(client, i, results)
                                                for i in range(N_LOOPS))), LOAD_TIMEOUT_S)
    return results


# ------------------------------------------------------------------------------ the test
def scrape(base: str) -> tuple[dict, dict]:
    """/metrics as prometheus_client's parser reads it: ({sample name: value} of the samples
    without labels other than `model`, and {"finished": {finish reason: count}}; {family:
    type})."""
    from prometheus_client.parser import text_string_to_metric_families
    status, text = get(base + "/metrics")
    assert status == 200
    samples, types = {"finished": {}}, {}
    for fam in text_string_to_metric_families(text):
        types[fam.name] = fam.type
        for s in fam.samples:
            if set(s.labels) == {"model"}:
                samples[s.name] = s.value
            elif s.name == "mtpjax_requests_finished_total":
                samples["finished"][s.labels["finish_reason"]] = s.value
    return samples, types


def idle_metrics(base: str, timeout: float = 30.0):
    """The /metrics samples once no request runs or waits (bounded)."""
    t0 = time.time()
    while True:
        samples, types = scrape(base)
        if samples["mtpjax_requests_running"] == 0 and samples["mtpjax_requests_waiting"] == 0:
            return samples, types
        assert time.time() - t0 < timeout, "requests still running after the load"
        time.sleep(0.1)


def expected(res: Result, out, tok, eos) -> dict:
    """What the client should have seen, from the offline engine's output (the final stop
    token is counted, never shown)."""
    ids = list(out.token_ids)
    if out.finish_reason == "stop" and ids and ids[-1] in (
            set(res.parsed.params.stop_token_ids) | set(eos)):
        ids = ids[:-1]
    forced = res.parsed.forced_call, res.parsed.forced_name
    msg = chat_message(tok.decode(ids, True), False, TOOLS, True, *forced)
    calls = [(c["function"]["name"], c["function"]["arguments"])
             for c in msg.get("tool_calls", ())]
    return {"content": msg["content"] or "", "calls": calls,
            "finish": finish_reason(out, bool(calls), forced[0]),
            "completion_tokens": len(out.token_ids)}


class Handles:
    """Keeps every RequestHandle the server makes (wraps online.add)."""

    def __init__(self, online):
        self.online, self.handles, self._real = online, [], online.add

    def __enter__(self):
        def add(*args, **kw):
            h = self._real(*args, **kw)
            self.handles.append(h)
            return h
        self.online.add = add
        return self

    def __exit__(self, *exc):
        del self.online.add


def test_agent_loops_under_disconnects_and_step_failures(live):
    t0 = time.time()
    with FaultInjector(live.engine, FAULTS) as faults, Handles(live.online) as made:
        results = asyncio.run(run_load(live.base))
        samples, types = idle_metrics(live.base)
    t_load = time.time() - t0
    assert len(results) == 2 * N_LOOPS

    # which request each prompt is (prompts are unique), and what failed steps held
    for res in results:
        res.parsed = parse_chat(res.body, live.limits, live.tok, live.template)
    by_prompt = {tuple(r.parsed.prompt_ids): r for r in results}
    assert len(by_prompt) == len(results), "two requests with one prompt"
    assert sorted(f.kind for f in faults.fired) == sorted(k for k, _ in FAULTS), faults.counts
    held = set().union(*(f.held for f in faults.fired))
    assert held and held <= set(by_prompt)

    # every request ended cleanly: a result, an injected failure's error, or the client's doing
    outcomes = {}
    for res in results:
        outcomes[res.outcome] = outcomes.get(res.outcome, 0) + 1
        key = tuple(res.parsed.prompt_ids)
        if res.outcome == "http_error":
            assert res.status == 500, (res.status, res.error)
        if res.outcome in ("http_error", "stream_error"):
            err = res.error
            assert isinstance(err, dict) and "injected fault" in err.get("message", ""), err
            assert err.get("type") == "server_error", err
            assert key in held, (res.loop, res.turn, err)
        elif res.outcome == "timeout":
            assert res.plan == "timeout", (res.loop, res.turn)
        elif res.outcome == "closed":
            assert res.plan == "close"
        else:
            assert res.outcome == "ok", res.outcome
        if key in held and not res.disturbed_by_client:
            assert res.outcome in ("http_error", "stream_error"), (res.loop, res.turn,
                                                                   res.outcome)
    assert outcomes.get("ok", 0) >= N_LOOPS // 2, outcomes
    assert outcomes.get("http_error", 0) + outcomes.get("stream_error", 0) > 0, outcomes
    assert outcomes.get("closed", 0) + outcomes.get("timeout", 0) > 0, outcomes
    assert live.errors.records == [], live.errors.records[:3]

    # the server's side of it: every request it took ended, once, as the client saw it
    ends = {tuple(h.prompt): h.output for h in made.handles}
    assert live.online._live == {}                      # no request left in the engine thread
    assert [h.id for h in made.handles if h._wakers] == []   # nor an async reader behind
    assert len(ends) == len(made.handles) and all(o is not None for o in ends.values())
    for res in results:
        end = ends.get(tuple(res.parsed.prompt_ids))
        if res.outcome == "ok":
            assert (end.finish_reason, end.error) in (("stop", None), ("length", None)), end
        elif res.outcome in ("http_error", "stream_error"):
            assert end.finish_reason == "error" and "injected fault" in end.error
        else:            # left early: the server may not even have read it
            assert end is None or end.finish_reason in ("cancelled", "stop", "length", "error")
    finished = samples["finished"]
    assert sum(finished.values()) == len(made.handles), finished
    assert finished["error"] == sum(o.finish_reason == "error" for o in ends.values())
    assert finished["cancelled"] > 0, finished          # the server noticed clients leave
    assert live.online.health == "ok" and live.online.fatal_error is None

    # nothing leaked: the metrics of the idle server ...
    assert types["mtpjax_prefix_cache_snapshot_slots_free"] == "gauge"
    assert types["mtpjax_prefix_cache_snapshots_pending"] == "gauge"
    assert samples["mtpjax_kv_free_pages"] == samples["mtpjax_kv_total_pages"]
    assert samples["mtpjax_prefix_cache_snapshots_pending"] == 0
    assert (samples["mtpjax_prefix_cache_snapshot_slots_free"] +
            samples["mtpjax_prefix_cache_snapshots"] ==
            samples["mtpjax_prefix_cache_snapshot_slots"])
    assert samples["mtpjax_engine_errors_total"] == len(FAULTS)
    assert samples["mtpjax_device_rebuilds_total"] == len(FAULTS)
    # ... and the engine itself, stopped, its prefix cache cleared
    live.online.shutdown()
    engine = live.engine
    assert not live.online.alive and engine._sched is None
    engine.clear_prefix_cache()
    engine.alloc.check()
    assert engine.alloc.free_pages == engine.num_pages
    assert len(engine.prefix.free_slots) == engine.prefix.num_slots and not engine.prefix.pending

    # the undisturbed requests got what the offline engine gives
    t1 = time.time()
    calm = [r for r in results if r.outcome == "ok"]
    outs = engine.generate([r.parsed.prompt_ids for r in calm], [r.parsed.params for r in calm])
    t_ref = time.time() - t1
    structured = forced = 0
    for res, out in zip(calm, outs):
        want = expected(res, out, live.tok, engine.eos)
        got = {"content": res.content, "calls": res.calls, "finish": res.finish,
               "completion_tokens": res.completion_tokens}
        assert got == want, (res.loop, res.turn, res.stream)
        if res.body.get("response_format") and res.finish == "stop":
            assert matches(json.loads(res.content), ANSWER), res.content
            structured += 1
        elif res.body.get("response_format") and res.finish == "tool_calls":
            # response_format with tools under "auto": the JSON or calls (parsing.tool_grammar)
            assert all(n == "lookup" and matches(json.loads(a), LOOKUP) for n, a in res.calls)
            structured += 1
        if res.turn == 0 and res.body["tool_choice"] != "auto":
            if res.finish == "tool_calls":
                ((name, args),) = res.calls
                assert name == "lookup" and matches(json.loads(args), LOOKUP), args
                forced += 1
            else:
                assert res.finish == "length", res.finish
    assert structured > 0 and forced > 0
    print(f"\nload {t_load:.1f} s ({outcomes}, faults held {len(held)} requests; programs "
          f"launched {faults.counts}), "
          f"offline reference {t_ref:.1f} s for {len(calm)} requests, {structured} structured "
          f"and {forced} forced calls checked")
