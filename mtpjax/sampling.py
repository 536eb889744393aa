"""Token sampling shared by plain decoding and speculative verification.

Data flow (one decode or verify step, all on device, no host sync):

1. ``processed_probs`` turns logits into the target distribution p: temperature, then
   top-k, then top-p on the renormalised top-k distribution. Greedy rows
   (temperature 0) become a one-hot on the argmax.
2. ``position_uniform`` draws one uniform u in [0, 1) per token from
   ``fold_in(key(seed), position)``. The key depends only on the request seed and the
   absolute sequence position the token will occupy. It never depends on the lane index,
   the batch size or the number of speculative tokens, so a request gives the same
   tokens in any lane, any batch and any speculation depth.
3. ``sample_from_uniform`` inverts the CDF of p at u, in vocabulary order.

``sample`` is plain decoding (steps 1-3 for one position per lane). ``verify`` runs
steps 1-3 for every one of the K+1 positions that a speculative step covers, then keeps
the longest prefix on which the sampled tokens agree with the drafts.

Why ``verify`` is lossless
--------------------------
Row j of the target logits is the target's distribution p_j for position
``first_position + j``, given the committed context plus ``drafts[:j]``. ``verify``
samples ``t_j = sample(p_j, u_j)`` with the same uniform u_j that plain sampling would use
at that position, and accepts draft j while ``t_j == drafts[j]``. It emits
``t_0 .. t_a``, where a is the number of accepted drafts. So:

* Per seed, the output is exactly the plain output. Every emitted token is a plain
  sample: for j < a, t_j equals the draft, and t_a is the plain sample at position a.
  t_j is only emitted when ``drafts[:j]`` were accepted, that is when the context that
  row j was computed with is the true context. The drafts only decide how many plain
  samples one step emits, never which ones. This holds for any drafter, stochastic or
  not, as long as the target logits match the plain engine's bit for bit; numerical
  differences between the verify and the decode forward can flip a token whose u lies
  within rounding of a CDF breakpoint.
* In distribution it is rejection sampling with a one-hot draft q = delta_d. The
  standard rule accepts d with probability min(1, p(d) / q(d)) = p(d) and, on
  rejection, draws from norm(max(p - q, 0)), which is p restricted to tokens != d and
  renormalised. Here ``t == d`` has probability p(d), and conditioned on ``t != d``, t is
  distributed as p restricted to tokens != d. The two rules coincide, so the marginal
  of each emitted token is exactly p.

Two mistakes break this, and tests/test_sampling.py shows that each one fails:
accepting the draft without checking it against p, and, after rejecting d, drawing
again from the full p, which can return d a second time.

Top-k and top-p never sort the vocabulary (the real one has 248,320 entries). The
threshold value is found by bisection over the order-preserving uint32 bit pattern of
the float32 values: 32 passes of O(V) counting or summing give the exact threshold.
Ties: every token equal to the threshold is kept, for top-k as well as for top-p, so
top-k can keep more than k tokens and top-p more than the smallest set.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

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


@dataclasses.dataclass(frozen=True)
class LaneSampling:
    """Per-lane sampling settings as device arrays, one entry per batch lane."""

    temperature: jax.Array  # f32[B]
    top_k: jax.Array  # i32[B]
    top_p: jax.Array  # f32[B]
    seed: jax.Array  # u32[B]

    @classmethod
    def from_params(
        cls, params: Sequence[SamplingParams], pad_to: int | None = None
    ) -> LaneSampling:
        """Builds lanes from host params. ``pad_to`` fills lanes to a fixed batch size
        with greedy defaults, so the step function sees one shape and does not recompile."""
        params = list(params)
        if pad_to is not None:
            if pad_to < len(params):
                raise ValueError(f"pad_to={pad_to} is smaller than the {len(params)} params")
            params += [SamplingParams()] * (pad_to - len(params))
        return cls(
            temperature=jnp.asarray(np.array([p.temperature for p in params], np.float32)),
            top_k=jnp.asarray(np.array([p.top_k for p in params], np.int32)),
            top_p=jnp.asarray(np.array([p.top_p for p in params], np.float32)),
            seed=jnp.asarray(np.array([p.seed for p in params], np.uint32)),
        )


jax.tree_util.register_dataclass(
    LaneSampling, data_fields=["temperature", "top_k", "top_p", "seed"], meta_fields=[]
)


@jax.jit
def position_uniform(seed: jax.Array, position: jax.Array) -> jax.Array:
    """Uniform in [0, 1) for the token at absolute ``position`` of the request ``seed``.

    Args:
      seed: u32[...], the request seed.
      position: i32[...], same shape as seed: the sequence index the sampled token
        will occupy (prompt tokens count, the first generated token sits at the
        prompt length).

    Returns:
      f32[...]. It depends only on (seed, position), which is what lets speculative and
      plain decoding draw identical tokens.
    """
    shape = jnp.broadcast_shapes(jnp.shape(seed), jnp.shape(position))
    seed = jnp.broadcast_to(seed, shape).astype(jnp.uint32).reshape(-1)
    position = jnp.broadcast_to(position, shape).astype(jnp.int32).reshape(-1)
    draw = jax.vmap(lambda s, p: jax.random.uniform(jax.random.fold_in(jax.random.key(s), p)))
    return draw(seed, position).reshape(shape)


def _ordered_key(x: jax.Array) -> jax.Array:
    """f32[...] -> u32[...] whose unsigned order is the float order (radix-sort trick).

    -0.0 becomes +0.0 first, so that keys tie exactly when the float values do.
    """
    x = jnp.where(x == 0, jnp.float32(0), x.astype(jnp.float32))
    bits = lax.bitcast_convert_type(x, jnp.uint32)
    negative = (bits >> 31) == 1
    return jnp.where(negative, ~bits, bits | jnp.uint32(0x80000000))


def _largest_key_reaching(keys: jax.Array, weights: jax.Array, target: jax.Array) -> jax.Array:
    """Largest t with sum(weights[keys >= t]) >= target, per row, built bit by bit.

    The mass above t only falls as t grows, so deciding the bits from the most
    significant one down is a bisection over all 2**32 keys: 32 O(V) reductions, no sort.
    The result is always the key of a present value (the mass only changes at present
    keys), so ``keys >= t`` keeps every token tied with the threshold. If no t reaches
    target, t = 0 and every token is kept.

    Args:
      keys: u32[B, V].
      weights: [B, V], int32 ones for top-k counts, float32 probabilities for top-p.
      target: [B], same dtype as weights.

    Returns:
      u32[B].
    """

    def body(i, t):  # t: u32[B]
        bit = jnp.left_shift(jnp.uint32(1), (31 - i).astype(jnp.uint32))
        cand = t | bit
        mass = jnp.sum(jnp.where(keys >= cand[:, None], weights, 0), axis=-1)
        return jnp.where(mass >= target, cand, t)

    return lax.fori_loop(0, 32, body, jnp.zeros(keys.shape[:1], jnp.uint32))


@jax.jit
def processed_probs(
    logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array
) -> jax.Array:
    """The distribution a lane samples from: temperature, then top-k, then top-p.

    Args:
      logits: f32[B, V].
      temperature: f32[B]; 0 gives a one-hot on the argmax (lowest index on ties).
      top_k: i32[B]; 0, or >= V, means off. Keeps every token >= the k-th largest logit.
      top_p: f32[B]; 1.0 means off. Keeps the smallest set of most probable tokens of
        the renormalised top-k distribution whose mass is >= top_p, plus every token
        tied with the smallest kept probability.

    Returns:
      f32[B, V], rows sum to 1.
    """
    with jax.named_scope("processed_probs"):
        logits = logits.astype(jnp.float32)
        _, vocab = logits.shape
        greedy = temperature <= 0
        safe_t = jnp.where(greedy, 1.0, temperature).astype(jnp.float32)
        scaled = logits / safe_t[:, None]  # [B, V]

        # Top-k on the raw logits: same order as the scaled ones for T > 0, and dividing
        # by T cannot merge two distinct values into one.
        use_k = (top_k > 0) & (top_k < vocab)
        k = jnp.where(use_k, top_k, vocab).astype(jnp.int32)
        logit_keys = _ordered_key(logits)
        # The bisections read the [B, V] rows 32 times each (about 2 GB per 27B step at 32
        # rows): run them only when some row filters; kth = 0 / tau = 0 keep every token.
        kth = lax.cond(jnp.any(use_k),
                       lambda: _largest_key_reaching(
                           logit_keys, jnp.ones_like(logit_keys, jnp.int32), k),
                       lambda: jnp.zeros(k.shape, jnp.uint32))
        keep = logit_keys >= kth[:, None]  # [B, V]

        row_max = jnp.max(jnp.where(keep, scaled, -jnp.inf), axis=-1, keepdims=True)
        q = jnp.where(keep, jnp.exp(scaled - row_max), 0.0)  # unnormalised, [B, V]

        # Top-p on the unnormalised weights: mass >= top_p * total avoids the float32
        # total falling just short of 1.
        use_p = top_p < 1.0
        total = jnp.sum(q, axis=-1)
        q_keys = _ordered_key(q)
        tau = lax.cond(jnp.any(use_p),
                       lambda: _largest_key_reaching(q_keys, q, top_p.astype(jnp.float32) * total),
                       lambda: jnp.zeros(total.shape, jnp.uint32))
        q = jnp.where(use_p[:, None] & (q_keys < tau[:, None]), 0.0, q)

        probs = q / jnp.sum(q, axis=-1, keepdims=True)
        one_hot = jax.nn.one_hot(jnp.argmax(logits, axis=-1), vocab, dtype=jnp.float32)
        return jnp.where(greedy[:, None], one_hot, probs)


@jax.jit
def sample_from_uniform(probs: jax.Array, u: jax.Array) -> jax.Array:
    """Inverse CDF in vocabulary order: the first index whose cumulative sum exceeds u * total.

    A one-hot (greedy) row returns its argmax for every u in [0, 1). If rounding pushes
    u * total to the top of the CDF, the result is clamped to the last token with nonzero
    probability, so a zero-probability token is never returned.

    Args:
      probs: f32[B, V], nonnegative, not necessarily normalised.
      u: f32[B] in [0, 1).

    Returns:
      i32[B].
    """
    with jax.named_scope("sample_from_uniform"):
        vocab = probs.shape[-1]
        cdf = jnp.cumsum(probs, axis=-1)  # [B, V]
        target = u.astype(jnp.float32) * cdf[:, -1]
        idx = jnp.sum(cdf <= target[:, None], axis=-1, dtype=jnp.int32)
        last_nonzero = vocab - 1 - jnp.argmax((probs > 0)[:, ::-1], axis=-1).astype(jnp.int32)
        return jnp.minimum(idx, last_nonzero)


@jax.jit
def sample(logits: jax.Array, lanes: LaneSampling, positions: jax.Array) -> jax.Array:
    """Plain sampling of one token per lane.

    Args:
      logits: f32[B, V].
      lanes: settings for B lanes.
      positions: i32[B], absolute position the sampled token will occupy.

    Returns:
      i32[B].
    """
    probs = processed_probs(logits, lanes.temperature, lanes.top_k, lanes.top_p)
    return sample_from_uniform(probs, position_uniform(lanes.seed, positions))


@jax.jit
def verify_from_uniforms(
    target_logits: jax.Array, drafts: jax.Array, lanes: LaneSampling, u: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """``verify`` with the uniforms given, so that tests can enumerate them.

    Args:
      target_logits: f32[B, K+1, V].
      drafts: i32[B, K].
      lanes: settings for B lanes.
      u: f32[B, K+1], the uniform for each position.

    Returns:
      num_accepted i32[B] in [0, K]; tokens i32[B, K+1], ``tokens[:, :a+1]`` are the
      emitted tokens and the rest are -1.
    """
    with jax.named_scope("verify"):
        batch, k1, vocab = target_logits.shape
        rep = lambda x: jnp.repeat(x, k1)  # [B] -> [B*(K+1)], lane-major
        probs = processed_probs(
            target_logits.reshape(batch * k1, vocab),
            rep(lanes.temperature),
            rep(lanes.top_k),
            rep(lanes.top_p),
        )
        t = sample_from_uniform(probs, u.reshape(-1)).reshape(batch, k1)  # [B, K+1]
        return accept(t, drafts)


def accept(target_tokens: jax.Array, drafts: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Accept drafts while they equal the target's tokens.

    Args:
      target_tokens: i32[B, K+1], the target's token at each position.
      drafts: i32[B, K].

    Returns:
      ``verify``'s (num_accepted i32[B], tokens i32[B, K+1] with -1 after the emitted ones).
    """
    k1 = target_tokens.shape[1]
    match = (target_tokens[:, : k1 - 1] == drafts).astype(jnp.int32)  # [B, K]
    num_accepted = jnp.sum(jnp.cumprod(match, axis=1), axis=1).astype(jnp.int32)
    emitted = jnp.arange(k1)[None, :] <= num_accepted[:, None]
    return num_accepted, jnp.where(emitted, target_tokens, -1).astype(jnp.int32)


@jax.jit
def verify(
    target_logits: jax.Array, drafts: jax.Array, lanes: LaneSampling, first_position: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Speculative verification of K drafts per lane, lossless (see module docstring).

    Args:
      target_logits: f32[B, K+1, V]; row j is the target's distribution for the token
        at position first_position + j, computed with drafts[:, :j] in the context.
      drafts: i32[B, K], the proposed tokens for positions first_position + 0 .. K-1.
      lanes: settings for B lanes.
      first_position: i32[B], the absolute position of the first new token.

    Returns:
      num_accepted i32[B] in [0, K]; tokens i32[B, K+1] with ``tokens[:, :a+1]`` the
      a + 1 emitted tokens (the accepted drafts, then the correction or bonus token),
      and -1 after them.
    """
    k1 = target_logits.shape[1]
    positions = first_position[:, None].astype(jnp.int32) + jnp.arange(k1, dtype=jnp.int32)
    u = position_uniform(lanes.seed[:, None], positions)  # [B, K+1]
    return verify_from_uniforms(target_logits, drafts, lanes, u)
