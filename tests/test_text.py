"""Text layer: tokenizer wrapper, streaming detokenizer, ChatML template, TextEngine and the
`generate` sub-command end to end on a tiny random checkpoint with its own BPE tokenizer."""

import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from mtpjax.config import Config
from mtpjax.params import init_params
from mtpjax.sampling import SamplingParams
from mtpjax.text import StreamDecoder, TextEngine, Tokenizer, apply_chat_template

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
QWEN35_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}|"
                r" ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
CORPUS = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "The quick brown fox jumps over the lazy dog. The dog sleeps; the fox runs away.\n",
    "import os\nimport sys\n\nfor i in range(10):\n    print(i, os.path.join('a', str(i)))\n",
    "café naïve résumé — über straße\n",
] * 20
MULTIBYTE = "naïve café — 日本語のテキスト 🙂👍🏽 Ωmega ∑x² ok"


def train_tokenizer():
    from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers, trainers
    from tokenizers import Tokenizer as HFTok
    tok = HFTok(models.BPE(unk_token=None, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN35_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=360, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=[])
    tok.train_from_iterator(CORPUS, trainer=trainer)
    tok.add_special_tokens(SPECIALS)
    tok.add_tokens(["<think>", "</think>"])  # Qwen: added, not special
    return tok


@pytest.fixture(scope="module")
def hf_tok():
    return train_tokenizer()


@pytest.fixture(scope="module")
def tok(hf_tok):
    return Tokenizer(hf_tok)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, hf_tok):
    """A random-weight Qwen3.5+MTP checkpoint (float32 safetensors) with tokenizer.json."""
    path = str(tmp_path_factory.mktemp("tiny_text_ckpt"))
    tj = hf_tok.to_str()
    ids = {s: hf_tok.token_to_id(s) for s in SPECIALS}
    eos = (ids["<|im_end|>"], ids["<|endoftext|>"])
    vocab = -(-hf_tok.get_vocab_size() // 16) * 16
    cfg = Config(vocab_size=vocab, hidden_size=32, intermediate_size=48,
                 layer_types=("linear_attention", "full_attention"),
                 num_attention_heads=2, num_key_value_heads=1, head_dim=16, rope_theta=10000.0,
                 partial_rotary_factor=0.5, linear_num_key_heads=1, linear_num_value_heads=2,
                 linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
                 tie_word_embeddings=True, mtp_num_hidden_layers=1, max_position_embeddings=512,
                 eos_token_ids=eos)
    params = init_params(cfg, jax.random.key(0), "float32", scale=0.3)
    try:
        from checkpoints.hf_writer import save_hf_checkpoint
    except ImportError:
        save_hf_checkpoint = None
    if save_hf_checkpoint is not None:
        save_hf_checkpoint(path, cfg, params, "float32", tokenizer_json=tj,
                           generation_config={"eos_token_id": list(eos)})
    else:  # fall back to the HF fixture writer (needs transformers)
        from hf_fixtures import write_checkpoint
        write_checkpoint(path, vocab_size=vocab)
        with open(os.path.join(path, "tokenizer.json"), "w") as f:
            f.write(tj)
    return path


# ------------------------------------------------------------------------------- tokenizer
def test_round_trip_and_specials(tok):
    for s in ["def fibonacci(n):\n    return n\n", MULTIBYTE, "  lead and trail  \n\n", ""]:
        ids = tok.encode(s)
        assert tok.decode(ids) == s
    ids = tok.encode("<|im_start|>user\nHi<|im_end|>\n")
    assert ids[0] == tok.token_to_id("<|im_start|>")
    assert tok.token_to_id("<|im_end|>") in ids
    assert tok.decode(ids, skip_special_tokens=True) == "user\nHi\n"
    assert set(tok.special_ids) == set(SPECIALS)          # <think> is added, not special
    assert tok.added_ids["<think>"] == tok.token_to_id("<think>")
    assert tok.encode("<think>\n") == [tok.token_to_id("<think>"), tok.encode("\n")[0]]
    assert tok.vocab_size == max(tok.added_ids.values()) + 1
    assert tok.stop_ids() == (tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>"))
    # no BOS / post-processor tokens
    assert tok.encode("a") == [tok.token_to_id("a")]


def test_from_checkpoint_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="checkpoint folder not found"):
        Tokenizer.from_checkpoint(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        Tokenizer.from_checkpoint(str(tmp_path))
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="could not load tokenizer"):
        Tokenizer.from_checkpoint(str(tmp_path))


# ------------------------------------------------------------------------------- streaming
def test_stream_decoder_multibyte(tok):
    ids = tok.encode(MULTIBYTE)
    # the test only means something if some tokens split a character
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    d = StreamDecoder(tok)
    pieces = [d.push(i) for i in ids]
    for p in pieces:
        assert "\ufffd" not in p
    tail = d.flush()
    assert tail == ""
    assert "".join(pieces) == tok.decode(ids) == MULTIBYTE == d.text
    # pushing several ids at a time, in uneven groups
    d = StreamDecoder(tok)
    out, i = [], 0
    for n in [1, 3, 2, 5, 1, 4] * 20:
        out.append(d.push(ids[i:i + n]))
        i += n
    out.append(d.flush())
    assert "".join(out) == MULTIBYTE and all("\ufffd" not in p for p in out)


def test_stream_decoder_matches_decode_on_invalid_utf8(tok):
    """Random id sequences (mostly byte tokens, so often invalid UTF-8): the pieces still add
    up to decode(all)."""
    byte_ids = sorted({i for ch in MULTIBYTE for i in tok.encode(ch)})
    pool = byte_ids + tok.encode("ab c\n") + [tok.token_to_id("<|im_end|>")]
    rng = np.random.default_rng(0)
    for _ in range(200):
        ids = [int(x) for x in rng.choice(pool, size=int(rng.integers(1, 12)))]
        d = StreamDecoder(tok)
        text = "".join(d.push(i) for i in ids) + d.flush()
        assert text == tok.decode(ids)
        d = StreamDecoder(tok, skip_special_tokens=True)
        text = "".join(d.push(i) for i in ids) + d.flush()
        assert text == tok.decode(ids, skip_special_tokens=True)


# ---------------------------------------------------------------------------- chat template
def test_chat_template_generation_prompts():
    msgs = [{"role": "user", "content": "Hello"}]
    assert apply_chat_template(msgs, enable_thinking=False) == (
        "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert apply_chat_template(msgs) == (
        "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n<think>\n")
    assert apply_chat_template(msgs, add_generation_prompt=False) == (
        "<|im_start|>user\nHello<|im_end|>\n")


def test_chat_template_history_and_trim():
    msgs = [
        {"role": "system", "content": "  You are brief.\n"},
        {"role": "user", "content": "\n Hi there  "},
        {"role": "assistant", "content": "<think>\nthe user greets\n</think>\n\nHello!"},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "\n  add them \n"},
    ]
    assert apply_chat_template(msgs, add_generation_prompt=False) == (
        "<|im_start|>system\nYou are brief.<|im_end|>\n"
        "<|im_start|>user\nHi there<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n"          # earlier reasoning dropped
        "<|im_start|>user\n2+2?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nadd them\n</think>\n\n4<|im_end|>\n")
    # reasoning inline in the final turn's content
    msgs[-1] = {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n4"}
    assert apply_chat_template(msgs, add_generation_prompt=False).endswith(
        "<|im_start|>assistant\n<think>\nadd them\n</think>\n\n4<|im_end|>\n")
    # a final turn without reasoning gets an empty think block: prompt(thinking off) + answer
    short = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi!"}]
    assert apply_chat_template(short, add_generation_prompt=False) == (
        apply_chat_template(short[:1], enable_thinking=False) + "Hi!<|im_end|>\n")
    # a new user turn drops the previous turn's reasoning from history
    follow = msgs + [{"role": "user", "content": "thanks"}]
    text = apply_chat_template(follow)
    assert "add them" not in text and "the user greets" not in text
    assert text.endswith("<|im_start|>assistant\n4<|im_end|>\n<|im_start|>user\nthanks<|im_end|>\n"
                         "<|im_start|>assistant\n<think>\n")


def test_chat_template_tool_messages():
    msgs = [{"role": "user", "content": "weather?"},
            {"role": "assistant", "content": "<tool_call>\n<function=w>\n</function>\n</tool_call>"},
            {"role": "tool", "content": "sunny"}, {"role": "tool", "content": " 21C "}]
    assert apply_chat_template(msgs, enable_thinking=False) == (
        "<|im_start|>user\nweather?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
        "<tool_call>\n<function=w>\n</function>\n</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\n21C\n"
        "</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n")


@pytest.mark.parametrize("msgs, match", [
    ([{"role": "robot", "content": "x"}], "role must be one of system, user, assistant, tool"),
    ([{"content": "x"}], "role must be one of"),
    ([{"role": "user", "content": 3}], "content must be a str"),
    ([{"role": "user", "content": "a"}, {"role": "system", "content": "b"}], "only allowed first"),
    ([], "messages is empty"),
    ({"role": "user", "content": "a"}, "must be a list"),
    (["hello"], "must be a dict"),
    ([{"role": "assistant", "content": "", "tool_calls": [{"name": "f"}]}], "tool_calls"),
])
def test_chat_template_errors(msgs, match):
    with pytest.raises(ValueError, match=match):
        apply_chat_template(msgs)


# ------------------------------------------------------------------------------ TextEngine
def test_text_engine(ckpt, tok):
    te = TextEngine.from_checkpoint(ckpt, num_speculative_tokens=1, max_lanes=2,
                                    max_seq_len=128, prefill_chunk=16)
    sp = SamplingParams(max_new_tokens=10)
    streamed = {}
    outs = te.generate(["def fibonacci(n):", tok.encode("The quick")], sp,
                       on_text=lambda i, s: streamed.setdefault(i, []).append(s))
    ref = te.engine.generate([tok.encode("def fibonacci(n):"), tok.encode("The quick")], sp)
    for i, (o, r) in enumerate(zip(outs, ref)):
        assert o.token_ids == r.token_ids and o.error is None
        toks = r.token_ids[:-1] if r.finish_reason == "stop" else r.token_ids
        assert o.text == tok.decode(toks) == "".join(streamed.get(i, []))
    assert outs[0].prompt == "def fibonacci(n):" and outs[1].prompt is None
    (single,) = te.generate("def fibonacci(n):", sp)
    assert single.token_ids == outs[0].token_ids
    (c,) = te.chat([{"role": "user", "content": "Hello"}], sp, enable_thinking=False)
    prompt = apply_chat_template([{"role": "user", "content": "Hello"}], enable_thinking=False)
    assert c.prompt_token_ids == tok.encode(prompt)     # this checkpoint ships no template
    assert tok.token_to_id("<|im_end|>") not in c.token_ids[:-1]
    with pytest.raises(TypeError, match="str or a list of token ids"):
        te.generate([3.5], sp)


# ---------------------------------------------------------------------------- sub-command
def test_generate_subcommand(ckpt):
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO)
    cmd = [sys.executable, "-m", "experiments", "generate", f"--checkpoint={ckpt}",
           "--prompt=def fibonacci(n):", "--max_new_tokens=12", "--num_speculative_tokens=2"]
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.rstrip("\n").split("\n")
    stats = lines[-1]
    assert stats.startswith("[stats] tokens=") and "tok/s=" in stats and "acceptance=" in stats
    assert "k=2" in stats
    assert "".join(lines[:-1]).strip(), r.stdout        # some generated text came first
    r = subprocess.run([sys.executable, "-m", "experiments", "generate",
                        f"--checkpoint={ckpt}/missing"], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode != 0 and "checkpoint folder not found" in r.stderr


def test_text_engine_chats_with_the_checkpoints_own_template(ckpt, tmp_path):
    """TextEngine.from_checkpoint renders chats with the checkpoint's Jinja chat_template
    (the server's), not the built-in ChatML: a template that differs from it shows."""
    import shutil
    folder = str(tmp_path / "templated")
    shutil.copytree(ckpt, folder)
    with open(os.path.join(folder, "chat_template.jinja"), "w") as f:
        f.write("{% for m in messages %}<|im_start|>{{ m.role }}\n[{{ m.content }}]<|im_end|>\n"
                "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    te = TextEngine.from_checkpoint(folder, max_lanes=1, max_seq_len=64, prefill_chunk=16)
    msgs = [{"role": "user", "content": "Hello"}]
    (c,) = te.chat(msgs, SamplingParams(max_new_tokens=2))
    want = "<|im_start|>user\n[Hello]<|im_end|>\n<|im_start|>assistant\n"
    assert c.prompt_token_ids == te.tokenizer.encode(want)
    assert want != apply_chat_template(msgs)
