"""The engine core: requests, pages, policies and the host state of every request, no JAX.

It owns what the host decides: the page allocator and the prefix cache (their policy), the
depth policy, request validation, each request's grammar, penalties and stop conditions, and
what happens to the tokens a step emitted. A session is a `scheduler.Scheduler` (the façade
opens and closes it); the core works on the session it is given.

One iteration, as the façade (engine.py) drives it:
  1. `Scheduler.schedule()` plans the step (`scheduler.StepBatch`);
  2. `batch(sched, plan, read_drafts)` turns the plan into the model runner's record
     (`batch.Batch`: host arrays in lane order): the chunks padded to their shape (one, or
     several lanes' packed, `StepShapes.ride`), each lane's
     sampling settings, the grammar masks (from the drafts the device holds, read with
     `read_drafts`; masked drafts are corrected here and travel in the record), logit_bias,
     the penalties' history rows, who wants log probabilities, and the snapshot slots the
     prefix cache took at the chunks' ends (`Scheduler.prefill_done`: unpublished entries);
  3. the runner runs the record and returns a `batch.StepResult`;
  4. `commit(sched, plan, result)`: publish the snapshots, tell the depth policy what the
     step cost, hand each row its tokens (stop conditions, grammar, streaming via the
     session's on_token), in the plan's row order.
The core never sees a device array; the runner never sees a request.
"""

from __future__ import annotations

import time
from typing import Callable

import numpy as np

from mtpjax import simulated_acceptance
from mtpjax.engine.batch import Batch, ChunkInput, ExtrasRows, SamplingRows, StepResult, StepShapes
from mtpjax.engine.depth import AdaptiveDepth
from mtpjax.engine.kv_pool import PageAllocator
from mtpjax.engine.prefix_cache import PrefixCache
from mtpjax.engine.scheduler import (Policy, Request, RequestStats, Scheduler,
                                     SpeculationPolicy, StepBatch, TokenLogprob)
from mtpjax.sampling_params import MAX_LOGIT_BIAS as LOGIT_BIAS_MAX  # = steps.LOGIT_BIAS_MAX
from mtpjax.sampling_params import SamplingParams

ReadDrafts = Callable[[bool], tuple[np.ndarray, np.ndarray | None]]


def _why(part: str, e: Exception) -> str:
    """The error a request ends with when its own host state raised."""
    return f"this request's {part} failed: {type(e).__name__}: {e}"


def make_policy(policy: Policy | str | None) -> Policy:
    """"fixed"/None -> SpeculationPolicy(), "adaptive" -> AdaptiveDepth(), a callable as is."""
    if policy in (None, "fixed"):
        return SpeculationPolicy()
    if policy == "adaptive":
        return AdaptiveDepth()
    if isinstance(policy, str) or not callable(policy):
        raise ValueError(f"speculation_policy must be 'fixed', 'adaptive' or a callable "
                         f"policy, got {policy!r}")
    return policy


class EngineCore:
    """Pages, prefix cache, depth policy and request host state for one engine (no JAX).

    snapshot_slots: the prefix cache's GDN snapshot slots (None: no prefix cache);
    snapshot_bytes: one slot's size (reported). mask_drafts: correct constrained lanes'
    drafts by their grammar before each step (an attribute: may change between steps).
    now: the engine's time in seconds, which the prefix cache's ages are measured in (a
    simulated clock's under one: the live_s protection of an entry lasts that clock's 10
    minutes, as on the device it predicts, whatever the host's speed)."""

    def __init__(self, shapes: StepShapes, *, eos: tuple[int, ...], policy: Policy,
                 snapshot_slots: int | None, snapshot_bytes: int, every_blocks: int,
                 mask_drafts: bool = True, simulate_acceptance=None, grammar_tokenizer=None,
                 now: Callable[[], float] = time.monotonic):
        self.shapes, self.eos, self.policy = shapes, eos, policy
        # timing only: each verify step accepts a seeded draw from a published profile
        self.simulated = simulated_acceptance.simulator(simulate_acceptance)
        self.num_draft_slots = shapes.num_draft_slots
        self.mask_drafts = bool(mask_drafts)
        self.alloc = PageAllocator(shapes.num_pages, shapes.page_size, shapes.lane_slots,
                                   shapes.pages_per_lane, pool_pages=shapes.pool_pages)
        self.pool_pages = self.alloc.sentinel
        self.prefix: PrefixCache | None = None
        if snapshot_slots is not None:
            # The slots are their own fixed allocation (slots x snapshot_bytes, in stats()),
            # so a snapshot is not also charged pool pages: cached KV pages are pool pages
            # that requests take back on demand, and the cache never lowers request capacity.
            self.prefix = PrefixCache(self.alloc, num_slots=snapshot_slots, snapshot_pages=0,
                                      snapshot_bytes=snapshot_bytes, every_blocks=every_blocks,
                                      mtp_kv=self.num_draft_slots > 0, clock=now)
        # penalties: each lane slot's token history (prompt + output, -1 past it) as the
        # steps take it, and whose it is: (the Request object, tokens written)
        self._history = np.full((shapes.lane_slots, shapes.history_len), -1, np.int32)
        self._history_of: list[tuple[object, int] | None] = [None] * shapes.lane_slots
        # structured output: the tokenizer's source (a path or an object), built at first use
        self._grammar_src, self._grammar_tok = grammar_tokenizer, None

    def simulated_report(self) -> dict:
        """stats()' simulated-acceptance entry (empty when off)."""
        return {} if self.simulated is None else {"simulated_acceptance": self.simulated.report()}

    # ---------------------------------------------------------------- sessions, requests
    def session(self, on_token) -> Scheduler:
        """A new session's scheduler over this core's pages, prefix cache and policy."""
        s = self.shapes
        return Scheduler(self.alloc, num_draft_slots=s.num_draft_slots,
                         max_seq_len=s.max_seq_len, prefill_chunk=s.prefill_chunk,
                         policy=self.policy, on_token=on_token, prefix_cache=self.prefix,
                         lanes=s.max_lanes, bucket=s.lane_bucket,
                         mixed_depth=s.mixed_max_depth, mixed_bucket=s.lane_slots,
                         ride=lambda lens: s.ride(lens, True), prefill_rows=s.prefill_rows)

    def validate(self, prompt: list[int], params, sched: Scheduler) -> str | None:
        """Why the request cannot run (it then ends "error" without touching the device)."""
        s = self.shapes
        if not isinstance(params, SamplingParams):
            return f"sampling params must be a SamplingParams, got {type(params).__name__}"
        try:
            params.validate(s.vocab_size)
        except ValueError as e:
            return f"invalid sampling parameters: {e}"
        if len(prompt) == 0:
            return "empty prompt"
        bad = [t for t in prompt if not (0 <= t < s.vocab_size)]
        if bad:
            return f"token id {bad[0]} outside the vocabulary [0, {s.vocab_size})"
        if len(prompt) >= s.max_seq_len:
            return (f"prompt too long: {len(prompt)} tokens, the context limit is "
                    f"{s.max_seq_len}")
        need = sched.pages_worst_case(len(prompt), params.max_new_tokens)
        if need > s.num_pages:
            return (f"request cannot fit the KV pool: a prompt of {len(prompt)} tokens with "
                    f"max_new_tokens={params.max_new_tokens} and {self.num_draft_slots} draft "
                    f"slots needs up to {need} pages of {s.page_size} tokens, the pool has "
                    f"{s.num_pages}")
        return None

    @property
    def grammar_tokenizer(self):
        """The llguidance tokenizer constrained requests use (built at first use), or None."""
        if self._grammar_tok is None and self._grammar_src is not None:
            from mtpjax import grammar     # JAX: imported when a grammar is first used
            self._grammar_tok = grammar.make_tokenizer(self._grammar_src,
                                                       self.shapes.vocab_size, self.eos)
        return self._grammar_tok

    def constraint(self, spec: str):
        """A request's grammar state (grammar.Constraint); ValueError when the engine has no
        grammar tokenizer or the grammar is invalid."""
        tok = self.grammar_tokenizer
        if tok is None:
            raise ValueError("this request has a grammar but the engine has no grammar "
                             "tokenizer (Engine(grammar_tokenizer=...), or from_checkpoint on a "
                             "folder with a tokenizer.json)")
        from mtpjax import grammar
        return grammar.Constraint(tok, spec, self.shapes.vocab_size)

    def request(self, request_id: int, prompt: list[int], params: SamplingParams,
                constraint=None) -> Request:
        stops = frozenset(params.stop_token_ids) | frozenset(self.eos)
        return Request(request_id, prompt, params, stops,
                       stats=RequestStats.for_depth(self.num_draft_slots),
                       constraint=constraint)

    def reset(self) -> None:
        """Every page free and an empty prefix cache (its hit counters kept): the host side
        of a rebuilt device state."""
        s = self.shapes
        self.alloc = PageAllocator(s.num_pages, s.page_size, s.lane_slots, s.pages_per_lane,
                                   pool_pages=self.pool_pages)
        if self.prefix is not None:
            old = self.prefix
            self.prefix = PrefixCache(self.alloc, num_slots=old.num_slots,
                                      snapshot_pages=old.snapshot_pages,
                                      snapshot_bytes=old.snapshot_bytes,
                                      every_blocks=old.every_blocks,
                                      mtp_kv=old.mtp_kv,
                                      live_s=old.live_s, clock=old.clock)
            self.prefix.stats = old.stats

    # ---------------------------------------------------------------- plan -> record
    def batch(self, sched: Scheduler, plan: StepBatch, read_drafts: ReadDrafts) -> Batch:
        """The runner's record of `plan` (module docstring, step 2)."""
        s, works = self.shapes, plan.prefills
        chunk = self._chunks(works, bool(plan.rows))
        slots = self._snapshot_slots(sched, works)
        if not plan.rows:
            return Batch(0, 0, plan.moves, plan.restores, chunk, slots)
        # a step carrying a chunk runs every lane slot: one program per depth, not per depth
        # and lane bucket (the idle slots are padding rows beside the chunk's tokens). The
        # view names the program (Scheduler._cell), so the depth policy's cell is this step's
        nb = plan.view.bucket
        assert nb >= max(plan.decode) + 1 and (chunk is None or nb == s.lane_slots), plan.view
        active = np.zeros(nb, bool)
        join_mask = np.zeros(nb, bool)
        join_tok = np.zeros(nb, np.int32)
        join_pos = np.zeros(nb, np.int32)
        for r in plan.rows:
            active[r.lane] = True
            if r.join_token is not None:
                join_mask[r.lane], join_tok[r.lane], join_pos[r.lane] = True, r.join_token, r.pos
        table = self.alloc.table[:nb].copy()
        failed: dict[int, str] = {}          # lane -> why its request's host state raised
        masks, drafts = self._masks(sched, plan, nb, read_drafts, failed)
        extras, constrained = self._extras(sched, plan, nb, failed)
        for r in plan.rows:
            if r.lane in failed:             # it ends "error" now; the step runs without it
                sched.fail(r.lane, r.request_id, failed[r.lane])
                active[r.lane] = join_mask[r.lane] = False
                if masks is not None:
                    masks[r.lane] = -1
                if constrained is not None:
                    constrained[r.lane] = False
                if extras is not None:
                    extras.want_logprobs[r.lane] = False
        forced = None
        if self.simulated is not None:       # the lanes' real drafts: an empty slot never lands
            lanes = [r.lane for r in plan.rows]
            real = ([ln.drafts for ln in plan.view.lanes] if plan.view is not None
                    else [plan.depth] * len(lanes))
            forced = self.simulated.forced(plan.depth, lanes, real, nb)
        wants = getattr(self.policy, "wants_timing", None)
        timed = bool(wants is not None and plan.view is not None
                     and wants(plan.view, plan.depth))
        return Batch(plan.depth, nb, plan.moves, plan.restores, chunk, slots, active, join_mask,
                     join_tok, join_pos, table, self._sampling(sched, nb), masks, drafts,
                     extras, constrained, tuple(r.pos for r in plan.rows), forced, timed)

    def _chunks(self, works, rides: bool) -> ChunkInput | None:
        """The plan's chunks padded to the program's shape (StepShapes.ride): one row each,
        in the plan's order, then padding rows (no pages, no tokens)."""
        if not works:
            return None
        s = self.shapes
        rows, T = s.ride([len(w.tokens) for w in works], rides)
        toks = np.zeros((rows, T), np.int32)
        nt = np.zeros((rows, T), np.int32)
        table = np.full((rows, s.pages_per_lane), -1, np.int32)
        lanes = self.alloc.table              # checked on every read: read once
        for r, w in enumerate(works):
            toks[r, :len(w.tokens)] = w.tokens
            nt[r, :len(w.next_tokens)] = w.next_tokens
            table[r] = lanes[w.lane]
        return ChunkInput(tuple(w.lane for w in works), tuple(w.start for w in works),
                          tuple(len(w.tokens) for w in works), toks, nt, table, T)

    @staticmethod
    def _snapshot_slots(sched: Scheduler, works) -> tuple[tuple[int, int], ...]:
        """Record the chunks (Scheduler.prefill_done: host state only, before any row can
        end in this step) and return (lane, slot) for each chunk whose end is saved into a
        snapshot slot. The entries stay unpublished until `commit`."""
        out = []
        for w in works:
            slot = sched.prefill_done(w)
            if slot is not None:
                out.append((w.lane, slot))
        return tuple(out)

    def _sampling(self, sched: Scheduler, nb: int) -> SamplingRows:
        """Sampling settings of the first nb lane slots; idle slots get defaults."""
        lanes = sched.lanes + [None] * (self.shapes.lane_slots - len(sched.lanes))
        ps = [ln.req.params if ln is not None else SamplingParams() for ln in lanes[:nb]]
        return SamplingRows(np.array([p.temperature for p in ps], np.float32),
                            np.array([p.top_k for p in ps], np.int32),
                            np.array([p.top_p for p in ps], np.float32),
                            np.array([p.seed for p in ps], np.uint32))

    def _masks(self, sched: Scheduler, plan: StepBatch, nb: int, read_drafts: ReadDrafts,
               failed: dict[int, str]):
        """The step's grammar masks, i32[nb, depth+1, words] (mtpjax/grammar.py), and the
        drafts to write back (None: unchanged). Per constrained row: the grammar state after
        its emitted tokens and each prefix of the drafts the device holds (read back here:
        the drafts the step verifies; -1, all allowed, for every other lane). None, None
        without a constrained row.

        Masked drafts (mask_drafts): the drafts are read back with their candidates
        (LaneState.candidates, recorded by the previous step because this lane was
        constrained there too), each constrained row's drafts are corrected by its grammar
        (Constraint.masked_drafts: a forbidden draft becomes the first allowed candidate)
        and, when any changed, the record carries every slot's drafts for the runner to
        write before the step; the masks follow the corrected drafts. Why here and not in
        the step: the grammar is on the host, and the step's drafts follow its own
        acceptance, which the host learns only after it. A row whose grammar walk raises
        goes into `failed` (lane -> message) with all-allowed masks and its drafts as they
        were: its request ends "error", the other rows are unchanged."""
        depth = plan.depth
        rows = [(r, sched.lanes[r.lane].req) for r in plan.rows]
        rows = [(r, req) for r, req in rows if req.constraint is not None]
        if not rows:
            return None, None
        masks = np.full((nb, depth + 1, self.shapes.mask_words), -1, np.int32)
        if not depth:
            for r, req in rows:
                try:
                    masks[r.lane] = req.constraint.step_masks([], req.stops)
                except Exception as e:  # noqa: BLE001 - this request's grammar only
                    failed[r.lane] = _why("grammar", e)
            return masks, None
        # the drafts the step verifies: the device's, after this step's lane moves (a
        # joining lane's are reset to 0)
        drafts, cands = read_drafts(self.mask_drafts)
        for src, dst in plan.moves:
            drafts[dst] = drafts[src]
            if cands is not None:
                cands[dst] = cands[src]
        changed = False
        for r, req in rows:
            try:
                if r.join_token is not None:
                    masks[r.lane] = req.constraint.step_masks([0] * depth, req.stops)
                elif cands is None:
                    masks[r.lane] = req.constraint.step_masks(drafts[r.lane, :depth],
                                                              req.stops)
                else:
                    fixed, row = req.constraint.masked_drafts(
                        drafts[r.lane, :depth], cands[r.lane, :depth], req.stops)
                    masks[r.lane] = row
                    if fixed != drafts[r.lane, :depth].tolist():
                        drafts[r.lane, :depth] = fixed
                        changed = True
            except Exception as e:  # noqa: BLE001 - this request's grammar only
                masks[r.lane] = -1
                failed[r.lane] = _why("grammar", e)
        return masks, drafts if changed else None

    def _extras(self, sched: Scheduler, plan: StepBatch, nb: int, failed: dict[int, str]):
        """The step's logit_bias, penalties and log-probability requests (ExtrasRows, None
        when no row asks) and which lanes' drafts are masked (None: none). A lane whose
        penalties' history raises goes into `failed` (lane -> message)."""
        reqs = [(r.lane, sched.lanes[r.lane].req) for r in plan.rows]
        masked = [b for b, q in reqs if q.constraint is not None] if (
            self.mask_drafts and self.num_draft_slots) else []
        constrained = None
        if masked:              # the step records their drafts' candidates (masked drafts)
            constrained = np.zeros(nb, bool)
            constrained[masked] = True
        reqs = [(b, q) for b, q in reqs
                if q.params.logprobs is not None or q.params.logit_bias or q.params.penalized]
        if not reqs:
            return None, constrained
        want = np.zeros(nb, bool)
        ids = np.zeros((nb, LOGIT_BIAS_MAX), np.int32)
        vals = np.zeros((nb, LOGIT_BIAS_MAX), np.float32)
        plen = np.zeros(nb, np.int32)
        pen = np.zeros((3, nb), np.float32)
        pen[2] = 1.0
        for b, q in reqs:
            p = q.params
            want[b] = p.logprobs is not None
            for j, (i, v) in enumerate(p.logit_bias):
                ids[b, j], vals[b, j] = i, v
            if p.penalized:
                try:
                    self._write_history(b, q)
                except Exception as e:  # noqa: BLE001 - this request's penalties only
                    self._history_of[b] = None
                    failed[b] = _why("penalties", e)
                    continue
                plen[b] = len(q.prompt)
                pen[:, b] = p.presence_penalty, p.frequency_penalty, p.repetition_penalty
        # rows of unpenalised lanes are whatever they hold: the step ignores them; without a
        # penalised lane the runner's cached all -1 rows go (no upload)
        history = (self._history[:nb].copy() if any(q.params.penalized for _, q in reqs)
                   else None)
        return ExtrasRows(want, ids, vals, history, plen, pen[0], pen[1], pen[2]), constrained

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

    # ---------------------------------------------------------------- result -> requests
    def commit(self, sched: Scheduler, plan: StepBatch, batch: Batch,
               result: StepResult) -> list[int]:
        """Apply a step's result (module docstring, step 4); returns the ids of the requests
        that got their first token in it."""
        for _, slot in batch.snapshots:       # the device holds them now: publish the entries
            sched.snapshot_saved(slot)
        if not plan.rows:
            return []
        out, n_acc = result.tokens, result.accepted
        observe = getattr(self.policy, "observe", None)
        if observe is not None and plan.view is not None:
            # a first call compiles: its wall time is no step cost (modelled time is), nor is
            # an overlapped step's that was not timed alone (result.compiled says either).
            # The view names the program that ran (Scheduler._cell: the cell its depth was
            # chosen in), and result.seconds is that program's time alone (the runner times
            # moves, restores and snapshot saves apart)
            observe(plan.view, plan.depth, result.seconds,
                    [int(n_acc[r.lane]) for r in plan.rows], result.compiled)
        first = []
        for r in plan.rows:
            # the request's lane now: in the overlapped loop the next step was planned
            # before this one's tokens came back, and its compaction may have moved lanes.
            # None: it ended (an error before the step, a stop or a cancel committed since,
            # a preemption): what its lane produced here is never emitted
            lane = sched.lane_of(r.request_id)
            if lane is None:
                continue
            if r.join_token is not None:
                first.append(r.request_id)
            try:
                sched.decode_done(lane, [int(t) for t in out[r.lane]], int(n_acc[r.lane]),
                                  plan.depth, self._token_logprobs(sched, lane, r.lane, result),
                                  drafts=r.drafts)
            except Exception as e:  # noqa: BLE001 - this request's output processing only
                sched.fail(lane, r.request_id, _why("output processing", e))
        return first

    @staticmethod
    def _token_logprobs(sched: Scheduler, lane: int, row: int, result: StepResult):
        """The TokenLogprob of each token the request in `lane` emitted this step, from the
        result's `row` (its lane when the step ran); None: not asked."""
        n = sched.lanes[lane].req.params.logprobs
        if n is None or result.logprobs is None:
            return None
        out, n_acc = result.tokens, result.accepted
        tok, top_ids, top_lp = result.logprobs
        return [TokenLogprob(int(out[row, j]), float(tok[row, j]),
                             tuple((int(i), float(v)) for i, v in
                                   zip(top_ids[row, j, :n], top_lp[row, j, :n])))
                for j in range(int(n_acc[row]) + 1)]
