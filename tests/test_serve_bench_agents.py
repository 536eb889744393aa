"""`serve_bench --trace=agents` (experiments/agent_trace.py): the trace is a function of its seed
and respects its sizes; the spec refuses bad sizes by name; the in-process run on the tiny
reports every key with sane values on the wall and the H200 clock, with the same replies on
both; and the command end to end runs one small session beside a foreign prompt against a real
server (`python -m experiments serve`) and in process, with the same replies on both paths.
Cached tokens are read from usage.prompt_tokens_details (HTTP) or the engine output where
reported, and are None (n/a) where not.
"""

import json
import os
import subprocess
import sys

import pytest

from experiments import agent_trace
from experiments.agent_trace import AgentSpec
from mtpjax.serving.chat_template import load_chat_template
from mtpjax.text import Tokenizer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CKPT = os.path.join(REPO, "checkpoints", "tiny")
# Few compiled programs: two lanes' buckets, one prefill bucket, no warm-up (compiled on use).
SMALL = AgentSpec(sessions=2, turns=2, tool_tokens=(40, 90), foreign_clients=1,
                  foreign_requests=1, foreign_tokens=(60, 100), max_tokens=8, seed=3)


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_checkpoint(CKPT)


def test_trace_is_a_function_of_its_seed(tok):
    spec = AgentSpec(sessions=3, turns=3, foreign_clients=2, foreign_requests=2, seed=7)
    a, b = agent_trace.build(tok, spec), agent_trace.build(tok, spec)
    assert a == b and a.digest() == b.digest()
    other = agent_trace.build(tok, AgentSpec(sessions=3, turns=3, foreign_clients=2,
                                             foreign_requests=2, seed=8))
    assert other.digest() != a.digest()
    assert [t.tool_result for s in other.sessions for t in s.turns] != \
        [t.tool_result for s in a.sessions for t in s.turns]


@pytest.mark.parametrize("seed", [0, 1])
def test_trace_respects_its_sizes(tok, seed):
    """Shape and sizes: turn 1 is the task, later turns carry a tool result whose tokens are
    the drawn size (within 2 tokens: the decode / re-encode seam) inside the range; every turn but
    the last calls a tool; foreign prompts likewise."""
    spec = AgentSpec(sessions=4, turns=4, tool_tokens=(300, 3000), foreign_clients=2,
                     foreign_requests=3, foreign_tokens=(1000, 3000), seed=seed)
    tr = agent_trace.build(tok, spec)
    assert len(tr.sessions) == 4 and all(len(s.turns) == 4 for s in tr.sessions)
    assert len(tr.foreign) == 2 and all(len(f) == 3 for f in tr.foreign)
    sizes = []
    for s in tr.sessions:
        first, *later = s.turns
        assert first.tool_result is None and first.tool_tokens == 0 and first.user
        assert [t.tool_choice for t in s.turns] == ["required"] * 3 + ["auto"]
        for t in later:
            assert 300 <= t.tool_tokens <= 3000
            got = len(tok.encode(t.tool_result))
            assert abs(got - t.tool_tokens) <= 2, (got, t.tool_tokens)
            assert t.tool_result == t.tool_result.strip()
            sizes.append(t.tool_tokens)
    assert len(set(sizes)) > len(sizes) // 2          # drawn, not one size
    for shots in tr.foreign:
        for o in shots:
            assert 1000 <= o.tokens <= 3000
            assert abs(len(tok.encode(o.prompt)) - o.tokens) <= 2
            assert o.prompt.startswith(agent_trace.FOREIGN)
    seeds = [t.seed for s in tr.sessions for t in s.turns] + \
        [o.seed for f in tr.foreign for o in f]
    assert len(set(seeds)) == len(seeds)


def test_user_messages_follow_their_probability(tok):
    never = agent_trace.build(tok, AgentSpec(sessions=3, turns=3, user_message_p=0.0))
    always = agent_trace.build(tok, AgentSpec(sessions=3, turns=3, user_message_p=1.0))
    assert all(t.user is None for s in never.sessions for t in s.turns[1:])
    assert all(t.user for s in always.sessions for t in s.turns[1:])


@pytest.mark.parametrize("kw,word", [(dict(sessions=0), "sessions"),
                                     (dict(turns=0), "turns"),
                                     (dict(tool_tokens=(0, 10)), "tool_tokens"),
                                     (dict(tool_tokens=(50, 10)), "tool_tokens"),
                                     (dict(foreign_tokens=(5, 1)), "foreign_tokens"),
                                     (dict(foreign_clients=-1), "foreign_clients"),
                                     (dict(user_message_p=1.5), "user_message_p"),
                                     (dict(max_tokens=0), "max_tokens")])
def test_spec_rejects_bad_sizes_by_name(kw, word):
    with pytest.raises(ValueError, match=word):
        AgentSpec(**kw)


def test_session_client_builds_the_next_turn(tok):
    """Turn t+1 = the messages so far + the reply (its call, id made deterministic) + the
    tool result (+ the user message); the last turn asks for no call."""
    tr = agent_trace.build(tok, AgentSpec(sessions=1, turns=3, user_message_p=1.0, seed=2))
    c = agent_trace.SessionClient(0, tr, "tiny")
    b1 = c.body()
    assert b1["tool_choice"] == "required" and b1["parallel_tool_calls"] is False
    assert [m["role"] for m in b1["messages"]] == ["system", "user"]
    assert b1["logprobs"] is True and b1["seed"] == tr.sessions[0].turns[0].seed
    c.advance({"role": "assistant", "content": "",
               "tool_calls": [{"id": "call_random", "type": "function",
                               "function": {"name": "read_file",
                                            "arguments": "{\"path\": \"a.py\"}"}}]})
    b2 = c.body()
    assert [m["role"] for m in b2["messages"]] == ["system", "user", "assistant", "tool", "user"]
    assert b2["messages"][:2] == b1["messages"]
    assert b2["messages"][2]["tool_calls"][0]["id"] == "call_0_0_0"
    assert b2["messages"][3] == {"role": "tool", "content": tr.sessions[0].turns[1].tool_result,
                                 "tool_call_id": "call_0_0_0"}
    c.advance({"role": "assistant", "content": "done"})      # no call: the tool result stays
    b3 = c.body()
    assert b3["tool_choice"] == "auto" and b3["messages"][-2]["role"] == "tool"
    assert "tool_call_id" not in b3["messages"][-2]
    c.advance({"role": "assistant", "content": "answer"})
    assert c.body() is None


def test_summary_keys_and_reuse():
    """summarize over hand-made records: per-turn mean / p90, the reuse of the previous
    prompt, cached tokens None (n/a) when any record lacks them, failures counted."""
    recs = [dict(kind="session", client=c, turn=t, prompt_tokens=p, cached_tokens=k,
                 completion_tokens=4, ttft_s=s, latency_s=1.0, finish_reason="stop",
                 reply="x", error=None, tool_tokens=0 if t == 1 else 100,
                 user_message=False)
            for c, t, p, k, s in [(0, 1, 100, 0, 0.1), (0, 2, 300, 96, 0.2),
                                  (1, 1, 100, 64, 0.3), (1, 2, 300, 50, 0.4)]]
    recs.append(dict(kind="foreign", client=0, turn=1, error="HTTP 500", tool_tokens=0,
                     user_message=False))
    s = agent_trace.summarize({"records": recs, "wall_s": 2.0, "prefix_cache": None})
    t1, t2 = s["turns"]
    assert t1["ttft_mean_s"] == pytest.approx(0.2) and t2["ttft_mean_s"] == pytest.approx(0.3)
    assert t2["ttft_p90_s"] == pytest.approx(0.38)
    assert t2["cached_tokens_mean"] == 73 and t1["reuse_of_previous_prompt"] is None
    assert t2["reuse_of_previous_prompt"] == pytest.approx((0.96 + 0.5) / 2)
    assert s["failures"] == 1 and s["foreign"]["failures"] == 1
    assert s["tokens_per_s"] == pytest.approx(16 / 2.0)
    recs[1] = {**recs[1], "cached_tokens": None}
    s = agent_trace.summarize({"records": recs, "wall_s": 2.0, "prefix_cache": None})
    assert s["turns"][1]["cached_tokens_mean"] is None
    assert s["later_turns"]["cached_tokens_mean"] is None


def _server_config(tok, trace, k):
    from mtpjax.serving.app import ServerConfig
    need = agent_trace.context_needed(trace, tok, load_chat_template(CKPT))
    return ServerConfig(checkpoint=CKPT, num_speculative_tokens=k, adaptive=False,
                        max_lanes=2, max_seq_len=-(-need // 256) * 256, prefill_chunk=32,
                        prefill_buckets=(32,), warmup=False)


@pytest.fixture(scope="module")
def engine_runs(tok):
    """The small trace in process on the wall clock and on the H200 clock (K = 1)."""
    from experiments import card as card_lib
    from mtpjax.serving.app import load_server
    trace = agent_trace.build(tok, SMALL)
    out = {}
    for clock in ("wall", "h200"):
        server = load_server(_server_config(tok, trace, 1))
        server.online.shutdown()
        e = server.online.engine
        e.clock = card_lib.make_clock(clock, e.k, page_size=e.page_size)
        out[clock] = (trace, agent_trace.run_engine(server, e, trace), e)
    return out


@pytest.mark.parametrize("clock", ["wall", "h200"])
def test_in_process_run_reports_sane_values(engine_runs, tok, clock):
    trace, run, e = engine_runs[clock]
    s = agent_trace.summarize(run)
    assert s["failures"] == 0, s["errors"]
    assert s["requests"] == 2 * 2 + 1
    assert [t["turn"] for t in s["turns"]] == [1, 2]
    for row in s["turns"] + [s["later_turns"], s["foreign"]]:
        assert set(row) >= {"requests", "failures", "ttft_mean_s", "ttft_p90_s",
                            "prompt_tokens_mean", "cached_tokens_mean"}
        assert 0 < row["ttft_mean_s"] < run["wall_s"] and 0 < row["ttft_p90_s"] < run["wall_s"]
    for r in run["records"]:
        assert 0 < r["ttft_s"] <= r["latency_s"] and 1 <= r["completion_tokens"] <= 8
        assert r["cached_tokens"] is None or 0 <= r["cached_tokens"] < r["prompt_tokens"]
    by = {(r["kind"], r["client"], r["turn"]): r for r in run["records"]}
    for c, sess in enumerate(trace.sessions):      # turn 2 = turn 1 + reply + tool result
        assert by["session", c, 2]["prompt_tokens"] > \
            by["session", c, 1]["prompt_tokens"] + sess.turns[1].tool_tokens
    assert by["session", 0, 1]["finish_reason"] in ("tool_calls", "length")
    assert s["tokens_per_s"] > 0 and s["completion_tokens"] == sum(
        r["completion_tokens"] for r in run["records"])
    pc = s["prefix_cache"]
    assert pc["lookups"] == 5 and pc["hits"] >= 1 and pc["tokens_reused"] > 0
    assert (e.clock is not None) == (clock == "h200")
    if clock == "h200":     # on the clock: the run's time is the clock's
        assert run["wall_s"] == pytest.approx(e.clock.now)


def test_replies_equal_on_both_clocks(engine_runs):
    (_, wall, _), (_, h200, _) = engine_runs["wall"], engine_runs["h200"]
    assert agent_trace.summarize(wall)["replies"] == agent_trace.summarize(h200)["replies"]


def test_serve_bench_agents_end_to_end(tmp_path):
    """The command: one session of two turns beside a foreign prompt, stock engine, over HTTP
    against a real server and in process; both runs reported, the same replies, card.md's
    table written."""
    out = tmp_path / "card.json"
    flags = ["--trace=agents", "--agent_paths=http,wall", "--agent_engines=stock",
             "--agent_sessions=1", "--agent_turns=2", "--agent_tool_tokens=30,60",
             "--agent_foreign_clients=1", "--agent_foreign_requests=1",
             "--agent_foreign_tokens=40,60", "--max_tokens=6", f"--out={out}",
             "--serve_flags=--max_lanes=2 --prefill_chunk=32 --prefill_buckets=32 --nowarmup"]
    p = subprocess.run([sys.executable, "-m", "experiments", "serve_bench", *flags], cwd=REPO,
                       capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-4000:]
    card = json.loads(out.read_text())
    assert json.loads(p.stdout.strip().splitlines()[-1]) == card
    assert [(r["path"], r["clock"], r["engine"], r["k"]) for r in card["runs"]] == \
        [("http", "wall", "stock", 0), ("in-process", "wall", "stock", 0)]
    for r in card["runs"]:
        s = r["summary"]
        assert s["failures"] == 0 and s["requests"] == 3, s["errors"]
        assert [t["turn"] for t in s["turns"]] == [1, 2]
        assert s["turns"][1]["ttft_mean_s"] > 0 and s["foreign"]["ttft_mean_s"] > 0
        assert s["prefix_cache"]["lookups"] == 3
    assert card["replies_identical"] is True
    assert "--max_seq_len=" in card["serve_flags"]
    md = (tmp_path / "card.md").read_text()
    assert "| http | wall | stock (K=0) | 2 |" in md and "| in-process | wall |" in md


def test_cached_tokens_are_read_where_reported(tok):
    """run_clients reads usage.prompt_tokens_details.cached_tokens (None where the server
    leaves it out), a failed request ends its session, and cached_tokens_of reads an engine
    output's own count or its stats' (None without either)."""
    import types
    tr = agent_trace.build(tok, AgentSpec(sessions=2, turns=2, foreign_clients=1,
                                          foreign_requests=1, user_message_p=0.0, seed=5))
    seen = []

    def send(body):
        seen.append(body)
        if body["seed"] == tr.sessions[1].turns[0].seed:
            raise RuntimeError("HTTP 503")
        n = 100 * len(body["messages"])      # turn 1: 2 messages, turn 2: 4
        usage = {"prompt_tokens": n, "completion_tokens": 3}
        if "tools" in body:          # sessions report it, the foreign client does not
            usage["prompt_tokens_details"] = {"cached_tokens": n // 2}
        return {"ttft_s": 0.1, "latency_s": 0.2, "usage": usage, "finish_reason": "stop",
                "message": {"role": "assistant", "content": "ok"}}

    run = agent_trace.run_clients(tr, "tiny", send)
    by = {(r["kind"], r["client"], r["turn"]): r for r in run["records"]}
    assert set(by) == {("session", 0, 1), ("session", 0, 2), ("session", 1, 1),
                       ("foreign", 0, 1)}
    assert by["session", 0, 1]["cached_tokens"] == 100
    assert by["session", 0, 2]["cached_tokens"] == 200
    assert by["foreign", 0, 1]["cached_tokens"] is None
    assert by["session", 1, 1]["error"] == "RuntimeError: HTTP 503"
    s = agent_trace.summarize(run)
    assert s["failures"] == 1 and s["turns"][1]["reuse_of_previous_prompt"] == 200 / 200
    out = types.SimpleNamespace(stats=types.SimpleNamespace(cached_tokens=64))
    assert agent_trace.cached_tokens_of(out) == 64
    assert agent_trace.cached_tokens_of(types.SimpleNamespace(cached_tokens=32, stats=None)) == 32
    assert agent_trace.cached_tokens_of(types.SimpleNamespace(stats=object())) is None
