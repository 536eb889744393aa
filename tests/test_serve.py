"""`python -m experiments serve` as a real server process on the tiny checkpoint, driven by the
official `openai` client: concurrent streaming chats give exactly what `TextEngine` gives for
the same seeds (the checkpoint's chat template renders these chats as the hand-written ChatML
does), stop strings cut exactly, usage reports the prompt tokens the prefix cache served
(streamed and not, chat and completions), a killed client's pages return, bad requests
(unsupported fields included) get 400 with an OpenAI error body without disturbing a running
stream, a chat with tool calls and tool responses in its history is served, and /metrics
parses (as prometheus_client's own parser reads it, with counter and gauge types).

The reference engine in this process has the server's settings (K = 1, fixed depth, 2 lanes,
context 128) and computes while the server starts and compiles, so the two overlap.
"""

import asyncio
import concurrent.futures
import json
import math
import os
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from mtpjax.engine import Engine
from mtpjax.sampling import SamplingParams
from mtpjax.serving.chat_template import load_chat_template
from mtpjax.text import TextEngine, Tokenizer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CKPT = os.path.join(REPO, "checkpoints", "tiny")
# Few compiled programs (2 lane buckets, 1 prefill bucket): compiling dominates this file.
ENGINE = dict(max_lanes=2, max_seq_len=128, prefill_chunk=32, prefill_buckets=[32])
# --generation_config=none: the cases below compare with SamplingParams built on OpenAI's
# defaults (top_p 1, no top_k); the checkpoint's defaults are tested in test_protocol
SERVER_FLAGS = ["--num_speculative_tokens=1", "--noadaptive", "--max_lanes=2",
                "--max_seq_len=128", "--prefill_chunk=32", "--prefill_buckets=32", "--nowarmup",
                "--generation_config=none"]
N_CHATS = 32


def chat_case(i):
    msgs = ([{"role": "system", "content": "You are terse."}] if i % 4 == 0 else [])
    msgs.append({"role": "user", "content": f"Tell me about item {i} in the list."})
    return dict(messages=msgs, thinking=i % 2 == 1,
                params=SamplingParams(temperature=(0.0, 0.7, 1.0)[i % 3],
                                      top_p=(1.0, 0.9)[i % 2], top_k=(0, 20)[i // 16],
                                      seed=1000 + i, max_new_tokens=8 + i % 9))


CHATS = [chat_case(i) for i in range(N_CHATS)]
LONG = dict(messages=[{"role": "user", "content": "Write a long story."}], thinking=False,
            params=SamplingParams(temperature=0.9, seed=77, max_new_tokens=60))
COMPLETION = dict(prompt="def fibonacci(n):", params=SamplingParams(temperature=0.8, seed=5,
                                                                    max_new_tokens=16))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(url, body=None, raw=None):
    """(status, parsed JSON or text) of a GET, or of a POST with a JSON (or raw) body."""
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            status, text = r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        with e:
            status, text = e.code, e.read().decode()
    try:
        return status, json.loads(text)
    except json.JSONDecodeError:
        return status, text


def warm_up(proc, base, errors):
    """Wait until the server answers, then send two requests at once: the server compiles its
    programs (both lane buckets) while this process computes the reference."""
    t0 = time.time()
    while True:
        if proc.poll() is not None:
            errors.append(f"the server exited with {proc.returncode}")
            return
        try:
            if http(base + "/health")[0] == 200:
                break
        except OSError:
            pass
        if time.time() - t0 > 240:
            errors.append("the server did not come up in 240 s")
            return
        time.sleep(0.3)
    body = {"model": "tiny", "messages": [{"role": "user", "content": "warm up"}],
            "max_tokens": 6}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        for status, out in pool.map(lambda _: http(base + "/v1/chat/completions", body), "ab"):
            if status != 200:
                errors.append(f"warm-up request failed: {status} {out}")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port = free_port()
    log = open(tmp_path_factory.mktemp("serve") / "server.log", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "experiments", "serve", f"--port={port}",
                             *SERVER_FLAGS], cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    errors = []
    warm = threading.Thread(target=warm_up, args=(proc, base, errors), daemon=True)
    warm.start()
    try:
        yield proc, base, log, warm, errors
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


@pytest.fixture(scope="module")
def reference():
    """TextEngine outputs (this process) for every request the tests send with a seed."""
    tok = Tokenizer.from_checkpoint(CKPT)
    te = TextEngine(Engine.from_checkpoint(CKPT, "float32", 1, speculation_policy="fixed",
                                           **ENGINE), tok, skip_special_tokens=True)
    cases = CHATS + [LONG]
    chats = [None] * len(cases)
    for thinking in (False, True):
        idx = [i for i, c in enumerate(cases) if c["thinking"] == thinking]
        outs = te.chat([cases[i]["messages"] for i in idx], [cases[i]["params"] for i in idx],
                       enable_thinking=thinking)
        for i, o in zip(idx, outs):
            chats[i] = o
    (completion,) = te.generate(COMPLETION["prompt"], COMPLETION["params"])
    return chats[:N_CHATS], chats[N_CHATS], completion


@pytest.fixture(scope="module")
def live(server, reference):
    """The server, up and warm (after the reference, which ran meanwhile)."""
    proc, base, log, warm, errors = server
    warm.join(300)
    if errors or warm.is_alive():
        log.seek(0)
        pytest.fail(f"{errors or 'warm-up hung'}; server log:\n{log.read()[-4000:]}")
    return base


@pytest.fixture
def client(live):
    with openai.OpenAI(base_url=live + "/v1", api_key="none", max_retries=0) as c:
        yield c


def kwargs_of(case):
    p = case["params"]
    return dict(model="tiny", messages=case["messages"], temperature=p.temperature,
                top_p=p.top_p, seed=p.seed, max_tokens=p.max_new_tokens,
                extra_body={"top_k": p.top_k,
                            "chat_template_kwargs": {"enable_thinking": case["thinking"]}})


def expected_split(text, thinking):
    """vLLM's qwen3 rule, written out: with thinking on, reasoning until </think>."""
    if not thinking:
        return "", text
    if text.startswith("<think>"):
        text = text[len("<think>"):]
    reasoning, sep, content = text.partition("</think>")
    return reasoning, content if sep else ""


async def stream_chat(client, case):
    reasoning, content, finish, usage, n_role = [], [], None, None, 0
    stream = await client.chat.completions.create(
        stream=True, stream_options={"include_usage": True}, **kwargs_of(case))
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            d = ch.delta
            n_role += d.role == "assistant"
            content.append(d.content or "")
            reasoning.append(getattr(d, "reasoning_content", None) or "")
            finish = ch.finish_reason or finish
    return "".join(reasoning), "".join(content), finish, usage, n_role


def test_concurrent_streaming_chats_equal_text_engine(live, reference):
    chats, _, _ = reference
    async def all_chats():
        async with openai.AsyncOpenAI(base_url=live + "/v1", api_key="none",
                                      max_retries=0) as client:
            return await asyncio.gather(*(stream_chat(client, c) for c in CHATS))

    results = asyncio.run(all_chats())
    for i, (case, ref, (reasoning, content, finish, usage, n_role)) in enumerate(
            zip(CHATS, chats, results)):
        assert (reasoning, content) == expected_split(ref.text, case["thinking"]), i
        assert finish == ref.finish_reason, i
        assert n_role == 1
        assert usage.completion_tokens == len(ref.token_ids), i
        assert usage.prompt_tokens == len(ref.prompt_token_ids), i
        assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_non_streaming_chat_and_completion(client, reference):
    chats, _, completion = reference
    for i in (0, 1):
        r = client.chat.completions.create(**kwargs_of(CHATS[i]))
        msg = r.choices[0].message
        want_r, want_c = expected_split(chats[i].text, CHATS[i]["thinking"])
        assert (msg.content or "") == want_c
        assert (getattr(msg, "reasoning_content", None) or "") == want_r
        assert r.usage.completion_tokens == len(chats[i].token_ids)
    p = COMPLETION["params"]
    r = client.completions.create(model="tiny", prompt=COMPLETION["prompt"], seed=p.seed,
                                  temperature=p.temperature, max_tokens=p.max_new_tokens)
    assert r.choices[0].text == completion.text
    assert r.choices[0].finish_reason == completion.finish_reason
    assert [m.id for m in client.models.list().data] == ["tiny"]


def test_usage_reports_cached_prompt_tokens(client):
    """usage.prompt_tokens_details.cached_tokens: 0 for a prompt the cache has not seen, then
    the prompt's last page boundary (16-token pages) for the same prompt again; streamed (the
    usage chunk) and not, chat and completions."""
    def cached(usage):
        return usage.prompt_tokens_details.cached_tokens

    def streamed(create, **kw):
        (usage,) = [c.usage for c in create(stream=True, stream_options={"include_usage": True},
                                            **kw) if c.usage is not None]
        return usage

    msgs = [{"role": "user", "content": "Count the apples in basket number seven and then "
                                        "the pears in basket number eight, please."}]
    chat = dict(model="tiny", messages=msgs, max_tokens=3, seed=2, temperature=0.0,
                extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    first = client.chat.completions.create(**chat).usage
    boundary = (first.prompt_tokens - 1) // 16 * 16
    assert cached(first) == 0 and boundary >= 16
    assert cached(client.chat.completions.create(**chat).usage) == boundary
    assert cached(streamed(client.chat.completions.create, **chat)) == boundary
    text = "The cache keeps this prefix: " + "one two three four five " * 5
    comp = dict(model="tiny", prompt=text, max_tokens=3, seed=2, temperature=0.0)
    first = streamed(client.completions.create, **comp)
    boundary = (first.prompt_tokens - 1) // 16 * 16
    assert cached(first) == 0 and boundary >= 16
    assert cached(client.completions.create(**comp).usage) == boundary
    assert cached(streamed(client.completions.create, **comp)) == boundary


@pytest.mark.parametrize("field,value", [("prefix_snapshots", -1),
                                         ("snapshot_every_blocks", 0)])
def test_prefix_cache_flags_are_checked(field, value):
    from mtpjax.serving.app import ServerConfig, load_server
    with pytest.raises(SystemExit, match=f"--{field} must be"):
        load_server(ServerConfig(checkpoint=CKPT, warmup=False, **{field: value}))


def test_stop_string_cuts_exactly_streaming_and_not(client, reference):
    _, _, completion = reference
    text = completion.text
    assert len(text) >= 8, f"the reference completion is too short for this test: {text!r}"
    stop = text[4:7]
    want = text[:text.find(stop)]
    p = COMPLETION["params"]
    kw = dict(model="tiny", prompt=COMPLETION["prompt"], seed=p.seed, temperature=p.temperature,
              max_tokens=p.max_new_tokens, stop=["@@never@@", stop])
    r = client.completions.create(**kw)
    assert r.choices[0].text == want and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens <= len(completion.token_ids)
    pieces, finish = [], None
    for chunk in client.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            pieces.append(ch.text)
            finish = ch.finish_reason or finish
    assert "".join(pieces) == want and finish == "stop"


def error_of(status, body, want_status, param=None):
    assert status == want_status, body
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    if param is not None:
        assert body["error"]["param"] == param, body
    return body["error"]


def test_bad_requests_get_openai_errors_and_leave_streams_alone(live, client, reference):
    _, long_ref, _ = reference
    stream = client.chat.completions.create(stream=True, **kwargs_of(LONG))
    it = iter(stream)
    pieces = [next(it).choices[0].delta.content or ""]     # the stream is running

    url = live + "/v1/chat/completions"
    msgs = [{"role": "user", "content": "hi"}]
    e = error_of(*http(url, raw=b'{"model": "tiny", "messages": [}'), 400)
    assert "not valid JSON" in e["message"]
    error_of(*http(url, {"model": "gpt-9", "messages": msgs}), 404, "model")
    error_of(*http(url, {"model": "tiny", "messages": msgs, "n": 0}), 400, "n")
    error_of(*http(url, {"model": "tiny", "messages": msgs, "temperature": -1}), 400,
             "temperature")
    error_of(*http(url, {"model": "tiny", "messages": msgs, "top_p": 0}), 400, "top_p")
    error_of(*http(url, {"model": "tiny", "messages": msgs, "max_tokens": 0}), 400, "max_tokens")
    error_of(*http(url, {"model": "tiny", "messages": [{"role": "bot", "content": "x"}]}), 400,
             "messages")
    error_of(*http(url, {"model": "tiny", "messages": msgs, "stop": [""]}), 400, "stop")
    for field, value in [("response_format", {"type": "yaml"}), ("tool_choice", "required"),
                         ("logprobs", 1), ("presence_penalty", 2.5), ("top_logprobs", 2),
                         ("made_up_field", 1)]:
        e = error_of(*http(url, {"model": "tiny", "messages": msgs, field: value}), 400, field)
        assert field in e["message"]
    e = error_of(*http(url, {"model": "tiny", "messages": msgs, "temperature": "0.5"}), 400,
                 "temperature")
    assert "must be a number" in e["message"]
    error_of(*http(url, {"model": "tiny", "messages": [
        {"role": "user", "content": "x"}, {"role": "system", "content": "late"}]}), 400,
        "messages")
    error_of(*http(url, {"model": "tiny", "messages": msgs,
                         "chat_template_kwargs": {"messages": []}}), 400, "chat_template_kwargs")
    e = error_of(*http(url, {"model": "tiny", "messages": [
        {"role": "user", "content": "word " * 200}]}), 400)
    assert e["code"] == "context_length_exceeded"
    curl = live + "/v1/completions"
    error_of(*http(curl, {"model": "tiny", "prompt": [1, 2, 99999]}), 400, "prompt")
    error_of(*http(curl, {"model": "tiny", "prompt": ""}), 400, "prompt")
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt="x", max_tokens=10_000)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=msgs)

    finish = None
    for chunk in it:
        for ch in chunk.choices:
            pieces.append(ch.delta.content or "")
            finish = ch.finish_reason or finish
    assert "".join(pieces) == long_ref.text
    assert finish == long_ref.finish_reason


TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}


def test_chat_with_tool_calls_in_its_history(client):
    """Assistant tool_calls (arguments as a JSON string, as OpenAI sends them) and tool
    responses render through the checkpoint's template; usage counts the rendered prompt."""
    msgs = [{"role": "user", "content": "Weather?"},           # short: the context is 128
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "a", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
            {"role": "tool", "tool_call_id": "a", "content": "snow"}]
    r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=4, seed=1,
                                       temperature=0.0)
    assert r.choices[0].finish_reason in ("stop", "length")
    parsed = [dict(m, tool_calls=[dict(c, function=dict(c["function"], arguments=json.loads(
        c["function"]["arguments"]))) for c in m["tool_calls"]]) if "tool_calls" in m else m
        for m in msgs]
    prompt = load_chat_template(CKPT).render(parsed, True)
    assert "<function=get_weather>\n<parameter=city>\nOslo\n</parameter>" in prompt
    assert r.usage.prompt_tokens == len(Tokenizer.from_checkpoint(CKPT).encode(prompt))


def test_tools_reach_the_template(live, client):
    """With tools, tool_choice "auto" renders them (the tools' system turn does not fit this
    server's 128-token context: a 400 that proves it was rendered); "none" leaves them out and
    answers normally; a named function that is not among the tools is refused by name. Forced
    calls ("required", named) and parsing calls out of the output are
    tests/test_serve_tools.py's (the tiny model's text is random)."""
    url = live + "/v1/chat/completions"
    msgs = [{"role": "user", "content": "Weather?"}]
    e = error_of(*http(url, {"model": "tiny", "messages": msgs, "tools": [TOOL]}), 400,
                 "messages")
    assert e["code"] == "context_length_exceeded"
    r = client.chat.completions.create(model="tiny", messages=msgs, tools=[TOOL],
                                       tool_choice="none", max_tokens=4, seed=1)
    assert r.choices[0].finish_reason in ("stop", "length") and not r.choices[0].message.tool_calls
    plain = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=4, seed=1)
    assert r.usage.prompt_tokens == plain.usage.prompt_tokens
    e = error_of(*http(url, {"model": "tiny", "messages": msgs, "tools": [TOOL],
                             "tool_choice": {"type": "function", "function": {"name": "nope"}}}),
                 400, "tool_choice")
    assert "not one of 'tools'" in e["message"]


METRIC_LINE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{([^}]*)\})? (\S+)$')
LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_prometheus(text):
    """{(name, frozenset(labels)): value} and {family: type}; raises on a malformed line or a
    sample whose family has no TYPE line."""
    types, samples = {}, {}
    for line in text.splitlines():
        if not line.strip():
            continue
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            assert kind in ("counter", "gauge", "histogram", "summary", "untyped"), line
            types[name] = kind
            continue
        if line.startswith("#"):
            assert line.startswith("# HELP "), line
            continue
        m = METRIC_LINE.match(line)
        assert m, f"malformed sample line: {line!r}"
        name, labels, value = m.group(1), m.group(3) or "", float(m.group(4))
        family = re.sub(r"_(bucket|sum|count)$", "", name) if name not in types else name
        assert family in types, f"no TYPE for {name}"
        lab = frozenset(LABEL.findall(labels))
        assert (name, lab) not in samples, f"duplicate sample {line!r}"
        samples[(name, lab)] = value
    return samples, types


def metric(samples, name, **labels):
    hits = [v for (n, lab), v in samples.items() if n == name and
            set(labels.items()) <= set(lab)]
    assert len(hits) == 1, (name, labels, hits)
    return hits[0]


def value_or_zero(samples, name, **labels):
    hits = [v for (n, lab), v in samples.items() if n == name and
            set(labels.items()) <= set(lab)]
    return hits[0] if hits else 0.0


def scrape(base):
    status, text = http(base + "/metrics")
    assert status == 200
    return parse_prometheus(text)


KILLED_CLIENT = """
import sys, openai
c = openai.OpenAI(base_url=sys.argv[1] + "/v1", api_key="none", max_retries=0)
for chunk in c.chat.completions.create(model="tiny", stream=True, max_tokens=90, seed=3,
        temperature=1.0, messages=[{"role": "user", "content": "never stop talking"}],
        extra_body={"chat_template_kwargs": {"enable_thinking": False}}):
    if chunk.choices and chunk.choices[0].delta.content:
        print("streaming", flush=True)
"""


def test_killed_client_frees_its_pages(live):
    total = metric(scrape(live)[0], "mtpjax_kv_total_pages")
    cancelled0 = value_or_zero(scrape(live)[0], "mtpjax_requests_finished_total",
                               finish_reason="cancelled")
    with subprocess.Popen([sys.executable, "-c", KILLED_CLIENT, live], stdout=subprocess.PIPE,
                          text=True) as proc:
        assert proc.stdout.readline().strip() == "streaming"
        t0 = time.time()
        while metric(scrape(live)[0], "mtpjax_kv_free_pages") >= total:
            assert time.time() - t0 < 30, "the streaming request holds no pages"
            time.sleep(0.05)
        proc.kill()                                    # no goodbye: the socket just closes
        proc.wait(10)
    t0 = time.time()
    while True:
        s = scrape(live)[0]
        if (metric(s, "mtpjax_kv_free_pages") == total and
                metric(s, "mtpjax_requests_running") == 0):
            break
        assert time.time() - t0 < 30, "the killed client's pages did not return"
        time.sleep(0.1)
    assert metric(s, "mtpjax_requests_finished_total", finish_reason="cancelled") == \
        cancelled0 + 1


def test_metrics_parse_and_count(live, reference):
    samples, types = scrape(live)
    status, text = http(live + "/metrics")
    official = {f.name: f.type for f in text_string_to_metric_families(text)}
    for name, kind in [("mtpjax_requests_running", "gauge"), ("mtpjax_requests_waiting", "gauge"),
                       ("mtpjax_requests_finished", "counter"),
                       ("mtpjax_prompt_tokens", "counter"),
                       ("mtpjax_generation_tokens", "counter"),
                       ("mtpjax_tokens_per_verify_step", "gauge"),
                       ("mtpjax_draft_accepted", "counter"),
                       ("mtpjax_iteration_seconds", "histogram"),
                       ("mtpjax_kv_free_pages", "gauge"), ("mtpjax_preemptions", "counter"),
                       ("mtpjax_decode_steps", "counter"),
                       ("mtpjax_prefix_cache_lookups", "counter"),
                       ("mtpjax_prefix_cache_hits", "counter"),
                       ("mtpjax_prefix_cache_evicted", "counter"),
                       ("mtpjax_prefix_cache_tokens_reused", "counter"),
                       ("mtpjax_prefix_cache_snapshots", "gauge")]:
        assert official.get(name) == kind, name
        text_name = name + "_total" if kind == "counter" else name       # 0.0.4 TYPE lines
        assert types.get(text_name) == kind, name
    assert metric(samples, "mtpjax_prefix_cache_lookups_total") >= N_CHATS
    assert metric(samples, "mtpjax_requests_finished_total", finish_reason="length") >= sum(
        o.finish_reason == "length" for o in reference[0])
    assert metric(samples, "mtpjax_generation_tokens_total") >= sum(
        c["params"].max_new_tokens for c in CHATS) // 2
    tried = metric(samples, "mtpjax_draft_tried_total", position="1")
    accepted = metric(samples, "mtpjax_draft_accepted_total", position="1")
    assert 0 < tried and 0 <= accepted <= tried
    assert math.isclose(metric(samples, "mtpjax_draft_acceptance_rate", position="1"),
                        accepted / tried, rel_tol=1e-6)
    assert 1.0 <= metric(samples, "mtpjax_tokens_per_verify_step") <= 2.0     # K = 1
    buckets = sorted(((float(dict(lab)["le"]), v) for (n, lab), v in samples.items()
                      if n == "mtpjax_iteration_seconds_bucket"))
    counts = [v for _, v in buckets]
    assert counts == sorted(counts) and buckets[-1][0] == math.inf
    assert counts[-1] == metric(samples, "mtpjax_iteration_seconds_count") > 0
