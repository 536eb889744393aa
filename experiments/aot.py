"""`python -m experiments aot [--target=h200] [--lanes=1] [--max_seq_len=1024] [--num_speculative_tokens=3]`.

Compiles the real Qwen3.5-27B step programs for an H200 on this CPU-only machine ("deviceless
AOT": a compile-only topology device from XLA's published H200 target description,
`experiments/data/h200_target_config.txtpb`) and audits what they move. No GPU, no weights:
every argument is a `jax.ShapeDtypeStruct` carrying a `SingleDeviceSharding` of that device.

Programs (experiments/aot_programs.build_programs): decode_k{d} for each depth d of `--depths`
(steps.decode_step verifying d drafts; default 0 and K), mixed_k{d}_t{T} for each depth of
`--mixed_depths` (the same step carrying a prefill chunk of T = --prefill_chunk tokens: one
iteration with a prefill in flight, whose weights must be read once; default the decode
depths), prefill_t{T} (steps.prefill_chunk: a chunk alone, no sampling), draft (one chained
MTP step), move_lane, snapshot_save, snapshot_restore. `--draft_vocab=N` gives the params an
N-row draft head (mtpjax/draft_vocab.py): every draft's argmax reads it instead of the lm_head
(default -1: the engine's default, 65,536 rows for the 27B; 0: the whole vocabulary); aot.json
records "draft_vocab" and the draft program's bytes.

For each it writes `<out_dir>/<program>.hlo.txt` (optimized HLO after the whole XLA GPU
pipeline) and, in `<out_dir>/aot.json`:
  lower_s, compile_s; memory (memory_analysis: argument, output, alias, temp bytes);
  donation (donated entry parameters, how many XLA aliased to an output, which not);
  audit (experiments.hlo_audit: bytes moved by copies and data-only fusions on buffers >= 1 MB
    with loop trip counts applied, by kind weight / cache / other, the top offenders with op,
    shape, bytes per execution and trips, the while loops and input/output aliases);
  roofline: floor (weights + KV read for the context + GDN state read and write + lm_head once
    per extra draft), estimate (floor + data movement), ratio and predicted ms at 4.8 TB/s.
A compact table goes to stdout.

`--kernel_counts` compiles the program keys the engine launches (decode per depth and lane
bucket, prefill per chunk bucket, draft, lane move, snapshots, the decode step carrying a chunk
per `--kernel_mixed_depths` and `--kernel_mixed_chunks`; `--programs` picks some) and
merges their kernel launches and audited bytes into mtpjax/h200_kernel_counts.py (the cost
model's kernel counts and its 27B check), printing the cost model's bytes beside the audit's.

Needs the `aot` extra (`pip install -e ".[aot]"`: the CUDA 13
PJRT plugin and the compiler pieces it loads; no driver).

Needs about 1.2 GB of host memory and ~10-20 s per 27B program on 2 cores.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import sys

from absl import flags

from experiments import mesh_flags, thunks, weight_flags
from experiments.kernel_counts import write_kernel_counts

FLAGS = flags.FLAGS
mesh_flags.define()
weight_flags.define()    # no checkpoint here: auto = dense; fp8 = 128 x 128 block-scaled linears
flags.DEFINE_enum("target", "h200", ["h200", "cpu"], "compile for an H200 (deviceless) or "
                  "the host CPU")
flags.DEFINE_enum("model", "27b", ["27b", "tiny"], "model shapes: Qwen3.5-27B or the bundled "
                  "checkpoints/tiny config (quick checks)")
flags.DEFINE_integer("lanes", 1, "engine lanes (batch of a decode step)")
flags.DEFINE_integer("max_seq_len", 1024, "context per lane (KV pool sized for every lane)")
flags.DEFINE_integer("num_speculative_tokens", 3, "K: the engine's draft slots")
flags.DEFINE_list("depths", [], "decode depths to compile (each in 0..K); default 0 and K")
flags.DEFINE_list("mixed_depths", [], "depths of the decode step carrying a prefill chunk of "
                  "--prefill_chunk tokens (mixed_k{d}_t{T}) to compile; default the decode "
                  "depths; 'none' for none")
flags.DEFINE_list("acceptance", ["0.92", "0.84", "0.65", "0.54"],
                  "with every depth 0..K compiled: share of verify steps accepting draft j "
                  "(j = 1..K), to predict the adaptive engine's depth from the audit's step "
                  "times (default: reported for a quantized Qwen3.6-27B; an assumption)")
flags.DEFINE_enum("kernels", "auto", ["auto", "pallas", "reference", "interpret"],
                  "kernels; auto = pallas for h200, reference for cpu")
flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32"], "weights / KV dtype")
flags.DEFINE_integer("page_size", 16, "KV page size in tokens")
flags.DEFINE_integer("prefill_chunk", 64, "tokens of the prefill program's chunk")
flags.DEFINE_integer("packed_rows", 1, "packed prefill: R > 1 adds mixed_k{d}_t{T}x{R} and "
                     "prefill_t{T}x{R} (R lanes' chunks in one program, Engine prefill_rows)")
flags.DEFINE_integer("draft_vocab", -1, "draft vocabulary size N (mtpjax/draft_vocab.py): the "
                     "programs draft over an N-row draft head instead of the lm_head (0: the "
                     "whole vocabulary; -1: the engine's default, draft_vocab.default_size: "
                     "65,536 rows for the 27B, the whole vocabulary for the tiny)")
flags.DEFINE_list("programs", [], "compile only these (names as in the table); default all")
flags.DEFINE_integer("min_mb", 1, "smallest data movement counted, MB written per execution")
flags.DEFINE_float("hbm_gbps", 4800.0, "HBM bandwidth for the predicted time (H200: 4800)")
flags.DEFINE_string("out_dir", "runs/aot", "where the HLO files and aot.json go")
flags.DEFINE_bool("kernel_counts", False, "compile every program key the engine launches "
                  "(decode at each depth 0..K and --kernel_lanes, prefill at --kernel_prefill, "
                  "draft, move_lane, snapshot save / restore; --programs picks some) and merge "
                  "each one's kernel launches and audited HBM bytes into --kernel_counts_out "
                  "(the cost model's table and its 27B check), the command appended to its "
                  "COMMANDS")
flags.DEFINE_list("kernel_lanes", ["1", "8", "32"], "--kernel_counts: decode / draft lane "
                  "buckets")
flags.DEFINE_list("kernel_prefill", ["16", "64", "512", "2048"], "--kernel_counts: prefill "
                  "chunk buckets")
flags.DEFINE_list("kernel_wide_depths", [], "--kernel_counts: decode depths compiled at the "
                  "lane buckets after the first (default: every depth 0..K)")
flags.DEFINE_list("kernel_mixed_depths", [], "--kernel_counts: depths of the decode step "
                  "carrying a chunk (\"mixed\" keys), at every --kernel_lanes bucket and "
                  "--kernel_mixed_chunks chunk (default none)")
flags.DEFINE_list("kernel_mixed_chunks", ["64"], "--kernel_counts: the riding chunk's length "
                  "for the mixed keys (the engine's prefill_chunk)")
flags.DEFINE_string("kernel_counts_out", "mtpjax/h200_kernel_counts.py", "--kernel_counts: "
                    "the table merged into (other entries and program keys kept)")
flags.DEFINE_bool("thunks", False, "dump XLA's thunk sequence of each program (into "
                  "<out_dir>/xla_dump) and report the kernels it launches inside command "
                  "buffers (CUDA graphs) and outside them (experiments/thunks.py)")

GB = 1e9


def _table(rows: list[dict]) -> str:
    head = (f"{'program':<14} {'compile_s':>9} {'moved_GB':>8} {'weight':>7} {'cache':>7} "
            f"{'other':>7} {'floor_GB':>8} {'est_GB':>7} {'ratio':>6} {'floor_ms':>8} "
            f"{'pred_ms':>7} {'temp_GB':>7} {'aliased':>8}")
    lines = [head, "-" * len(head)]
    for r in rows:
        a, roof, d = r["audit"], r["roofline"], r["donation"]
        k = a["data_movement_by_kind"]
        temp = r["memory"]["temp"] / GB if r["memory"] else float("nan")
        lines.append(
            f"{r['program']:<14} {r['compile_s']:>9.1f} {a['data_movement_bytes'] / GB:>8.2f} "
            f"{k['weight'] / GB:>7.2f} {k['cache'] / GB:>7.2f} {k['other'] / GB:>7.2f} "
            f"{roof['floor_bytes'] / GB:>8.2f} {roof['estimate_bytes'] / GB:>7.2f} "
            f"{roof['ratio']:>6.2f} {roof['floor_ms']:>8.2f} {roof['predicted_ms']:>7.2f} "
            f"{temp:>7.2f} {d['aliased']:>3}/{d['donated']:<4}")
    return "\n".join(lines)


def main(argv):
    del argv
    os.environ.setdefault("JAX_PLATFORMS", "cpu")   # a deviceless compile needs no GPU runtime
    dump_dir = os.path.join(FLAGS.out_dir, "xla_dump")
    if FLAGS.thunks:                 # before jax starts its backend, which reads XLA_FLAGS
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={dump_dir}"
                                   " --xla_dump_hlo_as_text").strip()
    import jax

    from experiments import aot_programs
    from mtpjax.config import Config, qwen3_5_27b

    cfg = qwen3_5_27b() if FLAGS.model == "27b" else Config.from_pretrained("checkpoints/tiny")
    from mtpjax.draft_vocab import default_size
    draft_vocab = (default_size(cfg.vocab_size) if FLAGS.draft_vocab < 0
                   else FLAGS.draft_vocab or None)
    if FLAGS.num_speculative_tokens == 0:
        draft_vocab = None
    kernels = FLAGS.kernels
    if kernels == "auto":
        kernels = "pallas" if FLAGS.target == "h200" else "reference"
    from mtpjax import tensor_parallel
    tensor_parallel.check_tp(cfg, FLAGS.tp)
    mesh = aot_programs.target_mesh(FLAGS.target, FLAGS.tp)
    weights = "fp8" if FLAGS.weights == "fp8" else "dense"
    mtp_weights = "fp8" if FLAGS.mtp_weights == "fp8" else "dense"
    if FLAGS.kernel_counts:
        if FLAGS.tp != 1 or FLAGS.model != "27b" or FLAGS.target != "h200":
            sys.exit("--kernel_counts is for the 27B on one H200 (tp = 1)")
        progs = aot_programs.kernel_count_programs(
            cfg, K=FLAGS.num_speculative_tokens, lanes=[int(b) for b in FLAGS.kernel_lanes],
            prefill_chunks=[int(t) for t in FLAGS.kernel_prefill],
            max_seq_len=FLAGS.max_seq_len, page_size=FLAGS.page_size, weights=weights,
            kernels=kernels, wide_depths=[int(d) for d in FLAGS.kernel_wide_depths] or None,
            mixed_depths=[int(d) for d in FLAGS.kernel_mixed_depths],
            mixed_chunks=[int(t) for t in FLAGS.kernel_mixed_chunks])
    else:
        progs = aot_programs.build_programs(
            cfg, lanes=FLAGS.lanes, max_seq_len=FLAGS.max_seq_len,
            K=FLAGS.num_speculative_tokens, kernels=kernels, dtype=FLAGS.dtype,
            page_size=FLAGS.page_size, prefill_chunk=FLAGS.prefill_chunk, mesh=mesh,
            weights=weights, mtp_weights=mtp_weights,
            depths=[int(d) for d in FLAGS.depths] or None,
            mixed_depths=_mixed_depths(FLAGS.mixed_depths, FLAGS.depths,
                                       FLAGS.num_speculative_tokens),
            draft_vocab=draft_vocab, packed_rows=FLAGS.packed_rows)
    if FLAGS.programs:
        unknown = set(FLAGS.programs) - {p.name for p in progs}
        if unknown:
            sys.exit(f"unknown programs {sorted(unknown)}; have {[p.name for p in progs]}")
        progs = [p for p in progs if p.name in FLAGS.programs]
    device = aot_programs.target_device(FLAGS.target)
    os.makedirs(FLAGS.out_dir, exist_ok=True)
    doc = {
        "command": "python -m experiments aot " + shlex.join(
            sys.argv[2:] if sys.argv[1:2] == ["aot"] else sys.argv[1:]),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "jax": jax.__version__, "python": platform.python_version(),
        "target": FLAGS.target, "device": str(device), "model": FLAGS.model,
        "lanes": FLAGS.lanes, "max_seq_len": FLAGS.max_seq_len,
        "num_speculative_tokens": FLAGS.num_speculative_tokens, "kernels": kernels,
        "dtype": FLAGS.dtype, "weights": weights, "mtp_weights": mtp_weights,
        "page_size": FLAGS.page_size,
        "prefill_chunk": FLAGS.prefill_chunk, "min_bytes": FLAGS.min_mb * 1_000_000,
        "draft_vocab": draft_vocab or cfg.vocab_size,
        "hbm_bytes_per_s": FLAGS.hbm_gbps * GB, "tp": FLAGS.tp, "dp": FLAGS.dp,
        "devices": FLAGS.tp * FLAGS.dp,
        "memory_per_device": tensor_parallel.memory_per_device(
            cfg, FLAGS.tp, FLAGS.dtype, lanes=FLAGS.lanes, max_seq_len=FLAGS.max_seq_len,
            page_size=FLAGS.page_size, K=FLAGS.num_speculative_tokens, weights=weights,
            mtp_weights=mtp_weights),
        "programs": {},
    }
    rows = []
    if FLAGS.thunks:
        # only what XLA_FLAGS sets differs from XLA's defaults (the dump's debug_options
        # lists the non-default ones): name the command-buffer settings given, if any
        doc["command_buffer_flags"] = [
            f for f in os.environ.get("XLA_FLAGS", "").split()
            if "command_buffer" in f or "graph" in f] or "XLA defaults (none set)"
    for p in progs:
        print(f"compiling {p.name} ...", flush=True)
        seen = set(thunks.dumps(dump_dir)) if FLAGS.thunks else set()
        r = aot_programs.compile_program(p, device, min_bytes=FLAGS.min_mb * 1_000_000,
                                         bytes_per_s=FLAGS.hbm_gbps * GB)
        if FLAGS.thunks:
            r["thunks"] = thunks.read_new(dump_dir, seen)
        with open(os.path.join(FLAGS.out_dir, f"{p.name}.hlo.txt"), "w") as f:
            f.write(r.pop("hlo"))
        doc["programs"][p.name] = r
        rows.append(r)
        with open(os.path.join(FLAGS.out_dir, "aot.json"), "w") as f:   # partial results too
            json.dump(doc, f, indent=1)
    per = " per device" if FLAGS.tp > 1 else ""
    wdesc = FLAGS.dtype if weights == "dense" else f"fp8 (mtp {mtp_weights})"
    print(f"\n{FLAGS.model} {wdesc} {kernels} on {FLAGS.target}: lanes={FLAGS.lanes} "
          f"max_seq_len={FLAGS.max_seq_len} K={FLAGS.num_speculative_tokens} tp={FLAGS.tp} "
          f"dp={FLAGS.dp} (GB = 1e9 bytes{per} per program run; dp replicas run the same "
          f"programs on their own devices)")
    print(_table(rows))
    if FLAGS.kernel_counts:        # before the pricing: the model reads this table
        path = write_kernel_counts(FLAGS.kernel_counts_out, rows, weights,
                                   FLAGS.num_speculative_tokens, FLAGS.page_size,
                                   doc["command"], FLAGS.max_seq_len)
        print(f"wrote {path}")
    model_rows = compare_model(rows, cfg, weights=weights, tp=FLAGS.tp,
                               K=FLAGS.num_speculative_tokens, page_size=FLAGS.page_size,
                               max_seq_len=FLAGS.max_seq_len, dtype=FLAGS.dtype,
                               mtp_weights=mtp_weights, draft_vocab=draft_vocab)
    if model_rows:
        doc["cost_model"] = model_rows
        print("\ntraffic (every kernel's HBM bytes, hlo_audit.traffic) vs the cost model "
              "(mtpjax/cost_model.py, its kernel counts from the table or the fallback):")
        print(_model_table(model_rows))
    if FLAGS.thunks:
        print(f"\nthunk sequence (XLA's, after its thunk passes; command-buffer flags: "
              f"{doc['command_buffer_flags']}): kernels launched inside command buffers "
              f"(CUDA graphs) and outside, all branches counted, loop bodies once")
        for r in rows:
            t = r["thunks"]
            print(f"  {r['program']:<18} " + ("no thunk dump" if t is None else
                  f"graphs {t['graphs']}, kernels in graphs {t['in_graphs']}, outside "
                  f"{t['outside']}, conditionals / loops {t['control']}"))
    for r in rows:
        if r["collectives"]:
            col = ", ".join(f"{op} x{c['count']} ({c['bytes'] / 1e6:.2f} MB)"
                            for op, c in r["collectives"].items())
            print(f"  {r['program']} collectives per device: {col}")
    for r in rows:
        wb = r["weight_bytes_by_role"]
        deq = r["dequantized_weight_buffers"]
        print(f"  {r['program']}: weights per target pass {wb['target'] / GB:.2f} GB, MTP head "
              f"{wb['mtp'] / GB:.2f} GB; weight-sized float buffers (dequantized copies): "
              f"{len(deq)}" + (f" e.g. {deq[0]['shape']} {deq[0]['op']}" if deq else ""))
    m = doc["memory_per_device"]
    print(f"  memory per device: weights {m['weights_bytes'] / GB:.2f} GB, GDN state "
          f"{m['gdn_state_bytes'] / GB:.3f} GB, KV {m['kv_bytes_per_token'] / 1e3:.1f} kB per "
          f"token ({m['kv_page_bytes'] / 1e6:.2f} MB per page); loader peak host "
          f"{m['loader_peak_host_bytes'] / GB:.2f} GB")
    for r in rows:
        top = r["audit"]["top_offenders"][:3]
        for t in top:
            print(f"  {r['program']}: {t['total_bytes'] / GB:7.2f} GB  {t['kind']:<13} "
                  f"{t['what']} {t['shape']} x{t['instructions']} x{t['trips']} trips  "
                  f"{(t['sources'] or [''])[0]}")
    choice = predict_depth(doc, FLAGS.num_speculative_tokens, FLAGS.lanes,
                           [float(a) for a in FLAGS.acceptance])
    if choice is not None:
        doc["adaptive_prediction"] = choice
        with open(os.path.join(FLAGS.out_dir, "aot.json"), "w") as f:
            json.dump(doc, f, indent=1)
        rates = ", ".join(f"d{d} {r:.0f}" for d, r in enumerate(choice["tokens_per_s"]))
        print(f"  adaptive depth at {FLAGS.lanes} lane(s), acceptance {FLAGS.acceptance}: "
              f"{choice['depth']} (tokens/s at the audit's step time: {rates})")
    print(f"wrote {FLAGS.out_dir}/aot.json and {len(rows)} .hlo.txt")


def _mixed_depths(given: list[str], depths: list[str], K: int) -> list[int]:
    """--mixed_depths: 'none' -> [], empty -> the decode depths (default 0 and K)."""
    if [d.strip().lower() for d in given] == ["none"]:
        return []
    return sorted({int(d) for d in given or depths} or {0, K})


def compare_model(rows: list[dict], cfg, *, weights: str, tp: int, K: int, page_size: int,
                  max_seq_len: int, dtype: str, mtp_weights: str,
                  draft_vocab: int | None = None) -> list[dict]:
    """Per program: the cost model's moved bytes (Cost.bytes) and floor (Cost.must_read) at
    the program's shapes (every lane at max_seq_len; a prefill chunk, alone or riding, at its
    start) against the traffic counted in its optimized HLO, and the weight bytes both read
    (audit: every kernel's reads of weight parameters; an iteration with a chunk riding must
    read them once). Empty where the model does not apply (float32, an FP8 MTP head)."""
    from mtpjax.cost_model import CostModel
    if dtype != "bfloat16" or mtp_weights != "dense":
        return []
    cm = CostModel(cfg, weights="fp8" if weights == "fp8" else "bf16", tp=tp, K=K,
                   page_size=page_size, draft_vocab=draft_vocab)
    out = []
    for r in rows:
        key = tuple(r["key"])
        if not key:
            continue
        lanes = key[2] if key[0] in ("decode", "mixed") else key[1] if key[0] == "draft" \
            else 1
        c = cm.program(key, [max_seq_len] * lanes, start=r["start"])
        audit = r["traffic"]["bytes"]
        out.append({"program": r["program"], "key": list(key), "model_bytes": c.total_bytes,
                    "must_read_bytes": c.must_read_bytes, "audit_bytes": audit,
                    "diff": c.total_bytes / audit - 1 if audit else None,
                    "model_weight_bytes": c.bytes.get("weights", 0.0),
                    "audit_weight_bytes": r["traffic"]["by_kind"]["read_weight"],
                    "model_kernels": c.kernels, "audit_kernels": r["traffic"]["kernels"],
                    "model_s": c.seconds, "model_terms": dict(c.bytes)})
    return out


def _model_table(rows: list[dict]) -> str:
    head = (f"{'program':<18} {'model_GB':>9} {'audit_GB':>9} {'diff':>7} {'must_GB':>8} "
            f"{'wts_GB':>7} {'audit_wts':>9} {'kernels':>7} {'model_ms':>8}")
    lines = [head, "-" * len(head)]
    for r in rows:
        diff = "-" if r["diff"] is None else f"{r['diff']:+.2%}"
        lines.append(f"{r['program']:<18} {r['model_bytes'] / GB:>9.3f} "
                     f"{r['audit_bytes'] / GB:>9.3f} {diff:>7} "
                     f"{r['must_read_bytes'] / GB:>8.3f} {r['model_weight_bytes'] / GB:>7.3f} "
                     f"{r['audit_weight_bytes'] / GB:>9.3f} {r['audit_kernels']:>7} "
                     f"{r['model_s'] * 1e3:>8.3f}")
    return "\n".join(lines)


def predict_depth(doc: dict, K: int, lanes: int, acceptance: list[float]) -> dict | None:
    """The depth mtpjax.engine.depth.AdaptiveDepth would settle on if the device ran each depth's
    step in the audit's predicted time (floor + data movement at --hbm_gbps) and drafts were
    accepted at the given rates; None unless decode_k0..decode_kK were all compiled."""
    from mtpjax.engine.depth import predict
    progs = doc["programs"]
    if K < 1 or any(f"decode_k{d}" not in progs for d in range(K + 1)):
        return None
    ms = [progs[f"decode_k{d}"]["roofline"]["predicted_ms"] for d in range(K + 1)]
    depth, rates = predict([m / 1e3 for m in ms], acceptance, lanes)
    return {"depth": depth, "step_ms": ms, "tokens_per_s": rates, "acceptance": acceptance}
