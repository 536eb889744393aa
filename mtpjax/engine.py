"""The serving engine: lanes, a paged KV pool, and the host loop around the step programs.

The engine is the engine core (host side: validation, sessions, the scheduler's plan) plus
its model runner (`_run`, `_step`, `_chunk`, `warmup`: device state and program launches),
joined by one ordered record per iteration, `scheduler.StepBatch`: which lane holds which
request, its position, real drafts and whether its last prompt token joins now, the step's
depth, the prefill chunk. Everything after the step (tokens to requests, acceptance to the
depth policy, snapshots to the prefix cache) reads that record, in its row order. Invalid
requests end with finish_reason "error" and never touch the device. The same code with
num_speculative_tokens = 0 is the stock engine the judge compares against.

Host loop (one iteration, ONE program that reads the weights once):
  1. `Scheduler.schedule()`: cancellations, admission by page budget, page reservation for this
     iteration's writes (preemption by recompute when the pool is short), speculation depth,
     the StepBatch record
  2. the decode step over the decoding lanes at the depth 0..K the policy chose (fixed:
     SpeculationPolicy; adaptive: depth.AdaptiveDepth, which learns from the step time and
     acceptance the engine reports), carrying at most one lane's prefill chunk (up to
     prefill_chunk tokens: the iteration's prefill token budget) in the same forward
     (steps.decode_step(chunk=...), key ("mixed", depth, lane_slots, T): T its ride bucket); a
     lane whose chunk reaches its last prompt token joins the step with that token and gets
     its first token from it. With no lane decoding, the chunk runs alone (`prefill_chunk`).
  3. a snapshot save when the chunk ended at a prefix-cache boundary (then the entry is
     published)
  4. read back the emitted tokens; the scheduler applies stop conditions, streams them to
     on_token and frees finished lanes' pages

Structured output (SamplingParams.grammar, mtpjax/grammar.py): a constrained request keeps an
llguidance matcher on the host (scheduler.Request.constraint, advanced by its emitted tokens);
before each decode step the engine reads back the drafts the step verifies and hands the step
one packed token mask per verify row (`_masks`: the grammar state after the emitted tokens and
the drafts before that row), so verification samples from the masked target distribution and
the output is constrained plain decoding's, token for token. The masks are an input of every
decode program (one cached all-allowed array when no lane is constrained): no extra program.
The drafts are masked too (`mask_drafts`): a step with a constrained lane also records each
draft's best draft-head candidates (LaneState.candidates), and before the next step the host
replaces each draft the lane's grammar forbids by the first allowed candidate (the masked
argmax of the draft logits; grammar.Constraint.masked_drafts) and writes the corrected drafts
into the lane state, so the step verifies drafts the grammar allows instead of drafts
verification must reject.

Log probabilities and logit_bias (SamplingParams.logprobs / .logit_bias): every decode step
takes a `steps.Extras` (each lane's bias, padded sparse ids + values, and whether it wants log
probabilities; one cached all-off set when no lane asks: no extra program) and returns the log
probabilities of every verify row (the raw target distribution's: log_softmax of the model's
logits; the chosen token's and the top steps.TOP_LOGPROBS). They are read back only when a
lane asked, and each emitted token gets the record of the row it came from, which is the
plain engine's row for that position: speculation changes neither (tests/test_logprobs.py).
The bias is added to the target logits before verification samples from them, so the biased
output is exact too.

Penalties (SamplingParams.presence_penalty / frequency_penalty / repetition_penalty) ride in
the same `steps.Extras`: each penalised lane's tokens so far (prompt + output: the host knows
them, scheduler.Request.prompt / .out, also after a preemption, which keeps both, and for
each of n sibling requests, which are requests of their own) as one fixed-shape history row
of the lane's token capacity, and the three values. The step counts the history on device and
adds the drafts before each verify row (steps._penalized), so every row sees the counts a
plain sampler at its position sees: the penalised output is exact under speculation, greedy
and seeded. The host keeps the history rows between steps (`_history`) and writes only each
lane's new tokens; the row goes to the device only in a step with a penalised lane.

Device state: `model.Cache` with a `PagedKV` pool per full-attention layer and for the MTP layer
([NKV, num_pages, page_size, HD] each) plus per-lane GDN slots per GDN layer, and
`steps.LaneState`.
The page table (kv_pool.PageAllocator.table) is sent with every program call.

Compiled programs: one prefill program per chunk bucket (default 8, 16, ... prefill_chunk), one
decode program per (draft depth used (0..K), lane bucket: default 1, 2, 4, ... max_lanes, or
`lane_buckets`) and one more per depth up to mixed_max_depth and ride bucket with a chunk riding (over every
lane slot, whatever the busy lanes: the padding rows are few beside the chunk's tokens, and
the programs stay few). A decode step runs only the lane slots up to the highest busy lane, rounded up to a
bucket, so idle lanes cost nothing; `stats()["compiled_programs"]`. `warmup()` compiles every
program a run can reach up front. Programs are keyed by shapes, so engines that agree on
lane_slots, pool_pages, max_seq_len, page_size and K share them (the judge builds its engines
that way: one program set for every workload).

The H200 clock (`clock=`, a cost_model.VirtualClock): the engine runs here, on whatever device
JAX has, with real tokens and real acceptance, while time is that of Qwen3.5-27B on an H200.
Every program `step()` launches (lane moves, snapshot restores, prefill chunks, snapshot
saves, decode steps; not `warmup()`) runs to completion and then advances the clock by the
cost model's price of that program at its real shapes: ("decode", depth, lane bucket) with
the tokens each busy lane has cached, ("prefill", chunk bucket) with the chunk's start and
whether it is the prompt's last. This device's own compute time is not counted. Host time is
measured: the wall time inside `step()` outside the launched programs (scheduling, page
bookkeeping, building inputs, reading tokens back into lists, the depth policy, this device's
dispatch and sync overhead outside a program's bracket), minus the time spent in the caller's
on_token callbacks (the caller's work, e.g. a benchmark's own bookkeeping); it goes to
`clock.add_host` and `timing["host_s"]`. With a clock, `timing["step_s"]` and
`timing["prefill_s"]` hold modelled seconds, the depth policy learns from modelled step
seconds, `timing["ttft_s"]` / `timing["first_tokens"]` add up each request's time to first
token on the clock (from `submit` to the end of its last prefill chunk), and `stats()["clock"]`
is `clock.report()`.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jax.sharding import NamedSharding, PartitionSpec

from mtpjax import draft_vocab as draft_vocab_lib
from mtpjax import model, quant, simulated_acceptance, snapshots, steps, tensor_parallel
from mtpjax.config import Config
from mtpjax.depth import AdaptiveDepth
from mtpjax.gdn import check_kernels
from mtpjax.kv_pool import OutOfPagesError, PageAllocator, pages_for
from mtpjax.params import Params
from mtpjax.prefix_cache import PrefixCache
from mtpjax.sampling import LaneSampling, SamplingParams
from mtpjax.scheduler import (FINISH_CANCELLED, FINISH_ERROR, FINISH_LENGTH, FINISH_STOP,
                              Policy, PrefillWork, Request, RequestOutput, RequestStats,
                              Scheduler, SpeculationPolicy, StepBatch, TokenLogprob)

__all__ = ["Engine", "RequestOutput", "RequestStats", "TokenLogprob", "SpeculationPolicy", "AdaptiveDepth",
           "OutOfPagesError",
           "FINISH_STOP", "FINISH_LENGTH", "FINISH_ERROR", "FINISH_CANCELLED", "default_kernels"]


def default_kernels() -> str:
    return "pallas" if jax.default_backend() == "gpu" else "reference"


def _peek_config(path: str) -> Config:
    return Config.from_pretrained(path)


def _check_placed(cfg: Config, params: Params, mesh) -> None:
    """Params handed in with a mesh must already be laid out on it (tensor_parallel)."""
    want = tensor_parallel.sharded_abstract_params(cfg, mesh, params.embed.dtype)
    for got, exp in zip(jax.tree.leaves(params), jax.tree.leaves(want)):
        if got.shape != exp.shape or not got.sharding.is_equivalent_to(exp.sharding, got.ndim):
            raise ValueError(f"params given with mesh= are not laid out on it (a leaf has shape "
                             f"{got.shape}, sharding {got.sharding}; expected {exp.shape}, "
                             f"{exp.sharding}): pass tp= instead, or place them with "
                             "tensor_parallel.place_params")


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


class Engine:
    """Continuous batching over `max_lanes` lanes and a paged KV pool, with MTP speculation.

    kernels: "reference" (plain jnp), "pallas" (Triton kernels) or "interpret" (the Pallas
      interpreter, CPU tests); default: pallas on GPU, reference elsewhere.
    page_size, num_pages: the KV pool; num_pages defaults to every lane at full context (no
      preemption). A smaller pool admits by page budget and preempts by recompute.
    speculation_policy: each step's draft depth 0..K: None or "fixed" = K whenever the pages
      allow (scheduler.SpeculationPolicy), "adaptive" = depth.AdaptiveDepth() (the depth that
      maximizes expected tokens per second from measured step cost and acceptance), or any
      scheduler.Policy.
    prefill_buckets: padded chunk lengths, one prefill program each (default 8, 16, ...,
      prefill_chunk); the largest must be prefill_chunk.
    prefix_cache: reuse cached prompt prefixes (KV pages + GDN snapshots, see
      mtpjax/prefix_cache.py), across requests and generate calls; output is the same with
      it on or off. Cached KV pages are pool pages that requests take back on demand (LRU).
      prefix_snapshots: GDN snapshot slots, a fixed device allocation beside the pool
      (default min(max(2 * max_lanes, 4), 32); stats()["prefix_cache"]["slot_bytes"]; 151 MB
      each at 27B, so size num_pages and prefix_snapshots together within the memory budget).
      snapshot_every_blocks: snapshots are taken at page-aligned prefill chunk ends at least
      this many pages apart (chunks end at multiples of prefill_chunk, the same positions for
      every request; with prefill_chunk a multiple of the page size, every chunk end).
    mixed_max_depth: the deepest step that carries a prefill chunk (default K; the policy's
      depth is capped to it in those iterations): each depth is one program per ride bucket.
    ride_buckets: the padded lengths of a chunk riding in a decode step, one program per depth
      each (default: the smallest chunk bucket >= page_size, and prefill_chunk; the largest
      must be prefill_chunk). A prompt's last chunk is often short (with the prefix cache it
      is at most the tokens after the last page boundary): padded to prefill_chunk it would
      cost a compute-bound pass (a 512-token chunk at 27B: ~35 ms instead of ~2 ms).
    depth0_fills_mtp_kv: a depth-0 step of a K > 0 engine writes the MTP KV of the pair it
      commits (True) or is the stock step (False, default: later drafts attend the stale
      entries, a measured acceptance cost of about nothing; see steps.py).

    Shapes and programs. Every compiled program is keyed by the shapes of what it takes, so
    these set how many programs a run compiles (each costs seconds to compile and, on XLA:CPU,
    some 600 of the process's 65,530 memory mappings):
    max_lanes: requests decoded together (the rest wait in the queue).
    lane_slots: lane slots in the device state (GDN state, lane state, page table rows;
      default max_lanes, at least max_lanes). Engines with different max_lanes but the same
      lane_slots (and pool, context, K) share every compiled program.
    lane_buckets: the lane counts a decode step is compiled for (default 1, 2, 4, ...
      max_lanes): a step over n busy lanes runs the smallest bucket >= n, so each extra
      bucket is one more program per draft depth. Idle lanes inside a bucket are padding
      (nearly free when decode is memory-bound, compute on a CPU).
    pool_pages: the device pool's pages (at least num_pages); the allocator hands out
      num_pages of them, so engines with different page budgets can share a pool shape, hence
      their programs. Default: num_pages; with lane_slots given, the larger of num_pages and
      every lane slot at full context (lane_slots x pages_per_lane), the pool that engines of
      one lane_slots share whatever their max_lanes and num_pages (the judge's engines).

    draft_vocab: None (default: drafts take the argmax over the whole vocabulary) or the
      draft vocabulary (mtpjax/draft_vocab.py: token ids, or a DraftVocab / its path; a size
      N is resolved by from_checkpoint against the list beside the checkpoint): the MTP
      drafts over those lm_head rows only, gathered here into params.draft. Verification is
      unchanged, so outputs are too; a draft is cheaper (N x H read, not V x H) and accepted
      a little less often.

    grammar_tokenizer: what structured output (SamplingParams.grammar) tokenizes with: an
      llguidance LLTokenizer, a tokenizer.json or checkpoint folder path, or a
      text.Tokenizer; built lazily at the first constrained request (from_checkpoint passes
      the checkpoint's tokenizer.json). None: a request with a grammar ends "error". Each
      step's verification then samples from the grammar-masked target distribution, the
      output of constrained plain decoding token for token (mtpjax/grammar.py); the masks are
      an input of every decode program (all-allowed without a constrained lane), so they add
      no program.
    mask_drafts: correct a constrained lane's drafts by its grammar before each step (True,
      default; see `_masks`), or verify the MTP's drafts as they are (False: for comparison;
      the output is the same either way, only acceptance differs). An attribute: it can be
      changed between steps, with the same programs.

    clock: None (default: wall time, as measured) or a cost_model.VirtualClock whose model has
      this engine's K and page size: time is then the modelled H200's (module docstring).
      timing["step_s"] and timing["prefill_s"] then hold modelled seconds, timing["host_s"]
      the measured host seconds added to the clock.
    simulate_acceptance: None, or a profile name / path / simulated_acceptance.Profile or
      Simulator: each verify step accepts as many drafts as a seeded draw from the profile
      (Extras.forced_accept), for timing on the clock only: the tokens are not the model's.
    """

    def __init__(self, cfg: Config, params: Params, *, num_speculative_tokens: int = 0,
                 max_lanes: int = 4, max_seq_len: int = 1024, prefill_chunk: int = 64,
                 kernels: str | None = None, eos_token_ids: Sequence[int] | None = None,
                 page_size: int = 16, num_pages: int | None = None,
                 speculation_policy: Policy | str | None = None,
                 prefill_buckets: Sequence[int] | None = None,
                 tp: int = 1, devices: Sequence | None = None, mesh=None,
                 prefix_cache: bool = True, prefix_snapshots: int | None = None,
                 snapshot_every_blocks: int = 4, depth0_fills_mtp_kv: bool = False,
                 lane_slots: int | None = None, lane_buckets: Sequence[int] | None = None,
                 pool_pages: int | None = None, clock=None, mixed_max_depth: int | None = None,
                 ride_buckets: Sequence[int] | None = None, draft_vocab=None,
                 grammar_tokenizer=None, mask_drafts: bool = True,
                 simulate_acceptance=None):
        k = int(num_speculative_tokens)
        if k < 0:
            raise ValueError(f"num_speculative_tokens must be >= 0, got {k}")
        if k > 0 and not cfg.has_mtp:
            raise ValueError("num_speculative_tokens > 0 needs a checkpoint with an MTP head")
        if max_lanes < 1:
            raise ValueError(f"max_lanes must be >= 1, got {max_lanes}")
        slots_given = lane_slots is not None
        lane_slots = max_lanes if lane_slots is None else int(lane_slots)
        if lane_slots < max_lanes:
            raise ValueError(f"lane_slots ({lane_slots}) must be >= max_lanes ({max_lanes})")
        self.lane_buckets = _lane_buckets(max_lanes, lane_slots, lane_buckets)
        if max_seq_len < 2 or max_seq_len > cfg.max_position_embeddings:
            raise ValueError(f"max_seq_len must be in [2, {cfg.max_position_embeddings}], "
                             f"got {max_seq_len}")
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        kernels = kernels or default_kernels()
        check_kernels(kernels)
        if kernels == "pallas" and page_size & (page_size - 1):
            raise ValueError(f"the Triton paged-attention kernel needs a power-of-two "
                             f"page_size, got {page_size}")
        if quant.has_fp8(params):          # the FP8 matmul follows the kernels choice
            tensor_parallel.check_fp8(params, tp if mesh is None else tensor_parallel.mesh_tp(mesh))
            params = quant.set_impl(params, kernels)
        if mesh is None:
            mesh = tensor_parallel.make_meshes(tp, 1, devices)[0]
            params = tensor_parallel.place_params(cfg, params, mesh)
        elif tp not in (1, tensor_parallel.mesh_tp(mesh)):
            raise ValueError(f"tp={tp} but the given mesh has {tensor_parallel.mesh_tp(mesh)} "
                             "devices on its tp axis")
        elif not quant.has_fp8(params):
            _check_placed(cfg, dataclasses.replace(params, draft=None), mesh)
        tensor_parallel.check_tp(cfg, tensor_parallel.mesh_tp(mesh))
        self.mesh, self.tp = mesh, tensor_parallel.mesh_tp(mesh)
        self.draft_ids = draft_vocab_lib.resolve(draft_vocab, cfg.vocab_size)
        if self.draft_ids is not None and k == 0:
            raise ValueError("draft_vocab needs num_speculative_tokens > 0 (a stock engine "
                             "drafts nothing)")
        params = dataclasses.replace(params, draft=None if self.draft_ids is None else
                                     draft_vocab_lib.build_head(params, self.draft_ids,
                                                                self.tp, mesh))
        self.cfg, self.params, self.k = cfg, params, k
        self.depth0_fills_mtp_kv = bool(depth0_fills_mtp_kv)
        self.max_lanes, self.max_seq_len, self.kernels = max_lanes, max_seq_len, kernels
        buckets = sorted(set(map(int, prefill_buckets or _buckets(prefill_chunk))))
        if buckets[0] < 1 or buckets[-1] != prefill_chunk:
            raise ValueError(f"prefill_buckets must be positive and end at prefill_chunk="
                             f"{prefill_chunk}, got {buckets}")
        self.prefill_chunk = prefill_chunk
        self.chunk_buckets = buckets
        if mixed_max_depth is not None and mixed_max_depth < 0:
            raise ValueError(f"mixed_max_depth must be >= 0, got {mixed_max_depth}")
        self.mixed_max_depth = k if mixed_max_depth is None else min(int(mixed_max_depth), k)
        if ride_buckets is None:   # a prompt's short tail (e.g. up to its last page) rides cheap
            ride_buckets = (next(b for b in buckets if b >= min(page_size, prefill_chunk)),
                            prefill_chunk)
        self.ride_buckets = sorted(set(map(int, ride_buckets)))
        if self.ride_buckets[0] < 1 or self.ride_buckets[-1] != prefill_chunk:
            raise ValueError(f"ride_buckets must be positive and end at prefill_chunk="
                             f"{prefill_chunk}, got {self.ride_buckets}")
        self.eos = tuple(cfg.eos_token_ids if eos_token_ids is None else eos_token_ids)
        if speculation_policy in (None, "fixed"):
            speculation_policy = SpeculationPolicy()
        elif speculation_policy == "adaptive":
            speculation_policy = AdaptiveDepth()
        elif isinstance(speculation_policy, str) or not callable(speculation_policy):
            raise ValueError(f"speculation_policy must be 'fixed', 'adaptive' or a callable "
                             f"policy, got {speculation_policy!r}")
        self.policy = speculation_policy
        self.simulated = simulated_acceptance.simulator(simulate_acceptance)
        self.dtype = params.embed.dtype
        # Room past the context limit for the k+1 verify slots and the k-1 chained MTP slots,
        # so that where a request stops does not depend on k.
        self.pages_per_lane = pages_for(max_seq_len + 2 * k, page_size)
        num_pages = max_lanes * self.pages_per_lane if num_pages is None else num_pages
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        self.page_size, self.num_pages, self.lane_slots = page_size, num_pages, lane_slots
        if pool_pages is None and slots_given:
            pool_pages = max(num_pages, lane_slots * self.pages_per_lane)
        self.alloc = PageAllocator(num_pages, page_size, lane_slots, self.pages_per_lane,
                                   pool_pages=pool_pages)      # checks pool_pages >= num_pages
        self.pool_pages = pool_pages = self.alloc.sentinel
        if snapshot_every_blocks < 1:
            raise ValueError(f"snapshot_every_blocks must be >= 1, got {snapshot_every_blocks}")
        self.every_blocks = int(snapshot_every_blocks)
        self.prefix: PrefixCache | None = None
        self.snaps = None
        if prefix_cache:
            slots = (min(max(2 * lane_slots, 4), 32) if prefix_snapshots is None
                     else int(prefix_snapshots))
            if slots < 1:
                raise ValueError(f"prefix_snapshots must be >= 1, got {slots}")
            snap_b = snapshots.snapshot_bytes(cfg, self.dtype)
            # The slots are their own fixed allocation (slots x snap_b bytes, in stats()), so
            # a snapshot is not also charged pool pages: cached KV pages are pool pages that
            # requests take back on demand, and the cache never lowers request capacity.
            self.prefix = PrefixCache(self.alloc, num_slots=slots, snapshot_pages=0,
                                      snapshot_bytes=snap_b, every_blocks=self.every_blocks,
                                      next_token_in_key=k > 0)
        self.cache, self.state, self.snaps = self._device_state()
        self.timing = {"prefill_s": 0.0, "step_s": 0.0, "host_s": 0.0, "steps": 0,
                       "plain_steps": 0, "mixed_steps": 0, "prefill_chunks": 0,
                       "lane_moves": 0}
        self.preemptions = 0
        self.depth_steps = [0] * (k + 1)          # decode steps run at each depth
        self._programs: set = set()
        self._sched: Scheduler | None = None
        self._clock = None
        self._mark = 0.0                 # clock: perf_counter where the open host segment began
        self._submitted: dict[int, float] = {}   # clock: request id -> clock time of submit
        self.clock = clock
        self._grammar_src, self._grammar_tok = grammar_tokenizer, None
        self.mask_drafts = bool(mask_drafts)
        self._no_masks: dict[tuple[int, int], jax.Array] = {}   # (lanes, depth) -> all -1
        self._no_extras: dict[int, steps.Extras] = {}             # lanes -> all off
        # penalties: each lane slot's token history (prompt + output, -1 past it) as the
        # steps take it, and whose it is: (the Request object, tokens written); see _extras
        self.history_len = self.pages_per_lane * page_size
        self._history = np.full((lane_slots, self.history_len), -1, np.int32)
        self._history_of: list[tuple[object, int] | None] = [None] * lane_slots

    @property
    def clock(self):
        """The VirtualClock this engine advances (None: wall time); see the module docstring."""
        return self._clock

    @clock.setter
    def clock(self, clock) -> None:
        if clock is not None:
            model = getattr(clock, "model", None)
            for name, want in (("K", self.k), ("page_size", self.page_size)):
                got = getattr(model, name, want)
                if got != want:
                    raise ValueError(f"the clock's cost model has {name} = {got}, this engine "
                                     f"{want}: it would price programs of other shapes")
            self.timing.setdefault("ttft_s", 0.0)
            self.timing.setdefault("first_tokens", 0)
        self._clock = clock

    @classmethod
    def from_checkpoint(cls, path: str, dtype: str = "float32", num_speculative_tokens: int = 0,
                        tp: int = 1, dp: int = 1, devices: Sequence | None = None,
                        weights: str = "auto", mtp_weights: str = "auto", **kw):
        """Load a checkpoint onto tp x dp devices; kw (kernels, page_size, num_pages,
        max_lanes, ...) go to each Engine.

        tp: tensor-parallel degree (each weight and cache split over tp devices, see
        tensor_parallel.py); dp: data-parallel replicas, each with its own lanes and page pool
        (dp > 1 returns a `data_parallel.DataParallelEngine`, which has the Engine interface).
        Each checkpoint tensor is read once and sent straight to its shards.
        weights: "auto" (as stored: an FP8 checkpoint loads FP8), "fp8" (quantize the linears
        block-wise at load time) or "dense"; mtp_weights: the MTP head's, "auto" = as stored,
        dense when weights="fp8" (see mtpjax/quant.py).
        draft_vocab (in kw): "auto" (default: draft_vocab.default_size, 64k rows for the
        27B's 248k-id vocabulary when the checkpoint ships a list; the whole vocabulary for
        small ones), None or 0 (the whole vocabulary), a size N or a share of the vocabulary
        (the most frequent ids of the `draft_vocab.json` beside the checkpoint), a path to
        such a list, or token ids.
        """
        from mtpjax.api import load_checkpoint
        import os
        if "grammar_tokenizer" not in kw and os.path.isfile(os.path.join(path, "tokenizer.json")):
            kw["grammar_tokenizer"] = os.path.join(path, "tokenizer.json")   # built lazily
        spec = kw.pop("draft_vocab", "auto")
        if not num_speculative_tokens and spec not in (None, 0, "auto"):
            raise ValueError("draft_vocab needs num_speculative_tokens > 0 (a stock engine "
                             "drafts nothing)")
        if spec == "auto" and not os.path.isfile(os.path.join(path, draft_vocab_lib.FILE)):
            spec = None                   # no list shipped: the whole vocabulary
        if num_speculative_tokens and spec is not None:   # resolved against the list
            kw["draft_vocab"] = draft_vocab_lib.resolve(spec, _peek_config(path).vocab_size,
                                                        path)
        meshes = tensor_parallel.make_meshes(tp, dp, devices)
        if meshes == [None]:
            cfg, params = load_checkpoint(path, dtype, None, weights, mtp_weights)
            return cls(cfg, params, num_speculative_tokens=num_speculative_tokens, **kw)
        tensor_parallel.check_tp(_peek_config(path), tp)     # before reading any weight
        cfg, trees = load_checkpoint(path, dtype, meshes, weights, mtp_weights)
        engines = [cls(cfg, p, num_speculative_tokens=num_speculative_tokens, mesh=m, **kw)
                   for p, m in zip(trees, meshes)]
        if dp == 1:
            return engines[0]
        from mtpjax.data_parallel import DataParallelEngine
        return DataParallelEngine(engines)

    # ---------------------------------------------------------------- validation
    def _validate(self, prompt, params, sched: Scheduler) -> str | None:
        if not isinstance(params, SamplingParams):
            return f"sampling params must be a SamplingParams, got {type(params).__name__}"
        try:
            params.validate(self.cfg.vocab_size)
        except ValueError as e:
            return f"invalid sampling parameters: {e}"
        if len(prompt) == 0:
            return "empty prompt"
        bad = [t for t in prompt if not (0 <= t < self.cfg.vocab_size)]
        if bad:
            return f"token id {bad[0]} outside the vocabulary [0, {self.cfg.vocab_size})"
        if len(prompt) >= self.max_seq_len:
            return (f"prompt too long: {len(prompt)} tokens, the context limit is "
                    f"{self.max_seq_len}")
        need = sched.pages_worst_case(len(prompt), params.max_new_tokens)
        if need > self.num_pages:
            return (f"request cannot fit the KV pool: a prompt of {len(prompt)} tokens with "
                    f"max_new_tokens={params.max_new_tokens} and {self.k} draft slots needs "
                    f"up to {need} pages of {self.page_size} tokens, the pool has "
                    f"{self.num_pages}")
        return None

    # ---------------------------------------------------------------- main entry
    def generate(self, prompts: Sequence[Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] = SamplingParams(),
                 on_token: Callable[[int, list[int]], None] | None = None) -> list[RequestOutput]:
        """Generate for every prompt (lists of token ids); one output per prompt, in order.

        params: one SamplingParams for all, or one per prompt. on_token(i, new_ids) streams
        each request's tokens as they are committed (i = index into prompts). To cancel
        request i, call `engine.cancel(i)` (from on_token or another thread): it ends with
        finish_reason "cancelled" and the tokens streamed so far.
        """
        prompts = [list(map(int, p)) for p in prompts]
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
        self.start(on_token)
        outs: dict[int, RequestOutput] = {}
        try:
            for i, (p, sp) in enumerate(zip(prompts, params)):
                err = self.submit(i, p, sp)
                if err is not None:
                    outs[i] = err
            while self.has_work():
                outs.update(self.step())
        finally:
            self.stop()
        return [outs[i] for i in range(len(prompts))]

    # ---------------------------------------------------------------- continuous session
    def start(self, on_token: Callable[[int, list[int]], None] | None = None) -> None:
        """Open a continuous session: `submit` adds requests at any time, each `step` runs one
        scheduler iteration (admission, at most one prefill chunk, one decode step) over
        everything submitted so far, `stop` ends the session. `generate` is start, submit
        all, step until done, stop; an online server (mtpjax/serving/online.py) keeps one session
        open and submits as requests arrive. on_token(request_id, new_ids) streams tokens.
        submit/step/stop must be called from one thread; `cancel` may come from any."""
        if self._sched is not None:
            raise RuntimeError("a session is already running on this engine (generate() or "
                               "start() without stop())")
        self._sched = Scheduler(self.alloc, k=self.k, max_seq_len=self.max_seq_len,
                                prefill_chunk=self.prefill_chunk, policy=self.policy,
                                on_token=self._callback(on_token), prefix_cache=self.prefix,
                                lanes=self.max_lanes, bucket=self._bucket_of,
                                mixed_depth=self.mixed_max_depth)

    def _callback(self, on_token):
        """on_token as the scheduler calls it; with a clock its time is the caller's, so the
        open host segment starts that much later (not host time of the engine)."""
        if on_token is None:
            return None

        def timed(request_id: int, ids: list[int]) -> None:
            if self.clock is None:
                return on_token(request_id, ids)
            t0 = time.perf_counter()
            try:
                on_token(request_id, ids)
            finally:
                self._mark += time.perf_counter() - t0
        return timed

    def _session(self) -> Scheduler:
        if self._sched is None:
            raise RuntimeError("no session: call engine.start() first")
        return self._sched

    def submit(self, request_id: int, prompt: Sequence[int],
               params: SamplingParams = SamplingParams()) -> RequestOutput | None:
        """Queue a request in the running session. request_id: a new int; lower ids are
        senior (admitted first, preempted last). Returns None when queued, or the request's
        final RequestOutput (finish_reason "error", the problem in .error) when it is invalid:
        an invalid request never reaches the device or disturbs the others."""
        sched = self._session()
        request_id = int(request_id)
        if request_id in sched.ids:
            raise ValueError(f"request id {request_id} was already submitted in this session")
        prompt = [int(t) for t in prompt]
        err = self._validate(prompt, params, sched)
        if err:
            sched.refused(request_id)
            return RequestOutput(prompt, [], FINISH_ERROR, err, RequestStats())
        stops = frozenset(params.stop_token_ids) | frozenset(self.eos)
        constraint = None
        if params.grammar is not None:
            try:
                constraint = self._constraint(params.grammar)
            except (ValueError, TypeError, OSError) as e:
                sched.refused(request_id)
                return RequestOutput(prompt, [], FINISH_ERROR, str(e), RequestStats())
        sched.add(Request(request_id, prompt, params, stops,
                          stats=RequestStats.for_depth(self.k), constraint=constraint))
        if self.clock is not None:
            self._submitted[request_id] = self.clock.now
        return None

    def has_work(self) -> bool:
        """Whether the session has requests queued or running."""
        return self._sched is not None and self._sched.has_work()

    def step(self) -> dict[int, RequestOutput]:
        """One scheduler iteration of the session; returns the requests that ended in it
        (finished, stopped, cancelled), by id."""
        sched = self._session()
        if sched.has_work():
            t0 = self._mark = time.perf_counter()
            plan = sched.schedule()
            if self.clock is None:
                self.timing["host_s"] += time.perf_counter() - t0
            try:
                self._run(sched, plan)
            except BaseException:
                self.stop()
                raise
            if self.clock is not None:
                self._add_host(time.perf_counter() - self._mark)
        done, sched.finished = sched.finished, {}
        for rid in done:
            self._submitted.pop(rid, None)
        return done

    def stop(self) -> dict[int, RequestOutput]:
        """End the session: requests still queued or running end "cancelled" (with the
        tokens they have) and every lane's pages return to the pool. `waiting_at_stop` then
        names the queued ones that had no token yet and were not cancelled: resubmitted to a
        new session, each gets the output it would have had (after a failed step, they are
        the requests the failure did not touch)."""
        sched = self._sched
        if sched is None:
            return {}
        self.waiting_at_stop = tuple(r.id for r in sched.queue
                                     if not r.out and r.id not in sched.cancelled)
        sched.abort()
        self.preemptions += sched.preemptions
        self._sched = None
        self._submitted.clear()
        return sched.finished

    def session_counts(self) -> dict:
        """The open session's requests running (in a lane) and waiting (queued), and its
        preemptions so far (stats()["preemptions"] adds a session's only when it stops);
        zeros without a session."""
        sched = self._sched
        if sched is None:
            return {"running": 0, "waiting": 0, "preemptions": 0}
        return {"running": sum(ln is not None for ln in sched.lanes),
                "waiting": len(sched.queue), "preemptions": sched.preemptions}

    def cancel(self, request_id: int) -> None:
        """Cancel a request of the running session (generate: an index into its prompts); it
        ends with finish_reason "cancelled" and the tokens streamed so far. Thread-safe: the
        session is read once (stop() on another thread may end it meanwhile; a cancel that
        reaches a session already stopped is a no-op)."""
        sched = self._sched
        if sched is not None:
            sched.cancel(request_id)

    # ---------------------------------------------------------------- recovery
    waiting_at_stop: tuple[int, ...] = ()     # set by stop()

    def reset_device_state(self) -> None:
        """Re-create the device state as the constructor built it: the KV pool and GDN slots
        (`cache`), the lane state, the snapshot store, and the host state that describes them
        (an empty page allocator: every page free; an empty prefix cache, its counters kept).

        Why: the step programs donate the cache and lane state, so a step that fails inside
        (or after) its program leaves `self.cache` / `self.state` pointing at deleted (or half
        written) buffers, and every later step would fail. Compiled programs stay valid: the
        shapes are the same. The old arrays are freed first, so the new ones never sit beside
        them (a pool sized to the memory budget would not fit twice). An allocation that fails
        (e.g. out of device memory) raises; calling again retries from where it stopped.
        Needs no session open (stop() first)."""
        if self._sched is not None:
            raise RuntimeError("reset_device_state() needs no open session: stop() it first")
        old = (self.cache, self.state, self.snaps)
        self.cache = self.state = self.snaps = None
        self._delete_arrays(old)
        del old
        self.alloc = PageAllocator(self.num_pages, self.page_size, self.lane_slots,
                                   self.pages_per_lane, pool_pages=self.pool_pages)
        if self.prefix is not None:
            self.prefix = self._empty_prefix_cache(self.prefix, self.alloc)
        self.cache, self.state, self.snaps = self._device_state()

    def _device_state(self):
        """A fresh (cache, lane state, snapshot store or None) for this engine's shapes: the KV
        pool and GDN slots of every lane slot, zero lane state (replicated over a mesh) and
        the prefix cache's snapshot slots. The constructor and reset_device_state both
        build it here. Allocated one after the other: a failure leaves nothing half-built
        referenced."""
        cache = tensor_parallel.init_paged_cache(self.cfg, self.mesh, self.lane_slots,
                                                 self.pool_pages, self.page_size, self.k + 1,
                                                 self.dtype)
        state = steps.LaneState.empty(self.lane_slots, self.k)
        if self.mesh is not None:
            state = jax.device_put(state, NamedSharding(self.mesh, PartitionSpec()))
        snaps = (None if self.prefix is None else
                 snapshots.init_snapshots(self.cfg, self.mesh, self.prefix.num_slots,
                                          self.dtype))
        return cache, state, snaps

    @staticmethod
    def _delete_arrays(tree) -> None:
        """Free the device buffers of a pytree's arrays now (those a donating program has not
        deleted already), rather than when the last Python reference goes."""
        for x in jax.tree.leaves(tree):
            if isinstance(x, jax.Array) and not x.is_deleted():
                x.delete()

    @staticmethod
    def _empty_prefix_cache(old: PrefixCache, alloc: PageAllocator) -> PrefixCache:
        """A prefix cache like `old` (slots, stride, key), empty, on `alloc`; the hit counters
        carry over (they count over the engine's life, as stats() reports them)."""
        new = PrefixCache(alloc, num_slots=old.num_slots, snapshot_pages=old.snapshot_pages,
                          snapshot_bytes=old.snapshot_bytes, every_blocks=old.every_blocks,
                          next_token_in_key=bool(old.extra))
        new.stats = old.stats
        return new

    # ---------------------------------------------------------------- structured output
    @property
    def grammar_tokenizer(self):
        """The llguidance tokenizer constrained requests use (built at first use), or None."""
        if self._grammar_tok is None and self._grammar_src is not None:
            from mtpjax import grammar
            self._grammar_tok = grammar.make_tokenizer(self._grammar_src, self.cfg.vocab_size,
                                                       self.eos)
        return self._grammar_tok

    def _constraint(self, spec: str):
        """A request's grammar state (grammar.Constraint); ValueError when the engine has no
        grammar tokenizer or the grammar is invalid."""
        from mtpjax import grammar
        tok = self.grammar_tokenizer
        if tok is None:
            raise ValueError("this request has a grammar but the engine has no grammar "
                             "tokenizer (Engine(grammar_tokenizer=...), or from_checkpoint on a "
                             "folder with a tokenizer.json)")
        return grammar.Constraint(tok, spec, self.cfg.vocab_size)

    def _masks(self, sched: Scheduler, batch: StepBatch, nb: int):
        """The step's grammar masks, i32[nb, k+1, words] (mtpjax/grammar.py): per constrained
        row, the grammar state after its emitted tokens and each prefix of the drafts the
        device holds (read back here: the drafts the step verifies); -1 (all allowed) for
        every other lane. Without a constrained row, one cached all -1 device array.

        Masked drafts (mask_drafts): the drafts are read back with their candidates
        (LaneState.candidates, recorded by the previous step because this lane was
        constrained there too), each constrained row's drafts are corrected by its grammar
        (grammar.Constraint.masked_drafts: a forbidden draft becomes the first allowed
        candidate) and, when any changed, the lane state's drafts are replaced on the device
        before the step; the masks follow the corrected drafts. Why here and not in the
        step: the grammar is on the host, and the step's drafts follow its own acceptance,
        which the host learns only after it. The cost is what `_masks` already paid (one read
        back of the drafts, a grammar walk per constrained row) plus, when a draft changed,
        one small host-to-device copy."""
        k = batch.k
        rows = [(r, sched.lanes[r.lane].req) for r in batch.rows]
        rows = [(r, req) for r, req in rows if req.constraint is not None]
        if not rows:
            key = (nb, k)
            if key not in self._no_masks:
                self._no_masks[key] = jnp.full((nb, k + 1, (self.cfg.vocab_size + 31) // 32),
                                               -1, jnp.int32)
            return self._no_masks[key]
        from mtpjax import grammar
        masks = np.full((nb, k + 1, grammar.words(self.cfg.vocab_size)), -1, np.int32)
        if not k:
            for r, req in rows:
                masks[r.lane] = req.constraint.step_masks([], req.stops)
            return jnp.asarray(masks)
        # the drafts the step verifies: the device's (a joining lane's are reset to 0)
        if self.mask_drafts:
            drafts, cands = jax.device_get((self.state.drafts, self.state.candidates))
            drafts = np.array(drafts)
        else:
            drafts, cands = np.array(self.state.drafts), None
        changed = False
        for r, req in rows:
            if r.join_token is not None:
                masks[r.lane] = req.constraint.step_masks([0] * k, req.stops)
            elif cands is None:
                masks[r.lane] = req.constraint.step_masks(drafts[r.lane, :k], req.stops)
            else:
                fixed, masks[r.lane] = req.constraint.masked_drafts(
                    drafts[r.lane, :k], cands[r.lane, :k], req.stops)
                if fixed != drafts[r.lane, :k].tolist():
                    drafts[r.lane, :k] = fixed
                    changed = True
        if changed:        # the corrected drafts are the ones the step verifies
            # placed as the state's drafts are, committed or not: a committed copy of an
            # uncommitted state (one device) is another program input, so the step and every
            # program after it (the state flows through them) compiled again after warmup
            old = self.state.drafts
            self.state = dataclasses.replace(self.state, drafts=(
                jax.device_put(drafts, old.sharding) if old.committed else jnp.asarray(drafts)))
        return jnp.asarray(masks)

    # ---------------------------------------------------------------- pieces
    def _lane_sampling(self, sched: Scheduler, n: int | None = None) -> LaneSampling:
        """Sampling settings of the first n lane slots (every slot when None); idle slots get
        defaults."""
        n = self.lane_slots if n is None else n
        lanes = sched.lanes + [None] * (self.lane_slots - len(sched.lanes))
        return LaneSampling.from_params(
            [ln.req.params if ln is not None else SamplingParams() for ln in lanes[:n]])

    def _bucket_of(self, top: int) -> int:
        return next(b for b in self.lane_buckets if b >= top)

    def lane_bucket(self, busy_lanes) -> int:
        """Lane slots a decode step runs: the smallest of `lane_buckets` (default 1, 2, 4, ...,
        max_lanes) that covers the highest busy lane. The scheduler fills the lowest free lane
        first."""
        return self._bucket_of(max(busy_lanes) + 1)

    def _add_host(self, seconds: float) -> None:
        self.clock.add_host(seconds)
        self.timing["host_s"] += seconds

    def _program(self, key: tuple, run: Callable[[], tuple], contexts: Sequence[int] = (),
                 start: int = 0, is_last: bool = True) -> tuple[tuple, float]:
        """Launch one program: run() calls it and returns its outputs. Without a clock that is
        all (returns (outputs, 0.0)). With one, the host segment open since the last program
        closes (clock.add_host), the program runs until its outputs are ready (this device's
        compute is not host time) and the clock advances by its price at these shapes;
        returns (outputs, modelled seconds)."""
        if self.clock is None:
            return run(), 0.0
        t0 = time.perf_counter()
        self._add_host(t0 - self._mark)
        out = jax.block_until_ready(run())
        self._mark = time.perf_counter()
        return out, self.clock.launch(key, contexts, start, is_last)

    def _run(self, sched: Scheduler, batch: StepBatch) -> None:
        """Run one iteration's record: lane moves, snapshot restores, then ONE program (the
        decode step carrying the prefill chunk, or the chunk alone when no lane decodes),
        then the snapshot its chunk may owe the prefix cache, then the bookkeeping, all read
        from `batch` in its row order."""
        clocked = self.clock is not None
        for src, dst in batch.moves:
            (self.cache, self.state), _ = self._program(("move_lane",), lambda: steps.move_lane(
                self.cache, self.state, jnp.int32(src), jnp.int32(dst), mesh=self.mesh))
            self.timing["lane_moves"] += 1
        for lane, slot in batch.restores:      # prefix hits: GDN state at the cached boundary
            (self.cache, self.snaps), _ = self._program(
                ("snapshot_restore",), lambda: snapshots.restore(
                    self.cache, self.snaps, jnp.int32(lane), jnp.int32(slot), mesh=self.mesh))
        w = batch.prefill
        if w is None and not batch.rows:      # nothing to run (e.g. every request cancelled)
            return
        # a chunk riding in a decode step takes the largest bucket: one program per depth and
        # lane bucket, not per chunk length
        chunk, T = (None, 0) if w is None else self._chunk(w, bool(batch.rows))
        t0 = time.perf_counter()
        if batch.rows:
            out, n_acc, lps, key, modelled = self._step(sched, batch, chunk, T)
        else:
            key = ("prefill", T)
            self.cache, modelled = self._program(key, lambda: steps.prefill_chunk(
                self.cfg, self.params, self.cache, chunk, k=self.k, kernels=self.kernels,
                mesh=self.mesh), start=w.start, is_last=False)
        compiled = key not in self._programs
        self._programs.add(key)
        t1 = time.perf_counter()
        seconds = modelled if clocked else t1 - t0
        if w is not None:
            self.timing["prefill_chunks"] += 1
            slot = sched.prefill_done(w)
            if slot is not None:              # a boundary the prefix cache took: save, publish
                (self.cache, self.snaps), saved = self._program(
                    ("snapshot",), lambda: snapshots.save(
                        self.cache, self.snaps, jnp.int32(w.lane), jnp.int32(slot),
                        mesh=self.mesh))
                sched.snapshot_saved(slot)
                # the save is prefill work, whichever program carried the chunk
                self.timing["prefill_s"] += saved if clocked else time.perf_counter() - t1
        if not batch.rows:
            self.timing["prefill_s"] += seconds
            return
        self.timing["step_s"] += seconds          # a decode step, with its chunk if it has one
        self.timing["mixed_steps"] += w is not None
        observe = getattr(self.policy, "observe", None)
        if observe is not None and batch.view is not None:
            # a first call compiles: its wall time is no step cost (modelled time is); a step
            # that carried a chunk is priced as such (view.chunk > 0: the policy keeps those
            # apart, depth.AdaptiveDepth)
            observe(dataclasses.replace(batch.view, bucket=self.lane_bucket(batch.decode)),
                    batch.k, seconds, [int(n_acc[r.lane]) for r in batch.rows],
                    compiled and not clocked)
        self.depth_steps[batch.k] += 1
        t2 = time.perf_counter()
        first = []
        for r in batch.rows:
            if r.join_token is not None:
                first.append(r.request_id)
            sched.decode_done(r.lane, [int(t) for t in out[r.lane]], int(n_acc[r.lane]),
                              batch.k, self._token_logprobs(sched, r.lane, out, n_acc, lps))
        if clocked:
            for rid in first:                 # the request's first token, on the clock
                started = self._submitted.pop(rid, None)
                if started is not None:
                    self.timing["ttft_s"] += self.clock.now - started
                    self.timing["first_tokens"] += 1
        else:
            self.timing["host_s"] += time.perf_counter() - t2
        self.timing["steps"] += 1
        self.timing["plain_steps"] += batch.k == 0

    def _chunk(self, w: PrefillWork, rides: bool) -> tuple[steps.Chunk, int]:
        """The device form of a prefill chunk, padded to T: its chunk bucket when it runs
        alone, its ride bucket when it rides in a decode step."""
        n = len(w.tokens)
        T = next(b for b in (self.ride_buckets if rides else self.chunk_buckets)
                 if b >= max(n, 1))
        toks = np.zeros((1, T), np.int32)
        toks[0, :n] = w.tokens
        nt = np.zeros((1, T), np.int32)
        nt[0, :len(w.next_tokens)] = w.next_tokens
        return steps.Chunk(jnp.int32(w.lane), jnp.asarray(toks), jnp.asarray(nt),
                           jnp.int32(w.start), jnp.int32(n),
                           jnp.asarray(self.alloc.table[w.lane:w.lane + 1])), T

    def _step(self, sched: Scheduler, batch: StepBatch, chunk, T: int):
        """Launch the decode step of batch.rows (with the chunk when given); returns (tokens
        [B, k+1], accepted [B], program key, modelled seconds)."""
        # a step carrying a chunk runs every lane slot: one program per depth, not per depth
        # and lane bucket (the idle slots are padding rows beside the chunk's tokens)
        nb = self.lane_bucket(batch.decode) if chunk is None else self.lane_slots
        active = np.zeros(nb, bool)
        join_mask = np.zeros(nb, bool)
        join_tok = np.zeros(nb, np.int32)
        join_pos = np.zeros(nb, np.int32)
        for r in batch.rows:
            active[r.lane] = True
            if r.join_token is not None:
                join_mask[r.lane], join_tok[r.lane], join_pos[r.lane] = True, r.join_token, r.pos
        join = steps.Join(jnp.asarray(join_mask), jnp.asarray(join_tok), jnp.asarray(join_pos))
        lanes = self._lane_sampling(sched, nb)
        key = ("decode", batch.k, nb) if chunk is None else ("mixed", batch.k, nb, T)
        contexts = [r.pos for r in batch.rows]   # tokens cached per lane before the step
        allowed = self._masks(sched, batch, nb)
        extras, want = self._extras(sched, batch, nb)
        if self.simulated is not None:
            extras = self.simulated.apply(extras, batch, nb)
        (self.cache, self.state, out, n_acc, lps), modelled = self._program(
            key, lambda: steps.decode_step(
                self.cfg, self.params, self.cache, self.state, lanes, jnp.asarray(active),
                jnp.asarray(self.alloc.table[:nb]), join, chunk, allowed, extras, k=batch.k,
                kernels=self.kernels, mesh=self.mesh, fill_mtp_kv=self.depth0_fills_mtp_kv),
            contexts, start=0 if batch.prefill is None else batch.prefill.start)
        # the log probabilities come back only when a request asked for them
        lps = tuple(np.asarray(x) for x in lps) if want else None
        return np.asarray(out), np.asarray(n_acc), lps, key, modelled

    def _extras(self, sched: Scheduler, batch: StepBatch, nb: int):
        """The step's `steps.Extras` (logit_bias, penalties, who wants log probabilities,
        which lanes' drafts are masked) and whether any row wants log probabilities; one
        cached all-off set when no row asks for any of them."""
        if nb not in self._no_extras:
            self._no_extras[nb] = steps.Extras.none(nb, self.history_len)
        none = self._no_extras[nb]
        reqs = [(r.lane, sched.lanes[r.lane].req) for r in batch.rows]
        masked = [b for b, q in reqs if q.constraint is not None] if (
            self.mask_drafts and self.k) else []
        reqs = [(b, q) for b, q in reqs
                if q.params.logprobs is not None or q.params.logit_bias or q.params.penalized]
        if not reqs and not masked:
            return none, False
        x = none
        if masked:              # the step records their drafts' candidates (masked drafts)
            flag = np.zeros(nb, bool)
            flag[masked] = True
            x = dataclasses.replace(x, constrained=jnp.asarray(flag))
        if not reqs:
            return x, False
        want = np.zeros(nb, bool)
        ids = np.zeros((nb, steps.LOGIT_BIAS_MAX), np.int32)
        vals = np.zeros((nb, steps.LOGIT_BIAS_MAX), np.float32)
        plen = np.zeros(nb, np.int32)
        pen = np.zeros((3, nb), np.float32)
        pen[2] = 1.0
        for b, q in reqs:
            p = q.params
            want[b] = p.logprobs is not None
            for j, (i, v) in enumerate(p.logit_bias):
                ids[b, j], vals[b, j] = i, v
            if p.penalized:
                self._write_history(b, q)
                plen[b] = len(q.prompt)
                pen[:, b] = p.presence_penalty, p.frequency_penalty, p.repetition_penalty
        # rows of unpenalised lanes are whatever they hold: the step ignores them; without a
        # penalised lane the cached all -1 rows go (no upload)
        if any(q.params.penalized for _, q in reqs):
            history = jnp.asarray(self._history[:nb])
        else:
            history = none.history
        return (steps.Extras(jnp.asarray(want), jnp.asarray(ids), jnp.asarray(vals), history,
                             jnp.asarray(plen), *map(jnp.asarray, pen), x.constrained,
                             x.forced_accept),
                bool(want.any()))

    def _write_history(self, lane: int, req: Request) -> None:
        """Bring lane slot `lane`'s history row up to req's tokens (prompt + output): only
        the new output when the row already holds an earlier state of the same request
        (outputs only grow), the whole row otherwise (a new request in the slot, or a lane
        moved by compaction)."""
        row = self._history[lane]
        lp = len(req.prompt)
        n = lp + len(req.out)
        held = self._history_of[lane]
        if held is not None and held[0] is req and held[1] <= n:
            start = held[1]             # >= lp: a row is written whole once
        else:
            row[:] = -1
            row[:lp] = req.prompt
            start = lp
        row[start:n] = req.out[start - lp:]
        self._history_of[lane] = (req, n)

    @staticmethod
    def _token_logprobs(sched: Scheduler, lane: int, out, n_acc, lps):
        """The TokenLogprob of each token the lane emitted this step (None: not asked)."""
        n = sched.lanes[lane].req.params.logprobs
        if n is None or lps is None:
            return None
        tok, top_ids, top_lp = lps
        return [TokenLogprob(int(out[lane, j]), float(tok[lane, j]),
                             tuple((int(i), float(v)) for i, v in
                                   zip(top_ids[lane, j, :n], top_lp[lane, j, :n])))
                for j in range(int(n_acc[lane]) + 1)]

    def request_logprobs(self, request_id: int) -> list[TokenLogprob] | None:
        """The TokenLogprobs of a running request's tokens so far (one per emitted token; the
        last ones are those an on_token callback was just given), or None (not asked, or not
        running). For streaming (mtpjax/serving/online.py); call from the session's thread."""
        sched = self._sched
        if sched is None:
            return None
        for ln in sched.lanes:
            if ln is not None and ln.req.id == request_id:
                return ln.req.logprobs
        return None

    def clear_prefix_cache(self) -> None:
        """Drop every cached prefix (pages and snapshots return to the pool)."""
        if self._sched is not None and self._sched.has_work():
            raise RuntimeError("clear_prefix_cache() needs an idle engine")
        if self.prefix is not None:
            self.prefix.clear()

    def reset_timing(self, keys=None) -> None:
        """Zero the step timers and counters (all, or `keys`), e.g. between timed passes;
        resetting all also zeroes the per-depth step counts."""
        for key in (self.timing if keys is None else keys):
            self.timing[key] = 0
        if keys is None:
            self.depth_steps = [0] * (self.k + 1)

    def warmup_plan(self, depths: Sequence[int] | None = None,
                    lanes: int | None = None) -> list[tuple]:
        """The programs `warmup(depths, lanes)` would compile, as keys (see `stats()["programs"]`):
        ("decode", depth, lane bucket) for every depth (default 0..K) and every lane bucket a
        run of up to `lanes` (default max_lanes) busy lanes reaches, the same with a prefill
        chunk riding ("mixed", depth, lane_slots, T) for every ride bucket T (depths up to
        mixed_max_depth), ("prefill", T) for every chunk bucket, ("move_lane",) with more than one lane and ("snapshot_restore",),
        ("snapshot",) with the prefix cache; minus those this engine already ran."""
        depths = list(range(self.k + 1) if depths is None else depths)
        for d in depths:
            if not 0 <= d <= self.k:
                raise ValueError(f"depth {d} outside 0..{self.k}")
        top = self.max_lanes if lanes is None else min(int(lanes), self.max_lanes)
        buckets = sorted({self.lane_bucket([b]) for b in range(top)})
        keys = [("decode", d, nb) for nb in buckets for d in depths]
        keys += [("mixed", d, self.lane_slots, T) for T in self.ride_buckets for d in depths
                 if d <= self.mixed_max_depth]
        keys += [("prefill", T) for T in self.chunk_buckets]
        if self.max_lanes > 1:
            keys.append(("move_lane",))
        if self.prefix is not None:
            keys += [("snapshot_restore",), ("snapshot",)]
        return [key for key in keys if key not in self._programs]

    def shape_key(self, key: tuple = ("decode",)) -> tuple:
        """What the compiled program `key` (a warmup_plan key) depends on besides the key
        itself: two engines with equal shape keys run the same program (JAX compiles it once
        per process), whatever their max_lanes, page budget or policy. Snapshot programs also
        depend on the snapshot slots."""
        snap = key[0].startswith("snapshot") and self.prefix is not None
        return (self.cfg, self.k, self.kernels, str(self.dtype), self.lane_slots,
                self.pool_pages, self.page_size, self.pages_per_lane, self.depth0_fills_mtp_kv,
                self.mesh, self.prefix.num_slots if snap else None,
                None if self.draft_ids is None else len(self.draft_ids))

    def warmup(self, depths: Sequence[int] | None = None, lanes: int | None = None,
               progress: Callable[[tuple, float], None] | None = None) -> int:
        """Compile, before any timed work, every program a run may need (`warmup_plan`): the
        decode program of every depth (default 0..K) for every lane bucket up to `lanes`
        (default max_lanes), the prefill program of every chunk bucket (a preempted request
        re-prefills its prompt and replies, a chunk length the first requests may never have
        used), the lane move and, with the prefix cache, snapshot save and restore. So a
        policy switching depths, or a preemption, never compiles mid-run. progress(key,
        seconds) is called after each program (compiled, loaded from the persistent cache, or
        already compiled by an engine of the same `shape_key`).

        Nothing any request can see is touched: decode programs run with every lane idle
        (no lane state read or written); prefill chunks (alone or riding) run on lane 0 with
        a page table of no pages (every KV write is dropped); what they leave in lane 0's GDN slot is never read, since a lane is always
        prefilled from position 0 (read as zeros) or restored from a snapshot when a request
        is admitted to it. A snapshot is saved only into a free slot (with every slot in use,
        save compiles on demand). Call it between generate calls. Returns how many programs
        it ran."""
        if self._sched is not None:
            raise RuntimeError("warmup() cannot run inside generate()")
        n = 0
        for key in self.warmup_plan(depths, lanes):
            if key == ("snapshot",) and not self.prefix.free_slots:
                continue
            t0 = time.perf_counter()
            self._warm_one(key)
            self._programs.add(key)
            n += 1
            if progress is not None:
                progress(key, time.perf_counter() - t0)
        return n

    def _warm_one(self, key: tuple) -> None:
        """Run the program `key` once on inputs that touch nothing a request sees (warmup)."""
        no_pages = jnp.full((1, self.pages_per_lane), -1, jnp.int32)

        def chunk(T):     # on lane 0, from position 0, no pages: writes nothing a request reads
            zeros = jnp.zeros((1, T), jnp.int32)
            return steps.Chunk(jnp.int32(0), zeros, zeros, jnp.int32(0), jnp.int32(T), no_pages)
        if key[0] in ("decode", "mixed"):
            d, nb = key[1], key[2]
            lanes_s = LaneSampling.from_params([SamplingParams()] * nb)
            no_masks = jnp.full((nb, d + 1, (self.cfg.vocab_size + 31) // 32), -1, jnp.int32)
            self.cache, self.state, out, _, _ = steps.decode_step(
                self.cfg, self.params, self.cache, self.state, lanes_s,
                jnp.zeros(nb, bool), jnp.asarray(self.alloc.table[:nb]), steps.Join.none(nb),
                chunk(key[3]) if key[0] == "mixed" else None, no_masks,
                steps.Extras.none(nb, self.history_len), k=d,
                kernels=self.kernels, mesh=self.mesh, fill_mtp_kv=self.depth0_fills_mtp_kv)
            out.block_until_ready()
        elif key[0] == "prefill":
            self.cache = steps.prefill_chunk(self.cfg, self.params, self.cache, chunk(key[1]),
                                             k=self.k, kernels=self.kernels, mesh=self.mesh)
            jax.block_until_ready(self.cache)
        elif key == ("move_lane",):
            self.cache, self.state = steps.move_lane(self.cache, self.state, jnp.int32(0),
                                                     jnp.int32(0), mesh=self.mesh)
            jax.block_until_ready(self.state)
        elif key == ("snapshot_restore",):
            self.cache, self.snaps = snapshots.restore(self.cache, self.snaps, jnp.int32(0),
                                                       jnp.int32(0), mesh=self.mesh)
            jax.block_until_ready(self.cache)
        elif key == ("snapshot",):
            self.cache, self.snaps = snapshots.save(
                self.cache, self.snaps, jnp.int32(0), jnp.int32(self.prefix.free_slots[-1]),
                mesh=self.mesh)
            jax.block_until_ready(self.snaps)
        else:
            raise ValueError(f"unknown program {key!r}")

    def stats(self) -> dict:
        return {"compiled_programs": len(self._programs),
                "programs": sorted(self._programs),
                "free_pages": self.alloc.available, "total_pages": self.num_pages,
                "cached_pages": self.alloc.held_pages,
                "prefix_cache": None if self.prefix is None else self.prefix.report(),
                "page_size": self.page_size, "pages_per_lane": self.pages_per_lane,
                "pool_pages": self.pool_pages, "lane_slots": self.lane_slots,
                "lane_buckets": list(self.lane_buckets),
                "preemptions": self.preemptions, "max_lanes": self.max_lanes,
                "max_seq_len": self.max_seq_len, "num_speculative_tokens": self.k,
                "policy": type(self.policy).__name__, "depth_steps": list(self.depth_steps),
                "kernels": self.kernels, "tp": self.tp,
                "weights": "fp8" if quant.has_fp8(self.params) else str(self.dtype),
                "mtp_weights": (None if self.params.mtp is None else "fp8"
                                if quant.has_fp8(self.params.mtp) else str(self.dtype)),
                "weight_bytes": int(sum(x.nbytes for x in jax.tree.leaves(self.params))),
                "devices": [str(d) for d in (self.mesh.devices.flat if self.mesh is not None
                                             else [self.params.embed.devices().pop()])],
                **({} if self.clock is None else {"clock": self.clock.report()}),
                **({} if self.simulated is None
                   else {"simulated_acceptance": self.simulated.report()}),
                **self.timing}
