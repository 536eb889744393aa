"""The bundled demo checkpoint (checkpoints/tiny) and the HF writer it is saved with.

* The shipped checkpoint loads through the public API, its tokenizer round-trips text and its
  special tokens are the generation config's stop ids, its logits are finite, and its MTP head
  is actually trained: on held-out standard-library source (files the trainer never saw) the
  MTP's t+2 argmax agrees with the target's own greedy token there far above chance.
* `save_hf_checkpoint` is the exact inverse of the loader (float32, both layouts, tied and
  untied), keeps A_log in F32 when the rest is BF16, and writes the real HF tensor names.
"""

from __future__ import annotations

import json
import os

import jax
import numpy as np
import pytest
from safetensors import safe_open

import mtpjax
from checkpoints import save_hf_checkpoint
from experiments import corpus
from mtpjax.config import FULL, LINEAR, Config
from mtpjax.params import hf_tensor_map, init_params

TINY = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                    "checkpoints", "tiny")
SNIPPET_TOKENS = 256
SNIPPET_ROWS = 1
FALLBACK = '''import os
import sys


def main(argv=None):
    """Print every file under the given directories."""
    if argv is None:
        argv = sys.argv[1:]
    for root in argv:
        for dirpath, dirnames, filenames in os.walk(root):
            for name in sorted(filenames):
                path = os.path.join(dirpath, name)
                print(path)
    return 0


class Counter:
    def __init__(self, start=0):
        self.value = start

    def increment(self, step=1):
        self.value += step
        return self.value

    def __repr__(self):
        return f"{self.__class__.__name__}({self.value!r})"


if __name__ == "__main__":
    sys.exit(main())
'''


@pytest.fixture(scope="module")
def tiny():
    cfg, params = mtpjax.load_checkpoint(TINY)
    return cfg, params


@pytest.fixture(scope="module")
def tokenizer():
    from tokenizers import Tokenizer
    return Tokenizer.from_file(os.path.join(TINY, "tokenizer.json"))


@pytest.fixture(scope="module")
def heldout_tokens(tokenizer):
    """[SNIPPET_ROWS, SNIPPET_TOKENS] tokens from held-out stdlib files (never trained on)."""
    eot = tokenizer.token_to_id(corpus.EOT)
    docs = corpus.texts("heldout", max_files=12)
    ids = corpus.encode_docs(tokenizer, docs, eot) if docs else np.zeros((0,), np.int32)
    need = SNIPPET_ROWS * SNIPPET_TOKENS
    if len(ids) < need:  # an unusual Python install: fall back to a fixed snippet
        one = np.asarray([eot] + tokenizer.encode(FALLBACK).ids, np.int32)
        ids = np.tile(one, need // len(one) + 1)
    # skip the first windows' worth (licence headers are the easiest text there is)
    start = max(0, min(len(ids) - need, 1024))
    return ids[start:start + need].reshape(SNIPPET_ROWS, SNIPPET_TOKENS)


# --------------------------------------------------------------------------------------------
# The shipped checkpoint
# --------------------------------------------------------------------------------------------

def test_tiny_files_and_size():
    names = set(os.listdir(TINY))
    for f in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json",
              "TRAINING.md", "train_metrics.json"):
        assert f in names, f
    total = sum(os.path.getsize(os.path.join(TINY, f)) for f in names
                if os.path.isfile(os.path.join(TINY, f)))
    assert total <= 25_000_000, total
    with open(os.path.join(TINY, "config.json")) as f:
        raw = json.load(f)
    assert raw["model_type"] == "qwen3_5" and raw["text_config"]["model_type"] == "qwen3_5_text"
    with safe_open(os.path.join(TINY, "model.safetensors"), framework="numpy") as f:
        keys = set(f.keys())
        a_log = [k for k in keys if k.endswith("A_log")]
        assert a_log and all(str(f.get_tensor(k).dtype) == "float32" for k in a_log)
        emb = f.get_tensor("model.language_model.embed_tokens.weight")
        assert str(emb.dtype) == "bfloat16"
    assert any(k.startswith("mtp.") for k in keys)
    assert all(k.startswith(("model.language_model.", "mtp.", "lm_head.")) for k in keys)


def test_tiny_architecture(tiny):
    cfg, params = tiny
    assert cfg.has_mtp and params.mtp is not None
    assert cfg.layer_types[:4] == (LINEAR, LINEAR, LINEAR, FULL) and cfg.num_layers % 4 == 0
    assert cfg.num_full_layers >= 1 and cfg.num_linear_layers >= 3
    assert params.embed.dtype == np.float32


def test_tiny_tokenizer_round_trip_and_stop_ids(tiny, tokenizer):
    cfg, _ = tiny
    texts = [FALLBACK, "déjà vu — naïve café, 東京, emoji 🐍\n\ttabs\r\n and  spaces  ",
             "x = [i ** 2 for i in range(10)]  # 0123456789\n"]
    for t in texts:
        ids = tokenizer.encode(t).ids
        assert all(0 <= i < cfg.vocab_size for i in ids)
        assert tokenizer.decode(ids, skip_special_tokens=False) == t
    eot, im_start, im_end = (tokenizer.token_to_id(s) for s in
                             ("<|endoftext|>", "<|im_start|>", "<|im_end|>"))
    assert None not in (eot, im_start, im_end) and len({eot, im_start, im_end}) == 3
    # a special token is one id, and decodes back to itself
    chat = "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>"
    ids = tokenizer.encode(chat).ids
    assert ids[0] == im_start and im_end in ids and ids[-1] == eot
    assert tokenizer.decode(ids, skip_special_tokens=False) == chat
    with open(os.path.join(TINY, "generation_config.json")) as f:
        gen = json.load(f)
    assert sorted(gen["eos_token_id"]) == sorted([eot, im_end])
    assert sorted(cfg.eos_token_ids) == sorted([eot, im_end])
    assert tokenizer.get_vocab_size() <= cfg.vocab_size


def test_tiny_forward_logits_finite(tiny, heldout_tokens):
    cfg, params = tiny
    logits = np.asarray(mtpjax.forward_logits(cfg, params, heldout_tokens))
    assert logits.shape == heldout_tokens.shape + (cfg.vocab_size,)
    assert np.all(np.isfinite(logits))
    assert logits.std() > 0.1  # not a constant (e.g. all-zero) model


def test_tiny_mtp_agrees_with_greedy_target_on_heldout(tiny, heldout_tokens):
    """MTP argmax at p (its guess for token p+2) == target argmax at p+1 (its greedy p+2).

    This is the first-draft acceptance of greedy self-speculative decoding, measured
    teacher-forced on held-out text. An untrained or misaligned MTP head scores ~0 here.
    """
    cfg, params = tiny
    target = np.asarray(mtpjax.forward_logits(cfg, params, heldout_tokens)).argmax(-1)
    mtp = np.asarray(mtpjax.mtp_logits(cfg, params, heldout_tokens)).argmax(-1)
    agree = float(np.mean(mtp[:, :-1] == target[:, 1:-1]))
    # control: the same comparison one position off (MTP row p vs the target's own guess for
    # p+1). A head that ignores its inputs, or a constant predictor, scores alike on both.
    misaligned = float(np.mean(mtp[:, :-1] == target[:, :-2]))
    target_acc = float(np.mean(target[:, :-1] == heldout_tokens[:, 1:]))
    mtp_acc = float(np.mean(mtp[:, :-1] == heldout_tokens[:, 2:]))
    top_share = float(np.unique(target, return_counts=True)[1].max() / target.size)
    print(f"held-out agreement {agree:.3f} (misaligned {misaligned:.3f}), target acc "
          f"{target_acc:.3f}, MTP acc {mtp_acc:.3f}, top target token share {top_share:.3f}")
    assert agree >= 0.4, agree
    assert agree >= misaligned + 0.25, (agree, misaligned)
    assert top_share <= 0.5, top_share  # not a constant predictor
    # chance is 1/4096; the shipped model is small and briefly trained (see TRAINING.md)
    assert target_acc >= 0.1, target_acc
    assert mtp_acc >= 0.1, mtp_acc


# --------------------------------------------------------------------------------------------
# Writer / loader round trip
# --------------------------------------------------------------------------------------------

def _tiny_cfg(tied: bool) -> Config:
    return Config(
        vocab_size=97, hidden_size=32, intermediate_size=48,
        layer_types=(LINEAR, LINEAR, LINEAR, FULL) * 2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=10000.0,
        partial_rotary_factor=0.25, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=8, linear_value_head_dim=12, linear_conv_kernel_dim=4,
        tie_word_embeddings=tied, mtp_num_hidden_layers=1, max_position_embeddings=512,
        eos_token_ids=(5, 3))


def _leaves(params):
    return jax.tree_util.tree_leaves_with_path(params)


@pytest.mark.parametrize("layout", ["wrapper", "text"])
@pytest.mark.parametrize("tied", [True, False])
def test_writer_loader_round_trip_exact_f32(tmp_path, layout, tied):
    cfg = _tiny_cfg(tied)
    params = init_params(cfg, jax.random.key(3), "float32")
    gen = {"eos_token_id": [5, 3]}
    save_hf_checkpoint(str(tmp_path), cfg, params, dtype="float32", generation_config=gen,
                       layout=layout)
    cfg2, params2 = mtpjax.load_checkpoint(str(tmp_path))
    assert cfg2 == cfg
    assert (params2.lm_head is None) == tied
    a, b = _leaves(params), _leaves(params2)
    assert [p for p, _ in a] == [p for p, _ in b]
    for (path, x), (_, y) in zip(a, b):
        assert x.shape == y.shape and x.dtype == y.dtype, path
        assert np.array_equal(np.asarray(x), np.asarray(y)), jax.tree_util.keystr(path)

    with safe_open(str(tmp_path / "model.safetensors"), framework="numpy") as f:
        keys = set(f.keys())
    prefix = "model.language_model." if layout == "wrapper" else "model."
    expect = {s.name if s.name.startswith("mtp.") or s.name == "lm_head.weight"
              else prefix + s.name for s in hf_tensor_map(cfg)}
    assert keys == expect
    assert ("lm_head.weight" in keys) == (not tied)
    assert "model.language_model.layers.3.self_attn.q_proj.weight" in keys or layout == "text"
    assert f"{prefix}layers.0.linear_attn.A_log" in keys
    assert "mtp.layers.0.self_attn.q_proj.weight" in keys and "mtp.fc.weight" in keys
    with open(tmp_path / "config.json") as f:
        raw = json.load(f)
    assert raw["model_type"] == ("qwen3_5" if layout == "wrapper" else "qwen3_5_text")


def test_writer_bf16_keeps_a_log_f32(tmp_path):
    cfg = _tiny_cfg(False)
    params = init_params(cfg, jax.random.key(4), "float32")
    save_hf_checkpoint(str(tmp_path), cfg, params, dtype="bfloat16")
    with safe_open(str(tmp_path / "model.safetensors"), framework="numpy") as f:
        for k in f.keys():
            want = "float32" if k.endswith("A_log") else "bfloat16"
            assert str(f.get_tensor(k).dtype) == want, k
    _, p2 = mtpjax.load_checkpoint(str(tmp_path))
    # A_log exact; everything else is the bf16 rounding of the original
    assert np.array_equal(np.asarray(p2.layers[0].gdn.A_log), np.asarray(params.layers[0].gdn.A_log))
    x, y = np.asarray(params.embed), np.asarray(p2.embed)
    assert np.array_equal(y, x.astype(jax.numpy.bfloat16).astype(np.float32))
    assert not np.array_equal(x, y)
