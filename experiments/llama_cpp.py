"""`python -m experiments llama_cpp`: our stock engine beside llama.cpp on the same checkpoint,
this CPU, the same greedy tokens (issue 36 item 6).

Needs a llama.cpp built here (nothing of it is in this repository, and CI never builds it) and
the checkpoint converted by llama.cpp's own converter to a GGUF (F32 for the tiny: the same
weights as our float32 engine). RESULTS.md (2026-12-07, session 4) gives the exact commands:
llama.cpp from the llama-cpp-python sdist on PyPI (its vendor/llama.cpp), built CPU-only with
cmake (`llama-bench llama-batched-bench llama-server`), and
`convert_hf_to_gguf.py checkpoints/tiny --outtype f32`.

    python -m experiments llama_cpp --llama_cpp_dir=/work/llama/llama.cpp/build/bin \\
        --gguf=/work/llama/gguf/tiny-f32.gguf --batch_sizes=1,8 --new_tokens=128 --rounds=3 \\
        --threads=2,1

What runs, per round, interleaved so their ratio is measured in one sitting:

  ours       the stock engine (k = 0, float32, `max_lanes` = B) generating `--new_tokens`
             greedy tokens for B held-out prompts of `--prompt_tokens` (experiments/
             depth_sweep.py heldout_prompts); decode tokens/s = the tokens emitted after every
             request has its first token, over the time from then to the last token (the
             prefill left out, as llama.cpp's benches do); the end-to-end rate (prefill
             included) is in the JSON too
  llama.cpp  `llama-batched-bench -t T -npp P -ntg N -npl B -ctk f32 -ctv f32` (S_TG: B
             sequences of P prompt tokens decoded together, one token each per step, the
             prefill left out), for every B; at B = 1 also `llama-bench -t T -p 0 -n N -d P`
             (tg N at a depth of P cached tokens), which takes no f32 KV cache (`-ctk` knows
             f16, bf16 and quantized types only): it runs with its default f16 KV, a column of
             its own. Both tools decode without sampling (ours samples greedily on device).
             Each `--threads` count is one more llama.cpp run per round.

Each round also records the 1-minute load average and the share of the cores OTHER processes
used during it (/proc/stat less this process's and its children's CPU time): llama.cpp with as
many threads as cores collapses when another process takes a core (RESULTS.md), so a ratio
means something only beside that share.

Same tokens: once per batch size (before the timed rounds), llama-server (`-np B`, the same
threads) generates greedily (top_k 1, stop at end-of-generation as our engine stops at the
checkpoint's eos ids) from the same prompt ids, B requests at once, and each request's tokens
are compared with ours; at the first divergence both engines' two best log-probabilities are
given (the margin: a float32 near-tie can flip from summation order alone), and over the
matched tokens the smallest top-2 margin each engine saw and the largest difference between
their log-probabilities of the chosen token.

The functions that read llama.cpp's output and find its tools take no flags (tests/
test_llama_cpp.py tests them without llama.cpp); the flags are defined only when this module
is the sub-command (`define_flags`, called by `python -m experiments`).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

TOOLS = ("llama-bench", "llama-batched-bench", "llama-server")
BUILD_HINT = ("build llama.cpp CPU-only (RESULTS.md, 2026-12-07 session 4: `pip download "
              "--no-binary :all: --no-deps llama-cpp-python==0.3.36`, unpack, then in its "
              "vendor/llama.cpp `cmake -B build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON "
              "-DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_USE_PREBUILT_UI=OFF && cmake --build "
              "build -j2 --target llama-bench llama-batched-bench llama-server`) and pass "
              "--llama_cpp_dir=<that llama.cpp>/build/bin")
CONVERT_HINT = ("convert the checkpoint with llama.cpp's converter: `python "
                "<llama.cpp>/convert_hf_to_gguf.py checkpoints/tiny --outtype f32 --outfile "
                "tiny-f32.gguf` (RESULTS.md, 2026-12-07 session 4) and pass --gguf")


class LlamaCppMissing(FileNotFoundError):
    """llama.cpp's tools or the GGUF are not there: the message names what is missing."""


# --------------------------------------------------------------------------------------------
# Finding llama.cpp (no flags)
# --------------------------------------------------------------------------------------------

def tool_dirs(llama_cpp_dir: str) -> list[str]:
    """Where the tools may be: the folder itself, its build/bin, its bin."""
    d = os.path.abspath(os.path.expanduser(llama_cpp_dir))
    return [d, os.path.join(d, "build", "bin"), os.path.join(d, "bin")]


def find_tools(llama_cpp_dir: str | None, names: Sequence[str] = TOOLS) -> dict[str, str]:
    """{tool: executable path} for every name, or LlamaCppMissing naming what is missing."""
    if not llama_cpp_dir:
        raise LlamaCppMissing(f"llama.cpp is not built here or not given: --llama_cpp_dir is "
                              f"unset (needs {', '.join(names)}); {BUILD_HINT}")
    dirs = tool_dirs(llama_cpp_dir)
    if not os.path.isdir(dirs[0]):
        raise LlamaCppMissing(f"--llama_cpp_dir={llama_cpp_dir}: no such folder (needs "
                              f"{', '.join(names)}); {BUILD_HINT}")
    found, missing = {}, []
    for name in names:
        for d in dirs:
            p = os.path.join(d, name)
            if os.path.isfile(p) and os.access(p, os.X_OK):
                found[name] = p
                break
        else:
            missing.append(name)
    if missing:
        raise LlamaCppMissing(f"llama.cpp tool(s) missing: {', '.join(missing)} (looked in "
                              f"{', '.join(dirs)}); {BUILD_HINT}")
    return found


def check_gguf(path: str | None) -> str:
    """The GGUF's absolute path, or LlamaCppMissing."""
    if not path:
        raise LlamaCppMissing(f"--gguf is unset; {CONVERT_HINT}")
    p = os.path.abspath(os.path.expanduser(path))
    if not os.path.isfile(p):
        raise LlamaCppMissing(f"--gguf={path}: no such file; {CONVERT_HINT}")
    with open(p, "rb") as f:
        if f.read(4) != b"GGUF":
            raise LlamaCppMissing(f"--gguf={path} is not a GGUF file (no GGUF magic); "
                                  f"{CONVERT_HINT}")
    return p


# --------------------------------------------------------------------------------------------
# Reading llama.cpp's output (no flags)
# --------------------------------------------------------------------------------------------

def _json_objects(text: str) -> list:
    """A JSON array, or JSON lines among other lines (logs), as a list."""
    s = text.strip()
    start = s.find("[")
    if start != -1 and (s.find("{") == -1 or start < s.find("{")):
        try:
            out = json.loads(s[start:s.rindex("]") + 1])
            if isinstance(out, list):
                return out
        except (ValueError, json.JSONDecodeError):
            pass
    out = []
    for line in s.splitlines():
        line = line.strip()
        if line.startswith("{") and line.endswith("}"):
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out


def parse_llama_bench(text: str) -> list[dict]:
    """llama-bench `-o json` (or `-o jsonl`) stdout: its records (one per test)."""
    recs = [r for r in _json_objects(text) if isinstance(r, dict) and "avg_ts" in r]
    if not recs:
        raise ValueError("no llama-bench record (a JSON object with avg_ts) in its output: "
                         + text.strip()[-300:])
    return recs


def llama_bench_decode(records: list[dict], n_gen: int) -> dict:
    """The decode test (n_prompt 0, n_gen = n_gen) of parse_llama_bench's records: tokens/s
    (avg_ts, its stddev and samples) with the build and test settings."""
    for r in records:
        if int(r.get("n_gen", 0)) == n_gen and int(r.get("n_prompt", 0)) == 0:
            return {"tokens_per_s": float(r["avg_ts"]),
                    "stddev_tokens_per_s": float(r.get("stddev_ts", 0.0)),
                    "samples_tokens_per_s": [float(x) for x in r.get("samples_ts", [])],
                    "n_depth": int(r.get("n_depth", 0)), "n_threads": r.get("n_threads"),
                    "build_commit": r.get("build_commit"), "build_number": r.get("build_number"),
                    "model_type": r.get("model_type"), "backends": r.get("backends"),
                    "cpu_info": r.get("cpu_info")}
    raise ValueError(f"no llama-bench decode record with n_prompt 0 and n_gen {n_gen}")


_MD_ROW = re.compile(r"^\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*([\d.]+)\s*\|"
                     r"\s*([\d.]+)\s*\|\s*([\d.]+)\s*\|\s*([\d.]+)\s*\|\s*([\d.]+)\s*\|"
                     r"\s*([\d.]+)\s*\|\s*$")
_MD_KEYS = ("pp", "tg", "pl", "n_kv", "t_pp", "speed_pp", "t_tg", "speed_tg", "t", "speed")


def parse_batched_bench(text: str) -> list[dict]:
    """llama-batched-bench's rows, from `--output-format jsonl` lines or its markdown table
    (`| PP | TG | B | N_KV | T_PP s | S_PP t/s | T_TG s | S_TG t/s | T s | S t/s |`): dicts
    with pp, tg, pl (parallel sequences), t_tg and speed_tg (decode tokens/s) among others."""
    rows = [r for r in _json_objects(text) if isinstance(r, dict) and "speed_tg" in r]
    if not rows:
        for line in text.splitlines():
            m = _MD_ROW.match(line.strip())
            if m:
                rows.append({k: (int(v) if i < 4 else float(v))
                             for i, (k, v) in enumerate(zip(_MD_KEYS, m.groups()))})
    if not rows:
        raise ValueError("no llama-batched-bench row in its output: " + text.strip()[-300:])
    return rows


def batched_decode(rows: list[dict], pl: int, tg: int) -> dict:
    """The row of parse_batched_bench with pl parallel sequences and tg generated tokens."""
    for r in rows:
        if int(r["pl"]) == pl and int(r["tg"]) == tg:
            return {"tokens_per_s": float(r["speed_tg"]), "t_tg": float(r["t_tg"]),
                    "pp": int(r["pp"]), "n_threads": r.get("n_threads")}
    raise ValueError(f"no llama-batched-bench row with B={pl} and TG={tg}")


def parse_completion(obj: dict) -> dict:
    """llama-server /completion response (`return_tokens`, `n_probs`): the generated ids, why
    it stopped, and per token the best (id, logprob) pairs when given."""
    if "tokens" not in obj:
        raise ValueError("llama-server reply has no 'tokens' (was return_tokens set?): "
                         + json.dumps(obj)[:300])
    tops = []
    for p in obj.get("completion_probabilities") or []:
        pairs = p.get("top_logprobs") or p.get("top_probs") or []
        tops.append([(int(q["id"]), float(q.get("logprob", q.get("prob", 0.0)))) for q in pairs])
    return {"tokens": [int(t) for t in obj["tokens"]],
            "stop_type": obj.get("stop_type"), "top": tops}


def compare_tokens(ours: Sequence[int], theirs: Sequence[int]) -> dict:
    """Greedy sequences side by side: the matched prefix, the first divergence (None where
    one is a prefix of the other and both have the same length) and whether all match."""
    n = min(len(ours), len(theirs))
    i = next((j for j in range(n) if ours[j] != theirs[j]), n)
    diverge = None if (i == n and len(ours) == len(theirs)) else i
    return {"matched": i, "ours_len": len(ours), "llama_len": len(theirs),
            "first_divergence": diverge, "same": diverge is None}


# --------------------------------------------------------------------------------------------
# Our engine's timing (no flags)
# --------------------------------------------------------------------------------------------

def decode_rate(events: Sequence[tuple[float, int, int]], n_requests: int) -> dict:
    """Decode tokens/s from on_token events (time, request index, tokens in the event): the
    window opens when the last request gets its first token (the prefills are over) and closes
    at the last event; its tokens are those of the events after it opens."""
    firsts: dict[int, float] = {}
    for t, i, n in events:
        if n and i not in firsts:
            firsts[i] = t
    if len(firsts) < n_requests:
        raise ValueError(f"{n_requests - len(firsts)} request(s) emitted no token")
    t0 = max(firsts.values())
    t1 = max(t for t, _, n in events if n)
    tokens = sum(n for t, _, n in events if t > t0)
    if tokens == 0 or t1 <= t0:
        raise ValueError("no token after the prefills: generate more tokens")
    return {"tokens_per_s": tokens / (t1 - t0), "decode_tokens": tokens, "decode_s": t1 - t0}


def proc_stat_busy(text: str) -> float:
    """Busy CPU seconds of the whole machine since boot, from /proc/stat's `cpu` line (user,
    nice, system, irq, softirq, steal; idle and iowait left out), at 100 ticks a second."""
    for line in text.splitlines():
        if line.startswith("cpu "):
            v = [int(x) for x in line.split()[1:]]
            busy = v[0] + v[1] + v[2] + sum(v[5:8])
            return busy / 100.0
    raise ValueError("no 'cpu ' line in /proc/stat")


class OthersCpu:
    """The share of the machine's cores that OTHER processes kept busy over an interval:
    (machine busy seconds - this process's and its finished children's CPU seconds) /
    (wall seconds x cores). The load average lags by a minute; this is the interval's own."""

    def __init__(self):
        self.t0, self.b0, self.own0 = time.perf_counter(), self._busy(), self._own()

    @staticmethod
    def _busy() -> float | None:
        try:
            with open("/proc/stat") as f:
                return proc_stat_busy(f.read())
        except (OSError, ValueError):
            return None

    @staticmethod
    def _own() -> float:
        t = os.times()
        return t.user + t.system + t.children_user + t.children_system

    def share(self) -> float | None:
        b1 = self._busy()
        if b1 is None or self.b0 is None:
            return None
        wall = time.perf_counter() - self.t0
        others = (b1 - self.b0) - (self._own() - self.own0)
        return max(0.0, others) / (wall * (os.cpu_count() or 1))


def logprob_agreement(ours_top: Sequence[Sequence[tuple[int, float]]],
                      llama_top: Sequence[Sequence[tuple[int, float]]], matched: int) -> dict:
    """Over the first `matched` positions (both engines chose the same token), per position
    the best two (id, logprob) pairs of each engine: the smallest top-1 - top-2 margin each
    engine saw (how near a float32 near-tie came to flipping a token) and the largest
    difference between the engines' log-probabilities of the chosen token."""
    margins = {"ours": [], "llama": []}
    diffs = []
    for j in range(min(matched, len(ours_top), len(llama_top))):
        a, b = ours_top[j], llama_top[j]
        for name, top in (("ours", a), ("llama", b)):
            if len(top) >= 2:
                margins[name].append(top[0][1] - top[1][1])
        if a and b and a[0][0] == b[0][0]:
            diffs.append(abs(a[0][1] - b[0][1]))
    low = lambda xs: min(xs) if xs else None
    return {"min_margin_ours": low(margins["ours"]), "min_margin_llama": low(margins["llama"]),
            "max_chosen_logprob_diff": max(diffs) if diffs else None, "positions": len(diffs)}


def ratio(a: float | None, b: float | None) -> float | None:
    return None if not a or not b else a / b


def summarize(cells: dict[int, dict]) -> list[dict]:
    """One row per (batch size, llama.cpp threads): the medians over rounds of each engine's
    tokens/s and their ratios. cells[b]: "ours" (a list), "llama" and optionally
    "llama_bench" ({threads: list}), the token check "tokens" and the 1-minute load
    averages seen after each round ("load"), the share of the cores other processes used
    in each round ("others_cpu", OthersCpu)."""
    import statistics
    med = lambda xs: statistics.median(xs) if xs else None
    rows = []
    for b in sorted(cells):
        c = cells[b]
        ours = med(c["ours"])
        for t in sorted(c["llama"]):
            theirs = med(c["llama"][t])
            lb_rounds = list((c.get("llama_bench") or {}).get(t) or [])
            lb = med(lb_rounds)
            rows.append({"batch": b, "threads": t, "ours_tokens_per_s": ours,
                         "llama_tokens_per_s": theirs, "llama_over_ours": ratio(theirs, ours),
                         "llama_bench_tokens_per_s": lb,
                         "llama_bench_over_ours": ratio(lb, ours),
                         "ours_rounds": list(c["ours"]), "llama_rounds": list(c["llama"][t]),
                         "llama_bench_rounds": lb_rounds, "load": list(c.get("load") or []),
                         "others_cpu": list(c.get("others_cpu") or []),
                         "tokens": c.get("tokens")})
    return rows


def format_table(rows: list[dict]) -> str:
    """The markdown table of summarize's rows (medians over the rounds)."""
    lines = ["| batch | llama.cpp threads | ours tok/s | llama.cpp tok/s (batched-bench, f32 KV) "
             "| llama.cpp / ours | llama-bench tok/s (f16 KV) | llama-bench / ours | "
             "greedy tokens matched | load (1 min) | other processes' CPU |",
             "|---:|---:|---:|---:|---:|---:|---:|---|---|---|"]
    f = lambda x, p=1: "n/a" if x is None else f"{x:,.{p}f}"
    for r in rows:
        t = r.get("tokens") or {}
        match = (f"{t['matched']}/{t['compared']}" + (" (all)" if t.get("same") else "")
                 if t else "n/a")
        load = r.get("load") or []
        load = f"{min(load):.1f}-{max(load):.1f}" if load else "n/a"
        oc = [x for x in r.get("others_cpu") or [] if x is not None]
        oc = f"{100 * min(oc):.0f}-{100 * max(oc):.0f}%" if oc else "n/a"
        lines.append(f"| {r['batch']} | {r['threads']} | {f(r['ours_tokens_per_s'])} | "
                     f"{f(r['llama_tokens_per_s'])} | {f(r['llama_over_ours'], 2)} | "
                     f"{f(r['llama_bench_tokens_per_s'])} | {f(r['llama_bench_over_ours'], 2)} "
                     f"| {match} | {load} | {oc} |")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# Running llama.cpp
# --------------------------------------------------------------------------------------------

def _run(cmd: list[str], timeout: float) -> str:
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {p.returncode}: {p.stderr.strip()[-800:]}")
    return p.stdout + "\n" + p.stderr


def llama_bench_cmd(tool: str, gguf: str, threads: int, n_gen: int, depth: int,
                    reps: int) -> list[str]:
    """Its KV cache stays at its default, f16 (llama-bench's -ctk takes no f32)."""
    return [tool, "-m", gguf, "-t", str(threads), "-p", "0", "-n", str(n_gen), "-d", str(depth),
            "-r", str(reps), "-o", "json"]


def batched_bench_cmd(tool: str, gguf: str, threads: int, n_gen: int, prompt: int,
                      batch: int, kv_type: str = "f32") -> list[str]:
    """B sequences, then one more cell of 1 (the tool's logger runs on its own thread and, on
    a busy machine, can lose its last lines at exit: the row wanted is never the last)."""
    ctx = (batch + 1) * (prompt + n_gen) + 64
    return [tool, "-m", gguf, "-t", str(threads), "-tb", str(threads), "-c", str(ctx),
            "-b", "2048", "-ub", "512", "-npp", str(prompt), "-ntg", str(n_gen),
            "-npl", f"{batch},1", "-ctk", kv_type, "-ctv", kv_type,
            "--output-format", "jsonl"]


def run_batched_bench(cmd: list[str], batch: int, n_gen: int, tries: int = 3) -> dict:
    """batched_decode of a run of cmd, rerun (up to `tries` runs) when the row is missing
    from the output (the logger's lost lines, batched_bench_cmd)."""
    for attempt in range(tries):
        text = _run(cmd, timeout=600)
        try:
            return {**batched_decode(parse_batched_bench(text), batch, n_gen),
                    "attempts": attempt + 1}
        except ValueError:
            if attempt == tries - 1:
                raise
    raise AssertionError("unreachable")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def llama_server(tool: str, gguf: str, threads: int, parallel: int, ctx_per_seq: int,
                 kv_type: str = "f32", timeout: float = 120.0):
    """A llama-server on a free local port (yields its base URL), stopped at exit."""
    port = _free_port()
    cmd = [tool, "-m", gguf, "--host", "127.0.0.1", "--port", str(port), "-t", str(threads),
           "-tb", str(threads), "-np", str(parallel), "-c", str(parallel * ctx_per_seq),
           "-ctk", kv_type, "-ctv", kv_type, "--no-webui"]
    log = open(os.devnull, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        t0 = time.time()
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"llama-server exited {proc.returncode}: "
                                   f"{proc.stderr.read()[-800:]}")
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            if time.time() - t0 > timeout:
                raise RuntimeError(f"llama-server did not come up in {timeout:.0f} s")
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def server_greedy(url: str, prompt: Sequence[int], n_new: int, n_probs: int = 2,
                  timeout: float = 300.0) -> dict:
    """One greedy completion from token ids (parse_completion's dict)."""
    body = {"prompt": [int(t) for t in prompt], "n_predict": n_new, "temperature": 0.0,
            "top_k": 1, "samplers": ["top_k"], "return_tokens": True, "cache_prompt": False,
            "n_probs": n_probs, "post_sampling_probs": False, "stream": False}
    req = urllib.request.Request(url + "/completion", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return parse_completion(json.loads(r.read()))


# --------------------------------------------------------------------------------------------
# The sub-command
# --------------------------------------------------------------------------------------------

def define_flags() -> None:
    """This sub-command's flags (python -m experiments llama_cpp calls it); skipped for a name
    the process already has, so importing the module never defines or clashes with a flag."""
    from absl import flags
    F = flags.FLAGS
    default_ckpt = os.path.join(os.path.dirname(__file__), "..", "checkpoints", "tiny")
    for kind, name, default, help_ in (
            ("string", "llama_cpp_dir", os.environ.get("LLAMA_CPP_DIR"),
             "a built llama.cpp: the folder holding llama-bench, llama-batched-bench and "
             "llama-server (or one whose build/bin does); default $LLAMA_CPP_DIR"),
            ("string", "gguf", None, "the checkpoint converted by llama.cpp's "
             "convert_hf_to_gguf.py (--outtype f32)"),
            ("string", "checkpoint", default_ckpt, "the HF checkpoint the GGUF was made from"),
            ("list", "batch_sizes", ["1", "8"], "parallel sequences (lanes)"),
            ("integer", "new_tokens", 128, "tokens generated per sequence"),
            ("integer", "prompt_tokens", 32, "prompt tokens per sequence (held-out text)"),
            ("integer", "rounds", 3, "interleaved rounds (ours, llama.cpp) per batch size"),
            ("list", "threads", ["2"], "llama.cpp threads (-t and -tb); each count is one "
             "more llama.cpp run per round, the token check uses the first"),
            ("string", "kv_type", "f32", "llama.cpp's KV cache type (-ctk/-ctv; its default is "
             "f16, ours is the weights' float32)"),
            ("integer", "llama_bench_reps", 3, "llama-bench -r: repetitions inside one call"),
            ("bool", "check_tokens", True, "compare greedy tokens through llama-server"),
            ("integer", "seed", 0, "prompt seed"),
            ("string", "out", "", "also write the JSON here")):
        if name not in F:
            getattr(flags, f"DEFINE_{kind}")(name, default, help_)


def ours_engine(cfg, params, batch: int, prompt_tokens: int, new_tokens: int):
    import mtpjax
    return mtpjax.Engine(cfg, params, num_speculative_tokens=0, max_lanes=batch,
                         max_seq_len=prompt_tokens + new_tokens + 8, eos_token_ids=())


def ours_generate(engine, prompts, n_new: int, stop_ids=(), logprobs=None):
    """(outputs, on_token events, wall seconds) of one greedy generate."""
    from mtpjax.sampling import SamplingParams
    sp = SamplingParams(temperature=0.0, max_new_tokens=n_new, stop_token_ids=tuple(stop_ids),
                        logprobs=logprobs)
    events = []
    on_token = lambda i, ids: events.append((time.perf_counter(), i, len(ids)))
    t0 = time.perf_counter()
    outs = engine.generate(prompts, sp, on_token=on_token)
    return outs, events, time.perf_counter() - t0


def token_check(tools, gguf, engine, prompts, n_new, threads, eos_ids, log,
                kv_type: str = "f32") -> dict:
    """Greedy tokens of both engines, B requests at once, per request compared."""
    outs, _, _ = ours_generate(engine, prompts, n_new, stop_ids=eos_ids, logprobs=2)
    ctx = len(prompts[0]) + n_new + 16
    with llama_server(tools["llama-server"], gguf, threads, len(prompts), ctx, kv_type) as url:
        with ThreadPoolExecutor(len(prompts)) as ex:
            theirs = list(ex.map(lambda p: server_greedy(url, p, n_new), prompts))
    per, compared, matched = [], 0, 0
    for i, (o, t) in enumerate(zip(outs, theirs)):
        c = compare_tokens(o.token_ids, t["tokens"])
        d = c["first_divergence"]
        if d is not None:
            if d < len(o.token_ids) and o.logprobs:
                c["ours_top2_at_divergence"] = [list(x) for x in o.logprobs[d].top]
            if d < len(t["top"]):
                c["llama_top2_at_divergence"] = [list(x) for x in t["top"][d]]
            log(f"request {i}: diverges at token {d}: ours {o.token_ids[d:d + 1]}, llama.cpp "
                f"{t['tokens'][d:d + 1]}; ours top-2 {c.get('ours_top2_at_divergence')}, "
                f"llama.cpp top-2 {c.get('llama_top2_at_divergence')}")
        if o.logprobs:
            c.update(logprob_agreement([lp.top for lp in o.logprobs], t["top"], c["matched"]))
        compared += max(c["ours_len"], c["llama_len"])
        matched += c["matched"]
        per.append(c)
    pick = lambda key, f: (f(v) if (v := [c[key] for c in per if c.get(key) is not None])
                           else None)
    return {"matched": matched, "compared": compared, "same": all(c["same"] for c in per),
            "min_margin_ours": pick("min_margin_ours", min),
            "min_margin_llama": pick("min_margin_llama", min),
            "max_chosen_logprob_diff": pick("max_chosen_logprob_diff", max), "requests": per}


def main(argv):
    del argv
    from absl import flags
    F = flags.FLAGS
    try:
        tools = find_tools(F.llama_cpp_dir, TOOLS if F.check_tokens else TOOLS[:2])
        gguf = check_gguf(F.gguf)
    except LlamaCppMissing as e:
        sys.exit(f"llama_cpp: {e}")
    import mtpjax
    from experiments import depth_sweep
    from experiments.progress import Progress
    from mtpjax.text import Tokenizer
    log = Progress("llama_cpp")
    batches = [int(b) for b in F.batch_sizes]
    threads = [int(t) for t in F.threads]
    n, P = F.new_tokens, F.prompt_tokens
    log(f"loading {F.checkpoint} (float32)")
    cfg, params = mtpjax.load_checkpoint(F.checkpoint, "float32")
    tok = Tokenizer.from_checkpoint(F.checkpoint)
    prompts = depth_sweep.heldout_prompts(tok, max(batches), P, seed=F.seed)
    eos = tuple(cfg.eos_token_ids)
    cells: dict[int, dict] = {}
    for b in batches:
        engine = ours_engine(cfg, params, b, P, n)
        cell = cells[b] = {"ours": [], "ours_end_to_end": [], "llama": {t: [] for t in threads},
                           "load": []}
        log(f"batch {b}: warm-up of our engine (compiles)")
        ours_generate(engine, prompts[:b], n)
        if F.check_tokens:
            log(f"batch {b}: greedy tokens, ours and llama-server -np {b}")
            t = token_check(tools, gguf, engine, prompts[:b], n, threads[0], eos, log,
                            F.kv_type)
            cell["tokens"] = t
            log(f"batch {b}: tokens matched {t['matched']}/{t['compared']}; smallest top-2 "
                f"log-prob margin ours {t['min_margin_ours']}, llama.cpp "
                f"{t['min_margin_llama']}; largest difference of the chosen token's log-prob "
                f"{t['max_chosen_logprob_diff']}")
        for r in range(F.rounds):
            others = OthersCpu()
            outs, events, wall = ours_generate(engine, prompts[:b], n)
            rate = decode_rate(events, b)
            cell["ours"].append(rate["tokens_per_s"])
            cell["ours_end_to_end"].append(sum(len(o.token_ids) for o in outs) / wall)
            said = []
            for th in threads:
                res = run_batched_bench(batched_bench_cmd(
                    tools["llama-batched-bench"], gguf, th, n, P, b, F.kv_type), b, n)
                cell["llama"][th].append(res["tokens_per_s"])
                cell.setdefault("llama_details", []).append({"threads": th, **res})
                said.append(f"-t {th}: {res['tokens_per_s']:.1f}")
                if b == 1:
                    text = _run(llama_bench_cmd(tools["llama-bench"], gguf, th, n, P,
                                                F.llama_bench_reps), timeout=600)
                    lb = llama_bench_decode(parse_llama_bench(text), n)
                    cell.setdefault("llama_bench", {}).setdefault(th, []).append(
                        lb["tokens_per_s"])
                    cell.setdefault("llama_bench_details", []).append({"threads": th, **lb})
                    said.append(f"llama-bench -t {th}: {lb['tokens_per_s']:.1f}")
            cell["load"].append(os.getloadavg()[0])
            cell.setdefault("others_cpu", []).append(others.share())
            share = cell["others_cpu"][-1]
            log(f"batch {b} round {r + 1}: ours {rate['tokens_per_s']:.1f} tok/s; llama.cpp "
                f"{', '.join(said)} tok/s; load {cell['load'][-1]:.2f}, other processes "
                + ("n/a" if share is None else f"{100 * share:.0f}%") + " of the cores")
    rows = summarize(cells)
    print(format_table(rows))
    out = {"checkpoint": os.path.abspath(F.checkpoint), "gguf": gguf, "threads": threads,
           "kv_type": F.kv_type,
           "new_tokens": n, "prompt_tokens": P, "rounds": F.rounds,
           "loadavg_end": os.getloadavg(), "rows": rows,
           "cells": {str(b): {k: v for k, v in c.items() if k != "tokens"}
                     for b, c in cells.items()}}
    if F.out:
        with open(F.out, "w") as f:
            json.dump(out, f, indent=2)
    print(json.dumps(out))
    if F.check_tokens and not all((c.get("tokens") or {}).get("same") for c in cells.values()):
        print("tokens differ between the engines (see the divergences above)", file=sys.stderr)
