"""Reading XLA's GPU thunk sequence: which kernels a compiled program launches inside command
buffers (CUDA graphs) and which outside.

The optimized HLO does not show command buffers: XLA forms them on the thunk sequence
(`CommandBufferConversionPass`, a thunk pass run by `GpuExecutable::Create`). With
`--xla_dump_to=DIR --xla_dump_hlo_as_text` a compile writes `*.thunk_sequence.txt` (before the
thunk passes) and, when a pass changed it, `*.thunk_sequence_after_thunk_passes.txt`, one thunk
a line, `<index>: <kind> [...] <name> ...`, nested thunks (a command buffer's, a conditional
branch's, a loop body's) indented under their parent (shared/notes/gpu_step.md §3). A
deviceless H200 compile writes both.

`read_thunks` counts, from one such file: graphs (top-level command buffers: one graph
launch each), the kernel thunks inside them, and those outside (in conditional branches,
loop conditions and bodies that are not themselves converted: launched one by one, loop
bodies once per trip). No trip counts here: hlo_audit.traffic has those; this reads the
structure.
"""

from __future__ import annotations

import collections
import dataclasses
import glob
import os
import re

_THUNK = re.compile(r"^(\s*)(\d+): (k\w+)")
_LABEL = re.compile(r"^(\s*)(\w+):\s*$")
KERNEL_KINDS = ("kKernel", "kCustomKernel", "kCopy", "kGemm", "kCublasLtMatmul", "kCustomCall",
                "kTriton")


@dataclasses.dataclass(frozen=True)
class Thunks:
    graphs: int                 # top-level command buffers
    in_graphs: int              # kernel / copy / gemm thunks inside command buffers
    outside: int                # the same outside any command buffer
    control: int                # conditionals and loops (split the program's graphs)
    by_kind: dict

    def summary(self) -> dict:
        return dataclasses.asdict(self)


def read_thunks(text: str) -> Thunks:
    """Count a thunk-sequence dump (see the module docstring)."""
    stack: list[tuple[int, str]] = []        # (indent, kind or label) of the open parents
    graphs = in_graphs = outside = control = 0
    kinds: collections.Counter = collections.Counter()
    for line in text.splitlines():
        m = _THUNK.match(line)
        label = None if m else _LABEL.match(line)
        if not m and not label:
            continue
        indent = len((m or label).group(1))
        while stack and stack[-1][0] >= indent:
            stack.pop()
        if label:
            stack.append((indent, label.group(2)))
            continue
        kind = m.group(3)
        in_cb = any(k == "kCommandBuffer" for _, k in stack)
        if kind == "kCommandBuffer" and not stack:
            graphs += 1
        elif kind in ("kConditional", "kWhile"):
            control += 1
        elif kind in KERNEL_KINDS or kind.endswith("Kernel"):
            kinds[kind] += 1
            if in_cb:
                in_graphs += 1
            else:
                outside += 1
        stack.append((indent, kind))
    return Thunks(graphs, in_graphs, outside, control, dict(kinds))


def dumps(dump_dir: str) -> list[str]:
    """The thunk-sequence files in an XLA dump directory."""
    return glob.glob(os.path.join(dump_dir, "*.thunk_sequence*.txt"))


def read_new(dump_dir: str, seen: set) -> dict | None:
    """Thunks.summary() of the one compile that wrote the files not in `seen`: its
    after-passes sequence where there is one (command buffers formed), else the plain one;
    None when it wrote none."""
    new = [f for f in dumps(dump_dir) if f not in seen]
    pick = ([f for f in new if f.endswith("_after_thunk_passes.txt")]
            or [f for f in new if f.endswith(".thunk_sequence.txt")])
    if not pick:
        return None
    with open(max(pick, key=os.path.getmtime)) as f:
        return read_thunks(f.read()).summary()
