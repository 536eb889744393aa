"""Host-side page allocator for the paged KV pool (`model.PagedKV`).

The device holds one pool of `num_pages` pages of `page_size` tokens per attention layer; every
layer and the MTP layer use the same page ids, so one page table per lane serves them all. This
module owns that table as a numpy array, i32[max_lanes, pages_per_lane]: entry j of lane b is
the page that holds the lane's positions [j * page_size, (j + 1) * page_size). Entries a lane
does not own hold the sentinel `pool_pages` (the device pool's size, by default `num_pages`:
out of range): `pallas_kernels.write_kv` drops writes routed there, so a missing reservation
can never overwrite another lane's page.

The table is checked every time it is read (`PageAllocator.table`, which the engine reads
before every program call): an owned entry outside [0, num_pages), an entry past the lane's
pages that is not the sentinel, or a page held twice raises `CorruptPageTableError`
naming the lane and entry. Inside a program nothing can raise, so the kernels add a backstop:
rows that need a page id outside the pool come out NaN (pallas_kernels.paged_attention).

Pages are allocated incrementally as a sequence grows (`reserve(lane, n_tokens)` makes sure
positions [0, n_tokens) have pages) and all released at once when the lane's request ends or is
preempted (`free(lane)`). Pages are reference counted for the prefix cache
(mtpjax/engine/prefix_cache.py): a cache entry `hold`s the pages of a prompt prefix, a request that
hits it `share`s them (its table starts with them; it never writes below the prefix), and a
page returns to the free list when its last holder lets go. Held pages are "frozen": only they
may appear in several lanes' tables. When the free list is short, `reserve` first asks the
cache to evict (`reclaimer`), so cached pages give way before any request is preempted;
`available` counts free pages plus those the cache could give back. Freed pages go on top of a LIFO free list, so page tables become
scrambled permutations of the pool after a little churn (the kernels must not care).

How many tokens a step touches is the caller's business; `tokens_touched_*` below are the rules
for the engine's programs (see steps.py): a decode step of depth d writes target KV at
pos..pos+d and MTP KV at pos..pos+2d-1.
"""

from __future__ import annotations

import numpy as np


class OutOfPagesError(RuntimeError):
    """The pool cannot cover a reservation: `needed` more pages, only `free` left."""

    def __init__(self, lane: int, needed: int, free: int, total: int, page_size: int):
        self.lane, self.needed, self.free, self.total = lane, needed, free, total
        super().__init__(f"out of pages: lane {lane} needs {needed} more page(s) of "
                         f"{page_size} tokens, {free} free of {total}")


class CorruptPageTableError(ValueError):
    """The page table holds an entry the allocator never handed out (names lane and entry)."""

    def __init__(self, lane: int, entry: int, page: int, what: str):
        self.lane, self.entry, self.page = lane, entry, page
        super().__init__(f"corrupt page table: lane {lane} entry {entry} holds page {page}: "
                         f"{what}")


def validate_page_table(table: np.ndarray, owned, num_pages: int, shared=None,
                        sentinel: int | None = None) -> None:
    """Host-side check of a page table i32[lanes, pages_per_lane] against what each lane owns.

    Lane b owns entries [0, owned[b]): each must be a page id in [0, num_pages), and no page
    may appear twice in the whole table (except pages marked in `shared`, bool[num_pages]: the
    prefix cache's read-only pages); every entry past them must be `sentinel` (default
    num_pages; the device pool's size, so its writes are dropped). Raises
    CorruptPageTableError for the first violation.
    Vectorised: a few microseconds for an engine's table, cheap enough for every step.
    """
    sentinel = num_pages if sentinel is None else sentinel
    table = np.asarray(table)
    owned = np.asarray(owned)
    own = np.arange(table.shape[1])[None, :] < owned[:, None]
    out = own & ((table < 0) | (table >= num_pages))
    if out.any():
        b, j = map(int, np.argwhere(out)[0])
        raise CorruptPageTableError(b, j, int(table[b, j]),
                                    f"outside the pool [0, {num_pages})")
    stray = ~own & (table != sentinel)
    if stray.any():
        b, j = map(int, np.argwhere(stray)[0])
        raise CorruptPageTableError(b, j, int(table[b, j]),
                                    f"past the lane's {int(owned[b])} owned page(s), where "
                                    f"only the sentinel {sentinel} may stand")
    ids = table[own]
    counts = np.bincount(ids, minlength=num_pages)
    dup = counts > 1
    if shared is not None:
        dup &= ~np.asarray(shared)
    if dup.any():
        page = int(np.flatnonzero(dup)[0])
        holders = [tuple(map(int, x)) for x in np.argwhere(own & (table == page))]
        (b, j), (b0, j0) = holders[-1], holders[0]
        raise CorruptPageTableError(b, j, page, f"also held by lane {b0} entry {j0}")


def pages_for(n_tokens: int, page_size: int) -> int:
    return -(-max(int(n_tokens), 0) // page_size)


def tokens_touched_decode(pos: int, depth: int) -> int:
    """KV positions [0, result) written by a decode step at `pos` verifying `depth` drafts:
    target pos..pos+depth, MTP pos..pos+a (a <= depth accepted) then depth-1 chained drafts,
    at most pos + 2 * depth - 1; a depth-0 step writes the MTP KV at pos only."""
    return pos + 1 + max(2 * depth - 1, 0)


class PageAllocator:
    """Free list + per-lane page tables for a pool of `num_pages` pages.

    pool_pages: the device pool's size (default num_pages); the allocator hands out ids
    [0, num_pages) only and marks unowned entries with `sentinel` = pool_pages, outside the
    device pool, so their writes are dropped. A pool larger than the page budget lets engines
    with different budgets share one pool shape, hence one set of compiled programs.
    """

    def __init__(self, num_pages: int, page_size: int, max_lanes: int, pages_per_lane: int,
                 pool_pages: int | None = None):
        pool_pages = num_pages if pool_pages is None else int(pool_pages)
        for name, v in (("num_pages", num_pages), ("page_size", page_size),
                        ("max_lanes", max_lanes), ("pages_per_lane", pages_per_lane)):
            if v < 1:
                raise ValueError(f"{name} must be >= 1, got {v}")
        if pool_pages < num_pages:
            raise ValueError(f"pool_pages ({pool_pages}) must be >= num_pages ({num_pages})")
        self.num_pages, self.page_size = num_pages, page_size
        self.sentinel = pool_pages
        self.max_lanes, self.pages_per_lane = max_lanes, pages_per_lane
        self._table = np.full((max_lanes, pages_per_lane), self.sentinel, np.int32)
        self._owned = [0] * max_lanes              # pages held by each lane (a table prefix)
        self._free = list(range(num_pages - 1, -1, -1))   # pop() hands out 0, 1, 2, ... first
        self._refs = np.zeros(num_pages, np.int32)      # holders: lane tables + cache holds
        self._held = np.zeros(num_pages, np.int32)      # holds by the prefix cache
        self._frozen = np.zeros(num_pages, bool)        # read-only (published to the cache)
        # set by the prefix cache: reclaimer(n) evicts until n pages are free (or nothing is
        # left to evict); reclaimable() = pages evicting everything would free
        self.reclaimer = None
        self.reclaimable = lambda: 0

    @property
    def table(self) -> np.ndarray:
        """The page table i32[max_lanes, pages_per_lane], validated on every read
        (`validate_page_table`): what the engine sends to the device is never corrupt."""
        validate_page_table(self._table, self._owned, self.num_pages, self._frozen,
                            self.sentinel)
        return self._table

    @property
    def free_pages(self) -> int:
        """Pages on the free list."""
        return len(self._free)

    @property
    def available(self) -> int:
        """Pages a request can get now: free, or held only by the prefix cache (evicted on
        demand by `reserve`)."""
        return len(self._free) + self.reclaimable()

    @property
    def held_pages(self) -> int:
        """Pages the prefix cache holds (some may be shared with lanes)."""
        return int((self._held > 0).sum())

    def cache_only(self) -> np.ndarray:
        """bool[num_pages]: pages held by the prefix cache and by no lane."""
        return (self._held > 0) & (self._refs == self._held)

    @property
    def used_pages(self) -> int:
        return self.num_pages - len(self._free)

    def owned(self, lane: int) -> int:
        return self._owned[lane]

    def capacity(self, lane: int) -> int:
        """Tokens the lane's pages cover now."""
        return self._owned[lane] * self.page_size

    def needed(self, lane: int, n_tokens: int) -> int:
        """More pages the lane needs so that positions [0, n_tokens) are covered."""
        want = pages_for(n_tokens, self.page_size)
        if want > self.pages_per_lane:
            raise ValueError(f"lane {lane}: {n_tokens} tokens exceed the per-lane page table "
                             f"({self.pages_per_lane} pages of {self.page_size} tokens)")
        return max(want - self._owned[lane], 0)

    def can_reserve(self, lane: int, n_tokens: int) -> bool:
        return self.needed(lane, n_tokens) <= self.available

    def _ensure_free(self, n: int) -> None:
        if n > len(self._free) and self.reclaimer is not None:
            self.reclaimer(n)

    def _pop(self) -> int:
        p = self._free.pop()
        self._refs[p] = 1
        return p

    def _release(self, pages) -> None:
        for p in pages:
            p = int(p)
            if not 0 <= p < self.num_pages or self._refs[p] < 1:
                continue     # a corrupted table entry (the step that read it has raised)
            self._refs[p] -= 1
            if self._refs[p] == 0:
                self._frozen[p] = False
                self._free.append(p)

    def reserve(self, lane: int, n_tokens: int) -> int:
        """Allocate pages so that lane positions [0, n_tokens) are covered; returns how many
        pages were added (evicting cached pages first when the free list is short). Raises
        OutOfPagesError (and allocates nothing) when short."""
        need = self.needed(lane, n_tokens)
        self._ensure_free(need)
        if need > len(self._free):
            raise OutOfPagesError(lane, need, len(self._free), self.num_pages, self.page_size)
        for _ in range(need):
            self._table[lane, self._owned[lane]] = self._pop()
            self._owned[lane] += 1
        return need

    def free(self, lane: int) -> int:
        """Let go of all of the lane's pages (each returns to the pool unless the prefix cache
        or another lane still holds it); returns how many the lane held."""
        n = self._owned[lane]
        self._release(self._table[lane, :n][::-1])
        self._table[lane] = self.sentinel
        self._owned[lane] = 0
        return n

    # ---------------------------------------------------------------- prefix cache
    def lane_pages(self, lane: int) -> list[int]:
        return [int(p) for p in self._table[lane, :self._owned[lane]]]

    def share(self, lane: int, pages) -> None:
        """Start the empty lane's table with cached (held) pages: a prefix hit."""
        pages = [int(p) for p in pages]
        if self._owned[lane]:
            raise ValueError(f"lane {lane} already holds {self._owned[lane]} pages")
        if len(pages) > self.pages_per_lane:
            raise ValueError(f"{len(pages)} shared pages exceed the per-lane table")
        if not all(self._frozen[p] for p in pages):
            raise ValueError("only pages held by the prefix cache can be shared")
        self._table[lane, :len(pages)] = pages
        self._owned[lane] = len(pages)
        self._refs[pages] += 1

    def copy_on_write(self, lane: int, index: int) -> tuple[int, int]:
        """Give the lane a page of its own at table index `index` in place of the shared one
        it holds there (a prefix hit whose last cached page it must change: its MTP KV at the
        boundary's last position, snapshots.Rewrite); returns (shared page, new page). The
        new page is taken while the lane still holds the shared one, so they differ; the
        device copies one into the other before anything writes either. Raises
        OutOfPagesError (the lane keeps the shared page) when the pool has no page."""
        if not 0 <= index < self._owned[lane]:
            raise ValueError(f"lane {lane} holds {self._owned[lane]} pages, not index {index}")
        self._ensure_free(1)
        if not self._free:
            raise OutOfPagesError(lane, 1, 0, self.num_pages, self.page_size)
        src, dst = int(self._table[lane, index]), self._pop()
        self._table[lane, index] = dst
        self._release([src])
        return src, dst

    def hold(self, pages) -> None:
        """The prefix cache keeps these (owned) pages; they become read-only (frozen)."""
        for p in pages:
            if self._refs[p] < 1:
                raise ValueError(f"page {p} is free: only pages in use can be held")
            self._refs[p] += 1
            self._held[p] += 1
            self._frozen[p] = True

    def take(self, n: int) -> list[int] | None:
        """n pages held by the cache outside any table (what a snapshot costs), evicting cached
        pages when short; None (nothing taken) when the pool cannot give them."""
        self._ensure_free(n)
        if n > len(self._free):
            return None
        pages = [self._pop() for _ in range(n)]
        self._held[pages] += 1
        self._frozen[pages] = True
        return pages

    def frees_any(self, pages) -> bool:
        """Whether letting go of one cache hold on each of `pages` (`unhold`) would return a
        page to the free list: one of them has that hold as its only holder."""
        return any(self._refs[p] == 1 for p in pages)

    def unhold(self, pages) -> None:
        """The prefix cache lets go of pages it held (hold or take)."""
        for p in pages:
            if self._held[p] < 1:
                raise ValueError(f"page {p} is not held by the cache")
            self._held[p] -= 1
        self._release(pages)

    def move(self, src: int, dst: int) -> None:
        """Hand lane src's pages (and table row) to the empty lane dst (lane compaction)."""
        if self._owned[dst] or src == dst:
            raise ValueError(f"cannot move lane {src} onto lane {dst}: it holds "
                             f"{self._owned[dst]} pages")
        self._table[dst], self._owned[dst] = self._table[src], self._owned[src]
        self._table[src], self._owned[src] = self.sentinel, 0

    def free_page_ids(self) -> np.ndarray:
        return np.array(sorted(self._free), np.int32)

    def check(self) -> None:
        """Invariants (tests): the table is valid (`validate_page_table`); every page's
        reference count is its table entries plus its cache holds; the free list holds
        exactly the pages nobody holds, once each."""
        validate_page_table(self._table, self._owned, self.num_pages, self._frozen,
                            self.sentinel)
        owned = [int(p) for b in range(self.max_lanes) for p in self._table[b, :self._owned[b]]]
        uses = np.bincount(np.asarray(owned, np.int64), minlength=self.num_pages) + self._held
        if (uses != self._refs).any():
            p = int(np.flatnonzero(uses != self._refs)[0])
            raise AssertionError(f"page accounting broken: page {p} has {self._refs[p]} "
                                 f"references, {uses[p]} holders")
        if sorted(self._free) != [int(p) for p in np.flatnonzero(self._refs == 0)]:
            raise AssertionError(f"page accounting broken: free list {sorted(self._free)}, "
                                 f"unreferenced {np.flatnonzero(self._refs == 0).tolist()}")
