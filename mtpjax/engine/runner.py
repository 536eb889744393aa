"""The model runner: the only owner of the device state and the compiled step programs.

It holds the placed parameters (tensor-parallel mesh, FP8 implementation, draft head), the
device state (`model.Cache`: a `PagedKV` pool per full-attention layer and for the MTP
layer plus per-lane GDN slots; `steps.LaneState`; the prefix cache's snapshot slots), the
set of programs run so far, and the timing of every program it launches.

`launch(batch)` takes one `batch.Batch` (host arrays, in lane order) and runs, in order:
  1. its lane moves (compaction) and snapshot restores (prefix hits);
  2. the corrected drafts, when the record carries them (masked drafts);
  3. ONE program: the decode step at the record's depth over its lane bucket, with the
     prefill chunk riding in it when there is one (key ("mixed", depth, lane_slots, T);
     several lanes' chunks packed: ("mixed", depth, lane_slots, T, rows)), or the chunks
     alone (("prefill", T), ("prefill", T, rows));
  4. the snapshot saves of the chunks' lanes the record names;
without waiting for them (an `InFlight`); `collect(flight)` waits and returns a
`batch.StepResult` of host arrays (tokens, accepted counts, log probabilities when a lane
asked). A step's seconds, which the depth policy learns from, are its own program's, not the
moves' before it or the previous launch's still running. It reads nothing else: no
scheduler, no request, no engine core.

Warm-up (`warmup_plan`, `warmup`) compiles every program a run can reach; `shape_key` says
which engines share them. Timing: without a clock, `timing` holds wall seconds; with one
(`clock=`, a cost_model.VirtualClock) every launched program runs to completion and the
clock advances by its modelled price, while the host time between programs (`_mark`: where
the open host segment began) goes to `clock.add_host` and `timing["host_s"]`.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from mtpjax import draft_vocab as draft_vocab_lib
from mtpjax import quant, steps, tensor_parallel
from mtpjax.config import Config
from mtpjax.engine import snapshots
from mtpjax.engine.batch import Batch, ChunkInput, StepResult, StepShapes
from mtpjax.gdn import check_kernels
from mtpjax.params import Params
from mtpjax.sampling import LaneSampling, SamplingParams


def default_kernels() -> str:
    return "pallas" if jax.default_backend() == "gpu" else "reference"


def _check_placed(cfg: Config, params: Params, mesh) -> None:
    """Params handed in with a mesh must already be laid out on it (tensor_parallel)."""
    want = tensor_parallel.sharded_abstract_params(cfg, mesh, params.embed.dtype)
    for got, exp in zip(jax.tree.leaves(params), jax.tree.leaves(want)):
        if got.shape != exp.shape or not got.sharding.is_equivalent_to(exp.sharding, got.ndim):
            raise ValueError(f"params given with mesh= are not laid out on it (a leaf has shape "
                             f"{got.shape}, sharding {got.sharding}; expected {exp.shape}, "
                             f"{exp.sharding}): pass tp= instead, or place them with "
                             "tensor_parallel.place_params")


def load_replicas(path: str, dtype: str, num_draft_slots: int, tp: int, dp: int,
                  devices: Sequence | None, weights: str, mtp_weights: str, kw: dict):
    """Read a checkpoint onto tp x dp devices: (cfg, [(params, mesh or None)] per replica,
    kw with the draft vocabulary resolved against the checkpoint's list). Each tensor is
    read once and sent straight to its shards (Engine.from_checkpoint)."""
    from mtpjax.api import load_checkpoint
    kw = dict(kw)
    spec = kw.pop("draft_vocab", "auto")
    if not num_draft_slots and spec not in (None, 0, "auto"):
        raise ValueError("draft_vocab needs num_speculative_tokens > 0 (a stock engine "
                         "drafts nothing)")
    if spec == "auto" and not os.path.isfile(os.path.join(path, draft_vocab_lib.FILE)):
        spec = None                   # no list shipped: the whole vocabulary
    if num_draft_slots and spec is not None:   # resolved against the list
        kw["draft_vocab"] = draft_vocab_lib.resolve(
            spec, Config.from_pretrained(path).vocab_size, path)
    meshes = tensor_parallel.make_meshes(tp, dp, devices)
    if meshes == [None]:
        cfg, params = load_checkpoint(path, dtype, None, weights, mtp_weights)
        return cfg, [(params, None)], kw
    tensor_parallel.check_tp(Config.from_pretrained(path), tp)     # before reading weights
    cfg, trees = load_checkpoint(path, dtype, meshes, weights, mtp_weights)
    return cfg, list(zip(trees, meshes)), kw


def _timing() -> dict:
    # host_s: seconds the device waited for the host (between one launch's last program
    # finishing and the next launch); host_work_s: the host's own seconds between launches
    # (with a clock; overlapped work hides part of them)
    return {"prefill_s": 0.0, "step_s": 0.0, "host_s": 0.0, "host_work_s": 0.0, "steps": 0,
            "plain_steps": 0, "mixed_steps": 0, "prefill_chunks": 0, "prefill_tokens": 0,
            "packed_steps": 0,     # launches carrying several lanes' chunks (packed prefill)
            "lane_moves": 0,
            "moves_s": 0.0, "launches": 0, "overlapped": 0}


@dataclasses.dataclass
class InFlight:
    """A launched record whose outputs the host has not read yet (ModelRunner.launch).

    Times are perf_counter seconds on this host. The step program's own time is
    ready - max(launched, the previous launch's end), where `ready` is the first time its
    outputs were seen ready (probe) or the moment a blocking read returned: an upper bound
    when the host looked late, exact when the host was waiting for it and nothing was queued
    behind the step (XLA:CPU may run the queued program before it wakes the waiting host: the
    step before it then looks long and it looks free, so in the overlapped loop only a
    `timed` record is clean)."""
    batch: Batch
    outputs: tuple | None        # device (tokens, accepted, logprobs) of a decode step
    want: bool                   # a lane asked for log probabilities
    tail: object                 # the launch's last device output (its snapshot save, ...)
    launched: float              # when the step program was launched
    modelled: float              # its price on the clock (0.0 without one)
    clean: bool                  # its seconds are its own: serial, timed alone or modelled
    compiled: bool               # its first run (its wall time is no step cost)
    busy_seen: float = 0.0       # the last time the launch's tail was seen still running
    ready_seen: float | None = None   # the first time the step's outputs were seen ready
    tail_seen: float | None = None    # the first time the tail was seen ready
    clock_end: float = 0.0       # with a clock: when the modelled device finishes it


def _live(x) -> list:
    """x's device arrays that no later program has consumed (donated buffers are deleted
    when the next launch takes them: that launch queued behind them, so their end is read
    at its launch, `probe`, or not at all)."""
    return [a for a in jax.tree.leaves(x) if isinstance(a, jax.Array) and not a.is_deleted()]


def _ready(x) -> bool:
    """Whether every live device array of x has been computed (no wait)."""
    return all(a.is_ready() for a in _live(x))


class ModelRunner:
    """Placement, device state, programs, warm-up and timing (module docstring).

    snapshot_slots: the prefix cache's snapshot slots (None: no prefix cache); pool_pages:
    the device pool's pages (the allocator's sentinel)."""

    def __init__(self, cfg: Config, params: Params, shapes: StepShapes, *, pool_pages: int,
                 kernels: str | None = None, tp: int = 1, devices: Sequence | None = None,
                 mesh=None, draft_vocab=None, snapshot_slots: int | None = None,
                 depth0_fills_mtp_kv: bool = False):
        k = shapes.num_draft_slots
        kernels = kernels or default_kernels()
        check_kernels(kernels)
        if kernels == "pallas" and shapes.page_size & (shapes.page_size - 1):
            raise ValueError(f"the Triton paged-attention kernel needs a power-of-two "
                             f"page_size, got {shapes.page_size}")
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
        self.cfg, self.params, self.shapes, self.num_draft_slots = cfg, params, shapes, k
        self.kernels, self.dtype, self.pool_pages = kernels, params.embed.dtype, pool_pages
        self.snapshot_slots = snapshot_slots
        self.depth0_fills_mtp_kv = bool(depth0_fills_mtp_kv)
        self.cache, self.state, self.snaps = self._device_state()
        self.timing = _timing()
        self.depth_steps = [0] * (k + 1)          # decode steps run at each depth
        self._programs: set = set()
        self._clock = None
        self._mark = 0.0                 # clock: perf_counter where the open host segment began
        self._submitted: dict[int, float] = {}   # clock: request id -> clock time of submit
        self._no_masks: dict[tuple[int, int], jax.Array] = {}   # (lanes, depth) -> all -1
        self._no_extras: dict[int, steps.Extras] = {}             # lanes -> all off
        self._last: InFlight | None = None   # the last launch (wall: the device's idle time)
        self._prev_end = 0.0                 # wall: when the last collected launch ended
        self._excluded = 0.0                 # callers' callback seconds since the last launch
        self._idle_mark = 0.0                # clock: its idle_s when timing last followed it
        self._uncollected = 0                # launches whose outputs were not read yet
        # XLA:CPU runs a program on the host's own cores: a step queued behind the one the
        # host reads holds them, and the read wakes only when both have run (RESULTS,
        # session 8), so an output wanted early is read before the next launch there
        self.host_is_device = all(d.platform == "cpu" for d in (
            self.params.embed.devices() if mesh is None else mesh.devices.flat))

    # ---------------------------------------------------------------- device state
    def _device_state(self):
        """A fresh (cache, lane state, snapshot store or None) for these shapes: the KV pool
        and GDN slots of every lane slot, zero lane state (replicated over a mesh) and the
        snapshot slots. Allocated one after the other: a failure leaves nothing half-built
        referenced."""
        s = self.shapes
        cache = tensor_parallel.init_paged_cache(self.cfg, self.mesh, s.lane_slots,
                                                 self.pool_pages, s.page_size,
                                                 self.num_draft_slots + 1, self.dtype)
        state = steps.LaneState.empty(s.lane_slots, self.num_draft_slots)
        if self.mesh is not None:
            state = jax.device_put(state, NamedSharding(self.mesh, PartitionSpec()))
        snaps = (None if self.snapshot_slots is None else
                 snapshots.init_snapshots(self.cfg, self.mesh, self.snapshot_slots, self.dtype))
        return cache, state, snaps

    def reset(self) -> None:
        """Re-create the device state as the constructor built it. The old arrays are freed
        first, so the new ones never sit beside them (a pool sized to the memory budget would
        not fit twice); an allocation that fails raises, and calling again retries."""
        old = (self.cache, self.state, self.snaps)
        self.cache = self.state = self.snaps = None
        for x in jax.tree.leaves(old):     # those a donating program has not deleted already
            if isinstance(x, jax.Array) and not x.is_deleted():
                x.delete()
        del old
        self.cache, self.state, self.snaps = self._device_state()

    def read_drafts(self, candidates: bool) -> tuple[np.ndarray, np.ndarray | None]:
        """The drafts the device holds, i32[lane_slots, K], and with candidates their best
        draft rows (LaneState.candidates), as writable host copies: what the core's grammar
        masks are built from."""
        if candidates:
            drafts, cands = jax.device_get((self.state.drafts, self.state.candidates))
            return np.array(drafts), np.array(cands)
        return np.array(self.state.drafts), None

    # ---------------------------------------------------------------- timing
    @property
    def clock(self):
        return self._clock

    @clock.setter
    def clock(self, clock) -> None:
        if clock is not None:
            model = getattr(clock, "model", None)
            for name, want in (("K", self.num_draft_slots), ("page_size", self.shapes.page_size)):
                got = getattr(model, name, want)
                if got != want:
                    raise ValueError(f"the clock's cost model has {name} = {got}, this engine "
                                     f"{want}: it would price programs of other shapes")
            self.timing.setdefault("ttft_s", 0.0)
            self.timing.setdefault("first_tokens", 0)
            self._idle_mark = clock.idle_s
        self._clock = clock

    def open_host(self) -> float:
        """A host segment starts now (the start of an iteration); returns perf_counter."""
        self._mark = time.perf_counter()
        return self._mark

    def close_host(self) -> None:
        """With a clock: the open host segment ends now (clock.add_host)."""
        if self.clock is not None:
            self._add_host(time.perf_counter() - self._mark)
            self._sync_idle()

    def _sync_idle(self) -> None:
        """With a clock: timing["host_s"] follows the clock's device idle time."""
        idle = self.clock.idle_s
        self.timing["host_s"] += idle - self._idle_mark
        self._idle_mark = idle

    def wall_host(self, seconds: float) -> None:
        """Without a clock: host seconds of the caller's own work (scheduling, bookkeeping),
        overlapped or not (timing["host_work_s"]; the device's idle time is host_s)."""
        if self.clock is None:
            self.timing["host_work_s"] += seconds

    def exclude(self, seconds: float) -> None:
        """Seconds the caller's callbacks took inside the open host segment: not ours."""
        self._mark += seconds
        self._excluded += seconds

    def _add_host(self, seconds: float) -> None:
        self.clock.add_host(seconds)
        self.timing["host_work_s"] += seconds

    def submitted(self, request_id: int) -> None:
        """With a clock: a request was submitted now (its time to first token starts)."""
        if self.clock is not None:
            self._submitted[request_id] = self.clock.now

    def first_tokens(self, request_ids: Sequence[int]) -> None:
        """With a clock: these requests got their first token now."""
        if self.clock is None:
            return
        for rid in request_ids:
            started = self._submitted.pop(rid, None)
            if started is not None:
                self.timing["ttft_s"] += self.clock.now - started
                self.timing["first_tokens"] += 1

    def forget(self, request_ids=None) -> None:
        """Drop the submit times of ended requests (all when None)."""
        if request_ids is None:
            self._submitted.clear()
        for rid in request_ids or ():
            self._submitted.pop(rid, None)

    def reset_timing(self, keys=None) -> None:
        for key in (self.timing if keys is None else keys):
            self.timing[key] = 0
        if keys is None:
            self.depth_steps = [0] * (self.num_draft_slots + 1)

    def _program(self, key: tuple, run: Callable[[], tuple], contexts: Sequence[int] = (),
                 start: int = 0, is_last: bool = True) -> tuple[tuple, float]:
        """Launch one program: run() calls it and returns its outputs. Without a clock that is
        all (returns (outputs, 0.0)): dispatch is asynchronous. With one, the host segment
        open since the last program closes (clock.add_host), the program runs here until its
        outputs are ready (this machine's compute is neither host time nor the modelled
        device's) and the clock queues it on the modelled device at its price at these
        shapes, without the host waiting for it (`collect` waits); returns (outputs,
        modelled seconds)."""
        if self.clock is None:
            return run(), 0.0
        t0 = time.perf_counter()
        self._add_host(t0 - self._mark)
        out = jax.block_until_ready(run())
        self._mark = time.perf_counter()
        return out, self.clock.launch(key, contexts, start, is_last, wait=False)

    # ---------------------------------------------------------------- one step
    def launch(self, batch: Batch, serial: bool = True) -> InFlight | None:
        """Launch one record (module docstring) without reading its outputs: moves,
        restores, drafts, ONE program, the snapshot save. None when it runs no program.
        serial: the caller reads the outputs before planning more (the moves are then timed
        apart from the step; in the overlapped loop they are not waited for, and the step's
        time is not clean, unless the record is `timed`: then everything before it finishes
        first and its outputs are read at once, so its seconds are its own)."""
        clocked = self.clock is not None
        alone = batch.timed and not serial and not clocked
        t_moves = time.perf_counter()
        self.probe()
        self._gap(t_moves)
        self._excluded = 0.0
        for src, dst in batch.moves:
            (self.cache, self.state), _ = self._program(("move_lane",), lambda: steps.move_lane(
                self.cache, self.state, jnp.int32(src), jnp.int32(dst), mesh=self.mesh))
            self.timing["lane_moves"] += 1
        for lane, slot, fix in batch.restores:   # prefix hits: GDN state at the boundary
            (self.cache, self.snaps), _ = self._program(
                ("snapshot_restore",), lambda: snapshots.restore(
                    self.cfg, self.params, self.cache, self.snaps, jnp.int32(lane),
                    jnp.int32(slot), snapshots.Rewrite.make(fix),
                    rewrite=self.num_draft_slots > 0, mesh=self.mesh, kernels=self.kernels))
        others = bool(batch.moves or batch.restores)
        if others and (serial or alone) and not clocked:
            # each program is timed to completion: dispatch is asynchronous, so a move's or
            # restore's work would otherwise land in the step's seconds (the depth policy's)
            jax.block_until_ready((self.cache, self.state))
            self.timing["moves_s"] += time.perf_counter() - t_moves
        if alone:
            self._settle()
        key = batch.key
        if key is None:                       # nothing to run (e.g. every request cancelled)
            if others:
                self._last = InFlight(batch, None, False, (self.cache, self.state),
                                      time.perf_counter(), 0.0, False, False,
                                      clock_end=self._clock_end())
            return None
        if batch.drafts is not None:
            self._write_drafts(batch.drafts)
        c = batch.chunk
        chunk = None if c is None else self._chunk(c)
        t0 = time.perf_counter()
        outputs, want = None, False
        if batch.decodes:
            outputs, want, modelled = self._decode(batch, chunk)
            tail = outputs[1]
        else:
            self.cache, modelled = self._program(key, lambda: steps.prefill_chunk(
                self.cfg, self.params, self.cache, chunk, k=self.num_draft_slots,
                kernels=self.kernels, mesh=self.mesh), start=c.starts, is_last=False)
            tail = self.cache
        compiled = key not in self._programs
        self._programs.add(key)
        ready_seen = None
        if alone and outputs is not None:     # read at once: nothing queued behind it yet
            jax.block_until_ready(outputs[1])
            ready_seen = time.perf_counter()
        for lane, slot in batch.snapshots:
            # a boundary the prefix cache took: save (prefill work, whichever program
            # carried the chunk; its time is the launch's, after the step's outputs)
            (self.cache, self.snaps), saved = self._program(
                ("snapshot",), lambda: snapshots.save(
                    self.cache, self.snaps, jnp.int32(lane), jnp.int32(slot), mesh=self.mesh))
            self.timing["prefill_s"] += saved
            tail = self.snaps
        self.timing["launches"] += 1
        self.timing["overlapped"] += self._uncollected > 0   # launched behind a running step
        self._uncollected += 1
        flight = InFlight(batch, outputs, want, tail, t0, modelled,
                          clocked or serial or alone, compiled and not clocked,
                          clock_end=self._clock_end())
        if ready_seen is not None:
            flight.ready_seen = flight.busy_seen = ready_seen
        self._last = flight
        return flight

    def read_before_next(self, batch: Batch) -> bool:
        """Whether the overlapped loop reads this launch before it launches the next: a
        step that gives requests their first tokens, where the host is the device (wall
        time; a clock prices the overlap itself). Behind the next step its tokens would
        reach the host only after that step too, a whole step's time added to the TTFT."""
        return (self.host_is_device and self.clock is None and batch.join_mask is not None
                and bool(batch.join_mask.any()))

    def drop_launches(self) -> None:
        """The caller will not collect the launches in flight (a session ended): they still
        run, in order, before anything launched later; their outputs are never read."""
        self._uncollected, self._last = 0, None
        if self.clock is not None:
            self.clock.wait()

    def _settle(self) -> None:
        """Wait until everything launched so far has finished (a timed step starts on an idle
        device); the launch before it ended by now at the latest, which is when the host
        records it as seen ending (its step's own time and the next one's start read it)."""
        jax.block_until_ready(_live((self.cache, self.state, self.snaps)))
        now = time.perf_counter()
        f = self._last
        if f is not None:
            if f.outputs is not None and f.ready_seen is None:
                f.ready_seen = now
            if f.tail_seen is None:
                f.tail_seen = f.busy_seen = now

    def _clock_end(self) -> float:
        """With a clock: when the modelled device finishes what is queued so far."""
        return 0.0 if self.clock is None else self.clock.device_free

    def probe(self) -> None:
        """Note, without waiting, whether the last launch has finished (its readiness is what
        the step's time and the device's idle time are read from)."""
        f = self._last
        if f is None or self.clock is not None or f.tail_seen is not None:
            return
        now = time.perf_counter()
        if f.outputs is not None and f.ready_seen is None:
            if not _ready(f.outputs[1]):
                f.busy_seen = now
                return
            f.ready_seen = now
        if _ready(f.tail):
            f.tail_seen = now
        else:
            f.busy_seen = now

    def _gap(self, now: float) -> None:
        """Without a clock: the device's idle time before a launch at `now`: from the last
        launch's end (at most the last time it was seen running) to now; 0 when it is still
        running (the new launch queues behind it: the host is hidden)."""
        f = self._last
        if f is None or self.clock is not None or f.tail_seen is None:
            return
        self.timing["host_s"] += max(0.0, now - max(f.busy_seen, f.launched) - self._excluded)
        self._last = None

    def collect(self, flight: InFlight) -> StepResult:
        """Read a launched record's outputs (waiting for them) and account its time."""
        clocked = self.clock is not None
        batch = flight.batch
        self._uncollected -= 1
        if clocked:
            self.clock.wait(flight.clock_end)
            self._sync_idle()
            seconds = flight.modelled
        else:
            prev_end = self._prev_end
            if flight.outputs is not None and flight.ready_seen is None:
                if not _ready(flight.outputs[1]):
                    jax.block_until_ready(flight.outputs[1])
                    flight.busy_seen = time.perf_counter()   # running until (about) now
                flight.ready_seen = time.perf_counter()
            if flight.tail_seen is None:
                if not _ready(flight.tail):
                    jax.block_until_ready(_live(flight.tail))
                    flight.busy_seen = time.perf_counter()
                flight.tail_seen = time.perf_counter()
            done = flight.ready_seen if flight.outputs is not None else flight.tail_seen
            seconds = max(done - max(flight.launched, prev_end), 0.0)
            self._prev_end = flight.tail_seen
        if batch.chunk is not None:
            self.timing["prefill_chunks"] += len(batch.chunk.lanes)
            self.timing["packed_steps"] += batch.chunk.packed
            self.timing["prefill_tokens"] += sum(batch.chunk.n_valid)   # not the padding
        if not batch.decodes:
            self.timing["prefill_s"] += seconds
            return StepResult(seconds=seconds, compiled=flight.compiled)
        out, n_acc, lps = flight.outputs
        self.timing["step_s"] += seconds          # a decode step, with its chunk if it has one
        self.timing["mixed_steps"] += batch.chunk is not None
        self.timing["steps"] += 1
        self.timing["plain_steps"] += batch.depth == 0
        self.depth_steps[batch.depth] += 1
        # the log probabilities come back only when a request asked for them
        lps = tuple(np.asarray(x) for x in lps) if flight.want else None
        # a first call compiles, and a step behind other programs of its launch is not
        # timed alone: neither is a step cost for the depth policy (modelled time is)
        return StepResult(np.asarray(out), np.asarray(n_acc), lps, seconds,
                          flight.compiled or not flight.clean)

    def _write_drafts(self, drafts: np.ndarray) -> None:
        """The corrected drafts become the lane state's, placed as the state's drafts are,
        committed or not: a committed copy of an uncommitted state (one device) is another
        program input, so the step and every program after it (the state flows through
        them) would compile again after warmup."""
        old = self.state.drafts
        self.state = dataclasses.replace(self.state, drafts=(
            jax.device_put(drafts, old.sharding) if old.committed else jnp.asarray(drafts)))

    def _chunk(self, c: ChunkInput) -> steps.Chunk:
        """The record's chunks as the program takes them: scalars for one chunk; packed,
        i32[rows] vectors whose padding rows name lane slot `lane_slots` (out of range: they
        read zeros and write nothing) with no tokens."""
        if not c.packed:
            return steps.Chunk(jnp.int32(c.lanes[0]), jnp.asarray(c.tokens),
                               jnp.asarray(c.next_tokens), jnp.int32(c.starts[0]),
                               jnp.int32(c.n_valid[0]), jnp.asarray(c.page_table))
        pad = c.rows - len(c.lanes)
        vec = lambda xs, fill: jnp.asarray(np.array(tuple(xs) + (fill,) * pad, np.int32))
        return steps.Chunk(vec(c.lanes, self.shapes.lane_slots), jnp.asarray(c.tokens),
                           jnp.asarray(c.next_tokens), vec(c.starts, 0), vec(c.n_valid, 0),
                           jnp.asarray(c.page_table))

    def _decode(self, batch: Batch, chunk):
        """Launch the decode step of the record (with the chunk when given); returns its
        device outputs (tokens [B, depth+1], accepted [B], log probabilities), whether a
        lane wants the log probabilities, and the modelled seconds."""
        nb, depth, s = batch.lanes, batch.depth, batch.sampling
        join = steps.Join(jnp.asarray(batch.join_mask), jnp.asarray(batch.join_tokens),
                          jnp.asarray(batch.join_positions))
        lanes = LaneSampling(jnp.asarray(s.temperature), jnp.asarray(s.top_k),
                             jnp.asarray(s.top_p), jnp.asarray(s.seed))
        if batch.masks is not None:
            allowed = jnp.asarray(batch.masks)
        else:
            if (nb, depth) not in self._no_masks:
                self._no_masks[nb, depth] = jnp.full((nb, depth + 1, self.shapes.mask_words),
                                                     -1, jnp.int32)
            allowed = self._no_masks[nb, depth]
        extras, want = self._extras(batch)
        (self.cache, self.state, *outputs), modelled = self._program(
            batch.key, lambda: steps.decode_step(
                self.cfg, self.params, self.cache, self.state, lanes, jnp.asarray(batch.active),
                jnp.asarray(batch.page_table), join, chunk, allowed, extras, k=depth,
                kernels=self.kernels, mesh=self.mesh, fill_mtp_kv=self.depth0_fills_mtp_kv),
            list(batch.contexts), start=0 if batch.chunk is None else batch.chunk.starts)
        for x in outputs[:2] + (list(outputs[2]) if want else []):
            x.copy_to_host_async()           # on its way while the host plans the next step
        return tuple(outputs), want, modelled

    def _extras(self, batch: Batch) -> tuple[steps.Extras, bool]:
        """The record's steps.Extras and whether a row wants log probabilities; one cached
        all-off set when the record asks for none."""
        nb = batch.lanes
        if nb not in self._no_extras:
            self._no_extras[nb] = steps.Extras.none(nb, self.shapes.history_len)
        x = none = self._no_extras[nb]
        if batch.constrained is not None:   # the step records their drafts' candidates
            x = dataclasses.replace(x, constrained=jnp.asarray(batch.constrained))
        if batch.forced_accept is not None:  # simulated acceptance (timing only)
            x = dataclasses.replace(x, forced_accept=jnp.asarray(batch.forced_accept))
        e = batch.extras
        if e is None:
            return x, False
        history = none.history if e.history is None else jnp.asarray(e.history)
        return (steps.Extras(jnp.asarray(e.want_logprobs), jnp.asarray(e.bias_ids),
                             jnp.asarray(e.bias_values), history, jnp.asarray(e.prompt_len),
                             jnp.asarray(e.presence), jnp.asarray(e.frequency),
                             jnp.asarray(e.repetition), x.constrained, x.forced_accept),
                bool(e.want_logprobs.any()))

    # ---------------------------------------------------------------- programs
    def warmup_plan(self, depths: Sequence[int] | None = None,
                    lanes: int | None = None) -> list[tuple]:
        """The program keys `warmup(depths, lanes)` would run (`stats()["programs"]`):
        ("decode", depth, lane bucket) for every depth (default 0..K) and lane bucket a run of
        up to `lanes` (default max_lanes) busy lanes reaches, ("mixed", depth, lane_slots, T)
        for every ride bucket T and depth up to mixed_max_depth, ("prefill", T) for every
        chunk bucket, packed prefill's ("mixed", depth, lane_slots, T, rows) and ("prefill",
        T, rows) when prefill_rows > 1, ("move_lane",) with more than one lane, the
        snapshot programs with the prefix cache; minus those already run."""
        s, k = self.shapes, self.num_draft_slots
        depths = list(range(k + 1) if depths is None else depths)
        for d in depths:
            if not 0 <= d <= k:
                raise ValueError(f"depth {d} outside 0..{k}")
        top = s.max_lanes if lanes is None else min(int(lanes), s.max_lanes)
        buckets = sorted({s.lane_bucket(b + 1) for b in range(top)})
        keys = [("decode", d, nb) for nb in buckets for d in depths]
        keys += [("mixed", d, s.lane_slots, T) for T in s.ride_buckets for d in depths
                 if d <= s.mixed_max_depth]
        keys += [("prefill", T) for T in s.chunk_buckets]
        if s.prefill_rows > 1:     # packed prefill: prefill_rows rows (StepShapes.ride)
            R = s.prefill_rows
            keys += [("mixed", d, s.lane_slots, T, R) for T in s.ride_buckets for d in depths
                     if d <= s.mixed_max_depth]
            keys.append(("prefill", s.prefill_chunk, R))
        if s.max_lanes > 1:
            keys.append(("move_lane",))
        if self.snapshot_slots is not None:
            keys += [("snapshot_restore",), ("snapshot",)]
        return [key for key in keys if key not in self._programs]

    def shape_key(self, key: tuple = ("decode",)) -> tuple:
        """What the compiled program `key` depends on besides the key (Engine.shape_key)."""
        s = self.shapes
        snap = key[0].startswith("snapshot") and self.snapshot_slots is not None
        return (self.cfg, self.num_draft_slots, self.kernels, str(self.dtype), s.lane_slots,
                self.pool_pages, s.page_size, s.pages_per_lane, self.depth0_fills_mtp_kv,
                self.mesh, self.snapshot_slots if snap else None,
                None if self.draft_ids is None else len(self.draft_ids))

    def warmup(self, keys: Sequence[tuple], table: np.ndarray, free_slot: int | None,
               progress: Callable[[tuple, float], None] | None = None) -> int:
        """Run each program of `keys` once on inputs that touch nothing a request sees
        (Engine.warmup); table: the page table as it stands; free_slot: a free snapshot slot
        (None: the save is skipped). Returns how many ran."""
        n = 0
        for key in keys:
            if key == ("snapshot",) and free_slot is None:
                continue
            t0 = time.perf_counter()
            self._warm_one(key, table, free_slot)
            self._programs.add(key)
            n += 1
            if progress is not None:
                progress(key, time.perf_counter() - t0)
        return n

    def _warm_one(self, key: tuple, table: np.ndarray, free_slot: int | None) -> None:
        """Run the program `key` once on inputs that touch nothing a request sees."""
        s = self.shapes
        no_pages = jnp.full((1, s.pages_per_lane), -1, jnp.int32)

        def chunk(T, rows=1):   # on lane 0, from position 0, no pages: writes nothing a
            zeros = jnp.zeros((rows, T), jnp.int32)           # request reads (packed: every
            if rows == 1:                                     # row a padding row)
                return steps.Chunk(jnp.int32(0), zeros, zeros, jnp.int32(0), jnp.int32(T),
                                   no_pages)
            none = jnp.zeros((rows,), jnp.int32)
            return steps.Chunk(none + s.lane_slots, zeros, zeros, none, none + T,
                               jnp.full((rows, s.pages_per_lane), -1, jnp.int32))
        if key[0] in ("decode", "mixed"):
            d, nb = key[1], key[2]
            lanes_s = LaneSampling.from_params([SamplingParams()] * nb)
            no_masks = jnp.full((nb, d + 1, s.mask_words), -1, jnp.int32)
            self.cache, self.state, out, _, _ = steps.decode_step(
                self.cfg, self.params, self.cache, self.state, lanes_s,
                jnp.zeros(nb, bool), jnp.asarray(table[:nb]), steps.Join.none(nb),
                chunk(*key[3:]) if key[0] == "mixed" else None, no_masks,
                steps.Extras.none(nb, s.history_len), k=d,
                kernels=self.kernels, mesh=self.mesh, fill_mtp_kv=self.depth0_fills_mtp_kv)
            out.block_until_ready()
        elif key[0] == "prefill":
            self.cache = steps.prefill_chunk(self.cfg, self.params, self.cache, chunk(*key[1:]),
                                             k=self.num_draft_slots, kernels=self.kernels,
                                             mesh=self.mesh)
            jax.block_until_ready(self.cache)
        elif key == ("move_lane",):
            self.cache, self.state = steps.move_lane(self.cache, self.state, jnp.int32(0),
                                                     jnp.int32(0), mesh=self.mesh)
            jax.block_until_ready(self.state)
        elif key == ("snapshot_restore",):
            self.cache, self.snaps = snapshots.restore(
                self.cfg, self.params, self.cache, self.snaps, jnp.int32(0), jnp.int32(0),
                snapshots.Rewrite.make(None), rewrite=self.num_draft_slots > 0, mesh=self.mesh,
                kernels=self.kernels)
            jax.block_until_ready(self.cache)
        elif key == ("snapshot",):
            self.cache, self.snaps = snapshots.save(self.cache, self.snaps, jnp.int32(0),
                                                    jnp.int32(free_slot), mesh=self.mesh)
            jax.block_until_ready(self.snaps)
        else:
            raise ValueError(f"unknown program {key!r}")

    def stats(self) -> dict:
        """The runner's part of Engine.stats()."""
        return {"compiled_programs": len(self._programs), "programs": sorted(self._programs),
                "kernels": self.kernels, "tp": self.tp,
                "weights": "fp8" if quant.has_fp8(self.params) else str(self.dtype),
                "mtp_weights": (None if self.params.mtp is None else "fp8"
                                if quant.has_fp8(self.params.mtp) else str(self.dtype)),
                "weight_bytes": int(sum(x.nbytes for x in jax.tree.leaves(self.params))),
                "devices": [str(d) for d in (self.mesh.devices.flat if self.mesh is not None
                                             else [self.params.embed.devices().pop()])]}
