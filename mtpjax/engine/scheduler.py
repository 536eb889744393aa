"""Continuous-batching scheduler: requests, lanes, KV pages, preemption, speculation depth.

Host-only bookkeeping; it knows nothing about JAX. The engine asks it for a `Plan` each
iteration, runs the plan's programs, and reports the tokens back:

  1. cancellations: cancelled requests end ("cancelled") and release their lane and pages.
  2. admission: queued requests (oldest first) take free lanes while the pool can promise the
     pages of their whole prefill on top of what running lanes still need (their unfinished
     prefill and every decoding lane's next depth-0 step: draft slots only use pages that are
     free, see _promised).
     With a prefix cache (mtpjax/engine/prefix_cache.py) an admitted request first looks up its
     longest cached prefix: on a hit its page table starts with the cached (shared, read-only)
     pages, its prefill starts at the boundary, and the plan restores the boundary's GDN
     snapshot into its lane (Plan.restores). Cached pages count as available: they are
     evicted (LRU) before any request is preempted. A request whose prompt's last page
     boundary another lane is about to snapshot on the same tokens (n > 1 siblings, identical
     prompts) waits for that entry and is then admitted as a hit: the shared prompt is
     prefilled once, each sibling prefills only its tail after the boundary (`_awaits_prefix`).
     Requests that arrive together on a shared prefix (a system prompt) with different
     messages after it do the same when the prefix is most of their prefill: the queued
     request names the deepest page boundary it shares with a prefilling lane (a *share
     point*: `Lane.shares`), that lane's prefill cuts a chunk and snapshots there, and the
     request waits for the entry (`_share_wait`).
  2b. compaction: the highest busy lanes move into the lowest free ones (Plan.moves), so the
     busy lanes are always 0..n-1 and a decode step's lane bucket holds no idle lane.
  3. work: the prefill chunks of up to `prefill_rows` lanes still prefilling, oldest first
     (packed prefill; chunks end at multiples of prefill_chunk and never include a sequence's
     last token, so a step's prefill budget is prefill_rows x prefill_chunk tokens) plus one
     decode step over every lane that decodes, including a lane whose last token joins now
     (after its final chunk, in the same step). Decode lanes always run: the chunks take
     what the step carries beside them. The engine runs all of it in one program. A lane in
     prefill is idle in the decode step.
  4. draft depth: `policy(view)` picks the step's depth d in 0..K from a `StepView` (the
     decoding lanes with their drafts and acceptance so far, the lane bucket, the deepest
     depth the free pages cover); lossless whatever it picks: sampling keys depend on
     (seed, position) only. `SpeculationPolicy` is the fixed depth, `depth.AdaptiveDepth`
     chooses from measured step cost and acceptance.
  5. pages: each lane that runs gets the pages of every position the step writes
     (kv_pool.tokens_touched_*), oldest lane first. When the pool is short, the youngest
     running-or-waiting lane is preempted by recompute: its pages are freed and its request
     goes back to the queue with prompt + tokens so far as the sequence to prefill; its output
     continues where it stopped. The oldest lane can always proceed, because admission rejects
     requests that could not fit the pool alone (`pages_worst_case`), so the loop terminates.

Seniority is arrival order (request id), so preempted requests re-enter the queue ahead of
newer ones.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import threading
from typing import Callable, Protocol

from mtpjax.engine.kv_pool import PageAllocator, pages_for, tokens_touched_decode
from mtpjax.engine.prefix_cache import PrefixCache, block_hashes
from mtpjax.sampling_params import SamplingParams

FINISH_STOP, FINISH_LENGTH, FINISH_ERROR, FINISH_CANCELLED = "stop", "length", "error", "cancelled"

# Ended request ids a session still refuses to take again (Scheduler.ids): a window, so that a
# session serving requests for days keeps a bounded set, not every id it ever saw.
RECENT_IDS = 4096


@dataclasses.dataclass
class RequestStats:
    verify_steps: int = 0           # decode steps that verified drafts (depth > 0)
    drafted_tokens: int = 0         # real drafts verified (not the empty slots of a deeper step)
    accepted_tokens: int = 0
    # per draft position j: steps that verified a real draft j with drafts 1..j-1 accepted,
    # and steps that accepted it (accepted/tried = the conditional acceptance of position j)
    accepted_per_position: list[int] = dataclasses.field(default_factory=list)
    tried_per_position: list[int] = dataclasses.field(default_factory=list)
    depth_steps: list[int] = dataclasses.field(default_factory=list)  # decode steps per depth
    plain_steps: int = 0            # decode steps run with depth 0 (policy choice / stock)
    # the step its last prompt token joined (at the step's depth, counted in depth_steps): it
    # samples the first token and drafts; its draft slots held no real draft, so it is neither
    # a verify step nor a plain one (the prefill's last step, in other engines' terms)
    first_steps: int = 0
    preemptions: int = 0
    # prompt tokens served from the prefix cache at its first admission (the hit boundary;
    # 0 on a miss), kept after a preemption: OpenAI's usage.prompt_tokens_details.cached_tokens
    cached_tokens: int = 0

    @staticmethod
    def for_depth(num_draft_slots: int) -> "RequestStats":
        n = num_draft_slots
        return RequestStats(accepted_per_position=[0] * n, tried_per_position=[0] * n,
                            depth_steps=[0] * (n + 1))

    @property
    def tokens_per_step(self) -> float:
        return (self.accepted_tokens + self.verify_steps) / max(self.verify_steps, 1)


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
    """One emitted token's log probability under the raw target distribution, and the
    `SamplingParams.logprobs` most likely tokens at its position as (id, logprob) pairs,
    most likely first."""
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclasses.dataclass
class RequestOutput:
    prompt_token_ids: list[int]
    token_ids: list[int]
    finish_reason: str
    error: str | None
    stats: RequestStats
    # one TokenLogprob per token_ids entry when SamplingParams.logprobs is set, else None
    logprobs: list[TokenLogprob] | None = None


@dataclasses.dataclass(eq=False)
class Request:
    id: int                          # arrival order = seniority
    prompt: list[int]
    params: SamplingParams
    stops: frozenset[int]
    out: list[int] = dataclasses.field(default_factory=list)
    stats: RequestStats = dataclasses.field(default_factory=RequestStats)
    done: str | None = None
    # structured output: the request's grammar state over `out` (grammar.Constraint), or None.
    # It advances by every emitted token here (_emit); the engine reads it to mask each step.
    constraint: object | None = None
    # SamplingParams.logprobs set: one TokenLogprob per `out` entry (appended with it, _emit)
    logprobs: list[TokenLogprob] | None = None

    def __post_init__(self):
        if self.logprobs is None and getattr(self.params, "logprobs", None) is not None:
            self.logprobs = []


@dataclasses.dataclass(eq=False)
class Lane:
    """A request in a lane: its sequence to prefill, progress, and decode position.

    The prefill covers seq[:-1]; the sequence's last token joins a decode step (steps.Join),
    which samples the first new token."""
    req: Request
    seq: list[int]            # prompt + tokens generated before admission (recompute)
    prefilled: int = 0        # tokens of seq already prefilled (at most len(seq) - 1)
    pos: int = -1             # decode: absolute position of the last token fed (-1: not yet)
    drafts: int = 0           # real drafts the lane holds for its next step (0..K)
    restore: int | None = None   # prefix hit: snapshot slot to load before its next prefill
    rewrite: tuple | None = None  # and its MTP KV rewrite: (src page, dst page, token L, L-1)
    reset: bool = False       # its GDN state belongs to seq (a chunk from 0 ran, or a restore)
    snapped: int = 0          # its last snapshot boundary (prefix cache)
    # the overlapped loop: tokens the lane's launched, not yet committed decode steps may
    # still emit (at most depth + 1 each); its next step is planned past them
    inflight: int = 0
    held: collections.deque = dataclasses.field(default_factory=collections.deque)  # real
    # drafts the lane held for each of those steps, oldest first (its BatchRow.drafts)
    hashes: list[int] = dataclasses.field(default_factory=list)  # block_hashes(seq)
    # share points: page boundaries a queued request shares with seq and waits for; the
    # lane's prefill cuts a chunk and inserts a prefix-cache entry at each (`_share_wait`)
    shares: set[int] = dataclasses.field(default_factory=set)

    @property
    def prefilling(self) -> bool:
        """Needs a prefill chunk: tokens before the last one remain, or a fresh lane's reset
        (a one-token sequence: an empty chunk at 0 zeroes the lane's state)."""
        return self.prefilled < len(self.seq) - 1 or not self.reset

    @property
    def ready(self) -> bool:
        """Prefilled up to its last token, which joins the next decode step."""
        return self.pos < 0 and not self.inflight and not self.prefilling

    @property
    def decoding(self) -> bool:
        """It has joined decode (its join step may still be in flight)."""
        return self.pos >= 0 or self.inflight > 0


@dataclasses.dataclass(frozen=True)
class PrefillWork:
    lane: int
    start: int
    tokens: list[int]         # seq[start:end]
    next_tokens: list[int]    # seq[start + 1:end + 1] (end < len(seq): all known)
    joins: bool               # the chunk ends at len(seq) - 1: the lane joins this step


@dataclasses.dataclass(frozen=True)
class BatchRow:
    """One decode lane of a step, as the step's record holds it."""
    lane: int                 # lane slot (after this step's compaction)
    request_id: int
    pos: int                  # position of the token the step feeds first
    drafts: int               # real drafts the lane holds (0..K)
    join_token: int | None    # the sequence's last token when the lane enters decode now


@dataclasses.dataclass(frozen=True)
class StepBatch:
    """The ordered record of one engine iteration, built by the scheduler (the engine core's
    host side) and executed by the engine's model runner. Every piece of host bookkeeping
    after the step (tokens to requests, acceptance to the depth policy, snapshots to the
    prefix cache) reads this one record, so no two of them can disagree on which lane holds
    which request.

    rows: the decode lanes in lane order; depth: the step's depth; prefills: the lanes'
    chunks (oldest first; several: packed prefill), run in the same program as the rows;
    view: what the depth policy is told the step ran (view.lanes correspond to rows, in
    order)."""
    prefills: tuple[PrefillWork, ...]
    rows: tuple[BatchRow, ...]
    depth: int                # drafts verified by the decode step (0..num_draft_slots)
    preempted: tuple[int, ...] = ()   # request ids preempted while planning
    moves: tuple[tuple[int, int], ...] = ()   # (src, dst) lane moves to apply first (compaction)
    view: "StepView | None" = None
    restores: tuple[tuple, ...] = ()   # (lane, snapshot slot, MTP KV rewrite or None): after
                                       # moves, first (snapshots.Rewrite)

    @property
    def decode(self) -> tuple[int, ...]:
        """The decode lanes, in row order."""
        return tuple(r.lane for r in self.rows)


Plan = StepBatch      # the name of earlier versions


@dataclasses.dataclass(frozen=True)
class LaneView:
    """One decoding lane as a depth policy sees it."""
    request_id: int
    pos: int                  # absolute position of its last emitted token
    drafts: int               # real drafts it holds (a deeper step verifies empty slots too)
    stats: RequestStats       # its acceptance so far (per-position counts)


@dataclasses.dataclass(frozen=True)
class StepView:
    """What a depth policy decides from, once per decode step."""
    K: int                    # the engine's draft slots: depths 0..K are allowed
    max_depth: int            # deepest depth whose pages are free now (deeper preempts)
    lanes: tuple[LaneView, ...]   # the decoding lanes, in lane order
    bucket: int               # lane slots the step runs (the engine's lane bucket)
    step: int                 # scheduler iteration
    chunk: int = 0            # prefill tokens riding in the step, padded as the program
                              # carries them (rows x ride bucket; 0: none)
    waiting: int = 0          # requests in lanes awaiting their first token, which no step
                              # in flight brings: each waits as long as this step runs

    @property
    def context(self) -> int:
        return max((ln.pos for ln in self.lanes), default=0)


class Policy(Protocol):
    """Chooses each decode step's depth; may also learn from what the step measured
    (`observe(view, depth, seconds, accepted, compiled)`, called by the engine when present;
    `wants_timing(view, depth)`, when present, says which steps the overlapped loop times
    alone: only those reach observe as step costs)."""
    def __call__(self, view: StepView) -> int: ...


@dataclasses.dataclass(frozen=True)
class SpeculationPolicy:
    """Fixed depth: `depth` (None: K, the engine's draft slots) while at most
    `max_busy_lanes` lanes decode (None: any number), capped at the deepest depth the free
    pages cover; 0 above max_busy_lanes.

    Any callable StepView -> depth in 0..K can stand in for it (depth.AdaptiveDepth chooses
    from measured cost and acceptance).
    """
    max_busy_lanes: int | None = None
    depth: int | None = None

    def __post_init__(self):
        if self.max_busy_lanes is not None and self.max_busy_lanes < 0:
            raise ValueError(f"max_busy_lanes must be >= 0 or None, got {self.max_busy_lanes}")
        if self.depth is not None and self.depth < 0:
            raise ValueError(f"depth must be >= 0 or None, got {self.depth}")

    def __call__(self, view: StepView) -> int:
        if self.max_busy_lanes is not None and len(view.lanes) > self.max_busy_lanes:
            return 0
        want = view.K if self.depth is None else min(self.depth, view.K)
        return max(min(want, view.max_depth), 0)


class Scheduler:
    """Queue + lanes + page accounting for one `generate` call (see the module docstring)."""

    def __init__(self, alloc: PageAllocator, *, num_draft_slots: int, max_seq_len: int,
                 prefill_chunk: int,
                 policy: Policy | None = None,
                 on_token: Callable[[int, list[int]], None] | None = None,
                 prefix_cache: PrefixCache | None = None, lanes: int | None = None,
                 bucket: Callable[[int], int] | None = None, mixed_depth: int | None = None,
                 mixed_bucket: int | None = None,
                 ride: Callable[[list[int]], tuple[int, int]] | None = None,
                 prefill_rows: int = 1):
        self.alloc, self.max_seq_len = alloc, max_seq_len
        self.num_draft_slots = k = int(num_draft_slots)   # K: the drafts a lane can hold
        # the deepest step that carries a prefill chunk (default K): a cap bounds the programs
        self.mixed_depth = k if mixed_depth is None else max(0, min(int(mixed_depth), k))
        self.chunk = prefill_chunk
        self.prefill_rows = max(1, int(prefill_rows))   # lanes' chunks one step carries
        self.cache = prefix_cache
        self.policy = policy or SpeculationPolicy()
        self.on_token = on_token
        # lanes: requests decoded together (default: every lane slot of the allocator);
        # bucket(n): the lane slots a step over lanes 0..n-1 runs (the engine's lane buckets)
        self.lanes: list[Lane | None] = [None] * (alloc.max_lanes if lanes is None else lanes)
        if len(self.lanes) > alloc.max_lanes:
            raise ValueError(f"{len(self.lanes)} lanes but the allocator has "
                             f"{alloc.max_lanes} lane slots")
        self.bucket = bucket or (lambda n: min(1 << (n - 1).bit_length(), len(self.lanes)))
        # a step carrying chunks runs `mixed_bucket` lane slots (default: every lane) with
        # the chunks padded to ride(their lengths) = (rows, T) (StepShapes.ride): the cell
        # its view names is that program's
        self.mixed_bucket = len(self.lanes) if mixed_bucket is None else int(mixed_bucket)
        self.ride = ride or (lambda lens: (1, lens[0]) if len(lens) == 1
                             else (self.prefill_rows, self.chunk))
        self.queue: list[Request] = []          # sorted by id
        self.finished: dict[int, RequestOutput] = {}
        # Bounded bookkeeping (a session may stay open for days): `cancelled` holds ids of live
        # requests only (cancel() ignores others; ended ones leave it at the next schedule());
        # `ids`, the ids a new request may not take, holds the live requests' and the last
        # RECENT_IDS ended ones' (`_ended`, oldest first).
        self.cancelled: set[int] = set()
        self.ids: set[int] = set()
        self._live_ids: set[int] = set()        # queued or in a lane
        self._ended: collections.deque[int] = collections.deque()
        self._cancel_lock = threading.Lock()    # cancel() comes from any thread
        self.preemptions = 0
        self.step = 0

    # ---------------------------------------------------------------- requests
    def pages_worst_case(self, prompt_len: int, max_new_tokens: int) -> int:
        """Most pages a request ever holds at depth K (it must fit the pool alone)."""
        k = self.num_draft_slots
        end = min(prompt_len + max_new_tokens, self.max_seq_len)
        last_pos = max(end - 2, prompt_len - 1)  # the last token fed to a step (the join's
        return pages_for(tokens_touched_decode(last_pos, k), self.alloc.page_size)  # at least)

    def add(self, req: Request) -> None:
        self.ids.add(req.id)
        self._live_ids.add(req.id)
        bisect.insort(self.queue, req, key=lambda r: r.id)

    def refused(self, request_id: int) -> None:
        """A request id submitted and refused at once (an invalid request): used, like an
        ended request's id."""
        self.ids.add(request_id)
        self._retire(request_id)

    def _retire(self, request_id: int) -> None:
        """The request ended: its id leaves the live set and joins the window of recent ids;
        the oldest id leaving the window may be taken again."""
        self._live_ids.discard(request_id)
        self._ended.append(request_id)
        while len(self._ended) > RECENT_IDS:
            old = self._ended.popleft()
            if old not in self._live_ids:
                self.ids.discard(old)

    def cancel(self, request_id: int) -> None:
        """Cancel a queued or running request at the next scheduling point (thread-safe).
        Ids of requests that are not queued or running (ended, or never submitted) are
        ignored: there is nothing to cancel, and the set stays as small as the live requests."""
        with self._cancel_lock:
            if request_id in self._live_ids:
                self.cancelled.add(request_id)

    def _prune_cancelled(self) -> None:
        """Drop the cancellations of requests that have ended (applied, or raced with their
        end); a cancel() arriving meanwhile for a live request stays."""
        with self._cancel_lock:
            self.cancelled &= self._live_ids

    def has_work(self) -> bool:
        return bool(self.queue) or any(self.lanes)

    # ---------------------------------------------------------------- planning
    def _running(self) -> list[int]:
        return sorted((b for b, ln in enumerate(self.lanes) if ln is not None),
                      key=lambda b: self.lanes[b].req.id)

    def _chunk_end(self, ln: Lane) -> int:
        """End of the lane's next prefill chunk: the next multiple of the chunk length (the
        token budget of an iteration's prefill) after what is prefilled, at most len(seq) - 1
        (the last token joins a decode step). Chunk ends are the same positions for every
        request, so the snapshots taken there (prefix cache) serve any request sharing the
        prefix. With the prefix cache, the chunk that would reach len(seq) - 1 stops at the
        sequence's last page boundary instead (a snapshot there: what the next turn of a chat
        shares, however short the prompt is beside the chunk length); the few tokens after it
        ride with the join in the next iteration."""
        end = self._grid_end(len(ln.seq), ln.prefilled)
        cut = min((p for p in ln.shares if ln.prefilled < p < end), default=None)
        return end if cut is None else cut     # cut: a share point a queued request waits for

    def _grid_end(self, n: int, start: int) -> int:
        """`_chunk_end` without share points, for a sequence of n tokens prefilled up to
        start."""
        end = min(n - 1, (start // self.chunk + 1) * self.chunk)
        last = (n - 1) // self.alloc.page_size * self.alloc.page_size
        if self.cache is not None and end == n - 1 and start < last < end:
            return last
        return end

    def _chunks(self, n: int, start: int) -> int:
        """Prefill chunks a sequence of n tokens prefilled up to `start` still runs."""
        count = 0
        while start < n - 1:
            start, count = self._grid_end(n, start), count + 1
        return count

    def _last_page(self, ln: Lane) -> int:
        """The last page boundary at or before the sequence's last token."""
        ps = self.alloc.page_size
        return (len(ln.seq) - 1) // ps * ps

    def _feed_pos(self, ln: Lane) -> int:
        """Position of the first token the lane's next decode step feeds: past its steps in
        flight, at most (their tokens are not known yet: pages are reserved for the most)."""
        return (ln.pos if ln.pos >= 0 else len(ln.seq) - 1) + ln.inflight

    def _waits(self, ln: Lane) -> bool:
        """A lane with a step in flight whose next step needs that step's tokens on the host
        waits a step (the overlapped loop; every other lane goes on): its grammar masks and
        penalties' history are built from its emitted tokens, and a lane that may reach its
        token limit in flight must not run past it (nor reserve pages past its worst case,
        `pages_worst_case`). A stop token or string needs no wait: what a step after a stop
        produced is never emitted (the request has ended when its result is committed)."""
        if not ln.inflight:
            return False
        req = ln.req
        if req.constraint is not None or req.params.penalized:
            return True
        n = len(req.out) + ln.inflight
        return (n >= req.params.max_new_tokens
                or len(req.prompt) + n >= self.max_seq_len)

    def lane_of(self, request_id: int) -> int | None:
        """The lane slot holding request_id now (lanes move between steps), or None."""
        return next((b for b, ln in enumerate(self.lanes)
                     if ln is not None and ln.req.id == request_id), None)

    def _promised(self) -> int:
        """Pages running lanes will want soon: the rest of their prefill and their next step
        at depth 0. Deeper steps run only on pages that are free then (the policy sees
        `max_depth`), so draft slots never keep a request out: admission is the same whatever
        K is, and under page pressure the depth gives way, not the lanes."""
        return sum(self.alloc.needed(b, tokens_touched_decode(self._feed_pos(ln), 0))
                   for b, ln in enumerate(self.lanes) if ln is not None)

    def _awaits_prefix(self, seq: list[int]) -> bool:
        """Whether seq should wait before admission for the prefix-cache entry at its last
        page boundary B: the entry is pending (its snapshot is being saved), or a lane whose
        sequence has the same tokens [0, B) (the key), and B as its own last page boundary,
        has not prefilled up to B yet (it will insert B there, as its head: `prefill_done`).
        Then seq's prefill would repeat that lane's, token for token; waiting one prefill
        makes seq a hit at B instead (n > 1 siblings share their prompt's
        prefill this way; a prompt that only shares [0, B) waits when that brings its first
        token sooner). Never a deadlock: the lane runs (oldest prefilling lane first) or
        ends or is preempted, and a pending entry is published or dropped by its step."""
        if self.cache is None:
            return False
        B = (len(seq) - 1) // self.alloc.page_size * self.alloc.page_size
        if B <= 0:
            return False
        if self.cache.pending_at(seq, B):
            return True
        for ln in self.lanes:
            if (ln is not None and ln.prefilled < B and ln.snapped < B
                    and self._last_page(ln) == B and ln.seq[:B] == seq[:B]):
                if ln.seq == seq:            # n > 1 siblings: the whole prefill is shared
                    return True
                # another next token (chat turns on one prompt): wait only when seq's first
                # token comes sooner (the lane's steps to B, then seq's from B), else it
                # prefills beside the lane and the queue behind it is not held
                ahead = self._chunks(B + 1, ln.prefilled)   # the lane's steps to B
                return (ahead + self._chunks(len(seq), B)
                        < self._chunks(len(seq), self.cache.longest(seq)))
        return self._share_wait(seq)

    def _share_wait(self, seq: list[int]) -> bool:
        """Whether seq should wait for a share point: the deepest page boundary P it shares
        (tokens [0, P), the key) with a lane still prefilling, when a hit at P saves
        seq at least one prefill chunk (a system prompt shared by requests that arrive
        together, each with its own message; each chunk saved is a row of a packed step that
        another lane gets). The lane cuts a chunk at P and inserts the entry there
        (`Lane.shares`, `_chunk_end`, `prefill_done`), and seq is admitted as a hit at P once
        it is published: the shared prefix is prefilled once, as the rule for identical
        prompts does for a whole prompt; where messages differ right at the boundary (a
        64-token system prompt), an MTP engine's hit rewrites the MTP KV at P-1
        (snapshots.Rewrite). Registers P on the lane (the oldest
        lane sharing the deepest prefix); no deadlock: the lane prefills (oldest first) or
        ends or is preempted, and a pending entry is published or dropped by its step."""
        ps = self.alloc.page_size
        mine = (len(seq) - 1) // ps * ps                   # seq's own last boundary
        best = None
        for ln in self.lanes:
            if ln is None or not ln.prefilling:
                continue
            c = _common(seq, ln.seq)
            P = min(c // ps * ps, mine, self._last_page(ln))
            if P > 0 and (best is None or P > best[0]):
                best = (P, ln)
        if best is None:
            return False
        P, ln = best
        if ln.prefilled >= P and ln.snapped != P:
            return False                                   # passed it without a snapshot
        hit = self.cache.longest(seq)
        if P <= hit or self._chunks(len(seq), P) >= self._chunks(len(seq), hit):
            return False                         # a hit at P would save seq no chunk
        if ln.prefilled < P:           # (snapped <= prefilled: no snapshot at P yet)
            ln.shares.add(P)
            return True
        return self.cache.pending_at(seq, P)

    def _admit(self) -> None:
        while self.queue and None in self.lanes:
            req = self.queue[0]
            seq = req.prompt + req.out
            if self._awaits_prefix(seq):     # oldest first: the queue waits behind it
                return
            lane = self.lanes.index(None)
            hit = self.cache.lookup(seq) if self.cache is not None else None
            # an MTP entry prefilled with another token L: the lane gets its own last page
            cow = hit is not None and self.cache.needs_rewrite(hit, seq)
            if hit is not None:
                self.alloc.share(lane, hit.pages)
            need = self.alloc.needed(lane, tokens_touched_decode(len(seq) - 1, 0)) + cow
            if self.alloc.available - self._promised() < need:
                self.alloc.free(lane)
                return
            self.queue.pop(0)
            ln = Lane(req, seq)
            if self.cache is not None:
                self.cache.admitted(len(seq), hit, cow)
            if not req.stats.preemptions:    # the first admission's hit is the request's
                req.stats.cached_tokens = hit.length if hit is not None else 0
            if hit is not None:
                ln.prefilled, ln.restore, ln.reset = hit.length, hit.slot, True
                ln.snapped = hit.length
                if cow:
                    L = hit.length
                    src, dst = self.alloc.copy_on_write(lane, L // self.alloc.page_size - 1)
                    ln.rewrite = (src, dst, int(seq[L]), L - 1)
            if self.cache is not None:       # its path, for `prefill_done`'s junction
                ln.hashes = block_hashes(seq, self.alloc.page_size)
            self.lanes[lane] = ln

    def _preempt(self, lane: int) -> int:
        ln = self.lanes[lane]
        self.alloc.free(lane)
        self.lanes[lane] = None
        ln.req.stats.preemptions += 1
        self.preemptions += 1
        self.add(ln.req)
        return ln.req.id

    def _lane_view(self, b: int) -> LaneView:
        ln = self.lanes[b]
        return LaneView(ln.req.id, self._feed_pos(ln), ln.drafts if ln.decoding else 0,
                        ln.req.stats)

    def schedule(self) -> StepBatch:
        """Admit, pick this iteration's work, reserve its pages (preempting when short), and
        return its record."""
        for b, ln in enumerate(self.lanes):
            if ln is not None and ln.req.id in self.cancelled:
                self._finish(b, FINISH_CANCELLED)
        for req in [r for r in self.queue if r.id in self.cancelled]:
            self.queue.remove(req)
            self._record(req, FINISH_CANCELLED)
        if self.cancelled:
            self._prune_cancelled()
        self._admit()

        running = self._running()
        pres = [b for b in running if self.lanes[b].prefilling][:self.prefill_rows]
        joins = {b for b in pres
                 if self._chunk_end(self.lanes[b]) == len(self.lanes[b].seq) - 1}
        decode = sorted(b for b in running
                        if (self.lanes[b].decoding and not self._waits(self.lanes[b]))
                        or self.lanes[b].ready or b in joins)
        pre_need = sum(self.alloc.needed(b, self._chunk_end(self.lanes[b]))
                       for b in pres if b not in joins)

        available = self.alloc.available     # free + cached-only pages (one count)

        def fits(d: int) -> bool:
            return pre_need + sum(self.alloc.needed(b, tokens_touched_decode(
                self._feed_pos(self.lanes[b]), d)) for b in decode) <= available
        max_depth = next((d for d in range(self.num_draft_slots, -1, -1) if fits(d)), 0)
        if pres:
            max_depth = min(max_depth, self.mixed_depth)
        depth = 0
        if decode:
            top = len(running)     # busy lanes are 0..n-1 after compaction
            rides = [self._chunk_end(self.lanes[b]) - self.lanes[b].prefilled for b in pres]
            waiting = sum(self.lanes[b].pos < 0 and not self.lanes[b].inflight
                          for b in running)
            view = StepView(self.num_draft_slots, max_depth,
                            tuple(self._lane_view(b) for b in decode),
                            **self._cell(top, rides), step=self.step, waiting=waiting)
            depth, bad = self._choose_depth(view)
            for b in [b for b in decode if self.lanes[b].req.id in bad]:
                self._finish(b, FINISH_ERROR, bad[self.lanes[b].req.id])
            decode = [b for b in decode if self.lanes[b] is not None]
            pres = [b for b in pres if self.lanes[b] is not None]
            if not (isinstance(depth, int) and 0 <= depth <= self.num_draft_slots):
                raise ValueError(f"speculation policy returned {depth!r}; it must return a "
                                 f"depth in 0..{self.num_draft_slots}")
            if pres:
                depth = min(depth, self.mixed_depth)   # a step carrying chunks: capped

        want = {b: tokens_touched_decode(self._feed_pos(self.lanes[b]), depth) for b in decode}
        for b in pres:
            want.setdefault(b, self._chunk_end(self.lanes[b]))
        preempted = []
        for b in sorted(want, key=lambda b: self.lanes[b].req.id):
            if self.lanes[b] is None:          # preempted for an older lane
                continue
            while not self.alloc.can_reserve(b, want[b]):
                victim = self._running()[-1]   # youngest lane, running or waiting
                preempted.append(self._preempt(victim))
                if victim == b:
                    break
            if self.lanes[b] is not None:
                self.alloc.reserve(b, want[b])

        decode = [b for b in decode if self.lanes[b] is not None]
        pres = [b for b in pres if self.lanes[b] is not None]
        moves = self._compact()
        where = {src: dst for src, dst in moves}
        pres = [where.get(b, b) for b in pres]
        decode = sorted(where.get(b, b) for b in decode)

        works = []
        for b in pres:
            ln = self.lanes[b]
            s, e = ln.prefilled, self._chunk_end(ln)
            works.append(PrefillWork(b, s, ln.seq[s:e], ln.seq[s + 1:e + 1],
                                     e == len(ln.seq) - 1))
        rows = tuple(BatchRow(b, self.lanes[b].req.id, self._feed_pos(self.lanes[b]),
                              self.lanes[b].drafts if self.lanes[b].decoding else 0,
                              None if self.lanes[b].decoding else self.lanes[b].seq[-1])
                     for b in decode)
        view = None
        if rows:
            view = StepView(self.num_draft_slots, max_depth,
                            tuple(self._lane_view(r.lane) for r in rows),
                            **self._cell(len(self._running()), [len(w.tokens) for w in works]),
                            step=self.step)
        for r in rows:        # in flight until committed: the device holds `depth` drafts after
            ln = self.lanes[r.lane]
            ln.inflight += depth + 1
            ln.held.append(r.drafts)
            ln.drafts = depth
        restores = []
        for b, ln in enumerate(self.lanes):
            if ln is not None and ln.restore is not None:
                restores.append((b, ln.restore, ln.rewrite))
                ln.restore = ln.rewrite = None
        self.step += 1
        return StepBatch(tuple(works), rows, depth if rows else 0, tuple(preempted), moves,
                         view, tuple(restores))

    def _cell(self, top: int, rides: list[int]) -> dict[str, int]:
        """StepView's bucket and chunk (the lane bucket, and the chunk tokens as the program
        carries them) of the program a step over running lanes 0..top-1 runs, with chunks of
        these lengths riding in it: the cell the depth policy decides in is the cell the
        step's time is recorded in (a chunk-carrying step runs every lane slot, whichever
        lanes decode; packed chunks run prefill_rows rows)."""
        if rides:      # chunks ride (an empty one too: a fresh lane's reset)
            rows, T = self.ride([max(n, 1) for n in rides])
            return {"bucket": self.mixed_bucket, "chunk": rows * T}
        return {"bucket": self.bucket(top), "chunk": 0}

    def _choose_depth(self, view: StepView) -> tuple[int, dict[int, str]]:
        """The policy's depth for `view`, and the requests whose own input made it raise
        ({request id: message}; they end "error", the others go on). When the policy raises
        on the whole view, each lane is tried alone; the lanes it raises on are dropped and
        the rest decided again. It re-raises when no lane alone is to blame (the policy's own
        fault: the step fails as before), or when every lane is."""
        try:
            return self.policy(view), {}
        except Exception:       # noqa: BLE001 - find whose input it was
            bad = {}
            for ln in view.lanes:
                try:
                    self.policy(dataclasses.replace(view, lanes=(ln,)))
                except Exception as e:  # noqa: BLE001 - this request's input
                    bad[ln.request_id] = (f"the depth policy failed on this request's state: "
                                          f"{type(e).__name__}: {e}")
            if not bad or len(bad) == len(view.lanes):
                raise
        rest = tuple(ln for ln in view.lanes if ln.request_id not in bad)
        return self.policy(dataclasses.replace(view, lanes=rest)), bad

    def _compact(self) -> tuple[tuple[int, int], ...]:
        """Move the highest busy lanes into the lowest free ones, so that the busy lanes are
        0..n-1 and a decode step's lane bucket holds no idle lane. The engine moves the
        lanes' device state (GDN slots, lane state) before running the plan."""
        moves = []
        while None in self.lanes:   # a lane moves at most once: it lands below every hole
            dst = self.lanes.index(None)
            src = max((b for b, ln in enumerate(self.lanes) if ln is not None), default=-1)
            if src < dst:
                break
            self.lanes[dst], self.lanes[src] = self.lanes[src], None
            self.alloc.move(src, dst)
            moves.append((src, dst))
        return tuple(moves)

    # ---------------------------------------------------------------- results
    def prefill_done(self, work: PrefillWork, first_token=None) -> int | None:
        """Record a prefill chunk. A chunk that ends past the lane's last snapshot at a
        boundary the prefix cache keeps (`PrefixCache.keeps`: the sequence's last page
        boundary, its head, its junction, or a point of the doubling grid) is a snapshot
        boundary: returns the slot to save the lane's GDN state into when the prefix cache
        took it, else None. The entry stays unpublished (no lookup sees it) until
        `snapshot_saved(slot)`: a save that fails never leaves an entry whose state was not
        written."""
        ln = self.lanes[work.lane]
        ln.prefilled = L = work.start + len(work.tokens)
        ln.reset = True
        if self.cache is None or L <= ln.snapped:
            return None
        last = self._last_page(ln)
        junction = L < last and (self.cache.is_junction(ln.hashes, L, self.chunk)
                                 or L in ln.shares)
        if junction or self.cache.keeps(L, last):
            ln.snapped = L
            return self.cache.insert(ln.seq, L, work.lane, head=L == last, shared=junction)
        return None

    def snapshot_saved(self, slot: int) -> None:
        """The device holds the snapshot of `slot` now: publish its prefix-cache entry."""
        self.cache.publish(slot)

    def decode_done(self, lane: int, tokens: list[int], n_accepted: int, depth: int,
                    logprobs: list[TokenLogprob] | None = None,
                    drafts: int | None = None) -> None:
        """Record a decode step's tokens for the lane (tokens[:n_accepted + 1] emitted);
        logprobs: one TokenLogprob per emitted token when the request asked for them;
        drafts: the real drafts the lane held for the step (its BatchRow's; None: as the
        scheduler recorded them when it planned the step)."""
        ln = self.lanes[lane]
        st = ln.req.stats
        planned = ln.held.popleft() if ln.held else ln.drafts
        held = planned if drafts is None else drafts
        ln.inflight = max(ln.inflight - (depth + 1), 0)
        if ln.pos < 0:             # the lane joined with its last token: no drafts were real
            ln.pos = len(ln.seq) - 1
            st.first_steps += 1
            if st.depth_steps:
                st.depth_steps[depth] += 1
        elif depth:
            if st.depth_steps:
                st.depth_steps[depth] += 1
            real = min(depth, held)            # slots past the lane's drafts were empty
            st.verify_steps += 1
            st.drafted_tokens += real
            st.accepted_tokens += n_accepted
            for j in range(min(real, n_accepted + 1)):
                st.tried_per_position[j] += 1
                st.accepted_per_position[j] += j < n_accepted
        else:
            if st.depth_steps:
                st.depth_steps[0] += 1
            st.plain_steps += 1
        ln.pos += n_accepted + 1
        self._emit(lane, tokens[:n_accepted + 1], logprobs)

    def _emit(self, lane: int, toks: list[int], logprobs=None) -> None:
        """Append tokens to the lane's request up to its stop conditions."""
        req = self.lanes[lane].req
        if req.id in self.cancelled:
            self._finish(lane, FINISH_CANCELLED)
            return
        new, done, error = [], None, None
        c = req.constraint
        for j, t in enumerate(toks):
            new.append(t)
            req.out.append(t)
            if req.logprobs is not None:
                req.logprobs.append(logprobs[j] if logprobs is not None
                                    else TokenLogprob(t, float("nan")))
            if t in req.stops:
                done = FINISH_STOP
            elif c is not None and (error := c.consume(t)) is not None:
                done = FINISH_ERROR      # cannot happen: tokens come from the masked target
            elif c is not None and c.stopped:   # the grammar is complete: nothing can follow
                done = FINISH_STOP
            elif len(req.out) >= req.params.max_new_tokens:
                done = FINISH_LENGTH
            elif len(req.prompt) + len(req.out) >= self.max_seq_len:
                done = FINISH_LENGTH
            if done:
                break
        if self.on_token and new:
            self.on_token(req.id, new)
        if done:
            self._finish(lane, done, error)

    def fail(self, lane: int, request_id: int, error: str) -> bool:
        """End request_id, in `lane`, with finish_reason "error" and `error`: its host state
        raised (its grammar, its penalties' history, its output processing). Its pages return
        to the pool; the other lanes go on. False when the lane no longer holds it."""
        ln = self.lanes[lane]
        if ln is None or ln.req.id != request_id:
            return False
        self._finish(lane, FINISH_ERROR, error)
        return True

    def _finish(self, lane: int, reason: str, error: str | None = None) -> None:
        req = self.lanes[lane].req
        self.alloc.free(lane)
        self.lanes[lane] = None
        self._record(req, reason, error)

    def _record(self, req: Request, reason: str, error: str | None = None) -> None:
        req.done = reason
        self.finished[req.id] = RequestOutput(req.prompt, req.out, reason, error, req.stats,
                                              req.logprobs)
        self._retire(req.id)

    def abort(self) -> None:
        """End every running and queued request "cancelled" (with the tokens it has) and
        release every lane's pages: the end of an engine session, or a step that raised
        (a prefix-cache entry whose snapshot was not saved is dropped, never published)."""
        if self.cache is not None:
            self.cache.abandon_pending()
        for b, ln in enumerate(self.lanes):
            if ln is not None:
                self._finish(b, FINISH_CANCELLED)
        for req in self.queue:
            self._record(req, FINISH_CANCELLED)
        self.queue.clear()


def _common(a: list[int], b: list[int]) -> int:
    """Length of the common prefix of two token lists."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
