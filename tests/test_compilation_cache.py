"""`python -m experiments` keeps JAX's persistent compilation cache: the second run loads what
the first compiled; --compilation_cache=false writes nothing."""

from __future__ import annotations

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GENERATE = ["generate", "--max_new_tokens=2", "--num_speculative_tokens=0", "--prompt=ab"]
LINE = re.compile(r"\[compilation cache\] (\d+) hits, (\d+) new entries in (\S+)")


def _run(args, **env_over):
    env = dict(os.environ, JAX_PLATFORMS="cpu", **env_over)
    p = subprocess.run([sys.executable, "-m", "experiments", *args], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return p


def _files(path):
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs)


def test_second_run_hits_the_cache_and_the_flag_turns_it_off(tmp_path):
    on, off = tmp_path / "cache", tmp_path / "off"
    # first run: the env var names the folder; a concurrent run with the cache off
    env_run = subprocess.Popen(
        [sys.executable, "-m", "experiments", *GENERATE, "--compilation_cache=false"], cwd=ROOT,
        env=dict(os.environ, JAX_PLATFORMS="cpu", MTPJAX_COMPILATION_CACHE_DIR=str(off)),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    first = _run(GENERATE, MTPJAX_COMPILATION_CACHE_DIR=str(on))
    off_out, off_err = env_run.communicate(timeout=300)
    assert env_run.returncode == 0, off_err[-3000:]

    hits, writes, where = LINE.search(first.stderr).groups()
    written = _files(on)
    assert where == str(on) and int(hits) == 0 and int(writes) > 0
    assert len(written) >= int(writes)

    # second run: the flag names the same folder; every program comes from the cache
    second = _run(GENERATE + [f"--compilation_cache_dir={on}"])
    hits, writes, _ = LINE.search(second.stderr).groups()
    assert int(hits) > 0 and int(writes) == 0, second.stderr[-2000:]
    assert _files(on) == written

    # off: nothing written, no cache line
    assert not off.exists() or _files(off) == []
    assert not LINE.search(off_err)
