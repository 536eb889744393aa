"""The agent trace of `serve_bench --trace=agents`: coding-agent sessions beside other clients.

What a run does, in order:
  1. `build(tokenizer, AgentSpec)` draws the trace from `spec.seed` alone (numpy's
     default_rng; the same spec and tokenizer give the same trace, byte for byte):
     - `sessions` agent sessions on one system prompt and one tool list (an agent product's
       sessions share them), each with its own task and `turns` turns. Turns 1..T-1 ask for
       a tool call (tool_choice "required", one call: parallel_tool_calls false), the last
       turn answers (tool_choice "auto"). Before every turn t >= 2 the session gets a tool
       result of `tool_tokens` (drawn uniformly, inclusive) tokens and, with probability
       `user_message_p`, a short user message after it;
     - `foreign_clients` other clients, each sending `foreign_requests` one-shot prompts of
       `foreign_tokens` tokens (no tools) one after another.
     Tool results and foreign prompts are slices of the Python standard library's held-out
     source files (experiments/corpus.py: sorted, so the same on every machine with the same
     Python), cut to the drawn size in the checkpoint's tokens.
  2. Every client is a closed loop: its next request goes in when its previous one ends (a
     session's turn t+1 = its messages so far + the assistant reply, with its tool_calls, +
     the tool message + the user message, if any). All clients start at once, so foreign
     prompts interleave with conversations waiting for their next turn. Replies come from
     the model, so a turn's prompt is known only once the previous turn ended; the trace
     fixes everything else (seeds included: a request's tokens depend on its seed and
     prompt only, so the replies, and with them every prompt, are the same on every run,
     path and K).
  3. The same requests run two ways: over HTTP against `python -m experiments serve`
     (`run_clients` with an HTTP `send`: wall clock, the real server), or in this process
     on the engine the server would build (`run_engine`: the request bodies go through the
     server's own `parse_chat`, the replies through its `chat_message`, so the engine sees
     the same prompt ids and sampling parameters; the engine's clock is the wall clock or
     the H200 cost model's VirtualClock).
  4. `summarize` reports per session turn: time to first token (mean, p90), prompt tokens
     and cached tokens (the response's usage.prompt_tokens_details.cached_tokens, OpenAI's
     field; None, shown "n/a", where the server or engine does not report it), and the
     share of the previous turn's prompt that was cached; then the foreign requests, tokens
     per second and failures over the run, and the prefix cache's counters over the run.

Time to first token over HTTP: requests ask for `logprobs`, so every committed token sends a
chunk even while the tool-call parser holds its text back (a call's text is streamed only
once the call parses); the first chunk after the role chunk is the first token.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import statistics
import threading
import time
from typing import Callable

import numpy as np

SYSTEM = ("You are a coding agent working in a checkout of the Python standard library. Read "
          "files, search and run commands with the tools; change as little as you can and "
          "say what you changed.")
TASKS = ("Fix the failing test that covers {path}.",
         "Explain what {path} does and where it is used.",
         "Find a bug in {path} and propose a patch.",
         "Add type hints to the public functions of {path}.")
FOLLOW_UPS = ("Keep going.", "Also check the callers of {path}.",
              "Is there a test for that?", "Make the change smaller.")
FOREIGN = "Review this file and list anything that looks wrong:\n\n"


def _string(description: str, max_length: int) -> dict:
    return {"type": "string", "description": description, "maxLength": max_length}


TOOLS = (
    {"type": "function", "function": {
        "name": "read_file", "description": "Read a file of the repository.",
        "parameters": {"type": "object", "properties": {
            "path": _string("path relative to the repository root", 40)},
            "required": ["path"]}}},
    {"type": "function", "function": {
        "name": "search", "description": "Search the repository for a regular expression.",
        "parameters": {"type": "object", "properties": {
            "pattern": _string("a Python regular expression", 32)},
            "required": ["pattern"]}}},
    {"type": "function", "function": {
        "name": "run_command", "description": "Run a shell command in the repository.",
        "parameters": {"type": "object", "properties": {
            "command": _string("the command line", 40)},
            "required": ["command"]}}},
)


@dataclasses.dataclass(frozen=True)
class AgentSpec:
    sessions: int = 4
    turns: int = 3
    tool_tokens: tuple[int, int] = (300, 3000)       # a tool result's size, inclusive
    user_message_p: float = 0.25                      # a user message after a tool result
    foreign_clients: int = 2
    foreign_requests: int = 2                         # one-shot prompts per foreign client
    foreign_tokens: tuple[int, int] = (1000, 3000)
    max_tokens: int = 64                              # every reply's max_tokens
    seed: int = 0

    def __post_init__(self):
        for name in ("sessions", "turns", "max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("foreign_clients", "foreign_requests"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("tool_tokens", "foreign_tokens"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise ValueError(f"{name} must be a range 1 <= low <= high, got {lo}..{hi}")
        if not 0.0 <= self.user_message_p <= 1.0:
            raise ValueError(f"user_message_p must be in [0, 1], got {self.user_message_p}")


@dataclasses.dataclass(frozen=True)
class Turn:
    tool_result: str | None      # the tool message before this turn (None on turn 1)
    tool_tokens: int             # its size in the checkpoint's tokens (0 on turn 1)
    user: str | None             # the user message (turn 1: the task; later: a follow-up)
    tool_choice: str             # "required": a tool call; "auto": the answer (last turn)
    seed: int


@dataclasses.dataclass(frozen=True)
class Session:
    turns: tuple[Turn, ...]


@dataclasses.dataclass(frozen=True)
class OneShot:
    prompt: str
    tokens: int                  # the prompt's size in tokens (the user message's content)
    seed: int


@dataclasses.dataclass(frozen=True)
class Trace:
    spec: AgentSpec
    system: str
    tools: tuple[dict, ...]
    sessions: tuple[Session, ...]
    foreign: tuple[tuple[OneShot, ...], ...]     # per foreign client, in order

    def digest(self) -> str:
        """sha256 of everything the trace fixes (determinism is checked on this)."""
        return hashlib.sha256(json.dumps(dataclasses.asdict(self), sort_keys=True)
                              .encode()).hexdigest()


# -------------------------------------------------------------------------------- text
@functools.lru_cache(maxsize=4)
def _corpus(tokenizer, min_tokens: int) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """(paths, token ids) of the held-out stdlib files in sorted order, joined by blank
    lines, until there are at least min_tokens tokens."""
    from experiments import corpus
    paths, ids = [], []
    for p in corpus.split_files("heldout"):
        text = corpus.read_file(p)
        if not text or not text.strip():
            continue
        paths.append(p)
        ids += tokenizer.encode(f"# {p}\n{text}\n\n")
        if len(ids) >= min_tokens:
            break
    if len(ids) < min_tokens:
        raise ValueError(f"the held-out corpus has {len(ids)} tokens, fewer than {min_tokens}")
    return tuple(paths), tuple(ids)


def sized_text(tokenizer, pool: tuple[int, ...], start: int, n: int, prefix: str = "") -> str:
    """prefix + text cut from the pool so that the whole encodes to about n tokens: the pool's
    tokens [start, start + k) decoded, stripped (the chat template trims contents), k grown
    or shrunk (at most 8 times) towards n tokens: the result is within a token or two."""
    head = len(tokenizer.encode(prefix)) if prefix else 0
    k = max(1, n - head)

    def text(k):
        return prefix + tokenizer.decode(list(pool[start:start + k])).strip()
    for _ in range(8):
        got = len(tokenizer.encode(text(k)))
        if got == n:
            break
        k = max(1, k + (n - got))
    return text(k)


def build(tokenizer, spec: AgentSpec = AgentSpec()) -> Trace:
    """The trace of `spec` (module docstring, step 1): deterministic in spec and tokenizer."""
    rng = np.random.default_rng(spec.seed)
    need = 4 * max(spec.tool_tokens[1], spec.foreign_tokens[1])
    paths, pool = _corpus(tokenizer, need)

    def cut(n: int, prefix: str = "") -> str:
        start = int(rng.integers(0, len(pool) - 2 * n))
        return sized_text(tokenizer, pool, start, n, prefix)

    def path() -> str:
        return paths[int(rng.integers(0, len(paths)))]

    sessions = []
    for s in range(spec.sessions):
        turns = [Turn(None, 0, TASKS[int(rng.integers(0, len(TASKS)))].format(path=path()),
                      "required" if spec.turns > 1 else "auto", spec.seed * 1_000_003 + 1000 * s)]
        for t in range(1, spec.turns):
            n = int(rng.integers(spec.tool_tokens[0], spec.tool_tokens[1] + 1))
            result = cut(n)
            user = None
            if rng.random() < spec.user_message_p:
                user = FOLLOW_UPS[int(rng.integers(0, len(FOLLOW_UPS)))].format(path=path())
            turns.append(Turn(result, n, user, "required" if t < spec.turns - 1 else "auto",
                              spec.seed * 1_000_003 + 1000 * s + t))
        sessions.append(Session(tuple(turns)))
    foreign = []
    for c in range(spec.foreign_clients):
        shots = []
        for r in range(spec.foreign_requests):
            n = int(rng.integers(spec.foreign_tokens[0], spec.foreign_tokens[1] + 1))
            shots.append(OneShot(cut(n, FOREIGN), n,
                                 spec.seed * 1_000_003 + 500_000 + 1000 * c + r))
        foreign.append(tuple(shots))
    return Trace(spec, SYSTEM, TOOLS, tuple(sessions), tuple(foreign))


def context_needed(trace: Trace, tokenizer, template) -> int:
    """An upper bound on any request's prompt + max_tokens: the longest session's first
    prompt (rendered with the template), then per later turn its tool result and user message
    plus 64 tokens of chat markup and twice max_tokens for the reply before it (a call's
    re-rendered XML is about as long as the generated one)."""
    worst = 0
    for s in trace.sessions:
        first = tokenizer.encode(template.render(
            [{"role": "system", "content": trace.system},
             {"role": "user", "content": s.turns[0].user}], True, list(trace.tools),
            {"enable_thinking": False}))
        n = len(first)
        for t in s.turns[1:]:
            n += t.tool_tokens + len(tokenizer.encode(t.user or "")) + 64 + \
                2 * trace.spec.max_tokens
        worst = max(worst, n + trace.spec.max_tokens)
    for shots in trace.foreign:
        for o in shots:
            worst = max(worst, o.tokens + 16 + trace.spec.max_tokens)
    return worst


# ----------------------------------------------------------------------------- clients
def _body(model: str, messages: list[dict], max_tokens: int, seed: int, **more) -> dict:
    """A streamed chat request with thinking off; sampling the checkpoint's defaults
    (generation_config.json) with the trace's seed; logprobs for the first-token time."""
    return {"model": model, "messages": [dict(m) for m in messages], "max_tokens": max_tokens,
            "seed": seed, "stream": True, "stream_options": {"include_usage": True},
            "logprobs": True, "chat_template_kwargs": {"enable_thinking": False}, **more}


class SessionClient:
    """One agent session: `body()` is the next turn's request (None when done), `advance`
    takes the assistant message of the reply and adds the next tool result and user
    message."""
    kind = "session"

    def __init__(self, index: int, trace: Trace, model: str):
        self.index, self.trace, self.model = index, trace, model
        self.turns = trace.sessions[index].turns
        self.turn = 0
        self.messages: list[dict] = [{"role": "system", "content": trace.system},
                                     {"role": "user", "content": self.turns[0].user}]

    def body(self) -> dict | None:
        if self.turn >= len(self.turns):
            return None
        t = self.turns[self.turn]
        return _body(self.model, self.messages, self.trace.spec.max_tokens, t.seed,
                     tools=[dict(x) for x in self.trace.tools], tool_choice=t.tool_choice,
                     parallel_tool_calls=False)

    def info(self) -> dict:
        t = self.turns[self.turn]
        return {"kind": self.kind, "client": self.index, "turn": self.turn + 1,
                "tool_tokens": t.tool_tokens,
                "user_message": self.turn > 0 and t.user is not None}

    def advance(self, message: dict) -> None:
        """The reply's assistant message -> history; tool call ids made deterministic (the
        server draws them at random; the template does not render them)."""
        calls = [{"id": f"call_{self.index}_{self.turn}_{i}", "type": "function",
                  "function": {"name": c["function"]["name"],
                               "arguments": c["function"]["arguments"]}}
                 for i, c in enumerate(message.get("tool_calls") or [])]
        msg = {"role": "assistant", "content": message.get("content") or ""}
        if calls:
            msg["tool_calls"] = calls
        self.messages.append(msg)
        self.turn += 1
        if self.turn < len(self.turns):
            t = self.turns[self.turn]
            tool = {"role": "tool", "content": t.tool_result}
            if calls:
                tool["tool_call_id"] = calls[0]["id"]
            self.messages.append(tool)
            if t.user is not None:
                self.messages.append({"role": "user", "content": t.user})


class ForeignClient:
    """Another client's one-shot long prompts, one after another."""
    kind = "foreign"

    def __init__(self, index: int, trace: Trace, model: str):
        self.index, self.shots, self.model = index, trace.foreign[index], model
        self.max_tokens = trace.spec.max_tokens
        self.turn = 0

    def body(self) -> dict | None:
        if self.turn >= len(self.shots):
            return None
        o = self.shots[self.turn]
        return _body(self.model, [{"role": "user", "content": o.prompt}], self.max_tokens,
                     o.seed)

    def info(self) -> dict:
        return {"kind": self.kind, "client": self.index, "turn": self.turn + 1,
                "tool_tokens": 0, "user_message": False}

    def advance(self, message: dict) -> None:
        self.turn += 1


def clients_of(trace: Trace, model: str) -> list:
    return ([SessionClient(i, trace, model) for i in range(len(trace.sessions))]
            + [ForeignClient(i, trace, model) for i in range(len(trace.foreign))])


def reply_digest(message: dict) -> str:
    """A reply's content and calls (names, arguments), hashed: equal across runs when the
    tokens are."""
    calls = [(c["function"]["name"], c["function"]["arguments"])
             for c in message.get("tool_calls") or []]
    return hashlib.sha256(json.dumps([message.get("content") or "", calls]).encode()
                          ).hexdigest()[:16]


# --------------------------------------------------------------------------------- HTTP
def run_clients(trace: Trace, model: str, send: Callable[[dict], dict]) -> dict:
    """Every client as a thread (closed loop) through send(body) -> {ttft_s, latency_s,
    usage, message, finish_reason} (serve_bench.stream_chat over HTTP). A request that raises
    is a failure and ends its client (a session cannot go on without the reply). Returns
    {"records", "wall_s"}."""
    records, lock = [], threading.Lock()

    def loop(client):
        while (body := client.body()) is not None:
            info = client.info()
            try:
                res = send(body)
            except Exception as e:  # noqa: BLE001 - a failure of this request, reported
                with lock:
                    records.append({**info, "error": f"{type(e).__name__}: {e}"[:300]})
                return
            usage = res["usage"]
            details = usage.get("prompt_tokens_details") or {}
            with lock:
                records.append({**info, "prompt_tokens": usage["prompt_tokens"],
                                "cached_tokens": details.get("cached_tokens"),
                                "completion_tokens": usage["completion_tokens"],
                                "ttft_s": res["ttft_s"], "latency_s": res["latency_s"],
                                "finish_reason": res["finish_reason"],
                                "reply": reply_digest(res["message"]), "error": None})
            client.advance(res["message"])

    t0 = time.perf_counter()
    threads = [threading.Thread(target=loop, args=(c,)) for c in clients_of(trace, model)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"records": records, "wall_s": time.perf_counter() - t0}


# ------------------------------------------------------------------------------ engine
def cached_tokens_of(out) -> int | None:
    """The prompt tokens an engine output says were served from the prefix cache:
    `out.cached_tokens` or `out.stats.cached_tokens` where the engine reports it, else None."""
    for obj in (out, getattr(out, "stats", None)):
        v = getattr(obj, "cached_tokens", None)
        if v is not None:
            return int(v)
    return None


def reply_message(server, parsed, out) -> dict:
    """The assistant message the server would send for this engine output (non-streamed
    body): the final stop token dropped, the text decoded as the server does, then the
    reasoning split and tool-call parse (mtpjax/serving/app.chat_message)."""
    from mtpjax.serving.app import chat_message
    ids = list(out.token_ids)
    stops = set(parsed.params.stop_token_ids) | set(server.online.engine.eos)
    if out.finish_reason == "stop" and ids and ids[-1] in stops:
        ids = ids[:-1]
    text = server.tokenizer.decode(ids, skip_special_tokens=parsed.skip_special_tokens)
    return chat_message(text, parsed.enable_thinking, parsed.tools, parsed.parallel_tool_calls,
                        parsed.forced_call, parsed.forced_name)


def run_engine(server, engine, trace: Trace) -> dict:
    """The trace on `engine` in this process (module docstring, step 3), closed loop as
    run_clients: each request's body goes through server.parse_chat (the prompt ids and
    SamplingParams the HTTP server would submit) and its reply through `reply_message`.
    Times come from the engine's clock (card.now: its VirtualClock, else perf_counter):
    time to first token and latency run from the submit. Returns {"records", "wall_s",
    "prefix_cache" (the cache's counters over the run, or None without a cache)}."""
    from experiments import card as card_lib
    from mtpjax.serving.app import finish_reason
    from mtpjax.serving.protocol import APIError

    now = lambda: card_lib.now(engine)
    clients = clients_of(trace, server.limits.model)
    records, live, first = [], {}, {}
    ids = iter(range(1 << 62))

    def submit(c: int) -> None:
        client = clients[c]
        body = client.body()
        if body is None:
            return
        info = client.info()
        try:
            parsed = server.parse_chat(body)
        except APIError as e:      # a failure; a session cannot go on without the reply
            records.append({**info, "error": f"APIError: {e}"[:300]})
            return
        rid = next(ids)
        t = now()
        err = engine.submit(rid, parsed.prompt_ids, parsed.params)
        if err is None:
            live[rid] = (c, info, parsed, t)
        else:
            records.append({**info, "error": f"refused: {err.error}"[:300]})

    before = engine.stats().get("prefix_cache")
    engine.start(lambda rid, new: first.setdefault(rid, now()))
    t0 = now()
    try:
        for c in range(len(clients)):
            submit(c)
        while engine.has_work():
            for rid, out in engine.step().items():
                c, info, parsed, t_sub = live.pop(rid)
                end = now()
                if out.finish_reason == "error":
                    records.append({**info, "error": f"engine: {out.error}"[:300]})
                    continue
                msg = reply_message(server, parsed, out)
                records.append({**info, "prompt_tokens": len(out.prompt_token_ids),
                                "cached_tokens": cached_tokens_of(out),
                                "completion_tokens": len(out.token_ids),
                                "ttft_s": first[rid] - t_sub if rid in first else None,
                                "latency_s": end - t_sub,
                                "finish_reason": finish_reason(out, "tool_calls" in msg,
                                                               parsed.forced_call),
                                "reply": reply_digest(msg), "error": None})
                clients[c].advance(msg)
                submit(c)
    finally:
        engine.stop()
    wall = now() - t0
    after = engine.stats().get("prefix_cache")
    return {"records": records, "wall_s": wall, "prefix_cache": prefix_delta(before, after)}


PREFIX_COUNTERS = ("lookups", "hits", "tokens_reused", "inserted", "evicted")


def prefix_delta(before: dict | None, after: dict | None) -> dict | None:
    """The prefix cache's counters over a run (PrefixCache.report keys, or /metrics' names
    without the mtpjax_prefix_cache_ prefix)."""
    if after is None:
        return None
    before = before or {}
    return {k: after.get(k, 0) - before.get(k, 0) for k in PREFIX_COUNTERS}


# ----------------------------------------------------------------------------- summary
def _mean(xs):
    return statistics.fmean(xs) if xs else None


def _p90(xs):
    return float(np.percentile(xs, 90)) if xs else None


def _stats(rows: list[dict]) -> dict:
    ok = [r for r in rows if r.get("error") is None]
    ttft = [r["ttft_s"] for r in ok if r["ttft_s"] is not None]
    cached = [r["cached_tokens"] for r in ok]
    have = all(c is not None for c in cached) and cached
    return {"requests": len(rows), "failures": len(rows) - len(ok),
            "ttft_mean_s": _mean(ttft), "ttft_p90_s": _p90(ttft),
            "prompt_tokens_mean": _mean([r["prompt_tokens"] for r in ok]),
            "cached_tokens_mean": _mean(cached) if have else None}


def summarize(run: dict) -> dict:
    """Per session turn, the foreign requests, turns >= 2 together, and the run's totals
    (module docstring, step 4). reuse_of_previous_prompt: cached tokens of turn t over the
    prompt tokens of the same session's turn t - 1, averaged (None without cached tokens)."""
    recs = run["records"]
    sess = [r for r in recs if r["kind"] == "session"]
    prompt = {(r["client"], r["turn"]): r.get("prompt_tokens") for r in sess}
    turns = []
    for t in sorted({r["turn"] for r in sess}):
        rows = [r for r in sess if r["turn"] == t]
        row = {"turn": t, **_stats(rows),
               "user_messages": sum(bool(r.get("user_message")) for r in rows),
               "tool_tokens_mean": _mean([r["tool_tokens"] for r in rows]) if t > 1 else None}
        shares = [r["cached_tokens"] / prompt[r["client"], t - 1] for r in rows
                  if r.get("error") is None and r["cached_tokens"] is not None
                  and prompt.get((r["client"], t - 1))]
        row["reuse_of_previous_prompt"] = _mean(shares) if t > 1 and shares else None
        turns.append(row)
    later = [r for r in sess if r["turn"] >= 2]
    ok = [r for r in recs if r.get("error") is None]
    tokens = sum(r["completion_tokens"] for r in ok)
    wall = run["wall_s"]
    return {"turns": turns, "later_turns": _stats(later),
            "foreign": _stats([r for r in recs if r["kind"] == "foreign"]),
            "requests": len(recs), "failures": len(recs) - len(ok),
            "errors": sorted({r["error"] for r in recs if r.get("error")})[:5],
            "completion_tokens": tokens, "prompt_tokens": sum(r["prompt_tokens"] for r in ok),
            "wall_s": wall, "tokens_per_s": tokens / wall if wall else None,
            "prefix_cache": run.get("prefix_cache"),
            "replies": {f"{r['kind']}/{r['client']}/{r['turn']}": r["reply"] for r in ok}}


# -------------------------------------------------------------------------------- card
def _ms(x):
    return "n/a" if x is None else f"{1e3 * x:.0f}"


def _num(x, nd=0):
    return "n/a" if x is None else f"{x:.{nd}f}"


def render_md(card: dict) -> str:
    """card.md: how the trace ran, then one table row per (run, turn)."""
    spec = card["spec"]
    lines = ["# serve_bench --trace=agents", "",
             f"`{card['command']}`", "",
             f"{spec['sessions']} agent sessions x {spec['turns']} turns (tool results "
             f"{spec['tool_tokens'][0]}-{spec['tool_tokens'][1]} tokens, a user message after "
             f"one with p = {spec['user_message_p']}), {spec['foreign_clients']} foreign "
             f"clients x {spec['foreign_requests']} one-shot prompts of "
             f"{spec['foreign_tokens'][0]}-{spec['foreign_tokens'][1]} tokens, max_tokens "
             f"{spec['max_tokens']}, seed {spec['seed']}; serve flags `{card['serve_flags']}`; "
             f"trace sha256 {card['trace_digest'][:12]}. Time to first token from the request "
             f"(HTTP: the client's clock; in-process: the submit, on the engine's clock). "
             f"h200: {card['h200_words']}.", "",
             "| path | clock | engine | turn | requests | TTFT mean ms | TTFT p90 ms | "
             "prompt tokens | cached tokens | reuse of previous prompt | failures |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for run in card["runs"]:
        s = run["summary"]
        head = f"| {run['path']} | {run['clock']} | {run['engine']} (K={run['k']}) "
        for t in s["turns"]:
            lines.append(head + f"| {t['turn']} | {t['requests']} | {_ms(t['ttft_mean_s'])} | "
                         f"{_ms(t['ttft_p90_s'])} | {_num(t['prompt_tokens_mean'])} | "
                         f"{_num(t['cached_tokens_mean'])} | "
                         f"{_num(t['reuse_of_previous_prompt'], 2)} | {t['failures']} |")
        for name, st in (("turns >= 2", s["later_turns"]), ("foreign", s["foreign"])):
            lines.append(head + f"| {name} | {st['requests']} | {_ms(st['ttft_mean_s'])} | "
                         f"{_ms(st['ttft_p90_s'])} | {_num(st['prompt_tokens_mean'])} | "
                         f"{_num(st['cached_tokens_mean'])} | | {st['failures']} |")
    lines += ["", "Over each run (wall s: the run's time on its clock; host s: the part of it "
              "measured on this machine's host, h200 only; prefix cache: its counters over the "
              "run):", "",
              "| path | clock | engine | wall s | host s | completion tokens | tokens/s | "
              "failures | prefix cache: tokens reused / prompt tokens | hits / lookups | "
              "evicted |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for run in card["runs"]:
        s, pc = run["summary"], run["summary"]["prefix_cache"]
        cache = ("n/a", "n/a", "n/a") if pc is None else (
            f"{pc['tokens_reused']:.0f} / {s['prompt_tokens']} "
            f"({pc['tokens_reused'] / max(1, s['prompt_tokens']):.0%})",
            f"{pc['hits']:.0f} / {pc['lookups']:.0f}", f"{pc['evicted']:.0f}")
        lines.append(f"| {run['path']} | {run['clock']} | {run['engine']} (K={run['k']}) | "
                     f"{s['wall_s']:.1f} | {_num(run.get('host_s'), 1)} | "
                     f"{s['completion_tokens']} | "
                     f"{_num(s['tokens_per_s'], 1)} | {s['failures']} | {' | '.join(cache)} |")
    same = card.get("replies_identical")
    lines += ["", f"Replies identical across runs (same seeds): "
              f"{'n/a' if same is None else ('yes' if same else 'NO')}."]
    return "\n".join(lines) + "\n"
