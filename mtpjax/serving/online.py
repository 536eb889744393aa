"""The online engine: one thread runs an `Engine` session forever while other threads (or an
asyncio server) add and cancel requests and read their tokens as they are committed.

Data flow:
  1. `OnlineEngine.add(prompt_ids, params, stop=...)` (any thread) queues a `RequestHandle` and
     wakes the loop; ids increase, so earlier requests are senior (admitted first, preempted
     last), as in `Engine.generate`.
  2. The loop thread (the only one that touches the engine) submits queued handles
     (`Engine.submit`: an invalid request ends at once with finish_reason "error"), applies
     cancellations, and runs `Engine.step()` while there is work; idle, it sleeps until woken.
  3. `on_token` (engine thread) turns each request's new ids into a `Delta`: ids, and with a
     tokenizer the text that became final. Stop strings are cut here: text that could be the
     start of a stop string is held back; when one appears the text ends just before it, the
     ids end at the token that completed it, and the engine request is cancelled (its pages
     return at the next step). The final stop token (eos / stop_token_ids) is never detokenized.
  4. When the engine reports the request ended (`step()`'s return), the handle gets its
     `OnlineOutput`, and the counters behind `/metrics` are updated.

Failures. A step that raises ends the requests it held (finish_reason "error"); the step
programs donate the device buffers, so the engine's device state is re-created
(`Engine.reset_device_state`, retried with pauses: an out-of-memory may pass) before a new
session opens, and the requests that were only waiting in the queue go into it and finish
normally. Meanwhile `health` is "rebuilding" (the server's /health answers 503). A detokenizer
error ends only its own request. If the device state cannot be rebuilt, the loop stops: every
request left ends with an error and `health` is "stopped". A fault that persists opens the
breaker after `max_consecutive_failures` failed steps in a row (faults.py): `health` is
"unavailable", queued requests end "error", `add` raises `faults.Unavailable`, and the loop
probes every `probe_interval_s` with a one-token request of its own until one completes.

Requests are token-identical to `Engine.generate` for the same prompt and SamplingParams:
the sampler draws each token from (seed, position) only, whatever the batch or arrival time.
A handle is read with a plain iterator (`for delta in handle`), an async iterator
(`async for delta in handle`), or `result()` / `await handle.aresult()`.
"""

from __future__ import annotations

import asyncio
import bisect
import dataclasses
import itertools
import threading
import time
from typing import Sequence

from mtpjax.engine import (FINISH_CANCELLED, FINISH_ERROR, FINISH_LENGTH, FINISH_STOP, Engine,
                           RequestOutput, RequestStats)
from mtpjax.sampling import SamplingParams
from mtpjax.serving.faults import BreakerConfig, FaultInjection, InjectedFault, Unavailable

# Upper bounds (seconds) of the histogram of engine iterations (one Engine.step each).
ITERATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


@dataclasses.dataclass(frozen=True)
class Delta:
    """Newly committed token ids of one request, and the text that became final with them
    (may lag the ids: partial UTF-8 characters and possible stop-string starts wait)."""
    token_ids: tuple[int, ...]
    text: str = ""
    # SamplingParams.logprobs set: one engine.TokenLogprob per token id, else None
    logprobs: tuple | None = None


@dataclasses.dataclass
class OnlineOutput:
    """A finished request. token_ids: what the client gets (through the token that completed
    a stop string, when one did); text: their decoding, cut before the stop string, without
    the final stop token; stop_reason: the stop string or stop token id that ended it."""
    request_id: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    error: str | None
    stats: RequestStats
    stop_reason: str | int | None = None
    logprobs: list | None = None      # one engine.TokenLogprob per token id, when asked

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens served from the prefix cache (RequestStats.cached_tokens)."""
        return self.stats.cached_tokens


# ---------------------------------------------------------------------------- stop strings
class StopStringCutter:
    """Releases streamed text, holding back any suffix that may still grow into a stop string;
    once a stop string appears, releases the text before it and sets `hit`.

    Released text never contains a stop string or a started one, so a stop string can only
    begin inside the held-back part: searching there finds the earliest occurrence."""

    def __init__(self, stops: Sequence[str]):
        stops = tuple(stops)
        for s in stops:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty strings, got {s!r}")
        self.stops = stops
        self._held = ""
        self.hit: str | None = None

    def push(self, text: str) -> str:
        if self.hit is not None:
            return ""
        buf = self._held + text
        found = [(buf.find(s), s) for s in self.stops if s in buf]
        if found:
            at, self.hit = min(found, key=lambda f: f[0])
            self._held = ""
            return buf[:at]
        hold = max((_held_len(buf, s) for s in self.stops), default=0)
        self._held = buf[len(buf) - hold:]
        return buf[:len(buf) - hold]

    def flush(self) -> str:
        out, self._held = self._held, ""
        return "" if self.hit is not None else out


def _held_len(text: str, stop: str) -> int:
    """Longest suffix of text that is a proper prefix of stop."""
    for n in range(min(len(stop) - 1, len(text)), 0, -1):
        if text.endswith(stop[:n]):
            return n
    return 0


class _TextState:
    """Per request, on the engine thread: detokenizer + stop-string cutter."""

    def __init__(self, tokenizer, stops: Sequence[str], stop_ids: frozenset[int],
                 skip_special_tokens: bool):
        self.decoder = tokenizer.stream(skip_special_tokens) if tokenizer is not None else None
        self.cutter = StopStringCutter(stops)
        self.stop_ids = stop_ids
        self.text = ""
        self.error: str | None = None       # the detokenizer failed: the request ends "error"

    @property
    def ended(self) -> bool:
        """No more text: cut at a stop string, or the detokenizer failed."""
        return self.cutter.hit is not None or self.error is not None

    def push(self, ids: list[int]) -> tuple[list[int], str]:
        """Ids kept (cut after the token that completed a stop string, or before the token
        the detokenizer failed on: then `error` says why) and the text released."""
        if self.decoder is None:
            return ids, ""
        out = []
        for n, t in enumerate(ids):
            if t in self.stop_ids and n == len(ids) - 1:
                break                       # the engine ends on it: never part of the text
            try:
                piece = self.decoder.push([t])
            except Exception as e:  # noqa: BLE001 - this request's text only: it ends
                self.error = f"detokenizer failed on token id {t}: {type(e).__name__}: {e}"
                ids = ids[:n]
                break
            out.append(self.cutter.push(piece))
            if self.cutter.hit is not None:
                ids = ids[:n + 1]
                break
        piece = "".join(out)
        self.text += piece
        return ids, piece

    def finish(self) -> str:
        if self.decoder is None or self.cutter.hit is not None:
            return ""
        piece = self.cutter.push(self.decoder.flush())
        piece += self.cutter.flush()
        self.text += piece
        return piece


# ---------------------------------------------------------------------------------- handles
class RequestHandle:
    """One request of an OnlineEngine: iterate it (sync or async) for `Delta`s, then read
    `output`. Thread-safe; the deltas are kept, so several readers each see all of them."""

    def __init__(self, online: "OnlineEngine", request_id: int, prompt: list[int],
                 params: SamplingParams, stops: tuple[str, ...], skip_special_tokens: bool):
        self.online, self.id, self.prompt, self.params = online, request_id, prompt, params
        self.stops, self.skip_special_tokens = stops, skip_special_tokens
        self._cond = threading.Condition()
        self._deltas: list[Delta] = []
        self.output: OnlineOutput | None = None
        self.queued = False                    # accepted by Engine.submit
        self._wakers: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []

    # producer side (engine thread)
    def _publish(self, delta: Delta | None = None, output: OnlineOutput | None = None,
                 queued: bool = False) -> None:
        with self._cond:
            if delta is not None:
                self._deltas.append(delta)
            if output is not None:
                self.output = output
            self.queued = self.queued or queued
            self._cond.notify_all()
            wakers = list(self._wakers)
        for loop, ev in wakers:
            try:
                loop.call_soon_threadsafe(ev.set)
            except RuntimeError:               # that event loop is closed
                pass

    @property
    def done(self) -> bool:
        return self.output is not None

    def cancel(self) -> None:
        self.online.cancel(self.id)

    # sync readers
    def __iter__(self):
        i = 0
        while True:
            with self._cond:
                while i >= len(self._deltas) and self.output is None:
                    self._cond.wait()
                batch, done = self._deltas[i:], self.output is not None
            i += len(batch)
            yield from batch
            if done:
                return

    def result(self, timeout: float | None = None) -> OnlineOutput:
        with self._cond:
            if not self._cond.wait_for(lambda: self.output is not None, timeout):
                raise TimeoutError(f"request {self.id} did not finish in {timeout}s")
            return self.output

    # async readers
    async def _wait(self, ready) -> None:
        """Wait (on the running asyncio loop) until ready() holds."""
        loop = asyncio.get_running_loop()
        ev = asyncio.Event()
        with self._cond:
            self._wakers.append((loop, ev))
        try:
            while True:
                ev.clear()                     # before the check: a later publish sets it
                with self._cond:
                    if ready():
                        return
                await ev.wait()
        finally:
            with self._cond:
                self._wakers.remove((loop, ev))

    async def wait_queued(self) -> OnlineOutput | None:
        """Wait until the engine took the request (None) or rejected it (its output)."""
        await self._wait(lambda: self.queued or self.output is not None)
        return self.output if not self.queued else None

    async def _agen(self):
        i = 0
        while True:
            await self._wait(lambda: i < len(self._deltas) or self.output is not None)
            with self._cond:
                batch, done = self._deltas[i:], self.output is not None
            i += len(batch)
            for d in batch:
                yield d
            if done:
                return

    def __aiter__(self):
        return self._agen()

    async def aresult(self) -> OnlineOutput:
        await self._wait(lambda: self.output is not None)
        return self.output


# ---------------------------------------------------------------------------------- metrics
@dataclasses.dataclass
class OnlineStats:
    """Counters of an OnlineEngine (a consistent copy; see OnlineEngine.stats)."""
    running: int = 0                       # requests in a lane
    waiting: int = 0                       # queued in the engine or not yet submitted
    finished: dict[str, int] = dataclasses.field(default_factory=dict)  # by finish reason
    prompt_tokens: int = 0                 # of accepted requests
    generation_tokens: int = 0             # committed by the engine
    verify_steps: int = 0                  # of finished requests
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = dataclasses.field(default_factory=list)
    tried_per_position: list[int] = dataclasses.field(default_factory=list)
    iterations: int = 0                    # Engine.step calls with work
    iteration_seconds: float = 0.0
    iteration_buckets: list[int] = dataclasses.field(
        default_factory=lambda: [0] * len(ITERATION_BUCKETS))   # counts per bucket (not cumulative)
    engine_errors: int = 0
    device_rebuilds: int = 0               # device state re-created after a failed step
    consecutive_failures: int = 0          # failed engine steps since the last that completed
    breaker_open: bool = False             # taking no work until a probe completes
    breaker_opens: int = 0                 # times the breaker opened
    probes: int = 0                        # probe requests run while it was open
    engine: dict = dataclasses.field(default_factory=dict)      # Engine.stats() snapshot

    @property
    def tokens_per_verify_step(self) -> float:
        return (self.accepted_tokens + self.verify_steps) / max(self.verify_steps, 1)

    def copy(self) -> "OnlineStats":
        return dataclasses.replace(
            self, finished=dict(self.finished),
            accepted_per_position=list(self.accepted_per_position),
            tried_per_position=list(self.tried_per_position),
            iteration_buckets=list(self.iteration_buckets), engine=dict(self.engine))


def _session_counts(engine: Engine) -> tuple[int, int, int]:
    """(running, queued, preemptions so far) of the engine's open session."""
    c = engine.session_counts()
    return c["running"], c["waiting"], c["preemptions"]


# ------------------------------------------------------------------------------ the engine
class OnlineEngine:
    """An Engine session kept open on its own thread; see the module docstring.

    tokenizer: a `text.Tokenizer` (or None: deltas carry ids only, stop strings unavailable);
    skip_special_tokens: the default of `add`. rebuild_attempts, rebuild_backoff_s: how often
    the device state is re-created after a failed step before the loop gives up, and the
    first pause between tries (doubling). breaker: when to stop taking work after failed
    steps, and how often to probe (faults.BreakerConfig); fault_injection: a test aid
    (faults.FaultInjection, None = off). Use as a context manager or call start() and
    shutdown()."""

    def __init__(self, engine: Engine, tokenizer=None, skip_special_tokens: bool = True,
                 stats_interval_s: float = 0.05, rebuild_attempts: int = 5,
                 rebuild_backoff_s: float = 0.1, breaker: BreakerConfig = BreakerConfig(),
                 fault_injection: FaultInjection | None = None):
        if not hasattr(engine, "submit"):
            raise ValueError(f"{type(engine).__name__} has no continuous sessions (start / "
                             "submit / step); the online engine needs one Engine (dp = 1)")
        self.engine, self.tokenizer = engine, tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stats_interval_s = stats_interval_s
        if rebuild_attempts < 1:
            raise ValueError(f"rebuild_attempts must be >= 1, got {rebuild_attempts}")
        self.rebuild_attempts, self.rebuild_backoff_s = int(rebuild_attempts), rebuild_backoff_s
        self.breaker, self.fault_injection = breaker, fault_injection
        self._broken: str | None = None       # why the breaker is open (None: closed)
        self._steps_run = 0                    # engine steps tried (fault_injection counts them)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._pending: list[RequestHandle] = []
        self._cancels: set[int] = set()
        self._ids = itertools.count()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._start_error: BaseException | None = None
        self._rebuilding = False               # set by the engine thread, read by any
        self.fatal_error: BaseException | None = None   # what ended the loop, if it failed
        # engine thread only:
        self._live: dict[int, tuple[RequestHandle, _TextState]] = {}
        self._stats = OnlineStats(accepted_per_position=[0] * engine.k,
                                  tried_per_position=[0] * engine.k)
        self._snapshot = self._stats.copy()
        self._snapshot_t = 0.0

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> "OnlineEngine":
        if self._thread is not None:
            raise RuntimeError("the online engine is already started")
        self._thread = threading.Thread(target=self._loop, name="mtpjax-online", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._start_error is not None:
            raise RuntimeError(f"the engine session did not start: {self._start_error}") \
                from self._start_error
        return self

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Stop the loop: requests still running end "cancelled"; every page returns."""
        with self._lock:
            self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.shutdown()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def health(self) -> str:
        """"ok" (serving), "rebuilding" (re-creating the device state after a failed step: new
        requests wait until it is done), "unavailable" (the breaker is open after
        max_consecutive_failures failed steps: see `unavailable_reason`; new requests are
        refused until a probe completes) or "stopped" (shut down, never started, or the
        device state could not be rebuilt: see fatal_error)."""
        if not self.alive:
            return "stopped"
        if self._broken is not None:
            return "unavailable"
        return "rebuilding" if self._rebuilding else "ok"

    @property
    def unavailable_reason(self) -> str | None:
        """Why the breaker is open (None while it is closed)."""
        return self._broken

    @property
    def ready(self) -> bool:
        """Whether requests are served now (health "ok")."""
        return self.health == "ok"

    # ------------------------------------------------------------------ any thread
    def add(self, prompt_ids: Sequence[int], params: SamplingParams = SamplingParams(),
            stop: Sequence[str] = (), skip_special_tokens: bool | None = None) -> RequestHandle:
        """Queue a request; returns its handle at once. Problems the engine checks (prompt
        length, page budget, token ids, sampling values) end the handle with finish_reason
        "error" (see RequestHandle.wait_queued); a stop string without a tokenizer raises."""
        if isinstance(stop, str):
            stop = (stop,)
        stop = tuple(stop)
        if stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer (OnlineEngine(..., tokenizer=))")
        StopStringCutter(stop)                  # checks them
        if not self.alive:
            raise RuntimeError("the online engine is not running (start() it)")
        if self._broken is not None:
            raise Unavailable(self._broken)
        skip = self.skip_special_tokens if skip_special_tokens is None else skip_special_tokens
        with self._lock:
            if self._stopping:
                raise RuntimeError("the online engine is shutting down")
            h = RequestHandle(self, next(self._ids), [int(t) for t in prompt_ids], params,
                              stop, bool(skip))
            self._pending.append(h)
        self._wake.set()
        return h

    def cancel(self, request_id: int | RequestHandle) -> None:
        """End a request early ("cancelled", with what it has); its pages return at the next
        engine iteration. Unknown or finished ids are ignored. Safe from any thread, at any
        time (the engine thread applies it; a session restarting meanwhile is no matter)."""
        rid = request_id.id if isinstance(request_id, RequestHandle) else int(request_id)
        with self._lock:
            self._cancels.add(rid)
        self._wake.set()

    def stats(self) -> OnlineStats:
        """The counters as of the engine thread's last snapshot (at most stats_interval_s old
        while busy, current when idle)."""
        with self._lock:
            return self._snapshot.copy()

    # ------------------------------------------------------------------ engine thread
    def _loop(self) -> None:
        eng = self.engine
        try:
            eng.start(on_token=self._on_token)
        except BaseException as e:  # noqa: BLE001 - reported by start()
            self._start_error = e
            self._ready.set()
            return
        self._ready.set()
        try:
            self._serve()
        except Exception as e:  # noqa: BLE001 - the loop cannot go on: every request left
            self.fatal_error = e                # ends with this error, health says "stopped"
        finally:
            self._close()

    def _serve(self) -> None:
        """Until shutdown: submit new requests, apply cancellations, step while there is work,
        sleep when idle."""
        eng = self.engine
        while True:
            with self._lock:
                new, self._pending = self._pending, []
                cancels, self._cancels = self._cancels, set()
                stopping = self._stopping
            if stopping:
                for h in new:
                    self._end(h, None, FINISH_CANCELLED, None)
                return
            for h in new:
                self._submit(h, h.id in cancels)
            for rid in cancels:
                if rid in self._live:
                    eng.cancel(rid)
            if self._broken is not None:       # take no work; probe now and then
                for rid in sorted(self._live):
                    self._fail_unavailable(rid)
                self._take_snapshot(force=True)
                if not self._wake.wait(self.breaker.probe_interval_s):
                    self._probe()
                self._wake.clear()
            elif eng.has_work():
                self._iterate()
                self._take_snapshot(force=not eng.has_work())
            else:
                self._take_snapshot(force=True)
                self._wake.wait()
                self._wake.clear()

    def _close(self) -> None:
        """The loop ended (shutdown, or a failure it could not recover from): no more adds;
        requests left end "cancelled" (with what they have), or "error" after a failure."""
        eng, fatal = self.engine, self.fatal_error
        with self._lock:
            self._stopping = True
            pending, self._pending = self._pending, []
        msg = None if fatal is None else f"the engine stopped: {type(fatal).__name__}: {fatal}"
        for h in pending:
            self._end(h, None, FINISH_CANCELLED if fatal is None else FINISH_ERROR, msg)
        left = eng.stop() if getattr(eng, "_sched", None) is not None else {}
        if fatal is not None:
            for rid in sorted(self._live):
                h, ts = self._live.pop(rid)
                self._end(h, None, FINISH_ERROR, msg, ts)
        for rid, out in left.items():
            self._finished(rid, out)
        for rid in list(self._live):
            self._finished(rid, None)
        self._take_snapshot(force=True)

    def _submit(self, h: RequestHandle, cancelled: bool) -> None:
        if cancelled:
            self._end(h, None, FINISH_CANCELLED, None)
            return
        err = self._engine_submit(h)
        if err is not None:
            self._end(h, None, FINISH_ERROR, err)
            return
        p = h.params
        stop_ids = frozenset(p.stop_token_ids) | frozenset(self.engine.eos)
        self._live[h.id] = (h, _TextState(self.tokenizer, h.stops, stop_ids,
                                          h.skip_special_tokens))
        self._stats.prompt_tokens += len(h.prompt)
        h._publish(queued=True)

    def _engine_submit(self, h: RequestHandle) -> str | None:
        """Hand the request to the engine's session: None, or why the engine refused it."""
        try:
            err = self.engine.submit(h.id, h.prompt, h.params)
        except (TypeError, ValueError) as e:   # e.g. a params object of the wrong type
            return str(e)
        return None if err is None else err.error

    def _step(self) -> dict:
        """One engine step, or the injected fault in its place (FaultInjection)."""
        self._steps_run += 1
        fi = self.fault_injection
        if fi is not None and fi.fails(self._steps_run):
            raise InjectedFault(f"injected device fault (fault_injection fail_steps:"
                                f"{fi.first}-{fi.last}, engine step {self._steps_run})")
        return self.engine.step()

    def _failed(self, e: Exception) -> None:
        """A step raised: fail what it held, rebuild, and open the breaker after
        max_consecutive_failures in a row."""
        s = self._stats
        s.engine_errors += 1
        s.consecutive_failures += 1
        self._recover(e)
        if self._broken is None and \
                s.consecutive_failures >= self.breaker.max_consecutive_failures:
            self._broken = (f"{s.consecutive_failures} consecutive engine steps failed (the "
                            f"last: {type(e).__name__}: {e}); probing every "
                            f"{self.breaker.probe_interval_s:g} s")
            s.breaker_open, s.breaker_opens = True, s.breaker_opens + 1
            with self._lock:                   # queued, not yet submitted: refused too
                pending, self._pending = self._pending, []
            for h in pending:
                self._end(h, None, FINISH_ERROR, f"server unavailable: {self._broken}")
            for rid in sorted(self._live):
                self._fail_unavailable(rid)

    def _completed(self) -> None:
        """A step completed: the failure count restarts, an open breaker closes."""
        s = self._stats
        s.consecutive_failures = 0
        if self._broken is not None:
            self._broken, s.breaker_open = None, False

    def _fail_unavailable(self, rid: int) -> None:
        h, ts = self._live.pop(rid)
        self.engine.cancel(rid)
        self._end(h, None, FINISH_ERROR, f"server unavailable: {self._broken}", ts)

    def _probe(self) -> None:
        """While the breaker is open: one greedy one-token request of the loop's own (never
        published), stepped until it ends. Completing it closes the breaker; a failed step
        counts, is recovered from (device state rebuilt) and leaves it open."""
        eng = self.engine
        self._stats.probes += 1
        rid = next(self._ids)
        if eng.submit(rid, [0], SamplingParams(max_new_tokens=1)) is not None:
            return                             # refused (cannot happen for a valid engine)
        while True:
            try:
                done = self._step()
            except Exception as e:  # noqa: BLE001 - still broken: rebuilt, probed again later
                self._failed(e)
                return
            if rid in done:
                self._completed()
                return

    def _iterate(self) -> None:
        t0 = time.perf_counter()
        try:
            done = self._step()
        except Exception as e:  # noqa: BLE001 - fail the requests it held, keep serving the rest
            self._failed(e)
            return
        self._completed()
        dt = time.perf_counter() - t0
        s = self._stats
        s.iterations += 1
        s.iteration_seconds += dt
        b = bisect.bisect_left(ITERATION_BUCKETS, dt)
        if b < len(ITERATION_BUCKETS):
            s.iteration_buckets[b] += 1
        for rid, out in done.items():
            self._finished(rid, out)

    def _recover(self, error: Exception) -> None:
        """After a step that raised: the requests it held (in a lane, or with tokens
        streamed) end with finish_reason "error"; the device state is re-created (the failed
        program may have deleted its donated buffers, and every later step would fail on
        them); a new session opens and the requests that were only waiting in the queue go
        into it, to finish as if nothing happened. `health` is "rebuilding" meanwhile."""
        eng = self.engine
        self._rebuilding = True
        try:
            eng.stop()                          # a no-op if step() closed the session already
            self._take_snapshot(force=True)     # the error counted before any client hears
            waiting = set(eng.waiting_at_stop)
            msg = f"engine step failed: {type(error).__name__}: {error}"
            for rid in sorted(self._live):
                h, ts = self._live[rid]
                if ts.cutter.hit is not None:   # complete: only its cancellation was pending
                    del self._live[rid]
                    self._end(h, None, FINISH_STOP, None, ts, ts.cutter.hit)
                elif rid not in waiting or h._deltas or ts.error is not None:
                    del self._live[rid]
                    self._end(h, None, FINISH_ERROR, msg, ts)
            self._take_snapshot(force=True)
            self._rebuild_device_state()
            eng.start(on_token=self._on_token)
            for rid in sorted(self._live):
                self._resubmit(rid)
        finally:
            self._rebuilding = False

    def _rebuild_device_state(self) -> None:
        """engine.reset_device_state(), tried up to rebuild_attempts times with doubling
        pauses (an out-of-memory can pass once the failed program's buffers are released);
        raises when every try failed."""
        last = None
        for attempt in range(self.rebuild_attempts):
            if attempt:
                time.sleep(self.rebuild_backoff_s * 2 ** (attempt - 1))
            try:
                self.engine.reset_device_state()
            except Exception as e:  # noqa: BLE001 - e.g. RESOURCE_EXHAUSTED: tried again
                last = e
                continue
            self._stats.device_rebuilds += 1
            return
        raise RuntimeError(f"the device state could not be rebuilt after a failed step "
                           f"({self.rebuild_attempts} tries; the last raised "
                           f"{type(last).__name__}: {last})") from last

    def _resubmit(self, rid: int) -> None:
        """Put a request that was only waiting back into the new session (its handle, text
        state and counters stay as they are)."""
        h, ts = self._live[rid]
        err = self._engine_submit(h)
        if err is not None:
            del self._live[rid]
            self._end(h, None, FINISH_ERROR, err, ts)

    def _on_token(self, rid: int, new: list[int]) -> None:
        entry = self._live.get(rid)
        if entry is None or entry[1].ended:
            return                              # cut at a stop string, or its text failed
        h, ts = entry
        self._stats.generation_tokens += len(new)
        lps = None
        if h.params.logprobs is not None:       # the records of `new`: the request's last ones
            recs = self.engine.request_logprobs(rid) or []
            lps = tuple(recs[len(recs) - len(new):])
        try:
            ids, text = ts.push(list(new))
        except Exception as e:  # noqa: BLE001 - this request's text only: it ends, others go on
            ts.error = f"text processing failed: {type(e).__name__}: {e}"
            ids, text = [], ""
        if ids or text:
            h._publish(Delta(tuple(ids), text, None if lps is None else lps[:len(ids)]))
        if ts.ended:                            # its pages return at the next step
            self.engine.cancel(rid)

    def _finished(self, rid: int, out: RequestOutput | None) -> None:
        entry = self._live.pop(rid, None)
        if entry is None:
            return
        h, ts = entry
        self._flush_text(h, ts)
        if out is None:
            self._end(h, None, FINISH_CANCELLED if ts.error is None else FINISH_ERROR,
                      ts.error, ts)
            return
        st, agg = out.stats, self._stats
        agg.verify_steps += st.verify_steps
        agg.drafted_tokens += st.drafted_tokens
        agg.accepted_tokens += st.accepted_tokens
        for j, (a, t) in enumerate(zip(st.accepted_per_position, st.tried_per_position)):
            agg.accepted_per_position[j] += a
            agg.tried_per_position[j] += t
        reason, stop_reason = out.finish_reason, None
        if ts.error is not None:
            self._end(h, out, FINISH_ERROR, ts.error, ts)
            return
        if ts.cutter.hit is not None:
            reason, stop_reason = FINISH_STOP, ts.cutter.hit
        elif reason == FINISH_STOP and out.token_ids and out.token_ids[-1] in ts.stop_ids:
            stop_reason = out.token_ids[-1]
        self._end(h, out, reason, out.error, ts, stop_reason)

    def _flush_text(self, h: RequestHandle, ts: _TextState) -> None:
        """Publish the text the detokenizer and the stop-string cutter still held."""
        if ts.error is not None:
            return
        try:
            tail = ts.finish()
        except Exception as e:  # noqa: BLE001 - this request's text only
            ts.error = f"detokenizer failed at the end of the text: {type(e).__name__}: {e}"
            return
        if tail:
            h._publish(Delta((), tail))

    def _end(self, h: RequestHandle, out: RequestOutput | None, reason: str, error: str | None,
             ts: _TextState | None = None, stop_reason=None) -> None:
        """Publish the handle's final output (ids as streamed, cut at a stop string)."""
        ids = [t for d in h._deltas for t in d.token_ids]
        lps = ([r for d in h._deltas for r in (d.logprobs or ())]
               if getattr(h.params, "logprobs", None) is not None else None)
        self._stats.finished[reason] = self._stats.finished.get(reason, 0) + 1
        h._publish(output=OnlineOutput(
            h.id, h.prompt, ids, ts.text if ts is not None else "", reason, error,
            out.stats if out is not None else RequestStats(), stop_reason, lps))

    def _take_snapshot(self, force: bool) -> None:
        now = time.perf_counter()
        if not force and now - self._snapshot_t < self.stats_interval_s:
            return
        running, queued, preempt = _session_counts(self.engine)
        st = self.engine.stats()
        st["preemptions"] = st.get("preemptions", 0) + preempt
        with self._lock:
            pending = len(self._pending)
        self._stats.running, self._stats.waiting = running, queued + pending
        self._stats.engine = st
        snap = self._stats.copy()
        with self._lock:
            self._snapshot = snap
        self._snapshot_t = now
