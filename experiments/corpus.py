"""A training/evaluation corpus present on every machine: the Python standard library's source.

Files are the `*.py` under `sysconfig.get_paths()["stdlib"]` (site-packages excluded), sorted
by relative path. The split is by file and depends only on the relative path (a hash), so it is
the same on every machine and Python version: a file is held out iff
`sha256(relpath) mod 100 < heldout_percent`.

Documents are joined with the `<|endoftext|>` token between them when tokenised.
"""

from __future__ import annotations

import functools
import hashlib
import os
import sysconfig
from typing import Iterator

import numpy as np

EOT = "<|endoftext|>"
SKIP_DIRS = ("site-packages", "dist-packages", "__pycache__")
MAX_FILE_BYTES = 400_000  # a few huge generated tables (e.g. unicode data) would dominate


def stdlib_root() -> str:
    return sysconfig.get_paths()["stdlib"]


def is_heldout(relpath: str, heldout_percent: int = 5) -> bool:
    h = hashlib.sha256(relpath.replace(os.sep, "/").encode()).digest()
    return int.from_bytes(h[:8], "big") % 100 < heldout_percent


@functools.lru_cache(maxsize=4)
def list_files(root: str | None = None) -> tuple[str, ...]:
    """Relative paths of the corpus files, sorted (deterministic)."""
    root = root or stdlib_root()
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
        for fn in filenames:
            if fn.endswith(".py"):
                full = os.path.join(dirpath, fn)
                try:
                    if os.path.getsize(full) > MAX_FILE_BYTES:
                        continue
                except OSError:
                    continue
                out.append(os.path.relpath(full, root).replace(os.sep, "/"))
    return tuple(sorted(out))


def split_files(split: str, heldout_percent: int = 5, root: str | None = None) -> list[str]:
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    want = split == "heldout"
    return [p for p in list_files(root) if is_heldout(p, heldout_percent) == want]


def read_file(relpath: str, root: str | None = None) -> str | None:
    root = root or stdlib_root()
    try:
        with open(os.path.join(root, relpath), encoding="utf-8") as f:
            text = f.read()
    except (UnicodeDecodeError, OSError):
        return None
    return text.replace("\r\n", "\n")


def iter_texts(split: str, heldout_percent: int = 5, root: str | None = None,
               max_files: int | None = None) -> Iterator[str]:
    """Text of each (non-empty, UTF-8) file of the split, in sorted order."""
    n = 0
    for p in split_files(split, heldout_percent, root):
        t = read_file(p, root)
        if not t or not t.strip():
            continue
        yield t
        n += 1
        if max_files is not None and n >= max_files:
            return


def texts(split: str, heldout_percent: int = 5, root: str | None = None,
          max_files: int | None = None) -> list[str]:
    return list(iter_texts(split, heldout_percent, root, max_files))


def encode_docs(tokenizer, docs: list[str], eot_id: int, batch_size: int = 256) -> np.ndarray:
    """Token ids of the documents joined by <|endoftext|> (one before each doc), int32."""
    parts = []
    for i in range(0, len(docs), batch_size):
        for enc in tokenizer.encode_batch(docs[i:i + batch_size]):
            parts.append(np.asarray([eot_id], np.int32))
            parts.append(np.asarray(enc.ids, np.int32))
    return np.concatenate(parts) if parts else np.zeros((0,), np.int32)


def token_array(tokenizer, split: str, heldout_percent: int = 5, root: str | None = None,
                max_files: int | None = None, max_tokens: int | None = None) -> np.ndarray:
    """The split as one int32 token stream (documents separated by <|endoftext|>)."""
    eot_id = tokenizer.token_to_id(EOT)
    if eot_id is None:
        raise ValueError(f"tokenizer has no {EOT} token")
    arr = encode_docs(tokenizer, texts(split, heldout_percent, root, max_files), eot_id)
    return arr[:max_tokens] if max_tokens is not None else arr


def batches(tokens: np.ndarray, batch: int, seq_len: int, seed: int) -> Iterator[np.ndarray]:
    """Endless random windows [batch, seq_len + 2] of the stream (deterministic given seed).

    seq_len + 2 tokens per row: inputs t_0..t_{L-1}, next-token targets t_1..t_L and the MTP's
    t+2 targets t_2..t_{L+1}.
    """
    rng = np.random.default_rng(seed)
    n = len(tokens) - (seq_len + 2)
    if n <= 0:
        raise ValueError(f"corpus of {len(tokens)} tokens is shorter than a window of {seq_len + 2}")
    while True:
        starts = rng.integers(0, n, size=batch)
        yield np.stack([tokens[s:s + seq_len + 2] for s in starts])
