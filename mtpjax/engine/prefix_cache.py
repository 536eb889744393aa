"""Prefix cache for the hybrid model: KV pages plus Gated DeltaNet snapshots, host side.

A full-attention engine can reuse any cached KV page whose tokens match. Qwen3.5's 48 Gated
DeltaNet layers have no per-token cache: their recurrent state and conv tail at position L
summarise the whole prefix, so a prefix is reusable only where that state was saved. An entry
is therefore a *boundary* L (a multiple of the page size) with:

  - the pages of positions [0, L): full-attention KV and MTP KV (one page id serves every
    layer), held by reference count in the page pool (kv_pool.PageAllocator.hold);
  - a snapshot slot: every GDN layer's recurrent state and conv tail after position L-1
    (mtpjax/engine/snapshots.py holds them on the device);
  - its key: the tokens [0, L). A hit needs the request to have token L too: the prefill
    after the hit starts at L and must feed at least one token to sample the first output;
  - on an MTP engine (`mtp_kv=True`), the token L it was prefilled with (`next_token`). The
    MTP KV at position L-1 is made from the target's hidden state at L-1 AND the embedding
    of token L (spec §5.3), so the last cached page is right as it is only for requests
    whose token L matches. A hit whose token L differs (`needs_rewrite`: requests that share
    a system prompt ending exactly at a boundary, each with its own message) gets a page of
    its own in place of the last one, and the restore rewrites the MTP KV at L-1 there from
    h(L-1), which the snapshot keeps (snapshots.Rewrite): every such request hits at L.

Keys are a hash chain over page-sized blocks (block i's hash covers blocks 0..i); a hit
compares the stored tokens too, so a hash collision can never serve wrong state.

Which boundaries a prompt inserts (`PrefixCache.keeps`): snapshots are taken at the ends of
prefill chunks, which the scheduler cuts at multiples of the chunk length (the iteration's
prefill token budget), the same positions for every request, and, with the cache, at the
sequence's last page boundary. Of those, a prompt inserts
  - its *head*: its last page boundary, the deepest state its prefill reaches. The next turn
    of a conversation is this prompt + the reply + a new message, so the head is what that
    turn reuses (all of the previous prompt but < one page); an n > 1 request's siblings
    reuse it too (the scheduler holds them until it is published);
  - its *junction* (`is_junction`): the chunk end where its tokens leave the path of a
    cached entry (the last chunk end to which some entry's prefix matches it, the next one
    not), checked as its prefill reaches each chunk end. The prefix it shares with an
    earlier prompt (a system prompt, a tool preamble) is then cached to within a chunk for
    every later prompt (as SGLang's mamba radix cache checkpoints its branching points),
    and, shared by two prompts, it counts as a hit (rank 1 below). A next turn of a
    conversation extends its previous head, so its prefill (from that head) meets no path;
  - the boundaries on a doubling grid, L = g * 2^j with g = every_blocks pages (64 tokens
    with the defaults), where a chunk ends there: before any junction is known, a prefix this
    prompt shares with a later one is reused to at least half its length, whatever that
    length is (when the chunk length divides g, as with the defaults, every grid point is a
    chunk end).
So a prompt of n tokens inserts at most log2(n / g) + 3 entries (a 2,000-token prompt: 7 at
the defaults, not one per chunk), and a long prompt cannot flood the slots.
A denser grid costs one GDN snapshot (151 MB at 27B, the HBM of ~2,350 tokens of KV) per
boundary for reuse that only a prompt diverging inside the long prompt could use.

An entry is published (visible to lookups) only once its snapshot is saved on the device
(`insert` makes it pending, `publish` after the save): a save that fails leaves no entry
whose state was never written.

Budget: cached KV pages are pages of the request pool, which requests take back on demand
(reclaim before preemption), so the cache never lowers request capacity. Snapshots live in a
fixed number of device slots beside the pool (the engine's `prefix_snapshots`; their bytes are
reported); `snapshot_pages` > 0 would also charge each live snapshot that many pool pages
(`PageAllocator.take`), for a deployment that wants snapshots to compete with requests for
one budget (the engine uses 0: its slots are allocated up front).

Eviction (`_victim`), when a slot or pages are needed. Entries are one list in order of last
use (insert or hit: LRU, as vLLM's free-block queue and SGLang's radix-tree leaves), and each
has a rank (`_rank`); the least recently used entry of the lowest rank goes first:
  0. every other entry: a grid boundary no request has hit for `live_s` seconds (default
     10 minutes), a superseded head, an idle head;
  1. a shared prefix in use: an entry that served a hit, or was a junction, within live_s
     (a system prompt that new conversations start from);
  2. a *live head*: a head used within live_s (a conversation waiting on a tool or its user).
Ranks expire with time (no hit count: an entry hot once ages like any other), so nothing
lives forever on past use. A conversation's newest entry is kept for its next turn ahead of
every older or shallower entry, and a long prompt from another client evicts its own and other
stale entries first. A grid boundary or a junction evicts only rank 0 (else it is not
inserted: an unproven boundary is not worth a prefix in use, let alone a live conversation's
next turn); a head evicts any rank, so with only live heads left a new one evicts the least
recently used (the oldest conversation). A head that a deeper head of the same path
supersedes (the conversation's next turn published its own) is no head any more, and the hit
that turn made does not count as sharing.

Reclaiming KV pages for requests (the pool is short: running requests need the memory now)
evicts only entries whose eviction frees a page, i.e. whose tail pages no deeper entry or lane
holds (a shared prefix stays while its extensions are cached, as radix caches evict leaves),
rank 0 first, then live heads, then shared prefixes in use: a shared prefix's few pages serve
every request that starts with it, a head's pages (its whole conversation) serve one. Slots
are the scarce resource the order above protects heads in (one GDN snapshot is the HBM of
~2,350 tokens of KV at 27B); pages come back to requests whatever the order. A running
request's pages are never evicted (the request holds its own references), only the cache's
hold on them. Eviction frees an entry's snapshot slot at once: a request that hit it has
already copied the snapshot into its lane (the restore runs before any later save can reuse
the slot).

Sizing: each live conversation keeps one slot (its head) and each distinct shared prefix one
or a few, so `prefix_snapshots` should be at least the conversations expected to be live at
once plus a few (the engine's default is min(max(2 * lane slots, 4), 32)); with fewer, the
least recently used conversation's next turn misses.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Callable

from mtpjax.engine.kv_pool import PageAllocator


def block_hashes(tokens, page_size: int) -> list[int]:
    """Hash chain over the full page-sized blocks of `tokens`: entry i covers blocks 0..i."""
    out, h = [], 0
    for i in range(len(tokens) // page_size):
        h = hash((h, tuple(tokens[i * page_size:(i + 1) * page_size])))
        out.append(h)
    return out


# Eviction order of the ranks (`PrefixCache._rank`): for a snapshot slot, live heads last;
# for KV pages, shared prefixes in use last (`PrefixCache._victim`).
SLOT_ORDER = (0, 1, 2)
PAGE_ORDER = (0, 2, 1)


@dataclasses.dataclass(eq=False)
class Entry:
    length: int                  # L: the prefix [0, L) is cached
    tokens: tuple[int, ...]      # tokens [0, L)
    pages: tuple[int, ...]       # page ids of positions [0, L)
    slot: int                    # snapshot slot on the device
    charge: tuple[int, ...]      # pool pages the snapshot is charged
    key: tuple = ()              # its key in the table
    hits: int = 0                # lookups it served (reported; eviction ignores it)
    head: bool = False           # a prompt's last boundary, not superseded (module docstring)
    used_at: float = 0.0         # clock time of its last insert or hit
    hit_at: float | None = None  # clock time of its last hit that counts as sharing
    hashes: tuple[int, ...] = ()  # block_hashes of its prefix: its path (`is_junction`)
    next_token: int | None = None  # token L it was prefilled with (MTP engines: the MTP KV at
                                   # L-1 in its last page is made with it)


@dataclasses.dataclass
class PrefixCacheStats:
    lookups: int = 0             # admissions that looked the cache up
    hits: int = 0
    rewrites: int = 0            # hits whose MTP KV at L-1 was rewritten (`needs_rewrite`)
    lookup_tokens: int = 0       # prompt tokens of those admissions
    tokens_reused: int = 0       # prompt tokens whose prefill hits skipped
    inserted: int = 0
    evicted: int = 0
    superseded: int = 0          # heads a deeper head of the same path replaced
    refused: int = 0             # boundaries not inserted for want of a slot (a grid
                                 # boundary or junction evicts only rank 0, `_rank`)


class PrefixCache:
    """Entries (boundary -> pages + snapshot slot) on top of a PageAllocator, evicted LRU by
    rank: live conversation heads last, shared prefixes in use before them (module docstring).

    num_slots: snapshot slots on the device; snapshot_pages: pool pages one snapshot is
    charged; every_blocks: the doubling grid's first boundary, in blocks (pages); live_s:
    seconds a head or a hit protects an entry; clock: seconds (tests pass their own)."""

    def __init__(self, alloc: PageAllocator, *, num_slots: int, snapshot_pages: int,
                 snapshot_bytes: int = 0, every_blocks: int = 4, mtp_kv: bool = True,
                 live_s: float = 600.0, clock: Callable[[], float] = time.monotonic):
        if num_slots < 1:
            raise ValueError(f"the prefix cache needs at least one snapshot slot, got {num_slots}")
        if every_blocks < 1:
            raise ValueError(f"every_blocks must be >= 1, got {every_blocks}")
        if not live_s >= 0:
            raise ValueError(f"live_s must be >= 0 seconds, got {live_s}")
        self.alloc, self.page_size = alloc, alloc.page_size
        self.num_slots, self.snapshot_pages = num_slots, snapshot_pages
        self.snapshot_bytes, self.every_blocks = snapshot_bytes, every_blocks
        self.live_s, self.clock = float(live_s), clock
        self.mtp_kv = mtp_kv             # entries carry MTP KV: they record token L
        self.entries: collections.OrderedDict[tuple, Entry] = collections.OrderedDict()  # LRU first
        self.pending: dict[int, Entry] = {}      # slot -> entry whose snapshot is being saved
        self.free_slots = list(range(num_slots - 1, -1, -1))
        self.paths: collections.Counter[int] = collections.Counter()  # entries' block hashes
        self.stats = PrefixCacheStats()
        alloc.reclaimer, alloc.reclaimable = self._reclaim, self.reclaimable

    # ---------------------------------------------------------------- which boundaries
    def keeps(self, L: int, last: int) -> bool:
        """Whether a prefill chunk ending at L inserts an entry as a head or a grid point: L
        is the sequence's last page boundary `last` (its head), or a page boundary on the
        doubling grid every_blocks pages * 2^j (module docstring: with the junction, at most
        log2(n / grid) + 3 entries per prompt)."""
        if L <= 0 or L % self.page_size:
            return False
        if L == last:
            return True
        q, r = divmod(L, self.every_blocks * self.page_size)
        return r == 0 and q & (q - 1) == 0

    def _on_path(self, hashes, L: int) -> bool:
        """Whether a cached entry's prefix holds the sequence's tokens [0, L) (hashes: its
        block_hashes; a chain hash at block i covers blocks 0..i, so one lookup decides; a
        collision would only add an entry, never serve wrong state)."""
        i = L // self.page_size - 1
        return 0 <= i < len(hashes) and self.paths[hashes[i]] > 0

    def is_junction(self, hashes, L: int, step: int) -> bool:
        """Whether the chunk end L is where the sequence (hashes: its block_hashes) leaves the
        paths of the cached entries: one holds [0, L), none holds [0, L + step) (step: the
        chunk length, so the next chunk end). O(1) per chunk end."""
        return (L > 0 and L % self.page_size == 0 and self._on_path(hashes, L)
                and not self._on_path(hashes, L + step))

    # ---------------------------------------------------------------- lookup
    def _key(self, hashes: list[int], L: int) -> tuple:
        return (hashes[L // self.page_size - 1],)

    def _touch(self, key: tuple, e: Entry) -> None:
        """A use of e: most recently used, and a head's protection starts again."""
        self.entries.move_to_end(key)
        e.used_at = self.clock()

    def _find(self, tokens) -> tuple[tuple, Entry] | None:
        """(key, entry) of the longest cached prefix of `tokens` that leaves at least one
        token to prefill (L < len(tokens)), or None; touches nothing."""
        n = len(tokens)
        if n < 2 or not self.entries:
            return None
        hashes = block_hashes(tokens[:n - 1], self.page_size)
        for L in range(len(hashes) * self.page_size, 0, -self.page_size):
            key = self._key(hashes, L)
            e = self.entries.get(key)
            if e is not None and e.tokens == tuple(tokens[:L]):
                return key, e
        return None

    def lookup(self, tokens) -> Entry | None:
        """The longest cached prefix of `tokens` that leaves at least one token to prefill
        (L < len(tokens)), or None; touches the entry (LRU). `admitted` counts it."""
        found = self._find(tokens)
        if found is None:
            return None
        key, e = found
        self._touch(key, e)
        e.hits += 1
        e.hit_at = e.used_at
        return e

    def longest(self, tokens) -> int:
        """The length `lookup` would hit now (0: none), without touching or counting it."""
        found = self._find(tokens)
        return 0 if found is None else found[1].length

    def pending_at(self, tokens, L: int) -> bool:
        """Whether an entry for tokens' prefix [0, L) is being saved (inserted, unpublished)."""
        if L <= 0 or L % self.page_size or L > len(tokens) or not self.pending:
            return False
        want = tuple(int(t) for t in tokens[:L])
        return any(e.tokens == want for e in self.pending.values())

    def needs_rewrite(self, hit: Entry, tokens) -> bool:
        """Whether a hit on `hit` by `tokens` needs the MTP KV at L-1 rewritten (a page of its
        own for the lane: module docstring): an MTP entry prefilled with another token L."""
        return hit.next_token is not None and int(tokens[hit.length]) != hit.next_token

    def admitted(self, n_tokens: int, hit: Entry | None, rewrite: bool = False) -> None:
        """Count an admission of a sequence of n_tokens that looked the cache up."""
        self.stats.lookups += 1
        self.stats.lookup_tokens += n_tokens
        if hit is not None:
            self.stats.hits += 1
            self.stats.rewrites += rewrite
            self.stats.tokens_reused += hit.length

    # ---------------------------------------------------------------- insert / evict
    def insert(self, tokens, L: int, lane: int, head: bool = False,
               shared: bool = False) -> int | None:
        """Cache the prefix [0, L) that `lane` has just prefilled (its pages cover it; token L
        is known); head: L is the sequence's last page boundary (`keeps`); shared: L is its
        junction (`is_junction`), a prefix two prompts share, which counts as a hit. Returns the
        snapshot slot the engine must save the lane's GDN state into, then `publish`, or None
        (already cached or pending: touched; no free slot and, for a boundary that is no
        head, no entry of rank 0 to evict; or the pool cannot give the snapshot's pages).
        The entry holds its pages and slot from now on."""
        if L <= 0 or L % self.page_size or L >= len(tokens):
            raise ValueError(f"a boundary must be a positive multiple of {self.page_size} "
                             f"below the sequence length {len(tokens)}, got {L}")
        hashes = block_hashes(tokens[:L], self.page_size)
        key = self._key(hashes, L)
        if key in self.entries:
            e = self.entries[key]
            self._touch(key, e)
            if shared:
                e.hit_at = e.used_at
            if head and not e.head:
                e.head = True
                self._supersede(e)
            return None
        if any(e.key == key for e in self.pending.values()):
            return None
        pages = self.alloc.lane_pages(lane)[:L // self.page_size]
        if len(pages) < L // self.page_size:
            raise ValueError(f"lane {lane} holds {len(pages)} pages, the prefix needs "
                             f"{L // self.page_size}")
        self.alloc.hold(pages)              # first: eviction below must not free them
        if not self.free_slots and not self._evict(max_rank=2 if head else 0):
            self.stats.refused += 1
        charge = self.alloc.take(self.snapshot_pages) if self.free_slots else None
        if charge is None:
            self.alloc.unhold(pages)
            return None
        slot = self.free_slots.pop()
        self.pending[slot] = Entry(L, tuple(int(t) for t in tokens[:L]), tuple(pages), slot,
                                   tuple(charge), key, head=head,
                                   hit_at=0.0 if shared else None,
                                   next_token=int(tokens[L]) if self.mtp_kv else None)
        return slot

    def publish(self, slot: int) -> None:
        """The snapshot of pending entry `slot` is on the device: lookups may serve it."""
        e = self.pending.pop(slot)
        self.entries[e.key] = e
        e.used_at = self.clock()
        if e.hit_at is not None:            # a junction: shared from its publication on
            e.hit_at = e.used_at
        e.hashes = tuple(block_hashes(e.tokens, self.page_size))
        self.paths.update(e.hashes)
        self.stats.inserted += 1
        if e.head:
            self._supersede(e)

    def _supersede(self, e: Entry) -> None:
        """Heads on e's path above e are no conversation's newest entry any more (the
        conversation's next turn is e): they lose their protection, and the hit that turn
        made does not count as sharing; they keep their place in the LRU order."""
        ps = self.page_size
        for L in range(ps, e.length, ps):
            key = self._key(e.hashes, L)
            old = self.entries.get(key)
            if old is not None and old.head and old.tokens == e.tokens[:L]:
                old.head, old.hit_at = False, None
                self.stats.superseded += 1

    def abandon_pending(self) -> None:
        """Drop every entry whose snapshot was never saved (a failed step): pages and slots
        return, nothing was published."""
        for e in self.pending.values():
            self.alloc.unhold(e.pages + e.charge)
            self.free_slots.append(e.slot)
        self.pending.clear()

    def _rank(self, e: Entry, now: float) -> int:
        """Eviction rank (module docstring): 2 a live head, 1 a shared prefix in use (hit
        within live_s), 0 any other entry; lower ranks go first."""
        if e.head and now - e.used_at <= self.live_s:
            return 2
        if e.hit_at is not None and now - e.hit_at <= self.live_s:
            return 1
        return 0

    def _victim(self, max_rank: int, for_pages: bool = False) -> tuple | None:
        """The key to evict: the least recently used entry of the lowest rank, if that rank
        is at most max_rank; else None. for_pages (reclaiming KV pages for requests): only
        entries whose eviction frees a page (a prefix that deeper entries or lanes share
        frees nothing and stays until they go, as SGLang's radix cache evicts leaves), and
        live heads before shared prefixes in use: a shared prefix's few pages serve every
        request that starts with it, a head's serve one conversation (module docstring)."""
        order = PAGE_ORDER if for_pages else SLOT_ORDER
        now, best, best_pos = self.clock(), None, len(order)
        for k, e in self.entries.items():          # least recently used first
            r = self._rank(e, now)
            if r > max_rank or order.index(r) >= best_pos:
                continue
            if for_pages and not self.alloc.frees_any(e.pages + e.charge):
                continue
            best, best_pos = k, order.index(r)
            if best_pos == 0:
                break
        return best

    def _evict(self, max_rank: int = 2, for_pages: bool = False) -> bool:
        """Evict one entry (`_victim`); False when there is none to evict."""
        key = self._victim(max_rank, for_pages)
        if key is None:
            return False
        e = self.entries.pop(key)
        self.alloc.unhold(e.pages + e.charge)
        for h in e.hashes:                  # drop its path (no zero counts left behind)
            self.paths[h] -= 1
            if not self.paths[h]:
                del self.paths[h]
        self.free_slots.append(e.slot)
        self.stats.evicted += 1
        return True

    def _reclaim(self, n: int) -> None:
        """Evict entries that free pages (by rank, live heads last) until n pages are free or
        none is left: requests come before cached prefixes."""
        while self.alloc.free_pages < n and self._evict(for_pages=True):
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
    def _count_rank(self, rank: int) -> int:
        now = self.clock()
        return sum(self._rank(e, now) == rank for e in self.entries.values())

    def report(self) -> dict:
        s = self.stats
        return {"lookups": s.lookups, "hits": s.hits,
                "hit_rate": s.hits / s.lookups if s.lookups else 0.0,
                "mtp_kv_rewrites": s.rewrites,
                "tokens_reused": s.tokens_reused,
                "reused_fraction": s.tokens_reused / s.lookup_tokens if s.lookup_tokens else 0.0,
                "snapshots": len(self.entries), "snapshot_slots": self.num_slots,
                "snapshot_slots_free": len(self.free_slots),
                "snapshots_pending": len(self.pending),
                "live_heads": self._count_rank(2), "shared_in_use": self._count_rank(1),
                "snapshot_bytes": len(self.entries) * self.snapshot_bytes,
                "slot_bytes": self.num_slots * self.snapshot_bytes,
                "cached_pages": self.alloc.held_pages,
                "inserted": s.inserted, "evicted": s.evicted, "superseded": s.superseded,
                "refused": s.refused}
