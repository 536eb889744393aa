"""The judge's card: card.json (reference keys + extras), card.md and plots; and the clock
every timing sub-command (judge, bench, serve_bench, speed) reports on (`--clock`)."""

from __future__ import annotations

import json
import os

# --clock: "wall" = this machine's perf_counter; "h200" = the engines run here (real tokens,
# real acceptance) and each advances its own cost_model.VirtualClock by the modelled price of
# every program it launches, plus the host time measured here (mtpjax/engine/runner.py).
CLOCKS = ("wall", "h200")
CLOCK_HELP = ("wall: time as measured on this machine; h200: each engine runs here (real "
              "tokens and acceptance) and times itself on a cost_model.VirtualClock: every "
              "program it launches costs what mtpjax/cost_model.py predicts for Qwen3.5-27B on "
              "an H200 at its real shapes, plus the host time measured here")


CALIBRATION_HELP = ("--clock=h200: read the clock's constants (HBM bandwidth, cost of a "
                    "kernel, cost of a program) from this calibration file, written by "
                    "`python -m experiments gpu_check` on a lent GPU (--calibration_out), "
                    "instead of the published figures and assumptions in "
                    "mtpjax/cost_model.py; the range is built around the measured point")


def define_clock_flag() -> None:
    """--clock and --clock_calibration for the sub-command being imported (judge, bench,
    speed, serve_bench); a repeated call is a no-op, as several of them share a process in
    tests."""
    from absl import flags
    if "clock" not in flags.FLAGS:
        flags.DEFINE_enum("clock", "wall", list(CLOCKS), CLOCK_HELP)
    if "clock_calibration" not in flags.FLAGS:
        flags.DEFINE_string("clock_calibration", None, CALIBRATION_HELP)


def check_clock_flags(clock: str, calibration: str | None) -> None:
    """Bad --clock / --clock_calibration fail before anything loads: an unknown clock, a
    calibration without --clock=h200, a calibration file that is missing or malformed
    (cost_model.CalibrationError, naming the key)."""
    if clock not in CLOCKS:
        raise ValueError(f"--clock must be one of {CLOCKS}, got {clock!r}")
    if calibration:
        if clock != "h200":
            raise ValueError("--clock_calibration sets the H200 clock's constants: run with "
                             "--clock=h200")
        from mtpjax.cost_model import load_calibration
        load_calibration(calibration)


SIMULATE_HELP = ("simulated acceptance for planning, timing only: each verify step accepts as "
                 "many drafts as a seeded draw from this profile (a name in "
                 "mtpjax/simulated_acceptance.py PROFILES, e.g. qwen3.5-27b-nothink, or a JSON "
                 "file); the tokens are then not the model's, and the judge's lossless gate "
                 "reports 'not applicable'")


def define_simulate_flag() -> None:
    """--simulate_acceptance for the timing sub-commands (judge, bench, speed, serve_bench);
    a repeated call is a no-op."""
    from absl import flags
    if "simulate_acceptance" not in flags.FLAGS:
        flags.DEFINE_string("simulate_acceptance", None, SIMULATE_HELP)


def simulator(spec: str | None, seed: int = 0):
    """A simulated_acceptance.Simulator for the flag's value, or None (the flag unset); bad
    names fail here, before anything loads."""
    if not spec:
        return None
    from mtpjax import simulated_acceptance
    return simulated_acceptance.Simulator(spec, seed)


def predicted_words(tp: int = 1, calibration: str | None = None,
                    hardware: dict | None = None) -> str:
    """The line every h200-clock report carries, with where the clock's constants come from
    (constants_words)."""
    where = "one H200" if tp == 1 else f"{tp} H200s (tensor parallel)"
    return (f"predicted for Qwen3.5-27B on {where} by the cost model, not timed "
            f"(mtpjax/cost_model.py; {constants_words(calibration, hardware)})")


def constants_words(calibration: str | None = None, hardware: dict | None = None) -> str:
    """Where the clock's mid constants come from, with their values: the published figures
    and assumptions, or "calibrated from PATH: device, date". From a calibration path, or
    from a clock report's "hardware" (a card)."""
    if hardware is None:
        from mtpjax.cost_model import clock_constants
        hw = clock_constants(calibration).mid
        hardware = {"hbm_bytes_per_s": hw.hbm_bytes_per_s, "launch_s": hw.launch_s,
                    "program_s": hw.program_s, "origin": hw.origin}
    return (f"constants {hardware['hbm_bytes_per_s'] / 1e12:.3g} TB/s, "
            f"{hardware['launch_s'] * 1e6:.3g} us a kernel, "
            f"{hardware['program_s'] * 1e6:.3g} us a program: "
            f"{hardware.get('origin') or 'published figures and assumptions'}")


def make_clock(clock: str, k: int, *, weights: str = "bf16", tp: int = 1, page_size: int = 16,
               draft_vocab: int | None = None, context_offset: int = 0,
               calibration: str | None = None):
    """None for "wall"; for "h200" a fresh VirtualClock over CostModel(weights, tp, K = k, the
    engine's page size, the 27B's draft vocabulary rows): one per engine, since each engine's
    time is its own. calibration: a gpu_check calibration file whose constants replace the
    published ones (cost_model.load_calibration: its mid set prices, its fast / slow sets
    give the range); only with "h200"."""
    check_clock_flags(clock, None)
    if clock == "wall":
        if calibration:
            check_clock_flags(clock, calibration)      # raises: needs --clock=h200
        return None
    from mtpjax.cost_model import CostModel, VirtualClock, clock_constants
    sets = clock_constants(calibration)
    return VirtualClock(CostModel(weights=weights, tp=tp, K=k, page_size=page_size,
                                  draft_vocab=draft_vocab if k > 0 else None, hw=sets.mid),
                        fast=sets.fast, slow=sets.slow, context_offset=context_offset)


def clock_weights(params) -> str:
    """The cost model's weights for the params an engine runs: "fp8" when its linears are FP8
    (the 27B would be too), else "bf16" (the 27B's dtype, whatever this machine computes in)."""
    from mtpjax import quant
    return "fp8" if quant.has_fp8(params) else "bf16"


def now(engine) -> float:
    """The engine's time in seconds: its clock's when it has one, else perf_counter."""
    import time
    clock = getattr(engine, "clock", None)
    return time.perf_counter() if clock is None else clock.now


def _fmt(x, nd=3):
    return "n/a" if x is None else (f"{x:.{nd}f}" if isinstance(x, float) else str(x))


def render_md(c: dict) -> str:
    L = c["limits"]
    ok = lambda b: "pass" if b else "FAIL"
    sim = c.get("simulated_acceptance")
    lines = ["# mtpjax judge card" + (" — simulated acceptance" if sim else ""), ""]
    if sim:
        lines += [f"**Simulated acceptance ({sim['profile']}: tokens per verify step "
                  f"{', '.join(f'{x:.2f}' for x in sim['tokens_per_verify_step'])} at k = 1.."
                  f"{len(sim['tokens_per_verify_step'])}; {sim['source']}).** Each verify step "
                  f"accepted a seeded draw from this profile, whatever the drafts: times and "
                  f"ratios are for planning; the tokens are not the model's, and the lossless "
                  f"gate is not applicable.", ""]
    st = c["settings"]
    h200 = c.get("clock") == "h200"
    if h200:
        hw = (c.get("h200") or {}).get("model", {}).get("hardware")
        lines += [f"**Times, tokens/s, ratios and SpecScore: "
                  f"{predicted_words(st.get('tp', 1), hardware=hw)}.** "
                  + clock_words(c), ""]
    lines.append(f"checkpoint `{st['checkpoint']}` · dtype {st['dtype']} · {_policy_words(st)} · kernels "
                 f"{st['kernels']} · device {st['device']} ({st['backend']}) · jax "
                 f"{st['versions']['jax']} · {st['passes']} passes · clock {c.get('clock', 'wall')} · "
                 f"judge ran {st['wall_s']:.0f} s here"
                 + (f" · FP8 weights (target {c['fp8']['target']}, MTP head "
                    f"{c['fp8']['mtp_head']})" if c.get("fp8") else ""))
    lines += ["", "| workload | lanes | requests | ratio (median) | passes | stock tok/s | candidate tok/s | TTFT ms (stock / candidate) | tokens/verify step | page use (mean) | page use while waiting (stock / candidate) |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for w, r in c["ratios"].items():
        t = c["throughput"][w]
        util = c["page_utilization"].get(w)
        pu = c.get("page_use", {}).get(w, {})
        tt = c.get("ttft_ms", {}).get(w, {})
        lines.append(f"| {w} | {st['lanes'][w]} | {st['requests'][w]} | **{r['ratio']:.3f}** | "
                     f"{', '.join(f'{x:.3f}' for x in r['passes'])} | "
                     f"{', '.join(f'{x:.1f}' for x in t['stock_tok_s'])} | "
                     f"{', '.join(f'{x:.1f}' for x in t['candidate_tok_s'])} | "
                     f"{_fmt(tt.get('stock'), 1)} / {_fmt(tt.get('candidate'), 1)} | "
                     f"{_fmt(c['acceptance'][w])} | {_fmt(util, 2)} | "
                     f"{_fmt(pu.get('stock'), 2)} / {_fmt(pu.get('candidate'), 2)} |")
    long = {w: n for w, n in (st.get("long_context") or {}).items() if n}
    if long:
        lines += ["", "Long-context workloads (" + ", ".join(f"{w}: {n:,} tokens" for w, n in
                                                       long.items())
                  + "): the engines run the checkpoint's own short prompts here; the H200 clock "
                  "prices every program as if each lane's context held that many more tokens "
                  "before its prompt, and each request's first chunk also pays their prefill "
                  "(2,048-token chunks); the depth policy keys its costs by that priced "
                  "context. Tokens and acceptance are the short prompts' (or the simulated "
                  "profile's), not a long prompt's. SpecScore is over solo, team and busy "
                  "only; these ratios are reported beside it.", ""]
    if h200:
        lines += [""] + render_host_md(c)
        rng = render_range_md(c)
        if rng:
            lines += [""] + rng
    gate_words = ("not applicable (simulated acceptance)" if sim else
                  f"{'PASS' if c['reason'] is None else 'FAIL (' + c['reason'] + ')'}")
    lines += ["", f"**SpecScore {c['specscore']:.3f}** (geometric mean of the workload ratios) · "
              + ("" if sim else f"score {c['score']:.3f} · ") + f"gate: {gate_words}", ""]
    before_gate = len(lines)
    lk, am, m = c["likelihood"], c["argmax"], c["memory"]
    proc = ("" if m.get("process_peak_mib") is None else
            f"; process-wide device peak, all engines: {m['process_peak_mib']:.1f} MiB")
    lines += ["| check | measured | limit | verdict |", "|---|---|---|---|"]
    if "busy_page_use" in c["checks"]:
        pu = c["page_use"]["busy"]
        lines.append(f"| busy_page_use (workload validity) | stock {_fmt(pu.get('stock'), 3)}, "
                     f"candidate {_fmt(pu.get('candidate'), 3)} of {pu.get('pages')} pages, "
                     f"while requests wait | >= {L['busy_page_use_floor']} | "
                     f"{ok(c['checks']['busy_page_use'])} |")
    lines += [f"| memory | candidate {m['peak_mib']:.1f} MiB vs stock {m['stock_peak_mib']:.1f} MiB ({m['how']}{proc}) | <= stock + {L['memory_slack_mib']:.0f} MiB | {ok(c['checks']['memory'])} |",
              f"| fidelity | {c['fidelity']:.2e} mean abs log-prob diff | <= {L['fidelity_ceiling']} | {ok(c['checks']['fidelity'])} |",
              f"| likelihood | gap {lk['gap']:+.4f} ± {1.96 * lk['se']:.4f} (cand {lk['candidate']:.4f}, stock {lk['stock']:.4f}) | ±{L['likelihood_bound']} | {ok(c['checks']['likelihood'])} |",
              f"| argmax | gap {am['gap']:+.4f} ± {1.96 * am['se']:.4f} (cand {am['candidate']:.4f}, stock {am['stock']:.4f}) | ±{L['argmax_bound']} | {ok(c['checks']['argmax'])} |",
              f"| greedy_agreement | {c['greedy_agreement']:.4f} | floor {_fmt(L['greedy_agreement_floor'])} | {ok(c['checks'].get('greedy_agreement', True))} |",
              f"| sampled_agreement | {c['sampled_agreement']:.4f} | reported | - |"]
    for w, v in c["lengths"].items():
        lines.append(f"| lengths/{w} | {v['ratio']:.3f} [{v['low']:.3f}, {v['high']:.3f}] | 1 ± {L['length_margin']} | {ok(c['checks']['lengths'])} |")
    if sim:     # the candidate's tokens are the profile's draws, not the model's
        del lines[before_gate:]
        lines.append("Lossless gate: **not applicable** (simulated acceptance: the candidate "
                     "emitted drafts the profile accepted, not the model's tokens).")
    lines += [""] + render_depth_md(c)
    lines += ["", "Per-step time (ms, median over passes; draft + verify + accept run as one program;"
              " host: the device waiting for the host, work: the host's own time, overlapped or not"
              + ("; step: modelled H200 device time, host work: measured here" if h200 else "")
              + "):", ""]
    for w, sp in c["step_time_ms"].items():
        lines.append(f"- {w}: stock step {sp['stock']['step_ms']:.2f} + host {sp['stock']['host_ms']:.2f} "
                     f"(work {sp['stock']['host_work_ms']:.2f}); "
                     f"candidate step {sp['candidate']['step_ms']:.2f} + host {sp['candidate']['host_ms']:.2f} "
                     f"(work {sp['candidate']['host_work_ms']:.2f}); "
                     f"prefill/request stock {sp['stock']['prefill_ms_per_request']:.1f}, candidate {sp['candidate']['prefill_ms_per_request']:.1f}")
    if c.get("draft_verify_ms"):
        dv = c["draft_verify_ms"]
        lines.append(f"- split at batch {dv['batch']}: draft {dv['draft_ms']:.2f} ms, verify forward {dv['verify_ms']:.2f} ms, decode forward {dv['decode_ms']:.2f} ms")
    if c.get("chat"):
        from experiments.chat_workload import render_md as render_chat_md
        lines += render_chat_md(c["chat"])
    if c.get("fp8"):
        lines += [""] + render_fp8_md(c["fp8"])
    return "\n".join(lines) + "\n"


def clock_words(c: dict) -> str:
    """How an h200 card's times were made, in one sentence."""
    st = c["settings"]
    model = (c.get("h200") or {}).get("model", {}).get("model", {})
    w = model.get("weights", "bf16")
    return (f"The engines ran on {st['device']} ({st['backend']}): tokens, acceptance, the "
            f"depths chosen and every gate check are real; each program an engine launched "
            f"advanced its own virtual clock by the price mtpjax/cost_model.py gives that "
            f"program at its real shapes for the 27B ({w} weights, tp {st.get('tp', 1)}), and "
            f"the host time measured here (scheduling, bookkeeping, the policy) was added "
            f"(per workload below). Memory and the gate's quality checks are this machine's.")


def render_range_md(c: dict) -> list[str]:
    """The clock's range: SpecScore and each workload's ratio and ms per token at [low, mid,
    high] over its three constant sets (h200.range)."""
    rg = (c.get("h200") or {}).get("range")
    if not rg:
        return []
    f = lambda xs, nd=3: "[" + ", ".join(f"{x:.{nd}f}" for x in xs) + "]"
    origin = ((c.get("h200") or {}).get("model", {}).get("hardware") or {}).get("origin", "")
    from mtpjax.cost_model import CALIBRATED_MIN_SPREAD
    sets = (f"mid calibrated, fast / slow the calibration's extremes, at least "
            f"{CALIBRATED_MIN_SPREAD:.0%} around it" if origin.startswith("calibrated")
            else "mtpjax/cost_model.py")
    lines = [f"Range over the clock's constants (fast / mid / slow bandwidth, launch and "
             f"program cost, {sets}; one run repriced, the depths chosen at mid): "
             f"**SpecScore {f(rg['specscore'])}** as [low, mid, high]", "",
             "| workload | ratio [low, mid, high] | stock ms/token | candidate ms/token | "
             "ms/token at mid without the long context's prefill, stock / candidate |",
             "|---|---|---|---|---|"]
    for w, v in rg["workloads"].items():
        dec = v.get("ms_per_token_without_long_prefill_mid") or {}
        lines.append(f"| {w} | {f(v['ratio'])} | {f(v['ms_per_token']['stock'], 2)} | "
                     f"{f(v['ms_per_token']['candidate'], 2)} | "
                     f"{_fmt(dec.get('stock'), 2)} / {_fmt(dec.get('candidate'), 2)} |")
    return lines


def render_host_md(c: dict) -> list[str]:
    """One line per workload: host time measured here and its share of the clock, beside the
    modelled device time, so a ratio can be read against how much of it the host decided."""
    wl = (c.get("h200") or {}).get("workloads", {})
    if not wl:
        return []
    lines = ["Host time on the clock (timed passes; host work measured on this machine; the "
             "modelled device waits for it only where it is longer than the launch it runs "
             "beside):", ""]
    for w, v in wl.items():
        part = lambda e: (f"{e['host_s']:.3f} s waiting for the host (of "
                          f"{e.get('host_work_s', e['host_s']):.3f} s host work) of "
                          f"{e['host_s'] + e['device_s']:.3f} s "
                          f"({e['host_share']:.0%}; {_fmt(e.get('host_ms_per_step'), 2)} ms "
                          f"per decode step)")
        lines.append(f"- {w}: stock {part(v['stock'])}; candidate {part(v['candidate'])}")
    return lines


def _policy_words(st: dict) -> str:
    """"K = 4, adaptive depth 0..4" / "k = 4 fixed", plus the MTP head when it is the control."""
    K = st["k"]
    words = (f"K = {K}, adaptive depth 0..{K}" if st.get("adaptive") else f"k = {K} fixed")
    if st.get("mtp_head", "trained") != "trained":
        words += f" · MTP head **{st['mtp_head']}** (control)"
    return words


def _rates(xs, nd=3) -> str:
    return ", ".join(f"d{j + 1} {_fmt(x, nd)}" for j, x in enumerate(xs))


def render_depth_md(c: dict) -> list[str]:
    """Depths the candidate ran (timed passes), acceptance by draft position and, for the
    adaptive policy, what it measured: so a ratio can be read against what drove it."""
    st, K = c["settings"], c["settings"]["k"]
    hist, ap = c.get("depth_hist", {}), c["acceptance_by_position"]
    lines = [f"Candidate decode steps per draft depth (timed passes, all lanes of a step "
             f"share its depth):", "",
             "| workload | steps (stock / candidate) | " + " | ".join(f"d{d}" for d in range(K + 1))
             + " | mean depth |", "|---|---|" + "---|" * (K + 2)]
    for w, h in hist.items():
        n = max(sum(h), 1)
        ds = c.get("decode_steps", {}).get(w, {})
        lines.append(f"| {w} | {ds.get('stock', 'n/a')} / {ds.get('candidate', 'n/a')} | "
                     + " | ".join(f"{x} ({x / n:.0%})" for x in h)
                     + f" | {sum(d * x for d, x in enumerate(h)) / n:.2f} |")
    lines += ["", "Acceptance by draft position (timed passes): conditional = accepted / tried "
              "(tried: a real draft j verified with drafts 1..j-1 accepted); share = verify "
              "steps accepting draft j / verify steps (any depth):", "",
              "| workload | tokens / verify step | tokens / lane step | conditional | share | verify steps | depth-0 lane steps |",
              "|---|---|---|---|---|---|---|"]
    for w, a in ap.items():
        lines.append(f"| {w} | {_fmt(a['tokens_per_verify_step'])} | {a['tokens_per_lane_step']:.3f} | "
                     f"{_rates(a['conditional'])} | {_rates(a['per_verify_step'])} | "
                     f"{a['verify_steps']} | {a['plain_lane_steps']} |")
    pol = {w: p for w, p in c.get("policy", {}).items() if p}
    if pol:
        lines += ["", "Adaptive policy (replica 0; its measured step cost in ms per depth at each "
                  "lane bucket b / context bucket c, median of its recent steps; pooled "
                  "conditional acceptance; depths chosen, the untimed pass included):", ""]
        for w, p in pol.items():
            r = p["replicas"][0]
            cells = "; ".join(f"{cell}: " + ", ".join(f"d{d} {ms:.2f}" for d, ms in v.items())
                              for cell, v in r["costs_ms"].items())
            chosen = ", ".join(f"d{d} {n}" for d, n in r["chosen"].items())
            lines.append(f"- {w}: chosen {chosen or 'none'} · pooled {_rates(r['pooled_acceptance'])}")
            lines.append(f"  - cost ms: {cells or 'none measured'}")
            mixed = "; ".join(f"{cell}: " + ", ".join(f"d{d} {ms:.2f}" for d, ms in v.items())
                              for cell, v in r.get("mixed_costs_ms", {}).items())
            if mixed:
                lines.append(f"  - cost ms with a prefill chunk riding (b lanes / t chunk "
                             f"tokens): {mixed}")
    wu = st.get("warmup")
    if wu:
        lines += ["", "Engine warm-up (every program a run can launch, before any timed work; "
                  "engines of one shape share programs, so later engines find them compiled): "
                  + ", ".join(f"{key} {v['programs']} programs in {v['seconds']:.1f} s"
                              for key, v in wu.items())]
    mm = st.get("memory_mappings")
    if mm:
        lines += ["", f"Memory mappings (/proc/self/maps): {mm['after_load']} after loading, "
                  f"{mm['after_warmup']} after the warm-up, peak {mm['peak']} of the kernel's "
                  f"{mm['limit']} per process; lane buckets {st.get('lane_buckets')}, "
                  f"{st.get('lane_slots')} lane slots, context {st.get('max_seq_len')}"]
    return lines


def render_fp8_md(f: dict) -> list[str]:
    """The card's FP8 block: fidelity against the dense model and MTP acceptance per head."""
    fd = f["fidelity_vs_dense"]
    lines = [f"## FP8 weights (--weights={f['weights']} --mtp_weights={f['mtp_weights']}: "
             f"target {f['target']}, MTP head {f['mtp_head']}; measured in {f['wall_s']:.0f} s)", "",
             f"Fidelity vs dense ({fd['texts']} fixed texts, {fd['positions']} positions; "
             f"reference: {f['dense_reference']}):", "",
             "| measure | value |", "|---|---|",
             f"| mean abs log-prob diff of the actual next token | {fd['mean_abs_logprob_diff']:.4f} (max {fd['max_abs_logprob_diff']:.4f}) |",
             f"| mean log-prob of the actual next token, dense / FP8 | {fd['mean_logprob']['dense']:.4f} / {fd['mean_logprob']['fp8']:.4f} |",
             f"| top-1 agreement | {fd['top1_agreement']:.4f} |",
             f"| mean KL(dense ‖ FP8) per token | {fd['mean_kl']:.2e} nats |",
             "", f"How: {fd['how']}."]
    ma = f.get("mtp_acceptance")
    if ma:
        lines += ["", f"MTP acceptance, head dense vs FP8 (target {f['target']}; candidate k = "
                      f"{ma['k']}, {ma['workload']} workload, {ma['lanes']} lanes, "
                      f"{ma['prompts']} greedy prompts):", "",
                  "| MTP head | tokens / verify step | acceptance by draft position | verify steps |",
                  "|---|---|---|---|"]
        for head in ("dense", "fp8"):
            v = ma[f"{head}_head"]
            lines.append(f"| {head} | {v['tokens_per_verify_step']:.3f} | "
                         + ", ".join(f"d{j + 1} {x:.3f}" for j, x in enumerate(v["acceptance_by_position"]))
                         + f" | {v['verify_steps']} |")
        lines += ["", f"Greedy agreement of the two runs' replies: {ma['greedy_agreement']:.4f}.",
                  "", f"How: {ma['how']}."]
    return lines


def plot(c: dict, out_dir: str) -> list[str]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    paths = []
    ws = list(c["throughput"])
    fig, axes = plt.subplots(1, len(ws), figsize=(4 * len(ws), 3.2), squeeze=False)
    for ax, w in zip(axes[0], ws):
        t = c["throughput"][w]
        n = len(t["stock_tok_s"])
        ax.bar([i - 0.2 for i in range(n)], t["stock_tok_s"], 0.4, label="stock")
        ax.bar([i + 0.2 for i in range(n)], t["candidate_tok_s"], 0.4, label="candidate")
        ax.set_title(f"{w}: ratio {c['ratios'][w]['ratio']:.3f}")
        ax.set_xlabel("pass")
        ax.set_ylabel("tokens / s")
        ax.set_xticks(range(n))
    axes[0][0].legend()
    fig.tight_layout()
    p = os.path.join(out_dir, "throughput.png")
    fig.savefig(p, dpi=100)
    plt.close(fig)
    paths.append(p)
    fig, ax = plt.subplots(figsize=(5, 3.2))
    for w, a in c["acceptance_by_position"].items():
        per = a["conditional"]
        xs = [j + 1 for j, x in enumerate(per) if x is not None]
        ax.plot(xs, [x for x in per if x is not None], marker="o", label=w)
    ax.set_xlabel("draft position")
    ax.set_ylabel("conditional acceptance")
    ax.set_ylim(0, 1)
    ax.legend()
    fig.tight_layout()
    p = os.path.join(out_dir, "acceptance.png")
    fig.savefig(p, dpi=100)
    plt.close(fig)
    paths.append(p)
    if c.get("depth_hist"):
        paths.append(plot_depths(c, out_dir))
    return paths


def plot_depths(c: dict, out_dir: str) -> str:
    """depth.png: share of the candidate's decode steps at each depth, per workload."""
    import matplotlib.pyplot as plt
    hist = c["depth_hist"]
    K = c["settings"]["k"]
    fig, ax = plt.subplots(figsize=(5, 3.2))
    width = 0.8 / max(len(hist), 1)
    for i, (w, h) in enumerate(hist.items()):
        n = max(sum(h), 1)
        ax.bar([d - 0.4 + width * (i + 0.5) for d in range(K + 1)], [x / n for x in h], width,
               label=w)
    ax.set_xlabel("draft depth")
    ax.set_ylabel("share of decode steps")
    ax.set_xticks(range(K + 1))
    ax.legend()
    fig.tight_layout()
    p = os.path.join(out_dir, "depth.png")
    fig.savefig(p, dpi=100)
    plt.close(fig)
    return p


def write_json(path: str, doc: dict, indent: int = 2) -> None:
    """Write doc as JSON at path, making its folder (the sub-commands' --out)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(doc, f, indent=indent, default=float)


def write(c: dict, out_dir: str) -> None:
    write_json(os.path.join(out_dir, "card.json"), c)
    with open(os.path.join(out_dir, "card.md"), "w") as f:
        f.write(render_md(c))
    plot(c, out_dir)
