"""Data parallelism: dp engine replicas, each on its own tp devices with its own lanes and KV
page pool, behind the `Engine` interface.

Why replicas and not one program over a ("dp", "tp") mesh: replicas share nothing per step
(no collective between them), each keeps its own lane buckets and compaction, and a replica's
step never waits for a busier one. Each replica's host loop runs on its own thread; JAX
releases the GIL while a step runs, so the replicas' devices work at the same time (on one
process; across hosts every process runs the same replicas, see README "Multi-host").

Requests are spread when `generate` is called: each goes to the replica with the least work
assigned so far (prompt + max_new_tokens tokens), ties to the lower replica. Outputs do not
depend on the replica: every sampling key is (request seed, absolute position).
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Sequence

from mtpjax import tensor_parallel
from mtpjax.config import Config
from mtpjax.engine import Engine, RequestOutput
from mtpjax.params import Params
from mtpjax.sampling import SamplingParams

# stats() fields that add up over replicas
_SUMMED = ("free_pages", "total_pages", "preemptions", "max_lanes", "steps", "plain_steps",
           "prefill_chunks", "prefill_tokens", "lane_moves", "compiled_programs", "cached_pages")


class DataParallelEngine:
    """dp `Engine` replicas with the Engine interface (generate, cancel, stats)."""

    def __init__(self, replicas: Sequence[Engine]):
        replicas = list(replicas)
        if not replicas:
            raise ValueError("a DataParallelEngine needs at least one replica")
        first = replicas[0]
        for e in replicas[1:]:
            if (e.cfg, e.k, e.max_seq_len) != (first.cfg, first.k, first.max_seq_len):
                raise ValueError("replicas must share the model config, k and max_seq_len")
        self.replicas = replicas
        self.cfg, self.k, self.eos = first.cfg, first.k, first.eos
        self.max_seq_len, self.kernels, self.tp = first.max_seq_len, first.kernels, first.tp
        self.dtype = first.dtype
        self._routes: dict[int, tuple[int, int]] | None = None

    @property
    def dp(self) -> int:
        return len(self.replicas)

    @property
    def max_lanes(self) -> int:
        return sum(e.max_lanes for e in self.replicas)

    @property
    def params(self) -> Params:
        return self.replicas[0].params

    def assign(self, prompts: Sequence[Sequence[int]],
               params: Sequence[SamplingParams]) -> list[int]:
        """The replica of each request: least assigned work first (prompt + max_new_tokens)."""
        load = [0] * self.dp
        out = []
        for p, sp in zip(prompts, params):
            r = min(range(self.dp), key=lambda i: (load[i], i))
            load[r] += len(p) + getattr(sp, "max_new_tokens", 0)
            out.append(r)
        return out

    def generate(self, prompts: Sequence[Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] = SamplingParams(),
                 on_token: Callable[[int, list[int]], None] | None = None) -> list[RequestOutput]:
        """Engine.generate over the replicas; one output per prompt, in order."""
        prompts = [list(p) for p in prompts]
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
        where = self.assign(prompts, params)
        mine = [[i for i, r in enumerate(where) if r == rep] for rep in range(self.dp)]
        self._routes = {i: (r, mine[r].index(i)) for i, r in enumerate(where)}
        lock = threading.Lock()

        def run(rep: int) -> list[RequestOutput]:
            ids = mine[rep]
            if not ids:
                return []
            cb = None
            if on_token is not None:
                def cb(j, new, ids=ids):
                    with lock:
                        on_token(ids[j], new)
            return self.replicas[rep].generate([prompts[i] for i in ids],
                                               [params[i] for i in ids], cb)

        try:
            with ThreadPoolExecutor(max_workers=self.dp) as pool:
                results = list(pool.map(run, range(self.dp)))
        finally:
            self._routes = None
        out: list[RequestOutput | None] = [None] * len(prompts)
        for rep, ids in enumerate(mine):
            for i, o in zip(ids, results[rep]):
                out[i] = o
        return out

    def cancel(self, request_id: int) -> None:
        routes = self._routes
        if routes is not None and request_id in routes:
            rep, local = routes[request_id]
            self.replicas[rep].cancel(local)

    @property
    def timing(self) -> dict:
        """The replicas' step timers: counters summed, seconds the slowest replica's (they
        run concurrently)."""
        per = [e.timing for e in self.replicas]
        return {key: (max if key.endswith("_s") else sum)(t[key] for t in per) for key in per[0]}

    def reset_timing(self, keys=None) -> None:
        for e in self.replicas:
            e.reset_timing(keys)

    def warmup(self, depths: Sequence[int] | None = None, lanes: int | None = None,
               progress=None) -> int:
        """Engine.warmup on every replica; programs run in all."""
        return sum(e.warmup(depths, lanes, progress) for e in self.replicas)

    def shape_key(self, key: tuple = ("decode",)) -> tuple:
        """Engine.shape_key of every replica."""
        return tuple(e.shape_key(key) for e in self.replicas)

    def warmup_plan(self, depths: Sequence[int] | None = None,
                    lanes: int | None = None) -> list[tuple]:
        """Engine.warmup_plan of every replica, concatenated."""
        return [key for e in self.replicas for key in e.warmup_plan(depths, lanes)]

    @property
    def depth_steps(self) -> list[int]:
        return [sum(d) for d in zip(*(e.depth_steps for e in self.replicas))]

    def stats(self) -> dict:
        """Totals over the replicas, and each replica's own stats under "replicas"."""
        per = [e.stats() for e in self.replicas]
        total = {key: sum(s[key] for s in per) for key in _SUMMED}
        pcs = [s["prefix_cache"] for s in per if s.get("prefix_cache")]
        if pcs:     # counts add up; the rates are recomputed from them
            pc = {key: sum(p[key] for p in pcs) for key in pcs[0]}
            pc["hit_rate"] = pc["hits"] / pc["lookups"] if pc["lookups"] else 0.0
            pc.pop("reused_fraction", None)
            total["prefix_cache"] = pc
        return {**total, **self.timing, "dp": self.dp, "tp": self.tp, "kernels": self.kernels,
                "num_speculative_tokens": self.k, "max_seq_len": self.max_seq_len,
                "page_size": per[0]["page_size"], "depth_steps": self.depth_steps,
                "policy": per[0]["policy"], "replicas": per}


def from_checkpoint(path: str, dtype: str = "float32", num_speculative_tokens: int = 0,
                    tp: int = 1, dp: int = 1, devices: Sequence | None = None, **kw):
    """`Engine.from_checkpoint` with dp replicas: an Engine (dp = 1) or a DataParallelEngine
    of dp engines, each with its own lanes and page pool on its own tp devices (kw: as
    Engine.from_checkpoint's)."""
    engines = Engine.replicas_from_checkpoint(path, dtype, num_speculative_tokens, tp, dp,
                                              devices, **kw)
    return engines[0] if dp == 1 else DataParallelEngine(engines)


def make_engine(cfg: Config, params: Params, *, tp: int = 1, dp: int = 1,
                devices: Sequence | None = None, placed: Sequence[Params] | None = None, **kw):
    """An Engine on tp devices (dp = 1) or a DataParallelEngine of dp such replicas.

    placed: params already laid out on `tensor_parallel.make_meshes(tp, dp, devices)` (one per
    replica), to share one placement between several engines (the judge's stock and
    candidate); else `params` (standard layout) are laid out for this engine.
    """
    meshes = tensor_parallel.make_meshes(tp, dp, devices)
    if placed is None:
        placed = [tensor_parallel.place_params(cfg, params, m) for m in meshes]
    engines = [Engine(cfg, p, mesh=m, **kw) for p, m in zip(placed, meshes)]
    return engines[0] if dp == 1 else DataParallelEngine(engines)
