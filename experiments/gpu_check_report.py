"""What makes a `python -m experiments gpu_check` run not ok: pure functions over its report.

Kept apart from gpu_check.py, which defines absl flags at import (shared with bench.py), so
that tests can import these next to other sub-commands' modules.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from typing import Sequence

from experiments.judge_gate import common_prefix, greedy_agreement

# Kernels with a memory-floor target: memory-bound at the timed shapes. chunk_gated_delta (the
# prefill chunk) may be compute-bound, so its memory floor is reported only.
TARGET_KERNELS = ("paged_attention", "gated_delta_verify", "fp8_matmul")


def parse_junit(path: str) -> dict:
    """Counts of a pytest --junitxml report, the compiled tests among them and the backend
    that tests/conftest.py recorded (property `jax_backend`)."""
    root = ET.parse(path).getroot()
    cases = root.findall(".//testcase")
    props = {p.get("name"): p.get("value") for p in root.iter("property")}
    out = {"tests": len(cases), "failed": 0, "errors": 0, "skipped": 0, "compiled": 0,
           "skipped_tests": [], "backend": props.get("jax_backend")}
    for c in cases:
        name = f"{c.get('classname')}.{c.get('name')}"
        out["compiled"] += "Compiled" in (c.get("classname") or "")
        if c.find("failure") is not None:
            out["failed"] += 1
        elif c.find("error") is not None:
            out["errors"] += 1
        elif c.find("skipped") is not None:
            out["skipped"] += 1
            out["skipped_tests"].append(name)
    return out


def pytest_problems(rc, timed_out: bool, counts: dict | None, smoke: bool) -> list[str]:
    """Why the pytest part is not ok (empty: ok). smoke only collects, on CPU."""
    if timed_out:
        return ["timed out"]
    if smoke:
        if rc != 0:
            return [f"collection failed (exit {rc})"]
        if not counts or counts["tests"] == 0:
            return ["collected no tests"]
        return []
    why = []
    if rc == 4:
        why.append("pytest usage error (exit 4): the tests did not start on a GPU "
                   "(MTPJAX_TEST_PLATFORM=gpu)")
    elif rc == 5:
        why.append("no test matched -k (exit 5)")
    elif rc != 0:
        why.append(f"pytest exit status {rc}")
    if counts is None:
        return why + ["no junit report"]
    if counts["backend"] != "gpu":
        why.append(f"tests ran on {counts['backend']}, not on a gpu backend")
    if counts["tests"] == 0:
        why.append("no test ran")
    elif counts["compiled"] == 0:
        why.append("no compiled (...Compiled) kernel test ran")
    if counts["failed"] or counts["errors"]:
        why.append(f"{counts['failed']} failed, {counts['errors']} errors")
    if counts["skipped"]:
        why.append(f"{counts['skipped']} skipped: {', '.join(counts['skipped_tests'][:5])}")
    return why


def compare_tokens(reference: Sequence[Sequence[int]],
                   candidate: Sequence[Sequence[int]]) -> dict:
    """Greedy replies of an engine against the reference engine's, prompt by prompt.

    Returns `equal` (every reply identical, lengths included), `agreement` (mean over prompts
    of the common prefix / the reference reply's length: the judge's greedy_agreement) and
    per prompt the common prefix, both lengths and the first diverging position (None when
    identical)."""
    if len(reference) != len(candidate):
        raise ValueError(f"{len(candidate)} replies to compare with {len(reference)} "
                         "reference replies")
    per = []
    for r, c in zip(reference, candidate):
        n = common_prefix(r, c)
        same = list(r) == list(c)
        per.append({"common_prefix": n, "reference_len": len(r), "len": len(c),
                    "first_divergence": None if same else n})
    return {"equal": all(p["first_divergence"] is None for p in per),
            "agreement": greedy_agreement(candidate, reference), "per_prompt": per}


def floor_target(x_floor: float, target: float, applies: bool, why_not: str = "") -> dict:
    """A floor target's verdict: met (x_floor <= target), or None (n/a) when the roofline does
    not apply (not a GPU: the floor is an H200's) with `status` saying why."""
    if not applies:
        return {"target": target, "met": None, "status": f"n/a ({why_not or 'not a GPU'})"}
    met = bool(x_floor <= target)
    return {"target": target, "met": met, "status": "MET" if met else "NOT MET"}


def kernel_target(row: dict, target: float, min_floor_s: float, applies: bool,
                  backend: str = "") -> dict | None:
    """The memory-floor target of one timed kernel row, or None when it has none: a kernel not
    in TARGET_KERNELS, or a floor under `min_floor_s` (a few microseconds of launch and
    ramp-up would dominate: reported only)."""
    if row.get("kernel") not in TARGET_KERNELS or "x_floor" not in row:
        return None
    if row["floor_s"] < min_floor_s:
        return None
    return floor_target(row["x_floor"], target, applies, f"measured on {backend or 'not a GPU'}")


def _target_failures(part: str, label: str, t: dict, roofline_applies: bool) -> list[str]:
    if t.get("met") is False:
        return [f"{part}: {label}: x{t['x_floor']:.3f} of the floor, target "
                f"<= x{t['target']} NOT MET"]
    if t.get("met") is None and roofline_applies:
        return [f"{part}: {label}: target not evaluated on a GPU run"]
    return []


def engine_verdict(reference: dict, run: dict) -> dict:
    """`run` (one engine under test) with its comparison against `reference` (the CPU
    reference engine's run) and its verdict: "equal", "DIFFERENT" (a gated run whose tokens
    differ: the float32 engine) or "differs (reported)" (an ungated dtype, bfloat16)."""
    c = compare_tokens(reference["tokens"], run["tokens"])
    verdict = ("equal" if c["equal"] else
               "DIFFERENT" if run.get("gated") else "differs (reported)")
    return {**run, "comparison": c, "verdict": verdict}


def _engine_failures(e: dict) -> list[str]:
    if "error" in e:
        return [f"engine: {e['error']}"]
    why = []
    if not any(r.get("gated") for r in e.get("runs", [])):
        why.append("engine: no float32 engine was compared with the reference (the gate: "
                   "--engine_dtypes must list float32)")
    ref = e.get("reference") or {}
    if "error" in ref:
        why.append(f"engine: reference: {ref['error']}")
    elif e.get("expect_platforms") and ref.get("platform") != "cpu":
        why.append(f"engine: the reference engine ran on {ref.get('platform')}, not the CPU")
    for r in e.get("runs", []):
        name = f"{r['dtype']} {r['kernels']}"
        if "error" in r:
            why.append(f"engine: {name}: {r['error']}")
        elif "skipped" in r:
            why.append(f"engine: {name}: skipped ({r['skipped']})")
        elif e.get("expect_platforms") and r.get("platform") != "gpu":
            why.append(f"engine: {name} ran on {r.get('platform')}, not the GPU")
        elif r.get("gated") and not r["comparison"]["equal"]:
            div = [(i, p["first_divergence"]) for i, p in enumerate(r["comparison"]["per_prompt"])
                   if p["first_divergence"] is not None]
            where = ", ".join(f"prompt {i} at token {j}" for i, j in div)
            why.append(f"engine: {name} greedy tokens differ from the CPU reference engine's "
                       f"({where}; agreement {r['comparison']['agreement']:.3f})")
    return why


def failures(doc: dict) -> list[str]:
    """Every reason the run is not ok: a failure, a fallback or a skip anywhere (a calibration
    constant not measured included), a float32
    engine whose greedy tokens differ from the CPU reference engine's, and every kernel or
    step floor target NOT MET (with its numbers). A target that is n/a (met None: not a GPU,
    the --smoke run) fails only when the doc says the roofline applies."""
    why = []
    applies = bool(doc.get("roofline_applies"))
    if doc.get("error"):
        why.append(f"backend: {doc['error']}")
    p = doc.get("pytest")
    if p and not p["passed"]:
        why.append(f"pytest: {p.get('why', 'failed')}")
    for r in doc.get("kernels") or []:
        if "error" in r:
            why.append(f"kernels: {r['kernel']}: {r['error']}")
        elif "skipped" in r:
            why.append(f"kernels: {r['kernel']}: skipped ({r['skipped']})")
        elif r.get("target"):
            why += _target_failures("kernels", kernel_label(r),
                                    {**r["target"], "x_floor": r["x_floor"]}, applies)
    for name, err in ((doc.get("calibrate") or {}).get("errors") or {}).items():
        why.append(f"calibrate: {name}: {err}")
    if doc.get("engine"):
        why += _engine_failures(doc["engine"])
    m = doc.get("model")
    if m:
        if "error" in m:
            why.append(f"model: {m['error']}")
        if m.get("kv_fallback"):
            why.append(f"model: paged attention failed, fell back to contiguous KV "
                       f"({m['kv_fallback']})")
        for r in m.get("results", []):
            if "skipped" in r:
                why.append(f"model: {r['program']} B={r['batch']} C={r['context_len']} "
                           f"skipped ({r['skipped']})")
        if applies and "results" in m:
            have = {t["program"] for t in m.get("weight_floor_targets", [])}
            for prog in ("decode", "verify"):
                if prog not in have:
                    why.append(f"model: no {prog} step at B=1 was timed, so its weight-floor "
                               "target is not established")
        for t in m.get("weight_floor_targets", []):
            why += _target_failures("model", f"{t['program']} B={t['batch']} "
                                    f"C={t['context_len']} (weight floor)",
                                    {**t, "x_floor": t["x_weight_floor"]}, applies)
        if (m.get("calibration_steps") or {}).get("error"):
            why.append(f"model: calibration steps: {m['calibration_steps']['error']}")
        if (m.get("cost_model") or {}).get("error"):
            why.append(f"model: cost model: {m['cost_model']['error']}")
    return why


def finish(doc: dict, failed: Sequence[str], parts: Sequence[str]) -> dict:
    """The run's verdict: `failures` (every reason, failures(doc)), `failed_parts` (the parts
    that failed while running, `failed`, plus each part of `parts` a failure names) and `ok`
    (no failure anywhere: a float32 engine mismatch or a floor target NOT MET on a GPU makes
    it false)."""
    why = failures(doc)
    failed = list(failed)
    for part in parts:
        if part not in failed and any(w.startswith(f"{part}:") for w in why):
            failed.append(part)
    return {"failures": why, "failed_parts": failed, "ok": not failed and not why}


def kernel_label(r: dict) -> str:
    """A kernel row's name and shape, as the summary table prints it."""
    if "median_s" not in r:
        return r["kernel"]
    if r["kernel"] == "paged_attention":
        shape = f"B={r['batch']} q={r['q_len']} ctx={r['context_len']}"
    elif r["kernel"] == "gated_delta_verify":
        shape = f"B={r['batch']} T={r['tokens']} H={r['heads']}"
    elif r["kernel"] == "fp8_matmul":
        shape = f"T={r['tokens']} O={r['out']} I={r['inp']} fp8"
    else:
        shape = f"B={r['batch']} T={r['tokens']} H={r['heads']} chunk={r['chunk_size']}"
    return f"{r['kernel']} {shape}"
