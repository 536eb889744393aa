"""The serving engine: lanes, a request queue, and the host loop around the step programs.

The engine knows nothing about XLA beyond calling `steps.prefill_chunk` and
`steps.decode_step`; it owns the host-side bookkeeping: validation (bad requests end with
finish_reason "error" and never touch the device), lane assignment, stop conditions, and
per-request speculation statistics. The same code with num_speculative_tokens = 0 is the stock
engine the judge compares against.

Host loop:
  1. admit queued requests into free lanes; prefill each in chunks (bucketed lengths)
  2. one `decode_step` over all lanes (idle lanes are padding)
  3. read back the emitted tokens, apply stop conditions, free finished lanes
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from mtpjax import model, steps
from mtpjax.config import Config
from mtpjax.gdn import check_kernels
from mtpjax.params import Params
from mtpjax.sampling import LaneSampling, SamplingParams

FINISH_STOP, FINISH_LENGTH, FINISH_ERROR = "stop", "length", "error"


@dataclasses.dataclass
class RequestStats:
    verify_steps: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = dataclasses.field(default_factory=list)

    @property
    def tokens_per_step(self) -> float:
        return (self.accepted_tokens + self.verify_steps) / max(self.verify_steps, 1)


@dataclasses.dataclass
class RequestOutput:
    prompt_token_ids: list[int]
    token_ids: list[int]
    finish_reason: str
    error: str | None
    stats: RequestStats


@dataclasses.dataclass
class _Active:
    index: int
    prompt: list[int]
    params: SamplingParams
    out: list[int]
    stats: RequestStats
    stops: frozenset[int]
    done: str | None = None


def default_kernels() -> str:
    return "pallas" if jax.default_backend() == "gpu" else "reference"


def _buckets(limit: int) -> list[int]:
    b, out = 8, []
    while b < limit:
        out.append(b)
        b *= 2
    out.append(limit)
    return out


class Engine:
    """Static-shape continuous batching over `max_lanes` lanes with MTP speculation."""

    def __init__(self, cfg: Config, params: Params, *, num_speculative_tokens: int = 0,
                 max_lanes: int = 4, max_seq_len: int = 1024, prefill_chunk: int = 64,
                 kernels: str | None = None, eos_token_ids: Sequence[int] | None = None):
        k = int(num_speculative_tokens)
        if k < 0:
            raise ValueError(f"num_speculative_tokens must be >= 0, got {k}")
        if k > 0 and not cfg.has_mtp:
            raise ValueError("num_speculative_tokens > 0 needs a checkpoint with an MTP head")
        if max_lanes < 1:
            raise ValueError(f"max_lanes must be >= 1, got {max_lanes}")
        if max_seq_len < 2 or max_seq_len > cfg.max_position_embeddings:
            raise ValueError(f"max_seq_len must be in [2, {cfg.max_position_embeddings}], "
                             f"got {max_seq_len}")
        kernels = kernels or default_kernels()
        check_kernels(kernels)
        self.cfg, self.params, self.k = cfg, params, k
        self.max_lanes, self.max_seq_len, self.kernels = max_lanes, max_seq_len, kernels
        self.prefill_chunk = prefill_chunk
        self.chunk_buckets = _buckets(prefill_chunk)
        self.eos = tuple(cfg.eos_token_ids if eos_token_ids is None else eos_token_ids)
        self.dtype = params.embed.dtype
        # Room past the context limit for the k+1 verify slots and the k-1 chained MTP slots,
        # so that where a request stops does not depend on k.
        self.cache = model.init_cache(cfg, max_lanes, max_seq_len + 2 * k + 1, k + 1, self.dtype)
        self.state = steps.LaneState.empty(max_lanes, k)
        self.timing = {"prefill_s": 0.0, "step_s": 0.0, "host_s": 0.0, "steps": 0}
        self._programs: set = set()

    @classmethod
    def from_checkpoint(cls, path: str, dtype: str = "float32", num_speculative_tokens: int = 0,
                        **kw) -> "Engine":
        from mtpjax.api import load_checkpoint
        cfg, params = load_checkpoint(path, dtype)
        return cls(cfg, params, num_speculative_tokens=num_speculative_tokens, **kw)

    # ---------------------------------------------------------------- validation
    def _validate(self, prompt, params) -> str | None:
        if not isinstance(params, SamplingParams):
            return f"sampling params must be a SamplingParams, got {type(params).__name__}"
        try:
            params.validate(self.cfg.vocab_size)
        except ValueError as e:
            return f"invalid sampling parameters: {e}"
        if len(prompt) == 0:
            return "empty prompt"
        bad = [t for t in prompt if not (0 <= t < self.cfg.vocab_size)]
        if bad:
            return f"token id {bad[0]} outside the vocabulary [0, {self.cfg.vocab_size})"
        if len(prompt) >= self.max_seq_len:
            return (f"prompt too long: {len(prompt)} tokens, the context limit is "
                    f"{self.max_seq_len}")
        return None

    # ---------------------------------------------------------------- main entry
    def generate(self, prompts: Sequence[Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] = SamplingParams(),
                 on_token: Callable[[int, list[int]], None] | None = None) -> list[RequestOutput]:
        """Generate for every prompt (lists of token ids); one output per prompt, in order.

        params: one SamplingParams for all, or one per prompt. on_token(i, new_ids) streams.
        """
        prompts = [list(map(int, p)) for p in prompts]
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
        results: list[RequestOutput | None] = [None] * len(prompts)
        queue = deque()
        for i, (p, sp) in enumerate(zip(prompts, params)):
            err = self._validate(p, sp)
            if err:
                results[i] = RequestOutput(p, [], FINISH_ERROR, err, RequestStats())
            else:
                stops = frozenset(sp.stop_token_ids) | frozenset(self.eos)
                queue.append(_Active(i, p, sp, [], RequestStats(accepted_per_position=[0] * self.k),
                                     stops))
        lanes: list[_Active | None] = [None] * self.max_lanes
        lane_params = [SamplingParams()] * self.max_lanes

        def finish(slot: int):
            a = lanes[slot]
            results[a.index] = RequestOutput(a.prompt, a.out, a.done, None, a.stats)
            lanes[slot] = None

        while queue or any(lanes):
            for slot in range(self.max_lanes):
                if lanes[slot] is None and queue:
                    a = queue.popleft()
                    lanes[slot] = a
                    lane_params[slot] = a.params
                    first = self._prefill(slot, a.prompt, LaneSampling.from_params(lane_params))
                    self._emit(a, [first], on_token)
                    if a.done:
                        finish(slot)
            if not any(lanes):
                continue
            active = np.array([a is not None for a in lanes])
            t0 = time.perf_counter()
            self.cache, self.state, out, n_acc = steps.decode_step(
                self.cfg, self.params, self.cache, self.state,
                LaneSampling.from_params(lane_params), jnp.asarray(active),
                k=self.k, kernels=self.kernels)
            out, n_acc = np.asarray(out), np.asarray(n_acc)
            t1 = time.perf_counter()
            self._programs.add(("decode", self.k))
            for slot, a in enumerate(lanes):
                if a is None:
                    continue
                st = a.stats
                if self.k:
                    st.verify_steps += 1
                    st.drafted_tokens += self.k
                    st.accepted_tokens += int(n_acc[slot])
                    for j in range(int(n_acc[slot])):
                        st.accepted_per_position[j] += 1
                self._emit(a, [int(t) for t in out[slot, :n_acc[slot] + 1]], on_token)
                if a.done:
                    finish(slot)
            self.timing["step_s"] += t1 - t0
            self.timing["host_s"] += time.perf_counter() - t1
            self.timing["steps"] += 1
        return results

    # ---------------------------------------------------------------- pieces
    def _prefill(self, slot: int, prompt: list[int], lanes: LaneSampling) -> int:
        t0 = time.perf_counter()
        n = len(prompt)
        C = self.prefill_chunk
        first = None
        for start in range(0, n, C):
            chunk = prompt[start:start + C]
            nxt = prompt[start + 1:start + C + 1]
            T = next(b for b in self.chunk_buckets if b >= len(chunk))
            toks = np.zeros((1, T), np.int32)
            toks[0, :len(chunk)] = chunk
            nt = np.zeros((1, T), np.int32)
            nt[0, :len(nxt)] = nxt
            is_last = start + C >= n
            self.cache, self.state, first = steps.prefill_chunk(
                self.cfg, self.params, self.cache, self.state, lanes, jnp.int32(slot),
                jnp.asarray(toks), jnp.asarray(nt), jnp.int32(start), jnp.int32(len(chunk)),
                jnp.bool_(is_last), k=self.k, kernels=self.kernels)
            self._programs.add(("prefill", T))
        first = int(first)
        self.timing["prefill_s"] += time.perf_counter() - t0
        return first

    def _emit(self, a: _Active, toks: list[int], on_token):
        """Append tokens to a request up to its stop conditions."""
        new = []
        for t in toks:
            new.append(t)
            a.out.append(t)
            if t in a.stops:
                a.done = FINISH_STOP
                break
            if len(a.out) >= a.params.max_new_tokens:
                a.done = FINISH_LENGTH
                break
            if len(a.prompt) + len(a.out) >= self.max_seq_len:
                a.done = FINISH_LENGTH
                break
        if on_token and new:
            on_token(a.index, new)

    def stats(self) -> dict:
        return {"compiled_programs": len(self._programs), "max_lanes": self.max_lanes,
                "max_seq_len": self.max_seq_len, "num_speculative_tokens": self.k,
                "kernels": self.kernels, **self.timing}
