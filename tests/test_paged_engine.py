"""The paged engine end to end (float32, CPU): paged == contiguous storage, Pallas (interpreted)
== reference kernels, batched + preempted == one at a time, NaN in free pages is inert, the
speculation policy and bad requests change nobody's output.

Compile time dominates on CPU, so the tests share a few engine shapes (jit caches are keyed
by shapes, so equal-shaped Engine instances reuse each other's programs):
  alone():     1 lane, k=2, a pool for full context, Pallas kernels in the interpreter: the
               one-at-a-time reference. Every comparison with it is also a check that the
               Pallas kernels (page size 4) give the reference kernels' tokens.
  crowded(k):  8 lanes, 12 pages of 4 tokens, reference kernels: 200 requests force
               preemption
The vocabulary of 11 makes drafts land, so accept, rollback and redraft all run.
"""

import dataclasses
import functools
import re
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mtpjax
from mtpjax import model, steps
from mtpjax.engine import Engine, SpeculationPolicy
from mtpjax.sampling import SamplingParams

from tiny_models import VOCAB11_CFG as CFG, VOCAB11_PARAMS as PARAMS
SEQ, CHUNK, PAGE, POOL = 48, 8, 4, 12      # a lane at full context needs 13 pages

rng = np.random.default_rng(0)
PROMPTS = [[int(t) for t in rng.integers(0, 11, rng.integers(1, 21))] for _ in range(200)]
GREEDY = [SamplingParams(max_new_tokens=int(n)) for n in rng.integers(1, 13, 200)]


def alone(**kw):
    return Engine(CFG, PARAMS, num_speculative_tokens=2, max_lanes=1, max_seq_len=SEQ,
                  prefill_chunk=CHUNK, page_size=PAGE, kernels="interpret", **kw)


def crowded(k, max_seq_len=SEQ, **kw):
    return Engine(CFG, PARAMS, num_speculative_tokens=k, max_lanes=8, max_seq_len=max_seq_len,
                  prefill_chunk=CHUNK, page_size=PAGE, num_pages=POOL, kernels="reference",
                  **kw)


@functools.cache
def reference():
    """Greedy outputs of the 200 requests, one at a time (a single lane, interpreted kernels)."""
    e = alone()
    outs = e.generate(PROMPTS, GREEDY)
    s = e.stats()
    assert s["preemptions"] == 0 and s["free_pages"] == e.num_pages
    assert s["kernels"] == "interpret" and s["plain_steps"] == 0
    return [o.token_ids for o in outs]


def assert_same(outs, idx):
    ref = reference()
    for o, i in zip(outs, idx):
        assert o.error is None and o.token_ids == ref[i], i


# ------------------------------------------------------------------------- model level

@partial(jax.jit, static_argnames=("kernels",))
def _prefill_then_verify(cache, tokens, block, table, kernels="reference"):
    """Prefill lanes of lengths (13, 6) in one chunk call, then a 3-token step."""
    n = jnp.asarray([13, 6], jnp.int32)
    seg = model.Segment(jnp.zeros(2, jnp.int32), n, table)
    h1, cache = model.forward(CFG, PARAMS, cache, tokens, seg, "chunk", kernels)
    h2, cache = model.forward(CFG, PARAMS, cache, block, model.Segment(n, n * 0 + 3, table),
                              "step", kernels)
    return model.lm_head(PARAMS, h1), model.lm_head(PARAMS, h2), cache


def test_paged_storage_equals_contiguous_with_permuted_pages_and_nan_pool():
    r = np.random.default_rng(3)
    tokens = jnp.asarray(r.integers(0, 11, (2, 16)), jnp.int32)
    block = jnp.asarray(r.integers(0, 11, (2, 3)), jnp.int32)
    c_lg1, c_lg2, c_cache = _prefill_then_verify(model.init_cache(CFG, 2, 24, 3), tokens, block,
                                                 None)
    num_pages = 12
    cache = model.init_paged_cache(CFG, 2, num_pages, PAGE, 3)
    nan = lambda kv: model.PagedKV(jnp.full_like(kv.k, jnp.nan), jnp.full_like(kv.v, jnp.nan),
                                   kv.page_size)
    cache = model.map_kv(cache, nan)
    perm = r.permutation(num_pages)
    table = np.full((2, 6), num_pages, np.int32)          # 16 + 3 tokens -> 4 / 3 pages
    table[0, :4], table[1, :3] = perm[:4], perm[4:7]
    lg1, lg2, cache = _prefill_then_verify(cache, tokens, block, jnp.asarray(table))
    valid1 = [13, 6]
    for b in range(2):
        np.testing.assert_allclose(lg1[b, :valid1[b]], c_lg1[b, :valid1[b]], rtol=1e-5,
                                   atol=1e-5)
    np.testing.assert_allclose(lg2, c_lg2, rtol=1e-5, atol=1e-5)
    # the pool holds exactly what the contiguous cache holds, at the table's pages
    pool = np.stack([np.asarray(kv.k) for kv in cache.kv[:-1]])          # [L, NKV, P, S, HD]
    ref = np.stack([np.asarray(kv.k) for kv in c_cache.kv[:-1]])        # [L, B, S, NKV, HD]
    for b, n in enumerate((16, 9)):
        for p in range(n):
            got = pool[:, :, table[b, p // PAGE], p % PAGE]               # [L, NKV, HD]
            np.testing.assert_allclose(got, ref[:, b, p], rtol=1e-6, atol=1e-6)
        assert np.isnan(pool[:, :, table[b, (n - 1) // PAGE], (n - 1) % PAGE + 1:]).all()
    # pages no lane owns were never written
    assert np.isnan(pool[:, :, perm[7:]]).all()


def test_paged_kv_needs_a_page_table():
    cache = model.init_paged_cache(CFG, 1, 4, PAGE, 1)
    with pytest.raises(ValueError, match="needs a Segment with a page_table"):
        jax.eval_shape(lambda c: model.forward(CFG, PARAMS, c, jnp.zeros((1, 2), jnp.int32),
                                               model.Segment.full(1, 2), "chunk"), cache)


# ------------------------------------------------------------------------- engine

def test_interpreted_pallas_kernels_with_small_pages_equal_reference_kernels():
    """alone() runs the Pallas kernels (interpreted); a lone request through the reference
    kernels must give the same tokens (the batched tests below compare all 200)."""
    idx = list(range(12))
    e = Engine(CFG, PARAMS, num_speculative_tokens=2, max_lanes=8, max_seq_len=SEQ,
               prefill_chunk=CHUNK, page_size=PAGE, num_pages=POOL, kernels="reference")
    for i in idx:
        assert_same(e.generate([PROMPTS[i]], GREEDY[i]), [i])
    assert alone().kernels == "interpret" and e.kernels == "reference"


@pytest.mark.parametrize("k", [0, 2])
def test_200_requests_batched_with_preemption_equal_one_at_a_time(k):
    e = crowded(k)
    streamed = {}
    outs = e.generate(PROMPTS, GREEDY,
                      on_token=lambda i, t: streamed.setdefault(i, []).extend(t))
    assert_same(outs, range(200))
    for i, o in enumerate(outs):
        assert o.finish_reason == "length" and len(o.token_ids) == GREEDY[i].max_new_tokens
        assert streamed[i] == o.token_ids
        assert o.prompt_token_ids == PROMPTS[i]
    s = e.stats()
    assert s["preemptions"] > 0
    assert sum(o.stats.preemptions for o in outs) == s["preemptions"]
    assert s["free_pages"] == s["total_pages"] == POOL
    e.alloc.check()
    allowed = {("prefill", CHUNK)} | {("decode", d, nb) for d in range(k + 1) for nb in (1, 2, 4, 8)}
    allowed |= {("mixed", d, nb, CHUNK) for d in range(k + 1) for nb in (1, 2, 4, 8)}
    R = e.prefill_rows          # packed prefill: the same programs at R chunk rows
    allowed |= {key + (R,) for key in allowed if key[0] in ("prefill", "mixed")}
    assert set(s["programs"]) <= allowed and s["compiled_programs"] == len(s["programs"])
    if k:
        assert sum(o.stats.accepted_tokens for o in outs) > 0


def test_alternating_speculation_depth_equals_plain():
    idx = list(range(24))
    policy = lambda view: view.K if view.step % 2 else 0
    e = crowded(2, speculation_policy=policy)
    outs = e.generate([PROMPTS[i] for i in idx], [GREEDY[i] for i in idx])
    assert_same(outs, idx)
    s = e.stats()
    assert 0 < s["plain_steps"] < s["steps"]
    assert sum(o.stats.accepted_tokens for o in outs) > 0
    # a busy-lane threshold: 8 lanes busy -> no speculation, the drained tail speculates
    e = crowded(2, speculation_policy=SpeculationPolicy(max_busy_lanes=3))
    assert_same(e.generate([PROMPTS[i] for i in idx], [GREEDY[i] for i in idx]), idx)
    assert 0 < e.stats()["plain_steps"] < e.stats()["steps"]


@partial(jax.jit, donate_argnames=("cache",))
def _poison(cache, free):
    f = lambda a: jnp.where(free[None, :, None, None], jnp.nan, a)
    return model.map_kv(cache, lambda p: model.PagedKV(f(p.k), f(p.v), p.page_size))


def test_nan_in_free_pages_does_not_change_outputs():
    idx = list(range(40))
    e = crowded(2)
    e.generate([PROMPTS[0]], GREEDY[0])               # warm-up
    e.clear_prefix_cache()                            # its cached pages back to the pool

    def poison(*_):
        free = np.zeros(e.num_pages, bool)
        free[e.alloc.free_page_ids()] = True
        e.cache = _poison(e.cache, jnp.asarray(free))

    poison()
    assert all(np.isnan(np.asarray(kv.k)).all() for kv in e.cache.kv)   # every page was free
    outs = e.generate([PROMPTS[i] for i in idx], [GREEDY[i] for i in idx], on_token=poison)
    assert_same(outs, idx)
    assert e.stats()["preemptions"] > 0


def test_seeded_sampling_reproduces_across_lane_counts():
    idx = list(range(0, 200, 8))
    sps = [SamplingParams(temperature=1.0, top_k=(0, 5)[i % 2], top_p=(1.0, 0.9)[i % 3 % 2],
                          seed=100 + i, max_new_tokens=GREEDY[i].max_new_tokens) for i in idx]
    prompts = [PROMPTS[i] for i in idx]
    one = alone().generate(prompts, sps)
    eight = crowded(2)
    many = eight.generate(prompts, sps)
    assert [o.token_ids for o in many] == [o.token_ids for o in one]
    assert eight.stats()["preemptions"] > 0
    other = alone().generate(prompts, [dataclasses.replace(p, seed=p.seed + 1) for p in sps])
    assert any(a.token_ids != b.token_ids for a, b in zip(other, one))


def test_bad_requests_end_with_an_error_and_change_nobody_else():
    good = [3, 4, 5, 6]
    bad = [
        ([], SamplingParams(), "empty prompt"),
        ([1] * SEQ, SamplingParams(), "prompt too long: 48 tokens, the context limit is 48"),
        ([1, 2], SamplingParams(stop_token_ids=(11,)), "invalid sampling parameters"),
        ([1, 2], "greedy", "must be a SamplingParams"),
        ([1, 11, 2], SamplingParams(), "token id 11 outside the vocabulary"),
        ([1, -1], SamplingParams(), "token id -1 outside the vocabulary"),
        ([1] * 40, SamplingParams(max_new_tokens=8),
         "cannot fit the KV pool.*needs up to 13 pages of 4 tokens, the pool has 12"),
    ]
    prompts, params, where = [], [], []
    for j, i in enumerate(good):
        prompts.append(PROMPTS[i])
        params.append(GREEDY[i])
        prompts.append(bad[j][0])
        params.append(bad[j][1])
        where.append(bad[j][2])
    for p, sp, msg in bad[len(good):]:
        prompts.append(p)
        params.append(sp)
        where.append(msg)
    e = crowded(2)
    outs = e.generate(prompts, params)
    assert_same(outs[0:8:2], good)
    errs = outs[1:8:2] + outs[8:]
    assert len(errs) == len(bad)
    for o, msg in zip(errs, where):
        assert o.finish_reason == "error" and o.token_ids == []
        assert re.search(msg, o.error), (o.error, msg)
    assert e.stats()["free_pages"] == POOL


def test_cancel_from_the_stream():
    idx = [5, 6, 7, 8]
    e = crowded(2)

    def on_token(i, toks):
        if i == 1:
            e.cancel(1)       # takes effect at the next scheduling point

    sps = [dataclasses.replace(GREEDY[i], max_new_tokens=12) for i in idx]
    outs = e.generate([PROMPTS[i] for i in idx], sps, on_token=on_token)
    assert outs[1].finish_reason == "cancelled" and 1 <= len(outs[1].token_ids) < 12
    ref = alone().generate([PROMPTS[i] for i in idx], sps)
    assert outs[1].token_ids == ref[1].token_ids[:len(outs[1].token_ids)]
    for j in (0, 2, 3):
        assert outs[j].token_ids == ref[j].token_ids
    assert e.stats()["free_pages"] == e.num_pages


def test_no_recompiles_across_calls_and_stats():
    alternate = lambda view: view.K if view.step % 2 else 0   # both decode programs
    e = crowded(2, speculation_policy=alternate)
    e.generate(PROMPTS[:30], GREEDY[:30])     # 30 requests: the lane buckets the pool allows
    sizes = (steps.decode_step._cache_size(), steps.prefill_chunk._cache_size())
    e.generate(PROMPTS[30:60], GREEDY[30:60])
    # a new engine of the same shapes
    crowded(2, speculation_policy=alternate).generate(PROMPTS[60:90], GREEDY[60:90])
    assert (steps.decode_step._cache_size(), steps.prefill_chunk._cache_size()) == sizes
    s = e.stats()
    for key in ("free_pages", "total_pages", "compiled_programs", "preemptions", "prefill_s",
                "step_s", "host_s", "steps"):
        assert key in s
    # one prefill bucket, two depths x the lane buckets 1, 2, 4, 8, and two depths with a
    # chunk riding (over every lane slot); packed prefill: the prefill and the two riding
    # ones again at prefill_rows rows
    assert s["compiled_programs"] <= 1 + 2 * 4 + 2 + 3
    assert {p[2] for p in s["programs"] if p[0] == "mixed"} <= {e.lane_slots}
    # the drained tail runs in bucket 1 (compaction keeps the last lane at slot 0)
    assert 1 in {p[2] for p in s["programs"] if p[0] == "decode"}


def test_warmup_compiles_everything_a_crowded_run_needs_and_changes_no_output():
    """After warmup(), 30 requests with preemptions (re-prefills of prompt + reply: chunk
    lengths the first admissions never used), lane moves and prefix-cache snapshots compile
    no step program, and give the one-at-a-time tokens (warmup's prefill left lane 0's GDN
    slot dirty and wrote no KV)."""
    from jax._src import dispatch, monitoring
    idx = list(range(30))
    # shapes of its own; two lane buckets (1 and all 8 lanes), not four: every one is a
    # program per depth for warmup to compile, and two show it compiles each
    e = crowded(1, max_seq_len=SEQ - 4, prefill_buckets=(4, CHUNK), lane_buckets=(1, 8))
    n = e.warmup()
    # depths 0..1 x buckets 1, 8, the same two depths with a chunk riding at each of the 2
    # ride buckets (the page-size bucket and the chunk), 2 chunks, move, snapshots
    assert len(e.ride_buckets) == 2 and e.ride_buckets[-1] == CHUNK
    assert e.lane_buckets == (1, 8)
    # packed prefill (prefill_rows 4): the riding programs again, and one prefill
    assert e.prefill_rows == 4 and n == 2 * 2 + 2 * 2 + 2 + 1 + 2 + (2 * 2 + 1)
    assert e.warmup() == 0
    compiled = []

    def on_compile(event, _secs, fun_name=None, **_):
        if event == dispatch.BACKEND_COMPILE_EVENT:
            compiled.append(fun_name)

    monitoring.register_event_duration_secs_listener(on_compile)
    try:
        outs = e.generate([PROMPTS[i] for i in idx], [GREEDY[i] for i in idx])
        jax.jit(lambda x: x + 1)(1.0)              # a positive control: this one compiles
    finally:
        monitoring.unregister_event_duration_listener(on_compile)
    assert_same(outs, idx)
    s = e.stats()
    assert s["preemptions"] > 0 and s["lane_moves"] > 0
    programs = {f"jit({f})" for f in ("decode_step", "prefill_chunk", "move_lane", "save",
                                       "restore")}
    assert "jit(<lambda>)" in compiled and not programs & set(compiled), compiled


def test_engine_arguments_are_checked_and_forwarded(monkeypatch):
    with pytest.raises(ValueError, match="kernels must be one of"):
        Engine(CFG, PARAMS, kernels="cuda")
    with pytest.raises(ValueError, match="page_size must be >= 1"):
        Engine(CFG, PARAMS, page_size=0)
    with pytest.raises(ValueError, match="num_pages must be >= 1"):
        Engine(CFG, PARAMS, num_pages=0)
    with pytest.raises(ValueError, match="power-of-two page_size, got 6"):
        Engine(CFG, PARAMS, kernels="pallas", page_size=6)
    with pytest.raises(ValueError, match="prefill_buckets must be positive and end at"):
        Engine(CFG, PARAMS, prefill_chunk=16, prefill_buckets=(8,))
    import mtpjax.api
    monkeypatch.setattr(mtpjax.api, "load_checkpoint",
                        lambda path, dtype, meshes=None, weights="auto", mtp_weights="auto":
                        (CFG, PARAMS))
    e = mtpjax.Engine.from_checkpoint("x", num_speculative_tokens=1, kernels="interpret",
                                      page_size=8, num_pages=7, max_lanes=2)
    assert (e.k, e.kernels, e.page_size, e.num_pages, e.max_lanes) == (1, "interpret", 8, 7, 2)
    assert [kv.k.shape for kv in e.cache.kv] == [(2, 7, 8, 16)] * 2    # 1 full layer + MTP
