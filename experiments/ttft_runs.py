"""Time to first token when prompts arrive together: the cells of
`python -m experiments ttft_check` (packed prefill against one chunk a step).

No flags here (tests and other sub-commands import it); experiments/ttft_check.py is the
command and says what is measured and how.
"""

from __future__ import annotations

import dataclasses
import statistics

import numpy as np

from experiments import card as card_lib
from experiments import chat_workload, depth_sweep

# (label, Engine prefill_rows): one chunk a step, and the engine's default (packed)
ROWS = (("one chunk", 1), ("packed", None))
ENGINES = (("stock", 0), ("candidate", depth_sweep.ADAPTIVE))


def make_engine(cfg, params, k: int, depth, lanes: int, rows: int | None, max_seq_len: int,
                clock: str, prefill_chunk: int):
    """A judge-like engine: stock (K = 0) or the adaptive candidate (K = k), stop tokens off,
    timed on `clock` ("wall" or "h200"); rows: prefill_rows (None: the default)."""
    import mtpjax
    kk = 0 if depth == 0 else k
    return mtpjax.Engine(cfg, params, num_speculative_tokens=kk, max_lanes=lanes,
                         max_seq_len=max_seq_len, prefill_chunk=prefill_chunk,
                         eos_token_ids=(), prefill_rows=rows,
                         speculation_policy=depth_sweep.ADAPTIVE if kk else "fixed",
                         clock=card_lib.make_clock(clock, kk,
                                                   weights=card_lib.clock_weights(params)))


def burst(engine, prompts, sampling) -> dict:
    """Every prompt submitted at once (one generate call): per request, the time from the
    call to its first token on the engine's time (its clock's, or wall)."""
    engine.reset_timing()
    t0, first = card_lib.now(engine), {}
    outs = engine.generate(prompts, sampling,
                           on_token=lambda i, ids: first.setdefault(i, card_lib.now(engine)))
    bad = [o.error for o in outs if o.error]
    if bad:
        raise RuntimeError(f"a request failed: {bad[0]}")
    ttft = [first[i] - t0 for i in range(len(prompts))]
    return {"ttft_s": ttft, "token_ids": [o.token_ids for o in outs],
            "packed_steps": engine.timing["packed_steps"],
            "chunk_launches": engine.timing["prefill_chunks"]}


def chat(engine, system, users, params) -> dict:
    """The judge's chat workload (experiments/chat_workload.py) with the time to first token
    of each turn on the engine's time: the mean over the turn's requests, from the call."""
    per_turn = []

    class Timed:      # what chat_workload.run_pass calls, with the turn's first tokens stamped
        def generate(self, prompts, ps, on_token=None):
            t0, first = card_lib.now(engine), {}

            def stamp(i, ids):
                first.setdefault(i, card_lib.now(engine))
                if on_token is not None:
                    on_token(i, ids)
            outs = engine.generate(prompts, ps, on_token=stamp)
            per_turn.append(float(np.mean([t - t0 for t in first.values()])))
            return outs

        def __getattr__(self, name):
            return getattr(engine, name)

    r = chat_workload.run_pass(Timed(), system, users, params)
    return {"ttft_s_per_turn": per_turn, "token_ids": [o.token_ids for o in r["outs"]]}


def p90(xs) -> float:
    return float(np.percentile(xs, 90))


def summary(passes: list[dict]) -> dict:
    """Medians over passes of the burst's mean and p90 time to first token (ms)."""
    return {"mean_ms": 1e3 * statistics.median(float(np.mean(p["ttft_s"])) for p in passes),
            "p90_ms": 1e3 * statistics.median(p90(p["ttft_s"]) for p in passes),
            "packed_steps": passes[0]["packed_steps"]}


def chat_summary(passes: list[dict]) -> dict:
    """Per turn, the median over passes of its mean time to first token (ms)."""
    turns = len(passes[0]["ttft_s_per_turn"])
    return {"turn_ms": [1e3 * statistics.median(p["ttft_s_per_turn"][t] for p in passes)
                        for t in range(turns)]}


def run(cfg, params, prompts, chat_texts, *, lanes: int, k: int, passes: int, new_tokens: int,
        clock: str, prefill_chunk: int, chat_spec: chat_workload.ChatSpec | None,
        log=print) -> dict:
    """Every (engine, rows) cell on the burst (and the chat workload when chat_spec), passes
    interleaved (the cell order reversed every other pass)."""
    from mtpjax.sampling import SamplingParams
    sampling = SamplingParams(temperature=0.0, max_new_tokens=new_tokens)
    max_seq = depth_sweep.max_seq_len_for(max(len(p) for p in prompts), new_tokens)
    system = users = None
    if chat_spec is not None:
        system, users = chat_workload.build(chat_texts, chat_spec)
        max_seq = max(max_seq, chat_workload.max_seq_len(chat_spec, new_tokens))
    chat_params = [SamplingParams(temperature=0.0, max_new_tokens=new_tokens)] * (
        0 if chat_spec is None else chat_spec.conversations)
    engines = {}
    for name, depth in ENGINES:
        for label, rows in ROWS:
            e = make_engine(cfg, params, k, depth, lanes, rows, max_seq, clock, prefill_chunk)
            burst(e, prompts, sampling)                     # compile what the passes run
            e.warmup(None)
            if chat_spec is not None:
                chat(e, system, users, chat_params)
            engines[name, label] = e
    runs = {key: [] for key in engines}
    chats = {key: [] for key in engines}
    order = list(engines)
    for p in range(passes):
        for key in (order if p % 2 == 0 else order[::-1]):
            runs[key].append(burst(engines[key], prompts, sampling))
            if chat_spec is not None:
                chats[key].append(chat(engines[key], system, users, chat_params))
    rows_out = []
    for name, _ in ENGINES:
        base = runs[name, ROWS[0][0]][0]["token_ids"]
        for label, _ in ROWS:
            row = {"engine": name, "prefill": label,
                   "prefill_rows": engines[name, label].prefill_rows,
                   **summary(runs[name, label]),
                   "same_tokens": runs[name, label][0]["token_ids"] == base}
            if chat_spec is not None:
                row.update(chat_summary(chats[name, label]))
                row["same_chat_tokens"] = (chats[name, label][0]["token_ids"]
                                           == chats[name, ROWS[0][0]][0]["token_ids"])
            rows_out.append(row)
            log(format_row(row))
    return {"settings": {"lanes": lanes, "k": k, "passes": passes, "clock": clock,
                         "prompts": len(prompts), "prompt_tokens": len(prompts[0]),
                         "new_tokens": new_tokens, "prefill_chunk": prefill_chunk,
                         "chat": None if chat_spec is None else dataclasses.asdict(chat_spec)},
            "rows": rows_out}


HEADER = ("| engine    | prefill   | rows | TTFT mean ms | TTFT p90 ms | packed steps | "
          "chat TTFT per turn ms | same tokens |\n|---|---|---|---|---|---|---|---|")


def format_row(r: dict) -> str:
    chat_ms = ", ".join(f"{x:.0f}" for x in r.get("turn_ms", [])) or "-"
    same = r["same_tokens"] and r.get("same_chat_tokens", True)
    return (f"| {r['engine']:9s} | {r['prefill']:9s} | {r['prefill_rows']:4d} | "
            f"{r['mean_ms']:12.1f} | {r['p90_ms']:11.1f} | {r['packed_steps']:12d} | "
            f"{chat_ms:21s} | {same} |")
