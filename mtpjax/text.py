"""Text in, text out: the tokenizer, a streaming detokenizer, the ChatML chat template, and
`TextEngine`, a thin wrapper that lets `Engine.generate` take strings and chat messages.

Nothing here touches the device; `Engine` still only sees lists of token ids.

* `Tokenizer` wraps a `tokenizers.Tokenizer` loaded from `<checkpoint>/tokenizer.json`
  (spec §7: byte-level BPE, no BOS). `encode` never adds special tokens; special-token strings
  that appear in the text (`<|im_start|>`, ...) are matched as their single ids.
* `StreamDecoder` turns ids into text incrementally. Byte-level BPE tokens can end in the middle
  of a UTF-8 character; such a tail is held back until the character is complete, so streamed
  pieces never contain a spurious U+FFFD and their concatenation (after `flush`) is exactly
  `Tokenizer.decode(all ids)`.
* `apply_chat_template` renders Qwen3.5's ChatML (spec §7) without Jinja: the fallback for a
  checkpoint that ships no chat template.
* `TextEngine.generate` / `TextEngine.chat` return `TextOutput`s: `RequestOutput` plus `.text`.
  `chat` renders with the checkpoint's own Jinja template when it has one
  (mtpjax/serving/chat_template.py, the one the server uses), so offline and served chats
  tokenize alike.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, Mapping, Sequence

from mtpjax.engine import Engine, RequestOutput
from mtpjax.sampling import SamplingParams

IM_START, IM_END, ENDOFTEXT = "<|im_start|>", "<|im_end|>", "<|endoftext|>"
THINK_START, THINK_END = "<think>", "</think>"
ROLES = ("system", "user", "assistant", "tool")
_REPLACEMENT = "\ufffd"
# An incomplete UTF-8 character is at most 3 bytes, and every token is at least one byte, so
# the bytes of an unfinished character lie in the last 3 tokens.
_MAX_HELD_TOKENS = 3


# ------------------------------------------------------------------------------------ tokenizer
class Tokenizer:
    """A `tokenizers.Tokenizer` with the few methods the engine and the CLI need."""

    def __init__(self, tok, path: str | None = None):
        self._tok = tok
        self.path = path
        added = tok.get_added_tokens_decoder()  # {id: AddedToken}
        self.special_ids: dict[str, int] = {t.content: i for i, t in sorted(added.items())
                                            if t.special}
        self.added_ids: dict[str, int] = {t.content: i for i, t in sorted(added.items())}

    @classmethod
    def from_file(cls, path: str) -> "Tokenizer":
        from tokenizers import Tokenizer as _HFTokenizer
        if not os.path.isfile(path):
            raise FileNotFoundError(f"tokenizer file not found: {path}")
        try:
            tok = _HFTokenizer.from_file(path)
        except Exception as e:  # tokenizers raises a bare Exception on malformed JSON
            raise ValueError(f"could not load tokenizer {path}: {e}") from e
        return cls(tok, path)

    @classmethod
    def from_checkpoint(cls, path: str) -> "Tokenizer":
        """The tokenizer.json of a checkpoint folder (HF layout or one converted by `convert`)."""
        if not os.path.isdir(path):
            raise FileNotFoundError(f"checkpoint folder not found: {path}")
        tok_path = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tok_path):
            raise FileNotFoundError(
                f"no tokenizer.json in checkpoint folder {path}; text generation needs the "
                "tokenizer saved beside the weights (HF checkpoints ship it; `convert` copies it)")
        return cls.from_file(tok_path)

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce, added tokens included (the model's
        vocab_size may be larger: padding rows)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"encode takes a str, got {type(text).__name__}")
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, i: int) -> str | None:
        return self._tok.id_to_token(int(i))

    def stop_ids(self) -> tuple[int, ...]:
        """Ids of `<|im_end|>` and `<|endoftext|>` that this tokenizer has (spec §7: stop on
        either)."""
        return tuple(i for i in (self.token_to_id(IM_END), self.token_to_id(ENDOFTEXT))
                     if i is not None)

    def stream(self, skip_special_tokens: bool = False) -> "StreamDecoder":
        return StreamDecoder(self, skip_special_tokens)


class StreamDecoder:
    """Incremental detokenizer: `push(ids)` returns the text that became final.

    The ids not yet emitted are kept and decoded together; when their text ends in U+FFFD
    (an unfinished UTF-8 character, or an invalid byte that later bytes may still explain) the
    longest prefix of them (holding back at most 3 tokens) that decodes cleanly is emitted and
    the rest waits. Each emitted piece ends on a character boundary, so the concatenation of all
    pieces plus `flush()` equals `tokenizer.decode(all_ids)` exactly.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self._start = 0  # ids[:_start] have been emitted
        self.text = ""   # everything emitted so far

    def _decode(self, ids):
        return self.tokenizer.decode(ids, self.skip_special_tokens)

    def push(self, ids: int | Sequence[int]) -> str:
        if isinstance(ids, int):
            ids = [ids]
        self.ids.extend(int(i) for i in ids)
        pending = self.ids[self._start:]
        if not pending:
            return ""
        text = self._decode(pending)
        cut = len(pending)
        if text.endswith(_REPLACEMENT):
            text, cut = "", 0
            for j in range(1, min(_MAX_HELD_TOKENS, len(pending) - 1) + 1):
                t = self._decode(pending[:-j])
                if t.endswith(_REPLACEMENT):
                    continue
                text, cut = t, len(pending) - j
                break
        self._start += cut
        self.text += text
        return text

    def flush(self) -> str:
        """Emit whatever is held back (at the end of a request)."""
        text = self._decode(self.ids[self._start:]) if self._start < len(self.ids) else ""
        self._start = len(self.ids)
        self.text += text
        return text


# ------------------------------------------------------------------------------ chat template
def _content(i: int, msg: Mapping[str, Any]) -> str:
    c = msg.get("content")
    if c is None and msg["role"] == "assistant":
        return ""
    if not isinstance(c, str):
        raise ValueError(f"message {i} ({msg['role']}): content must be a str, got "
                         f"{type(c).__name__}")
    return c.strip()


def _split_reasoning(content: str, reasoning: Any) -> tuple[str, str]:
    """(reasoning, answer) of an assistant message: `reasoning_content` when given, else the
    `<think>...</think>` part of the content."""
    if isinstance(reasoning, str):
        return reasoning.strip(), content
    if THINK_END in content:
        reasoning = content.split(THINK_END)[0].rstrip("\n").split(THINK_START)[-1].lstrip("\n")
        content = content.split(THINK_END)[-1].lstrip("\n")
        return reasoning.strip(), content
    return "", content


def _is_tool_response(text: str) -> bool:
    return text.startswith("<tool_response>") and text.endswith("</tool_response>")


def apply_chat_template(messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                        enable_thinking: bool = True) -> str:
    """Qwen3.5 ChatML (spec §7) as a string; encode it with `Tokenizer.encode`.

    * every message `<|im_start|>{role}\\n{content}<|im_end|>\\n`, content whitespace-trimmed;
      a system message is allowed only first;
    * consecutive `tool` messages become one user turn of `<tool_response>` blocks (Qwen3);
    * an assistant message's reasoning is its `reasoning_content` or the `<think>...</think>`
      part of its content; for assistant turns before the last user query it is dropped (only
      the answer stays), turns after it are rendered `<think>\\n{reasoning}\\n</think>\\n\\n{answer}`
      (an empty reasoning gives `<think>\\n\\n</think>\\n\\n`, the same text as a thinking-off
      prompt followed by the answer);
    * generation prompt `<|im_start|>assistant\\n<think>\\n`, or with enable_thinking=False
      `<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n`.

    Assistant `tool_calls` fields are not rendered (ValueError); put the `<tool_call>` XML in
    the content instead.
    """
    if isinstance(messages, Mapping) or not isinstance(messages, Sequence):
        raise ValueError("messages must be a list of {'role': ..., 'content': ...} dicts")
    if len(messages) == 0:
        raise ValueError("messages is empty")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ValueError(f"message {i} must be a dict with 'role' and 'content', got "
                             f"{type(m).__name__}")
        role = m.get("role")
        if role not in ROLES:
            raise ValueError(f"message {i}: role must be one of {', '.join(ROLES)}, got {role!r}")
        if role == "system" and i != 0:
            raise ValueError(f"message {i}: a system message is only allowed first")
        if m.get("tool_calls"):
            raise ValueError(f"message {i}: tool_calls are not supported by this template; "
                             "put the <tool_call>...</tool_call> text in the content")
    contents = [_content(i, m) for i, m in enumerate(messages)]

    last_query = len(messages) - 1
    for i in range(len(messages) - 1, -1, -1):
        if messages[i]["role"] == "user" and not _is_tool_response(contents[i]):
            last_query = i
            break

    out = []
    n = len(messages)
    for i, (m, content) in enumerate(zip(messages, contents)):
        role = m["role"]
        if role in ("system", "user"):
            out.append(f"{IM_START}{role}\n{content}{IM_END}\n")
        elif role == "assistant":
            reasoning, answer = _split_reasoning(content, m.get("reasoning_content"))
            if i > last_query:
                out.append(f"{IM_START}assistant\n{THINK_START}\n{reasoning}\n{THINK_END}\n\n"
                           f"{answer}{IM_END}\n")
            else:
                out.append(f"{IM_START}assistant\n{answer}{IM_END}\n")
        else:  # tool
            if i == 0 or messages[i - 1]["role"] != "tool":
                out.append(f"{IM_START}user")
            out.append(f"\n<tool_response>\n{content}\n</tool_response>")
            if i == n - 1 or messages[i + 1]["role"] != "tool":
                out.append(f"{IM_END}\n")
    if add_generation_prompt:
        out.append(f"{IM_START}assistant\n{THINK_START}\n")
        if not enable_thinking:
            out.append(f"\n{THINK_END}\n\n")
    return "".join(out)


# --------------------------------------------------------------------------------- TextEngine
@dataclasses.dataclass
class TextOutput(RequestOutput):
    """A `RequestOutput` plus the decoded text of `token_ids` (the final stop token, when the
    request ended on one, is left out of the text) and the prompt text when given as one."""
    text: str = ""
    prompt: str | None = None


Prompt = str | Sequence[int]


def _is_ids(p) -> bool:
    return not isinstance(p, str) and isinstance(p, Sequence) and all(
        isinstance(t, int) or hasattr(t, "__index__") for t in p)


class TextEngine:
    """`Engine` + `Tokenizer`: prompts may be strings or token-id lists, chats are messages.

    on_text(i, piece) streams decoded text per request as tokens arrive (held-back partial
    characters come out at the end of the batch); on_token(i, new_ids) is passed through.
    """

    def __init__(self, engine: Engine, tokenizer: Tokenizer, skip_special_tokens: bool = False,
                 chat_template=None):
        """chat_template: a serving.chat_template.ChatTemplate (None: the built-in ChatML,
        `apply_chat_template`); from_checkpoint passes the checkpoint's."""
        if tokenizer.vocab_size > engine.cfg.vocab_size:
            raise ValueError(f"tokenizer has {tokenizer.vocab_size} ids but the model's "
                             f"vocab_size is {engine.cfg.vocab_size}")
        from mtpjax.serving.chat_template import ChatTemplate
        self.engine, self.tokenizer = engine, tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.chat_template = ChatTemplate() if chat_template is None else chat_template

    @classmethod
    def from_checkpoint(cls, path: str, dtype: str = "float32", num_speculative_tokens: int = 0,
                        **engine_kw) -> "TextEngine":
        """The checkpoint's tokenizer, chat template (its Jinja `chat_template`, else the
        built-in ChatML) and engine."""
        from mtpjax.serving.chat_template import load_chat_template
        tok = Tokenizer.from_checkpoint(path)  # fail before loading weights
        template = load_chat_template(path)
        from mtpjax.data_parallel import from_checkpoint
        return cls(from_checkpoint(path, dtype, num_speculative_tokens, **engine_kw), tok,
                   chat_template=template)

    def encode_prompt(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        if _is_ids(prompt):
            return [int(t) for t in prompt]
        raise TypeError(f"a prompt must be a str or a list of token ids, got "
                        f"{type(prompt).__name__}")

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 params: SamplingParams | Sequence[SamplingParams] = SamplingParams(),
                 on_text: Callable[[int, str], None] | None = None,
                 on_token: Callable[[int, list[int]], None] | None = None) -> list[TextOutput]:
        """One TextOutput per prompt. A single str or a single list of ints is one prompt."""
        if isinstance(prompts, str) or (_is_ids(prompts) and len(prompts) > 0):
            prompts = [prompts]
        texts = [p if isinstance(p, str) else None for p in prompts]
        ids = [self.encode_prompt(p) for p in prompts]
        plist = [params] * len(ids) if isinstance(params, SamplingParams) else list(params)
        if len(plist) != len(ids):
            raise ValueError(f"got {len(plist)} sampling params for {len(ids)} prompts")
        stops = [frozenset(sp.stop_token_ids) | frozenset(self.engine.eos)
                 if isinstance(sp, SamplingParams) else frozenset() for sp in plist]
        decoders = [self.tokenizer.stream(self.skip_special_tokens) for _ in ids]

        def _on_token(i: int, new: list[int]):
            if on_token:
                on_token(i, new)
            if new and new[-1] in stops[i]:
                new = new[:-1]
            piece = decoders[i].push(new)
            if on_text and piece:
                on_text(i, piece)

        outs = self.engine.generate(ids, plist, on_token=_on_token)
        results = []
        for i, o in enumerate(outs):
            tail = decoders[i].flush()
            if on_text and tail:
                on_text(i, tail)
            toks = o.token_ids
            if o.finish_reason == "stop" and toks and toks[-1] in stops[i]:
                toks = toks[:-1]
            text = self.tokenizer.decode(toks, self.skip_special_tokens)
            results.append(TextOutput(**{f.name: getattr(o, f.name)
                                         for f in dataclasses.fields(RequestOutput)},
                                      text=text, prompt=texts[i]))
        return results

    def chat(self, conversations: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping]],
             params: SamplingParams | Sequence[SamplingParams] = SamplingParams(),
             enable_thinking: bool = True, on_text: Callable[[int, str], None] | None = None,
             on_token: Callable[[int, list[int]], None] | None = None,
             tools: Sequence[Mapping[str, Any]] | None = None) -> list[TextOutput]:
        """Render each conversation with the engine's chat template (`self.chat_template`:
        the checkpoint's Jinja template, else the built-in ChatML; generation prompt added,
        `tools` given to the template) and generate; `<|im_end|>`/`<|endoftext|>` are added
        to the stop ids. One message list is one conversation. A template that refuses the
        chat raises ChatTemplateError (a ValueError) naming why."""
        if conversations and isinstance(conversations[0], Mapping):
            conversations = [conversations]
        prompts = [self.chat_template.render(c, True, tools, {"enable_thinking": enable_thinking})
                   for c in conversations]
        plist = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        extra = self.tokenizer.stop_ids()
        plist = [dataclasses.replace(sp, stop_token_ids=tuple(dict.fromkeys(
                    tuple(sp.stop_token_ids) + extra))) if isinstance(sp, SamplingParams) else sp
                 for sp in plist]
        return self.generate(prompts, plist, on_text=on_text, on_token=on_token)


# ---------------------------------------------------------------------------- reasoning split
def _held_prefix(text: str, marker: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of marker: text that may
    still become the marker once more arrives, so a stream must hold it back."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


class ReasoningStream:
    """Splits generated text into (reasoning, content) as it streams, as vLLM's qwen3
    reasoning parser does for Qwen3.5, whose generation prompt already opens `<think>`:

    * thinking on: everything before the first `</think>` is reasoning (a `<think>` the model
      writes itself at the very start is dropped), everything after it is content; output
      without `</think>` (cut by max_tokens) is all reasoning;
    * thinking off (the prompt closed an empty think block): everything is content.

    `push(piece)` returns the (reasoning, content) text that became final; text that may be
    the start of a marker split across pieces is held back until it is decided, so the
    concatenated deltas equal `split_reasoning` of the whole text.
    """

    def __init__(self, enable_thinking: bool = True):
        self.in_reasoning = bool(enable_thinking)
        self._buf = ""
        self._at_start = True   # nothing released yet: a leading <think> is still possible

    def push(self, piece: str) -> tuple[str, str]:
        if not self.in_reasoning:
            return "", piece
        self._buf += piece
        if self._at_start:
            if THINK_START.startswith(self._buf):       # maybe the start of a leading <think>
                return "", ""
            if self._buf.startswith(THINK_START):
                self._buf = self._buf[len(THINK_START):]
            self._at_start = False
        if THINK_END in self._buf:
            reasoning, _, content = self._buf.partition(THINK_END)
            self._buf, self.in_reasoning = "", False
            return reasoning, content
        hold = _held_prefix(self._buf, THINK_END)
        out, self._buf = self._buf[:len(self._buf) - hold], self._buf[len(self._buf) - hold:]
        if out:
            self._at_start = False
        return out, ""

    def flush(self) -> tuple[str, str]:
        """At the end of the output: what is held back was reasoning after all."""
        out, self._buf = self._buf, ""
        return (out, "") if self.in_reasoning else ("", out)


def split_reasoning(text: str, enable_thinking: bool = True) -> tuple[str | None, str | None]:
    """(reasoning, content) of a whole generated text, None for a part that is empty (as the
    OpenAI fields `reasoning_content` and `content` are null when absent); see
    `ReasoningStream` for the rule."""
    s = ReasoningStream(enable_thinking)
    r1, c1 = s.push(text)
    r2, c2 = s.flush()
    return (r1 + r2) or None, (c1 + c2) or None
