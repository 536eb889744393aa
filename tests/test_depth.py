"""Draft depth per step (0..K): lossless under any depth sequence (depth-0 steps bare or
filling the MTP KV), the depth-0 MTP KV fill is exact, and the adaptive policy converges where
its cost and acceptance say it should.

Engine tests use the VOCAB11 random model (drafts land often enough that accept, rollback
and redraft run at every depth); policy tests drive `depth.AdaptiveDepth` with synthetic
step views and costs (pure host code, no device).
"""

import dataclasses
import random
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mtpjax
from mtpjax import model, steps
from mtpjax.cost_model import VirtualClock
from mtpjax.engine.depth import AdaptiveDepth, StepCosts, context_bucket
from mtpjax.sampling import SamplingParams
from mtpjax.engine.scheduler import LaneView, RequestStats, StepView

from tiny_models import VOCAB11_CFG as CFG, VOCAB11_PARAMS as PARAMS

K = 3
RNG = np.random.default_rng(5)
PROMPTS = [list(map(int, RNG.integers(0, 11, n))) for n in (3, 21, 9, 40, 1, 14)]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=28)
SAMPLED = [SamplingParams(temperature=t, top_k=tk, top_p=tp, seed=s, max_new_tokens=28)
           for t, tk, tp, s in ((1.0, 0, 1.0, 3), (0.7, 5, 0.9, 8), (1.3, 0, 0.8, 1),
                                (1.0, 4, 1.0, 21), (0.9, 0, 1.0, 5), (1.1, 6, 0.95, 2))]


class RandomDepth:
    """Forced random depths (seeded), capped by nothing: deeper than the lane's drafts too."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        self.seen = set()

    def __call__(self, view: StepView) -> int:
        d = self.rng.randint(0, view.K)
        self.seen.add(d)
        return d


def _engine(k, policy=None, **kw):
    """Every K-draft engine here has the same shapes (8-token pages: a deep step's block often
    crosses a page), so the tests share their compiled programs."""
    return mtpjax.Engine(CFG, PARAMS, num_speculative_tokens=k, max_lanes=4, max_seq_len=96,
                         prefill_chunk=16, speculation_policy=policy, page_size=8, **kw)


@pytest.fixture(scope="module")
def plain():
    # the reference: one lane bucket and one ride bucket, the fewest programs (the
    # speculative engines run every bucket and must give these tokens)
    e = _engine(0, lane_buckets=[4], ride_buckets=[16])
    return e.generate(PROMPTS, GREEDY), e.generate(PROMPTS, SAMPLED)


@pytest.mark.parametrize("seed, fill", [(0, False), (1, True)])
def test_random_depth_sequences_equal_plain_greedy_and_sampled(plain, seed, fill):
    """Depth-0 steps as the stock step (MTP KV holes) or filling the MTP KV: both exact."""
    greedy, sampled = plain
    policy = RandomDepth(seed)
    # fill_mtp_kv is a static argument of every decode program, so the filling engine
    # compiles a program set of its own: one lane bucket and one ride bucket for it (what it
    # checks, the depth-0 fill and the deeper steps reading it, runs alike at every bucket;
    # the other case runs every bucket)
    buckets = dict(lane_buckets=[4], ride_buckets=[16]) if fill else {}
    e = _engine(K, policy, depth0_fills_mtp_kv=fill, **buckets)
    outs = []
    for ref, sp in ((greedy, GREEDY), (sampled, SAMPLED)):
        outs += e.generate(PROMPTS, sp)
        for a, b in zip(ref, outs[-len(ref):]):
            assert b.error is None and b.token_ids == a.token_ids
    assert policy.seen == set(range(K + 1))
    steps = e.stats()["depth_steps"]
    assert all(n > 0 for n in steps), steps
    assert sum(steps) == e.stats()["steps"]
    # drafts were accepted, and counted only over real drafts
    acc = np.sum([o.stats.accepted_per_position for o in outs], axis=0)
    tried = np.sum([o.stats.tried_per_position for o in outs], axis=0)
    assert acc[0] > 0 and (acc <= tried).all(), (acc, tried)


@pytest.mark.parametrize("sampled", [False, True])
def test_random_depths_with_oracle_drafts_accepted_deep(plain, monkeypatch, sampled):
    """A random model's drafts rarely land past position 1, so here the drafts are replaced
    before every step by the plain engine's own next tokens, a few of them corrupted: steps
    accept 0..d drafts at every depth d, the GDN replays up to K + 1 pending tokens after
    a deep step and then runs a shallower block, and the output must not change."""
    ref = plain[1 if sampled else 0]
    params = SAMPLED if sampled else [GREEDY] * len(PROMPTS)
    rng = random.Random(7)
    real = steps.decode_step

    def oracle_drafts(cfg, prm, cache, state, lanes, active, table, join, *chunk, **kw):
        seq = PROMPTS[i] + ref[i].token_ids
        (lane,) = np.flatnonzero(np.asarray(active))      # one request at a time
        if bool(join.mask[lane]):                         # its first step: drafts are reset
            return real(cfg, prm, cache, state, lanes, active, table, join, *chunk, **kw)
        P = int(state.pos[lane])
        d = [seq[P + 1 + j] if P + 1 + j < len(seq) and rng.random() > 0.15 else 10 - j
             for j in range(K)]
        state = dataclasses.replace(state, drafts=state.drafts.at[lane].set(
            jnp.asarray(d, jnp.int32)))
        return real(cfg, prm, cache, state, lanes, active, table, join, *chunk, **kw)

    monkeypatch.setattr(steps, "decode_step", oracle_drafts)
    e = _engine(K, RandomDepth(3))   # the other tests' programs (one busy lane: bucket 1)
    acc = np.zeros(K, int)
    for i in range(len(PROMPTS)):
        out = e.generate([PROMPTS[i]], params[i])[0]
        assert out.token_ids == ref[i].token_ids, i
        acc += out.stats.accepted_per_position
    assert (acc > 0).all(), acc


def test_adaptive_engine_equals_plain_and_warmup_compiles_every_depth(plain):
    greedy, sampled = plain
    e = _engine(K, "adaptive")
    n = e.warmup()
    # depths 0..K x lane buckets 1, 2, 4; depths 0..K with a prefill chunk riding (one
    # program per depth and ride bucket, over every lane slot); a prefill per chunk bucket;
    # lane move; snapshots
    # packed prefill: the mixed programs again at prefill_rows rows, and one prefill
    assert n == ((K + 1) * 3 + (K + 1) * len(e.ride_buckets) + len(e.chunk_buckets) + 1
                 + 2 * (e.prefix is not None) + ((K + 1) * len(e.ride_buckets) + 1)
                 * (e.prefill_rows > 1))
    assert e.warmup() == 0
    for ref, sp in ((greedy, GREEDY), (sampled, SAMPLED)):
        for a, b in zip(ref, e.generate(PROMPTS, sp)):
            assert b.token_ids == a.token_ids
    s = e.stats()
    assert s["policy"] == "AdaptiveDepth" and s["free_pages"] == s["total_pages"]
    assert {key for key in s["programs"] if key[0] == "decode"} == {
        ("decode", d, nb) for d in range(K + 1) for nb in (1, 2, 4)}   # nothing new compiled
    rep = e.policy.report()
    assert sum(rep["chosen"].values()) == sum(s["depth_steps"]) and rep["costs_ms"]


class _PricedModel:
    """A stand-in cost model for an engine's VirtualClock: every program costs 1 ms, a decode
    step at depth d costs 1 ms x (1 + slope x d). The adaptive policy must learn from these
    prices, not from this CPU's wall time."""

    def __init__(self, slope: float, k: int = K, page_size: int = 8):
        self.slope, self.K, self.page_size = slope, k, page_size

    def program(self, key, contexts=(), start=0, is_last=True):
        depth = key[1] if key[0] in ("decode", "mixed") else 0
        return types.SimpleNamespace(seconds=1e-3 * (1 + self.slope * depth))


@pytest.mark.parametrize("slope", [20.0, 0.0])
def test_adaptive_policy_learns_from_the_engines_clock(plain, slope):
    """With a clock, the engine hands the policy the modelled seconds of each step: where a
    draft costs 20 steps (no acceptance pays that) it stays at depth 0 but for exploring;
    where drafting is free (this model's drafts land often) it runs the deepest depth. On
    this CPU's wall clock both runs would see the same costs and choose alike. The tokens
    do not change (the clock changes time only)."""
    clock = VirtualClock(_PricedModel(slope))
    e = _engine(K, "adaptive", clock=clock)
    for a, b in zip(plain[0], e.generate(PROMPTS, GREEDY)):
        assert b.token_ids == a.token_ids
    steps = e.depth_steps
    n = sum(steps)
    assert n == e.timing["steps"] == clock.launches["decode"] + clock.launches["mixed"] > 0
    if slope:
        # exploration: each cell (lane bucket x context, and each ride bucket of a step
        # carrying a chunk) measures the neighbours of its best depth `explore` times
        assert steps[0] >= 0.6 * n, steps
    else:
        assert steps[K] >= 0.6 * n, steps
    costs = e.policy.report()["costs_ms"]      # what it learned: the clock's prices exactly
    assert costs and all(ms == pytest.approx(1 + slope * int(key.split("/")[0][1:]))
                         for key, ms in costs.items()), costs


def test_bad_policy_values_are_refused():
    with pytest.raises(ValueError, match="speculation_policy must be"):
        _engine(K, "sometimes")
    e = _engine(K, lambda view: K + 1)
    out = None
    with pytest.raises(ValueError, match="must return a depth in 0..3"):
        out = e.generate(PROMPTS[:1], GREEDY)
    assert out is None and e.stats()["free_pages"] == e.stats()["total_pages"]


# ------------------------------------------------------------------------- model level

def test_mtp_kv_fill_writes_what_the_mtp_forward_writes():
    """The depth-0 step writes the MTP KV with fc + the KV projection only: the entries must
    equal those of the full MTP layer, at the right pages, and nothing else may change."""
    r = np.random.default_rng(2)
    num_pages, page = 10, 4
    cache = model.init_paged_cache(CFG, 2, num_pages, page, K + 1)
    cache = model.map_kv(cache, lambda kv: model.PagedKV(jnp.full_like(kv.k, jnp.nan),
                                                         jnp.full_like(kv.v, jnp.nan),
                                                         kv.page_size))
    table = jnp.asarray(r.permutation(num_pages)[:8].reshape(2, 4), jnp.int32)
    h = jnp.asarray(r.normal(size=(2, 3, CFG.hidden_size)), jnp.float32)
    nt = jnp.asarray(r.integers(0, 11, (2, 3)), jnp.int32)
    seg = model.Segment(jnp.asarray([5, 0], jnp.int32), jnp.asarray([3, 2], jnp.int32), table)
    _, full = model.mtp_forward(CFG, PARAMS, cache, h, nt, seg)
    fill = model.mtp_fill_kv(CFG, PARAMS, cache, h, nt, seg)
    for a, b in ((full.mtp.k, fill.mtp.k), (full.mtp.v, fill.mtp.v)):
        a, b = np.asarray(a), np.asarray(b)
        np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-6, equal_nan=True)
        assert np.isfinite(b).sum() == 2 * (3 + 2) * b.shape[-1]   # NKV heads x 5 rows
    for x, y in zip(jax.tree.leaves(full.layers), jax.tree.leaves(fill.layers)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# ------------------------------------------------------------------------- the policy

def _view(lanes, max_depth=K, bucket=1, pos=100, stats=None, k=K):
    st = stats or RequestStats.for_depth(k)
    return StepView(k, max_depth, tuple(LaneView(i, pos, k, st) for i in range(lanes)), bucket,
                    0)


def _drive(policy, accept, cost, steps=400, lanes=1, max_depth=K, k=K):
    """Run the policy against a synthetic device: cost(d) seconds per step, and each lane's
    draft j accepted with probability accept[j] given the earlier ones (seeded)."""
    rng = random.Random(0)
    stats = RequestStats.for_depth(k)
    picks = []
    for _ in range(steps):
        view = _view(lanes, min(max_depth, k), stats=stats, k=k)
        d = policy(view)
        assert 0 <= d <= min(k, max_depth)
        acc = []
        for _ in range(lanes):
            n = 0
            while n < d and rng.random() < accept[n]:
                n += 1
            acc.append(n)
            for j in range(min(d, n + 1)):
                stats.tried_per_position[j] += 1
                stats.accepted_per_position[j] += j < n
        policy.observe(view, d, cost(d), acc, False)
        picks.append(d)
    return picks


def _drive_mixed(policy, accept, cost, mixed_cost, steps=600, lanes=8, every=4, waiting=0):
    """_drive with every `every`-th step carrying a 48-token prefill chunk that costs
    mixed_cost(d) at depth d, `waiting` requests awaiting their first token beside it.
    Returns (decode picks, mixed picks)."""
    rng = random.Random(0)
    stats = RequestStats.for_depth(K)
    picks = {False: [], True: []}
    for i in range(steps):
        chunk = 48 if i % every == 0 else 0
        view = StepView(K, K, tuple(LaneView(j, 100, K, stats) for j in range(lanes)), lanes,
                        i, chunk, waiting=waiting if chunk else 0)
        d = policy(view)
        acc = []
        for _ in range(lanes):
            n = 0
            while n < d and rng.random() < accept[n]:
                n += 1
            acc.append(n)
            for j in range(min(d, n + 1)):
                stats.tried_per_position[j] += 1
                stats.accepted_per_position[j] += j < n
        policy.observe(view, d, (mixed_cost if chunk else cost)(d), acc, False)
        picks[bool(chunk)].append(d)
    return picks[False], picks[True]


def test_steps_carrying_a_chunk_are_priced_apart_by_what_depth_adds():
    """A chunk's cost is the same at every depth, so a mixed step is chosen by tokens(d) -
    r x cost(d) (r: the decode rate), not by its tokens per second. Decode: accept 0.9 and
    cost 1 + 0.3 d favour depth 1 (as above). Mixed steps where each depth adds 4 s next to
    a 10 s chunk: a rate rule would run them at depth 1 ((1 + 0.9) / 14 > 1 / 10 per lane:
    the chunk dilutes the cost), the marginal rule at depth 0 (0.9 tokens for 4 s, where a
    decode step earns 1.46 per s); mixed steps whose depth costs what a decode step's does follow the
    decode depth."""
    accept = [0.9, 0.2, 0.1]
    decode = lambda d: 1.0 + 0.3 * d
    dec, mix = _drive_mixed(AdaptiveDepth(), accept, decode, lambda d: 10.0 + 4.0 * d)
    assert dec[-200:].count(1) >= 190
    assert mix[-40:].count(0) >= 38
    dec, mix = _drive_mixed(AdaptiveDepth(), accept, decode, lambda d: 10.0 + 0.3 * d)
    assert dec[-200:].count(1) >= 190 and mix[-40:].count(1) >= 38
    rep = AdaptiveDepth()
    _drive_mixed(rep, accept, decode, lambda d: 10.0 + 4.0 * d, steps=40)
    assert rep.report()["mixed_costs_ms"] and all(k.endswith("/t64")
                                                  for k in rep.report()["mixed_costs_ms"])


def test_steps_delaying_first_tokens_run_shallower():
    """A request awaiting its first token earns nothing from a mixed step's drafts but waits
    as long as the step runs: each of its seconds is priced as a decoding lane's (r / L).
    Decode as above (depth 1, r = 11.7 tokens/s over 8 lanes); mixed steps where a depth
    adds 0.4 s to a 10 s chunk: with nobody waiting depth 1 gains 7.2 tokens for 4.7 tokens'
    worth of time; with 16 requests waiting beside the 8 lanes that time is worth 3x, 14 tokens,
    and the step runs at depth 0."""
    accept = [0.9, 0.2, 0.1]
    decode = lambda d: 1.0 + 0.3 * d
    mixed = lambda d: 10.0 + 0.4 * d
    one = lambda: AdaptiveDepth(wait_weight=1.0)
    _, mix = _drive_mixed(one(), accept, decode, mixed)
    assert mix[-40:].count(1) >= 38
    _, mix = _drive_mixed(one(), accept, decode, mixed, waiting=16)
    assert mix[-40:].count(0) >= 38
    # wait_weight prices a waiting request's second at that many decode-lane seconds: at 8,
    # two requests waiting beside the 8 lanes weigh as much as the 16 above (1 + 8 x 2 / 8 = 3
    # = 1 + 16 / 8); at 1 they do not; the default (4) weighs them 2x, 9.4 tokens' worth
    _, mix = _drive_mixed(one(), accept, decode, mixed, waiting=2)
    assert mix[-40:].count(1) >= 38
    _, mix = _drive_mixed(AdaptiveDepth(), accept, decode, mixed, waiting=2)
    assert mix[-40:].count(0) >= 38
    _, mix = _drive_mixed(AdaptiveDepth(wait_weight=8.0), accept, decode, mixed, waiting=2)
    assert mix[-40:].count(0) >= 38


def test_useless_head_settles_on_depth_zero():
    picks = _drive(AdaptiveDepth(), accept=[0.0] * K, cost=lambda d: 1.0 + 0.2 * d)
    assert picks[-200:].count(0) >= 190


def test_perfect_head_with_flat_cost_goes_deepest():
    picks = _drive(AdaptiveDepth(), accept=[1.0] * K, cost=lambda d: 1.0 + 0.01 * d)
    assert picks[-200:].count(K) >= 190


def test_middle_depth_when_acceptance_falls_along_the_draft():
    # E_1 = 1.9, E_2 = 2.08, E_3 = 2.098; cost 1 + 0.3 d: rates 1.46, 1.30, 1.10 -> depth 1
    picks = _drive(AdaptiveDepth(), accept=[0.9, 0.2, 0.1], cost=lambda d: 1.0 + 0.3 * d)
    assert picks[-200:].count(1) >= 190


def test_pages_cap_the_depth():
    picks = _drive(AdaptiveDepth(), accept=[1.0] * K, cost=lambda d: 1.0, max_depth=1)
    assert set(picks) <= {0, 1} and picks[-100:].count(1) >= 95


def test_step_costs_interpolate_along_depth_and_borrow_between_cells():
    c = StepCosts(window=4)
    assert c.estimate(1, 1, 64, K) is None
    for t in (1.3, 1.0, 5.0):        # lower quartile 1.0: one-sided noise is ignored
        c.record(0, 1, 64, t)
    c.record(2, 1, 64, 2.0)
    assert c.measured(0, 1, 64) == 1.0
    assert c.estimate(1, 1, 64, K) == pytest.approx(1.5)          # the line through d=0, 2
    assert c.estimate(3, 1, 64, K) == pytest.approx(2.5)
    c.record(1, 8, 64, 4.0)                                       # one depth in another cell:
    assert c.estimate(3, 8, 64, K) == pytest.approx(4.0 * 2.5 / 1.5)   # the relative slope
    assert c.estimate(2, 2, 128, K) == pytest.approx(2.0)         # nearest cell borrowed
    assert context_bucket(100) == 128 and context_bucket(3) == 64


def test_per_request_acceptance_separates_lanes():
    """A lane whose own drafts keep failing expects fewer tokens than the pooled rate."""
    pol = AdaptiveDepth()
    good, bad = RequestStats.for_depth(K), RequestStats.for_depth(K)
    good.tried_per_position, good.accepted_per_position = [50, 45, 40], [45, 40, 35]
    bad.tried_per_position, bad.accepted_per_position = [50, 1, 0], [1, 0, 0]
    view = lambda st: StepView(K, K, (LaneView(0, 10, K, st),), 1, 0)
    e_good, e_bad = pol.expected_tokens(view(good)), pol.expected_tokens(view(bad))
    assert e_good[0] == e_bad[0] == 1.0
    assert e_good[K] > 2.5 and e_bad[K] < 1.2


def test_policy_arguments_are_checked():
    for bad in (dict(prior_strength=0), dict(decay=0), dict(window=0), dict(explore=-1),
                dict(refresh=0), dict(hysteresis=-0.1), dict(wait_weight=-1.0),
                dict(sample_every=0)):
        with pytest.raises(ValueError, match="AdaptiveDepth needs"):
            AdaptiveDepth(**bad)


def test_predict_matches_the_expected_token_arithmetic():
    """predict() runs the policy on given step times and pooled acceptance: with acceptance
    a_j (share of verify steps accepting draft j), E_d = 1 + a_1 + ... + a_d per lane."""
    from mtpjax.engine.depth import predict
    acc = [0.9, 0.7, 0.4, 0.1]
    times = [1.0, 1.1, 1.2, 1.3, 1.4]
    depth, rates = predict(times, acc, lanes=2)
    want = [2 * (1 + sum(acc[:d])) / t for d, t in enumerate(times)]
    assert rates == pytest.approx(want, rel=1e-5)
    assert depth == int(np.argmax(want)) == 3
    assert predict([1.0, 2.0], [0.5])[0] == 0            # doubling the step for 0.5 tokens
    with pytest.raises(ValueError, match="non-increasing"):
        predict(times, [0.5, 0.7, 0.1, 0.0])


def test_fixed_policy_depth_and_page_cap():
    from mtpjax.engine.scheduler import SpeculationPolicy
    view = lambda max_depth, lanes=1: StepView(K, max_depth, tuple(
        LaneView(i, 5, K, RequestStats.for_depth(K)) for i in range(lanes)), 1, 0)
    assert SpeculationPolicy()(view(K)) == K
    assert SpeculationPolicy(depth=2)(view(K)) == 2
    assert SpeculationPolicy(depth=2)(view(1)) == 1          # the pages cap it
    assert SpeculationPolicy(depth=9)(view(K)) == K
    assert SpeculationPolicy(max_busy_lanes=1)(view(K, lanes=2)) == 0
    with pytest.raises(ValueError, match="depth must be >= 0"):
        SpeculationPolicy(depth=-1)


def test_useless_head_finds_depth_zero_despite_misleading_early_samples():
    """K = 2 and the first samples of depth 1 come from a loaded host (5x its cost): the line
    through them and depth 2 has slope 0 and hides how cheap depth 0 is; with exploration
    limited to the best depth's neighbours the policy sat at depth 2 until a refresh. Depth 0
    is always measured, so a useless head settles there within a few steps."""
    seen = {}

    def cost(d):
        seen[d] = seen.get(d, 0) + 1
        return 5.0 if d == 1 and seen[d] <= 2 else 1.0 + 0.2 * d

    pol = AdaptiveDepth()
    picks = _drive(pol, accept=[0.0] * 2, cost=cost, steps=60, k=2)
    assert picks[15:45].count(0) >= 27, (picks, pol.report())


class _CellRecorder(AdaptiveDepth):
    """AdaptiveDepth that records the cell of every decision and of every measurement."""

    def __post_init__(self):
        super().__post_init__()
        self.decided, self.observed = [], []

    def __call__(self, view):
        self.decided.append((view.bucket, view.chunk))
        return super().__call__(view)

    def observe(self, view, depth, seconds, accepted, compiled):
        self.observed.append((view.bucket, view.chunk, depth, seconds))
        return super().observe(view, depth, seconds, accepted, compiled)


class _KeyedModel(_PricedModel):
    """_PricedModel that keeps the keys of the decode and mixed programs it priced."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.keys = []

    def program(self, key, contexts=(), start=0, is_last=True):
        if key[0] in ("decode", "mixed"):
            self.keys.append(key)
        return super().program(key, contexts, start, is_last)


def test_policy_decides_and_learns_in_the_cell_of_the_program_that_ran(plain):
    """Issue 37 item 5: a step carrying a prefill chunk was chosen in one cost cell (the
    running lanes' bucket, the chunk's raw length) and recorded in another (the decoding
    lanes' bucket), so the policy explored the chosen cell forever. Now the view names the
    program: a decode step's lane bucket, or every lane slot and the ride bucket for a step
    carrying a chunk; each decision's cell is the cell its step's time is recorded in, and
    that time is the program's price."""
    model = _KeyedModel(slope=0.5)
    policy = _CellRecorder()
    e = _engine(K, policy, clock=VirtualClock(model))
    # staggered arrivals: later prompts prefill while earlier ones decode (mixed steps)
    e.start()
    outs = {}
    for i, p in enumerate(PROMPTS):
        e.submit(i, p, GREEDY)
        for _ in range(3):
            outs.update(e.step())
    while e.has_work():
        outs.update(e.step())
    outs.update(e.stop())
    for i, a in enumerate(plain[0]):
        assert outs[i].token_ids == a.token_ids
    assert len(policy.decided) == len(policy.observed) == len(model.keys)
    mixed = 0
    for (bucket, chunk), (ob, oc, depth, seconds), key in zip(policy.decided, policy.observed,
                                                              model.keys):
        assert (bucket, chunk) == (ob, oc)
        if key[0] == "mixed":
            mixed += 1
            assert key == ("mixed", depth, e.lane_slots, chunk)
        else:
            assert key == ("decode", depth, bucket) and chunk == 0
        assert seconds == pytest.approx(1e-3 * (1 + 0.5 * depth))
    assert mixed > 0
