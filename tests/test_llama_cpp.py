"""experiments/llama_cpp.py without llama.cpp: reading its tools' output, finding its tools, and
the clear error when it is not built. (CI has no llama.cpp and never builds it; the comparison
itself runs by hand, RESULTS.md 2026-12-07 session 4.)"""

import json
import os
import subprocess
import sys

import pytest

from experiments import llama_cpp as lc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# llama-bench -m tiny-f32.gguf -t 2 -p 0 -n 128 -r 3 -o json (this machine, trimmed)
LLAMA_BENCH_JSON = """[
  {
    "build_commit": "0c1e570",
    "build_number": 1,
    "cpu_info": "Intel(R) Xeon(R) Processor",
    "backends": "CPU",
    "model_type": "qwen35 ?B all F32",
    "n_threads": 2,
    "type_k": "f32",
    "n_prompt": 0,
    "n_gen": 128,
    "n_depth": 32,
    "avg_ns": 3211190273,
    "stddev_ns": 1362887005,
    "avg_ts": 44.191977,
    "stddev_ts": 15.383841,
    "samples_ns": [ 2572468284, 2284964399, 4776138138 ],
    "samples_ts": [ 49.7577, 56.0184, 26.7999 ]
  }
]
"""

# llama-batched-bench --output-format jsonl: stdout lines among stderr log lines
BATCHED_JSONL = """0.00.046.592 W model has unused tensor blk.8.nextn.eh_proj.weight -- ignoring
{"n_kv_max": 2048, "n_batch": 2048, "n_ubatch": 512, "flash_attn": -1, "is_pp_shared": 0, \
"n_gpu_layers": -1, "n_threads": 2, "n_threads_batch": 2, "pp": 32, "tg": 16, "pl": 1, \
"n_kv": 48, "t_pp": 0.078918, "speed_pp": 405.484161, "t_tg": 0.245957, "speed_tg": 65.052017, \
"t": 0.324875, "speed": 147.74913}
{"n_kv_max": 2048, "n_batch": 2048, "n_ubatch": 512, "flash_attn": -1, "is_pp_shared": 0, \
"n_gpu_layers": -1, "n_threads": 2, "n_threads_batch": 2, "pp": 32, "tg": 16, "pl": 8, \
"n_kv": 384, "t_pp": 0.486252, "speed_pp": 526.475952, "t_tg": 1.131677, "speed_tg": 113.106476, \
"t": 1.617929, "speed": 237.340454}
"""

# the same tool's default (markdown) table
BATCHED_MD = """
main: n_kv_max = 2048, n_batch = 2048, n_ubatch = 512, flash_attn = -1, is_pp_shared = 0
|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |
|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|
|    32 |     16 |    1 |     48 |    0.047 |   686.58 |    0.212 |    75.52 |    0.258 |   185.71 |
|    32 |     16 |    8 |    384 |    0.440 |   581.45 |    0.599 |   213.64 |    1.039 |   369.44 |

llama_perf_context_print:        load time =      40.39 ms
"""


def test_llama_bench_json():
    recs = lc.parse_llama_bench(LLAMA_BENCH_JSON)
    d = lc.llama_bench_decode(recs, 128)
    assert d["tokens_per_s"] == pytest.approx(44.191977)
    assert d["samples_tokens_per_s"] == [49.7577, 56.0184, 26.7999]
    assert d["build_commit"] == "0c1e570" and d["n_depth"] == 32 and d["n_threads"] == 2
    with pytest.raises(ValueError, match="n_gen 64"):
        lc.llama_bench_decode(recs, 64)


def test_llama_bench_jsonl_and_garbage():
    line = json.dumps(json.loads(LLAMA_BENCH_JSON)[0])
    assert lc.parse_llama_bench("log line\n" + line + "\n")[0]["avg_ts"] == pytest.approx(44.19,
                                                                                         abs=0.01)
    with pytest.raises(ValueError, match="no llama-bench record"):
        lc.parse_llama_bench("error: failed to load model\n")


@pytest.mark.parametrize("text", [BATCHED_JSONL, BATCHED_MD])
def test_batched_bench(text):
    rows = lc.parse_batched_bench(text)
    assert [r["pl"] for r in rows] == [1, 8]
    d = lc.batched_decode(rows, 8, 16)
    assert d["tokens_per_s"] == pytest.approx(113.106476 if text is BATCHED_JSONL else 213.64)
    assert d["pp"] == 32
    with pytest.raises(ValueError, match="B=4"):
        lc.batched_decode(rows, 4, 16)


def test_batched_bench_missing_row_reruns(monkeypatch):
    """The tool's logger can lose its last lines at exit: a run without the row is rerun."""
    outs = iter([BATCHED_JSONL.splitlines()[0] + "\n" + BATCHED_JSONL.splitlines()[1],
                 BATCHED_JSONL])
    monkeypatch.setattr(lc, "_run", lambda cmd, timeout: next(outs))
    d = lc.run_batched_bench(["x"], 8, 16)
    assert d["attempts"] == 2 and d["tokens_per_s"] == pytest.approx(113.106476)
    monkeypatch.setattr(lc, "_run", lambda cmd, timeout: "nothing\n")
    with pytest.raises(ValueError, match="no llama-batched-bench row"):
        lc.run_batched_bench(["x"], 8, 16, tries=2)


def test_commands_name_the_settings():
    b = lc.llama_bench_cmd("/x/llama-bench", "m.gguf", 2, 128, 32, 3)
    assert b[:3] == ["/x/llama-bench", "-m", "m.gguf"]
    assert " ".join(b[3:]) == "-t 2 -p 0 -n 128 -d 32 -r 3 -o json"
    bb = " ".join(lc.batched_bench_cmd("bb", "m.gguf", 2, 128, 32, 8))
    assert "-npp 32 -ntg 128 -npl 8,1 -ctk f32 -ctv f32 --output-format jsonl" in bb


def test_completion_reply():
    reply = {"content": "x", "tokens": [5, 7, 9], "stop_type": "limit",
             "completion_probabilities": [
                 {"id": 5, "logprob": -0.1, "top_logprobs": [{"id": 5, "logprob": -0.1},
                                                             {"id": 3, "logprob": -2.5}]}]}
    r = lc.parse_completion(reply)
    assert r["tokens"] == [5, 7, 9] and r["stop_type"] == "limit"
    assert r["top"] == [[(5, -0.1), (3, -2.5)]]
    with pytest.raises(ValueError, match="return_tokens"):
        lc.parse_completion({"content": "x"})


def test_compare_tokens():
    assert lc.compare_tokens([1, 2, 3], [1, 2, 3]) == {
        "matched": 3, "ours_len": 3, "llama_len": 3, "first_divergence": None, "same": True}
    c = lc.compare_tokens([1, 2, 3, 4], [1, 2, 5, 4])
    assert c["matched"] == 2 and c["first_divergence"] == 2 and not c["same"]
    c = lc.compare_tokens([1, 2], [1, 2, 3])      # one stopped earlier
    assert c["matched"] == 2 and c["first_divergence"] == 2 and not c["same"]


def test_logprob_agreement():
    ours = [[(5, -0.1), (3, -2.5)], [(7, -1.0), (8, -1.05)], [(9, -0.2), (1, -3.0)]]
    llama = [[(5, -0.1001), (3, -2.5)], [(7, -1.002), (8, -1.0)], [(4, -0.1), (9, -0.3)]]
    a = lc.logprob_agreement(ours, llama, matched=2)     # the third position diverged
    assert a["positions"] == 2
    assert a["min_margin_ours"] == pytest.approx(0.05)
    assert a["min_margin_llama"] == pytest.approx(-0.002)
    assert a["max_chosen_logprob_diff"] == pytest.approx(0.002)
    assert lc.logprob_agreement([], [], 0)["min_margin_ours"] is None


def test_decode_rate_leaves_the_prefills_out():
    # two requests: first tokens at t=1.0 and t=2.0 (prefills), then 1 token each per 0.5 s
    ev = [(1.0, 0, 1), (2.0, 1, 1), (2.5, 0, 1), (2.5, 1, 1), (3.0, 0, 1), (3.0, 1, 1)]
    r = lc.decode_rate(ev, 2)
    assert r["decode_tokens"] == 4 and r["decode_s"] == pytest.approx(1.0)
    assert r["tokens_per_s"] == pytest.approx(4.0)
    with pytest.raises(ValueError, match="1 request"):
        lc.decode_rate(ev[:1], 2)


def test_summarize_and_table():
    cells = {8: {"ours": [100.0, 120.0, 110.0], "llama": {2: [200.0, 240.0, 220.0]},
                 "load": [3.0, 4.5, 4.0], "others_cpu": [0.5, 0.25, None]},
             1: {"ours": [50.0], "llama": {1: [75.0], 2: [100.0]},
                 "llama_bench": {2: [150.0]},
                 "tokens": {"matched": 128, "compared": 128, "same": True}}}
    rows = lc.summarize(cells)
    assert [(r["batch"], r["threads"]) for r in rows] == [(1, 1), (1, 2), (8, 2)]
    assert rows[2]["ours_tokens_per_s"] == 110.0 and rows[2]["llama_over_ours"] == 2.0
    assert rows[1]["llama_bench_over_ours"] == 3.0 and rows[0]["llama_bench_tokens_per_s"] is None
    table = lc.format_table(rows)
    assert "| 1 | 1 | 50.0 | 75.0 | 1.50 | n/a | n/a | 128/128 (all) | n/a | n/a |" in table
    assert "| 1 | 2 | 50.0 | 100.0 | 2.00 | 150.0 | 3.00 | 128/128 (all) | n/a | n/a |" in table
    assert "| 8 | 2 | 110.0 | 220.0 | 2.00 | n/a | n/a | n/a | 3.0-4.5 | 25-50% |" in table


def test_proc_stat_busy():
    text = ("cpu  100 20 30 1000 50 5 6 7 0 0\n"
            "cpu0 50 10 15 500 25 2 3 3 0 0\n")
    # user + nice + system + irq + softirq + steal = 100 + 20 + 30 + 5 + 6 + 7 ticks
    assert lc.proc_stat_busy(text) == pytest.approx(1.68)
    with pytest.raises(ValueError):
        lc.proc_stat_busy("intr 1 2 3\n")
    share = lc.OthersCpu().share()
    assert share is None or 0.0 <= share


def _exe(path):
    with open(path, "w") as f:
        f.write("#!/bin/sh\n")
    os.chmod(path, 0o755)


def test_find_tools(tmp_path):
    with pytest.raises(lc.LlamaCppMissing, match="--llama_cpp_dir is unset"):
        lc.find_tools(None)
    with pytest.raises(lc.LlamaCppMissing, match="no such folder"):
        lc.find_tools(str(tmp_path / "nope"))
    bin_ = tmp_path / "build" / "bin"
    bin_.mkdir(parents=True)
    _exe(bin_ / "llama-bench")
    with pytest.raises(lc.LlamaCppMissing) as e:
        lc.find_tools(str(tmp_path))
    msg = str(e.value)
    assert "llama-batched-bench, llama-server" in msg and "llama-bench," not in msg
    assert "cmake" in msg                               # says how to build it
    _exe(bin_ / "llama-batched-bench")
    _exe(tmp_path / "llama-server")                   # the folder itself counts too
    found = lc.find_tools(str(tmp_path))
    assert found["llama-bench"] == str(bin_ / "llama-bench")
    assert found["llama-server"] == str(tmp_path / "llama-server")


def test_check_gguf(tmp_path):
    with pytest.raises(lc.LlamaCppMissing, match="--gguf is unset.*convert_hf_to_gguf"):
        lc.check_gguf(None)
    with pytest.raises(lc.LlamaCppMissing, match="no such file"):
        lc.check_gguf(str(tmp_path / "x.gguf"))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"PK\x03\x04")
    with pytest.raises(lc.LlamaCppMissing, match="not a GGUF"):
        lc.check_gguf(str(bad))
    good = tmp_path / "m.gguf"
    good.write_bytes(b"GGUF\x03\x00\x00\x00")
    assert lc.check_gguf(str(good)) == str(good)


def test_importing_defines_no_flags():
    from absl import flags
    assert "llama_cpp_dir" not in flags.FLAGS and "gguf" not in flags.FLAGS


def test_cli_without_llama_cpp_fails_clearly(tmp_path):
    """`python -m experiments llama_cpp` where llama.cpp is not built: a non-zero exit whose
    message names the missing tools, before any model is loaded."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("LLAMA_CPP_DIR", None)
    p = subprocess.run([sys.executable, "-m", "experiments", "llama_cpp",
                        f"--llama_cpp_dir={tmp_path}", "--nocompilation_cache"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode != 0
    assert "llama.cpp tool(s) missing: llama-bench, llama-batched-bench, llama-server" in p.stderr
    assert "loading" not in p.stderr
