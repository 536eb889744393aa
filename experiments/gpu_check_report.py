"""What makes a `python -m experiments gpu_check` run not ok: pure functions over its report.

Kept apart from gpu_check.py, which defines absl flags at import (shared with bench.py), so
that tests can import these next to other sub-commands' modules.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET


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


def failures(doc: dict) -> list[str]:
    """Every reason the run is not ok: a failure, a fallback or a skip anywhere."""
    why = []
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
    return why
