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

from mtpjax.sampling_params import (MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_PENALTY,  # noqa: F401
                                    SamplingParams)


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
