"""Packed prefill: several lanes' prefill chunks in one step (Engine(prefill_rows=R)).

1. The program: a decode step carrying R packed rows (two lanes' chunks, one of them starting
   its sequence, and a padding row) equals those chunks run one at a time and then the step,
   array for array: tokens, accepted counts and every cache array (a padding row reads
   zeros and writes nothing, so the idle lane slots and the decoding lanes keep their state).
   The chunks alone (no lane decodes) likewise. In the reference path and in the Pallas
   kernels' interpret mode.
2. The engine, on the trained tiny checkpoint (drafts accepted and rejected past position 1):
   prompts that arrive together, with a shared prefix (prefix-cache hits and snapshots),
   (and the same prompts again: prefix-cache hits, restores and packed tails) give the same
   tokens packed and unpacked, speculative and plain, greedy and sampled;
   packed steps did run, and the step records carry no more than R chunks.
"""

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mtpjax
from mtpjax import model, steps
from mtpjax.sampling import LaneSampling, SamplingParams
from mtpjax.text import Tokenizer

from test_iteration import one_row_chunk
from tiny_models import VOCAB11_CFG as CFG, VOCAB11_PARAMS as PARAMS
from tiny_models import assert_drafts_accepted_and_rejected

K = 2
R = 3          # packed rows: two real chunks and a padding row


def _engine(k=K, **kw):
    kw = dict(max_lanes=4, max_seq_len=96, prefill_chunk=16, page_size=8,
              kernels="reference") | kw
    return mtpjax.Engine(CFG, PARAMS, num_speculative_tokens=k, **kw)


# ------------------------------------------------------------------------------ 1. program

def _setup():
    """Lanes 0 and 1 decoding (lane 0 past a page boundary), lane 2 halfway through its
    prompt, lane 3 idle; returns (engine, cache, state, table, seqs, chunk(b, s, n))."""
    e = _engine()
    rng = np.random.default_rng(0)
    B, T = 4, 16
    for b in range(B):
        e.alloc.reserve(b, 48)
    table = jnp.asarray(e.alloc.table[:B])
    seqs = [list(map(int, rng.integers(0, 11, n))) for n in (21, 10, 30, 12)]
    cache, state = e.cache, e.state
    # NaN-poison the pages no lane owns: a packed row that read or wrote outside its own
    # pages would carry the NaN into the compared arrays
    def poison(x):
        if not isinstance(x, model.PagedKV):
            return x
        owned = np.zeros(x.k.shape[1], bool)
        ids = np.asarray(table).ravel()
        owned[ids[(ids >= 0) & (ids < owned.size)]] = True
        free = jnp.asarray(~owned)[None, :, None, None]
        return model.PagedKV(jnp.where(free, jnp.nan, x.k), jnp.where(free, jnp.nan, x.v),
                             x.page_size)
    cache = jax.tree.map(poison, cache, is_leaf=lambda x: isinstance(x, model.PagedKV))
    assert any(np.isnan(np.asarray(x)).any() for x in jax.tree.leaves(cache))

    chunk = functools.partial(one_row_chunk, seqs, table, T)
    kw = dict(k=K, kernels="reference")
    for b, n in ((0, 16), (1, 9)):
        cache = steps.prefill_chunk(CFG, PARAMS, cache, chunk(b, 0, n), **kw)
    cache = steps.prefill_chunk(CFG, PARAMS, cache, chunk(0, 16, 4), **kw)
    cache = steps.prefill_chunk(CFG, PARAMS, cache, chunk(2, 0, 16), **kw)
    lanes = LaneSampling.from_params([SamplingParams(), SamplingParams(temperature=1.0, seed=4),
                                      SamplingParams(), SamplingParams()])
    join = steps.Join(jnp.asarray([True, True, False, False]), jnp.asarray([seqs[0][20],
                      seqs[1][9], 0, 0], jnp.int32), jnp.asarray([20, 9, 0, 0], jnp.int32))
    cache, state, _, _ = steps.decode_step(CFG, PARAMS, cache, state, lanes,
                                           jnp.asarray([True, True, False, False]), table,
                                           join, **kw)
    return e, cache, state, table, seqs, chunk, lanes


def _pack(chunks, table, lane_slots):
    """steps.Chunk of several one-row chunks packed into R rows (padding rows last)."""
    pad = R - len(chunks)
    cat = lambda xs, fill: jnp.concatenate(xs + [fill] * pad)
    vec = lambda name, fill: jnp.asarray(
        [int(getattr(c, name)) for c in chunks] + [fill] * pad, jnp.int32)
    T = chunks[0].tokens.shape[1]
    zeros = jnp.zeros((1, T), jnp.int32)
    return steps.Chunk(vec("lane", lane_slots), cat([c.tokens for c in chunks], zeros),
                       cat([c.next_tokens for c in chunks], zeros), vec("start", 0),
                       vec("n_valid", 0),
                       cat([c.page_table for c in chunks],
                           jnp.full((1, table.shape[1]), -1, jnp.int32)))


def _assert_same(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(y), np.asarray(x), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("kernels", ["reference", "interpret"])
def test_packed_chunks_riding_a_step_equal_the_chunks_one_by_one_then_the_step(kernels):
    e, cache, state, table, seqs, chunk, lanes = _setup()
    # lane 2 finishes its prompt ([16, 29)) and joins at 29; lane 3 starts its sequence
    # ([0, 11)); lanes 0 and 1 decode
    c2, c3 = chunk(2, 16, 13), chunk(3, 0, 11)
    active = jnp.asarray([True, True, True, False])
    join = steps.Join(jnp.asarray([False, False, True, False]),
                      jnp.asarray([0, 0, seqs[2][29], 0], jnp.int32),
                      jnp.asarray([0, 0, 29, 0], jnp.int32))
    kw = dict(k=K, kernels=kernels)
    cache, state = jax.tree.map(jnp.copy, (cache, state))
    a_cache, a_state = jax.tree.map(jnp.copy, (cache, state))
    for c in (c2, c3):
        a_cache = steps.prefill_chunk(CFG, PARAMS, a_cache, c, **kw)
    a = steps.decode_step(CFG, PARAMS, a_cache, a_state, lanes, active, table, join, **kw)
    packed = _pack([c2, c3], table, e.lane_slots)
    b = steps.decode_step(CFG, PARAMS, cache, state, lanes, active, table, join, packed, **kw)
    _assert_same(a, b)
    out, n_acc = np.asarray(b[2]), np.asarray(b[3])
    assert (out[:3, 0] >= 0).all() and out[3, 0] == -1 and n_acc[3] == 0


def test_packed_chunks_alone_equal_the_chunks_one_by_one():
    e, cache, state, table, seqs, chunk, lanes = _setup()
    c2, c3 = chunk(2, 16, 13), chunk(3, 0, 11)
    kw = dict(k=K, kernels="reference")
    a = jax.tree.map(jnp.copy, cache)
    for c in (c2, c3):
        a = steps.prefill_chunk(CFG, PARAMS, a, c, **kw)
    b = steps.prefill_chunk(CFG, PARAMS, cache, _pack([c2, c3], table, e.lane_slots), **kw)
    _assert_same(a, b)


# ------------------------------------------------------------------------------ 2. engine

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CKPT = os.path.join(REPO, "checkpoints", "tiny")
TEXTS = ["def add(a, b):\n    return", "import os\nimport sys\n\ndef main():\n",
         "class Stack:\n    def __init__(self):\n", "for i in range(10):\n    print(",
         "def fib(n):\n    if n < 2:\n        return n\n"]


@pytest.fixture(scope="module")
def runs():
    tok = Tokenizer.from_checkpoint(CKPT)
    head = tok.encode("# utilities for the service\nimport json\nimport time\n\n")
    # a shared head (a prefix-cache hit after the first prompt's snapshot) and lengths from a
    # few tokens to several chunks, all arriving at once
    prompts = [head + tok.encode(t) for t in TEXTS] + [tok.encode(t) for t in TEXTS[:3]]
    params = [SamplingParams(temperature=0.0, max_new_tokens=32) if i % 3 else
              SamplingParams(temperature=0.8, top_p=0.9, seed=i, max_new_tokens=32)
              for i in range(len(prompts))]
    out = {}
    for k, rows in ((0, 1), (3, 1), (0, 4), (3, 4)):
        e = mtpjax.Engine.from_checkpoint(CKPT, num_speculative_tokens=k, max_lanes=4,
                                          max_seq_len=160, prefill_chunk=16, page_size=8,
                                          prefill_rows=rows)
        e.reset_timing()
        first = e.generate(prompts, params)
        # again: now the prompts' heads are cached (restores, then packed tails)
        out[k, rows] = (e, first + e.generate(prompts, params))
    return out


def test_packed_prefill_gives_the_unpacked_tokens(runs):
    _, base = runs[0, 1]
    for key, (e, outs) in runs.items():
        for a, b in zip(base, outs):
            assert b.token_ids == a.token_ids, key
            assert b.finish_reason == a.finish_reason and b.error is None, key
    assert_drafts_accepted_and_rejected(runs[3, 4][1])


def test_packed_steps_ran_and_took_fewer_launches(runs):
    for k in (0, 3):
        (e1, _), (e4, _) = runs[k, 1], runs[k, 4]
        t1, t4 = e1.timing, e4.timing
        assert t1["packed_steps"] == 0 and t4["packed_steps"] > 0, (t1, t4)
        # about the same chunks (packing moves when a snapshot is saved, so which prompt hits
        # the cache can change) in fewer programs: each packed step carried two or more
        assert abs(t4["prefill_chunks"] - t1["prefill_chunks"]) <= 2, (t1, t4)
        assert t4["mixed_steps"] < t1["mixed_steps"], (t1, t4)
        packed = [p for p in e4.stats()["programs"] if len(p) == (5 if p[0] == "mixed" else 3)
                  and p[0] in ("mixed", "prefill")]
        assert packed and all(p[-1] == 4 and p[-2] in (8, 16) for p in packed), packed
        st = e4.stats()
        assert st["free_pages"] == st["total_pages"]
        assert st["prefix_cache"]["hits"] > 0


def test_prefill_rows_is_checked():
    with pytest.raises(ValueError, match=r"prefill_rows must be in \[1, max_lanes=4\]"):
        _engine(prefill_rows=5)
    with pytest.raises(ValueError, match="prefill_rows"):
        _engine(prefill_rows=0)
    assert _engine(max_lanes=2).prefill_rows == 2 and _engine().prefill_rows == 4


# ------------------------------------------------------------------------------ 3. on the GPU

def test_packed_programs_compile_for_the_h200_with_caches_in_place():
    """The packed programs with the Pallas kernels compile deviceless for an H200 (the
    trained tiny's widths, bf16): donated caches stay aliased (the chunks' GDN slots are
    gathered and scattered back in place) and no weight is copied."""
    import sys
    sys.path.insert(0, REPO)
    from experiments import aot_programs
    from mtpjax.config import Config
    cfg = Config.from_pretrained(CKPT)
    progs = aot_programs.build_programs(cfg, lanes=4, max_seq_len=256, K=2, kernels="pallas",
                                        dtype="bfloat16", page_size=16, prefill_chunk=32,
                                        depths=[], mixed_depths=[2], packed_rows=4)
    packed = {p.name: p for p in progs if p.name.endswith("x4")}
    assert set(packed) == {"mixed_k2_t32x4", "prefill_t32x4"}
    device = aot_programs.target_device("h200")
    for name, prog in packed.items():
        r = aot_programs.compile_program(prog, device)
        assert r["donation"]["not_aliased"] == [], (name, r["donation"])
        assert r["weight_copy_bytes"] == 0, name
