"""A traffic audit of optimized HLO: what a compiled program moves besides what it must read.

Why: a decode step of a 27B model is bound by HBM bandwidth. Its floor is reading the weights
once (plus the KV context and the GDN state); anything XLA adds on top -- a weight sliced out of
a stacked array into a fresh buffer, a cache copied per layer through a scan, a zero-filled scan
output copied back into the donated cache -- costs bandwidth and shows up as a *data-movement
op* in the optimized HLO. `compiled.cost_analysis()` is None for deviceless GPU compiles and
XLA's cost model counts a while-loop body once, so this module counts bytes itself, from
`compiled.as_text()`, with loop trip counts applied.

Everything here is a pure function of the HLO text (plus what the caller knows about the entry
parameters); nothing imports jax.

What it counts (one "movement" per scheduled instruction, i.e. per kernel / thunk):
  - `copy` (and `copy-start`): a device-to-device copy.
  - a fusion whose fused computation only moves data: every op is one of MOVE_OPS (bitcast,
    copy, reshape, transpose, slice, dynamic-slice, dynamic-update-slice, concatenate,
    broadcast, pad, iota, gather, scatter, convert, select, reverse, ...) or integer/pred index
    math (the offsets of a dynamic slice, an iota == index mask). XLA's "dynamic_slice_fusion"
    (a dynamic-slice + copy emitted as a memcpy) and its concatenated GEMM operands are such
    fusions. A fusion holding any floating-point arithmetic, a reduce, a dot or a custom call
    is compute and is NOT counted (the reads of compute are what the floor is about).
  - the same ops when they stand unfused at the top level (dynamic-slice, concatenate, ...).
  Only movements writing >= min_bytes (default 1 MB) per execution are kept.

Byte convention (per execution, then times the trip counts of every enclosing while loop):
  written = the output's bytes; for an in-place dynamic-update-slice / scatter (its buffer
            operand is a parameter of the fusion, so XLA updates that buffer in place) only the
            update's bytes;
  read    = bytes of the data sources the written value comes from, capped at `written`
            (a copy / slice / concatenate reads what it writes; a fill -- broadcast of a
            constant, iota -- reads nothing);
  moved   = written + read. So a 178 MB weight slice copied out of its stacked array counts
            356 MB, a 16 MB zero-fill counts 16 MB.

Kinds: each movement is classified by the entry parameters its data comes from, traced
through pass-through ops (bitcast, copy, slices, tuples, while-loop carries, conditionals,
calls, fusions, custom-call output/operand aliasing): "weight" beats "cache" beats "other".
Values made by compute (or fills) have no source parameter; then the buffer's size is matched
against the non-weight parameters' (whole, or one index along one or two axes) and the kind
is marked "(shape)": a scan's zero-filled output buffer for the cache shows as "cache (shape)";
a weight is only ever a weight by provenance. Unknown trip counts are inferred from the loop condition (compare of the
induction variable against a constant) and otherwise taken as 1 and flagged.

What it cannot see: traffic inside kernels (a Triton kernel reading a KV page twice, a GEMM
re-reading its weight for every 64 rows of tokens), whether XLA overlaps or caches anything in
L2, and buffers that compute fusions write needlessly (e.g. a `where(active, new, old)` over a
whole cache is compute here). For conditionals, each conditional counts its most expensive
branch (nested conditionals inside a branch are summed: an upper bound).
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, Iterable, Mapping, Sequence, Union

MB = 1_000_000
H200_BYTES_PER_S = 4.8e12

DTYPE_BYTES = {
    "pred": 1, "s2": 0.25, "u2": 0.25, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2,
    "u16": 2, "s32": 4, "u32": 4, "s64": 8, "u64": 8, "f16": 2, "bf16": 2, "f32": 4, "f64": 8,
    "c64": 8, "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1, "f8e4m3fnuz": 1,
    "f8e5m2fnuz": 1, "f8e4m3b11fnuz": 1, "f8e3m4": 1, "f8e8m0fnu": 1, "f4e2m1fn": 0.5,
    "token": 0,
}
INT_TYPES = {"pred", "s2", "u2", "s4", "u4", "s8", "u8", "s16", "u16", "s32", "u32", "s64", "u64"}

# Ops that only move (or select / fill) data. Anything else in a fusion makes it compute,
# unless it is integer index math (see _is_index_math).
MOVE_OPS = {
    "parameter", "constant", "bitcast", "reshape", "copy", "transpose", "slice",
    "dynamic-slice", "dynamic-update-slice", "concatenate", "broadcast", "pad", "iota",
    "gather", "scatter", "tuple", "get-tuple-element", "convert", "reverse", "select",
    "bitcast-convert",
}
# Ops through which an entry parameter's data keeps its identity, with the operand indices
# that carry data (None = all operands). Used to trace where moved data comes from.
PASS_THROUGH = {
    "bitcast": (0,), "copy": (0,), "reshape": (0,), "transpose": (0,), "convert": (0,),
    "reverse": (0,), "broadcast": (0,), "slice": (0,), "dynamic-slice": (0,), "pad": (0,),
    "gather": (0,), "concatenate": None, "dynamic-update-slice": (0, 1), "scatter": (0, 2),
    "select": (1, 2), "bitcast-convert": (0,), "copy-start": (0,), "copy-done": (0,),
    "optimization-barrier": (0,), "domain": (0,),
}
KIND_ORDER = ("weight", "cache", "other")


# ---------------------------------------------------------------------------------------------
# Parsing
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Array:
    """One array shape: dtype and dims, e.g. Array("bf16", (16, 12288, 5120))."""
    dtype: str
    dims: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.dims:
            n *= d
        return int(n * DTYPE_BYTES.get(self.dtype, 4))

    def __str__(self) -> str:
        return f"{self.dtype}[{','.join(map(str, self.dims))}]"


@dataclasses.dataclass(frozen=True)
class Instr:
    """One HLO instruction. shape: its arrays (one for an array, several for a tuple)."""
    name: str
    opcode: str
    shape: tuple[Array, ...]
    is_tuple: bool
    operands: tuple[str, ...]
    args: str           # raw text inside the operand parens (parameter number, constant value)
    attrs: str          # everything after the operand list (attributes, metadata, config)
    is_root: bool

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.shape)

    def attr(self, key: str) -> str | None:
        """A computation-valued or simple attribute: calls=%x -> "x"; kind=kLoop -> "kLoop"."""
        m = re.search(r"(?:^|[ ,])" + re.escape(key) + r"=%?([^,\s}]+)", self.attrs)
        return m.group(1) if m else None

    @property
    def called(self) -> tuple[str, ...]:
        """Names of every computation this instruction calls."""
        names = re.findall(r"(?:calls|body|condition|to_apply|true_computation|"
                           r"false_computation)=%([^,\s}]+)", self.attrs)
        m = re.search(r"branch_computations=\{([^}]*)\}", self.attrs)
        if m:
            names += re.findall(r"%([^,\s}]+)", m.group(1))
        m = re.search(r"calls=\{([^}]*)\}", self.attrs)   # async ops may call a list
        if m:
            names += re.findall(r"%([^,\s}]+)", m.group(1))
        return tuple(dict.fromkeys(names))

    @property
    def op_name(self) -> str:
        m = re.search(r'op_name="([^"]*)"', self.attrs)
        return m.group(1) if m else ""


@dataclasses.dataclass(frozen=True)
class Computation:
    name: str
    instrs: tuple[Instr, ...]
    is_entry: bool

    @property
    def root(self) -> Instr:
        return next(i for i in self.instrs if i.is_root)

    def by_name(self) -> dict[str, Instr]:
        return {i.name: i for i in self.instrs}

    def params(self) -> dict[int, Instr]:
        out = {}
        for i in self.instrs:
            if i.opcode == "parameter":
                out[int(re.match(r"\s*(\d+)", i.args).group(1))] = i
        return out


@dataclasses.dataclass(frozen=True)
class Alias:
    """input_output_alias entry: output tuple index <- entry parameter (number, index)."""
    output_index: tuple[int, ...]
    param_number: int
    param_index: tuple[int, ...]
    kind: str  # may-alias / must-alias


@dataclasses.dataclass(frozen=True)
class Module:
    name: str
    computations: Mapping[str, Computation]
    entry: str
    aliases: tuple[Alias, ...]

    def entry_params(self) -> dict[int, Instr]:
        return self.computations[self.entry].params()


_ARRAY_RE = re.compile(r"([a-z][a-z0-9]*)\[([^\]]*)\]")


def parse_shape(text: str) -> tuple[tuple[Array, ...], bool]:
    """'bf16[1,5120]{1,0}' -> ((Array('bf16', (1, 5120)),), False); tuples -> all arrays."""
    arrays = []
    for dt, dims in _ARRAY_RE.findall(text):
        if dt not in DTYPE_BYTES:
            continue
        ds = tuple(int(d.replace("<=", "")) for d in dims.split(",") if d.strip())
        arrays.append(Array(dt, ds))
    return tuple(arrays), text.lstrip().startswith("(")


def _balanced(s: str, start: int) -> int:
    """Index just past the bracket group opening at s[start] ('(' or '{'), quotes respected."""
    pairs = {"(": ")", "{": "}", "[": "]"}
    depth, i, quote = 0, start, False
    while i < len(s):
        c = s[i]
        if quote:
            if c == "\\":
                i += 1
            elif c == '"':
                quote = False
        elif c == '"':
            quote = True
        elif c in pairs:
            depth += 1
        elif c in ")}]":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    raise ValueError(f"unbalanced brackets in HLO line: {s[:200]}")


def parse_instruction(line: str) -> Instr | None:
    s = line.strip()
    if not s.startswith(("%", "ROOT %")):
        return None
    is_root = s.startswith("ROOT ")
    if is_root:
        s = s[5:]
    name, _, rest = s.partition(" = ")
    name = name.lstrip("%")
    if rest.startswith("("):
        end = _balanced(rest, 0)
        shape_text, rest = rest[:end], rest[end:].lstrip()
    else:
        shape_text, _, rest = rest.partition(" ")
    m = re.match(r"([\w\-\$]+)\(", rest)
    if not m:
        return None
    opcode = m.group(1)
    end = _balanced(rest, m.end() - 1)
    inner = rest[m.end():end - 1]
    attrs = rest[end:].lstrip(", ")
    operands = tuple(re.findall(r"%([^\s,(){}]+)", inner))
    shape, is_tuple = parse_shape(shape_text)
    return Instr(name, opcode, shape, is_tuple, operands, inner, attrs, is_root)


def parse_module(text: str) -> Module:
    """Parse `compiled.as_text()` into computations of instructions (enough for the audit)."""
    comps: dict[str, Computation] = {}
    entry = None
    name = None
    instrs: list[Instr] = []
    is_entry = False
    header = text.split("\n", 1)[0]
    mod_name = re.match(r"HloModule (\S+?),?\s", header + " ")
    for line in text.splitlines():
        if name is None:
            m = re.match(r"(ENTRY )?%([^\s(]+) \(.*\{\s*$", line)
            if m:
                name, is_entry, instrs = m.group(2), bool(m.group(1)), []
            continue
        if line.startswith("}"):
            comps[name] = Computation(name, tuple(instrs), is_entry)
            if is_entry:
                entry = name
            name = None
            continue
        ins = parse_instruction(line)
        if ins is not None:
            instrs.append(ins)
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    return Module(mod_name.group(1) if mod_name else "", comps, entry, parse_aliases(header))


def parse_aliases(header: str) -> tuple[Alias, ...]:
    """`input_output_alias={ {0}: (43, {}, may-alias), ... }` from the HloModule line."""
    m = re.search(r"input_output_alias=\{(.*?)\}\s*,\s*[a-z_]+=", header)
    if not m:
        return ()
    ints = lambda s: tuple(int(x) for x in s.split(",") if x.strip())
    return tuple(Alias(ints(o), int(p), ints(pi), k) for o, p, pi, k in re.findall(
        r"\{([\d,\s]*)\}:\s*\((\d+),\s*\{([\d,\s]*)\},\s*([\w-]+)\)", m.group(1)))


# ---------------------------------------------------------------------------------------------
# Loops: which scheduled computation runs how many times per program execution
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Loop:
    name: str              # the while instruction
    computation: str       # where it sits
    body: str
    trip_count: int
    trip_count_source: str  # backend_config | inferred | unknown (taken as 1)
    multiplier: int        # executions of its body per program run (nested loops multiply)


def _int_constant(instr: Instr) -> int | None:
    if instr.opcode != "constant" or len(instr.shape) != 1 or instr.shape[0].dims:
        return None
    m = re.match(r"\s*(-?\d+)\s*$", instr.args)
    return int(m.group(1)) if m else None


def trip_count(module: Module, comp: Computation, w: Instr) -> tuple[int, str]:
    """A while loop's trip count: XLA's known_trip_count, else the condition's pattern.

    The inference handles `compare(induction, constant N), direction=LT|LE|GT|GE` (directly or
    inside a fusion of the condition) with the start value taken from known_init_step or a
    constant in the loop's init tuple (0 otherwise), step 1.
    """
    m = re.search(r'"known_trip_count":\{"n":"(\d+)"', w.attrs)
    if m:
        return int(m.group(1)), "backend_config"
    cond = module.computations.get(w.attr("condition") or "")
    if cond is None:
        return 1, "unknown"
    init = 0
    m = re.search(r'"known_init_step":\{"init":"(-?\d+)","step":"(-?\d+)"', w.attrs)
    if m:
        init = int(m.group(1))
    else:
        tup = comp.by_name().get(w.operands[0]) if w.operands else None
        if tup is not None and tup.opcode == "tuple" and tup.operands:
            first = comp.by_name().get(tup.operands[0])
            c = _int_constant(first) if first is not None else None
            while first is not None and c is None and first.opcode == "copy":
                first = comp.by_name().get(first.operands[0])
                c = _int_constant(first) if first is not None else None
            init = c if c is not None else 0
    for cc in [cond] + [module.computations[n] for i in cond.instrs for n in i.called
                        if n in module.computations]:
        for ins in cc.instrs:
            if ins.opcode != "compare":
                continue
            d = re.search(r"direction=(\w+)", ins.attrs)
            consts = [c for c in (_int_constant(cc.by_name().get(o)) if cc.by_name().get(o)
                                  else None for o in ins.operands) if c is not None]
            if d and consts:
                n, direction = consts[0], d.group(1)
                trips = {"LT": n - init, "LE": n - init + 1, "GT": init - n,
                         "GE": init - n + 1, "NE": n - init}.get(direction)
                if trips is not None and trips >= 0:
                    return trips, "inferred"
    return 1, "unknown"


@dataclasses.dataclass(frozen=True)
class Context:
    """How often a scheduled computation runs, and under which conditional branches."""
    multiplier: int
    branches: tuple[tuple[str, int], ...]  # (conditional instr, branch index), outermost first


def schedule_contexts(module: Module) -> tuple[dict[str, Context], list[Loop]]:
    """Walk the call graph from ENTRY: every scheduled computation (entry, while bodies and
    conditions, conditional branches, calls) with its execution count. Fused computations and
    reducers are not scheduled (they are part of one kernel) and are not listed."""
    ctx: dict[str, Context] = {}
    loops: list[Loop] = []

    def visit(name: str, c: Context):
        prev = ctx.get(name)
        if prev is not None:  # called from several places: executions add up
            c = Context(prev.multiplier + c.multiplier, prev.branches or c.branches)
        ctx[name] = c
        comp = module.computations[name]
        for ins in comp.instrs:
            if ins.opcode == "while":
                n, src = trip_count(module, comp, ins)
                body, cond = ins.attr("body"), ins.attr("condition")
                loops.append(Loop(ins.name, name, body, n, src, c.multiplier * n))
                visit(body, Context(c.multiplier * n, c.branches))
                visit(cond, Context(c.multiplier * (n + 1), c.branches))
            elif ins.opcode == "conditional":
                for bi, b in enumerate(ins.called):
                    visit(b, Context(c.multiplier, c.branches + ((f"{name}/{ins.name}", bi),)))
            elif ins.opcode in ("call", "async-start") and ins.called:
                for b in ins.called:
                    if b in module.computations:
                        visit(b, c)

    visit(module.entry, Context(1, ()))
    return ctx, loops


# ---------------------------------------------------------------------------------------------
# Provenance: which entry parameters a value's data comes from
# ---------------------------------------------------------------------------------------------

Origin = Union[frozenset, tuple]   # frozenset[int] of entry params, or a tuple of Origins
EMPTY: frozenset = frozenset()


def _flat(o: Origin) -> frozenset:
    if isinstance(o, frozenset):
        return o
    out = set()
    for x in o:
        out |= _flat(x)
    return frozenset(out)


def _merge(a: Origin, b: Origin) -> Origin:
    if isinstance(a, tuple) and isinstance(b, tuple) and len(a) == len(b):
        return tuple(_merge(x, y) for x, y in zip(a, b))
    if isinstance(a, tuple) or isinstance(b, tuple):
        return _flat(a) | _flat(b)
    return a | b


def _element(o: Origin, i: int) -> Origin:
    return o[i] if isinstance(o, tuple) and i < len(o) else _flat(o)


def _output_aliasing(ins: Instr) -> list[tuple[tuple[int, ...], int]]:
    m = re.search(r"output_to_operand_aliasing=\{(.*?)\}\s*(?:,\s*[a-z_]+=|$)", ins.attrs)
    if not m:
        return []
    ints = lambda s: tuple(int(x) for x in s.split(",") if x.strip())
    return [(ints(o), int(p)) for o, p in re.findall(r"\{([\d,\s]*)\}:\s*\((\d+),", m.group(1))]


class Provenance:
    """Origins of every instruction of the scheduled computations (and the fusions they call).

    origin[(computation, instr)] is the set of entry parameter numbers whose data reaches that
    value through pass-through ops only (tuple-structured for tuple values).
    """

    def __init__(self, module: Module):
        self.module = module
        self.origin: dict[tuple[str, str], Origin] = {}
        entry = module.computations[module.entry]
        args = {n: frozenset([n]) for n in entry.params()}
        self._eval(module.entry, args)

    def _eval(self, cname: str, param_origins: Mapping[int, Origin], depth: int = 0) -> Origin:
        comp = self.module.computations[cname]
        local: dict[str, Origin] = {}
        get = lambda n: local.get(n, EMPTY)
        for ins in comp.instrs:
            op = ins.opcode
            ops = [get(o) for o in ins.operands]
            if op == "parameter":
                num = int(re.match(r"\s*(\d+)", ins.args).group(1))
                o = param_origins.get(num, EMPTY)
            elif op == "get-tuple-element":
                o = _element(ops[0], int(ins.attr("index") or 0)) if ops else EMPTY
            elif op == "tuple":
                o = tuple(ops)
            elif op in PASS_THROUGH:
                idx = PASS_THROUGH[op]
                sel = ops if idx is None else [ops[i] for i in idx if i < len(ops)]
                o = EMPTY
                for x in sel:
                    o = _merge(o, x) if isinstance(o, tuple) else (_flat(x) | o)
                if op == "optimization-barrier" and ops:
                    o = ops[0]
            elif op == "while" and depth < 50:
                init = ops[0] if ops else EMPTY
                body, cond = ins.attr("body"), ins.attr("condition")
                cur = init
                for _ in range(4):   # carries: init merged with what the body feeds back
                    out = self._eval(body, {0: cur}, depth + 1)
                    new = _merge(cur, out)
                    if new == cur:
                        break
                    cur = new
                self._eval(cond, {0: cur}, depth + 1)
                o = cur
            elif op == "conditional" and depth < 50:
                o = None
                for bi, b in enumerate(ins.called):
                    r = self._eval(b, {0: ops[bi + 1] if bi + 1 < len(ops) else EMPTY},
                                   depth + 1)
                    o = r if o is None else _merge(o, r)
                o = EMPTY if o is None else o
            elif op in ("fusion", "call") and ins.called and depth < 50:
                o = self._eval(ins.called[0], dict(enumerate(ops)), depth + 1)
            elif op == "custom-call":
                al = _output_aliasing(ins)
                if ins.is_tuple:
                    o = tuple(EMPTY for _ in ins.shape)
                    for oi, p in al:
                        if oi and oi[0] < len(o) and p < len(ops):
                            o = o[:oi[0]] + (_flat(ops[p]),) + o[oi[0] + 1:]
                else:
                    o = frozenset().union(*[_flat(ops[p]) for _, p in al if p < len(ops)])
            else:
                o = EMPTY
            local[ins.name] = o
            key = (cname, ins.name)
            self.origin[key] = _merge(self.origin[key], o) if key in self.origin else o
        return local.get(comp.root.name, EMPTY)

    def of(self, cname: str, iname: str) -> frozenset:
        return _flat(self.origin.get((cname, iname), EMPTY))


# ---------------------------------------------------------------------------------------------
# Data movement
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Movement:
    """One data-movement instruction and what it costs per program execution."""
    computation: str
    name: str
    opcode: str            # copy / fusion / dynamic-slice / ...
    what: str              # e.g. "dynamic-slice+copy", "dynamic-update-slice (in place)"
    shape: str             # output shape (or the update's for an in-place update)
    written: int           # bytes per execution
    read: int
    trips: int             # executions per program run
    kind: str              # weight / cache / other, "(shape)" when matched by shape only
    sources: tuple[str, ...]   # entry parameter names the data comes from
    op_name: str           # jax op_name metadata
    branches: tuple[tuple[str, int], ...]

    @property
    def bytes_per_exec(self) -> int:
        return self.written + self.read

    @property
    def total(self) -> int:
        return self.bytes_per_exec * self.trips


def _is_index_math(ins: Instr, by_name: Mapping[str, Instr]) -> bool:
    """Integer / predicate arithmetic (slice offsets, iota == i masks): not data compute."""
    if not ins.shape or any(a.dtype not in INT_TYPES for a in ins.shape):
        return False
    for o in ins.operands:
        src = by_name.get(o)
        if src is not None and any(a.dtype not in INT_TYPES for a in src.shape):
            return False
    return ins.opcode not in ("dot", "reduce", "custom-call", "fusion", "sort", "while",
                              "conditional", "rng", "rng-bit-generator", "all-reduce")


def _only_moves(module: Module, cname: str, seen=None) -> bool:
    """True when a fused computation (and any fusion it nests) only moves data."""
    seen = set() if seen is None else seen
    if cname in seen:
        return True
    seen.add(cname)
    comp = module.computations[cname]
    by_name = comp.by_name()
    for ins in comp.instrs:
        if ins.opcode in MOVE_OPS or _is_index_math(ins, by_name):
            continue
        if ins.opcode == "fusion" and ins.called and _only_moves(module, ins.called[0], seen):
            continue
        return False
    return True


def _data_leaves(by_name: Mapping[str, Instr], name: str, acc: list, seen: set):
    """Instructions where the data of `name` starts: parameters, constants, iotas, or whatever
    is not a pass-through op (index math, a nested fusion). Index operands of slices and
    updates are not followed: they say where, not what."""
    if name in seen or name not in by_name:
        return
    seen.add(name)
    ins = by_name[name]
    if ins.opcode == "tuple":
        follow = list(ins.operands)
    elif ins.opcode == "get-tuple-element":
        follow = list(ins.operands[:1])
    elif ins.opcode in PASS_THROUGH:
        idx = PASS_THROUGH[ins.opcode]
        follow = list(ins.operands) if idx is None else [ins.operands[i] for i in idx
                                                         if i < len(ins.operands)]
    else:
        acc.append(ins)
        return
    for o in follow:
        _data_leaves(by_name, o, acc, seen)


def _read_bytes(comp: Computation, value: str, written: int) -> int:
    """Bytes read to produce `value` inside a fused computation, capped at `written`."""
    leaves: list[Instr] = []
    _data_leaves(comp.by_name(), value, leaves, set())
    src = sum(l.nbytes for l in leaves if l.opcode not in ("constant", "iota"))
    return min(written, src)


def _root_values(comp: Computation) -> list[Instr]:
    """The arrays a fusion outputs: its root, or the elements of a root tuple."""
    by_name = comp.by_name()
    root = comp.root
    if root.opcode == "tuple":
        return [by_name[o] for o in root.operands if o in by_name]
    return [root]


def _through_bitcasts(ins: Instr, by_name) -> Instr:
    while ins.opcode in ("bitcast", "reshape") and ins.operands and ins.operands[0] in by_name:
        ins = by_name[ins.operands[0]]
    return ins


def _fusion_cost(module: Module, fused: str) -> tuple[int, int, str, str]:
    """(written, read, what, shape) of a pure data-movement fusion, one execution."""
    comp = module.computations[fused]
    by_name = comp.by_name()
    written = read = 0
    whats, shapes = [], []
    for v in _root_values(comp):
        core = _through_bitcasts(v, by_name)
        if core.opcode in ("dynamic-update-slice", "scatter"):
            upd_i = 1 if core.opcode == "dynamic-update-slice" else 2
            buf = _through_bitcasts(by_name[core.operands[0]], by_name)
            upd = by_name.get(core.operands[upd_i]) if len(core.operands) > upd_i else None
            if buf.opcode == "parameter" and upd is not None:   # in place: the update only
                w = upd.nbytes
                written += w
                read += _read_bytes(comp, upd.name, w)
                whats.append(f"{core.opcode} (in place)")
                shapes.append(" ".join(map(str, upd.shape)))
                continue
        w = v.nbytes
        written += w
        read += _read_bytes(comp, v.name, w)
        ops = sorted({i.opcode for i in comp.instrs
                      if i.opcode not in ("parameter", "constant", "bitcast", "tuple",
                                          "get-tuple-element", "reshape")
                      and i.opcode in MOVE_OPS})
        whats.append("+".join(ops) or "bitcast")
        shapes.append(" ".join(map(str, v.shape)))
    return written, read, ", ".join(dict.fromkeys(whats)), ", ".join(shapes)


def _top_level_cost(ins: Instr, by_name) -> tuple[int, int, str, str] | None:
    """(written, read, what, shape) of an unfused data-movement op, or None if it is not one."""
    op = ins.opcode
    shape = " ".join(map(str, ins.shape))
    opnd = lambda i: by_name.get(ins.operands[i]) if i < len(ins.operands) else None
    if op in ("copy", "copy-start"):
        src = opnd(0)
        n = src.nbytes if src is not None else ins.nbytes
        return n, n, op, " ".join(map(str, src.shape)) if src is not None else shape
    if op in ("dynamic-update-slice", "scatter"):
        upd = opnd(1 if op == "dynamic-update-slice" else 2)
        n = upd.nbytes if upd is not None else ins.nbytes
        return n, n, f"{op} (in place)", " ".join(map(str, upd.shape)) if upd else shape
    if op in ("broadcast", "iota"):
        src = opnd(0)
        return ins.nbytes, src.nbytes if src is not None else 0, op, shape
    if op in ("dynamic-slice", "slice", "concatenate", "transpose", "gather", "pad",
              "reverse", "convert"):
        return ins.nbytes, ins.nbytes, op, shape
    return None


def _slice_sizes(a: Array) -> set[int]:
    """Byte sizes of `a` and of one index along any one or two of its axes (one layer, one
    lane, one layer of one lane): the buffers a scan or a lane slice makes of a cache."""
    sizes = {a.nbytes}
    dims = [d for d in a.dims if d > 1]
    for i, di in enumerate(dims):
        sizes.add(a.nbytes // di)
        for dj in dims[i + 1:]:
            sizes.add(a.nbytes // (di * dj))
    return sizes


def _shape_match(shape: tuple[Array, ...], params: Mapping[int, Instr],
                 param_kinds: Mapping[int, str]) -> tuple[str, str] | None:
    """(kind, parameter name) for a buffer without a traced source: a non-weight parameter of
    the same dtype whose whole size, or the size of one index along one or two of its axes,
    equals the buffer's (a scan's output buffer [16, 3, 1, ...] matches a [48, 8, ...] cache). Weights are read-only inputs,
    so a buffer is a weight only by provenance, never by shape (a zero-fill shaped like a
    weight is not a weight copy)."""
    found = []
    for a in shape:
        for num, p in params.items():
            kind = param_kinds.get(num)
            if kind in (None, "other", "weight") or not p.shape or p.shape[0].dtype != a.dtype:
                continue
            pa = p.shape[0]
            if a.nbytes in _slice_sizes(pa):
                found.append((KIND_ORDER.index(kind), num, kind, param_label(p)))
    if not found:
        return None
    _, _, kind, name = min(found)
    return kind, name


def param_label(p: Instr) -> str:
    """An entry parameter's name: its jax op_name (e.g. 'params.full.attn.q_proj')."""
    return p.op_name or p.name


def find_movements(module: Module, param_kinds: Mapping[int, str],
                   min_bytes: int = MB) -> tuple[list[Movement], list[Loop]]:
    """Every data-movement instruction writing >= min_bytes per execution, with its kind.

    param_kinds: entry parameter number -> "weight" | "cache" | "other" (missing: "other").
    """
    ctx, loops = schedule_contexts(module)
    prov = Provenance(module)
    params = module.entry_params()
    out = []
    for cname, c in ctx.items():
        comp = module.computations[cname]
        by_name = comp.by_name()
        for ins in comp.instrs:
            if ins.opcode == "fusion" and ins.called:
                if not _only_moves(module, ins.called[0]):
                    continue
                cost = _fusion_cost(module, ins.called[0])
            else:
                cost = _top_level_cost(ins, by_name)
                if cost is None:
                    continue
            written, read, what, shape = cost
            if written < min_bytes:
                continue
            src = sorted(prov.of(cname, ins.name))
            kinds = {param_kinds.get(n, "other") for n in src}
            kind = next((k for k in KIND_ORDER if k in kinds), None)
            sources = tuple(param_label(params[n]) for n in src if n in params)
            if kind is None or kind == "other":
                match = _shape_match(ins.shape, params, param_kinds)
                if match is not None:
                    kind, sources = f"{match[0]} (shape)", (f"{match[1]} (shape)",) + sources
            out.append(Movement(
                computation=cname, name=ins.name, opcode=ins.opcode, what=what, shape=shape,
                written=written, read=read, trips=c.multiplier, kind=kind or "other",
                sources=sources,
                op_name=ins.op_name, branches=c.branches))
    return out, loops


def total_bytes(moves: Iterable[Movement]) -> int:
    """Bytes per program run: straight-line movements summed; for each outermost conditional,
    its most expensive branch (movements within a branch are summed)."""
    plain = 0
    branches: dict[str, dict[int, int]] = {}
    for m in moves:
        if not m.branches:
            plain += m.total
        else:
            cond, bi = m.branches[0]
            branches.setdefault(cond, {}).setdefault(bi, 0)
            branches[cond][bi] += m.total
    return plain + sum(max(b.values()) for b in branches.values())


def base_kind(kind: str) -> str:
    return kind.split(" ")[0]


# ---------------------------------------------------------------------------------------------
# Traffic: the HBM bytes every scheduled kernel moves (independent of any declared floor)
# ---------------------------------------------------------------------------------------------

# Scheduled instructions that launch nothing: control flow, tuple plumbing, aliases, and the
# "done" halves of async pairs (the start is the launch).
NO_KERNEL = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while",
             "conditional", "call", "optimization-barrier", "after-all", "add-dependency",
             "domain", "partition-id", "replica-id", "copy-done", "all-reduce-done",
             "all-gather-done", "collective-permute-done", "async-done", "send-done",
             "recv-done", "async-update"}
SLICING = ("slice", "dynamic-slice", "gather")
IN_PLACE = {"dynamic-update-slice": 1, "scatter": 2}     # opcode -> index of the update


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One kernel launch site and the HBM bytes it moves per execution."""
    computation: str
    name: str
    kind: str              # gemm / pallas:<kernel> / fusion / copy / collective / <opcode>
    read: int              # bytes per execution
    written: int
    read_by_kind: Mapping[str, int]    # weight / cache / other (by the operands' provenance)
    trips: int             # executions per program run
    branches: tuple[tuple[str, int], ...]
    op_name: str

    @property
    def total(self) -> int:
        return (self.read + self.written) * self.trips


def _strip(ins: Instr, by_name) -> Instr:
    return _through_bitcasts(ins, by_name)


def _param_reads(module: Module, comp: Computation) -> dict[int, int | None]:
    """Per parameter of a fused computation: the bytes the kernel reads of it when it is only
    sliced (the slices' bytes) or only the in-place buffer of an update (0); None = whole."""
    by_name = comp.by_name()
    users: dict[str, list[tuple[Instr, int]]] = {}
    for ins in comp.instrs:
        for i, o in enumerate(ins.operands):
            users.setdefault(o, []).append((ins, i))

    def reads(name: str, seen: set) -> int | None:
        total = 0
        for u, idx in users.get(name, []):
            if u.name in seen:
                continue
            seen.add(u.name)
            if u.opcode in ("bitcast", "reshape"):
                r = reads(u.name, seen)
            elif u.opcode in SLICING and idx == 0:
                r = u.nbytes
            elif u.opcode in IN_PLACE and idx == 0:
                r = 0
            elif u.opcode == "fusion" and u.called:     # a nested fusion (Triton GEMM operands)
                inner = module.computations[u.called[0]]
                sub = _param_reads(module, inner).get(idx)
                r = sub
            else:
                r = None
            if r is None:
                return None
            total += r
        return total

    out = {}
    for num, p in comp.params().items():
        r = reads(p.name, set())
        out[num] = None if r is None else min(r, p.nbytes)
    return out


def _fusion_written(comp: Computation) -> int:
    """Bytes a fusion writes: each output array, or only the update of an in-place
    dynamic-update-slice / scatter into one of its parameters; nothing for an output that is
    a parameter passed through."""
    by_name = comp.by_name()
    out = 0
    for v in _root_values(comp):
        core = _strip(v, by_name)
        if core.opcode == "parameter":
            continue
        if core.opcode in IN_PLACE:
            buf = _strip(by_name[core.operands[0]], by_name)
            upd = by_name.get(core.operands[IN_PLACE[core.opcode]])
            if buf.opcode == "parameter" and upd is not None:
                out += upd.nbytes
                continue
        out += v.nbytes
    return out


def _kernel_name(ins: Instr) -> str:
    m = re.search(r"/([A-Za-z0-9_]+)/pallas_call", ins.op_name)
    return m.group(1) if m else ins.op_name.rsplit("/", 1)[-1]


def _pool_operands(operands: list[Instr | None]) -> dict[int, Instr]:
    """The operands shaped as a KV pool, [NKV, num_pages, page_size, HD], by index."""
    return {i: o for i, o in enumerate(operands)
            if o is not None and len(o.shape) == 1 and len(o.shape[0].dims) == 4}


def _paged_pool_read(ins: Instr, operands: list[Instr | None]) -> dict[int, int]:
    """A paged-attention kernel reads the pool pages its page table addresses, not the
    whole pool: for each [NKV, num_pages, page_size, HD] operand, min(pool, table entries x
    page bytes) with the table the i32 [B, pages] operand."""
    table = next((o for o in operands if o is not None and len(o.shape) == 1
                  and o.shape[0].dtype == "s32" and len(o.shape[0].dims) == 2), None)
    if table is None:
        return {}
    entries = table.shape[0].dims[0] * table.shape[0].dims[1]
    out = {}
    for i, o in _pool_operands(operands).items():
        nkv, pages, ps, hd = o.shape[0].dims
        page_bytes = o.nbytes // pages
        if pages > 1 and ps > 1:
            out[i] = min(o.nbytes, entries * page_bytes)
    return out


def _pool_write_traffic(ins: Instr, operands: list[Instr | None]) -> tuple[dict[int, int], int]:
    """The attention prologue (pallas_kernels/qk_norm_rope.py) writes each new token's K and
    V row into the pools it takes aliased (in place) and reads nothing of them: (operand
    index -> 0 for each pool, the bytes it writes: its non-pool outputs plus B x T x NKV
    rows of K and of V, with B, T from the i32 page table and the [B, T, C] projection)."""
    pools = _pool_operands(operands)
    qkv = next((o for o in operands if o is not None and len(o.shape) == 1
                and len(o.shape[0].dims) == 3 and o.shape[0].dtype != "s32"), None)
    if len(pools) != 2 or qkv is None:
        return {}, ins.nbytes
    pool_shapes = [p.shape[0] for p in pools.values()]
    outs = list(ins.shape)
    for a in pool_shapes:
        if a in outs:
            outs.remove(a)
    b, t, _ = qkv.shape[0].dims
    rows = sum(b * t * a.dims[0] * a.nbytes // (a.dims[0] * a.dims[1] * a.dims[2])
               for a in pool_shapes)
    return {i: 0 for i in pools}, sum(a.nbytes for a in outs) + rows


def _page_copy_traffic(operands: list[Instr | None]) -> tuple[dict[int, int], int]:
    """The restore's page copy (pallas_kernels/page_copy.py) reads one page of each pool it
    takes aliased and writes one page of each: (operand index -> a page's bytes for each
    pool, the bytes it writes: a page per pool)."""
    pages = {i: o.nbytes // o.shape[0].dims[1] for i, o in _pool_operands(operands).items()}
    return pages, sum(pages.values())


def kernel_traffic(module: Module, param_kinds: Mapping[int, str] | None = None
                   ) -> list[Kernel]:
    """Every kernel a compiled program launches, with the HBM bytes it moves (see
    `traffic`)."""
    kinds = param_kinds or {}
    ctx, _ = schedule_contexts(module)
    prov = Provenance(module)
    out = []
    for cname, c in ctx.items():
        comp = module.computations[cname]
        by_name = comp.by_name()
        for ins in comp.instrs:
            if ins.opcode in NO_KERNEL:
                continue
            opnds = [by_name.get(o) for o in ins.operands]
            sizes = [o.nbytes if o is not None else 0 for o in opnds]
            written = ins.nbytes
            if ins.opcode == "fusion" and ins.called:
                fused = module.computations[ins.called[0]]
                pr = _param_reads(module, fused)
                sizes = [s if pr.get(i) is None else pr[i] for i, s in enumerate(sizes)]
                written = _fusion_written(fused)
                cfg = re.search(r'"kind":"([^"]+)"', ins.attrs)
                kind = "gemm" if cfg and "gemm" in cfg.group(1) else "fusion"
            elif ins.opcode == "custom-call":
                target = re.search(r'custom_call_target="([^"]+)"', ins.attrs)
                target = target.group(1) if target else ""
                if "triton" in target:
                    kind = "pallas:" + _kernel_name(ins)
                    if "paged_attention" in kind:
                        for i, b in _paged_pool_read(ins, opnds).items():
                            sizes[i] = b
                    elif "qk_norm_rope_write" in kind:
                        reads, written = _pool_write_traffic(ins, opnds)
                        for i, b in reads.items():
                            sizes[i] = b
                    elif "copy_page" in kind:
                        reads, written = _page_copy_traffic(opnds)
                        for i, b in reads.items():
                            sizes[i] = b
                elif "gemm" in target or "cublas" in target:
                    kind = "gemm"
                else:
                    kind = "custom-call:" + target
            elif ins.opcode in IN_PLACE:          # unfused in-place update
                upd = IN_PLACE[ins.opcode]
                sizes = [0 if i == 0 else s for i, s in enumerate(sizes)]
                written = sizes[upd] if upd < len(sizes) else written
                kind = ins.opcode
            elif ins.opcode in ("copy", "copy-start"):
                kind = "copy"
                written = sizes[0] if sizes else written
            elif any(ins.opcode.startswith(op) for op in COLLECTIVE_OPS):
                kind = "collective"
            else:
                kind = ins.opcode
            by_kind = {k: 0 for k in KIND_ORDER}
            for o, s in zip(ins.operands, sizes):
                src = prov.of(cname, o)
                k = next((k for k in KIND_ORDER if k in {kinds.get(n, "other") for n in src}),
                         "other")
                by_kind[k] += s
            out.append(Kernel(cname, ins.name, kind, int(sum(sizes)), int(written), by_kind,
                              c.multiplier, c.branches, ins.op_name))
    return out


@dataclasses.dataclass(frozen=True)
class Traffic:
    """The HBM bytes and kernel launches of one program run, counted kernel by kernel.

    Conditionals: "min" takes, at each outermost conditional, its cheapest branch (by bytes),
    "max" its most expensive; a branch's kernels are summed (nested conditionals included).
    """
    kernels: tuple[Kernel, ...]

    def _pick(self, which: str) -> list[Kernel]:
        plain = [k for k in self.kernels if not k.branches]
        branches: dict[str, dict[int, list[Kernel]]] = {}
        for k in self.kernels:
            if k.branches:
                cond, bi = k.branches[0]
                branches.setdefault(cond, {}).setdefault(bi, []).append(k)
        choose = min if which == "min" else max
        for b in branches.values():
            plain += choose(b.values(), key=lambda ks: sum(k.total for k in ks))
        return plain

    def bytes(self, which: str = "min") -> int:
        return sum(k.total for k in self._pick(which))

    def count(self, which: str = "min") -> int:
        return sum(k.trips for k in self._pick(which))

    def by_kind(self, which: str = "min") -> dict[str, int]:
        """Bytes read by the operands' kind (weight / cache / other) and written."""
        out = {f"read_{k}": 0 for k in KIND_ORDER}
        out["written"] = 0
        for k in self._pick(which):
            for kk, b in k.read_by_kind.items():
                out[f"read_{kk}"] += b * k.trips
            out["written"] += k.written * k.trips
        return out

    def by_class(self, which: str = "min") -> dict[str, dict[str, int]]:
        """Kernel class (gemm, fusion, copy, pallas:<name>, ...) -> launches and bytes."""
        out: dict[str, dict[str, int]] = {}
        for k in self._pick(which):
            d = out.setdefault(k.kind, {"count": 0, "bytes": 0})
            d["count"] += k.trips
            d["bytes"] += k.total
        return dict(sorted(out.items(), key=lambda kv: -kv[1]["bytes"]))

    def summary(self) -> dict:
        return {"bytes": self.bytes("min"), "bytes_max_branch": self.bytes("max"),
                "kernels": self.count("min"), "kernels_max_branch": self.count("max"),
                "by_kind": self.by_kind("min"), "by_class": self.by_class("min")}


def traffic(hlo_text: str, param_kinds: Mapping[int, str] | None = None) -> Traffic:
    """Count, from optimized HLO alone, the HBM bytes a program moves and the kernels it
    launches (see the module docstring, "Traffic")."""
    return Traffic(tuple(kernel_traffic(parse_module(hlo_text), param_kinds)))


# ---------------------------------------------------------------------------------------------
# Summary and roofline
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Audit:
    module: str
    movements: tuple[Movement, ...]
    loops: tuple[Loop, ...]
    aliases: tuple[Alias, ...]
    total: int                       # data movement, bytes per program run
    by_kind: Mapping[str, int]       # weight / cache / other (shape-matched ones included)
    by_source: Mapping[str, int]     # first source parameter's name (or "(none)") -> bytes

    def summary(self, top: int = 12, param_names: Mapping[int, str] | None = None) -> dict:
        """JSON-ready: totals by kind, loops, aliasing, the top offenders."""
        names = param_names or {}
        grouped: dict[tuple, list[Movement]] = {}
        for m in self.movements:
            grouped.setdefault((m.what, m.shape, m.kind, m.trips, m.sources), []).append(m)
        offenders = sorted(grouped.values(), key=lambda ms: -sum(m.total for m in ms))
        return {
            "data_movement_bytes": self.total,
            "data_movement_by_kind": dict(self.by_kind),
            "data_movement_by_source": dict(self.by_source),
            "num_movements": len(self.movements),
            "loops": [dataclasses.asdict(l) for l in self.loops],
            "aliases": [{"output_index": list(a.output_index), "param": a.param_number,
                         "param_name": names.get(a.param_number, ""), "kind": a.kind}
                        for a in self.aliases],
            "top_offenders": [{
                "what": ms[0].what, "shape": ms[0].shape, "kind": ms[0].kind,
                "instructions": len(ms), "example": f"{ms[0].computation}/{ms[0].name}",
                "op_name": ms[0].op_name, "bytes_per_exec": ms[0].bytes_per_exec,
                "trips": ms[0].trips, "total_bytes": sum(m.total for m in ms),
                "sources": list(ms[0].sources[:4])} for ms in offenders[:top]],
        }


def audit(hlo_text: str, param_kinds: Mapping[int, str], min_bytes: int = MB) -> Audit:
    """Parse optimized HLO and count its data movement (see the module docstring)."""
    module = parse_module(hlo_text)
    moves, loops = find_movements(module, param_kinds, min_bytes)
    by_kind = {k: 0 for k in KIND_ORDER}
    for k in KIND_ORDER:
        by_kind[k] = total_bytes(m for m in moves if base_kind(m.kind) == k)
    first = lambda m: m.sources[0] if m.sources else "(none)"
    by_source = {s: total_bytes(m for m in moves if first(m) == s)
                 for s in sorted({first(m) for m in moves})}
    by_source = dict(sorted(by_source.items(), key=lambda kv: -kv[1]))
    return Audit(module.name, tuple(moves), tuple(loops), module.aliases,
                 total_bytes(moves), by_kind, by_source)


COLLECTIVE_OPS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all",
                  "collective-permute", "collective-broadcast")


FLOAT_TYPES = ("bf16", "f16", "f32", "f64")


def weight_sized_float_buffers(hlo_text: str, weight_shapes: Iterable[tuple[int, ...]]
                               ) -> list[dict[str, Any]]:
    """Buffers that look like a dequantized FP8 weight: every instruction of a scheduled
    computation (what reaches HBM; fused computations live in registers) that is not a
    parameter and outputs a bf16 / f16 / f32 / f64 array with as many elements as one of
    `weight_shapes` (the FP8 weights' [O, I]). An FP8 step program should have none."""
    sizes = set()
    for shape in weight_shapes:
        n = 1
        for d in shape:
            n *= int(d)
        sizes.add(n)
    module = parse_module(hlo_text)
    ctx, _ = schedule_contexts(module)
    out = []
    for cname, c in ctx.items():
        for ins in module.computations[cname].instrs:
            if ins.opcode in ("parameter", "get-tuple-element", "bitcast", "tuple"):
                continue
            for a in ins.shape:
                n = 1
                for d in a.dims:
                    n *= d
                if a.dtype in FLOAT_TYPES and n in sizes:
                    out.append({"computation": cname, "name": ins.name, "opcode": ins.opcode,
                                "shape": str(a), "trips": c.multiplier, "op": ins.op_name})
    return out


def collectives(hlo_text: str) -> dict[str, dict[str, int]]:
    """Cross-device collectives a program runs, per kind: executions (times loop trips) and
    bytes of their per-device results. Async pairs (`all-reduce-start` / `-done`) count once,
    at the start; collectives wrapped in an `async-start` computation count where they are."""
    module = parse_module(hlo_text)
    ctx, _ = schedule_contexts(module)
    out: dict[str, dict[str, int]] = {}
    for cname, c in ctx.items():
        for ins in module.computations[cname].instrs:
            op = ins.opcode[:-len("-start")] if ins.opcode.endswith("-start") else ins.opcode
            if op not in COLLECTIVE_OPS:
                continue
            result = ins.shape[-1] if ins.opcode.endswith("-start") and ins.is_tuple \
                else None
            nbytes = result.nbytes if result is not None else ins.nbytes
            d = out.setdefault(op, {"count": 0, "bytes": 0})
            d["count"] += c.multiplier
            d["bytes"] += c.multiplier * nbytes
    return out


def roofline(*, weights: float, kv_read: float, gdn_state_rw: float, lm_head_extra: float,
             data_movement: float, bytes_per_s: float = H200_BYTES_PER_S) -> dict:
    """The floor a step must move and the audit's estimate of what it does move.

    floor    = weights read once + KV read for the context + GDN state read and written
               + lm_head re-read once per extra (chained) draft;
    estimate = floor + data movement (what the audit found on top of the floor; kernels that
               re-read their inputs are not visible, so this is a lower bound of the real
               traffic). Times are at `bytes_per_s` (4.8 TB/s: an H200's HBM).
    """
    floor = weights + kv_read + gdn_state_rw + lm_head_extra
    est = floor + data_movement
    return {
        "floor_bytes": floor, "estimate_bytes": est,
        "floor_terms": {"weights": weights, "kv_read": kv_read, "gdn_state_rw": gdn_state_rw,
                        "lm_head_extra": lm_head_extra},
        "data_movement_bytes": data_movement,
        "ratio": est / floor if floor else float("nan"),
        "data_movement_over_weights": data_movement / weights if weights else float("nan"),
        "floor_ms": 1e3 * floor / bytes_per_s, "predicted_ms": 1e3 * est / bytes_per_s,
    }


def alias_report(module_aliases: Sequence[Alias], donated: Sequence[int],
                 param_names: Mapping[int, str]) -> dict:
    """Which donated entry parameters XLA aliased to an output (updated in place) and which
    not (their buffer is freed, the output gets a fresh one: a whole-buffer write)."""
    aliased = {a.param_number for a in module_aliases}
    return {"donated": len(donated), "aliased": len(aliased & set(donated)),
            "not_aliased": [param_names.get(n, str(n)) for n in donated if n not in aliased]}


if __name__ == "__main__":   # python -m experiments.hlo_audit FILE.hlo.txt: a quick look
    import sys
    text = open(sys.argv[1]).read()
    mod = parse_module(text)
    a = audit(text, {})
    print(json.dumps(a.summary(), indent=1, default=str))
