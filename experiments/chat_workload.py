"""The judge's `chat` workload: multi-turn conversations on a shared system prompt.

Chat and agent traffic repeats long prefixes; this workload is where the prefix cache
(mtpjax/engine/prefix_cache.py) earns its keep, and it checks that speculation still pays when
prefills are mostly cache hits. Each conversation starts from the same system prompt plus
its own first user message; turn t+1's prompt is turn t's prompt + the reply + the next user
message (token level: the conversation's text, as a chat template would lay it out, is not
needed to measure reuse). All conversations of a turn run as one batch (continuous
batching over `lanes` lanes), turn after turn.

Stock and candidate both run with the cache on (the judge's --prefix_cache, default on; the
other workloads run without it), and
each timed pass starts from an empty cache, so a pass measures the cache filling from the
system prompt on, as a fresh server would. The ratio is reported beside SpecScore (which
stays the geometric mean of solo, team and busy, as in the reference card).
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from mtpjax.sampling import SamplingParams


@dataclasses.dataclass(frozen=True)
class ChatSpec:
    conversations: int = 8
    turns: int = 3
    system_tokens: int = 64
    user_tokens: int = 16


def build(texts, spec: ChatSpec):
    """(system prompt ids, per conversation a list of `turns` user messages) from the judge's
    fixed texts: the system prompt is the first texts' prompts run together, the user
    messages are the other texts' prompt tails."""
    pool = [t for p, c in texts for t in p + c]
    if len(pool) < spec.system_tokens + spec.user_tokens:
        raise ValueError("the judge texts are too short for the chat workload")
    system = pool[:spec.system_tokens]
    msgs = [p[-spec.user_tokens:] for p, _ in texts]
    users = [[msgs[(c * spec.turns + t) % len(msgs)] for t in range(spec.turns)]
             for c in range(spec.conversations)]
    return system, users


def max_seq_len(spec: ChatSpec, max_new_tokens: int) -> int:
    return spec.system_tokens + spec.turns * (spec.user_tokens + max_new_tokens) + 8


def run_pass(engine, system, users, params: list[SamplingParams]) -> dict:
    """One timed pass over every turn: tokens, wall seconds, time to first token (mean over
    requests, from the start of their turn's batch) and the prefix cache's counts."""
    clear = getattr(engine, "clear_prefix_cache", None)
    if clear is not None:
        clear()
    before = _prefix(engine)
    prompts = [system + u[0] for u in users]
    tokens, ttft, outs = 0, [], []
    t0 = time.perf_counter()
    for t in range(len(users[0])):
        first: dict[int, float] = {}
        t_turn = time.perf_counter()

        def on_token(i, ids, first=first, t_turn=t_turn):
            first.setdefault(i, time.perf_counter() - t_turn)

        got = engine.generate(prompts, params, on_token=on_token)
        errors = [o.error for o in got if o.finish_reason == "error"]
        if errors:
            raise RuntimeError(f"chat request failed: {errors[0]}")
        tokens += sum(len(o.token_ids) for o in got)
        ttft.append(float(np.mean(list(first.values()))))
        outs.extend(got)
        if t + 1 < len(users[0]):
            prompts = [p + o.token_ids + u[t + 1] for p, o, u in zip(prompts, got, users)]
    wall = time.perf_counter() - t0
    after = _prefix(engine)
    cache = None
    if after is not None:
        d = {key: after[key] - before.get(key, 0) for key in ("lookups", "hits", "tokens_reused")}
        d["hit_rate"] = d["hits"] / d["lookups"] if d["lookups"] else 0.0
        cache = d
    return {"outs": outs, "tokens": tokens, "wall_s": wall, "tok_s": tokens / wall,
            "ttft_ms_per_turn": [x * 1e3 for x in ttft], "prefix_cache": cache}


def _prefix(engine) -> dict | None:
    return engine.stats().get("prefix_cache")


def summarize(stock: list[dict], cand: list[dict], spec: ChatSpec, lanes: int) -> dict:
    passes = [c["tok_s"] / s["tok_s"] for s, c in zip(stock, cand)]
    return {"ratio": float(np.median(passes)), "passes": passes,
            "stock_tok_s": [s["tok_s"] for s in stock],
            "candidate_tok_s": [c["tok_s"] for c in cand],
            "ttft_ms_per_turn": {"stock": stock[0]["ttft_ms_per_turn"],
                                 "candidate": cand[0]["ttft_ms_per_turn"]},
            "prefix_cache": {"stock": stock[0]["prefix_cache"],
                             "candidate": cand[0]["prefix_cache"]},
            "lanes": lanes, **dataclasses.asdict(spec)}


def render_md(chat: dict) -> list[str]:
    """The card's chat block."""
    pc = chat["prefix_cache"]["candidate"]
    cache = ("prefix cache off" if pc is None else
             f"prefix cache: hit rate {pc['hit_rate']:.2f}, {pc['tokens_reused']} prompt "
             f"tokens reused per pass (candidate)")
    tt = chat["ttft_ms_per_turn"]
    return ["", f"Chat workload ({chat['conversations']} conversations x {chat['turns']} turns "
            f"on a {chat['system_tokens']}-token system prompt, {chat['lanes']} lanes; not in "
            f"SpecScore): ratio **{chat['ratio']:.3f}** (passes "
            f"{', '.join(f'{x:.3f}' for x in chat['passes'])}); stock "
            f"{', '.join(f'{x:.1f}' for x in chat['stock_tok_s'])} tok/s, candidate "
            f"{', '.join(f'{x:.1f}' for x in chat['candidate_tok_s'])} tok/s; {cache}; mean "
            f"time to first token per turn (ms) stock "
            f"{', '.join(f'{x:.0f}' for x in tt['stock'])}, candidate "
            f"{', '.join(f'{x:.0f}' for x in tt['candidate'])}"]
