"""A request's sampling settings, on the host (no JAX: the engine core and the scheduler
read them; mtpjax/sampling.py turns them into the device's `LaneSampling`).

`SamplingParams` is checked at construction for what does not depend on the vocabulary, and
by `validate(vocab_size)` for the rest; the engine validates every request this way before
it reaches the device.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

_UINT32_MAX = 2**32 - 1


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Host-side sampling settings for one request.

    temperature 0 means greedy. top_k 0 and top_p 1.0 turn those filters off. The
    sampler does not read max_new_tokens, stop_token_ids or grammar; the engine applies them
    on the host (the grammar as token masks it hands each step, mtpjax/grammar.py). Fields
    that do not depend on the vocabulary are checked at construction;
    ``validate(vocab_size)`` also checks the stop ids.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    max_new_tokens: int = 16
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()
    # Structured output: a llguidance grammar (mtpjax.grammar.json_schema_grammar(schema),
    # json_object_grammar(), or any grammar llguidance's LLMatcher takes) the generated tokens
    # must follow; None: unconstrained. The engine masks the target distribution with it at
    # every verify position, exactly as constrained plain decoding would (mtpjax/grammar.py).
    grammar: str | None = None
    # Log probabilities of the emitted tokens (RequestOutput.logprobs): None off; 0 the chosen
    # token's only; 1..MAX_LOGPROBS also that many most likely tokens at each position. They
    # are the RAW target distribution's (log_softmax of the model's logits: before
    # temperature, top-k / top-p, logit_bias and any grammar mask; vLLM's default), computed
    # in the step from the verify row each token came from, so speculation does not change
    # them.
    logprobs: int | None = None
    # {token id: bias} (or (id, bias) pairs; stored as a sorted tuple of pairs): added to the
    # target logits at every position before sampling (and verification: exact under
    # speculation). At most MAX_LOGIT_BIAS entries, each bias in [-100, 100].
    logit_bias: tuple[tuple[int, float], ...] = ()
    # Penalties on tokens already seen (OpenAI's / vLLM's semantics), applied to the target
    # logits after logit_bias and before any grammar mask, temperature and top-k / top-p: with
    # c[t] the count of token t in the request's OUTPUT so far, logits[t] -= frequency_penalty
    # * c[t] + presence_penalty * (c[t] > 0), each in [-2, 2] (0 = off); repetition_penalty r
    # > 0 (HF / vLLM; 1 = off) first scales the logit of every token in the prompt or the
    # output so far: divided by r where positive, multiplied by r otherwise. Exact under
    # speculation: verify row j counts the drafts before it (steps.Extras).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0

    def __post_init__(self):
        # A list is accepted for convenience; a tuple keeps the object hashable.
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))
        self._validate_static()

    def _validate_static(self) -> None:
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {t!r}")
        k = self.top_k
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {k!r}")
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not (0.0 < p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1] (1.0 = off), got {p!r}")
        n = self.max_new_tokens
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {n!r}")
        s = self.seed
        if isinstance(s, bool) or not isinstance(s, (int, np.integer)) or not 0 <= s <= _UINT32_MAX:
            raise ValueError(f"seed must be an integer in [0, 2**32), got {s!r}")
        for i in self.stop_token_ids:
            if isinstance(i, bool) or not isinstance(i, (int, np.integer)) or i < 0:
                raise ValueError(f"stop_token_ids must be integers >= 0, got {i!r}")
        lp = self.logprobs
        if lp is not None and (isinstance(lp, bool) or not isinstance(lp, (int, np.integer))
                               or not 0 <= lp <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be None or an integer in [0, {MAX_LOGPROBS}], "
                             f"got {lp!r}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias has {len(self.logit_bias)} entries, at most "
                             f"{MAX_LOGIT_BIAS} are allowed")
        seen = set()
        for i, b in self.logit_bias:
            if isinstance(i, bool) or not isinstance(i, (int, np.integer)) or i < 0:
                raise ValueError(f"logit_bias token ids must be integers >= 0, got {i!r}")
            if i in seen:
                raise ValueError(f"logit_bias names token id {i} twice")
            seen.add(i)
            if (isinstance(b, bool) or not isinstance(b, (int, float, np.floating, np.integer))
                    or not math.isfinite(b) or not -100 <= b <= 100):
                raise ValueError(f"logit_bias values must be numbers in [-100, 100], got "
                                 f"{b!r} for token id {i}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_number(v) or not -MAX_PENALTY <= v <= MAX_PENALTY:
                raise ValueError(f"{name} must be a number in [-{MAX_PENALTY:g}, "
                                 f"{MAX_PENALTY:g}] (0 = off), got {v!r}")
        r = self.repetition_penalty
        if not _is_number(r) or not r > 0:
            raise ValueError(f"repetition_penalty must be a finite number > 0 (1 = off), got "
                             f"{r!r}")
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar):
            raise ValueError(f"grammar must be a llguidance grammar string or None, got "
                             f"{type(self.grammar).__name__}")

    @property
    def penalized(self) -> bool:
        """Whether any of the three penalties is on."""
        return (self.presence_penalty != 0 or self.frequency_penalty != 0
                or self.repetition_penalty != 1)

    def validate(self, vocab_size: int) -> SamplingParams:
        """Checks every field against ``vocab_size``; returns self so calls can chain."""
        self._validate_static()
        for i in self.stop_token_ids:
            if i >= vocab_size:
                raise ValueError(
                    f"stop_token_ids entry {i} is outside the vocabulary [0, {vocab_size})"
                )
        for i, _ in self.logit_bias:
            if i >= vocab_size:
                raise ValueError(
                    f"logit_bias token id {i} is outside the vocabulary [0, {vocab_size})")
        return self


MAX_LOGPROBS = 20        # top log probabilities per token (OpenAI's most); steps.TOP_LOGPROBS
MAX_LOGIT_BIAS = 300     # logit_bias entries per request (OpenAI's most); steps.LOGIT_BIAS_MAX
MAX_PENALTY = 2.0        # presence / frequency penalties lie in [-2, 2] (OpenAI's range)


def _is_number(v) -> bool:
    """A finite real number (not a bool)."""
    return (not isinstance(v, bool) and isinstance(v, (int, float, np.integer, np.floating))
            and math.isfinite(v))


def _bias_pairs(v) -> tuple:
    """logit_bias as given (a dict or (id, bias) pairs) -> a tuple of pairs sorted by id
    (values checked by _validate_static)."""
    if isinstance(v, dict):
        v = v.items()
    try:
        pairs = [tuple(p) for p in v]
    except TypeError:
        raise ValueError(f"logit_bias must be a dict {{token id: bias}} or (id, bias) pairs, "
                         f"got {type(v).__name__}") from None
    if any(len(p) != 2 for p in pairs):
        raise ValueError("logit_bias pairs must be (token id, bias)")
    try:
        return tuple(sorted(pairs, key=lambda p: p[0]))
    except TypeError:
        raise ValueError("logit_bias token ids must be integers") from None
