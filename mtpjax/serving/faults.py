"""Failing fast: the circuit breaker's settings, and a fault injector to test it.

A device fault that persists (a lost GPU, a driver reset, memory that never comes back) makes
every engine step fail. Rebuilding the device state and trying again forever would fail every
request while `/health` answered 200. So the online engine (online.py) counts consecutive
failed steps; after `max_consecutive_failures` it opens its breaker: queued requests end with
an error, new ones are refused (HTTP 503) and `/health` answers 503 "unavailable". While open it
probes by itself every `probe_interval_s` with a one-token request of its own; the first probe
that completes closes the breaker, and the server takes work again with no restart.

`FaultInjection` is a test aid (off by default; `serve --fault_injection=fail_steps:A-B`):
engine steps A..B, counted from 1 at the first engine step the online loop runs (after the
warm-up, which runs before it starts; probes count too), raise `InjectedFault` in place of the
step, as a device fault inside the step's program would. The online engine recovers from it
as from a real one: the requests the step held end "error" and the device state is rebuilt.
"""

from __future__ import annotations

import dataclasses
import re


class InjectedFault(RuntimeError):
    """An engine step failed on purpose (FaultInjection)."""


class Unavailable(RuntimeError):
    """The online engine's breaker is open: it takes no work until a probe succeeds."""


@dataclasses.dataclass(frozen=True)
class BreakerConfig:
    """max_consecutive_failures: failed engine steps in a row that open the breaker (a step
    that completes resets the count); probe_interval_s: seconds between probes while open."""
    max_consecutive_failures: int = 3
    probe_interval_s: float = 1.0

    def __post_init__(self):
        if not (isinstance(self.max_consecutive_failures, int)
                and self.max_consecutive_failures >= 1):
            raise ValueError("max_consecutive_failures must be an integer >= 1, got "
                             f"{self.max_consecutive_failures!r}")
        if not self.probe_interval_s > 0:
            raise ValueError(f"probe_interval_s must be > 0, got {self.probe_interval_s!r}")


@dataclasses.dataclass(frozen=True)
class FaultInjection:
    """Engine steps first..last (1-based, inclusive) fail with InjectedFault."""
    first: int
    last: int

    @staticmethod
    def parse(spec: str | None) -> "FaultInjection | None":
        """'' or None -> None; 'fail_steps:A-B' (or 'fail_steps:A', one step) -> the range."""
        if not spec:
            return None
        m = re.fullmatch(r"fail_steps:(\d+)(?:-(\d+))?", spec.strip())
        if m is None:
            raise ValueError(f"fault_injection must be 'fail_steps:A-B' (engine steps A..B "
                             f"fail, counted from 1), got {spec!r}")
        first = int(m.group(1))
        last = int(m.group(2)) if m.group(2) is not None else first
        if first < 1 or last < first:
            raise ValueError(f"fault_injection 'fail_steps:A-B' needs 1 <= A <= B, got {spec!r}")
        return FaultInjection(first, last)

    def fails(self, step: int) -> bool:
        return self.first <= step <= self.last
