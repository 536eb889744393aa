"""A cost model of Qwen3.5-27B on one H200 (bf16 or FP8 weights; tp 1..8), priced from the
shapes of the programs the engine launches. FIRST VERSION: the API is final, the numbers are
being refined (see the validation against the deviceless audit, tests/test_cost_model.py).

Time of one program = max(HBM bytes / achievable bandwidth, FLOPs / achievable tensor
throughput) + launch cost x kernels in the compiled program + a fixed cost per program.

What it counts, per program (steps.decode_step, steps.prefill_chunk, the draft chain,
steps.move_lane, snapshots.save / restore), from the config and the engine's cache layout
(model.init_paged_cache, steps.LaneState), never from the audit:
  weights       every weight a pass reads (target pass: every text weight but the embedding
                table, lm_head included; MTP pass: the MTP head), once per pass;
  lm_head_extra lm_head re-read per draft (argmax) and for a prefill's first token;
  kv_read       K and V of the context each lane's attention reads (target full-attention
                layers per target pass, the MTP layer per MTP pass);
  kv_write      the K and V the program writes;
  gdn_state     each lane's GDN slot as the cache holds it: recurrent state [NV, DK, DV] f32
                read + written, conv window [KC-1+P, CONV] and pending buffers (P = K + 1
                slots of k, v, g, beta) read + written;
  activations   per-token tensors between kernels (see `_activation_bytes`).
FLOPs: 2 x tokens x linear weights touched, attention (QK^T and PV over the context), the
GDN recurrence.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from typing import Mapping, Sequence

import numpy as np

from mtpjax import tensor_parallel
from mtpjax.config import FULL, Config, qwen3_5_27b

GB = 1e9


@dataclasses.dataclass(frozen=True)
class Hardware:
    """Achievable (measured, published) numbers, not datasheet peaks; each with its source."""
    name: str
    hbm_bytes_per_s: float
    bf16_flops_per_s: float
    fp8_flops_per_s: float
    launch_s: float         # per kernel launched inside one program (CUDA-graph-like replay)
    program_s: float        # fixed cost per program launch from the host
    sources: Mapping[str, str]


H200 = Hardware(
    name="NVIDIA H200 SXM 141 GB",
    hbm_bytes_per_s=4.0e12,
    bf16_flops_per_s=660e12,
    fp8_flops_per_s=1300e12,
    launch_s=2e-6,
    program_s=20e-6,
    sources={
        "hbm_bytes_per_s": "assumption (first version): ~83% of the 4.8 TB/s datasheet peak",
        "bf16_flops_per_s": "assumption (first version): ~67% of the 989 TFLOP/s dense peak",
        "fp8_flops_per_s": "assumption (first version): ~66% of the 1979 TFLOP/s dense peak",
        "launch_s": "assumption (first version)",
        "program_s": "assumption (first version)",
    })


@dataclasses.dataclass(frozen=True)
class Cost:
    """One program's modelled cost. bytes: what the compiled program moves, by term;
    must_read: what the step must read at least (same terms; a term missing is 0)."""
    bytes: Mapping[str, float]
    flops: float
    kernels: int
    seconds: float
    must_read: Mapping[str, float] = dataclasses.field(default_factory=dict)

    @property
    def total_bytes(self) -> float:
        return float(sum(self.bytes.values()))

    @property
    def must_read_bytes(self) -> float:
        return float(sum(self.must_read.values()))


def _weight_bytes(cfg: Config, weights: str, tp: int) -> dict[str, float]:
    """Bytes one device holds by role: target (text weights but the embedding; lm_head
    included, the embedding when tied), mtp (the MTP head), lm_head, embed."""
    from mtpjax.params import fp8_block, fp8_paths, leaf_dtype, leaf_shapes
    fp8 = fp8_paths(cfg, "fp8" if weights == "fp8" else "dense")
    out = {"target": 0.0, "mtp": 0.0, "lm_head": 0.0, "embed": 0.0}
    for path, shape in leaf_shapes(cfg, split_ba=bool(fp8)).items():
        n = int(np.prod(shape))
        if path in fp8:
            bo, bi = fp8_block(cfg, path, True)
            b = n * 1 + math.ceil(shape[0] / bo) * math.ceil(shape[1] / bi) * 4
        else:
            b = n * leaf_dtype(path, "bfloat16").itemsize
        lay = tensor_parallel.layout_index(cfg, tp, path) if tp > 1 else None
        if lay is not None:
            b = b * len(lay[1]) / shape[lay[0]] / tp
        if path[0] == "mtp":
            out["mtp"] += b
        elif path == ("embed",):
            out["embed"] += b
            if cfg.tie_word_embeddings:
                out["target"] += b
                out["lm_head"] += b
        else:
            out["target"] += b
            if path == ("lm_head",):
                out["lm_head"] += b
    return out


class CostModel:
    """Prices the engine's programs for `cfg` (None: Qwen3.5-27B) on `hw`.

    weights: "bf16" or "fp8" (128 x 128 block-scaled linears, mtpjax/quant.py; the MTP head
    stays bf16 as the engine's default); tp: tensor-parallel degree (every number is one
    device's share); K: the engine's draft slots (P = K + 1 pending slots); page_size: KV page.
    """

    def __init__(self, cfg: Config | None = None, *, weights: str = "bf16", tp: int = 1,
                 K: int = 4, page_size: int = 16, hw: Hardware = H200):
        if weights not in ("bf16", "fp8"):
            raise ValueError(f"weights must be 'bf16' or 'fp8', got {weights!r}")
        if K < 0:
            raise ValueError(f"K must be >= 0, got {K}")
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.cfg = cfg or qwen3_5_27b()
        tensor_parallel.check_tp(self.cfg, tp)
        self.weights, self.tp, self.K, self.page_size, self.hw = weights, tp, K, page_size, hw
        self.local = tensor_parallel.shard_config(self.cfg, tp)
        self.w = _weight_bytes(self.cfg, weights, tp)
        c, l = self.cfg, self.local
        self.act = 2                                   # bf16 activations and KV
        self.kv_token = 2 * l.num_key_value_heads * c.head_dim * self.act   # one layer, K+V
        P = K + 1
        kc = c.linear_conv_kernel_dim - 1
        nv, dk, dv = l.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
        conv = l.conv_dim if tp == 1 else _local_conv_dim(c, tp)
        self.gdn_state_layer = nv * dk * dv * 4
        self.gdn_conv_layer = (kc + P) * conv * self.act
        self.gdn_pend_layer = P * nv * (dk + dv + 2) * 4
        self.n_gdn = c.num_linear_layers
        self.n_full = c.num_full_layers

    # ------------------------------------------------------------------ pieces
    def _linear_params(self, role: str) -> float:
        """Multiply-adds per token of one pass's linears (weights read as bf16 elements)."""
        c, l = self.cfg, self.local
        H, I = c.hidden_size, l.intermediate_size
        nq, nkv, hd = l.num_attention_heads, l.num_key_value_heads, c.head_dim
        attn = H * (2 * nq * hd + 2 * nkv * hd) + nq * hd * H
        mlp = 3 * H * I
        nv, dv = l.linear_num_value_heads, c.linear_value_head_dim
        conv = l.conv_dim if self.tp == 1 else _local_conv_dim(c, self.tp)
        gdn = H * (conv + nv * dv + 2 * nv) + nv * dv * H
        vocab = -(-c.vocab_size // self.tp)
        if role == "target":
            return self.n_full * (attn + mlp) + self.n_gdn * (gdn + mlp) + vocab * H
        if role == "mtp":
            return 2 * H * H + attn + mlp
        if role == "lm_head":
            return vocab * H
        raise ValueError(role)

    def _attn_flops(self, tokens_ctx: float) -> float:
        """QK^T and PV of one attention layer: 4 x NQ x HD per (query token, context token)."""
        return 4 * self.local.num_attention_heads * self.cfg.head_dim * tokens_ctx

    def _gdn_flops(self, tokens: float) -> float:
        c, l = self.cfg, self.local
        return self.n_gdn * 7 * l.linear_num_value_heads * c.linear_key_head_dim \
            * c.linear_value_head_dim * tokens

    def _activation_bytes(self, tokens: float, mtp_tokens: float = 0.0) -> float:
        """Per-token tensors that cross kernel boundaries (rough first version)."""
        c, l = self.cfg, self.local
        H, I = c.hidden_size, l.intermediate_size
        per_full = 10 * H + 2 * (2 * l.num_attention_heads + 2 * l.num_key_value_heads) \
            * c.head_dim + 5 * l.num_attention_heads * c.head_dim + 6 * I
        per_gdn = 10 * H + 4 * (l.conv_dim + l.linear_num_value_heads * c.linear_value_head_dim) \
            + 6 * I
        per_tok = self.act * (self.n_full * per_full + self.n_gdn * per_gdn)
        return per_tok * tokens + self.act * (per_full + 4 * H) * mtp_tokens

    def _gdn_bytes(self, lanes: int) -> float:
        return 2 * lanes * self.n_gdn * (self.gdn_state_layer + self.gdn_conv_layer
                                         + self.gdn_pend_layer)

    def _finish(self, bytes_: dict, must: dict, flops: float, kernels: int,
                fp8_share: float = 0.0) -> Cost:
        total = sum(bytes_.values())
        thr = self.hw.fp8_flops_per_s if self.weights == "fp8" else self.hw.bf16_flops_per_s
        # weight-only FP8: the matmuls still run in bf16 (activations bf16)
        thr = self.hw.bf16_flops_per_s
        t = max(total / self.hw.hbm_bytes_per_s, flops / thr)
        t += self.hw.launch_s * kernels + self.hw.program_s
        return Cost({k: float(v) for k, v in bytes_.items()}, float(flops), int(kernels),
                    float(t), {k: float(v) for k, v in must.items()})

    # ------------------------------------------------------------------ programs
    def decode(self, depth: int, lanes: int, contexts: Sequence[int]) -> Cost:
        """steps.decode_step at depth d with a batch (lane bucket) of `lanes` slots; contexts:
        tokens already cached for each BUSY lane (len <= lanes)."""
        d, B = int(depth), int(lanes)
        if not 0 <= d <= self.K:
            raise ValueError(f"depth must lie in 0..K={self.K}, got {d}")
        if B < 1 or len(contexts) > B:
            raise ValueError(f"{len(contexts)} busy lanes in a bucket of {B}")
        T = d + 1
        n = len(contexts)
        ctx = float(sum(contexts)) + n * T
        w = self.w
        must = {
            "weights": w["target"] + d * w["mtp"],
            "lm_head_extra": d * w["lm_head"],
            "kv_read": self.kv_token * (self.n_full * ctx + d * ctx),
            "kv_write": self.kv_token * n * (self.n_full * T + (2 * d - 1 if d else 0)),
            "gdn_state": self._gdn_bytes(n),
        }
        moved = dict(must)
        moved["gdn_state"] = self._gdn_bytes(B)
        moved["activations"] = self._activation_bytes(B * T, B * T * (1 if d else 0) + B * max(d - 1, 0))
        flops = 2 * B * T * self._linear_params("target") \
            + 2 * (B * T + B * max(d - 1, 0)) * (self._linear_params("mtp") if d else 0) \
            + 2 * B * d * self._linear_params("lm_head") \
            + self.n_full * self._attn_flops(T * ctx) + d * self._attn_flops(T * ctx) \
            + self._gdn_flops(B * (T + self.K + 1))
        return self._finish(moved, must, flops, self._kernels(("decode", d, B)))

    def prefill(self, T: int, start: int = 0, is_last: bool = True) -> Cost:
        """steps.prefill_chunk of a chunk bucket of T tokens at position `start` of its lane."""
        T, start = int(T), int(start)
        if T < 1 or start < 0:
            raise ValueError(f"prefill needs T >= 1 and start >= 0, got T={T}, start={start}")
        K, w = self.K, self.w
        mtp = 1 if K > 0 else 0
        ctx = start * T + T * (T + 1) / 2              # (query, key) pairs, causal
        drafts = {
            "weights": mtp * K * w["mtp"],
            "lm_head_extra": (1 + mtp * K) * w["lm_head"],
        }
        launched = {
            "weights": w["target"] + drafts["weights"] + mtp * self._mtp_fill_weights(),
            "lm_head_extra": drafts["lm_head_extra"],
            "kv_read": self.kv_token * (self.n_full * (start + T) + mtp * K * (start + T)),
            "kv_write": self.kv_token * (self.n_full * T + mtp * (T + K)),
            "gdn_state": self._gdn_bytes(1),
            "activations": self._activation_bytes(T, mtp * T),
        }
        must = dict(launched)
        if not is_last:     # a non-final chunk needs no first token and no drafts
            must["weights"] = w["target"] + mtp * self._mtp_fill_weights()
            must["lm_head_extra"] = 0.0
            must["kv_read"] = self.kv_token * self.n_full * (start + T)
            must["kv_write"] = self.kv_token * (self.n_full * T + mtp * T)
        flops = 2 * T * self._linear_params("target") + 2 * mtp * K * self._linear_params("mtp") \
            + 2 * mtp * T * 2 * self.cfg.hidden_size ** 2 \
            + 2 * (1 + mtp * K) * self._linear_params("lm_head") \
            + self.n_full * self._attn_flops(ctx) + self._gdn_flops(T)
        return self._finish(launched, must, flops, self._kernels(("prefill", T)))

    def _mtp_fill_weights(self) -> float:
        """The MTP fc and KV projection the prefill's MTP KV fill reads (bf16 head)."""
        c, l = self.cfg, self.local
        return self.act * (2 * c.hidden_size * c.hidden_size
                           + 2 * l.num_key_value_heads * c.head_dim * c.hidden_size)

    def draft(self, lanes: int, contexts: Sequence[int]) -> Cost:
        """One chained MTP draft step (MTP layer + lm_head argmax) over `lanes` slots."""
        B = int(lanes)
        if B < 1 or len(contexts) > B:
            raise ValueError(f"{len(contexts)} busy lanes in a bucket of {B}")
        ctx = float(sum(contexts)) + len(contexts)
        w = self.w
        must = {"weights": w["mtp"], "lm_head_extra": w["lm_head"],
                "kv_read": self.kv_token * ctx, "kv_write": self.kv_token * len(contexts)}
        moved = dict(must, activations=self._activation_bytes(0, B))
        flops = 2 * B * (self._linear_params("mtp") + self._linear_params("lm_head")) \
            + self._attn_flops(ctx)
        return self._finish(moved, must, flops, self._kernels(("draft", B)))

    def move_lane(self) -> Cost:
        """steps.move_lane: one lane's GDN slot (state, conv, pending) read and written."""
        b = {"gdn_state": self._gdn_bytes(1)}
        return self._finish(b, b, 0.0, self._kernels(("move_lane",)))

    def snapshot_save(self) -> Cost:
        """snapshots.save: a lane's recurrent state and conv tail copied into a slot."""
        b = {"gdn_state": 2 * self.n_gdn * (self.gdn_state_layer + self._conv_tail())}
        return self._finish(b, b, 0.0, self._kernels(("snapshot",)))

    def snapshot_restore(self) -> Cost:
        """snapshots.restore: a slot copied into a lane's recurrent state and conv tail."""
        b = {"gdn_state": 2 * self.n_gdn * (self.gdn_state_layer + self._conv_tail())}
        return self._finish(b, b, 0.0, self._kernels(("snapshot_restore",)))

    def _conv_tail(self) -> float:
        c = self.cfg
        conv = self.local.conv_dim if self.tp == 1 else _local_conv_dim(c, self.tp)
        return (c.linear_conv_kernel_dim - 1) * conv * self.act

    def program(self, key: tuple, contexts: Sequence[int] = (), start: int = 0,
                is_last: bool = True) -> Cost:
        """Dispatch on the engine's program keys (Engine.warmup_plan): ("decode", d, B),
        ("prefill", T), ("move_lane",), ("snapshot",), ("snapshot_restore",), ("draft", B)."""
        kind = key[0] if key else None
        if kind == "decode":
            return self.decode(key[1], key[2], contexts)
        if kind == "prefill":
            return self.prefill(key[1], start, is_last)
        if kind == "draft":
            return self.draft(key[1], contexts)
        if key == ("move_lane",):
            return self.move_lane()
        if key == ("snapshot",):
            return self.snapshot_save()
        if key == ("snapshot_restore",):
            return self.snapshot_restore()
        raise ValueError(f"unknown program key {key!r}")

    # ------------------------------------------------------------------ kernels
    def _kernels(self, key: tuple) -> int:
        """Kernel launches in the compiled program. First version: an estimate from the layer
        structure (about 12 kernels per decoder layer, 15 per MTP pass), until the counts
        from the deviceless compile (mtpjax/h200_kernel_counts.py) replace it."""
        L = self.cfg.num_layers
        if key[0] == "decode":
            d = key[1]
            return 12 * L + 20 + 15 * d
        if key[0] == "prefill":
            return 14 * L + 20 + 15 * (self.K + 1)
        if key[0] == "draft":
            return 18
        return 2 * self.n_gdn


def _local_conv_dim(cfg: Config, tp: int) -> int:
    """One shard's conv channels: its q/k heads (replicated when tp exceeds them) + v heads."""
    nk = max(1, cfg.linear_num_key_heads // tp)
    nv = cfg.linear_num_value_heads // tp
    return 2 * nk * cfg.linear_key_head_dim + nv * cfg.linear_value_head_dim


class VirtualClock:
    """The H200 clock an engine run advances: every launched program adds its modelled
    seconds (device), the caller adds measured host seconds."""

    def __init__(self, model: CostModel):
        self.model = model
        self.device_s = 0.0
        self.host_s = 0.0
        self.launches: collections.Counter = collections.Counter()

    @property
    def now(self) -> float:
        return self.device_s + self.host_s

    def launch(self, key: tuple, contexts: Sequence[int] = (), start: int = 0,
               is_last: bool = True) -> float:
        s = self.model.program(key, contexts, start, is_last).seconds
        self.device_s += s
        self.launches[key[0]] += 1
        return s

    def add_host(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"host seconds must be >= 0, got {seconds}")
        self.host_s += float(seconds)

    def report(self) -> dict:
        m, hw = self.model, self.model.hw
        return {
            "device_s": self.device_s, "host_s": self.host_s, "now": self.now,
            "launches": dict(self.launches),
            "hardware": {f.name: getattr(hw, f.name) for f in dataclasses.fields(hw)
                         if f.name != "sources"} | {"sources": dict(hw.sources)},
            "model": {"weights": m.weights, "tp": m.tp, "K": m.K, "page_size": m.page_size,
                      "layers": m.cfg.num_layers, "hidden_size": m.cfg.hidden_size},
        }
