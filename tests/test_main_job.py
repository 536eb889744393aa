"""The main job as a new user runs it: README's first command, from an empty compilation cache.

`python -m experiments` (the judge) once died 12-16 minutes into its first run on a fresh
machine: it compiled ~160 XLA:CPU programs, each holding ~500 memory mappings, and the process
hit Linux's default limit of 65,530 (vm.max_map_count) in LLVM. CI had raised the limit and
never saw it. This test runs the judge in a subprocess as a new user would: an empty HOME (so
an empty persistent compilation cache), no raised limit, default engine sizes (K = 4, lanes 1 /
8 / 16, every depth and lane bucket warmed up), only fewer requests and one pass. It checks
that the run finishes, that it said what it was doing, and that its memory mappings, counted
by the judge itself from /proc/self/maps, stay inside a budget with a margin:

- the warm-up of the default-size engines (every program they can launch) adds at most
  WARMUP_BUDGET mappings: 27,304 measured for 42 programs (~650 each; 34 before packed
  prefill's 8) by README's main command on a clean clone, so the budget leaves 10% headroom,
  about four programs' worth: a fifth new program in the default plan fails here before it
  can crowd a user's process;
- the whole run peaks below PEAK_BUDGET: 28,697 measured, 10% headroom, and the budget itself
  under half the kernel's default limit (32,765), so a second engine in the same process fits.

It also checks the verdict: the run exits 0 only when the lossless gate passes (a failed gate
exits 1), and the card says PASS with every check true.

The judge before issue 22 fails it: its warm-up alone compiled ~157 programs (~74,000
mappings; it crashed near 64,500).
"""

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WARMUP_BUDGET = 30_000        # measured 27,304 (42 programs): 10% headroom
PEAK_BUDGET = 31_500          # measured 28,697: 10% headroom; half of vm.max_map_count is 32,765
# The busy workload at its default 32 requests, and its validity floor (page use while
# requests wait) at 0.8, not the judge's 0.9: 12-token replies turn the pool over four times
# as fast as the judge's 48, and a single pass measured 0.906 on a quiet machine and under 0.9
# with a second test process beside it (CI); the default judge measures 0.92-0.94
SMALL_RUN = ["--passes=1", "--solo_requests=1", "--team_requests=8", "--busy_requests=32",
             "--busy_page_use_floor=0.8",
             "--gate_prompts=4", "--chat_conversations=2", "--chat_turns=2",
             "--max_new_tokens=12", "--fidelity_tokens=10"]


def test_main_job_finishes_from_an_empty_cache_within_the_mappings_budget(tmp_path):
    home, out = tmp_path / "home", tmp_path / "judge"
    home.mkdir()
    env = {key: v for key, v in os.environ.items()
           if key not in ("MTPJAX_COMPILATION_CACHE_DIR", "XLA_FLAGS", "JAX_PLATFORMS")}
    env["HOME"] = str(home)
    proc = subprocess.run([sys.executable, "-m", "experiments", f"--out_dir={out}", *SMALL_RUN],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, f"the main job failed:\n{proc.stderr[-4000:]}"

    card = json.loads((out / "card.json").read_text())
    maps = card["settings"]["memory_mappings"]
    warm = maps["after_warmup"] - maps["after_load"]
    assert warm < WARMUP_BUDGET, (f"the default-size engines' warm-up added {warm} memory "
                                  f"mappings (budget {WARMUP_BUDGET}): {maps}")
    assert maps["peak"] < PEAK_BUDGET, f"the run peaked at {maps['peak']} mappings: {maps}"
    assert set(card["ratios"]) == {"solo", "team", "busy"} and card["specscore"] > 0
    # the verdict: the lossless gate passed, check by check (a failed gate exits 1, above)
    assert card["reason"] is None and card["score"] == card["specscore"], card["checks"]
    assert card["checks"] and all(card["checks"].values()), card["checks"]
    assert {"memory", "fidelity", "likelihood", "argmax", "greedy_agreement", "lengths",
            "busy_page_use"} <= set(card["checks"]), card["checks"]
    assert card["settings"]["k"] == 4 and card["settings"]["lanes"]["busy"] == 16

    # an empty cache at the start (every program compiled), filled at the end
    cache = home / ".cache" / "mtpjax" / "jax_cache"
    assert len(os.listdir(cache)) >= 30, "the run compiled and cached fewer programs than 30"

    # it said what it was doing, and nothing else: no libtpu notice, no plugin traceback
    err = proc.stderr
    for line in ("loading", "compiling 1/", "solo: pass 1/1", "busy: pass 1/1", "gate:"):
        assert line in err, f"no progress line {line!r} on stderr:\n{err[-3000:]}"
    assert "libtpu" not in err and "Traceback" not in err and "cuDNN" not in err, err[:3000]
