"""The judge's arithmetic: ratios, SpecScore and the lossless gate (../shared/spec/judge.md).

Pure functions over plain numbers and token lists, so each check can be tested on inputs whose
answer is known, apart from any engine.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np

Z95 = 1.96
DTYPES = ("float32", "bfloat16")


@dataclasses.dataclass(frozen=True)
class Limits:
    """The gate's limits (defaults: ../shared/spec/judge.md). greedy_agreement_floor None =
    the dtype's default (`greedy_floor`): 1.0 in float32, none in bfloat16; 0.0 turns the
    check off."""
    greedy_agreement_floor: float | None = None
    likelihood_bound: float = 0.05
    argmax_bound: float = 0.01
    fidelity_ceiling: float = 0.02
    length_margin: float = 0.05
    memory_slack_mib: float = 4096.0
    busy_page_use_floor: float = 0.9


def greedy_floor(limits: Limits, dtype: str | None) -> float | None:
    """The greedy-agreement floor the gate applies to a run computed in `dtype`.

    An explicit `limits.greedy_agreement_floor` wins. Otherwise, in float32, 1.0: speculation
    is lossless, so greedy speculative replies equal greedy stock replies token for token
    (judge.md; every float32 card so far measured 1.0), and one diverging token is a bug
    (a rejected draft kept, a cache slot not rolled back). In bfloat16, none (reported only):
    the verify step (k+1 rows) and the stock step (1 row) round differently, a near-tie
    flips and the common prefix, hence the metric, ends there; no bf16 run has measured how
    often, so any floor would be a guess. dtype None (unknown): no default floor.
    """
    if limits.greedy_agreement_floor is not None:
        return float(limits.greedy_agreement_floor)
    if dtype is None:
        return None
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES} or None, got {dtype!r}")
    return 1.0 if dtype == "float32" else None


def geomean(xs: Sequence[float]) -> float:
    xs = [float(x) for x in xs]
    return float(math.exp(sum(math.log(x) for x in xs) / len(xs))) if xs else float("nan")


def paired_gap(candidate: Sequence[float], stock: Sequence[float]) -> tuple[float, float]:
    """Mean of candidate - stock over paired items, and its standard error."""
    d = np.asarray(candidate, np.float64) - np.asarray(stock, np.float64)
    if d.size == 0:
        return float("nan"), float("nan")
    se = float(d.std(ddof=1) / math.sqrt(d.size)) if d.size > 1 else 0.0
    return float(d.mean()), se


def interval_outside(gap: float, se: float, bound: float) -> bool:
    """True iff gap ± 1.96 se lies entirely outside [-bound, bound] (the check fails)."""
    return gap - Z95 * se > bound or gap + Z95 * se < -bound


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def greedy_agreement(candidate: Sequence[Sequence[int]], stock: Sequence[Sequence[int]]) -> float:
    """Mean over prompts of common-prefix length / stock reply length."""
    vals = [common_prefix(c, s) / len(s) for c, s in zip(candidate, stock) if len(s)]
    return float(np.mean(vals)) if vals else float("nan")


def sampled_agreement(candidate: Sequence[Sequence[int]], stock: Sequence[Sequence[int]]) -> float:
    """Share of reply positions (over the longer reply of each pair) with identical tokens."""
    same = total = 0
    for c, s in zip(candidate, stock):
        n = max(len(c), len(s))
        same += sum(1 for x, y in zip(c, s) if x == y)
        total += n
    return same / total if total else float("nan")


def length_ratio(candidate_lengths: Sequence[int], stock_lengths: Sequence[int],
                 resamples: int = 2000, seed: int = 0) -> dict:
    """Ratio of mean reply lengths with a paired-bootstrap 95% interval."""
    c = np.asarray(candidate_lengths, np.float64)
    s = np.asarray(stock_lengths, np.float64)
    ratio = float(c.mean() / s.mean())
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(c), (resamples, len(c)))
    boot = c[idx].mean(1) / s[idx].mean(1)
    low, high = np.quantile(boot, [0.025, 0.975])
    return {"ratio": ratio, "low": float(low), "high": float(high)}


def evaluate(m: dict, limits: Limits, dtype: str | None = None) -> dict:
    """The gate: each check's value, limit and verdict, plus `reason` (first failure) and score.

    dtype: the run's compute dtype ("float32" or "bfloat16"); it sets the default greedy
    agreement floor (`greedy_floor`). `limits` in the result are the limits applied, that
    floor resolved.

    m holds: memory {candidate_mib, stock_mib}, fidelity (float), likelihood {gap, se, ...},
    argmax {gap, se, ...}, greedy_agreement, sampled_agreement, lengths {wl: {ratio,low,high}},
    ratios {wl: {passes, ratio}}, and optionally page_use {wl: {stock, candidate}} (page use
    while requests wait; None if they never did).

    `busy_page_use` (when the busy workload ran) is a validity check of the workload, listed
    first: the busy numbers mean nothing unless both engines kept the pool >= the floor full.
    """
    checks, page_verdict = {}, {}
    busy = (m.get("page_use") or {}).get("busy")
    if busy is not None:
        use = [busy.get("stock"), busy.get("candidate")]
        least = None if any(u is None for u in use) else min(use)
        ok = least is not None and least >= limits.busy_page_use_floor
        checks["busy_page_use"] = ok
        page_verdict["busy"] = {"least": least, "floor": limits.busy_page_use_floor, "ok": ok}
    allowed = m["memory"]["stock_mib"] + limits.memory_slack_mib
    checks["memory"] = m["memory"]["candidate_mib"] <= allowed
    checks["fidelity"] = m["fidelity"] <= limits.fidelity_ceiling
    lk, am = m["likelihood"], m["argmax"]
    checks["likelihood"] = not interval_outside(lk["gap"], lk["se"], limits.likelihood_bound)
    checks["argmax"] = not interval_outside(am["gap"], am["se"], limits.argmax_bound)
    floor = greedy_floor(limits, dtype)
    if floor is not None:
        checks["greedy_agreement"] = m["greedy_agreement"] >= floor
    lo, hi = 1 - limits.length_margin, 1 + limits.length_margin
    checks["lengths"] = all(v["high"] >= lo and v["low"] <= hi for v in m["lengths"].values())
    order = ["busy_page_use", "memory", "fidelity", "likelihood", "argmax", "greedy_agreement",
             "lengths"]
    reason = next((c for c in order if c in checks and not checks[c]), None)
    specscore = geomean([v["ratio"] for v in m["ratios"].values()])
    return {
        "checks": checks,
        "memory": {"ok": checks["memory"], "peak_mib": m["memory"]["candidate_mib"],
                   "stock_peak_mib": m["memory"]["stock_mib"], "allowed_mib": allowed},
        "page_use": page_verdict,
        "limits": dataclasses.asdict(dataclasses.replace(limits, greedy_agreement_floor=floor)),
        "reason": reason,
        "specscore": specscore,
        "score": specscore if reason is None else 0.0,
    }
