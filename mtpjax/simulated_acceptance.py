"""Simulated acceptance, for planning on the H200 clock: every verify step accepts as many
drafts as a draw from a published acceptance profile says, whatever the model proposed.

Why: the clock prices the 27B's programs while a tiny checkpoint runs here, and the tiny's
own acceptance (its greedy output loops) is not the 27B's. SGLang offers the same knob for the
same purpose (`SGLANG_SIMULATE_ACC_LEN`). A simulated run's tokens are NOT the model's: only
its times mean anything, so the judge's lossless gate reports "not applicable" for it and
nothing but the timing sub-commands (judge, bench, speed, serve_bench) accept the flag.

Data flow:
  1. a Profile holds the published tokens per verify step T_k at depth k = 1..K_max; the
     unconditional rate of draft j is a_j = T_j - T_{j-1} (T_0 = 1) and the conditional rate
     (draft j accepted given drafts 1..j-1 were) c_j = a_j / a_{j-1};
  2. Simulator.draw(k, real_drafts) draws, per lane of a depth-k step, the accepted count:
     successive Bernoulli(c_j) up to the first failure, at most min(k, the lane's real drafts)
     (seeded numpy generator: one run, one sequence);
  3. the engine passes the counts to the decode step in Extras.forced_accept (i32[B], -1 =
     off; always present, so no program is added): the step then emits the lane's drafts up
     to the count and one more token (steps._forced_accept), so the cache, the pending GDN
     replay and the positions stay those of a run that accepted that many;
  4. the engine, the scheduler and the depth policy read the accepted counts the step
     returns, as in any run: the adaptive policy sees the profile's acceptance.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Sequence

import numpy as np

# InferenceX (SemiAnalysisAI/InferenceX, PR #3304): Qwen3.x-27B with its native MTP head on
# one H200, SPEED-Bench coding, tokens per verify step at k = 1..4 speculative tokens.
INFERENCEX = ("InferenceX, SemiAnalysisAI/InferenceX PR #3304: Qwen3.x-27B native MTP on one "
              "H200, SPEED-Bench coding, tokens per verify step at k = 1..4")


@dataclasses.dataclass(frozen=True)
class Profile:
    """Published tokens per verify step at depth k = 1..len(tokens_per_verify_step)."""
    name: str
    tokens_per_verify_step: tuple[float, ...]
    source: str

    def __post_init__(self):
        t = (1.0,) + tuple(float(x) for x in self.tokens_per_verify_step)
        if len(t) < 2:
            raise ValueError(f"profile {self.name!r} needs tokens per verify step at k >= 1")
        gains = [b - a for a, b in zip(t, t[1:])]
        if not all(0 <= g <= 1 for g in gains) or any(b > a + 1e-12
                                                      for a, b in zip(gains, gains[1:])):
            raise ValueError(f"profile {self.name!r}: tokens per verify step must grow by "
                             f"non-increasing steps in [0, 1] from 1, got {t[1:]}")

    @property
    def depth(self) -> int:
        return len(self.tokens_per_verify_step)

    def unconditional(self) -> list[float]:
        """a_j: the share of depth >= j verify steps that accept draft j."""
        t = (1.0,) + tuple(self.tokens_per_verify_step)
        return [b - a for a, b in zip(t, t[1:])]

    def conditional(self) -> list[float]:
        """c_j: draft j accepted given drafts 1..j-1 were (0 after a zero rate)."""
        a, prev, out = self.unconditional(), 1.0, []
        for x in a:
            out.append(x / prev if prev > 0 else 0.0)
            prev = x
        return out

    def tokens_per_step(self, k: int) -> float:
        """Expected tokens a depth-k verify step emits per lane (1 at k = 0); past the
        profile's depth the last conditional rate repeats."""
        c = self.conditional()
        e, run = 1.0, 1.0
        for j in range(int(k)):
            run *= c[min(j, len(c) - 1)]
            e += run
        return e


PROFILES = {
    "qwen3.5-27b-nothink": Profile("qwen3.5-27b-nothink", (1.90, 2.68, 3.28, 3.79),
                                   INFERENCEX + ", thinking off"),
    "qwen3.5-27b-think": Profile("qwen3.5-27b-think", (1.73, 2.21, 2.52, 2.72),
                                 INFERENCEX + ", thinking on"),
}


def load(spec: "str | Profile") -> Profile:
    """A Profile by name (PROFILES) or from a JSON file {"name", "tokens_per_verify_step",
    "source"}."""
    if isinstance(spec, Profile):
        return spec
    if spec in PROFILES:
        return PROFILES[spec]
    if os.path.isfile(spec):
        with open(spec) as fh:
            d = json.load(fh)
        return Profile(str(d.get("name", os.path.basename(spec))),
                       tuple(d["tokens_per_verify_step"]), str(d.get("source", spec)))
    raise ValueError(f"unknown acceptance profile {spec!r}: a name ({', '.join(PROFILES)}) "
                     f"or a JSON file")


def simulator(spec, seed: int = 0) -> "Simulator | None":
    """None for None; a Simulator as given; else Simulator(spec, seed)."""
    if spec is None or isinstance(spec, Simulator):
        return spec
    return Simulator(spec, seed)


class Simulator:
    """Seeded draws of accepted drafts per lane from a Profile's conditional rates."""

    def __init__(self, profile: "str | Profile", seed: int = 0):
        self.profile = load(profile)
        self.seed = int(seed)
        self._rates = np.asarray(self.profile.conditional())
        self._rng = np.random.default_rng(self.seed)

    def rate(self, j: int) -> float:
        """c_{j+1}, the last rate repeating past the profile's depth."""
        return float(self._rates[min(j, len(self._rates) - 1)])

    def draw(self, k: int, real_drafts: Sequence[int]) -> list[int]:
        """Accepted drafts for each lane of a depth-k step (lanes holding real_drafts[i] real
        drafts: a draft slot holding nothing is never accepted)."""
        out = []
        for r in real_drafts:
            top, n = min(int(k), int(r)), 0
            while n < top and self._rng.random() < self.rate(n):
                n += 1
            out.append(n)
        return out

    def forced(self, k: int, lanes: Sequence[int], real_drafts: Sequence[int],
               bucket: int) -> np.ndarray:
        """Extras.forced_accept for a step of `bucket` lane slots: the draws at `lanes`
        (-1, off, elsewhere)."""
        f = np.full(bucket, -1, np.int32)
        f[list(lanes)] = self.draw(k, real_drafts)
        return f

    def report(self) -> dict:
        p = self.profile
        return {"profile": p.name, "tokens_per_verify_step": list(p.tokens_per_verify_step),
                "conditional": self.conditional_rounded(), "seed": self.seed,
                "source": p.source}

    def conditional_rounded(self) -> list[float]:
        return [round(x, 4) for x in self.profile.conditional()]
