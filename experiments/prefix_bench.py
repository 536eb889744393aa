"""bench --sweep=prefix: time to first token with and without the prefix cache, for growing
shared-prefix lengths.

For each shared length P, requests are `shared[:P] + suffix_r` with distinct suffixes (as
chats on one system prompt, or agents on one tool list). Two engines of the same shapes, the
prefix cache off and on, serve them one at a time with max_new_tokens = 1, so a request's
wall time is its time to first token: its prefill and the first token. The cache-on engine is
primed by one request (it caches the shared prefix's boundaries) and warmed by a second (the
snapshot restore program compiles); the off engine runs the same two untimed requests. Then
`repeats` timed requests each; the median is reported, with the prompt tokens the hits
skipped (the largest snapshot boundary inside the shared part whose next token matches; see
mtpjax/engine/prefix_cache.py).
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, Sequence

from mtpjax.engine import Engine
from mtpjax.sampling import SamplingParams


def run_ttft_sweep(cfg, params, stream: Sequence[int], *, shared_lens: Sequence[int],
                   suffix_tokens: int, repeats: int, k: int, kernels: str, page_size: int,
                   log: Callable[[str], None] = print) -> dict:
    """stream: tokens to cut the shared prefix and the suffixes from (held-out text)."""
    top = max(shared_lens)
    need = top + (repeats + 2) * suffix_tokens
    if len(stream) < need:
        raise ValueError(f"--sweep=prefix needs {need} tokens of text, got {len(stream)}")
    shared = list(stream[:top])
    suffixes = [list(stream[top + i * suffix_tokens:top + (i + 1) * suffix_tokens])
                for i in range(repeats + 2)]
    kw = dict(num_speculative_tokens=k, max_lanes=1, max_seq_len=top + suffix_tokens + 8,
              kernels=kernels, page_size=page_size)
    engines = {"off": Engine(cfg, params, prefix_cache=False, **kw),
               "on": Engine(cfg, params, prefix_cache=True, **kw)}
    one = SamplingParams(max_new_tokens=1)
    rows = []
    for P in shared_lens:
        row = {"shared_tokens": int(P)}
        for name, e in engines.items():
            if e.prefix is not None:
                e.clear_prefix_cache()
            for s in suffixes[:2]:                    # prime (on) / warm (both)
                e.generate([shared[:P] + s], one)
            before = e.stats()["prefix_cache"]
            times = []
            for s in suffixes[2:]:
                t0 = time.perf_counter()
                out = e.generate([shared[:P] + s], one)[0]
                times.append(time.perf_counter() - t0)
                if out.finish_reason == "error":
                    raise RuntimeError(out.error)
            row[f"ttft_ms_{name}"] = statistics.median(times) * 1e3
            if before is not None:
                after = e.stats()["prefix_cache"]
                row["reused_tokens"] = (after["tokens_reused"] - before["tokens_reused"]) // repeats
                row["hits"] = after["hits"] - before["hits"]
        row["speedup"] = row["ttft_ms_off"] / row["ttft_ms_on"]
        rows.append(row)
        log(f"shared {P}: off {row['ttft_ms_off']:.1f} ms, on {row['ttft_ms_on']:.1f} ms "
            f"({row['reused_tokens']} tokens reused), x{row['speedup']:.2f}")
    return {"rows": rows, "suffix_tokens": suffix_tokens, "repeats": repeats, "k": k,
            "page_size": page_size,
            "snapshot_every_blocks": engines["on"].every_blocks}


def format_table(res: dict) -> str:
    lines = [f"| shared prefix (tokens) | reused by the hit | TTFT, cache off (ms) | "
             f"TTFT, cache on (ms) | speedup |", "|---|---|---|---|---|"]
    for r in res["rows"]:
        lines.append(f"| {r['shared_tokens']} | {r['reused_tokens']} | {r['ttft_ms_off']:.1f} | "
                     f"{r['ttft_ms_on']:.1f} | {r['speedup']:.2f}x |")
    return "\n".join(lines)
