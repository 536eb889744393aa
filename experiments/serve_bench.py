"""`python -m experiments serve_bench [--concurrency=1,8,32] [--max_tokens=64] [serve flags]`

Load test of the OpenAI-compatible server (`python -m experiments serve`, mtpjax/serving/):
starts it as a subprocess on a free port with the given serve flags
(`--serve_flags="--max_lanes=8 ..."`), waits until it is healthy, warms it (one round at the
highest concurrency, unmeasured), then for each concurrency c runs `--rounds` x c streaming
chat requests from c client threads (each client sends its next request when the previous one
ends) and reports:

    requests/s = requests / wall time, tokens/s = completion tokens (usage) / wall time,
    mean time to first token, mean request latency

Every request has its own seed and temperature 0.8; prompts differ per request. The client is
the standard library (http.client, SSE parsed by hand), so the bench needs nothing beyond the
server's own dependencies. Writes `--out` (card.json) and prints it as the last stdout line.

`--clock=h200` (`--clock_calibration=PATH`: constants from a gpu_check calibration file): the
same load (same engine flags, same requests, closed loop: each client's
next request goes in when its previous one ends) on the engine's cost_model.VirtualClock,
predicted for Qwen3.5-27B on one H200 by the cost model, not timed. An online server's time is its clients' wall time, so there is no HTTP server
here: the engine `serve` would build (`serve.load_server`: same flags, same warm-up) runs in
this process as a continuous session (start / submit / step) and every time is the engine's
clock: a request's TTFT and latency run from its submit to its first token / its end, all
on the clock, and a level's wall time is the clock's. HTTP, JSON, tokenization and SSE are
not modelled (the wall run has them); the host time measured inside the engine is on the
clock and reported per level on its own line.

`--trace=agents`: multi-turn coding-agent sessions with tool calls and long tool results, and
other clients' one-shot long prompts interleaved (experiments/agent_trace.py; sizes from the
`--agent_*` flags). One command runs the same trace for the default candidate (the serve
flags as given: `--num_speculative_tokens`, default 4, adaptive depth) and stock (the same
flags with `--num_speculative_tokens=0`), each over `--agent_paths`: `http` (a real server,
wall clock), `wall` and `h200` (in this process on the engine `serve` would build, timed on
this machine's clock or on the cost model's H200 clock, as `--clock=h200` above). `--clock` and
`--concurrency` do not apply (every client of the trace runs at once); `--max_tokens` is
every reply's. The serve flags' `--max_seq_len` is raised to what the trace needs unless they
set it. Writes card.json and card.md (default runs/serve_bench_agents/).
"""

from __future__ import annotations

import contextlib
import dataclasses
import http.client
import json
import os
import shlex
import socket
import statistics
import subprocess
import sys
import threading
import time

from absl import flags

from experiments import card as card_lib

FLAGS = flags.FLAGS
flags.DEFINE_list("concurrency", ["1", "8", "32"], "concurrent clients per measurement")
flags.DEFINE_integer("rounds", 2, "requests per client per measurement")
flags.DEFINE_integer("max_tokens", 64, "max_tokens of every request")
flags.DEFINE_string("serve_flags", "", "extra flags for `python -m experiments serve`")
flags.DEFINE_string("out", "runs/serve_bench/card.json", "where to write the results")
card_lib.define_clock_flag()
card_lib.define_simulate_flag()
flags.DEFINE_float("startup_timeout_s", 1800.0, "how long the server may take to come up "
                   "(warmup compiles every decode program)")
flags.DEFINE_enum("trace", "stories", ["stories", "agents"], "stories: one-shot chats at each "
                  "--concurrency; agents: agent sessions with tool calls and long tool results "
                  "beside other clients' long prompts (experiments/agent_trace.py)")
flags.DEFINE_integer("agent_sessions", 4, "agents: concurrent agent sessions")
flags.DEFINE_integer("agent_turns", 3, "agents: turns per session (all but the last call a tool)")
flags.DEFINE_list("agent_tool_tokens", ["300", "3000"], "agents: a tool result's size in "
                  "tokens, low,high (drawn uniformly)")
flags.DEFINE_float("agent_user_message_p", 0.25, "agents: probability of a user message "
                   "after a tool result")
flags.DEFINE_integer("agent_foreign_clients", 2, "agents: other clients sending one-shot "
                     "long prompts")
flags.DEFINE_integer("agent_foreign_requests", 2, "agents: one-shot prompts per foreign client")
flags.DEFINE_list("agent_foreign_tokens", ["1000", "3000"], "agents: a one-shot prompt's size "
                  "in tokens, low,high")
flags.DEFINE_integer("agent_seed", 0, "agents: the trace's seed")
flags.DEFINE_list("agent_paths", ["http", "wall", "h200"], "agents: http (real server, wall "
                  "clock), wall / h200 (in-process engine on that clock)")
flags.DEFINE_list("agent_engines", ["candidate", "stock"], "agents: candidate (the serve "
                  "flags' K) and / or stock (K = 0)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stream_chat(port: int, body: dict) -> dict:
    """One streaming chat request; returns ttft_s (the first chunk after the role chunk with
    text, a tool call or a token's log probability), latency_s, completion_tokens, usage,
    finish_reason and the assistant message (content, tool_calls put together from the
    deltas)."""
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    conn.request("POST", "/v1/chat/completions", json.dumps(body),
                 {"Content-Type": "application/json"})
    r = conn.getresponse()
    if r.status != 200:
        raise RuntimeError(f"HTTP {r.status}: {r.read()[:300]!r}")
    ttft, usage, finish, content, calls = None, None, None, [], {}
    for raw in r:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        if "error" in chunk:
            raise RuntimeError(f"error in the stream: {chunk['error']}")
        if chunk.get("usage"):
            usage = chunk["usage"]
        for ch in chunk.get("choices", []):
            d = ch.get("delta", {})
            if ttft is None and (d.get("content") or d.get("reasoning_content")
                                 or d.get("tool_calls") or (ch.get("logprobs") or {}).get(
                                     "content")):
                ttft = time.perf_counter() - t0
            content.append(d.get("content") or "")
            for c in d.get("tool_calls") or []:
                call = calls.setdefault(c["index"], {"id": None, "type": "function",
                                                     "function": {"name": "", "arguments": ""}})
                call["id"] = c.get("id") or call["id"]
                f = c.get("function") or {}
                call["function"]["name"] += f.get("name") or ""
                call["function"]["arguments"] += f.get("arguments") or ""
            finish = ch.get("finish_reason") or finish
    conn.close()
    if usage is None:
        raise RuntimeError("the stream ended without a usage chunk")
    message = {"role": "assistant", "content": "".join(content)}
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return {"ttft_s": ttft, "latency_s": time.perf_counter() - t0,
            "completion_tokens": usage["completion_tokens"], "usage": usage,
            "finish_reason": finish, "message": message}


def request_body(model: str, i: int, max_tokens: int) -> dict:
    """Request i of a level: its own seed and prompt, temperature 0.8, thinking off."""
    return {"model": model, "stream": True, "stream_options": {"include_usage": True},
            "max_tokens": max_tokens, "temperature": 0.8, "seed": i,
            "messages": [{"role": "user", "content": f"Request {i}: tell a story."}],
            "chat_template_kwargs": {"enable_thinking": False}}


def run_level(port: int, model: str, clients: int, rounds: int, max_tokens: int,
              seed0: int) -> dict:
    results, errors = [], []
    lock = threading.Lock()

    def client(c: int):
        for r in range(rounds):
            i = seed0 + c * rounds + r
            body = request_body(model, i, max_tokens)
            try:
                res = stream_chat(port, body)
            except Exception as e:  # noqa: BLE001 - reported below
                with lock:
                    errors.append(f"{type(e).__name__}: {e}")
                return
            with lock:
                results.append(res)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed, first: {errors[0]}")
    toks = sum(r["completion_tokens"] for r in results)
    ttfts = [r["ttft_s"] for r in results if r["ttft_s"] is not None]
    return {"clients": clients, "requests": len(results), "wall_s": wall,
            "requests_per_s": len(results) / wall, "tokens_per_s": toks / wall,
            "completion_tokens": toks,
            "mean_ttft_s": statistics.fmean(ttfts) if ttfts else None,
            "mean_latency_s": statistics.fmean(r["latency_s"] for r in results)}


def run_level_clocked(engine, requests: list[list[tuple]]) -> dict:
    """One level on the engine's clock: requests[c] = client c's (prompt ids, SamplingParams)
    in order; the first of each goes in at once, the next when the previous ends (closed
    loop, as run_level's clients). Returns run_level's keys, every time on the clock, plus the
    clock's device (modelled) and host (measured) seconds over the level."""
    clock = engine.clock
    queues = [list(r) for r in requests]
    submitted, first, owner, ends = {}, {}, {}, []
    ids = iter(range(1 << 62))

    def submit(c: int) -> None:
        prompt, params = queues[c].pop(0)
        rid = next(ids)
        submitted[rid], owner[rid] = clock.now, c
        err = engine.submit(rid, prompt, params)
        if err is not None:
            raise RuntimeError(f"request refused: {err.error}")

    engine.start(lambda rid, new: first.setdefault(rid, clock.now))
    t0, dev0, host0, idle0 = clock.now, clock.device_s, clock.host_s, clock.idle_s
    iterations = 0
    try:
        for c in range(len(queues)):
            submit(c)
        while engine.has_work():
            done = engine.step()
            iterations += 1
            for rid, out in done.items():
                if out.finish_reason == "error":
                    raise RuntimeError(f"request failed: {out.error}")
                ends.append((rid, clock.now, len(out.token_ids)))
                if queues[owner[rid]]:
                    submit(owner[rid])
    finally:
        engine.stop()
    wall = clock.now - t0
    toks = sum(n for *_, n in ends)
    ttfts = [first[rid] - submitted[rid] for rid, *_ in ends if rid in first]
    # host: the time the modelled device waited for the host (host work it could not
    # hide behind a launched step); host_work: all of the host's own time
    dev, host = clock.device_s - dev0, clock.idle_s - idle0
    return {"clients": len(queues), "requests": len(ends), "wall_s": wall,
            "requests_per_s": len(ends) / wall, "tokens_per_s": toks / wall,
            "completion_tokens": toks,
            "mean_ttft_s": statistics.fmean(ttfts) if ttfts else None,
            "mean_latency_s": statistics.fmean(t - submitted[rid] for rid, t, _ in ends),
            "engine_iterations": iterations, "device_s": dev, "host_s": host,
            "host_work_s": clock.host_s - host0,
            "host_share": host / wall if wall else None}


def level_requests(server, clients: int, rounds: int, max_tokens: int, seed0: int):
    """run_level's requests as the server parses them (chat template, sampling): client c's
    list of (prompt ids, SamplingParams)."""
    out = []
    for c in range(clients):
        reqs = []
        for r in range(rounds):
            p = server.parse_chat(request_body(server.limits.model, seed0 + c * rounds + r,
                                               max_tokens))
            reqs.append((p.prompt_ids, p.params))
        out.append(reqs)
    return out


def clock_main(levels: list[int]) -> dict:
    """--clock=h200: the load on the engine `serve --serve_flags` builds, in this process, on
    its VirtualClock (module docstring). Returns the card."""
    from experiments import serve          # defines serve's flags: parse --serve_flags into them
    FLAGS(["serve", *shlex.split(FLAGS.serve_flags)])
    t0 = time.perf_counter()
    server = serve.load_server(FLAGS)
    server.online.shutdown()                # its engine only: no HTTP, no online loop
    engine = server.online.engine
    engine.clock = card_lib.make_clock("h200", engine.k,
                                       weights=card_lib.clock_weights(engine.params),
                                       tp=engine.tp, page_size=engine.page_size,
                                       calibration=FLAGS.clock_calibration)
    if engine.k:                            # timing only: the replies are not the model's
        engine.simulated = card_lib.simulator(FLAGS.simulate_acceptance)
    startup = time.perf_counter() - t0
    words = card_lib.predicted_words(engine.tp, FLAGS.clock_calibration)
    say = lambda m: print(f"[serve_bench h200] {m}", file=sys.stderr, flush=True)
    say(f"engine up in {startup:.1f}s (this machine): k={engine.k}, lanes={engine.max_lanes}; "
        f"times below: {words}")
    top = max(levels)
    run_level_clocked(engine, level_requests(server, top, 1, FLAGS.max_tokens, 10_000))  # warm
    rows = []
    for i, c in enumerate(levels):
        row = run_level_clocked(engine, level_requests(server, c, FLAGS.rounds,
                                                       FLAGS.max_tokens, 100_000 * (i + 1)))
        rows.append(row)
        say(f"{c:3d} clients: {row['requests']} requests in {row['wall_s']:.2f}s  "
            f"{row['requests_per_s']:.2f} req/s  {row['tokens_per_s']:.1f} tok/s  ttft "
            f"{row['mean_ttft_s']:.3f}s  latency {row['mean_latency_s']:.2f}s")
        say(f"{c:3d} clients: host {row['host_s']:.3f}s measured here of {row['wall_s']:.3f}s "
            f"on the clock ({row['host_share']:.0%}), modelled device {row['device_s']:.3f}s")
    return {"command": "python -m experiments serve_bench " + " ".join(sys.argv[2:]),
            "clock": "h200", "time": words,
            "how": "in-process engine session on its VirtualClock (no HTTP server): TTFT and "
                   "latency from submit, every time on the clock; host time measured here",
            "serve_command": "serve " + FLAGS.serve_flags + " (load_server, in this process)",
            "max_tokens": FLAGS.max_tokens, "rounds": FLAGS.rounds, "startup_s": startup,
            "cpu_count": os.cpu_count(), "levels": rows,
            "simulated_acceptance": (None if engine.simulated is None
                                     else engine.simulated.report()),
            "model": engine.clock.report()["model"]}


def _metrics(port: int) -> dict:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


@contextlib.contextmanager
def served(serve_args: list[str]):
    """`python -m experiments serve` with serve_args on a free port, up and answering
    /v1/models; yields {port, model, cmd, log (stderr lines so far), startup_s}; terminates it
    on exit."""
    port = _free_port()
    cmd = [sys.executable, "-m", "experiments", "serve", f"--port={port}", *serve_args]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    log: list[str] = []
    threading.Thread(target=lambda: [log.append(l) for l in proc.stderr], daemon=True).start()
    try:
        t0 = time.perf_counter()
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"the server exited ({proc.returncode}):\n{''.join(log)[-3000:]}")
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
                conn.request("GET", "/v1/models")
                r = conn.getresponse()
                if r.status == 200:
                    model = json.loads(r.read())["data"][0]["id"]
                    break
            except OSError:
                pass
            if time.perf_counter() - t0 > FLAGS.startup_timeout_s:
                raise SystemExit("the server did not come up in time")
            time.sleep(0.5)
        yield {"port": port, "model": model, "cmd": cmd, "log": log,
               "startup_s": time.perf_counter() - t0}
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def main(argv):
    if len(argv) > 1:
        raise SystemExit(f"unexpected arguments: {' '.join(argv[1:])}")
    card_lib.check_clock_flags(FLAGS.clock, FLAGS.clock_calibration)   # before any work
    if FLAGS.trace == "agents":
        _write(agents_main(), md=True)
        return
    levels = [int(c) for c in FLAGS.concurrency]
    if not levels or min(levels) < 1:
        raise SystemExit(f"--concurrency needs positive integers, got {FLAGS.concurrency}")
    if FLAGS.simulate_acceptance and FLAGS.clock == "wall":
        raise SystemExit("--simulate_acceptance needs --clock=h200 here (the in-process engine "
                         "session; the HTTP server runs the model's own acceptance)")
    if FLAGS.clock != "wall":
        _write(clock_main(levels))
        return
    with served(shlex.split(FLAGS.serve_flags)) as srv:
        port, model, cmd, log = srv["port"], srv["model"], srv["cmd"], srv["log"]
        startup = srv["startup_s"]
        print(f"[serve_bench] server up in {startup:.1f}s: {''.join(log).strip()}",
              file=sys.stderr, flush=True)
        top = max(levels)
        t1 = time.perf_counter()
        run_level(port, model, top, 1, FLAGS.max_tokens, 10_000)     # warm: compile, caches
        print(f"[serve_bench] warm round ({top} clients) {time.perf_counter() - t1:.1f}s",
              file=sys.stderr, flush=True)
        rows = []
        for i, c in enumerate(levels):
            m0 = _metrics(port)
            row = run_level(port, model, c, FLAGS.rounds, FLAGS.max_tokens, 100_000 * (i + 1))
            m1 = _metrics(port)
            row["engine_iterations"] = sum(v for k, v in m1.items()
                                           if k.startswith("mtpjax_iteration_seconds_count")) - \
                sum(v for k, v in m0.items() if k.startswith("mtpjax_iteration_seconds_count"))
            rows.append(row)
            print(f"[serve_bench] {c:3d} clients: {row['requests']} requests in "
                  f"{row['wall_s']:.1f}s  {row['requests_per_s']:.2f} req/s  "
                  f"{row['tokens_per_s']:.1f} tok/s  ttft {row['mean_ttft_s']:.2f}s  latency "
                  f"{row['mean_latency_s']:.2f}s", file=sys.stderr, flush=True)
        card = {"command": "python -m experiments serve_bench " + " ".join(
                    a for a in sys.argv[2:]), "clock": "wall", "serve_command": " ".join(cmd[1:]),
                "max_tokens": FLAGS.max_tokens, "rounds": FLAGS.rounds,
                "startup_s": startup, "cpu_count": os.cpu_count(), "levels": rows,
                "server_log": "".join(log).strip().splitlines()[-3:]}
    _write(card)


# ------------------------------------------------------------------------ --trace=agents
AGENT_PATHS = ("http", "wall", "h200")
AGENT_ENGINES = ("candidate", "stock")


def _range(name: str) -> tuple[int, int]:
    v = FLAGS[name].value
    if len(v) != 2:
        raise SystemExit(f"--{name} takes low,high, got {','.join(v)}")
    try:
        return int(v[0]), int(v[1])
    except ValueError:
        raise SystemExit(f"--{name} takes two integers, got {','.join(v)}")


def agent_spec():
    """The AgentSpec of the --agent_* flags (and --max_tokens)."""
    from experiments.agent_trace import AgentSpec
    try:
        return AgentSpec(
            sessions=FLAGS.agent_sessions, turns=FLAGS.agent_turns,
            tool_tokens=_range("agent_tool_tokens"),
            user_message_p=FLAGS.agent_user_message_p,
            foreign_clients=FLAGS.agent_foreign_clients,
            foreign_requests=FLAGS.agent_foreign_requests,
            foreign_tokens=_range("agent_foreign_tokens"), max_tokens=FLAGS.max_tokens,
            seed=FLAGS.agent_seed)
    except ValueError as e:
        raise SystemExit(f"--agent_* flags: {e}")


def _choices(name: str, allowed: tuple[str, ...]) -> list[str]:
    got = [x.strip() for x in FLAGS[name].value if x.strip()]
    bad = [x for x in got if x not in allowed]
    if bad or not got:
        raise SystemExit(f"--{name} takes some of {','.join(allowed)}, got {','.join(got)}")
    return got


def agent_serve_config(trace, tokenizer, template, serve_args: list[str]):
    """(ServerConfig of the serve flags, the serve args to run): --max_seq_len raised to what
    the trace needs (agent_trace.context_needed, a multiple of 256), unless the serve flags
    set it, which must then suffice."""
    from experiments import agent_trace, serve
    FLAGS(["serve", *serve_args])      # serve's flags, defined in this process by the import
    cfg = serve.config_of(FLAGS)
    need = agent_trace.context_needed(trace, tokenizer, template)
    if FLAGS["max_seq_len"].present:
        if cfg.max_seq_len < need:
            raise SystemExit(f"the trace needs a context of {need} tokens; --serve_flags sets "
                             f"--max_seq_len={cfg.max_seq_len}")
        return cfg, serve_args
    need = -(-need // 256) * 256
    return dataclasses.replace(cfg, max_seq_len=need), [*serve_args, f"--max_seq_len={need}"]


def _prefix_metrics(port: int) -> dict:
    """The prefix cache's counters on /metrics, by PrefixCache.report's names."""
    from experiments.agent_trace import PREFIX_COUNTERS
    m = _metrics(port)
    out = {}
    for key in PREFIX_COUNTERS:
        name = f"mtpjax_prefix_cache_{key}"
        out[key] = sum(v for k, v in m.items()
                       if k.split("{")[0] in (name, name + "_total"))
    return out


def run_agents_http(trace, serve_args: list[str]) -> dict:
    """The trace against a real server (wall clock): a warm-up request first (unmeasured),
    the prefix cache's counters from /metrics around the run."""
    from experiments import agent_trace
    with served(serve_args) as srv:
        port, model = srv["port"], srv["model"]
        say = lambda m: print(f"[serve_bench agents] {m}", file=sys.stderr, flush=True)
        say(f"server up in {srv['startup_s']:.1f}s: {' '.join(srv['cmd'][3:])}")
        stream_chat(port, {"model": model, "max_tokens": 2, "stream": True,
                           "stream_options": {"include_usage": True},
                           "messages": [{"role": "user", "content": "warm up"}]})
        before = _prefix_metrics(port)
        run = agent_trace.run_clients(trace, model, lambda body: stream_chat(port, body))
        run["prefix_cache"] = agent_trace.prefix_delta(before, _prefix_metrics(port))
        run["startup_s"] = srv["startup_s"]
    return run


def run_agents_engine(trace, cfg, clock: str) -> dict:
    """The trace in this process on a fresh engine of cfg (serve's load_server: same warm-up;
    fresh, so no cache or learned step cost carries over from another run), on the wall
    clock or the H200 clock (with --simulate_acceptance for a candidate, as clock_main)."""
    from experiments import agent_trace, serve
    from mtpjax.serving.app import load_server
    t0 = time.perf_counter()
    server = load_server(cfg, serve.warmup_with_progress)
    server.online.shutdown()                # its engine only: no HTTP, no online loop
    engine = server.online.engine
    if clock == "h200":
        engine.clock = card_lib.make_clock("h200", engine.k,
                                           weights=card_lib.clock_weights(engine.params),
                                           tp=engine.tp, page_size=engine.page_size)
        if engine.k:
            engine.simulated = card_lib.simulator(FLAGS.simulate_acceptance)
    startup = time.perf_counter() - t0
    run = agent_trace.run_engine(server, engine, trace)
    run["startup_s"] = startup
    if clock == "h200":
        run["host_s"] = engine.clock.host_s
    return run


def agents_main() -> dict:
    """--trace=agents (module docstring): every (path, engine) run of the trace; the card."""
    from experiments import agent_trace
    from mtpjax.serving.chat_template import load_chat_template
    from mtpjax.text import Tokenizer
    if FLAGS["clock"].present or FLAGS["concurrency"].present:
        raise SystemExit("--trace=agents runs its own paths (--agent_paths) with every client "
                         "at once: drop --clock / --concurrency")
    paths = _choices("agent_paths", AGENT_PATHS)
    engines = _choices("agent_engines", AGENT_ENGINES)
    if FLAGS.simulate_acceptance and "h200" not in paths:
        raise SystemExit("--simulate_acceptance applies to the h200 path only")
    serve_args = shlex.split(FLAGS.serve_flags)
    from experiments import serve                         # noqa: F401 - defines serve's flags
    FLAGS(["serve", *serve_args])
    ckpt = FLAGS.checkpoint
    tokenizer = Tokenizer.from_checkpoint(ckpt)
    spec = agent_spec()
    trace = agent_trace.build(tokenizer, spec)
    cfg, serve_args = agent_serve_config(trace, tokenizer, load_chat_template(ckpt), serve_args)
    if cfg.num_speculative_tokens < 1 and "candidate" in engines:
        raise SystemExit("the candidate needs --num_speculative_tokens >= 1 in --serve_flags")
    configs = {"candidate": (cfg, serve_args),
               "stock": (dataclasses.replace(cfg, num_speculative_tokens=0),
                         [*serve_args, "--num_speculative_tokens=0"])}
    say = lambda m: print(f"[serve_bench agents] {m}", file=sys.stderr, flush=True)
    say(f"trace {trace.digest()[:12]}: {spec}; context {cfg.max_seq_len}")
    runs = []
    for path in paths:
        for name in engines:
            c, args = configs[name]
            t0 = time.perf_counter()
            run = (run_agents_http(trace, args) if path == "http"
                   else run_agents_engine(trace, c, path))
            summary = agent_trace.summarize(run)
            runs.append({"path": "http" if path == "http" else "in-process",
                         "clock": "h200" if path == "h200" else "wall", "engine": name,
                         "k": c.num_speculative_tokens, "adaptive": c.adaptive,
                         "startup_s": run["startup_s"], "host_s": run.get("host_s"),
                         "ran_s": time.perf_counter() - t0, "summary": summary,
                         "records": run["records"]})
            later = summary["later_turns"]
            say(f"{path} {name}: {summary['requests']} requests, {summary['failures']} "
                f"failed, {summary['tokens_per_s']:.1f} tok/s, TTFT turns >= 2 mean "
                f"{later['ttft_mean_s']}, foreign {summary['foreign']['ttft_mean_s']}")
    replies = [r["summary"]["replies"] for r in runs]
    simulated = bool(FLAGS.simulate_acceptance)
    return {"command": "python -m experiments serve_bench " + " ".join(sys.argv[2:]),
            "trace": "agents", "spec": dataclasses.asdict(spec),
            "trace_digest": trace.digest(), "serve_flags": " ".join(serve_args),
            "h200_words": card_lib.predicted_words(cfg.tp),
            "cached_tokens_source": "usage.prompt_tokens_details.cached_tokens (HTTP); "
                                    "RequestOutput(.stats).cached_tokens (in-process); "
                                    "null where absent",
            "cpu_count": os.cpu_count(), "python": sys.version.split()[0],
            "replies_identical": (None if simulated or len(replies) < 2 else
                                  all(r == replies[0] for r in replies[1:])),
            "runs": runs}


def _write(card: dict, md: bool = False) -> None:
    """card.json at --out (--trace=agents: default runs/serve_bench_agents/card.json, and
    card.md beside it); the card is the last stdout line."""
    out = FLAGS.out
    if FLAGS.trace == "agents" and not FLAGS["out"].present:
        out = "runs/serve_bench_agents/card.json"
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(card, f, indent=1)
    if md:
        from experiments.agent_trace import render_md
        with open(os.path.join(os.path.dirname(out), "card.md"), "w") as f:
            f.write(render_md(card))
    print(json.dumps(card))
