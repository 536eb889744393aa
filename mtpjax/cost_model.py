"""A cost model of Qwen3.5-27B on one H200 (bf16 or FP8 weights; tp 1..8), priced from the
shapes of the programs the engine launches. Its moved bytes (Cost.bytes) are checked against
the deviceless audit (experiments/hlo_audit.traffic) in tests/test_cost_model.py; Cost.must_read
is the floor a step needs; kernel counts come from mtpjax/h200_kernel_counts.py.

Time of one program = max(HBM bytes / achievable bandwidth, FLOPs / achievable tensor
throughput) + launch cost x kernels in the compiled program + a fixed cost per program.

What it counts, per program (steps.decode_step: "decode"; the same step carrying one lane's
prefill chunk: "mixed", one engine iteration with a prefill in flight; steps.prefill_chunk
alone: "prefill", when no lane decodes; the draft chain, steps.move_lane, snapshots.save /
restore), from the config and the engine's cache layout (model.init_paged_cache,
steps.LaneState), never from the audit:
  weights       every weight a pass reads (target pass: every text weight but the embedding
                table, lm_head included, except in a prefill chunk alone, which samples
                nothing; MTP pass: the MTP head; a chunk's MTP KV fill: the MTP fc and
                projection), once per pass: a mixed iteration's chunk and step share ONE
                target pass (every GEMM runs over both groups' tokens);
  lm_head_extra lm_head re-read per draft (argmax); with a draft vocabulary of N ids
                (mtpjax/draft_vocab.py, CostModel(draft_vocab=N)) the N-row draft head instead;
  kv_read       K and V of the context each lane's attention reads (target full-attention
                layers per target pass, the MTP layer per MTP pass);
  kv_write      the K and V the program writes;
  gdn_state     each lane's GDN slot as the cache holds it: recurrent state [NV, DK, DV] f32
                read + written, conv window [KC-1+P, CONV] and pending buffers (P = K + 1
                slots of k, v, g, beta) read + written;
  gdn_conv_copy a decode step's extra copy of each lane's conv window (DECODE_GDN_F32);
  activations   per-token tensors between kernels (see `_activation_bytes`; a decode step's
                GDN f32 traffic, DECODE_GDN_F32);
  split_k       the f32 partial products of the projections XLA splits along their
                contraction at few rows (SPLIT_K_BY_ROWS: keyed on the rows, lanes x tokens
                per lane, so 8..80-row decode steps and short prefill chunks pay it);
  logits        the f32 logits the samplers write and re-read (SAMPLER_PASSES);
  groups        a mixed iteration's extra traffic for running two groups through one pass
                (MIXED_GDN_SLOT_PASSES).
FLOPs: 2 x tokens x linear weights touched, attention (QK^T and PV over the context), the
GDN recurrence.

Constants (Hardware): the mid set H200 prices every launch; H200_FAST and H200_SLOW bound the
clock's range. Each is a published figure or an assumption, with its source. A lent GPU
replaces the three it can measure (HBM bandwidth, launch cost of a kernel inside a graph,
cost of a program): `python -m experiments gpu_check` writes a calibration file
(experiments/gpu_calibration.py), and `load_calibration(PATH)` (what `--clock_calibration=PATH`
calls on the judge, bench, speed, serve_bench and clock_check) checks it, naming a bad or
missing key, and returns ClockConstants whose mid set holds the measured values, whose fast /
slow sets hold the calibration's per-round extremes at least CALIBRATED_MIN_SPREAD around
them, and whose `origin` ("calibrated from PATH: device, jax, date") the cards print where
they otherwise print "published figures and assumptions".
"""

from __future__ import annotations

import collections
import dataclasses
import math
from typing import Mapping, Sequence

import numpy as np

from mtpjax import tensor_parallel
from mtpjax.config import FULL, Config, qwen3_5_27b

GB = 1e9


@dataclasses.dataclass(frozen=True)
class Hardware:
    """Achievable (measured, published) numbers, not datasheet peaks; each with its source."""
    name: str
    hbm_bytes_per_s: float
    bf16_flops_per_s: float
    fp8_flops_per_s: float
    launch_s: float         # per kernel launched inside one program (CUDA-graph-like replay)
    program_s: float        # fixed cost per program launch from the host
    sources: Mapping[str, str]
    # where the set comes from, in one line for cards: published figures and assumptions, or
    # the calibration file it was read from (load_calibration)
    origin: str = ("published figures and assumptions (mtpjax/cost_model.py H200, H200_FAST, "
                   "H200_SLOW, each constant with its source)")


H200 = Hardware(
    name="NVIDIA H200 SXM 141 GB",
    hbm_bytes_per_s=4.03e12,
    bf16_flops_per_s=700e12,
    fp8_flops_per_s=1400e12,
    launch_s=2.5e-6,
    program_s=20e-6,
    sources={
        "hbm_bytes_per_s": "proxy, NOT an H200 measurement: the H200 datasheet's 4.8 TB/s HBM3e "
                           "peak x 0.84, the fraction of its 3.35 TB/s peak an H100 SXM5 reached "
                           "in measured coalesced matrix loads (2.8 TB/s, Nsight Compute; "
                           "https://mikamirai.com/blog/gpu-memory-bandwidth/). No published H200 "
                           "copy / STREAM / nvbandwidth figure was found in the corpora searched "
                           "(pages, docs: 'nvbandwidth H200', 'H200 STREAM triad'); "
                           "experiments/gpu_check.py measures it on a lent GPU and should "
                           "replace this number",
        "bf16_flops_per_s": "derated datasheet, NOT a measurement: 989 TFLOP/s dense bf16 "
                            "(H100 / H200 SXM datasheet, same tensor cores) x ~0.7; no measured "
                            "H100 / H200 cuBLAS bf16 GEMM throughput was found in the corpora "
                            "searched ('H100 bf16 GEMM TFLOPS measured cuBLAS')",
        "fp8_flops_per_s": "derated datasheet, NOT a measurement: 1979 TFLOP/s dense fp8 x "
                           "~0.7; unused while FP8 is weight-only (matmuls run in bf16)",
        "launch_s": "assumption, bracketed by measurements on other GPUs: a kernel replayed in "
                    "a CUDA graph costs ~0.9 us including a tiny kernel's run (CUDA.jl: 80 "
                    "broadcast kernels 70 us as a graph, 260 us launched one by one; "
                    "https://cuda.juliagpu.org/dev/usage/graphs/), a stream launch ~4-6 us "
                    "(https://susun-blog.com/blog/pegainfer-3-cuda-graph, RTX 5070 Ti); NVIDIA's "
                    "'Getting Started with CUDA Graphs' (developer.nvidia.com/blog/cuda-graphs/, "
                    "V100) times a chain of short kernels both ways. XLA replays only part of a "
                    "program as command buffers, so 2.5 us sits between the two; gpu_check "
                    "times a 27B synthetic step against this model",
        "program_s": "assumption: ~20 us per program launched from the host (one XLA "
                     "executable: argument handling, the launch, the result's readiness)",
    })

# The clock's range ("a range, not a point"): the same launches priced at a fast and a slow
# set of constants around H200 (the mid set, unchanged). A run is recorded once and every
# launch priced at all three sets (VirtualClock.device_range), so the depth policy, which
# learns from the clock's modelled step times, chose its depths at the MID constants: the
# fast and slow totals are the mid run's schedule repriced, not what the policy would have
# chosen on such a GPU. Each bound, with its source or marked as an assumption:
H200_FAST = dataclasses.replace(
    H200, name="NVIDIA H200 SXM 141 GB, fast bound",
    hbm_bytes_per_s=4.32e12, launch_s=1.0e-6, program_s=10e-6,
    sources={
        "hbm_bytes_per_s": "assumption: 0.90 of the 4.8 TB/s datasheet peak. The best "
                           "published SM copy-kernel figure found for an HBM3 Hopper part is "
                           "3.3 TB/s on an H20 (4.0 TB/s peak: 0.83; "
                           "https://github.com/NVIDIA/cuda-samples/issues/366); no H200 "
                           "measurement above the mid constant's 0.84 was found, so 0.90 is "
                           "a margin above it, not a measurement",
        "launch_s": "CUDA.jl: 80 small broadcast kernels replayed as one CUDA graph in 70 us, "
                    "~0.9 us a kernel including its run "
                    "(https://cuda.juliagpu.org/dev/usage/graphs/); 1.0 us: every kernel of "
                    "a step replayed inside a graph",
        "program_s": "assumption: half the mid constant (one XLA executable launch with its "
                     "arguments ready and no host sync); no published figure was found",
    })
H200_SLOW = dataclasses.replace(
    H200, name="NVIDIA H200 SXM 141 GB, slow bound",
    hbm_bytes_per_s=3.6e12, launch_s=4.5e-6, program_s=40e-6,
    sources={
        "hbm_bytes_per_s": "0.75 of the 4.8 TB/s peak: the device-local copy an H100 SXM "
                           "reaches through the copy engine in p2pBandwidthLatencyTest, ~2.5 "
                           "TB/s of its 3.35 TB/s (https://github.com/NVIDIA/nccl/issues/1264); "
                           "cudaMemcpy on an H20, 2 TB/s of 4.0 "
                           "(https://github.com/NVIDIA/cuda-samples/issues/366), is lower still "
                           "but is no kernel's read path",
        "launch_s": "a kernel launched from the stream, outside any graph: ~4-6 us each "
                    "(https://susun-blog.com/blog/pegainfer-3-cuda-graph, RTX 5070 Ti); "
                    "4.5 us: XLA replays none of the step as a command buffer",
        "program_s": "assumption: twice the mid constant (argument handling and a host "
                     "sync per program); no published figure was found",
    })
H200_RANGE_NAMES = ("fast", "mid", "slow")


# ---------------------------------------------------------------------------- calibration
# `python -m experiments gpu_check` on a lent GPU writes a calibration file (its calibrate part,
# experiments/gpu_calibration.py); `--clock_calibration=PATH` on every sub-command that builds
# the clock reads it here. The file's three constants replace the mid set's; the flop rates
# stay H200's (nothing measures them). The range is then built around the measured point, not
# kept at the published bounds (which a measured mid may lie outside of): each calibrated
# constant's fast and slow bounds are the best and worst of its per-repeat samples, widened to
# at least CALIBRATED_MIN_SPREAD on either side of the mid value. The samples say how well the
# micro-benchmark repeats; the floor says that a constant measured on tiny programs and one
# large read is not known to better than that when it prices a 27B step whose kernels are
# neither (an assumption; the file's `steps` section shows measured against predicted 27B-shaped
# steps at the calibrated constants, so a reader can see how far the model really is).
CALIBRATION_FORMAT = "mtpjax-clock-calibration/1"
CALIBRATED = ("hbm_bytes_per_s", "launch_s", "program_s")
CALIBRATED_MIN_SPREAD = 0.10


class CalibrationError(ValueError):
    """A calibration file that cannot price the clock; the message names the file and key."""


@dataclasses.dataclass(frozen=True)
class ClockConstants:
    """The clock's three constant sets: mid prices every launch, fast and slow give the range."""
    fast: Hardware
    mid: Hardware
    slow: Hardware

    def by_name(self) -> dict[str, Hardware]:
        return {"fast": self.fast, "mid": self.mid, "slow": self.slow}

    @property
    def origin(self) -> str:
        return self.mid.origin


H200_CONSTANTS = ClockConstants(H200_FAST, H200, H200_SLOW)


def clock_constants(calibration: str | None = None) -> ClockConstants:
    """The published sets (None or ""), or those read from a calibration file."""
    return load_calibration(calibration) if calibration else H200_CONSTANTS


def _positive(x) -> bool:
    return (isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
            and x > 0)


def check_calibration(doc, where: str = "calibration", allow_smoke: bool = False) -> None:
    """Raise CalibrationError naming the first bad or missing key; a file from `gpu_check
    --smoke` (toy sizes on whatever device) is refused unless allow_smoke."""
    def bad(key: str, why: str):
        raise CalibrationError(f"{where}: {key} {why} (a calibration file is what "
                               "`python -m experiments gpu_check` writes to --calibration_out)")
    if not isinstance(doc, dict):
        bad("the document", "is not a JSON object")
    if doc.get("format") != CALIBRATION_FORMAT:
        bad("format", f"is {doc.get('format')!r}, not {CALIBRATION_FORMAT!r}")
    if not isinstance(doc.get("date"), str) or not doc["date"]:
        bad("date", "is missing")
    dev = doc.get("device")
    if not isinstance(dev, dict) or not isinstance(dev.get("device_kind"), str):
        bad("device.device_kind", "is missing")
    if doc.get("smoke") and not allow_smoke:
        bad("smoke", "is true: a --smoke run measures toy sizes and cannot price the 27B")
    consts = doc.get("constants")
    if not isinstance(consts, dict):
        bad("constants", "is missing")
    errors = doc.get("errors") if isinstance(doc.get("errors"), dict) else {}
    for name in CALIBRATED:
        c = consts.get(name)
        if not isinstance(c, dict):
            bad(f"constants.{name}", "is missing" + (f" (the run says: {errors[name]})"
                                                     if name in errors else ""))
        if "value" not in c:
            bad(f"constants.{name}.value", "is missing")
        if not _positive(c["value"]):
            bad(f"constants.{name}.value", f"must be a positive number, got {c['value']!r}")
        samples = c.get("samples")
        if not isinstance(samples, list) or not samples:
            bad(f"constants.{name}.samples", "is missing or empty")
        if not all(_positive(x) for x in samples):
            bad(f"constants.{name}.samples", f"must be positive numbers, got {samples!r}")
        if not isinstance(c.get("how"), str) or not c["how"]:
            bad(f"constants.{name}.how", "is missing")


def calibrated_constants(doc: Mapping, path: str, base: Hardware = H200) -> ClockConstants:
    """The three sets from a checked calibration document: mid = the measured values; fast and
    slow = the samples' extremes, at least CALIBRATED_MIN_SPREAD away from mid."""
    dev = doc["device"]
    where = (f"calibrated from {path}: {dev['device_kind']}"
             + (f", jax {dev['jax']}" if dev.get("jax") else "") + f", {doc['date']}")
    mid, fast, slow, srcs = {}, {}, {}, {}
    for name in CALIBRATED:
        c = doc["constants"][name]
        v = float(c["value"])
        pts = [float(x) for x in c["samples"]] + [v]
        lo = min(min(pts), v * (1 - CALIBRATED_MIN_SPREAD))
        hi = max(max(pts), v * (1 + CALIBRATED_MIN_SPREAD))
        larger_is_faster = name == "hbm_bytes_per_s"
        mid[name] = v
        fast[name], slow[name] = (hi, lo) if larger_is_faster else (lo, hi)
        srcs[name] = f"{where}: {c['how']}"
    bound = (f"the calibrated samples' extreme, at least {CALIBRATED_MIN_SPREAD:.0%} from the "
             "measured mid value (mtpjax/cost_model.py CALIBRATED_MIN_SPREAD)")
    make = lambda vals, tag, src: dataclasses.replace(
        base, name=f"{base.name}, {tag}calibrated on {dev['device_kind']}", origin=where,
        sources={**base.sources, **src}, **vals)
    return ClockConstants(
        fast=make(fast, "fast bound, ", {n: f"{bound}; {srcs[n]}" for n in CALIBRATED}),
        mid=make(mid, "", srcs),
        slow=make(slow, "slow bound, ", {n: f"{bound}; {srcs[n]}" for n in CALIBRATED}))


def load_calibration(path: str) -> ClockConstants:
    """The clock's constant sets from a gpu_check calibration file (check_calibration, then
    calibrated_constants); CalibrationError for a missing, unreadable or malformed file."""
    import json
    try:
        with open(path) as f:
            doc = json.load(f)
    except FileNotFoundError:
        raise CalibrationError(f"calibration file {path} not found") from None
    except (OSError, ValueError) as e:
        raise CalibrationError(f"calibration file {path}: not readable JSON ({e})") from None
    check_calibration(doc, f"calibration file {path}")
    return calibrated_constants(doc, path)


def price(cost: "Cost", hw: Hardware) -> float:
    """Seconds of a program whose bytes, FLOPs and kernels are `cost`'s on `hw`:
    max(bytes / bandwidth, FLOPs / bf16 throughput) + launch cost x kernels + program cost
    (weight-only FP8 runs its matmuls in bf16)."""
    t = max(cost.total_bytes / hw.hbm_bytes_per_s, cost.flops / hw.bf16_flops_per_s)
    return t + hw.launch_s * cost.kernels + hw.program_s


def range_of(values: Mapping[str, float]) -> list[float]:
    """[low, mid, high] of a quantity priced at the fast / mid / slow constant sets: the
    smallest and largest of the three around the mid set's value."""
    v = [float(values[n]) for n in H200_RANGE_NAMES]
    return [min(v), v[1], max(v)]


# sampling.verify / sample over the target's logits: full-vocabulary f32 passes per verified
# row, as the deviceless compile of steps.decode_step shows them (hlo_audit.traffic of the
# sampler's kernels, Qwen3.5-27B widths, 1..160 rows): 18.9 passes at one row, 17.1 at 8, 16.5
# at 32, 16.4 at 40 and 160 (a few per-row reductions amortize over the batch): a + b / rows.
SAMPLER_PASSES = (16.35, 2.5)
# A prefill chunk's per-token activation traffic over `_activation_bytes`'s count, per decoder
# layer: the deviceless audit of steps.prefill_chunk (no sampling, no drafts) moves 1.73x
# (T = 512) to 1.86x (T = 64) that count per layer and token (the chunked GDN's f32
# intermediates: q / k broadcast to the value heads in f32, the conv output in f32), taken as
# the slope between the full 27B (64 layers) and a 2-layer config of its widths, so it
# follows the layer count. The chunk's MTP KV fill: what is left of the 2-layer program, 0.06x
# (T = 2048) to 0.40x (T = 64) of the MTP layer's count; 0.1 keeps the 2-layer programs (where
# it weighs most) within 1.5% at 64, 512 and 2048 tokens.
# (A 16-token chunk moves ~2% more than this count: the chunked GDN pads to 64-token chunks.)
PREFILL_ACTIVATIONS = 1.79
PREFILL_MTP_ACTIVATIONS = 0.1
# A decode step's GDN layers beyond `_activation_bytes`'s bf16 count, fitted to the deviceless
# audit of steps.decode_step (the slope between the 27B and its 2-layer config, so per GDN
# layer; 1..32 lanes x 1..5 tokens per lane, K = 4; residual under 0.2% of a program):
# per token, DECODE_GDN_F32 f32 vectors of the value width (NV x DV): q and k broadcast from
# the key heads to the value heads, v, the recurrence's output, the pending window's copies,
# all in f32; per lane, the conv window copied once more than it is updated (a copy kernel
# reads and writes it: `gdn_conv_layer` moved twice, 0.33 MB per lane and layer at K = 4).
DECODE_GDN_F32 = 14.6
# XLA's split-K GEMMs at few rows: a projection whose rows (tokens through it: lanes x tokens
# per lane in a decode step, the chunk in a prefill) are few next to its contraction runs as S
# partial products, each written to HBM in f32 and read back by every fusion that consumes the
# projection (no bf16 output is formed). S depends on the rows, the projection's input width
# (contraction) and output width, so XLA's choice is the same in every layer and in any layer
# count: the deviceless compiles of steps.decode_step (27B and a 2-layer config of its widths;
# 1, 8, 16, 32 lanes x 1..5 tokens) and steps.prefill_chunk show, per projection, S by rows up
# to the bound (first bound >= rows applies; none above the last: T = 512, 2048 show none).
# qkv: the attention's fused q/gate/k/v projection (5120 -> 14336); in_proj: the GDN's
# (5120 -> 16480); out: attention / GDN output projection (6144 -> 5120); down: the MLP's
# (17408 -> 5120); fc: the MTP head's (10240 -> 5120). gate_up (5120 -> 34816) is never split.
# These are the 27B's widths at tp = 1; a tp shard's narrower GEMMs are priced with the same
# table (not compiled: an approximation).
SPLIT_K_BY_ROWS = (
    (1, {"out": (4, 1), "down": (8, 1), "fc": (8, 1)}),
    (40, {"qkv": (4, 4), "in_proj": (4, 5), "out": (8, 1), "down": (8, 1), "fc": (8, 1)}),
    (48, {"qkv": (4, 4), "in_proj": (2, 5), "out": (8, 1), "down": (8, 1), "fc": (8, 1)}),
    (80, {"qkv": (2, 4), "in_proj": (2, 5), "out": (4, 1), "down": (8, 1), "fc": (8, 1)}),
    (96, {"qkv": (2, 4), "out": (4, 1), "down": (4, 1), "fc": (4, 1)}),
    (128, {"out": (4, 1), "down": (4, 1), "fc": (4, 1)}),
    (160, {"out": (2, 2), "down": (2, 1), "fc": (2, 1)}),
)
# (S, R): S partial products, read back by R kernels each. q/gate/k/v's four readers: the
# attention, the k / v cache writes, the gate; in_proj's five in a decode step (conv update,
# pending buffers, q/k/v, the gate z, beta and g), four where a step verifies all P = K + 1
# tokens of more than one lane (one consumer fuses away); in a prefill chunk six at up to 40
# rows (T = 16), four above (T = 64); the output projection's two at 160 rows (the residual
# add and the next norm each read it).
PREFILL_IN_PROJ_READERS = ((40, 6), (80, 4))

# A decode step carrying a prefill chunk ("mixed") launches the step's kernels plus, per decoder
# layer, the chunk's mixer (chunked GDN or paged attention over the chunk, its conv / norm /
# gate fusions and the slices that split the shared GEMMs' outputs by group) and, K > 0, the
# kernels of the chunk's MTP KV fill: deviceless 27B compiles (K = 4, 8 lanes, 64- and
# 512-token chunks: mixed minus decode at the same depth and bucket).
MIXED_CHUNK_KERNELS = 13
MIXED_FILL_KERNELS = 12
# The same program moves more than its step's and its chunk's terms: ~2.3 GB at the 27B whatever
# the chunk (64 or 512 tokens), lanes (1..16) and depth (0, 4), ~36 MB a layer (the audit's
# extra kernels, against decode + prefill alone: broadcasts, pads, selects and in-place slot
# updates of GDN-state shape in every GDN layer, and the concatenation of the groups' mixer
# outputs): priced as MIXED_GDN_SLOT_PASSES passes over one lane's GDN slot per GDN layer
# (13.5 x 3.6 MB x 48 layers; residual within +-0.7 GB over those seven 27B compiles). Left
# out: the whole-KV-pool copies XLA inserts at some chunk lengths (model.forward_groups does
# not order the chunk's attention before the step's KV write; tests/test_aot.py), which
# follow the pool's size, unknown here.
MIXED_GDN_SLOT_PASSES = 13.5
# Packed prefill ("mixed", d, B, T, rows), ("prefill", T, rows): the one-chunk program's kernels
# plus, per GDN layer, the gather of the chunks' conv and state slots and their scatter back
# (model.take_slots / put_slots with a vector of lanes). An ESTIMATE from the program's
# structure, not a compiled count: no deviceless 27B compile of a packed program yet.
PACKED_GDN_KERNELS = 4

def split_k(rows: int) -> dict[str, tuple[int, int]]:
    """XLA's (splits, readers) per split projection at `rows` rows (SPLIT_K_BY_ROWS)."""
    for bound, splits in SPLIT_K_BY_ROWS:
        if rows <= bound:
            return splits
    return {}


@dataclasses.dataclass(frozen=True)
class Cost:
    """One program's modelled cost. bytes: what the compiled program moves, by term;
    must_read: what the step must read at least (same terms; a term missing is 0)."""
    bytes: Mapping[str, float]
    flops: float
    kernels: int
    seconds: float
    must_read: Mapping[str, float] = dataclasses.field(default_factory=dict)

    @property
    def total_bytes(self) -> float:
        return float(sum(self.bytes.values()))

    @property
    def must_read_bytes(self) -> float:
        return float(sum(self.must_read.values()))


def _weight_bytes(cfg: Config, weights: str, tp: int) -> dict[str, float]:
    """Bytes one device holds by role: target (text weights but the embedding; lm_head
    included, the embedding when tied), mtp (the MTP head), lm_head, embed."""
    from mtpjax.params import fp8_block, fp8_paths, leaf_dtype, leaf_shapes
    fp8 = fp8_paths(cfg, "fp8" if weights == "fp8" else "dense")
    out = {"target": 0.0, "mtp": 0.0, "lm_head": 0.0, "embed": 0.0}
    for path, shape in leaf_shapes(cfg, split_ba=bool(fp8)).items():
        n = int(np.prod(shape))
        if path in fp8:
            bo, bi = fp8_block(cfg, path, True)
            b = n * 1 + math.ceil(shape[0] / bo) * math.ceil(shape[1] / bi) * 4
        else:
            b = n * leaf_dtype(path, "bfloat16").itemsize
        lay = tensor_parallel.layout_index(cfg, tp, path) if tp > 1 else None
        if lay is not None:
            b = b * len(lay[1]) / shape[lay[0]] / tp
        if path[0] == "mtp":
            out["mtp"] += b
        elif path == ("embed",):
            out["embed"] += b
            if cfg.tie_word_embeddings:
                out["target"] += b
                out["lm_head"] += b
        else:
            out["target"] += b
            if path == ("lm_head",):
                out["lm_head"] += b
    return out


class CostModel:
    """Prices the engine's programs for `cfg` (None: Qwen3.5-27B) on `hw`.

    weights: "bf16" or "fp8" (128 x 128 block-scaled linears, mtpjax/quant.py; the MTP head
    stays bf16 as the engine's default); tp: tensor-parallel degree (every number is one
    device's share); K: the engine's draft slots (P = K + 1 pending slots); page_size: KV page.
    """

    def __init__(self, cfg: Config | None = None, *, weights: str = "bf16", tp: int = 1,
                 K: int = 4, page_size: int = 16, hw: Hardware = H200,
                 draft_vocab: int | None = None):
        if weights not in ("bf16", "fp8"):
            raise ValueError(f"weights must be 'bf16' or 'fp8', got {weights!r}")
        if K < 0:
            raise ValueError(f"K must be >= 0, got {K}")
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.cfg = cfg or qwen3_5_27b()
        tensor_parallel.check_tp(self.cfg, tp)
        self.weights, self.tp, self.K, self.page_size, self.hw = weights, tp, K, page_size, hw
        self.local = tensor_parallel.shard_config(self.cfg, tp)
        self.w = _weight_bytes(self.cfg, weights, tp)
        V = self.cfg.vocab_size
        if draft_vocab is not None and not 1 <= int(draft_vocab) <= V:
            raise ValueError(f"draft_vocab must lie in 1..{V}, got {draft_vocab}")
        self.draft_vocab = None if draft_vocab in (None, V) else int(draft_vocab)
        # the rows one device's draft argmax reads: the lm_head's block, or the draft head's
        self.draft_rows = -(-(self.draft_vocab or V) // tp)
        self.w["draft"] = (self.w["lm_head"] if self.draft_vocab is None
                           else self.draft_rows * self.cfg.hidden_size * 2)   # bf16, like lm_head
        c, l = self.cfg, self.local
        self.act = 2                                   # bf16 activations and KV
        self.kv_token = 2 * l.num_key_value_heads * c.head_dim * self.act   # one layer, K+V
        P = K + 1
        kc = c.linear_conv_kernel_dim - 1
        nv, dk, dv = l.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
        conv = l.conv_dim if tp == 1 else _local_conv_dim(c, tp)
        self.gdn_state_layer = nv * dk * dv * 4
        self.gdn_conv_layer = (kc + P) * conv * self.act
        self.gdn_pend_layer = P * nv * (dk + dv + 2) * 4
        self.n_gdn = c.num_linear_layers
        self.n_full = c.num_full_layers
        self._table = (_kernel_table(weights, K, page_size)
                       if tp == 1 and self.cfg == qwen3_5_27b() else None)

    # ------------------------------------------------------------------ pieces
    def _linear_params(self, role: str) -> float:
        """Multiply-adds per token of one pass's linears (weights read as bf16 elements)."""
        c, l = self.cfg, self.local
        H, I = c.hidden_size, l.intermediate_size
        nq, nkv, hd = l.num_attention_heads, l.num_key_value_heads, c.head_dim
        attn = H * (2 * nq * hd + 2 * nkv * hd) + nq * hd * H
        mlp = 3 * H * I
        nv, dv = l.linear_num_value_heads, c.linear_value_head_dim
        conv = l.conv_dim if self.tp == 1 else _local_conv_dim(c, self.tp)
        gdn = H * (conv + nv * dv + 2 * nv) + nv * dv * H
        vocab = -(-c.vocab_size // self.tp)
        if role == "target":
            return self.n_full * (attn + mlp) + self.n_gdn * (gdn + mlp) + vocab * H
        if role == "mtp":
            return 2 * H * H + attn + mlp
        if role == "lm_head":
            return vocab * H
        if role == "draft":
            return self.draft_rows * H
        raise ValueError(role)

    def _attn_flops(self, tokens_ctx: float) -> float:
        """QK^T and PV of one attention layer: 4 x NQ x HD per (query token, context token)."""
        return 4 * self.local.num_attention_heads * self.cfg.head_dim * tokens_ctx

    def _gdn_flops(self, tokens: float) -> float:
        c, l = self.cfg, self.local
        return self.n_gdn * 7 * l.linear_num_value_heads * c.linear_key_head_dim \
            * c.linear_value_head_dim * tokens

    def _activation_bytes(self, tokens: float, mtp_tokens: float = 0.0,
                          chunk: bool = False) -> float:
        """Per-token tensors that cross kernel boundaries: a count of the layer's inputs,
        projections and MLP intermediates; chunk (a prefill chunk's chunked GDN and its
        wide GEMM tiles) x PREFILL_ACTIVATIONS, calibrated on the deviceless audit."""
        c, l = self.cfg, self.local
        H, I = c.hidden_size, l.intermediate_size
        per_full = 10 * H + 2 * (2 * l.num_attention_heads + 2 * l.num_key_value_heads) \
            * c.head_dim + 5 * l.num_attention_heads * c.head_dim + 6 * I
        per_gdn = 10 * H + 4 * (l.conv_dim + l.linear_num_value_heads * c.linear_value_head_dim) \
            + 6 * I
        per_tok = self.act * (self.n_full * per_full + self.n_gdn * per_gdn)
        per_mtp = self.act * (per_full + 4 * H)
        if chunk:
            per_tok *= PREFILL_ACTIVATIONS
            per_mtp *= PREFILL_MTP_ACTIVATIONS
        else:
            per_tok += self.n_gdn * DECODE_GDN_F32 * l.linear_num_value_heads \
                * c.linear_value_head_dim * 4
        return per_tok * tokens + per_mtp * mtp_tokens

    def _split_k_bytes(self, rows: int, mtp_rows: Sequence[int] = (),
                       in_proj_readers: int | None = None,
                       fill_rows: Sequence[int] = ()) -> float:
        """The f32 partial products of split-K projections (split_k), written once and read
        by each consuming kernel: `rows` tokens through the decoder layers (per layer, so it
        follows the layer count), then one MTP-head pass per entry of `mtp_rows` (its fc and
        its full-attention layer) and one MTP KV fill per entry of `fill_rows` (fc and the
        layer's q/k/v projection only) at that many rows. in_proj_readers: overrides the
        table's."""
        c, l = self.cfg, self.local
        hd = c.head_dim
        conv = l.conv_dim if self.tp == 1 else _local_conv_dim(c, self.tp)
        width = {"qkv": (2 * l.num_attention_heads + 2 * l.num_key_value_heads) * hd,
                 "in_proj": conv + l.linear_num_value_heads * c.linear_value_head_dim
                 + 2 * l.linear_num_value_heads,
                 "out": c.hidden_size, "down": c.hidden_size, "fc": c.hidden_size}

        def part(names: tuple, m: int) -> float:
            total = 0.0
            for n, (splits, readers) in split_k(m).items():
                if n in names:
                    if n == "in_proj" and in_proj_readers is not None:
                        readers = in_proj_readers
                    total += m * splits * width[n] * 4 * (1 + readers)
            return total

        full = ("qkv", "out", "down")
        layers = self.n_full * part(full, rows) + self.n_gdn * part(("in_proj", "out", "down"),
                                                                    rows) if rows else 0.0
        return layers + sum(part(full + ("fc",), m) for m in mtp_rows) \
            + sum(part(("qkv", "fc"), m) for m in fill_rows)

    def _logits_bytes(self, verify_rows: int, argmax_rows: int) -> float:
        """The lm_head's f32 logits around the samplers: every row written once by its GEMM;
        a verified / sampled row read SAMPLER_PASSES times by sampling.verify / sample, an
        argmax row (a draft, over the draft vocabulary's rows) read once."""
        row = -(-self.cfg.vocab_size // self.tp) * 4
        a, b = SAMPLER_PASSES
        passes = a + b / verify_rows if verify_rows else 0.0
        return row * verify_rows * (1 + passes) + self.draft_rows * 4 * argmax_rows * 2

    def _gdn_bytes(self, lanes: int, written: int | None = None) -> float:
        """GDN slot bytes of `lanes` lanes: state, conv window and pending buffers read, and
        written back; a decode step of T tokens (`written` = T) writes only its T pending
        slots and KC-1+T conv rows (model._gdn_mix), not all P."""
        read = self.gdn_state_layer + self.gdn_conv_layer + self.gdn_pend_layer
        if written is None:
            return 2 * lanes * self.n_gdn * read
        P = self.K + 1
        kc = self.cfg.linear_conv_kernel_dim - 1
        wrote = (self.gdn_state_layer + self.gdn_conv_layer * (kc + written) / (kc + P)
                 + self.gdn_pend_layer * written / P)
        return lanes * self.n_gdn * (read + wrote)

    def _finish(self, bytes_: dict, must: dict, flops: float, kernels: int,
                fp8_share: float = 0.0) -> Cost:
        cost = Cost({k: float(v) for k, v in bytes_.items()}, float(flops), int(kernels),
                    0.0, {k: float(v) for k, v in must.items()})
        return dataclasses.replace(cost, seconds=float(price(cost, self.hw)))

    # ------------------------------------------------------------------ programs
    def decode(self, depth: int, lanes: int, contexts: Sequence[int]) -> Cost:
        """steps.decode_step at depth d with a batch (lane bucket) of `lanes` slots; contexts:
        tokens already cached for each BUSY lane (len <= lanes)."""
        d, B = self._check_step(depth, lanes, contexts)
        moved, must, flops = self._step_terms(d, B, contexts)
        moved["split_k"] = self._step_split_k(d, B, B * (d + 1))
        return self._finish(moved, must, flops, self._kernels(("decode", d, B)))

    def prefill(self, T: int, start: int | Sequence[int] = 0, is_last: bool = True,
                rows: int = 1) -> Cost:
        """steps.prefill_chunk of a chunk bucket of T tokens at position `start` of its lane:
        the target forward over the chunk (no lm_head: it samples nothing) and, K > 0, the
        chunk's MTP KV fill (MTP fc + the MTP layer's projection). The program never samples
        or drafts, last chunk or not: the prompt's last token joins a decode step, which does
        both. With K = 0 nothing reads the chunk's final hidden state, so XLA drops the last
        layer's output projection and MLP (the audit reads 0.6 GB less). is_last: accepted
        for callers of the old program, no effect. rows > 1: packed prefill, `rows` chunks of
        T tokens (start: each real chunk's; the rest are padding rows at 0) under one read
        of the weights."""
        del is_last
        T = int(T)
        moved, must, flops = self._rows_terms(T, start, rows)
        dead = 0 if self.K > 0 else self._tail_params()
        per_param = 2.0 if self.weights == "bf16" else 1.0 + 4 / (128 * 128)
        moved["weights"] += self.w["target"] - self.w["lm_head"] - per_param * dead
        must["weights"] += self.w["target"] - self.w["lm_head"] - per_param * dead
        N = T * rows
        flops += 2 * N * (self._linear_params("target") - self._linear_params("lm_head") - dead)
        mtp = 1 if self.K > 0 else 0
        if split_k(N):
            readers = next((r for bound, r in PREFILL_IN_PROJ_READERS if N <= bound), None)
            moved["split_k"] = self._split_k_bytes(N, in_proj_readers=readers,
                                                   fill_rows=[N] * mtp)
        return self._finish(moved, must, flops,
                            self._kernels(("prefill", T) + ((rows,) if rows > 1 else ())))

    def mixed(self, depth: int, lanes: int, T: int, contexts: Sequence[int],
              start: int | Sequence[int] = 0, rows: int = 1) -> Cost:
        """steps.decode_step(chunk=...), key ("mixed", d, B, T): the depth-d step of `lanes`
        slots (contexts: tokens cached per busy lane) carrying one lane's prefill chunk of T
        tokens (the bucket) at position `start` of that lane. Both go through every target
        GEMM together (model.forward_groups), so the target weights are read ONCE, plus the
        MTP fc / projection the chunk's MTP KV fill reads (K > 0); the step's MTP passes read
        the head as a decode step's do. Every other term is the two parts': the step's KV,
        GDN slots, samplers and MTP passes, the chunk's KV over its context, its lane's GDN
        slot and its activations; the decoder layers' split-K partials at the rows of both
        (T + B (d + 1)); the two groups' handling (MIXED_GDN_SLOT_PASSES); FLOPs of both.
        rows > 1: packed prefill, key ("mixed", d, B, T, rows): `rows` chunks of T tokens
        (start: each real chunk's; the rest are padding rows at 0), each priced as a chunk."""
        d, B = self._check_step(depth, lanes, contexts)
        T = int(T)
        N = T * rows
        moved, must, flops = self._step_terms(d, B, contexts)
        c_moved, c_must, c_flops = self._rows_terms(T, start, rows)
        moved = {k: moved.get(k, 0.0) + c_moved.get(k, 0.0) for k in moved | c_moved}
        must = {k: must.get(k, 0.0) + c_must.get(k, 0.0) for k in must | c_must}
        moved["split_k"] = self._step_split_k(d, B, B * (d + 1) + N) \
            + self._split_k_bytes(0, fill_rows=[N] * (self.K > 0))
        moved["groups"] = MIXED_GDN_SLOT_PASSES * self._gdn_bytes(rows) / 2
        c_flops += 2 * N * (self._linear_params("target") - self._linear_params("lm_head"))
        return self._finish(moved, must, flops + c_flops,
                            self._kernels(("mixed", d, B, T) + ((rows,) if rows > 1 else ())))

    def _rows_terms(self, T: int, start: int | Sequence[int], rows: int
                    ) -> tuple[dict, dict, float]:
        """`_chunk_terms` of `rows` chunks of T tokens at these starts (padding rows at 0),
        summed, with the MTP fill's weights read once."""
        starts = [int(x) for x in (start if isinstance(start, (tuple, list)) else (start,))]
        rows = int(rows)
        if T < 1 or not 1 <= len(starts) <= rows or min(starts) < 0:
            raise ValueError(f"chunks need T >= 1, 1..rows={rows} starts >= 0, got T={T}, "
                             f"starts={starts}")
        parts = [self._chunk_terms(T, x) for x in starts + [0] * (rows - len(starts))]
        moved, must = {}, {}
        for m, u, _ in parts:
            for k, v in m.items():
                moved[k] = moved.get(k, 0.0) + v
            for k, v in u.items():
                must[k] = must.get(k, 0.0) + v
        moved["weights"], must["weights"] = parts[0][0]["weights"], parts[0][1]["weights"]
        return moved, must, sum(f for _, _, f in parts)

    def _check_step(self, depth: int, lanes: int, contexts: Sequence[int]) -> tuple[int, int]:
        d, B = int(depth), int(lanes)
        if not 0 <= d <= self.K:
            raise ValueError(f"depth must lie in 0..K={self.K}, got {d}")
        _check_lanes(B, contexts)
        return d, B

    def _step_terms(self, d: int, B: int, contexts: Sequence[int]) -> tuple[dict, dict, float]:
        """A depth-d decode step's (moved, must, FLOPs) but its split-K partials, which follow
        the rows of every GEMM (a riding chunk's included): see _step_split_k."""
        T = d + 1
        n = len(contexts)
        ctx = float(sum(contexts)) + n * T
        w = self.w
        must = {
            "weights": w["target"] + d * w["mtp"],
            "lm_head_extra": d * w["draft"],
            "kv_read": self.kv_token * (self.n_full * ctx + d * ctx),
            "kv_write": self.kv_token * n * (self.n_full * T + (2 * d - 1 if d else 0)),
            "gdn_state": self._gdn_bytes(n, T),
        }
        moved = dict(must)
        moved["gdn_state"] = self._gdn_bytes(B, T)               # every slot of the bucket
        moved["gdn_conv_copy"] = 2 * B * self.n_gdn * self.gdn_conv_layer   # DECODE_GDN_F32
        moved["activations"] = self._activation_bytes(B * T, B * T * (1 if d else 0)
                                                      + B * max(d - 1, 0))
        moved["logits"] = self._logits_bytes(B * T, B * d)
        flops = 2 * B * T * self._linear_params("target") \
            + 2 * (B * T + B * max(d - 1, 0)) * (self._linear_params("mtp") if d else 0) \
            + 2 * B * d * self._linear_params("draft") \
            + self.n_full * self._attn_flops(T * ctx) + d * self._attn_flops(T * ctx) \
            + self._gdn_flops(B * (T + self.K + 1))
        return moved, must, flops

    def _step_split_k(self, d: int, B: int, rows: int) -> float:
        """A depth-d step's split-K partials with `rows` rows through the decoder layers (its
        B (d + 1), plus a riding chunk's): the MTP head's re-run over the B (d + 1) verified
        rows and d - 1 chained drafts over B (depth 0 writes the MTP KV only: no split
        projection there)."""
        T = d + 1
        return self._split_k_bytes(rows, [B * T] * (d > 0) + [B] * max(d - 1, 0),
                                   4 if B > 1 and T == self.K + 1 and rows == B * T else None)

    def _chunk_terms(self, T: int, start: int) -> tuple[dict, dict, float]:
        """A prefill chunk's own (moved, must, FLOPs) beside the target weights (read by
        whichever program carries it): its MTP KV fill's weights (K > 0), the KV its
        attention reads (start + T tokens) and writes (T, and T MTP entries), its lane's GDN
        slot, its activations."""
        mtp = 1 if self.K > 0 else 0
        ctx = start * T + T * (T + 1) / 2              # (query, key) pairs, causal
        must = {
            "weights": mtp * self._mtp_fill_weights(),
            "kv_read": self.kv_token * self.n_full * (start + T),
            "kv_write": self.kv_token * (self.n_full * T + mtp * T),
            "gdn_state": self._gdn_bytes(1),
        }
        moved = dict(must, weights=mtp * self._mtp_fill_weights(compiled=True),
                     activations=self._activation_bytes(T, mtp * T, chunk=True))
        flops = 2 * mtp * T * self._mtp_fill_params() + self.n_full * self._attn_flops(ctx) \
            + self._gdn_flops(T)
        return moved, must, flops

    def _tail_params(self) -> float:
        """The last decoder layer's output projection and MLP (multiply-adds per token):
        what a pass whose final hidden state nothing reads never runs."""
        c, l = self.cfg, self.local
        out = (l.num_attention_heads * c.head_dim if c.layer_types[-1] == FULL
               else l.linear_num_value_heads * c.linear_value_head_dim)
        return (out + 3 * l.intermediate_size) * c.hidden_size

    def _mtp_fill_weights(self, compiled: bool = False) -> float:
        """The MTP weights a KV fill (model.mtp_fill_kv) reads (bf16 head): fc and the KV
        projection (the floor); compiled, XLA does not narrow the layer's fused q/gate/k/v
        GEMM to its k / v columns (the deviceless audit reads all of it)."""
        return self.act * self._mtp_fill_params(compiled)

    def _mtp_fill_params(self, compiled: bool = True) -> float:
        c, l = self.cfg, self.local
        heads = 2 * l.num_key_value_heads + (2 * l.num_attention_heads if compiled else 0)
        return 2 * c.hidden_size * c.hidden_size + heads * c.head_dim * c.hidden_size

    def prefill_roofline(self, N: int) -> float:
        """Seconds the prefill of an N-token prompt needs at least on this hardware: max(the
        FLOPs of one target forward over the N tokens (every linear, the lm_head for one row:
        the first token's; causal attention over the prompt; the GDN recurrence) / achievable
        bf16 throughput, every target weight read once / achievable HBM bandwidth). No MTP,
        no activations, no launches: what a time to first token is compared with."""
        N = int(N)
        if N < 1:
            raise ValueError(f"a prompt has >= 1 tokens, got {N}")
        head = self._linear_params("lm_head")
        flops = 2 * N * (self._linear_params("target") - head) + 2 * head \
            + self.n_full * self._attn_flops(N * (N + 1) / 2) + self._gdn_flops(N)
        return max(flops / self.hw.bf16_flops_per_s, self.w["target"] / self.hw.hbm_bytes_per_s)

    def draft(self, lanes: int, contexts: Sequence[int]) -> Cost:
        """One chained MTP draft step (MTP layer + lm_head argmax, over the draft vocabulary's
        rows with one) over `lanes` slots."""
        B = int(lanes)
        _check_lanes(B, contexts)
        ctx = float(sum(contexts)) + len(contexts)
        w = self.w
        must = {"weights": w["mtp"], "lm_head_extra": w["draft"],
                "kv_read": self.kv_token * ctx, "kv_write": self.kv_token * len(contexts)}
        moved = dict(must, activations=self._activation_bytes(0, B),
                     logits=self._logits_bytes(0, B), split_k=self._split_k_bytes(0, [B]))
        flops = 2 * B * (self._linear_params("mtp") + self._linear_params("draft")) \
            + self._attn_flops(ctx)
        return self._finish(moved, must, flops, self._kernels(("draft", B)))

    def move_lane(self) -> Cost:
        """steps.move_lane: one lane's GDN slot (state, conv, pending) read and written (the
        floor). The compiled program moves it twice: each array's slice is copied out into a
        temporary by one kernel, then written into the destination slot by another (the
        deviceless audit shows two kernels per array)."""
        must = {"gdn_state": self._gdn_bytes(1)}
        return self._finish({"gdn_state": 2 * self._gdn_bytes(1)}, must, 0.0,
                            self._kernels(("move_lane",)))

    def snapshot_save(self) -> Cost:
        """snapshots.save: a lane's recurrent state and conv tail copied into a slot."""
        b = {"gdn_state": 2 * self.n_gdn * (self.gdn_state_layer + self._conv_tail())}
        return self._finish(b, b, 0.0, self._kernels(("snapshot",)))

    def snapshot_restore(self) -> Cost:
        """snapshots.restore: a slot copied into a lane's recurrent state and conv tail; with
        K > 0 also one KV page copied in every KV layer and the MTP's (the copy on write,
        an identity copy when the hit needs no MTP KV rewrite; one kernel reads the page and
        writes it, pallas_kernels/page_copy.py; the rewrite's MTP weights, read only then,
        are left out)."""
        b = {"gdn_state": 2 * self.n_gdn * (self.gdn_state_layer + self._conv_tail())}
        moved = dict(b, kv_write=2 * self.kv_token * self.page_size * (self.n_full + 1)
                     if self.K > 0 else 0.0)
        return self._finish(moved, b, 0.0, self._kernels(("snapshot_restore",)))

    def _conv_tail(self) -> float:
        c = self.cfg
        conv = self.local.conv_dim if self.tp == 1 else _local_conv_dim(c, self.tp)
        return (c.linear_conv_kernel_dim - 1) * conv * self.act

    def program(self, key: tuple, contexts: Sequence[int] = (), start: int = 0,
                is_last: bool = True) -> Cost:
        """Dispatch on the engine's program keys (Engine.warmup_plan): ("decode", d, B),
        ("mixed", d, B, T) (contexts: the decode lanes'; start: the riding chunk's),
        ("prefill", T) (start: the chunk's; is_last: no effect, see `prefill`), packed
        prefill's ("mixed", d, B, T, rows) and ("prefill", T, rows) (start: each chunk's),
        ("move_lane",), ("snapshot",), ("snapshot_restore",), ("draft", B)."""
        kind = key[0] if key else None
        if kind == "decode":
            return self.decode(key[1], key[2], contexts)
        if kind == "mixed":
            return self.mixed(key[1], key[2], key[3], contexts, start, *key[4:])
        if kind == "prefill":
            return self.prefill(key[1], start, is_last, *key[2:])
        if kind == "draft":
            return self.draft(key[1], contexts)
        if key == ("move_lane",):
            return self.move_lane()
        if key == ("snapshot",):
            return self.snapshot_save()
        if key == ("snapshot_restore",):
            return self.snapshot_restore()
        raise ValueError(f"unknown program key {key!r}")

    # ------------------------------------------------------------------ kernels
    def _kernels(self, key: tuple) -> int:
        """Kernel launches in the compiled program: the deviceless compile's count
        (mtpjax/h200_kernel_counts.py, the 27B at this weights / K / page size, tp = 1); a
        prefill chunk bucket or lane bucket missing there takes the nearest one compiled
        (the count does not follow T, and barely B); otherwise `_kernels_fallback`."""
        packed = len(key) == (5 if key[0] == "mixed" else 3 if key[0] == "prefill" else 0)
        if packed and key not in (self._table or {}):
            return self._kernels(key[:-1]) + PACKED_GDN_KERNELS * self.n_gdn
        table = self._table
        if table is None:
            return self._kernels_fallback(key)
        if key in table:
            return table[key]
        if key[0] == "mixed":
            return self._mixed_kernels(key, table)
        near = [k for k in table if k[:-1] == key[:-1] and len(k) == len(key) > 1]
        if near:
            return table[min(near, key=lambda k: (abs(math.log2(k[-1] / key[-1])), k[-1]))]
        return self._kernels_fallback(key)

    def _mixed_kernels(self, key: tuple, table: dict) -> int:
        """("mixed", d, B, T) missing from the table: the compiled (d, B) at the nearest chunk
        (the count barely follows T); else the (d, B) decode step's count plus what a chunk
        added to the compiled mixed key nearest in (depth, lanes, chunk) (its count minus its
        decode step's); else `_kernels_fallback`."""
        _, d, B, T = key
        dist = lambda k: (abs(math.log2(k[3] / T)), k[3])
        same = [k for k in table if k[:3] == key[:3]]
        if same:
            return table[min(same, key=dist)]
        paired = [k for k in table if k[0] == "mixed" and ("decode",) + k[1:3] in table]
        if not paired:
            return self._kernels_fallback(key)
        m = min(paired, key=lambda k: (abs(k[1] - d), abs(math.log2(k[2] / B)), dist(k), k))
        return self._kernels(("decode", d, B)) + table[m] - table[("decode",) + m[1:3]]

    def _kernels_fallback(self, key: tuple) -> int:
        """An estimate from the layer structure, for configs and keys the table lacks:
        per decoder layer and per MTP pass as the 27B's table shows them at one lane (decode
        depth 0: ~26 kernels a layer; each MTP pass ~30 more; prefill ~20 a layer; a decode
        step carrying a chunk: the step's plus the chunk's mixers, ~MIXED_CHUNK_KERNELS a
        layer, and its MTP KV fill; move_lane two per GDN array, a snapshot one)."""
        L = self.cfg.num_layers
        if key[0] == "decode":
            return 26 * L + 30 * key[1] + 10
        if key[0] == "mixed":
            return self._kernels_fallback(("decode",) + key[1:3]) + MIXED_CHUNK_KERNELS * L \
                + MIXED_FILL_KERNELS * (self.K > 0)
        if key[0] == "prefill":
            return 20 * L + 10 * (self.K > 0) + 10
        if key[0] == "draft":
            return 30
        if key[0] == "move_lane":
            return 12 * self.n_gdn + 8
        return 2 * self.n_gdn + 1


def _kernel_table(weights: str, K: int, page_size: int) -> dict | None:
    try:
        from mtpjax.h200_kernel_counts import COUNTS
    except ImportError:
        return None
    return COUNTS.get((weights, K, page_size))


def _check_lanes(B: int, contexts: Sequence[int]) -> None:
    if B < 1 or len(contexts) > B:
        raise ValueError(f"{len(contexts)} busy lanes in a bucket of {B}")
    if any(c < 0 for c in contexts):
        raise ValueError(f"contexts must be >= 0 tokens, got {list(contexts)}")


def _local_conv_dim(cfg: Config, tp: int) -> int:
    """One shard's conv channels: its q/k heads (replicated when tp exceeds them) + v heads."""
    nk = max(1, cfg.linear_num_key_heads // tp)
    nv = cfg.linear_num_value_heads // tp
    return 2 * nk * cfg.linear_key_head_dim + nv * cfg.linear_value_head_dim


class VirtualClock:
    """The H200 clock an engine run advances: every launched program adds its modelled
    seconds (device; `launch` prices the engine's key with CostModel.program: a "mixed" key
    at its decode lanes' contexts and its chunk's start), the caller adds measured host
    seconds. Each launch is also priced at the fast and slow constants (device_range; see
    H200_FAST): `now` and everything the engine and its depth policy read are mid.
    context_offset: price a longer context than the engine runs (the tiny checkpoint's
    prompts are short): every lane's context and every chunk's start move up by that many
    tokens, and a request's first chunk (start 0) also pays the prefill of those tokens."""

    def __init__(self, model: CostModel, fast: Hardware = H200_FAST,
                 slow: Hardware = H200_SLOW, context_offset: int = 0,
                 offset_chunk: int = 2048):
        if context_offset < 0 or offset_chunk < 1:
            raise ValueError(f"context_offset must be >= 0 and offset_chunk >= 1, got "
                             f"{context_offset}, {offset_chunk}")
        self.model = model
        # a long context priced, not run: every lane's context is context_offset tokens
        # longer than the engine's (those tokens stand before its prompt), and a request's
        # first chunk also pays their prefill (offset_chunk-token chunks)
        self.context_offset = int(context_offset)
        self._offset_prefill = [model.prefill(min(offset_chunk, context_offset - s), s)
                                for s in range(0, context_offset, offset_chunk)]
        self.offset_prefill_s = 0.0      # of device_s: those prefills (mid constants)
        self.device_s = 0.0
        self.host_s = 0.0
        # two timelines: the host's (`now`) and the modelled device's (busy until
        # device_free). A launch queues its program behind the device's work; the host waits
        # only where it reads outputs (`wait`), so host work done while the device runs an
        # earlier launch is hidden, and only where it is shorter than that work
        self._host_t = 0.0
        self.device_free = 0.0
        self.launches: collections.Counter = collections.Counter()
        # the range: each launch priced once more at the fast and slow constants (the mid
        # set is the model's own hardware, so device_range["mid"] == device_s)
        # (a stand-in model without hardware, as tests use, gets a range of its one price)
        hw = getattr(model, "hw", None)
        self.range_hw = {} if hw is None else {"fast": fast, "mid": hw, "slow": slow}
        self.device_range = {n: 0.0 for n in H200_RANGE_NAMES}

    @property
    def now(self) -> float:
        """The host's time: its work plus its waits for the device."""
        return self._host_t

    @property
    def hidden_s(self) -> float:
        """Host seconds that ran while the device was busy (the overlapped loop)."""
        return max(self.host_s - self.idle_s, 0.0)

    @property
    def idle_s(self) -> float:
        """Seconds the device waited for the host, up to `now` (its queue drained)."""
        return max(self._host_t, self.device_free) - self.device_s

    def wait(self, until: float | None = None) -> None:
        """The host waits for the device: until it finishes the work queued by `until`
        (device_free at that launch; None: everything queued)."""
        self._host_t = max(self._host_t, self.device_free if until is None else until)

    def launch(self, key: tuple, contexts: Sequence[int] = (), start: int | Sequence[int] = 0,
               is_last: bool = True, wait: bool = True) -> float:
        """Price one program and queue it on the device; wait: the host waits for it (the
        serial loop). Returns its modelled seconds (mid constants)."""
        off, costs = self.context_offset, []
        if off and key[0] in ("decode", "mixed", "draft", "prefill"):
            contexts = [c + off for c in contexts]
            if key[0] in ("prefill", "mixed"):     # each chunk that starts a sequence pays
                starts = start if isinstance(start, (tuple, list)) else (start,)
                costs = self._offset_prefill * sum(x == 0 for x in starts)
                self.offset_prefill_s += sum(c.seconds for c in costs)
                start = tuple(x + off for x in starts)
        costs.append(self.model.program(key, contexts, start, is_last))
        s = sum(c.seconds for c in costs)
        self.device_s += s
        self.device_free = max(self.device_free, self._host_t) + s
        if wait:
            self._host_t = self.device_free
        for n in self.device_range:
            hw = self.range_hw.get(n)
            self.device_range[n] += s if n == "mid" or hw is None else sum(price(c, hw)
                                                                           for c in costs)
        self.launches[key[0]] += 1
        return s

    def add_host(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"host seconds must be >= 0, got {seconds}")
        self.host_s += float(seconds)
        self._host_t += float(seconds)

    def report(self) -> dict:
        m, hw = self.model, self.model.hw
        return {
            "device_s": self.device_s, "host_s": self.host_s, "now": self.now,
            "idle_s": self.idle_s, "hidden_s": self.hidden_s,
            "launches": dict(self.launches),
            "device_range_s": dict(self.device_range),
            "range_hardware": {n: {f.name: getattr(h, f.name) for f in dataclasses.fields(h)
                                   if f.name != "sources"} | {"sources": dict(h.sources)}
                               for n, h in self.range_hw.items() if n != "mid"},
            "hardware": {f.name: getattr(hw, f.name) for f in dataclasses.fields(hw)
                         if f.name != "sources"} | {"sources": dict(hw.sources)},
            "context_offset": self.context_offset,
            "model": {"weights": m.weights, "tp": m.tp, "K": m.K, "page_size": m.page_size,
                      "layers": m.cfg.num_layers, "hidden_size": m.cfg.hidden_size},
        }
