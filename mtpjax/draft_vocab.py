"""A draft vocabulary: the MTP drafts over the N most frequent tokens only (FR-Spec, arXiv
2502.14856).

Why: at 27B a chained draft reads the MTP layer (~0.85 GB) and the whole 248,320 x 5,120
lm_head (2.5 GB) for one argmax, so three quarters of what a deeper step adds is lm_head. A
draft over N rows reads N x H. Verification still samples from the target's full logits
(steps._verify), so the output is the same token for token; only acceptance changes: a
draft whose full-vocabulary argmax lies outside the N rows proposes another token, which
the target almost always rejects.

A list is ranked once from token counts (`python -m experiments draft_vocab`: a text corpus
through the checkpoint's tokenizer and/or the model's own greedy outputs) and shipped beside
the checkpoint as `draft_vocab.json`; any N takes the first N ids of the ranking (ids never
seen follow in id order, so every N <= V is defined). At load time the engine gathers those
rows of the lm_head into a `params.DraftHead` (ascending ids, padded to a multiple of tp),
split by rows over the tensor-parallel shards like the lm_head.

File format (JSON): {"format": FORMAT, "vocab_size": V, "ids": [ranked ids seen],
"counts": [their counts], "source": "what was counted"}.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from mtpjax.params import DraftHead, Params

FILE = "draft_vocab.json"
FORMAT = "mtpjax-draft-vocab-1"

# The 27B's default: of 16k, 32k, 64k and all 248,320 rows, the size with the highest predicted
# H200 tokens/s at 1, 8 and 32 lanes (RESULTS.md "Draft vocabulary"; python -m experiments
# draft_vocab_sweep). Smaller vocabularies (the tiny's 4,096) draft over all of them.
DEFAULT_ROWS = 65536


def default_size(vocab_size: int) -> int | None:
    """The draft vocabulary an engine takes by default: DEFAULT_ROWS for a vocabulary of more
    than twice that (the 27B's), else None (the whole vocabulary)."""
    return DEFAULT_ROWS if vocab_size > 2 * DEFAULT_ROWS else None


@dataclasses.dataclass(frozen=True)
class DraftVocab:
    """Every token id ranked by its count, most frequent first (ties: lower id first)."""
    ranking: np.ndarray   # i32[V], a permutation of 0..V-1
    counts: np.ndarray    # i64[V], the count of each ranked id (0 for ids never seen)
    source: str = ""

    @property
    def vocab_size(self) -> int:
        return len(self.ranking)

    def top(self, n: int) -> np.ndarray:
        """The n most frequent ids, ascending (the draft head's row order)."""
        n = int(n)
        if not 1 <= n <= self.vocab_size:
            raise ValueError(f"a draft vocabulary holds 1..{self.vocab_size} tokens, got {n}")
        return np.sort(self.ranking[:n]).astype(np.int32)

    def coverage(self, n: int) -> float:
        """Share of the counted tokens that the top n cover."""
        total = int(self.counts.sum())
        return float(self.counts[:int(n)].sum() / total) if total else 0.0

    def save(self, path: str) -> None:
        seen = self.counts > 0
        doc = {"format": FORMAT, "vocab_size": self.vocab_size, "source": self.source,
               "ids": self.ranking[seen].tolist(), "counts": self.counts[seen].tolist()}
        with open(path, "w") as f:
            json.dump(doc, f)
            f.write("\n")

    @staticmethod
    def load(path: str, vocab_size: int | None = None) -> "DraftVocab":
        """From a draft_vocab.json file, or a checkpoint folder holding one."""
        if os.path.isdir(path):
            path = os.path.join(path, FILE)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"no draft vocabulary at {path}: build one with "
                                    "`python -m experiments draft_vocab`")
        with open(path) as f:
            doc = json.load(f)
        if doc.get("format") != FORMAT:
            raise ValueError(f"{path}: not a draft vocabulary file (format "
                             f"{doc.get('format')!r}, expected {FORMAT!r})")
        V = int(doc["vocab_size"])
        if vocab_size is not None and V != vocab_size:
            raise ValueError(f"{path}: ranks a vocabulary of {V} tokens, the model has "
                             f"{vocab_size}")
        counts = np.zeros(V, np.int64)
        ids = np.asarray(doc["ids"], np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= V or len(set(ids.tolist())) != len(ids)):
            raise ValueError(f"{path}: ids must be distinct and in [0, {V})")
        counts[ids] = np.asarray(doc["counts"], np.int64)
        return from_counts(counts, doc.get("source", ""))


def from_counts(counts: np.ndarray, source: str = "") -> DraftVocab:
    counts = np.asarray(counts, np.int64)
    if counts.ndim != 1 or (counts < 0).any():
        raise ValueError("counts must be a non-negative vector over the vocabulary")
    ranking = np.lexsort((np.arange(len(counts)), -counts)).astype(np.int32)
    return DraftVocab(ranking, counts[ranking], source)


def count_tokens(streams: Iterable[Sequence[int]], vocab_size: int,
                 always: Sequence[int] = ()) -> np.ndarray:
    """Counts i64[V] of the ids in `streams`; `always` (e.g. the end-of-turn ids: a draft of
    the end of a reply is worth a lot) rank first whatever their count."""
    counts = np.zeros(vocab_size, np.int64)
    for s in streams:
        a = np.asarray(s, np.int64).reshape(-1)
        if a.size and (a.min() < 0 or a.max() >= vocab_size):
            raise ValueError(f"token ids must lie in [0, {vocab_size})")
        counts += np.bincount(a, minlength=vocab_size)
    for t in always:
        counts[int(t)] = counts.max() + 1
    return counts


def resolve(spec, vocab_size: int, checkpoint: str | None = None) -> np.ndarray | None:
    """Ascending draft ids from a spec, or None (the whole vocabulary, no draft head).

    spec: None or 0 (whole vocabulary); "auto" (default_size, from the list beside
    `checkpoint` when it has one, else the whole vocabulary); an int N (the N most frequent ids of the list beside
    `checkpoint`); a float in (0, 1] (that share of the vocabulary, same list); a path to a
    draft_vocab.json (all its counted ids); a DraftVocab (all its counted ids); a sequence
    of token ids (used as given)."""
    if isinstance(spec, str) and spec == "auto":
        n = default_size(vocab_size)
        has_list = checkpoint is not None and os.path.isfile(
            checkpoint if not os.path.isdir(checkpoint) else os.path.join(checkpoint, FILE))
        return DraftVocab.load(checkpoint, vocab_size).top(n) if n and has_list else None
    if spec is None or (isinstance(spec, (int, np.integer)) and not isinstance(spec, bool)
                        and int(spec) == 0):
        return None
    if isinstance(spec, bool):
        raise ValueError(f"draft_vocab must be a size, a share, a path or token ids, got {spec}")
    if isinstance(spec, (int, np.integer, float)):
        if checkpoint is None:
            raise ValueError("a draft_vocab size is resolved against the list shipped beside "
                             "a checkpoint: use Engine.from_checkpoint(path, draft_vocab=N), "
                             "or pass the token ids (DraftVocab.load(path).top(N))")
        dv = DraftVocab.load(checkpoint, vocab_size)
        n = int(round(spec * vocab_size)) if isinstance(spec, float) else int(spec)
        if isinstance(spec, float) and not 0 < spec <= 1:
            raise ValueError(f"a draft_vocab share must lie in (0, 1], got {spec}")
        return dv.top(n)
    if isinstance(spec, str):
        dv = DraftVocab.load(spec, vocab_size)
        return dv.top(max(1, int((dv.counts > 0).sum())))
    if isinstance(spec, DraftVocab):
        if spec.vocab_size != vocab_size:
            raise ValueError(f"draft vocabulary ranks {spec.vocab_size} tokens, the model has "
                             f"{vocab_size}")
        return spec.top(max(1, int((spec.counts > 0).sum())))
    ids = np.asarray(spec).reshape(-1)
    if ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"draft_vocab token ids must be a non-empty integer list, got {spec!r}")
    if ids.min() < 0 or ids.max() >= vocab_size:
        raise ValueError(f"draft_vocab token ids must lie in [0, {vocab_size})")
    if len(np.unique(ids)) != len(ids):
        raise ValueError("draft_vocab token ids must be distinct")
    return np.sort(ids).astype(np.int32)


def build_head(params: Params, ids: np.ndarray, tp: int = 1, mesh=None) -> DraftHead:
    """The draft head [N', H] of `ids` (ascending), N' = N padded to a multiple of tp with
    zero rows of id -1; on `mesh`, rows split over its tp axis (each shard a block of
    ascending ids, what model.draft_tokens' shard reduction assumes)."""
    from jax.sharding import NamedSharding, PartitionSpec as P
    from mtpjax.tensor_parallel import TP_AXIS
    w = params.embed if params.lm_head is None else params.lm_head
    ids = np.asarray(ids, np.int32)
    pad = -len(ids) % tp
    rows = jnp.take(w, jnp.asarray(ids), axis=0)                    # global gather: [N, H]
    rows = np.concatenate([np.asarray(jax.device_get(rows)),
                           np.zeros((pad, w.shape[1]), np.asarray(rows).dtype)])
    ids = np.concatenate([ids, np.full((pad,), -1, np.int32)])
    if mesh is None:
        return DraftHead(jnp.asarray(rows), jnp.asarray(ids))
    spec = P(TP_AXIS) if tp > 1 else P()
    return DraftHead(jax.device_put(rows, NamedSharding(mesh, P(*spec, None) if tp > 1 else P())),
                     jax.device_put(ids, NamedSharding(mesh, spec)))


def head_spec(tp: int) -> DraftHead:
    """The shard_map in_specs of a draft head."""
    from jax.sharding import PartitionSpec as P
    from mtpjax.tensor_parallel import TP_AXIS
    return DraftHead(P(TP_AXIS, None), P(TP_AXIS)) if tp > 1 else DraftHead(P(), P())


def abstract_head(n: int, hidden: int, dtype, tp: int = 1, mesh=None) -> DraftHead:
    """ShapeDtypeStructs of an n-row draft head (deviceless compiles, experiments/aot.py)."""
    from jax.sharding import NamedSharding
    rows = n + (-n % tp)
    spec = head_spec(tp)
    sh = (lambda s: NamedSharding(mesh, s)) if mesh is not None else (lambda s: None)
    return DraftHead(jax.ShapeDtypeStruct((rows, hidden), jnp.dtype(dtype), sharding=sh(spec.weight)),
                     jax.ShapeDtypeStruct((rows,), jnp.int32, sharding=sh(spec.ids)))
