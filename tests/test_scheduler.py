"""Allocator and scheduler on the host, with a mock model whose outputs are known by hand.

The mock keeps a host copy of the paged pool (page id -> slot -> token) and computes every
next token from the context it READS BACK THROUGH THE PAGE TABLE, so a page shared by two
lanes, a missing reservation or a page freed too early changes the outputs. Its "true" next
token after a context c is `oracle(c) = (sum(c) * 7 + len(c)) % V`; its drafts are right except
at positions divisible by 3, so accept, reject and rollback all happen. Every write the real
programs make (target KV at pos..pos+k, MTP KV up to pos+2k-1) is made by the mock too, and a
write to a position without a page fails the test.
"""

import random

import pytest

from mtpjax.engine.kv_pool import OutOfPagesError, PageAllocator, pages_for, tokens_touched_decode
from mtpjax.sampling import SamplingParams
from mtpjax.engine.scheduler import Request, RequestStats, Scheduler, SpeculationPolicy

V = 13


def oracle(ctx):
    return (sum(ctx) * 7 + len(ctx)) % V


# -------------------------------------------------------------------------------- allocator

def test_reserve_covers_positions_and_free_returns_pages():
    a = PageAllocator(num_pages=10, page_size=4, max_lanes=3, pages_per_lane=5)
    assert a.reserve(0, 5) == 2 and a.capacity(0) == 8
    assert a.reserve(0, 8) == 0                 # already covered
    assert a.reserve(1, 1) == 1
    assert a.free_pages == 7 and a.used_pages == 3
    owned = set(a.table[0, :2]) | set(a.table[1, :1])
    assert len(owned) == 3 and all(0 <= p < 10 for p in owned)
    assert (a.table[0, 2:] == 10).all() and (a.table[2] == 10).all()   # sentinel = num_pages
    a.check()
    assert a.free(0) == 2 and a.free_pages == 9 and (a.table[0] == 10).all()
    a.check()
    # freed pages are handed out again (LIFO)
    a.reserve(2, 8)
    assert set(a.table[2, :2]) == set(owned) - set(a.table[1, :1])
    a.check()


def test_out_of_pages_names_needed_and_free_and_allocates_nothing():
    a = PageAllocator(num_pages=4, page_size=2, max_lanes=2, pages_per_lane=4)
    a.reserve(0, 6)                             # 3 pages
    with pytest.raises(OutOfPagesError, match=r"out of pages: lane 1 needs 2 more page\(s\) "
                                              r"of 2 tokens, 1 free of 4") as e:
        a.reserve(1, 4)
    assert (e.value.needed, e.value.free) == (2, 1)
    assert a.owned(1) == 0 and a.free_pages == 1
    assert not a.can_reserve(1, 4) and a.can_reserve(1, 2)


def test_reservation_beyond_the_lane_table_is_a_value_error():
    a = PageAllocator(num_pages=8, page_size=4, max_lanes=1, pages_per_lane=2)
    with pytest.raises(ValueError, match="exceed the per-lane page table"):
        a.reserve(0, 9)


@pytest.mark.parametrize("bad", [dict(num_pages=0), dict(page_size=0), dict(max_lanes=0),
                                 dict(pages_per_lane=0)])
def test_allocator_sizes_should_be_positive(bad):
    kw = dict(num_pages=4, page_size=4, max_lanes=1, pages_per_lane=1) | bad
    with pytest.raises(ValueError, match="must be >= 1"):
        PageAllocator(**kw)


def test_draft_slot_reservation_rules():
    # decode at pos P with k drafts: target P..P+k, MTP re-run P..P+a, chain to P+a+k-1
    assert tokens_touched_decode(10, 3) == 10 + 2 * 3           # positions 10..15
    assert tokens_touched_decode(10, 1) == 12                   # target 10, 11; MTP 10, 11
    assert tokens_touched_decode(10, 0) == 11                   # depth 0: P only (MTP KV fill)
    assert pages_for(9, 4) == 3 and pages_for(8, 4) == 2 and pages_for(0, 4) == 0


# -------------------------------------------------------------------------------- mock loop

class MockModel:
    """Executes Plans against a host pool; see the module docstring."""

    def __init__(self, alloc: PageAllocator, k: int):
        self.alloc, self.k = alloc, k
        self.pool = {}          # (page, slot) -> token: the target KV
        self.mtp_pool = {}      # the MTP layer's KV (same page table, scratch here)
        self.last = {}          # lane -> (last token, pos)
        self.drafts = {}        # lane -> list of k drafts

    def write(self, lane, pos, tok, mtp=False):
        ps = self.alloc.page_size
        assert pos < self.alloc.capacity(lane), f"lane {lane} writes {pos} without a page"
        page = int(self.alloc.table[lane, pos // ps])
        (self.mtp_pool if mtp else self.pool)[(page, pos % ps)] = tok

    def context(self, lane, n):
        ps = self.alloc.page_size
        return [self.pool[(int(self.alloc.table[lane, p // ps]), p % ps)] for p in range(n)]

    def make_drafts(self, lane, ctx_len, first, start_pos, n):
        """n drafts for positions start_pos+1..: right unless the position is divisible by 3;
        the other of the k slots hold 0. Writes the MTP KV slots the real chain writes:
        start_pos .. start_pos+n-2."""
        ctx = self.context(lane, ctx_len) + [first]
        drafts = []
        for j in range(n):
            p = start_pos + 1 + j
            t = oracle(ctx)
            d = t if p % 3 else (t + 1) % V
            drafts.append(d)
            ctx = ctx + [d]
            if j > 0:
                self.write(lane, start_pos + j - 1, d, mtp=True)   # chained MTP step
        self.drafts[lane] = drafts + [0] * (self.k - n)

    def prefill(self, w):
        """A chunk only writes KV (target and MTP): it never samples or drafts."""
        for i, t in enumerate(w.tokens):
            self.write(w.lane, w.start + i, t)
            self.write(w.lane, w.start + i, t, mtp=True)

    def join(self, row):
        """A lane enters decode with its sequence's last token (steps.Join): no drafts."""
        self.last[row.lane] = (row.join_token, row.pos)
        self.drafts[row.lane] = [0] * self.k

    def restore(self, lane, fix):
        """A prefix hit's restore (snapshots.restore): GDN state is the mock's oracle, so only
        the MTP KV rewrite acts: page src copied into the lane's own page dst, then the MTP
        KV at L-1 written there with the request's token L."""
        if fix is None:
            return
        src, dst, token, pos = fix
        ps = self.alloc.page_size
        assert int(self.alloc.table[lane, pos // ps]) == dst, "the rewrite's page is not the lane's"
        for pool in (self.pool, self.mtp_pool):
            for j in range(ps):
                if (src, j) in pool:
                    pool[(dst, j)] = pool[(src, j)]
        self.write(lane, pos, token, mtp=True)

    def step(self, sched, plan):
        """Run a plan's restores, chunk and decode rows, report them, as the engine does."""
        for lane, _, fix in plan.restores:
            self.restore(lane, fix)
        for w in plan.prefills:
            self.prefill(w)
        results = []
        for r in plan.rows:
            if r.join_token is not None:
                self.join(r)
            results.append((r.lane, self.decode(r.lane, plan.depth)))
        for w in plan.prefills:
            slot = sched.prefill_done(w)
            if slot is not None:           # the engine saves the snapshot, then publishes
                sched.snapshot_saved(slot)
        for lane, (out, acc) in results:
            sched.decode_done(lane, out, acc, plan.depth)

    def move(self, src, dst):
        """A lane's device state moves with it (steps.move_lane); pages move by table."""
        for d in (self.last, self.drafts):
            if src in d:
                d[dst] = d.pop(src)

    def decode(self, lane, k):
        last, pos = self.last[lane]
        block = [last] + self.drafts.get(lane, [])[:k]
        for j, t in enumerate(block):
            self.write(lane, pos + j, t)             # target KV of the verify block
        out, acc = [], 0
        for j in range(len(block)):
            t = oracle(self.context(lane, pos + j + 1))
            out.append(t)
            if j < k and t == block[j + 1]:
                acc += 1
            else:
                break
        for j in range(acc + 1):
            self.write(lane, pos + j, out[j], mtp=True)   # MTP re-run over accepted pairs
        new_pos = pos + acc + 1
        self.last[lane] = (out[acc], new_pos)
        if self.k:
            self.make_drafts(lane, new_pos, out[acc], new_pos, k)
        return out, acc


def expected(prompt, n, stops=()):
    seq, out = list(prompt), []
    for _ in range(n):
        t = oracle(seq)
        out.append(t)
        seq.append(t)
        if t in stops:
            break
    return out


def run_mock(reqs, *, lanes, pages, page_size, k, chunk=5, max_seq_len=64, policy=None,
             cancel_at=None, prefill_rows=1, packed=None):
    pages_per_lane = pages_for(max_seq_len + 2 * k, page_size)
    alloc = PageAllocator(pages, page_size, lanes, pages_per_lane)
    streamed = {}
    sched = None

    def on_token(i, toks):
        streamed.setdefault(i, []).extend(toks)
        if cancel_at and i == cancel_at[0] and len(streamed[i]) >= cancel_at[1]:
            sched.cancel(i)

    sched = Scheduler(alloc, num_draft_slots=k, max_seq_len=max_seq_len, prefill_chunk=chunk,
                      policy=policy, on_token=on_token, prefill_rows=prefill_rows)
    for i, (p, sp) in enumerate(reqs):
        assert sched.pages_worst_case(len(p), sp.max_new_tokens) <= pages
        sched.add(Request(i, p, sp, frozenset(sp.stop_token_ids),
                          stats=RequestStats.for_depth(k)))
    m = MockModel(alloc, k)
    ks = []
    while sched.has_work():
        plan = sched.schedule()
        alloc.check()
        for src, dst in plan.moves:
            m.move(src, dst)
        busy = [b for b, ln in enumerate(sched.lanes) if ln is not None]
        assert busy == list(range(len(busy))), f"busy lanes {busy} are not compact"
        assert len(plan.prefills) <= prefill_rows
        lanes_pre = [w.lane for w in plan.prefills]     # oldest first, one chunk a lane
        assert len(set(lanes_pre)) == len(lanes_pre)
        assert [sched.lanes[b].req.id for b in lanes_pre] == sorted(
            sched.lanes[b].req.id for b in lanes_pre)
        if packed is not None:
            packed.append(len(plan.prefills))
        m.step(sched, plan)
        if plan.decode:
            ks.append(plan.depth)
        alloc.check()
    assert alloc.free_pages == pages
    return sched, streamed, ks


def random_requests(n, seed):
    rng = random.Random(seed)
    return [([rng.randrange(V) for _ in range(rng.randint(1, 20))],
             SamplingParams(max_new_tokens=rng.randint(1, 12))) for _ in range(n)]


@pytest.mark.parametrize("k,rows", [(0, 1), (1, 1), (3, 1), (0, 3), (3, 8)])
def test_mock_outputs_do_not_depend_on_lanes_pool_or_preemption(k, rows):
    """rows > 1: packed prefill (several lanes' chunks a step, each written through its own
    page table row): the same tokens, under preemption."""
    reqs = random_requests(200, seed=k)
    packed = []
    sched, streamed, ks = run_mock(reqs, lanes=8, pages=12, page_size=4, k=k,
                                   prefill_rows=rows, packed=packed)
    assert sched.preemptions > 0
    assert (max(packed) > 1) == (rows > 1), max(packed)
    for i, (p, sp) in enumerate(reqs):
        o = sched.finished[i]
        assert o.token_ids == expected(p, sp.max_new_tokens), i
        assert streamed[i] == o.token_ids
        assert o.finish_reason == "length"
    if k:
        assert sum(o.stats.accepted_tokens for o in sched.finished.values()) > 0
        assert min(ks) < k and k in ks   # pages ran short: the default policy went shallower


def test_mock_alternating_policy_and_busy_threshold():
    reqs = random_requests(40, seed=5)
    alt = lambda view: view.K if view.step % 2 else 0
    sched, _, ks = run_mock(reqs, lanes=4, pages=200, page_size=4, k=2, policy=alt)
    assert set(ks) == {0, 2}
    for i, (p, sp) in enumerate(reqs):
        assert sched.finished[i].token_ids == expected(p, sp.max_new_tokens)
    sched, _, ks = run_mock(reqs, lanes=4, pages=200, page_size=4, k=2,
                            policy=SpeculationPolicy(max_busy_lanes=2))
    assert set(ks) == {0, 2}              # full lanes -> 0, the drained tail -> 2
    for i, (p, sp) in enumerate(reqs):
        assert sched.finished[i].token_ids == expected(p, sp.max_new_tokens)


def test_policy_must_return_a_depth_in_range():
    reqs = random_requests(2, seed=1)
    for bad in (3, -1, 1.0):
        with pytest.raises(ValueError, match="must return a depth in 0..2"):
            run_mock(reqs, lanes=2, pages=100, page_size=4, k=2, policy=lambda view: bad)


def test_stop_tokens_and_context_limit():
    p = [1, 2, 3]
    free = expected(p, 12)
    stop = free[4]
    reqs = [(p, SamplingParams(max_new_tokens=12, stop_token_ids=(stop,))),
            ([5] * 10, SamplingParams(max_new_tokens=50))]
    sched, _, _ = run_mock(reqs, lanes=2, pages=60, page_size=4, k=2, max_seq_len=16)
    o = sched.finished[0]
    assert o.finish_reason == "stop" and o.token_ids == expected(p, 12, (stop,))
    assert o.token_ids[-1] == stop and len(o.token_ids) <= 5
    o = sched.finished[1]
    assert o.finish_reason == "length" and len(o.token_ids) == 16 - 10


def test_cancel_running_and_queued_requests():
    reqs = random_requests(6, seed=3)
    reqs = [(p, SamplingParams(max_new_tokens=12)) for p, _ in reqs]
    sched, streamed, _ = run_mock(reqs, lanes=1, pages=60, page_size=4, k=1,
                                  cancel_at=(0, 3))
    o = sched.finished[0]
    assert o.finish_reason == "cancelled" and 3 <= len(o.token_ids) < 12
    assert o.token_ids == expected(reqs[0][0], 12)[:len(o.token_ids)] == streamed[0]
    assert all(sched.finished[i].finish_reason == "length" for i in range(1, 6))
    # a queued request cancelled before it runs never emits
    alloc = PageAllocator(10, 4, 1, 10)
    s = Scheduler(alloc, num_draft_slots=0, max_seq_len=32, prefill_chunk=8)
    s.add(Request(0, [1], SamplingParams(), frozenset()))
    s.cancel(0)
    plan = s.schedule()
    assert not plan.prefills and not s.has_work()
    assert s.finished[0].finish_reason == "cancelled" and s.finished[0].token_ids == []


def test_worst_case_pages_of_a_request():
    alloc = PageAllocator(100, 4, 1, 100)
    s = Scheduler(alloc, num_draft_slots=2, max_seq_len=40, prefill_chunk=8)
    # prompt 10, 5 new: last step at pos 13 touches 13 + 2k = 17 tokens -> 5 pages
    assert s.pages_worst_case(10, 5) == 5
    # one new token: the join step at pos 9 (the prompt's last token) at depth k writes up to
    # 9 + 2k -> 13 tokens -> 4 pages
    assert s.pages_worst_case(10, 1) == 4
    # capped by the context limit: last pos 38 -> 42 tokens
    assert s.pages_worst_case(10, 1000) == pages_for(42, 4)
