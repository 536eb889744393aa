"""A calibration file as `gpu_check` writes it (experiments/gpu_calibration.calibration_doc),
with made-up GPU numbers, for the tests of the clock that reads it."""

from __future__ import annotations

import copy
import json

from mtpjax.cost_model import CALIBRATION_FORMAT

DOC = {
    "format": CALIBRATION_FORMAT, "date": "2026-12-07T05:00:00+00:00",
    "device": {"backend": "gpu", "device_kind": "NVIDIA H200", "jax": "0.11.2"},
    "smoke": False, "partial": False,
    "constants": {
        "hbm_bytes_per_s": {"value": 4.2e12, "unit": "bytes/s",
                            "samples": [4.15e12, 4.2e12, 4.22e12], "how": "read slope"},
        "launch_s": {"value": 2.0e-6, "unit": "s per kernel",
                     "samples": [1.9e-6, 2.0e-6, 2.1e-6], "how": "chain slope"},
        "program_s": {"value": 15e-6, "unit": "s per program",
                      "samples": [14e-6, 15e-6, 40e-6], "how": "one-kernel call"},
    },
    "errors": {}, "steps": {"rows": []}, "elapsed_s": 12.0,
}


def calibration(**values) -> dict:
    """DOC with some constants' values replaced (name=value; the samples follow: value x
    0.99, 1, 1.01)."""
    doc = copy.deepcopy(DOC)
    for name, v in values.items():
        doc["constants"][name]["value"] = v
        doc["constants"][name]["samples"] = [0.99 * v, v, 1.01 * v]
    return doc


def write(path, doc: dict | None = None) -> str:
    with open(path, "w") as f:
        json.dump(DOC if doc is None else doc, f)
    return str(path)
