"""Tuning knobs for the Pallas (Triton) kernels, kept as data.

Every kernel in this package takes an optional ``tuning`` object. When it is
``None`` the kernel looks up a table below, keyed by the static shapes that
matter for code generation, and falls back to a default entry. The numbers in
the tables are first guesses checked only for *lowering* (Triton needs
power-of-two block shapes and dots with M, N, K >= 16); they have not yet been
timed on a GPU. A benchmark sweep should overwrite the table rows, not the
kernel code.

Knobs shared by all configs:

* ``num_warps`` / ``num_stages``: passed to ``pltr.CompilerParams``; passing
  them is also what selects the Triton backend on CUDA (a ``pallas_call``
  without compiler params goes to Mosaic GPU in jax 0.10).
"""

from __future__ import annotations

import dataclasses

# Every dimension (M, N and K) of a dot inside a Triton kernel must be >= 16.
TRITON_MIN_DOT = 16


def _is_pow2(x: int) -> bool:
  return x > 0 and (x & (x - 1)) == 0


def next_pow2(x: int) -> int:
  """Smallest power of two >= max(x, 1)."""
  x = max(int(x), 1)
  return 1 << (x - 1).bit_length()


def _check_launch(num_warps: int, num_stages: int) -> None:
  if not _is_pow2(num_warps) or num_warps > 32:
    raise ValueError(f"num_warps must be a power of two <= 32, got {num_warps}")
  if num_stages < 1:
    raise ValueError(f"num_stages must be >= 1, got {num_stages}")


# --------------------------------------------------------------------------
# Paged attention
# --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PagedAttentionTuning:
  """Block sizes of :func:`pallas_kernels.paged_attention`.

  Attributes:
    max_block_rows: the query rows (``Tq * G`` folded together) of one program
      are padded to a power of two; when that exceeds ``max_block_rows`` the
      rows are split into blocks of ``max_block_rows`` (prefill chunks). Must
      be a power of two >= 16.
    pages_per_compute_block: pages gathered per online-softmax step; the
      step's key block is ``pages_per_compute_block * page_size`` tokens, a
      dot dimension: the compiled (Triton) kernel rejects a block below
      ``TRITON_MIN_DOT`` = 16 tokens with a ValueError (the page size is known
      only at the call, so the check is there). Power of two.
    k_splits: number of partitions of the page table processed by separate
      programs and merged afterwards (flash-decoding). ``None`` = choose so
      that the grid has roughly ``target_programs`` programs.
    target_programs: used only when ``k_splits`` is ``None``.
    num_warps, num_stages: Triton launch parameters.
  """

  max_block_rows: int = 64
  pages_per_compute_block: int = 4
  k_splits: int | None = None
  target_programs: int = 256
  num_warps: int = 4
  num_stages: int = 2

  def __post_init__(self):
    if not _is_pow2(self.max_block_rows) or self.max_block_rows < 16:
      raise ValueError(
          f"max_block_rows must be a power of two >= 16, got {self.max_block_rows}")
    if not _is_pow2(self.pages_per_compute_block):
      raise ValueError("pages_per_compute_block must be a power of two, got "
                       f"{self.pages_per_compute_block}")
    if self.k_splits is not None and self.k_splits < 1:
      raise ValueError(f"k_splits must be >= 1 or None, got {self.k_splits}")
    if self.target_programs < 1:
      raise ValueError(f"target_programs must be >= 1, got {self.target_programs}")
    _check_launch(self.num_warps, self.num_stages)

  @property
  def name(self) -> str:
    return (f"rows{self.max_block_rows}_ppcb{self.pages_per_compute_block}_"
            f"w{self.num_warps}_s{self.num_stages}")


# key: (head_dim, page_size, mode). mode is "decode" when the folded query
# rows of one (lane, kv head) fit one block (Tq * G <= 64: decode and verify),
# else "prefill". The key block is pages_per_compute_block * page_size tokens;
# aim for 64 keys per step in decode (q block <= 64x256, k/v blocks 64x256
# bf16) and 32 keys with 8 warps in prefill, where the 64x256 f32 accumulator
# is the largest live value.
PAGED_ATTENTION_TABLE: dict[tuple[int, int, str], PagedAttentionTuning] = {
    (256, 16, "decode"): PagedAttentionTuning(max_block_rows=64, pages_per_compute_block=4,
                                              num_warps=4, num_stages=2),
    (256, 16, "prefill"): PagedAttentionTuning(max_block_rows=64, pages_per_compute_block=2,
                                               num_warps=8, num_stages=2),
    (256, 32, "decode"): PagedAttentionTuning(max_block_rows=64, pages_per_compute_block=2,
                                              num_warps=4, num_stages=2),
    (256, 32, "prefill"): PagedAttentionTuning(max_block_rows=64, pages_per_compute_block=1,
                                               num_warps=8, num_stages=2),
    (128, 16, "decode"): PagedAttentionTuning(max_block_rows=64, pages_per_compute_block=8,
                                              num_warps=4, num_stages=2),
}


def get_paged_attention_tuning(head_dim: int, page_size: int,
                               num_rows: int = 1) -> PagedAttentionTuning:
  """Table entry for (head_dim, page_size, mode), else a default (64 keys/step).

  ``num_rows`` is ``Tq * G``, the folded query rows of one (lane, kv head).
  """
  mode = "decode" if num_rows <= 64 else "prefill"
  hit = PAGED_ATTENTION_TABLE.get((head_dim, page_size, mode))
  if hit is not None:
    return hit
  ppcb = next_pow2(max(1, 64 // max(page_size, 1)))
  return PagedAttentionTuning(pages_per_compute_block=ppcb)


# --------------------------------------------------------------------------
# Gated delta rule
# --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class GatedDeltaTuning:
  """Block sizes of the gated-delta kernels.

  The delta rule is separable over the value dimension (each column of the
  ``[DK, DV]`` state evolves on its own given k, g, beta), so both kernels
  run a grid over ``(B, H, DV // block_v)``; a smaller ``block_v`` means more
  programs and fewer registers per program.

  Attributes:
    block_v: value columns per program. Power of two dividing DV.
    num_warps, num_stages: Triton launch parameters.
  """

  block_v: int = 32
  num_warps: int = 4
  num_stages: int = 1

  def __post_init__(self):
    if not _is_pow2(self.block_v):
      raise ValueError(f"block_v must be a power of two, got {self.block_v}")
    _check_launch(self.num_warps, self.num_stages)

  @property
  def name(self) -> str:
    return f"bv{self.block_v}_w{self.num_warps}_s{self.num_stages}"


# key: (kernel, DK, DV). "chunk" = chunked prefill (a [C, DK] x [DK, bv]
# matmul pipeline per chunk), "verify" = per-token recurrence (matvecs), "verify_head" = the
# same, one program per head (block_v = DV).
GATED_DELTA_TABLE: dict[tuple[str, int, int], GatedDeltaTuning] = {
    ("chunk", 128, 128): GatedDeltaTuning(block_v=32, num_warps=8, num_stages=1),
    ("verify", 128, 128): GatedDeltaTuning(block_v=32, num_warps=4, num_stages=1),
    # one program per head (pending writes and the output norm inside): the [128, 128] f32
    # state over 8 warps, 64 registers a thread. Untimed: no GPU has run it yet.
    ("verify_head", 128, 128): GatedDeltaTuning(block_v=128, num_warps=8, num_stages=1),
}


def get_gated_delta_tuning(kernel: str, dk: int, dv: int) -> GatedDeltaTuning:
  """Table entry for (kernel, DK, DV), else block_v = min(32, next_pow2(DV)).

  The kernels clamp ``block_v`` to DV and, in interpret mode only, fall back
  to one block of DV columns when ``block_v`` does not divide DV.
  """
  if kernel not in ("chunk", "verify", "verify_head"):
    raise ValueError(f"unknown gated-delta kernel {kernel!r}")
  hit = GATED_DELTA_TABLE.get((kernel, dk, dv))
  if hit is not None:
    return hit
  if kernel == "verify_head":         # one program per head: all DV columns
    return GatedDeltaTuning(block_v=next_pow2(dv))
  return GatedDeltaTuning(block_v=min(32, next_pow2(dv)))


# --------------------------------------------------------------------------
# FP8 weight-only matmul
# --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Fp8MatmulTuning:
  """Tile sizes of :func:`pallas_kernels.fp8_matmul` (y = x @ dequant(q).T).

  Attributes:
    block_o: output channels per program (``BO``, the dot's N). Power of two
      >= 16. A per-tile scalar scale is used when the weight block's ``bo`` is
      a multiple of it, else a per-row scale vector.
    block_k: input features per loop step (``BK``, the dot's K). Power of two
      >= 16; the kernel cuts it to the largest power of two dividing the
      block's ``bi`` (several input blocks) or to ``next_pow2(I)`` (one).
    block_t: token rows per program (``BT``, the dot's M) when the token count,
      padded to a power of two >= 16, exceeds it. Power of two >= 16.
    num_warps, num_stages: Triton launch parameters.
  """

  block_o: int = 64
  block_k: int = 128
  block_t: int = 64
  num_warps: int = 4
  num_stages: int = 3

  def __post_init__(self):
    for name in ("block_o", "block_k", "block_t"):
      v = getattr(self, name)
      if not _is_pow2(v) or v < TRITON_MIN_DOT:
        raise ValueError(f"{name} must be a power of two >= {TRITON_MIN_DOT}, got {v}")
    _check_launch(self.num_warps, self.num_stages)

  @property
  def name(self) -> str:
    return (f"bo{self.block_o}_bk{self.block_k}_bt{self.block_t}_"
            f"w{self.num_warps}_s{self.num_stages}")


# key: mode. "decode" = at most 64 token rows (decode / verify: the weight
# stream dominates, one token tile), "prefill" = more. Untimed first guesses.
FP8_MATMUL_TABLE: dict[str, Fp8MatmulTuning] = {
    "decode": Fp8MatmulTuning(block_o=64, block_k=128, block_t=64, num_warps=4,
                              num_stages=3),
    "prefill": Fp8MatmulTuning(block_o=128, block_k=128, block_t=64, num_warps=8,
                               num_stages=3),
}


def get_fp8_matmul_tuning(num_rows: int, out_features: int,
                          in_features: int) -> Fp8MatmulTuning:
  """Table entry for the mode of ``num_rows`` tokens.

  In decode, ``block_o`` is halved (down to 16) while the grid would have
  fewer than ~264 programs (two per H200 SM), e.g. the 5120-wide outputs.
  """
  del in_features
  mode = "decode" if num_rows <= 64 else "prefill"
  t = FP8_MATMUL_TABLE[mode]
  if mode == "decode":
    bo = t.block_o
    while bo > 16 and -(-out_features // bo) < 264:
      bo //= 2
    if bo != t.block_o:
      t = dataclasses.replace(t, block_o=bo)
  return t
