"""Prefix cache for the hybrid model: KV pages plus Gated DeltaNet snapshots, host side.

A full-attention engine can reuse any cached KV page whose tokens match. Qwen3.5's 48 Gated
DeltaNet layers have no per-token cache: their recurrent state and conv tail at position L
summarise the whole prefix, so a prefix is reusable only where that state was saved. An entry
is therefore a *boundary* L (a multiple of the page size) with:

  - the pages of positions [0, L): full-attention KV and MTP KV (one page id serves every
    layer), held by reference count in the page pool (kv_pool.PageAllocator.hold);
  - a snapshot slot: every GDN layer's recurrent state and conv tail after position L-1
    (mtpjax/engine/snapshots.py holds them on the device);
  - its key: the tokens [0, L] -- one past the boundary. The MTP KV at position L-1 is made
    from the target's hidden state at L-1 AND the embedding of token L (spec §5.3), so the
    last cached page is right only for requests whose token L matches too. A hit needs the
    request to have token L anyway: the prefill after the hit starts at L and must feed at
    least one token to sample the first output.

Keys are a hash chain over page-sized blocks (block i's hash covers blocks 0..i), plus token
L; a hit compares the stored tokens too, so a hash collision can never serve wrong state. An
engine without speculation writes no MTP KV, and its keys leave token L out
(`next_token_in_key=False`). The cost of the extra token: requests that share a prefix ending
exactly at a boundary but differ right after it reuse only up to the previous boundary (each
such variant caches its own entry at the boundary when it prefills).

Where snapshots are taken: at the ends of prefill chunks. The scheduler cuts a sequence into
chunks at multiples of the chunk length (the iteration's prefill token budget), the same
positions for every request, and after a chunk that ends on a page boundary (at least
`every_blocks` pages past the lane's previous snapshot) the engine saves the lane's GDN state
into a new entry's slot. With a chunk length that is a multiple of the page size (the
defaults), every chunk end but the last is such a boundary. So the chunk length is
set by the token budget, not by snapshots, and a prompt of n tokens makes at most
n / chunk entries.

An entry is published (visible to lookups) only once its snapshot is saved on the device
(`insert` makes it pending, `publish` after the save): a save that fails leaves no entry
whose state was never written.

Budget: cached KV pages are pages of the request pool, which requests take back on demand
(reclaim before preemption), so the cache never lowers request capacity. Snapshots live in a
fixed number of device slots beside the pool (the engine's `prefix_snapshots`; their bytes are
reported); `snapshot_pages` > 0 would also charge each live snapshot that many pool pages
(`PageAllocator.take`), for a deployment that wants snapshots to compete with requests for
one budget (the engine uses 0: its slots are allocated up front). Entries are evicted LRU
when a slot or pages are needed, entries never hit before entries that were (so one long
prompt's many fresh entries cannot push out a hot system prompt); a running request's pages are never evicted (the request holds its own
references), only the cache's hold on them. Eviction frees an entry's snapshot slot at once:
a request that hit it has already copied the snapshot into its lane (the restore runs before
any later save can reuse the slot).
"""

from __future__ import annotations

import collections
import dataclasses

from mtpjax.engine.kv_pool import PageAllocator


def block_hashes(tokens, page_size: int) -> list[int]:
    """Hash chain over the full page-sized blocks of `tokens`: entry i covers blocks 0..i."""
    out, h = [], 0
    for i in range(len(tokens) // page_size):
        h = hash((h, tuple(tokens[i * page_size:(i + 1) * page_size])))
        out.append(h)
    return out


@dataclasses.dataclass(eq=False)
class Entry:
    length: int                  # L: the prefix [0, L) is cached
    tokens: tuple[int, ...]      # tokens [0, L] (the prefix and the token after it), or
                                 # [0, L) when next tokens are not keyed
    pages: tuple[int, ...]       # page ids of positions [0, L)
    slot: int                    # snapshot slot on the device
    charge: tuple[int, ...]      # pool pages the snapshot is charged
    key: tuple = ()              # its key in the table
    hits: int = 0                # lookups it served


@dataclasses.dataclass
class PrefixCacheStats:
    lookups: int = 0             # admissions that looked the cache up
    hits: int = 0
    lookup_tokens: int = 0       # prompt tokens of those admissions
    tokens_reused: int = 0       # prompt tokens whose prefill hits skipped
    inserted: int = 0
    evicted: int = 0


class PrefixCache:
    """Entries (boundary -> pages + snapshot slot), LRU, on top of a PageAllocator.

    num_slots: snapshot slots on the device; snapshot_pages: pool pages one snapshot is
    charged; every_blocks: the periodic snapshot stride in blocks (pages)."""

    def __init__(self, alloc: PageAllocator, *, num_slots: int, snapshot_pages: int,
                 snapshot_bytes: int = 0, every_blocks: int = 4, next_token_in_key: bool = True):
        if num_slots < 1:
            raise ValueError(f"the prefix cache needs at least one snapshot slot, got {num_slots}")
        if every_blocks < 1:
            raise ValueError(f"every_blocks must be >= 1, got {every_blocks}")
        self.alloc, self.page_size = alloc, alloc.page_size
        self.num_slots, self.snapshot_pages = num_slots, snapshot_pages
        self.snapshot_bytes, self.every_blocks = snapshot_bytes, every_blocks
        self.extra = int(next_token_in_key)      # key tokens past the boundary: 1 or 0
        self.entries: collections.OrderedDict[tuple, Entry] = collections.OrderedDict()  # LRU first
        self.pending: dict[int, Entry] = {}      # slot -> entry whose snapshot is being saved
        self.free_slots = list(range(num_slots - 1, -1, -1))
        self.stats = PrefixCacheStats()
        alloc.reclaimer, alloc.reclaimable = self._reclaim, self.reclaimable

    # ---------------------------------------------------------------- lookup
    def _key(self, hashes: list[int], tokens, L: int) -> tuple:
        return (hashes[L // self.page_size - 1],) + tuple(int(t) for t in tokens[L:L + self.extra])

    def lookup(self, tokens) -> Entry | None:
        """The longest cached prefix of `tokens` that leaves at least one token to prefill
        (L < len(tokens)), or None; touches the entry (LRU). `admitted` counts it."""
        n = len(tokens)
        if n < 2 or not self.entries:
            return None
        hashes = block_hashes(tokens[:n - 1], self.page_size)
        for L in range(len(hashes) * self.page_size, 0, -self.page_size):
            e = self.entries.get(self._key(hashes, tokens, L))
            if e is not None and e.tokens == tuple(tokens[:L + self.extra]):
                self.entries.move_to_end(self._key(hashes, tokens, L))
                e.hits += 1
                return e
        return None

    def admitted(self, n_tokens: int, hit: Entry | None) -> None:
        """Count an admission of a sequence of n_tokens that looked the cache up."""
        self.stats.lookups += 1
        self.stats.lookup_tokens += n_tokens
        if hit is not None:
            self.stats.hits += 1
            self.stats.tokens_reused += hit.length

    # ---------------------------------------------------------------- insert / evict
    def insert(self, tokens, L: int, lane: int) -> int | None:
        """Cache the prefix [0, L) that `lane` has just prefilled (its pages cover it; token L
        is known). Returns the snapshot slot the engine must save the lane's GDN state into,
        then `publish`, or None (already cached or pending: touched; or the pool cannot give
        the snapshot's pages). The entry holds its pages and slot from now on."""
        if L <= 0 or L % self.page_size or L >= len(tokens):
            raise ValueError(f"a boundary must be a positive multiple of {self.page_size} "
                             f"below the sequence length {len(tokens)}, got {L}")
        hashes = block_hashes(tokens[:L], self.page_size)
        key = self._key(hashes, tokens, L)
        if key in self.entries:
            self.entries.move_to_end(key)
            return None
        if any(e.key == key for e in self.pending.values()):
            return None
        pages = self.alloc.lane_pages(lane)[:L // self.page_size]
        if len(pages) < L // self.page_size:
            raise ValueError(f"lane {lane} holds {len(pages)} pages, the prefix needs "
                             f"{L // self.page_size}")
        self.alloc.hold(pages)              # first: eviction below must not free them
        if not self.free_slots:
            self._evict()
        charge = self.alloc.take(self.snapshot_pages) if self.free_slots else None
        if charge is None:
            self.alloc.unhold(pages)
            return None
        slot = self.free_slots.pop()
        self.pending[slot] = Entry(L, tuple(int(t) for t in tokens[:L + self.extra]),
                                   tuple(pages), slot, tuple(charge), key)
        return slot

    def publish(self, slot: int) -> None:
        """The snapshot of pending entry `slot` is on the device: lookups may serve it."""
        e = self.pending.pop(slot)
        self.entries[e.key] = e
        self.stats.inserted += 1

    def abandon_pending(self) -> None:
        """Drop every entry whose snapshot was never saved (a failed step): pages and slots
        return, nothing was published."""
        for e in self.pending.values():
            self.alloc.unhold(e.pages + e.charge)
            self.free_slots.append(e.slot)
        self.pending.clear()

    def _evict(self) -> bool:
        """Evict one entry: the least recently used of those never hit, else the least
        recently used (a segmented LRU: hit entries are protected from a stream of cold
        ones)."""
        if not self.entries:
            return False
        key = next((k for k, e in self.entries.items() if e.hits == 0),
                   next(iter(self.entries)))
        e = self.entries.pop(key)
        self.alloc.unhold(e.pages + e.charge)
        self.free_slots.append(e.slot)
        self.stats.evicted += 1
        return True

    def _reclaim(self, n: int) -> None:
        """Evict LRU entries until n pages are free or nothing is cached."""
        while self.alloc.free_pages < n and self._evict():
            pass

    def reclaimable(self) -> int:
        """Pages that evicting every entry would free (held by the cache and no lane; not a
        pending entry's: its snapshot save may still be in flight, it cannot be evicted)."""
        if not self.entries:
            return 0
        only = self.alloc.cache_only()
        for e in self.pending.values():
            only[list(e.pages + e.charge)] = False
        return int(only.sum())

    def clear(self) -> None:
        self.abandon_pending()
        while self._evict():
            pass

    # ---------------------------------------------------------------- report
    def report(self) -> dict:
        s = self.stats
        return {"lookups": s.lookups, "hits": s.hits,
                "hit_rate": s.hits / s.lookups if s.lookups else 0.0,
                "tokens_reused": s.tokens_reused,
                "reused_fraction": s.tokens_reused / s.lookup_tokens if s.lookup_tokens else 0.0,
                "snapshots": len(self.entries), "snapshot_slots": self.num_slots,
                "snapshot_slots_free": len(self.free_slots),
                "snapshots_pending": len(self.pending),
                "snapshot_bytes": len(self.entries) * self.snapshot_bytes,
                "slot_bytes": self.num_slots * self.snapshot_bytes,
                "cached_pages": self.alloc.held_pages,
                "inserted": s.inserted, "evicted": s.evicted}
