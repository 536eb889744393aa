"""A small random checkpoint with a real byte-level BPE tokenizer, for judge tests."""

import dataclasses
import json
import os

import jax
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from checkpoints.hf_writer import save_hf_checkpoint
from mtpjax.config import Config
from mtpjax.params import init_params

TEXTS = os.path.join(os.path.dirname(__file__), "..", "experiments", "data", "judge_texts.json")


def write_judge_checkpoint(path: str, peaky: float = 1.0, vocab: int = 300) -> str:
    texts = [t["prompt"] + t["continuation"] for t in json.load(open(TEXTS))["texts"]]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    V = tok.get_vocab_size()
    cfg = Config(vocab_size=V, hidden_size=32, intermediate_size=48,
                 layer_types=("linear_attention",) * 3 + ("full_attention",),
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=1e4,
                 partial_rotary_factor=0.5, linear_num_key_heads=2, linear_num_value_heads=4,
                 linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
                 tie_word_embeddings=False, mtp_num_hidden_layers=1, eos_token_ids=(0,))
    params = init_params(cfg, jax.random.key(0), "float32", scale=0.3)
    # a sharper target (peaky > 1) makes temperature-1 samples mostly the argmax
    params = dataclasses.replace(params, lm_head=params.lm_head * peaky)
    os.makedirs(path, exist_ok=True)
    tok.save(os.path.join(path, "tokenizer.json"))
    save_hf_checkpoint(path, cfg, params, dtype="float32",
                       tokenizer_json=os.path.join(path, "tokenizer.json"),
                       generation_config={"eos_token_id": [0]})
    return path
