"""Adaptive draft depth: each step, the depth that maximizes expected tokens per second.

Why: a fixed draft length wastes work when drafts stop being accepted (long context, hard
text, a weak head) and a fixed threshold on the batch size collapses throughput when the batch
crosses it; what a deeper draft costs depends on the device, the lane bucket and the context,
and what it earns depends on the request. So both are measured while the engine runs:

  tokens(d) = sum over the step's lanes of E_d(lane),
      E_d = 1 + sum_{j=1..d} prod_{l<=j} p_l(lane)          (expected tokens emitted)
  cost(d)   = seconds of a depth-d step in this (lane bucket, context bucket), on the
              engine's clock
  depth     = argmax_d tokens(d) / cost(d),  d <= the deepest depth the free pages cover.

- p_l(lane) is the conditional acceptance of draft position l (accepted given drafts 1..l-1
  were): the request's own counts shrunk towards the pooled rate with `prior_strength`
  pseudo-counts, the pooled rate being decayed counts over recent steps of every lane, and a
  position nobody has tried yet borrowing the rate of the position before it.
- cost(d, bucket, ctx) is the lower quartile of the last `window` step times the engine measured
  (wall seconds from launch to the tokens on the host, the first call of each program excluded
  because it compiles). Nothing is a device constant: on a GPU the same clock times the
  GPU's programs. With `Engine(clock=...)` (a cost_model.VirtualClock: the engine runs here
  while time is that of Qwen3.5-27B on an H200) the engine reports each step's modelled
  seconds instead, no call excluded (a price never includes a compile), so the policy
  chooses the depths it would choose on the modelled device, where a depth-1 step costs a
  few percent more than depth 0 at one lane, not what this machine's programs cost.
  On wall time (no clock: the Engine sets `wall`) the cost is the median of the window, and
  a step is a sample only when the steps before and after it ran its depth in consecutive
  iterations: in the overlapped loop a program's time starts when the host saw the previous
  step end (a late look shortens it, and the lower quartile picked exactly those), and the
  host work of the steps around it (committing, planning, the caller's callbacks) shares a
  2-core CPU with it, so an isolated step measures its neighbours as much as itself.
  (`cadence`, a wall clock, prices steps instead by the time between consecutive decode
  results; on this CPU its depth-0 samples came out inflated, so it is off by default.)
  A depth not measured yet in a cell is interpolated along the depth axis of
  the cell (a line through its measured depths, slope >= 0), or scaled from the relative
  slope seen in other cells, or borrowed from the nearest cell; nothing measured: equal costs.
- Exploration is local: until both neighbours (best - 1, best + 1) of the current best depth
  and depth 0 have `explore` measurements in the cell the step runs one of them instead;
  afterwards every `refresh`-th visit of the cell re-measures one (costs drift with the
  context). Depth 0 is always among them: it is the fallback when drafts stop landing, and a
  line fitted through noisy deeper samples must not hide what it costs. Each refresh after
  which no neighbour beats the best by what a switch to it needs doubles the cell's interval
  (up to `refresh_max` visits): a refresh at a worse depth is pure cost. On wall time a
  refresh runs `burst` steps in a row and only a step whose neighbours ran its depth is a
  sample (an interval holds the host work of the steps around it). A switch to a deeper
  depth needs a `hysteresis` gain plus `confidence` x the measured relative spread of the
  step times (StepCosts.spread, over the two depths' sample counts), so a lucky sample on
  a loaded host does not leave the cheap depth; a switch to a shallower one needs no gain
  (one hard direction is what keeps noise from making the depth flap).

A step that carries a prefill chunk (view.chunk > 0: one program per iteration, the chunk
rides in the decode step) is priced apart, per (lane bucket, chunk bucket): its chunk costs
the same at every depth, so it is chosen by what a deeper step adds, not by its tokens per
second, which the chunk's fixed cost would dilute in favour of depth:

  depth = argmax_d tokens(d) - r * mixed_cost(d),  r = the best decode-step rate of the view

(r: what a second spent here would have earned in a decode step). On this CPU a step of 16
lane slots at depth 2 with a 64-token chunk cost ~2.4x the 8-lane decode step, so mixed
steps run shallower there; on the H200 the chunk and the drafts cost little next to the
weights, so they run as deep as decode steps.

A depth-0 step is the stock step (steps.py: no MTP work by default), so a useless MTP head
costs about nothing: acceptance 0 makes every E_d = 1 and the cheapest depth, 0, wins.
Lossless whatever it chooses (tests/test_depth.py forces random depth sequences).
"""

from __future__ import annotations

import collections
import dataclasses
import statistics
from typing import Callable

from mtpjax.engine.scheduler import LaneView, RequestStats, StepView


def context_bucket(context: int, smallest: int = 64) -> int:
    """Powers of two from `smallest`: costs are kept per context bucket."""
    return max(smallest, 1 << max(int(context), 1).bit_length())


class StepCosts:
    """Measured step seconds per (depth, lane bucket, context bucket): a quantile (`quantile`:
    0.25, the lower quartile, by default) over a window of recent steps, cached until the
    cell's next record (the policy reads it every step)."""

    def __init__(self, window: int = 16, quantile: float = 0.25):
        if not 0 <= quantile < 1:
            raise ValueError(f"StepCosts needs 0 <= quantile < 1, got {quantile}")
        self.window = window
        self.quantile = quantile
        self._t: dict[tuple[int, int, int], collections.deque] = {}
        self._q: dict[tuple[int, int, int], float] = {}

    def record(self, depth: int, bucket: int, ctx: int, seconds: float) -> None:
        key = (depth, bucket, ctx)
        self._t.setdefault(key, collections.deque(maxlen=self.window)).append(float(seconds))
        self._q.pop(key, None)

    def count(self, depth: int, bucket: int, ctx: int) -> int:
        return len(self._t.get((depth, bucket, ctx), ()))

    def measured(self, depth: int, bucket: int, ctx: int) -> float | None:
        """The window's `quantile`. The lower quartile (default) is what a program costs when
        nothing else gets in its way (a shared host, a GC pause or a concurrent compile only
        ever add time, so a median lets such noise pick the depth); AdaptiveDepth's wall
        cadence uses the median (what a step costs the run, its host work included)."""
        st = self._stats(depth, bucket, ctx)
        return None if st is None else st[0]

    def _stats(self, depth: int, bucket: int, ctx: int) -> tuple[float, float] | None:
        """(the window's quantile, its relative spread: (q75 - q25) / median / 1.35, a normal
        distribution's sigma over its mean; 0 below 4 samples), cached until a record."""
        key = (depth, bucket, ctx)
        st = self._q.get(key)
        if st is None:
            t = self._t.get(key)
            if not t:
                return None
            ts = sorted(t)
            n = len(ts)
            med = ts[n // 2]
            spread = ((ts[(3 * n) // 4] - ts[n // 4]) / med / 1.35 if n >= 4 and med > 0
                      else 0.0)
            st = self._q[key] = (ts[int(n * self.quantile)], spread)
        return st

    def spread(self, bucket: int, ctx: int, K: int) -> float:
        """The cell's relative step-time noise: the largest spread of its measured depths."""
        return max((st[1] for d in range(K + 1)
                    if (st := self._stats(d, bucket, ctx)) is not None), default=0.0)

    def cells(self) -> set[tuple[int, int]]:
        return {(b, c) for _, b, c in self._t}

    def _line(self, bucket: int, ctx: int, K: int):
        """(intercept, slope) of a least-squares line through the cell's measured depths,
        slope >= 0; None with fewer than two depths."""
        pts = [(d, self.measured(d, bucket, ctx)) for d in range(K + 1)]
        pts = [(d, t) for d, t in pts if t is not None]
        if len(pts) < 2:
            return None
        n = len(pts)
        md = sum(d for d, _ in pts) / n
        mt = sum(t for _, t in pts) / n
        var = sum((d - md) ** 2 for d, _ in pts)
        slope = max(sum((d - md) * (t - mt) for d, t in pts) / var, 0.0)
        return mt - slope * md, slope

    def _relative_slope(self, K: int) -> float:
        """Median over cells with a line of slope / intercept (0 when none: optimistic)."""
        rel = []
        for b, c in self.cells():
            line = self._line(b, c, K)
            if line is not None and line[0] > 0:
                rel.append(line[1] / line[0])
        return statistics.median(rel) if rel else 0.0

    def estimate(self, depth: int, bucket: int, ctx: int, K: int) -> float | None:
        t = self.measured(depth, bucket, ctx)
        if t is not None:
            return t
        line = self._line(bucket, ctx, K)
        if line is not None:
            return line[0] + line[1] * depth
        pts = [(d, self.measured(d, bucket, ctx)) for d in range(K + 1)]
        pts = [(d, t) for d, t in pts if t is not None]
        if pts:
            d0, t0 = pts[0]
            r = self._relative_slope(K)
            return t0 * (1 + r * depth) / (1 + r * d0)
        others = sorted(self.cells(), key=lambda bc: (abs(bc[0] - bucket) / max(bucket, 1),
                                                      abs(bc[1] - ctx) / max(ctx, 1)))
        for b, c in others:
            if (b, c) != (bucket, ctx):
                return self.estimate(depth, b, c, K)
        return None


class PooledAcceptance:
    """Conditional acceptance per draft position over recent steps of all lanes (decayed)."""

    def __init__(self, K: int, decay: float):
        self.decay = decay
        self.accepted = [0.0] * K
        self.tried = [0.0] * K

    def update(self, real_drafts: int, n_accepted: int) -> None:
        for j in range(min(real_drafts, n_accepted + 1)):
            self.tried[j] += 1
            self.accepted[j] += j < n_accepted

    def age(self) -> None:
        self.accepted = [a * self.decay for a in self.accepted]
        self.tried = [t * self.decay for t in self.tried]

    def rates(self, first_prior: float = 0.5) -> list[float]:
        """Per position; an untried position borrows its predecessor's rate (one pseudo-count)."""
        out, prev = [], first_prior
        for a, t in zip(self.accepted, self.tried):
            prev = (a + prev) / (t + 1)
            out.append(prev)
        return out


@dataclasses.dataclass
class AdaptiveDepth:
    """The depth policy of the module docstring (stateful: one per engine)."""
    prior_strength: float = 4.0   # pooled pseudo-counts in a request's own acceptance estimate
    decay: float = 0.99           # pooled acceptance counts' decay per step
    window: int = 16              # step times kept per (depth, bucket, context bucket)
    explore: int = 2              # measurements each neighbour of the best depth gets first
    refresh: int = 50             # then every refresh-th visit of a cell re-measures one
    hysteresis: float = 0.03      # relative gain a switch away from the last depth needs
    min_context: int = 256        # smallest context bucket: below it the KV a step reads is
                                  # small next to its weights, so short contexts share a cell
                                  # (and are explored once, not once per 64 tokens)
    context_offset: int = 0       # tokens before every lane's context that the engine's
                                  # clock prices but the engine does not run (a long context
                                  # on the H200 clock, cost_model.VirtualClock): cells follow
                                  # the priced context
    confidence: float = 2.5       # a switch to a deeper depth needs a gain above hysteresis
                                  # + confidence x the relative noise of the two costs
                                  # (StepCosts.spread, over their sample counts): on a loaded
                                  # host a lucky sample of a deeper step must not win
    burst: int = 3                # on wall time a refresh runs its depth this
                                  # many steps in a row, and a step next to one of another
                                  # depth (before or after it) is no sample: its interval
                                  # holds the other depth's host work (committing the one
                                  # before, planning and launching the one after), so an
                                  # isolated deep step among shallow ones looks cheaper,
                                  # and an isolated depth-0 step among deep ones dearer,
                                  # than either runs; the burst's middle is what it costs
    refresh_max: int = 800        # a refresh after which no neighbour could win doubles
                                  # the cell's refresh interval, up to this many visits
    cadence: Callable[[], float] | None = None
                                  # a wall clock (seconds): a step's cost is then the time
                                  # on it between the results of consecutive decode steps
                                  # (its share of the run's wall time: host work and its
                                  # contention with the device included), the window's
                                  # median; None: the seconds the engine reports (its
                                  # program's time, or a VirtualClock's price)
    wall: bool = False            # the engine's seconds are wall time (the Engine sets it,
                                  # engine_clock): median of the window, samples only from
                                  # steps between steps of their depth, refresh bursts

    def __post_init__(self):
        if self.prior_strength <= 0 or not 0 < self.decay <= 1 or self.window < 1:
            raise ValueError("AdaptiveDepth needs prior_strength > 0, 0 < decay <= 1, "
                             f"window >= 1; got {self}")
        if (self.explore < 0 or self.refresh < 1 or self.hysteresis < 0 or self.min_context < 1
                or self.context_offset < 0 or self.refresh_max < self.refresh
                or self.confidence < 0 or self.burst < 1):
            raise ValueError("AdaptiveDepth needs explore >= 0, refresh >= 1, "
                             f"hysteresis >= 0, min_context >= 1, context_offset >= 0, "
                             f"refresh_max >= refresh, confidence >= 0, burst >= 1; "
                             f"got {self}")
        self._new_tables()
        self.pooled: PooledAcceptance | None = None
        self.visits: collections.Counter = collections.Counter()
        self.chosen: collections.Counter = collections.Counter()
        self.last = None
        self.last_mixed = None
        self.gap: dict = {}            # per cell: visits between refreshes (refresh.. max)
        self.since: collections.Counter = collections.Counter()   # visits since a refresh
        self.refreshes: collections.Counter = collections.Counter()
        self.bursts: dict = {}         # per cell: [depth, steps left] of a running refresh
        self.best_at: dict = {}        # per cell: the best depth when it last refreshed
        self._prev = None              # cadence: (scheduler step, time, depth) of the last result
        self._picked = None            # the depth of the last step planned

    def _new_tables(self) -> None:
        q = 0.5 if self.wall or self.cadence is not None else 0.25
        self.costs = StepCosts(self.window, q)
        self.mixed_costs = StepCosts(self.window, q)   # steps carrying a chunk, by chunk bucket

    def engine_clock(self, clock) -> None:
        """Called by the Engine with its VirtualClock (None: wall time). On wall time the
        policy's samples are wall seconds (`wall`); with a VirtualClock it uses the modelled
        seconds the engine reports as before (lower quartile, every step a sample)."""
        if clock is None and not self.wall:
            self.wall = True
            self._new_tables()

    def _context(self, view: StepView) -> int:
        """The step's context bucket: its deepest lane's context, plus context_offset."""
        return context_bucket(view.context + self.context_offset, self.min_context)

    # ---------------------------------------------------------------- estimates
    def _rates(self, lane, pooled: list[float]) -> list[float]:
        s = self.prior_strength
        acc = lane.stats.accepted_per_position or [0] * len(pooled)
        tried = lane.stats.tried_per_position or [0] * len(pooled)
        return [(a + s * p) / (t + s) for a, t, p in zip(acc, tried, pooled)]

    def expected_tokens(self, view: StepView) -> list[float]:
        """Expected tokens the step emits at each depth 0..K (summed over its lanes)."""
        pooled = self._pool(view.K).rates()
        out = [0.0] * (view.K + 1)
        for lane in view.lanes:
            e, run = 1.0, 1.0
            out[0] += e
            for d, p in enumerate(self._rates(lane, pooled), start=1):
                run *= p
                e += run
                out[d] += e
        return out

    def throughput(self, view: StepView) -> list[float | None]:
        """Estimated tokens per second at each depth (None: no cost known anywhere)."""
        ctx = self._context(view)
        toks = self.expected_tokens(view)
        out = []
        for d in range(view.K + 1):
            c = self.costs.estimate(d, view.bucket, ctx, view.K)
            out.append(None if c is None else toks[d] / max(c, 1e-9))
        return out

    def _pool(self, K: int) -> PooledAcceptance:
        if self.pooled is None or len(self.pooled.tried) != K:
            self.pooled = PooledAcceptance(K, self.decay)
        return self.pooled

    def _mixed_cell(self, view: StepView) -> tuple[int, int]:
        """A chunk-carrying step's cost cell: (lane bucket, chunk tokens as the program carries
        them, rows x ride bucket: powers of two)."""
        return view.bucket, context_bucket(view.chunk, 16)

    def mixed_values(self, view: StepView) -> list[float | None] | None:
        """For a step carrying a chunk: tokens(d) - r * mixed_cost(d) at each depth (None where
        no cost is known), r the best decode rate of the view; None when r is unknown."""
        rates = [r for r in self.throughput(view) if r is not None]
        if not rates:
            return None
        r = max(rates)
        toks = self.expected_tokens(view)
        out = []
        for d in range(view.K + 1):
            c = self.mixed_costs.estimate(d, *self._mixed_cell(view), view.K)
            out.append(None if c is None else toks[d] - r * c)
        return out

    # ---------------------------------------------------------------- the policy
    def __call__(self, view: StepView) -> int:
        top = max(min(view.K, view.max_depth), 0)
        if top == 0:
            return 0
        if view.chunk > 0:
            values = self.mixed_values(view)
            if values is not None and any(v is not None for v in values[:top + 1]):
                return self._choose(values[:top + 1], top, self.mixed_costs,
                                    ("mixed",) + self._mixed_cell(view), mixed=True)
        cell = (view.bucket, self._context(view))
        rate = self.throughput(view)[:top + 1]
        if all(r is None for r in rate):       # nothing measured yet: equal costs
            toks = self.expected_tokens(view)[:top + 1]
            rate = [t / 1.0 for t in toks]
        return self._choose(rate, top, self.costs, cell)

    def _choose(self, score, top: int, costs: StepCosts, cell, mixed: bool = False) -> int:
        """The best-scoring depth (ties: the shallower) with hysteresis against the last
        choice of its kind (decode or mixed), then local exploration."""
        self.visits[cell] += 1
        floor = min((v for v in score if v is not None), default=0.0)
        score = [v if v is not None else floor - 1.0 for v in score]
        best = max(range(top + 1), key=lambda d: (score[d], -d))
        last = self.last_mixed if mixed else self.last
        last = last if last is not None and last <= top else None
        where = cell[1:] if mixed else cell
        noise = self._noise(costs, where, top)
        if last is not None and best > last:
            # deeper needs a gain above hysteresis and the noise; shallower needs none (a
            # tie goes to the cheaper step, the stock step at depth 0, and one direction
            # being hard is what keeps noise from making the depth flap)
            rel = self.hysteresis + noise(best, last)
            if score[best] <= score[last] + rel * abs(score[last]):
                best = last
        pick = self._explore(best, top, costs, cell, score, noise)
        if mixed:
            self.last_mixed = best
        else:
            self.last = best
        self.chosen[pick] += 1
        self._picked = pick
        return pick

    def _noise(self, costs: StepCosts, where, top: int):
        """noise(a, b): confidence x the cell's relative step-time spread over the sample
        counts of depths a and b: the relative gain a switch between them needs on top of
        hysteresis before it is believed (0 with a noise-free clock)."""
        spread = self.confidence * costs.spread(*where, top)
        n = lambda d: max(costs.count(d, *where), 1)
        return lambda a, b: spread * (1 / n(a) + 1 / n(b)) ** 0.5 if spread else 0.0

    def _explore(self, best: int, top: int, costs: StepCosts, cell, score=None,
                 noise=None) -> int:
        """The neighbours of the best depth, and depth 0 (the fallback that must be known: a
        line through noisy deeper samples can hide how cheap it is), get `explore` samples in
        each cell first, then one every `refresh` visits in turn (bursts of `burst` steps on
        wall time); the interval doubles (up to refresh_max) while no neighbour beats the
        best depth by what a switch to it needs."""
        where = cell[1:] if cell[0] == "mixed" else cell
        run = self.bursts.get(cell)
        if run is not None and run[1] > 0 and run[0] <= top:
            run[1] -= 1
            return run[0]
        cand = [d for d in dict.fromkeys((best + 1, best - 1, 0)) if 0 <= d <= top and d != best]
        for d in cand:
            if costs.count(d, *where) < self.explore:
                return d
        if not cand:
            return best
        self.since[cell] += 1
        gap = self.gap.get(cell, self.refresh)
        if self.since[cell] < gap:
            return best
        # a refresh: when the best depth is the one the last refresh saw and every
        # neighbour scores below it by more than hysteresis, the next refresh waits twice as
        # long (a refresh step at a worse depth is pure cost; at one lane on a 2-core CPU a
        # depth-1 step costs ~1.9x a depth-0 one); a close call keeps the base interval
        clear = score is None or all(
            score[d] <= score[best] + (self.hysteresis + (noise(d, best) if d > best else 0.0))
            * abs(score[best]) for d in cand)
        stable = self.best_at.get(cell) == best and clear
        self.gap[cell] = min(2 * gap, self.refresh_max) if stable else self.refresh
        self.best_at[cell] = best
        self.since[cell] = 0
        self.refreshes[cell] += 1
        pick = cand[(self.refreshes[cell] - 1) % len(cand)]
        on_wall = self.wall or self.cadence is not None
        self.bursts[cell] = [pick, (self.burst if on_wall else 1) - 1]
        return pick

    def observe(self, view: StepView, depth: int, seconds: float, accepted, compiled: bool):
        """What the engine measured for the step it ran with `view`: its depth, seconds on the
        engine's clock (wall, or modelled with a VirtualClock), the lanes' accepted drafts
        (in view.lanes order) and whether the call compiled (its seconds are then no step
        cost)."""
        if self.wall or self.cadence is not None:
            # a sample only between steps of its depth in consecutive iterations (no
            # prefill-only iteration, new session or idle time in between; the overlapped
            # loop planned the next step before this one's result, so that one too, see
            # `burst`); with `cadence` the sample is the wall time since the previous result
            now = self.cadence() if self.cadence is not None else 0.0
            prev, self._prev = self._prev, (view.step, now, depth)
            ok = (prev is not None and view.step == prev[0] + 1 and prev[2] == depth
                  and self._picked in (None, depth))
            if self.cadence is not None:
                seconds = now - prev[1] if ok else None
            elif not ok:
                seconds = None
        if seconds is None or compiled:
            pass
        elif view.chunk > 0:
            self.mixed_costs.record(depth, *self._mixed_cell(view), seconds)
        else:
            self.costs.record(depth, view.bucket, self._context(view),
                              seconds)
        pool = self._pool(view.K)
        pool.age()
        if depth:
            for lane, n in zip(view.lanes, accepted):
                pool.update(min(depth, lane.drafts), int(n))

    def report(self) -> dict:
        """Depths chosen so far, pooled acceptance, and the cost table (ms) for cards."""
        return {"chosen": dict(sorted(self.chosen.items())),
                "pooled_acceptance": [] if self.pooled is None else self.pooled.rates(),
                "costs_ms": {f"d{d}/b{b}/c{c}": round(1e3 * self.costs.measured(d, b, c), 3)
                             for d, b, c in sorted(self.costs._t)},
                "mixed_costs_ms": {f"d{d}/b{b}/t{t}": round(1e3 * self.mixed_costs.measured(
                    d, b, t), 3) for d, b, t in sorted(self.mixed_costs._t)}}


def predict(step_seconds, acceptance, lanes: int = 1) -> tuple[int, list[float]]:
    """What AdaptiveDepth would choose once it has measured `step_seconds[d]` for every depth
    d = 0..K at one (lane bucket, context) and pooled `acceptance[j]`, the share of verify steps
    that accept draft j+1 (unconditional, non-increasing): for predictions from a cost model
    such as the deviceless H200 audit (`python -m experiments aot --depths=...`).
    Returns (depth, estimated tokens per second at each depth)."""
    K = len(step_seconds) - 1
    if len(acceptance) < K:
        raise ValueError(f"{K + 1} step times need acceptance for {K} draft positions, "
                         f"got {len(acceptance)}")
    policy = AdaptiveDepth(explore=0, hysteresis=0.0)
    pool = policy._pool(K)
    prev = 1.0
    for j, a in enumerate(acceptance[:K]):
        if not 0 <= a <= prev:
            raise ValueError(f"acceptance must be non-increasing in [0, 1], got {acceptance}")
        pool.tried[j], pool.accepted[j] = 1e6 * prev, 1e6 * a    # conditional a / prev
        prev = a
    view = StepView(K, K, tuple(LaneView(i, 0, K, RequestStats.for_depth(K))
                                for i in range(lanes)), lanes, 0)
    for d, t in enumerate(step_seconds):
        policy.costs.record(d, view.bucket, context_bucket(0, policy.min_context), t)
    rates = policy.throughput(view)
    return max(range(K + 1), key=lambda d: (rates[d], -d)), rates

