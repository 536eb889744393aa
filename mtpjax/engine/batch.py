"""The per-step batch record: everything one engine iteration hands the model runner.

Data flow of one iteration:
  1. the scheduler plans (`scheduler.StepBatch`: which lane holds which request, the step's
     depth, the prefill chunk, lane moves and snapshot restores);
  2. the engine core turns that plan into one `Batch`: host arrays only (numpy), in lane
     order, padded to the lane slots the step runs: tokens and positions of the lanes that
     join, the chunk's tokens and page-table row, each lane's sampling settings, the grammar
     masks (and the corrected drafts behind them), logit_bias, the penalties' history rows,
     who wants log probabilities, and the snapshot slot the chunk's end is saved into;
  3. the model runner runs it (lane moves, restores, the drafts written back, ONE step
     program, the snapshot save) and returns a `StepResult` of host arrays;
  4. the core reads the result with the plan it kept, in the same row order.

The runner looks nothing up anywhere else: if it needed to read the scheduler's lanes, this
record would be incomplete. No JAX here, so the core and the scheduler stay JAX-free.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from mtpjax.engine.kv_pool import pages_for

# The default of StepShapes.prefill_rows: lanes whose prefill chunks one step carries together.
PREFILL_ROWS = 4


@dataclasses.dataclass(frozen=True)
class StepShapes:
    """The shapes every record is padded to, and so the programs a run compiles: checked
    once (`build`), then shared by the core (which plans to them) and the runner (which
    compiles and warms them up). K = num_draft_slots: the drafts a lane holds; a step's
    depth is 0..K."""
    num_draft_slots: int
    max_lanes: int
    lane_slots: int
    lane_buckets: tuple[int, ...]
    prefill_chunk: int
    chunk_buckets: tuple[int, ...]
    ride_buckets: tuple[int, ...]
    prefill_rows: int               # R: most lanes' chunks one step carries (packed prefill)
    mixed_max_depth: int
    max_seq_len: int
    page_size: int
    pages_per_lane: int
    num_pages: int
    pool_pages: int | None          # None: num_pages (the allocator checks it)
    vocab_size: int

    @property
    def history_len(self) -> int:
        """The penalties' history row: a lane's token capacity."""
        return self.pages_per_lane * self.page_size

    @property
    def mask_words(self) -> int:
        """i32 words of one packed grammar mask row (mtpjax/grammar.py: words)."""
        return (self.vocab_size + 31) // 32

    def lane_bucket(self, top: int) -> int:
        """The lane slots a decode step over lanes 0..top-1 runs."""
        return next(b for b in self.lane_buckets if b >= top)

    def chunk_bucket(self, n: int, rides: bool) -> int:
        """A chunk of n tokens padded: its ride bucket inside a decode step, else its chunk
        bucket."""
        return next(b for b in (self.ride_buckets if rides else self.chunk_buckets)
                    if b >= max(n, 1))

    def ride(self, lens: Sequence[int], rides: bool) -> tuple[int, int]:
        """(rows, T) of the program carrying chunks of these lengths: one chunk, one row of
        its bucket; several (packed prefill), prefill_rows rows of the longest one's ride
        bucket beside decoding lanes, of prefill_chunk alone (no lane decodes: a burst's
        first chunks, full ones). Two row counts only (1 and prefill_rows), so packing adds
        one program per ride bucket and mixed depth, and one prefill program (the mappings
        budget)."""
        if len(lens) == 1:
            return 1, self.chunk_bucket(lens[0], rides)
        return self.prefill_rows, (self.chunk_bucket(max(lens), True) if rides
                                   else self.prefill_chunk)

    @classmethod
    def build(cls, *, num_draft_slots: int, max_lanes: int, lane_slots: int | None,
              lane_buckets: Sequence[int] | None, prefill_chunk: int,
              prefill_buckets: Sequence[int] | None, ride_buckets: Sequence[int] | None,
              prefill_rows: int | None, mixed_max_depth: int | None, max_seq_len: int, max_position: int,
              page_size: int, num_pages: int | None, pool_pages: int | None,
              vocab_size: int) -> "StepShapes":
        """The engine's shape arguments, checked (ValueError), with their defaults."""
        k = num_draft_slots
        if max_lanes < 1:
            raise ValueError(f"max_lanes must be >= 1, got {max_lanes}")
        slots_given = lane_slots is not None
        lane_slots = max_lanes if lane_slots is None else int(lane_slots)
        if lane_slots < max_lanes:
            raise ValueError(f"lane_slots ({lane_slots}) must be >= max_lanes ({max_lanes})")
        lanes = _lane_buckets(max_lanes, lane_slots, lane_buckets)
        if max_seq_len < 2 or max_seq_len > max_position:
            raise ValueError(f"max_seq_len must be in [2, {max_position}], got {max_seq_len}")
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        buckets = sorted(set(map(int, prefill_buckets or _buckets(prefill_chunk))))
        if buckets[0] < 1 or buckets[-1] != prefill_chunk:
            raise ValueError(f"prefill_buckets must be positive and end at prefill_chunk="
                             f"{prefill_chunk}, got {buckets}")
        if mixed_max_depth is not None and mixed_max_depth < 0:
            raise ValueError(f"mixed_max_depth must be >= 0, got {mixed_max_depth}")
        mixed = k if mixed_max_depth is None else min(int(mixed_max_depth), k)
        if ride_buckets is None:   # a prompt's short tail (e.g. up to its last page) rides cheap
            ride_buckets = (next(b for b in buckets if b >= min(page_size, prefill_chunk)),
                            prefill_chunk)
        rides = sorted(set(map(int, ride_buckets)))
        if rides[0] < 1 or rides[-1] != prefill_chunk:
            raise ValueError(f"ride_buckets must be positive and end at prefill_chunk="
                             f"{prefill_chunk}, got {rides}")
        # packed prefill: up to 4 lanes' chunks a step by default (never more than the lanes)
        rows = min(PREFILL_ROWS, max_lanes) if prefill_rows is None else int(prefill_rows)
        if not 1 <= rows <= max_lanes:
            raise ValueError(f"prefill_rows must be in [1, max_lanes={max_lanes}], got "
                             f"{prefill_rows}")
        # Room past the context limit for the k+1 verify slots and the k-1 chained MTP slots,
        # so that where a request stops does not depend on k.
        pages_per_lane = pages_for(max_seq_len + 2 * k, page_size)
        num_pages = max_lanes * pages_per_lane if num_pages is None else num_pages
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        if pool_pages is None and slots_given:
            pool_pages = max(num_pages, lane_slots * pages_per_lane)
        return cls(k, max_lanes, lane_slots, lanes, prefill_chunk, tuple(buckets),
                   tuple(rides), rows, mixed, max_seq_len, page_size, pages_per_lane, num_pages,
                   pool_pages, vocab_size)


def _lane_buckets(max_lanes: int, lane_slots: int, given: Sequence[int] | None) -> tuple:
    """The decode lane buckets: given (checked), else 1, 2, 4, ... below max_lanes, and
    max_lanes."""
    if given is None:
        return tuple(sorted({min(1 << (n - 1).bit_length(), max_lanes)
                             for n in range(1, max_lanes + 1)}))
    out = tuple(sorted({int(b) for b in given}))
    if not out or out[0] < 1 or out[-1] > lane_slots or out[-1] < max_lanes:
        raise ValueError(f"lane_buckets must be positive, at most lane_slots={lane_slots} and "
                         f"reach max_lanes={max_lanes}, got {list(given)}")
    return tuple(b for b in out if b < max_lanes) + (min(b for b in out if b >= max_lanes),)


def _buckets(limit: int) -> list[int]:
    b, out = 8, []
    while b < limit:
        out.append(b)
        b *= 2
    out.append(limit)
    return out


@dataclasses.dataclass(frozen=True)
class ChunkInput:
    """The prefill chunks a step carries, each padded to `bucket` tokens: one lane's (one row),
    or several lanes' packed into StepShapes.prefill_rows rows (packed prefill). Row r < len(
    lanes) is lanes[r]'s positions [starts[r], starts[r] + n_valid[r]), in arrival order; the
    rows after them are padding (the runner gives them a lane slot out of range: they read
    zeros and write nothing)."""
    lanes: tuple[int, ...]
    starts: tuple[int, ...]
    n_valid: tuple[int, ...]
    tokens: np.ndarray         # i32[rows, bucket]
    next_tokens: np.ndarray    # i32[rows, bucket]: tokens[r, t]'s successor (the MTP pair)
    page_table: np.ndarray     # i32[rows, pages_per_lane]: the lanes' rows, as planned
    bucket: int                # T: a chunk bucket alone, a ride bucket inside a decode step

    @property
    def rows(self) -> int:
        return self.tokens.shape[0]

    @property
    def packed(self) -> bool:
        """Several rows: the step's program takes each row's lane (steps.Chunk, packed)."""
        return self.rows > 1

    @property
    def shape(self) -> tuple[int, ...]:
        """What the chunk adds to a program key: (T,) alone, (T, rows) packed."""
        return (self.bucket, self.rows) if self.packed else (self.bucket,)


@dataclasses.dataclass(frozen=True)
class SamplingRows:
    """Every lane slot's sampling settings (idle slots: greedy defaults)."""
    temperature: np.ndarray    # f32[lanes]
    top_k: np.ndarray          # i32[lanes]
    top_p: np.ndarray          # f32[lanes]
    seed: np.ndarray           # u32[lanes]


@dataclasses.dataclass(frozen=True)
class ExtrasRows:
    """logit_bias, penalties and log-probability requests of the step's lanes (steps.Extras).
    history None: no penalised lane (the runner sends its cached all -1 rows)."""
    want_logprobs: np.ndarray  # bool[lanes]
    bias_ids: np.ndarray       # i32[lanes, LOGIT_BIAS_MAX]
    bias_values: np.ndarray    # f32[lanes, LOGIT_BIAS_MAX]
    history: np.ndarray | None  # i32[lanes, history_len]: prompt + output, -1 past it
    prompt_len: np.ndarray     # i32[lanes]
    presence: np.ndarray       # f32[lanes]
    frequency: np.ndarray      # f32[lanes]
    repetition: np.ndarray     # f32[lanes]


@dataclasses.dataclass(frozen=True)
class Batch:
    """One iteration's work for the model runner, in lane order.

    lanes: the lane slots the decode step runs (its lane bucket; every slot when a chunk
    rides); 0 when no lane decodes (the chunk runs alone, or nothing runs). depth: the drafts
    the step verifies (0..num_draft_slots). masks None: no constrained lane (the runner's
    cached all-allowed masks); drafts None: the device's drafts stand, else every lane slot's
    drafts as the step must verify them (masked drafts). extras None and constrained None:
    the runner's cached all-off extras. contexts: tokens each decoding lane has cached before
    the step (what the H200 clock prices)."""
    depth: int
    lanes: int
    moves: tuple[tuple[int, int], ...] = ()      # (src, dst) lane moves, first
    restores: tuple[tuple, ...] = ()   # (lane, snapshot slot, MTP KV rewrite: None or
                                       # (src page, dst page, token L, L-1)), after the moves
    chunk: ChunkInput | None = None
    snapshots: tuple[tuple[int, int], ...] = ()  # (lane, slot): save a chunk lane's GDN state
                                                 # there after the step
    active: np.ndarray | None = None             # bool[lanes]: decoding lanes
    join_mask: np.ndarray | None = None          # bool[lanes]: lanes joining with their last
    join_tokens: np.ndarray | None = None        # i32[lanes]   prompt token,
    join_positions: np.ndarray | None = None     # i32[lanes]   at this position
    page_table: np.ndarray | None = None         # i32[lanes, pages_per_lane]
    sampling: SamplingRows | None = None
    masks: np.ndarray | None = None              # i32[lanes, depth + 1, words]
    drafts: np.ndarray | None = None             # i32[lane_slots, num_draft_slots]
    extras: ExtrasRows | None = None
    constrained: np.ndarray | None = None        # bool[lanes]: record draft candidates
    contexts: tuple[int, ...] = ()
    # simulated acceptance (timing only, mtpjax/simulated_acceptance.py): each lane accepts
    # that many drafts; None: off (the runner's cached all -1)
    forced_accept: np.ndarray | None = None      # i32[lanes]
    # time the step alone (a sample for the depth policy): the runner launches it on an idle
    # device and reads its outputs before anything else is launched. In the overlapped loop
    # a step queued behind another cannot be timed apart: the host sees the one before end
    # late (its wake-up may wait for the queued step), so the rest are not policy samples
    timed: bool = False

    @property
    def decodes(self) -> bool:
        """Whether the step runs the decode program (else the chunk alone, or nothing)."""
        return self.lanes > 0

    @property
    def key(self) -> tuple | None:
        """The program the step runs, as warmup_plan names it (None: no program)."""
        if self.decodes:
            return (("decode", self.depth, self.lanes) if self.chunk is None
                    else ("mixed", self.depth, self.lanes) + self.chunk.shape)
        return None if self.chunk is None else ("prefill",) + self.chunk.shape


@dataclasses.dataclass(frozen=True)
class StepResult:
    """What the runner hands back: host arrays, indexed by lane slot.

    tokens[b, :accepted[b] + 1] are lane b's emitted tokens; logprobs (only when a lane
    asked): (chosen token's [lanes, depth+1], top ids [lanes, depth+1, TOP], top values).
    seconds: the step program's time (modelled with a clock); compiled: those seconds are
    no step cost (its first run compiled, or, in the overlapped loop, other programs of its
    launch ran before it without being waited for)."""
    tokens: np.ndarray | None = None      # i32[lanes, depth + 1]
    accepted: np.ndarray | None = None    # i32[lanes]
    logprobs: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
    seconds: float = 0.0
    compiled: bool = False
