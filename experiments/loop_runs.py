"""The serial loop against the overlapped one: the cells of `python -m experiments loop_check`.

No flags here (tests and other sub-commands import it); experiments/loop_check.py is the
command and says what is measured and how.
"""

from __future__ import annotations

import statistics

from experiments import depth_sweep

LOOPS = (("serial", False), ("overlapped", True))


def cell_summary(passes: list[dict]) -> dict:
    """Medians over a cell's passes: tokens/s, host ms per decode step (the device's wait
    and the host's work), the share of launches that overlapped a running step."""
    per_step = lambda p, key: 1e3 * p[key] / max(p["steps"], 1)
    return {"tokens_per_s": statistics.median(p["tokens_per_s"] for p in passes),
            "host_ms": statistics.median(per_step(p, "host_s") for p in passes),
            "host_work_ms": statistics.median(per_step(p, "host_work_s") for p in passes),
            "step_ms": statistics.median(per_step(p, "step_s") for p in passes),
            "overlapped": statistics.median(p["overlapped"] / max(p["launches"], 1)
                                            for p in passes),
            "steps": statistics.median(p["steps"] for p in passes)}


def run(cfg, params, prompts, lanes: list[int], k: int, passes: int, requests_per_lane: int,
        new_tokens: int, clock: str, log=print) -> dict:
    """Every (lanes, engine, loop) cell; see the module docstring."""
    from mtpjax.sampling import SamplingParams
    sampling = SamplingParams(temperature=0.0, max_new_tokens=new_tokens)
    depths = [0, depth_sweep.ADAPTIVE]
    max_seq = depth_sweep.max_seq_len_for(max(len(p) for p in prompts), new_tokens)
    rows = []
    for L in lanes:
        work = [list(p) for p in prompts[:L * requests_per_lane]]
        engines = {}
        for d in depths:
            for name, overlap in LOOPS:
                e = depth_sweep.make_engine(cfg, params, L, d, [0, k], max_seq, None,
                                            lane_slots=max(lanes), clock=clock,
                                            overlap=overlap)
                depth_sweep.warm(e, work, sampling, d)
                engines[d, name] = e
        runs = {key: [] for key in engines}
        order = list(engines)
        for p in range(passes):
            for key in (order if p % 2 == 0 else order[::-1]):
                runs[key].append(depth_sweep.run_pass(engines[key], work, sampling))
        for d in depths:
            ids = {name: runs[d, name][0]["token_ids"] for name, _ in LOOPS}
            for name, _ in LOOPS:
                row = {"lanes": L, "engine": "stock" if d == 0 else "candidate", "loop": name,
                       **cell_summary(runs[d, name]),
                       "same_tokens": ids[name] == ids["serial"]}
                rows.append(row)
                log(format_row(row))
    return {"settings": {"lanes": lanes, "k": k, "passes": passes, "clock": clock,
                         "requests_per_lane": requests_per_lane, "new_tokens": new_tokens},
            "rows": rows}


def format_row(r: dict) -> str:
    return (f"| {r['lanes']:>5} | {r['engine']:9s} | {r['loop']:10s} | "
            f"{r['tokens_per_s']:8.1f} | {r['step_ms']:7.2f} | {r['host_ms']:7.3f} | "
            f"{r['host_work_ms']:8.3f} | {r['overlapped']:6.0%} | {r['same_tokens']} |")


HEADER = ("| lanes | engine    | loop       |    tok/s | step ms | host ms | work ms  | "
          "overl. | same tokens |\n|---|---|---|---|---|---|---|---|---|")
