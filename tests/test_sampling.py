"""Tests for mtpjax/sampling.py: exactness, losslessness and seed invariance.

The distribution tests enumerate, with no Monte Carlo. A token depends on the PRNG key
only through its uniform u in [0, 1). Cutting [0, 1) at the CDF breakpoints of a float64
reference distribution gives intervals on which the sampler cannot change its answer.
Evaluating it once per interval, at the midpoint, and summing interval lengths per
outcome gives the exact probability of every emitted sequence. Every check returns an
error measure, so the same function is shown to be small for the real sampler and
large for a deliberately broken one (the mutants below).
"""

from __future__ import annotations

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtpjax import sampling
from mtpjax.sampling import LaneSampling, SamplingParams

# --------------------------------------------------------------------------------------
# float64 reference (sorts, unlike the implementation)
# --------------------------------------------------------------------------------------


def reference_probs(logits, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """f64[V]: temperature, top-k by argsort, top-p by argsort + cumsum; ties at the
    threshold are kept."""
    x = np.asarray(logits, np.float64)
    vocab = x.size
    if temperature == 0:
        return np.eye(vocab)[int(np.argmax(x))]
    keep = np.ones(vocab, bool)
    if 0 < top_k < vocab:
        order = np.argsort(-x, kind="stable")
        keep = x >= x[order[top_k - 1]]
    s = x / temperature
    q = np.where(keep, np.exp(s - s[keep].max()), 0.0)
    q /= q.sum()
    if top_p < 1.0:
        order = np.argsort(-q, kind="stable")
        cum = np.cumsum(q[order])
        n = min(int(np.searchsorted(cum, top_p - 1e-12)), vocab - 1)  # first cum >= top_p
        q = np.where(q >= q[order[n]], q, 0.0)
        q /= q.sum()
    return q


def lanes_of(params: list[SamplingParams]) -> LaneSampling:
    return LaneSampling.from_params(params)


def take_lanes(lanes: LaneSampling, idx) -> LaneSampling:
    # Host-side numpy indexing: eager jnp gathers would each compile.
    return jax.tree.map(lambda x: np.asarray(x)[np.asarray(idx)], lanes)


# --------------------------------------------------------------------------------------
# 1. processed_probs against the sorting reference
# --------------------------------------------------------------------------------------

MIXED_PARAMS = [
    SamplingParams(),  # greedy
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.3),
    SamplingParams(temperature=2.5),
    SamplingParams(temperature=1.0, top_k=1),
    SamplingParams(temperature=0.7, top_k=5),
    SamplingParams(temperature=1.3, top_k=40),
    SamplingParams(temperature=1.0, top_p=0.5),
    SamplingParams(temperature=0.8, top_p=0.9),
    SamplingParams(temperature=1.0, top_p=0.01),  # only the top token (or its ties)
    SamplingParams(temperature=1.1, top_k=20, top_p=0.8),
    SamplingParams(temperature=0.5, top_k=3, top_p=0.95),
    SamplingParams(temperature=1.0, top_k=10_000),  # k >= V: off
    SamplingParams(temperature=0.0, top_k=5, top_p=0.5),  # greedy wins over filters
]


@pytest.mark.parametrize("vocab", [7, 257, 4099])
@pytest.mark.parametrize("ties", [False, True])
def test_processed_probs_matches_sorting_reference(vocab, ties):
    rng = np.random.default_rng(vocab + ties)
    logits = rng.normal(size=(len(MIXED_PARAMS), vocab)).astype(np.float32) * 3
    if ties:  # many exact ties, also across the top-k / top-p thresholds
        logits = np.round(logits * 2) / 2
    logits[1, : vocab // 3] = -np.inf  # masked vocabulary entries
    logits[5, 1] = logits[5].max()  # tie at the very top, argmax picks the lower index
    lanes = lanes_of(MIXED_PARAMS)
    got = np.asarray(
        sampling.processed_probs(jnp.asarray(logits), lanes.temperature, lanes.top_k, lanes.top_p)
    )
    for row, p in enumerate(MIXED_PARAMS):
        want = reference_probs(logits[row], p.temperature, p.top_k, p.top_p)
        np.testing.assert_allclose(got[row], want, atol=1e-6, rtol=0, err_msg=f"row {row}: {p}")
        assert ((got[row] > 0) == (want > 0)).all(), f"support differs in row {row}: {p}"


def test_processed_probs_at_the_real_vocabulary_size():
    """Qwen3.5's 248,320 entries: the bisection still finds the exact thresholds."""
    params = [SamplingParams(temperature=0.7, top_k=50, top_p=0.9),
              SamplingParams(temperature=1.0, top_p=0.95)]
    logits = (np.random.default_rng(0).normal(size=(2, 248_320)) * 3).astype(np.float32)
    lanes = lanes_of(params)
    got = np.asarray(sampling.processed_probs(logits, lanes.temperature, lanes.top_k, lanes.top_p))
    for row, p in enumerate(params):
        want = reference_probs(logits[row], p.temperature, p.top_k, p.top_p)
        np.testing.assert_allclose(got[row], want, atol=1e-6, rtol=0)
        np.testing.assert_array_equal(got[row] > 0, want > 0)


def test_top_p_keeps_every_token_tied_at_threshold():
    # p = [e^2, e, e, e, 1]/Z = [0.44, 0.16, 0.16, 0.16, 0.06]. top_p 0.5 needs one of the
    # tied tokens; all three are kept. top_k=2 also keeps all three tied at the 2nd value.
    logits = jnp.asarray([[2.0, 1.0, 1.0, 1.0, 0.0]] * 2)
    probs = sampling.processed_probs(
        logits, jnp.asarray([1.0, 1.0]), jnp.asarray([0, 2]), jnp.asarray([0.5, 1.0])
    )
    np.testing.assert_array_equal(np.asarray(probs) > 0, [[1, 1, 1, 1, 0]] * 2)


# --------------------------------------------------------------------------------------
# sample_from_uniform and position_uniform
# --------------------------------------------------------------------------------------


def test_sample_from_uniform_inverse_cdf_never_returns_zero_probability():
    probs = jnp.asarray([[0.0, 0.25, 0.0, 0.5, 0.25, 0.0]])
    us = np.concatenate([np.linspace(0, 1, 1001, endpoint=False), [np.nextafter(1, 0)]])
    got = np.array([int(sampling.sample_from_uniform(probs, jnp.asarray([u], jnp.float32))[0])
                    for u in [0.0, 0.2499, 0.25, 0.7499, 0.75, float(us[-1])]])
    np.testing.assert_array_equal(got, [1, 1, 3, 3, 4, 4])
    batch = jnp.broadcast_to(probs, (us.size, 6))
    tokens = np.asarray(sampling.sample_from_uniform(batch, jnp.asarray(us, jnp.float32)))
    assert set(tokens.tolist()) == {1, 3, 4}
    # A one-hot row returns its token for any u.
    one_hot = jnp.broadcast_to(jnp.eye(6)[2], (us.size, 6))
    tokens = np.asarray(sampling.sample_from_uniform(one_hot, jnp.asarray(us, jnp.float32)))
    assert (tokens == 2).all()


def test_position_uniform_depends_only_on_seed_and_position():
    seeds = np.array([0, 1, 2**32 - 1, 12345], np.uint32)
    positions = np.array([0, 7, 7, 100_000], np.int32)
    got = np.asarray(sampling.position_uniform(jnp.asarray(seeds), jnp.asarray(positions)))
    for s, p, g in zip(seeds, positions, got):
        want = jax.random.uniform(jax.random.fold_in(jax.random.key(int(s)), int(p)))
        assert g == float(want)
    # Any shape, any place in the batch: the same value.
    grid = sampling.position_uniform(jnp.asarray(seeds)[:, None], jnp.asarray(positions)[None, :])
    np.testing.assert_array_equal(np.diag(np.asarray(grid)), got)
    assert ((got >= 0) & (got < 1)).all()


# --------------------------------------------------------------------------------------
# 2. exact distribution of the emitted tokens by enumeration
# --------------------------------------------------------------------------------------


def _cells(cut_lists: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Cartesian product of intervals: midpoints f64[N, n] and weights f64[N]."""
    mids, lens = [], []
    for cuts in cut_lists:
        lo, hi = cuts[:-1], cuts[1:]
        ok = hi > lo
        mids.append(((lo + hi) / 2)[ok])
        lens.append((hi - lo)[ok])
    mid = np.stack(np.meshgrid(*mids, indexing="ij"), -1).reshape(-1, len(cut_lists))
    weight = np.stack(np.meshgrid(*lens, indexing="ij"), -1).reshape(-1, len(cut_lists)).prod(-1)
    return mid, weight


def exact_emissions(verify_u, logits, drafts, params, n_uniforms=1) -> dict[tuple, float]:
    """Exact probability of each emitted token sequence of ``verify_u``.

    verify_u(target_logits f32[N, K+1, V], drafts i32[N, K], lanes, u) -> (a, tokens), with u
    f32[N, K+1] if n_uniforms == 1 else f32[N, K+1, n_uniforms].
    """
    k = len(drafts)
    ref = [reference_probs(logits[j], params.temperature, params.top_k, params.top_p)
           for j in range(k + 1)]
    cut_lists = []
    for j in range(k + 1):
        cuts = {0.0, 1.0, *np.cumsum(ref[j])[:-1].tolist()}
        if j < k and ref[j][drafts[j]] < 1:
            # Where an accept-with-prob-p(d) rule, and a redraw from p without d, cut.
            residual = np.where(np.arange(ref[j].size) == drafts[j], 0.0, ref[j])
            cuts |= {float(ref[j][drafts[j]]), *np.cumsum(residual / residual.sum())[:-1].tolist()}
        cut_lists += [np.array(sorted(c for c in cuts if 0.0 <= c <= 1.0))] * n_uniforms
    mid, weight = _cells(cut_lists)
    n = mid.shape[0]
    padded = max(256, 1 << (n - 1).bit_length())  # few bucket sizes, few recompiles
    mid = np.concatenate([mid, np.full((padded - n, mid.shape[1]), 0.5)])
    weight = np.concatenate([weight, np.zeros(padded - n)])
    u = mid.reshape(padded, k + 1, n_uniforms).astype(np.float32)
    if n_uniforms == 1:
        u = u[..., 0]
    num, tokens = verify_u(
        np.broadcast_to(np.asarray(logits, np.float32), (padded, *logits.shape)),
        np.broadcast_to(np.asarray(drafts, np.int32), (padded, k)),
        lanes_of([params] * padded),
        u,
    )
    num, tokens = np.asarray(num), np.asarray(tokens)
    dist = collections.defaultdict(float)
    for i in range(n):
        dist[tuple(tokens[i, : num[i] + 1].tolist())] += weight[i]
    return dict(dist)


def ideal_emissions(logits, drafts, params) -> dict[tuple, float]:
    """What plain sampling from the target emits, cut after its first disagreement with
    the drafts: P(d_0..d_{m-1}, x) = prod_{i<m} p_i(d_i) * p_m(x), with x != d_m for m < K."""
    k, vocab = len(drafts), logits.shape[-1]
    ref = [reference_probs(logits[j], params.temperature, params.top_k, params.top_p)
           for j in range(k + 1)]
    dist, reach = {}, 1.0
    for m in range(k + 1):
        for x in range(vocab):
            if (m == k or x != drafts[m]) and reach * ref[m][x] > 0:
                dist[tuple(drafts[:m]) + (x,)] = reach * ref[m][x]
        if m < k:
            reach *= ref[m][drafts[m]]
    return dist


def emission_error(verify_u, logits, drafts, params, n_uniforms=1) -> float:
    """Max abs difference between the sampler's exact emission distribution and the
    plain-sampling one: 0 (to float32 rounding) for a lossless verifier."""
    got = exact_emissions(verify_u, logits, drafts, params, n_uniforms)
    want = ideal_emissions(logits, drafts, params)
    return max(abs(got.get(s, 0.0) - want.get(s, 0.0)) for s in set(got) | set(want))


def position_marginals(dist: dict[tuple, float], pos: int, vocab: int) -> np.ndarray:
    """f64[V]: P(a token is emitted at index pos and equals x)."""
    out = np.zeros(vocab)
    for seq, pr in dist.items():
        if len(seq) > pos:
            out[seq[pos]] += pr
    return out


ENUM_SETTINGS = {
    "temperature": SamplingParams(temperature=0.8),
    "top_k": SamplingParams(temperature=1.0, top_k=3),
    "top_p": SamplingParams(temperature=1.2, top_p=0.7),
    "top_k_top_p": SamplingParams(temperature=0.9, top_k=4, top_p=0.8),
    "greedy": SamplingParams(),
}


def _enum_case(vocab: int, k: int, draft_kind: str, seed: int):
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(k + 1, vocab)).astype(np.float32)
    order = np.argsort(-logits, axis=-1)
    pick = {"argmax": 0, "second": 1, "last": vocab - 1}[draft_kind]  # "last" is 0 under top-k
    drafts = order[:k, pick].astype(np.int32)
    return logits, drafts


@pytest.mark.parametrize("setting", list(ENUM_SETTINGS))
@pytest.mark.parametrize("vocab,k", [(5, 1), (8, 1), (6, 2)])
@pytest.mark.parametrize("draft_kind", ["argmax", "second", "last"])
def test_verify_exact_distribution(setting, vocab, k, draft_kind):
    params = ENUM_SETTINGS[setting]
    logits, drafts = _enum_case(vocab, k, draft_kind, seed=vocab * 10 + k)
    ref = [reference_probs(logits[j], params.temperature, params.top_k, params.top_p)
           for j in range(k + 1)]
    dist = exact_emissions(sampling.verify_from_uniforms, logits, drafts, params)
    assert abs(sum(dist.values()) - 1) < 1e-9
    # (a) The first emitted token is distributed as the target at that position.
    np.testing.assert_allclose(position_marginals(dist, 0, vocab), ref[0], atol=1e-6)
    # Marginal at each position: reached with prob prod_{i<j} p_i(d_i), then exactly p_j.
    reach = 1.0
    for j in range(k + 1):
        np.testing.assert_allclose(position_marginals(dist, j, vocab), reach * ref[j], atol=1e-6)
        if j < k:
            reach *= ref[j][drafts[j]]
    if k == 2:  # (b) joint of the first two emitted tokens when the first draft is accepted
        for x in range(vocab):
            joint = sum(pr for s, pr in dist.items() if len(s) > 1 and s[:2] == (drafts[0], x))
            assert abs(joint - ref[0][drafts[0]] * ref[1][x]) < 1e-6
    assert emission_error(sampling.verify_from_uniforms, logits, drafts, params) < 1e-6


# --------------------------------------------------------------------------------------
# 3. mutants: the same checks must fail for broken verifiers
# --------------------------------------------------------------------------------------


def _probs3(target_logits, lanes):  # [B, K+1, V] -> [B, K+1, V]
    b, k1, v = target_logits.shape
    rep = lambda x: jnp.repeat(x, k1)
    p = sampling.processed_probs(target_logits.reshape(b * k1, v), rep(lanes.temperature),
                                 rep(lanes.top_k), rep(lanes.top_p))
    return p.reshape(b, k1, v)


def _emit(t, accept):  # t i32[B, K+1], accept bool[B, K] -> (a, tokens)
    a = jnp.sum(jnp.cumprod(accept.astype(jnp.int32), axis=1), axis=1)
    return a, jnp.where(jnp.arange(t.shape[1])[None] <= a[:, None], t, -1)


@jax.jit
def mutant_always_accept(target_logits, drafts, lanes, u):
    probs = _probs3(target_logits, lanes)
    bonus = sampling.sample_from_uniform(probs[:, -1], u[:, -1])
    t = jnp.concatenate([drafts, bonus[:, None]], axis=1)
    return _emit(t, jnp.ones_like(drafts, bool))


def _accept_then_redraw(target_logits, drafts, lanes, u, remove_draft: bool):
    """Classic rule with a one-hot draft: accept d if u0 < p(d), else redraw with u1,
    from p without d (correct) or from the full p (the mutant)."""
    b, k1, v = target_logits.shape
    probs = _probs3(target_logits, lanes)
    p_d = jnp.take_along_axis(probs[:, :-1], drafts[..., None], axis=-1)[..., 0]
    accept = u[:, :-1, 0] < p_d
    redraw_p = probs[:, :-1]
    if remove_draft:
        redraw_p = jnp.where(jax.nn.one_hot(drafts, v, dtype=bool), 0.0, redraw_p)
    redraw = sampling.sample_from_uniform(redraw_p.reshape(-1, v), u[:, :-1, 1].reshape(-1))
    bonus = sampling.sample_from_uniform(probs[:, -1], u[:, -1, 0])
    t = jnp.concatenate([jnp.where(accept, drafts, redraw.reshape(b, k1 - 1)), bonus[:, None]], 1)
    return _emit(t, accept)


mutant_redraw_full_p = jax.jit(lambda *a: _accept_then_redraw(*a, remove_draft=False))
control_redraw_residual = jax.jit(lambda *a: _accept_then_redraw(*a, remove_draft=True))


@pytest.mark.parametrize("setting", ["temperature", "top_k_top_p"])
def test_distribution_check_catches_mutants(setting):
    params = ENUM_SETTINGS[setting]
    logits, drafts = _enum_case(6, 1, "second", seed=7)
    p_draft = reference_probs(logits[0], params.temperature, params.top_k, params.top_p)[drafts[0]]
    assert 0.1 < p_draft < 0.9  # a case where the mutants have something to get wrong
    real = emission_error(sampling.verify_from_uniforms, logits, drafts, params)
    always = emission_error(mutant_always_accept, logits, drafts, params)
    full_p = emission_error(mutant_redraw_full_p, logits, drafts, params, n_uniforms=2)
    residual = emission_error(control_redraw_residual, logits, drafts, params, n_uniforms=2)
    assert real < 1e-6 and residual < 1e-6, (real, residual)
    assert always > 0.05, always
    assert full_p > 0.02, full_p


@jax.jit
def _keyed_uniform(seed, position, extra):
    """uniform(fold_in(fold_in(key(seed), position), extra)), vmapped over [N]."""
    def one(s, p, e):
        return jax.random.uniform(jax.random.fold_in(jax.random.fold_in(jax.random.key(s), p), e))
    return jax.vmap(one)(seed, position, jnp.broadcast_to(extra, seed.shape).astype(jnp.int32))


UNIFORMS = {
    # uniform_fn(seed u32[N], position i32[N], row i32[N], batch, num_spec) -> f32[N]
    "real": lambda s, p, row, b, k: sampling.position_uniform(s, p),
    "row_index": lambda s, p, row, b, k: _keyed_uniform(s, p, row),
    "num_spec": lambda s, p, row, b, k: _keyed_uniform(s, p, k),
    "batch_size": lambda s, p, row, b, k: _keyed_uniform(s, p, b),
}


def make_pipeline(uniform_fn):
    """(sample_fn, verify_fn) with the signatures of sampling.sample / sampling.verify,
    drawing uniforms from ``uniform_fn``, so that bad keys can be injected. Not jitted as
    a whole: the jitted pieces it calls are then compiled once for all the mutants."""

    def sample_fn(logits, lanes, positions):
        b = logits.shape[0]
        u = uniform_fn(np.asarray(lanes.seed), np.asarray(positions), np.arange(b), b, 0)
        probs = sampling.processed_probs(logits, lanes.temperature, lanes.top_k, lanes.top_p)
        return sampling.sample_from_uniform(probs, u)

    def verify_fn(target_logits, drafts, lanes, first_position):
        b, k1, _ = target_logits.shape
        pos = (np.asarray(first_position)[:, None] + np.arange(k1)).reshape(-1)
        seed = np.repeat(np.asarray(lanes.seed), k1)
        u = np.asarray(uniform_fn(seed, pos, np.arange(b * k1), b, k1 - 1)).reshape(b, k1)
        return sampling.verify_from_uniforms(target_logits, drafts, lanes, u)

    return sample_fn, verify_fn


def _random_lanes(rng, batch, greedy_every=0):
    params = []
    for i in range(batch):
        t = 0.0 if greedy_every and i % greedy_every == 0 else float(rng.uniform(0.7, 1.5))
        params.append(SamplingParams(temperature=t, top_k=int(rng.choice([0, 0, 40])),
                                     top_p=float(rng.choice([1.0, 0.95])),
                                     seed=int(rng.integers(0, 2**32))))
    return lanes_of(params)


def spec_vs_plain_mismatches(sample_fn, verify_fn, k=3, batch=16, vocab=64, greedy_every=0) -> int:
    """Count of (num_accepted, token) entries where verify differs from plain sampling.

    Drafts equal the plain samples, except at one position per lane (lane b breaks at
    b % (K+1); K+1 means never), so every accept length 0..K appears and drafts that match
    again after the break must still be rejected."""
    rng = np.random.default_rng(k * 1000 + batch)
    logits = rng.normal(size=(batch, k + 1, vocab)).astype(np.float32) * 0.5
    lanes = _random_lanes(rng, batch, greedy_every)
    first = rng.integers(0, 5000, size=batch).astype(np.int32)
    plain = np.stack(
        [np.asarray(sample_fn(logits[:, j], lanes, first + j)) for j in range(k + 1)], axis=1
    )
    brk = np.arange(batch) % (k + 2)
    drafts = plain[:, :k].copy()
    for b in range(batch):
        if brk[b] < k:
            drafts[b, brk[b]] = (drafts[b, brk[b]] + 1) % vocab
    want_a = np.minimum(brk, k)
    want_tokens = np.where(np.arange(k + 1)[None] <= want_a[:, None], plain, -1)
    a, tokens = verify_fn(logits, drafts, lanes, first)
    return int((np.asarray(a) != want_a).sum() + (np.asarray(tokens) != want_tokens).sum())


def lane_invariance_mismatches(sample_fn, batch=8, vocab=64) -> int:
    """Count of tokens that change when a request moves to another lane or batch size."""
    rng = np.random.default_rng(batch)
    logits = rng.normal(size=(batch, vocab)).astype(np.float32) * 0.5
    lanes = _random_lanes(rng, batch)
    pos = rng.integers(0, 5000, size=batch).astype(np.int32)
    full = np.asarray(sample_fn(logits, lanes, pos))

    def moved(idx):  # the requests idx, in that order, as a batch of their own
        idx = np.asarray(idx)
        tokens = np.asarray(sample_fn(logits[idx], take_lanes(lanes, idx), pos[idx]))
        return int((tokens != full[idx]).sum())

    perm = rng.permutation(batch)
    bad = sum(moved([b]) for b in range(batch))  # alone, in a batch of 1
    bad += moved(perm)  # in other lanes
    return bad + moved(np.concatenate([perm, perm]))  # twice, in a larger batch


def test_key_mutants_break_spec_equals_plain_and_lane_invariance():
    # The real key passes both checks (also in the tests of section 4).
    assert spec_vs_plain_mismatches(sampling.sample, sampling.verify) == 0
    assert lane_invariance_mismatches(sampling.sample) == 0
    # A key folded with the flattened row index: lanes differ and verify rows differ.
    sample_row, verify_row = make_pipeline(UNIFORMS["row_index"])
    assert spec_vs_plain_mismatches(sample_row, verify_row) > 10
    assert lane_invariance_mismatches(sample_row) > 5
    # A key folded with K: plain (K = 0) and speculative tokens differ.
    assert spec_vs_plain_mismatches(*make_pipeline(UNIFORMS["num_spec"])) > 10
    # A key folded with the batch size: a request changes tokens with the batch.
    assert lane_invariance_mismatches(make_pipeline(UNIFORMS["batch_size"])[0]) > 5
    # Control: the test pipeline with the real key is faithful, so the failures above
    # come from the key alone.
    assert spec_vs_plain_mismatches(*make_pipeline(UNIFORMS["real"])) == 0


# --------------------------------------------------------------------------------------
# 4. verify == plain sample, for the same seeds; lane and batch invariance
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [0, 1, 3])
def test_verify_emits_plain_samples(k):
    """Since every K gives the plain tokens, the tokens also do not depend on K."""
    assert spec_vs_plain_mismatches(sampling.sample, sampling.verify, k=k) == 0
    assert spec_vs_plain_mismatches(sampling.sample, sampling.verify, k=k, greedy_every=2) == 0


def test_same_seed_same_samples_in_any_lane_or_batch():
    assert lane_invariance_mismatches(sampling.sample) == 0
    # One seed in every lane, same logits and position: one token. Different positions
    # draw independent uniforms.
    rng = np.random.default_rng(0)
    logits = jnp.broadcast_to(jnp.asarray(rng.normal(size=64).astype(np.float32)) * 0.1, (16, 64))
    lanes = lanes_of([SamplingParams(temperature=1.0, seed=7)] * 16)
    same = np.asarray(sampling.sample(logits, lanes, jnp.full(16, 11, jnp.int32)))
    assert (same == same[0]).all()
    spread = np.asarray(sampling.sample(logits, lanes, jnp.arange(16, dtype=jnp.int32)))
    assert len(set(spread.tolist())) > 6


# --------------------------------------------------------------------------------------
# 5. greedy
# --------------------------------------------------------------------------------------


def test_greedy_is_argmax_and_accepts_iff_draft_is_argmax():
    rng = np.random.default_rng(1)
    b, k, v = 16, 3, 64  # the shapes of spec_vs_plain_mismatches: no new compile
    logits = np.round(rng.normal(size=(b, k + 1, v)), 1).astype(np.float32)  # ties
    logits[0, :, 7] = logits[0, :, 3] = logits[0].max() + 1  # tie at the top: lowest index
    argmax = logits.argmax(-1)  # [B, K+1]
    lanes = lanes_of([SamplingParams(seed=i, top_k=i % 3, top_p=0.5 + 0.03 * i) for i in range(b)])
    for j in range(k + 1):
        tok = np.asarray(sampling.sample(logits[:, j], lanes, np.full(b, j, np.int32)))
        np.testing.assert_array_equal(tok, argmax[:, j])
    assert (argmax[0] == 3).all()
    drafts = argmax[:, :k].copy()
    drafts[1, 0] += 1
    drafts[2, 1] += 1
    drafts[3, 2] += 1
    drafts[4, 0] += 1
    drafts[4, 2] += 1
    drafts[5:] = argmax[5:, :k]  # lanes 5.. accept all drafts
    drafts %= v
    a, tokens = sampling.verify(jnp.asarray(logits), jnp.asarray(drafts), lanes,
                                jnp.zeros(b, jnp.int32))
    want_a = np.array([int(np.cumprod(drafts[i] == argmax[i, :k]).sum()) for i in range(b)])
    np.testing.assert_array_equal(np.asarray(a), want_a)
    np.testing.assert_array_equal(np.asarray(a)[:6], [3, 0, 1, 2, 0, 3])
    want_tokens = np.where(np.arange(k + 1)[None] <= want_a[:, None], argmax, -1)
    np.testing.assert_array_equal(np.asarray(tokens), want_tokens)


# --------------------------------------------------------------------------------------
# 6. SamplingParams validation and LaneSampling
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(temperature=float("inf")), "temperature"),
        (dict(top_k=-1), "top_k"),
        (dict(top_k=1.5), "top_k"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_p=float("nan")), "top_p"),
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(seed=-1), "seed"),
        (dict(seed=2**32), "seed"),
        (dict(stop_token_ids=[3, -1]), "stop_token_ids"),
    ],
)
def test_sampling_params_rejects_bad_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_sampling_params_validate_checks_stop_ids_against_vocab():
    p = SamplingParams(temperature=0.5, seed=2**32 - 1, stop_token_ids=[0, 99])
    assert p.stop_token_ids == (0, 99)
    assert hash(p) == hash(SamplingParams(0.5, 0, 1.0, 16, 2**32 - 1, (0, 99)))
    assert p.validate(vocab_size=100) is p
    with pytest.raises(ValueError, match="stop_token_ids"):
        p.validate(vocab_size=99)


def test_lane_sampling_from_params_is_a_pytree():
    lanes = LaneSampling.from_params(
        [SamplingParams(temperature=0.7, top_k=5, top_p=0.9, seed=2**32 - 1)], pad_to=3
    )
    dtypes = [x.dtype for x in jax.tree.leaves(lanes)]
    assert dtypes == [jnp.float32, jnp.int32, jnp.float32, jnp.uint32]
    assert all(x.shape == (3,) for x in jax.tree.leaves(lanes))
    assert int(lanes.seed[0]) == 2**32 - 1 and float(lanes.temperature[1]) == 0.0
    doubled = jax.jit(lambda ls: jax.tree.map(lambda x: x * 2, ls))(lanes)
    assert isinstance(doubled, LaneSampling) and int(doubled.top_k[0]) == 10
    with pytest.raises(ValueError, match="pad_to"):
        LaneSampling.from_params([SamplingParams()] * 2, pad_to=1)
