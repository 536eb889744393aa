"""Progress lines on stderr for long runs: what is loading, compiling (n of m) and timing.

A first run on a 2-core CPU spends minutes compiling before its first timed pass; a user must
see what it is doing. `Progress(enabled)` prints `[name mm:ss] message` lines on stderr (elapsed
time since the run started), nothing when disabled (`--progress=false`). `mappings()` counts
the process's memory mappings (/proc/self/maps): every XLA:CPU program holds hundreds, and
Linux allows a process 65,530 (vm.max_map_count), so long runs report them.
"""

from __future__ import annotations

import sys
import time

MAX_MAP_COUNT_DEFAULT = 65530


def mappings() -> int | None:
    """Memory mappings of this process now (None where /proc is missing)."""
    try:
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:
        return None


def map_limit() -> int:
    """The kernel's per-process mapping limit (vm.max_map_count; Linux's default if unknown)."""
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read())
    except (OSError, ValueError):
        return MAX_MAP_COUNT_DEFAULT


class Progress:
    """Timestamped progress lines on stderr, and the peak memory mappings seen at each line."""

    def __init__(self, name: str, enabled: bool = True, stream=None):
        self.name, self.enabled = name, enabled
        self.stream = stream or sys.stderr
        self.t0 = time.perf_counter()
        self.peak_mappings = mappings() or 0

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def sample(self) -> None:
        self.peak_mappings = max(self.peak_mappings, mappings() or 0)

    def __call__(self, message: str) -> None:
        self.sample()
        if self.enabled:
            m, s = divmod(int(self.elapsed()), 60)
            print(f"[{self.name} {m:02d}:{s:02d}] {message}", file=self.stream, flush=True)


def program_name(key: tuple) -> str:
    """A warm-up program key (Engine.warmup_plan) in words."""
    if key[0] == "decode":
        return f"decode depth {key[1]} x {key[2]} lane{'s' if key[2] > 1 else ''}"
    if key[0] == "mixed":
        return (f"decode depth {key[1]} x {key[2]} lane{'s' if key[2] > 1 else ''} "
                f"+ prefill chunk of {key[3]}")
    if key[0] == "prefill":
        return f"prefill chunk of {key[1]}"
    return {"move_lane": "lane move", "snapshot": "snapshot save",
            "snapshot_restore": "snapshot restore"}.get(key[0], str(key))
