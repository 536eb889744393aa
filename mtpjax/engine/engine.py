"""The public engine: a façade over the engine core (host) and the model runner (device).

  Engine.submit ─> EngineCore.validate / request ─> Scheduler (the open session)
  Engine.step:  Scheduler.schedule() ─> StepBatch (plan N+1, past the steps in flight)
                EngineCore.batch(plan, runner.read_drafts) ─> Batch (host arrays)
                ModelRunner.launch(batch) ─> InFlight (the device runs N+1 behind N)
                ModelRunner.collect(step N) ─> StepResult (host arrays)
                EngineCore.commit(plan N, batch, result) ─> tokens to requests, on_token
  (overlap=False: launch and collect the same step, the serial loop)

The façade owns what joins the two: the session, the grammar tokenizer (built lazily), the
host-time bookkeeping of each iteration, the public attributes. Arguments and a step's data
flow: the package docstring (mtpjax/engine/__init__.py).
"""

from __future__ import annotations

import os
import time
from typing import Callable, Sequence

from mtpjax.config import Config
from mtpjax.engine import snapshots
from mtpjax.engine.batch import StepResult, StepShapes
from mtpjax.engine.core import EngineCore, make_policy
from mtpjax.engine.runner import ModelRunner, load_replicas
from mtpjax.engine.scheduler import (FINISH_ERROR, Policy, RequestOutput, RequestStats,
                                     Scheduler, TokenLogprob)
from mtpjax.params import Params
from mtpjax.sampling_params import SamplingParams


def _forward(owner: str, name: str, settable: bool = False, doc: str | None = None):
    """A façade attribute that is `self.<owner>.<name>`."""
    def get(self):
        return getattr(getattr(self, owner), name)

    def put(self, value):
        setattr(getattr(self, owner), name, value)
    return property(get, put if settable else None, doc=doc)


def _forwards(owner: str, names: str, settable: bool = False) -> tuple:
    return tuple(_forward(owner, name, settable) for name in names.split())


class Engine:
    """Continuous batching and a paged KV pool, with MTP speculation (arguments: package doc)."""

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
                 ride_buckets: Sequence[int] | None = None, prefill_rows: int | None = None,
                 draft_vocab=None, grammar_tokenizer=None, mask_drafts: bool = True,
                 simulate_acceptance=None, overlap: bool = True):
        k = int(num_speculative_tokens)        # K: the draft slots of every lane
        if k < 0:
            raise ValueError(f"num_speculative_tokens must be >= 0, got {k}")
        if k > 0 and not cfg.has_mtp:
            raise ValueError("num_speculative_tokens > 0 needs a checkpoint with an MTP head")
        self.shapes = shapes = StepShapes.build(
            num_draft_slots=k, max_lanes=max_lanes, lane_slots=lane_slots,
            lane_buckets=lane_buckets, prefill_chunk=prefill_chunk,
            prefill_buckets=prefill_buckets, ride_buckets=ride_buckets,
            prefill_rows=prefill_rows, mixed_max_depth=mixed_max_depth, max_seq_len=max_seq_len,
            max_position=cfg.max_position_embeddings, page_size=page_size,
            num_pages=num_pages, pool_pages=pool_pages, vocab_size=cfg.vocab_size)
        if snapshot_every_blocks < 1:
            raise ValueError(f"snapshot_every_blocks must be >= 1, got {snapshot_every_blocks}")
        slots = None
        if prefix_cache:
            slots = (min(max(2 * shapes.lane_slots, 4), 32) if prefix_snapshots is None
                     else int(prefix_snapshots))
            if slots < 1:
                raise ValueError(f"prefix_snapshots must be >= 1, got {slots}")
        policy = make_policy(speculation_policy)
        dtype = params.embed.dtype
        self.core = EngineCore(
            shapes, eos=tuple(cfg.eos_token_ids if eos_token_ids is None else eos_token_ids),
            policy=policy, snapshot_slots=slots,
            snapshot_bytes=0 if slots is None else snapshots.snapshot_bytes(cfg, dtype),
            every_blocks=int(snapshot_every_blocks), mask_drafts=mask_drafts,
            simulate_acceptance=simulate_acceptance, grammar_tokenizer=grammar_tokenizer,
            now=lambda: time.monotonic() if self.clock is None else self.clock.now)
        self.runner = ModelRunner(cfg, params, shapes, pool_pages=self.core.pool_pages,
                                  kernels=kernels, tp=tp, devices=devices, mesh=mesh,
                                  draft_vocab=draft_vocab, snapshot_slots=slots,
                                  depth0_fills_mtp_kv=depth0_fills_mtp_kv)
        self.every_blocks = int(snapshot_every_blocks)
        self.preemptions = 0
        self._sched: Scheduler | None = None
        self.clock = clock
        self.overlap = bool(overlap)      # plan step N+1 while the device runs step N
        self._flight = None               # overlapped: (plan, batch, launch) not read yet

    # the runner's: placement, device state, programs, timing
    (cfg, params, mesh, tp, kernels, dtype, draft_ids, depth0_fills_mtp_kv, timing,
     depth_steps) = _forwards("runner", "cfg params mesh tp kernels dtype draft_ids "
                              "depth0_fills_mtp_kv timing depth_steps")
    cache, state, snaps = _forwards("runner", "cache state snaps", settable=True)
    clock = _forward("runner", "clock", True, "The VirtualClock this engine advances (None: "
                     "wall time); see the package docstring.")
    # the core's: pages, prefix cache, policies
    alloc, prefix, policy, eos, pool_pages = _forwards("core", "alloc prefix policy eos pool_pages")
    mask_drafts, simulated = _forwards("core", "mask_drafts simulated", settable=True)
    grammar_tokenizer = _forward("core", "grammar_tokenizer", doc="The llguidance tokenizer "
                                 "constrained requests use (built at first use), or None.")
    # the shapes; K is num_draft_slots (callers' `k`), a step's depth is 0..K
    (num_draft_slots, max_lanes, lane_slots, lane_buckets, max_seq_len, prefill_chunk,
     prefill_rows, mixed_max_depth, page_size, num_pages, pages_per_lane, history_len) = _forwards(
        "shapes", "num_draft_slots max_lanes lane_slots lane_buckets max_seq_len prefill_chunk "
        "prefill_rows mixed_max_depth page_size num_pages pages_per_lane history_len")
    k = _forward("shapes", "num_draft_slots", doc="K (num_speculative_tokens), as callers name it")
    chunk_buckets = property(lambda self: list(self.shapes.chunk_buckets))
    ride_buckets = property(lambda self: list(self.shapes.ride_buckets))

    @classmethod
    def from_checkpoint(cls, path: str, dtype: str = "float32", num_speculative_tokens: int = 0,
                        tp: int = 1, dp: int = 1, devices: Sequence | None = None,
                        weights: str = "auto", mtp_weights: str = "auto", **kw):
        """Load a checkpoint onto tp devices; kw (kernels, page_size, max_lanes, ...) go to the
        Engine (dp > 1: `mtpjax.from_checkpoint`). weights: "auto" (as stored), "fp8" (the
        linears quantized block-wise at load, mtpjax/quant.py) or "dense"; mtp_weights: the
        MTP head's ("auto": as stored, dense when weights="fp8"). draft_vocab (in kw): "auto"
        (default_size when the checkpoint ships one), None or 0 (all), N, a share, a path, ids."""
        if dp != 1:
            raise ValueError(f"dp={dp}: replicas are a DataParallelEngine, built by "
                             "mtpjax.from_checkpoint (same arguments)")
        return cls.replicas_from_checkpoint(path, dtype, num_speculative_tokens, tp, 1, devices,
                                            weights, mtp_weights, **kw)[0]

    @classmethod
    def replicas_from_checkpoint(cls, path: str, dtype: str = "float32",
                                 num_speculative_tokens: int = 0, tp: int = 1, dp: int = 1,
                                 devices: Sequence | None = None, weights: str = "auto",
                                 mtp_weights: str = "auto", **kw) -> list:
        """dp engines of the checkpoint, each on its own tp devices (from_checkpoint)."""
        if "grammar_tokenizer" not in kw and os.path.isfile(os.path.join(path, "tokenizer.json")):
            kw["grammar_tokenizer"] = os.path.join(path, "tokenizer.json")   # built lazily
        cfg, placed, kw = load_replicas(path, dtype, num_speculative_tokens, tp, dp, devices,
                                        weights, mtp_weights, kw)
        return [cls(cfg, p, num_speculative_tokens=num_speculative_tokens, mesh=m, **kw)
                for p, m in placed]

    # ---------------------------------------------------------------- main entry
    def generate(self, prompts: Sequence[Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] = SamplingParams(),
                 on_token: Callable[[int, list[int]], None] | None = None) -> list[RequestOutput]:
        """Generate for every prompt (lists of token ids); one output per prompt, in order.

        params: one SamplingParams for all, or one per prompt. on_token(i, new_ids) streams
        each request's tokens as they are committed (i = index into prompts). To cancel
        request i, call `engine.cancel(i)` (from on_token or another thread): it ends with
        finish_reason "cancelled" and the tokens streamed so far."""
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
        scheduler iteration over everything submitted so far, `stop` ends the session.
        on_token(request_id, new_ids) streams tokens. submit/step/stop must be called from
        one thread; `cancel` may come from any."""
        if self._sched is not None:
            raise RuntimeError("a session is already running on this engine (generate() or "
                               "start() without stop())")
        self._sched = self.core.session(self._callback(on_token))

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
                self.runner.exclude(time.perf_counter() - t0)
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
        err = self.core.validate(prompt, params, sched)
        constraint = None
        if not err and params.grammar is not None:
            try:
                constraint = self.core.constraint(params.grammar)
            except (ValueError, TypeError, OSError) as e:
                err = str(e)
        if err:
            sched.refused(request_id)
            return RequestOutput(prompt, [], FINISH_ERROR, err, RequestStats())
        sched.add(self.core.request(request_id, prompt, params, constraint))
        self.runner.submitted(request_id)
        return None

    def has_work(self) -> bool:
        """Whether the session has requests queued or running, or a step in flight."""
        return self._sched is not None and (self._sched.has_work() or self._flight is not None)

    def step(self) -> dict[int, RequestOutput]:
        """One scheduler iteration of the session (package docstring); returns the requests
        that ended in it (finished, stopped, cancelled), by id. Overlapped (the default): it
        plans and launches step N+1, then reads step N's tokens while the device runs N+1."""
        sched = self._session()
        if sched.has_work() or self._flight is not None:
            try:          # first tokens are read before the next launch where that is sooner
                if self._flight is not None and self.runner.read_before_next(self._flight[1]):
                    done, self._flight = self._flight, None
                    self._commit(sched, *done)
            except BaseException:
                self.stop()
                raise
            t0 = self.runner.open_host()      # (after the wait above: not host work)
            plan = sched.schedule() if sched.has_work() else None   # raises: session stays
            self.runner.wall_host(time.perf_counter() - t0)
            try:
                now = None
                if plan is not None:
                    batch = self.core.batch(sched, plan, self.runner.read_drafts)
                    now = (plan, batch, self.runner.launch(batch, serial=not self.overlap))
                if now is not None and now[2] is None:      # nothing launched: commit now
                    self._commit(sched, *now)
                    now = None
                done, self._flight = ((self._flight, now) if self.overlap else (now, None))
                if done is not None:
                    self._commit(sched, *done)
            except BaseException:
                self.stop()
                raise
            self.runner.close_host()
        done, sched.finished = sched.finished, {}
        self.runner.forget(done)
        return done

    def _commit(self, sched: Scheduler, plan, batch, flight) -> None:
        """Read a launch's outputs (None: it launched nothing) and apply them to requests."""
        result = self.runner.collect(flight) if flight is not None else StepResult()
        t1 = time.perf_counter()
        first = self.core.commit(sched, plan, batch, result)
        self.runner.wall_host(time.perf_counter() - t1)
        self.runner.first_tokens(first)
        self.runner.probe()

    def stop(self) -> dict[int, RequestOutput]:
        """End the session: requests still queued or running end "cancelled" (with the
        tokens they have) and every lane's pages return to the pool. `waiting_at_stop` then
        names the queued ones that had no token yet and were not cancelled: resubmitted to a
        new session, each gets the output it would have had (after a failed step, they are
        the requests the failure did not touch)."""
        sched = self._sched
        if sched is None:
            return {}
        self._flight = self.runner.drop_launches()   # a step in flight: its tokens dropped
        self.waiting_at_stop = tuple(r.id for r in sched.queue
                                     if not r.out and r.id not in sched.cancelled)
        sched.abort()
        self.preemptions += sched.preemptions
        self._sched = None
        self.runner.forget()
        return sched.finished

    def session_counts(self) -> dict:
        """The open session's requests running (in a lane) and waiting (queued), and its
        preemptions so far; zeros without a session."""
        sched = self._sched
        if sched is None:
            return {"running": 0, "waiting": 0, "preemptions": 0}
        return {"running": sum(ln is not None for ln in sched.lanes),
                "waiting": len(sched.queue), "preemptions": sched.preemptions}

    def cancel(self, request_id: int) -> None:
        """Cancel a request of the running session (it ends "cancelled"). Thread-safe: the
        session is read once (after a stop() it is a no-op)."""
        sched = self._sched
        if sched is not None:
            sched.cancel(request_id)

    # ---------------------------------------------------------------- recovery
    waiting_at_stop: tuple[int, ...] = ()     # set by stop()

    def reset_device_state(self) -> None:
        """Re-create the device state as the constructor built it (KV pool and GDN slots,
        lane state, snapshot store) and the host state that describes it (every page free; an
        empty prefix cache, its counters kept). Why: the step programs donate the cache and
        lane state, so a step that fails inside its program leaves them deleted or half
        written. Compiled programs stay valid. Needs no session open (stop() first)."""
        if self._sched is not None:
            raise RuntimeError("reset_device_state() needs no open session: stop() it first")
        self.runner.reset()
        self.core.reset()

    # ---------------------------------------------------------------- the rest of the API
    def lane_bucket(self, busy_lanes) -> int:
        """Lane slots a decode step over `busy_lanes` runs (the smallest bucket covering)."""
        return self.shapes.lane_bucket(max(busy_lanes) + 1)

    def request_logprobs(self, request_id: int) -> list[TokenLogprob] | None:
        """The TokenLogprobs of a running request's tokens so far, or None (not asked, or not
        running). For streaming (mtpjax/serving/online.py); call from the session's thread."""
        lanes = () if self._sched is None else self._sched.lanes
        return next((ln.req.logprobs for ln in lanes
                     if ln is not None and ln.req.id == request_id), None)

    def clear_prefix_cache(self) -> None:
        """Drop every cached prefix (pages and snapshots return to the pool)."""
        if self._sched is not None and self._sched.has_work():
            raise RuntimeError("clear_prefix_cache() needs an idle engine")
        if self.prefix is not None:
            self.prefix.clear()

    def reset_timing(self, keys=None) -> None:
        """Zero the step timers and counters (all, or `keys`); all also zeroes depth_steps."""
        self.runner.reset_timing(keys)

    def warmup_plan(self, depths: Sequence[int] | None = None,
                    lanes: int | None = None) -> list[tuple]:
        """The programs `warmup(depths, lanes)` would compile, as keys (`stats()["programs"]`;
        which ones: ModelRunner.warmup_plan)."""
        return self.runner.warmup_plan(depths, lanes)

    def shape_key(self, key: tuple = ("decode",)) -> tuple:
        """What the compiled program `key` (a warmup_plan key) depends on besides the key
        itself: two engines with equal shape keys run the same program (JAX compiles it once
        per process), whatever their max_lanes, page budget or policy."""
        return self.runner.shape_key(key)

    def warmup(self, depths: Sequence[int] | None = None, lanes: int | None = None,
               progress: Callable[[tuple, float], None] | None = None) -> int:
        """Compile, before any timed work, every program of `warmup_plan(depths, lanes)`, so
        a policy switching depths, or a preemption, never compiles mid-run. progress(key,
        seconds) is called after each. Nothing a request can see is touched (decode programs
        run with every lane idle, chunks on lane 0 with no pages, a snapshot is saved only
        into a free slot). Call it between generate calls. Returns how many programs ran."""
        if self._sched is not None:
            raise RuntimeError("warmup() cannot run inside generate()")
        free = None if self.prefix is None or not self.prefix.free_slots else \
            self.prefix.free_slots[-1]
        return self.runner.warmup(self.warmup_plan(depths, lanes), self.alloc.table, free,
                                  progress)

    def stats(self) -> dict:
        run = self.runner.stats()
        return {"compiled_programs": run.pop("compiled_programs"),
                "programs": run.pop("programs"),
                "free_pages": self.alloc.available, "total_pages": self.num_pages,
                "cached_pages": self.alloc.held_pages,
                "prefix_cache": None if self.prefix is None else self.prefix.report(),
                "page_size": self.page_size, "pages_per_lane": self.pages_per_lane,
                "pool_pages": self.pool_pages, "lane_slots": self.lane_slots,
                "lane_buckets": list(self.lane_buckets),
                "preemptions": self.preemptions, "max_lanes": self.max_lanes,
                "max_seq_len": self.max_seq_len, "num_speculative_tokens": self.k,
                "policy": type(self.policy).__name__, "depth_steps": list(self.depth_steps),
                **run, **({} if self.clock is None else {"clock": self.clock.report()}),
                **self.core.simulated_report(),
                **self.timing}
