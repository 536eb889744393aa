"""The checkpoint's own chat template, rendered the way transformers renders it.

Why: a chat model is trained on one exact prompt text (its system/tools section, the think
blocks, the tool-call format); the checkpoint ships that text as a Jinja template, so the
server renders the checkpoint's template rather than a copy of it in Python, and a new
checkpoint with a changed template needs no code change.

Where the template comes from (`load_chat_template`), as transformers loads it:
`<checkpoint>/chat_template.jinja`, else the "chat_template" of `tokenizer_config.json` (a string,
or a list of {"name", "template"} of which "default" is used). A checkpoint without either
falls back to the hand-written ChatML of `mtpjax.text.apply_chat_template` (which takes no
tools and only the `enable_thinking` variable).

How it is rendered (`render_jinja`), matching transformers' `render_jinja_template`: a
sandboxed `ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)` with the loop
controls extension, a `{% generation %}` tag that renders its body, the `tojson` filter as
`json.dumps` (non-ASCII kept, no HTML escaping), the globals `raise_exception` and
`strftime_now`; the variables are `messages` (None-valued keys dropped, the reasoning aliased
to `reasoning_content` and `thinking`), `tools`, `documents`, `add_generation_prompt`, the
tokenizer's special tokens (`bos_token`, `eos_token`, ...) and any template variables the
caller passes (e.g. `enable_thinking`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from datetime import datetime
from typing import Any, Mapping, Sequence

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                       "cls_token", "mask_token")
RESERVED = frozenset({"messages", "tools", "documents", "add_generation_prompt"})
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class ChatTemplateError(ValueError):
    """The messages cannot be rendered (the template raised on them)."""


class TemplateVariableError(ChatTemplateError):
    """A template variable is not allowed (reserved, or unknown to the built-in template)."""


# ---------------------------------------------------------------------------------- loading
def _token_text(v: Any) -> str | None:
    """A special token of tokenizer_config.json: a string, or an AddedToken dict."""
    if isinstance(v, dict):
        v = v.get("content")
    return v if isinstance(v, str) else None


def _template_of_config(config: Mapping[str, Any], path: str) -> str | None:
    t = config.get("chat_template")
    if t is None or isinstance(t, str):
        return t
    if isinstance(t, list):
        named = {d.get("name"): d.get("template") for d in t if isinstance(d, dict)}
        if isinstance(named.get("default"), str):
            return named["default"]
    raise ChatTemplateError(f"{path}: 'chat_template' must be a string or a list of "
                            "{name, template} with a 'default' entry")


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
    """A checkpoint's chat template: `source` is its Jinja text (None: the hand-written
    ChatML), `special_tokens` the tokenizer's named special tokens, `origin` where it came
    from (for messages)."""
    source: str | None = None
    special_tokens: Mapping[str, str] = dataclasses.field(default_factory=dict)
    origin: str = "mtpjax.text.apply_chat_template"

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
               tools: Sequence[Mapping[str, Any]] | None = None,
               variables: Mapping[str, Any] | None = None) -> str:
        """The prompt text of a chat; variables: the template's own (e.g. enable_thinking).
        ChatTemplateError when the template refuses the chat or a variable."""
        variables = dict(variables or {})
        if self.source is None:
            return render_fallback(messages, add_generation_prompt, tools, variables)
        return render_jinja(self.source, messages, add_generation_prompt, tools,
                            variables={**self.special_tokens, **variables})


    def check_variables(self, variables: Mapping[str, Any]) -> None:
        """A client's template variables (the server's chat_template_kwargs): one the template
        never reads would be dropped without a word (a typo, or a kwarg meant for another
        model's template), so it is refused by name (TemplateVariableError). Callers that set
        well-known variables whatever the template (TextEngine's enable_thinking) skip this."""
        if self.source is None:
            return                      # render_fallback refuses all but enable_thinking
        unknown = set(variables) - RESERVED - template_variables(self.source)
        if unknown:
            known = sorted(template_variables(self.source) - RESERVED - set(self.special_tokens))
            raise TemplateVariableError(
                f"the chat template ({self.origin}) reads no variable "
                f"{', '.join(repr(u) for u in sorted(unknown))}; it reads "
                f"{', '.join(repr(k) for k in known) or 'none'}")


def load_chat_template(folder: str) -> ChatTemplate:
    """The chat template of a checkpoint folder (module docstring for the order)."""
    config_path = os.path.join(folder, "tokenizer_config.json")
    config: dict = {}
    if os.path.isfile(config_path):
        with open(config_path, encoding="utf-8") as f:
            config = json.load(f)
    special = {k: t for k in SPECIAL_TOKEN_NAMES if (t := _token_text(config.get(k)))}
    jinja_path = os.path.join(folder, "chat_template.jinja")
    if os.path.isfile(jinja_path):
        with open(jinja_path, encoding="utf-8") as f:
            source = f.read()
        compile_template(source)                # a broken template fails at load, not per request
        return ChatTemplate(source, special, jinja_path)
    source = _template_of_config(config, config_path)
    if source is None:
        return ChatTemplate()
    compile_template(source)
    return ChatTemplate(source, special, config_path)


# -------------------------------------------------------------------------------- rendering
def _raise_exception(message: str):
    import jinja2
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """transformers' tojson: json.dumps, without Jinja's HTML escaping and key sorting."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=8)
def compile_template(source: str):
    """The compiled Jinja template (cached: a server renders one template per request)."""
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """`{% generation %}...{% endgeneration %}` (transformers' assistant-mask tag): the body
        as it is; no masks are needed to serve."""
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ChatTemplateError(f"the chat template does not compile: {e}") from e


@functools.lru_cache(maxsize=8)
def template_variables(source: str) -> frozenset[str]:
    """The variables a template reads from its context (Jinja's undeclared variables: what
    a caller may set), less the globals this module provides."""
    from jinja2 import meta
    env = compile_template(source).environment
    names = meta.find_undeclared_variables(env.parse(source))
    return frozenset(names) - set(env.globals)


def template_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict]:
    """Messages as transformers hands them to a template: None-valued keys dropped, a
    message's reasoning under `reasoning_content` and `thinking` whichever name it came in."""
    out = []
    for m in messages:
        m = {k: v for k, v in m.items() if v is not None}
        reasoning = next((m[k] for k in _REASONING_FIELDS if m.get(k) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


def render_jinja(source: str, messages: Sequence[Mapping[str, Any]],
                 add_generation_prompt: bool = True,
                 tools: Sequence[Mapping[str, Any]] | None = None,
                 documents: Sequence[Mapping[str, Any]] | None = None,
                 variables: Mapping[str, Any] | None = None) -> str:
    """Render a Jinja chat template as transformers' apply_chat_template(tokenize=False);
    variables: further template variables (special tokens, enable_thinking, ...)."""
    import jinja2
    variables = dict(variables or {})
    clash = RESERVED & set(variables)
    if clash:
        raise TemplateVariableError(f"template variables may not set {', '.join(sorted(clash))}")
    try:
        return compile_template(source).render(
            messages=template_messages(messages), tools=None if tools is None else list(tools),
            documents=None if documents is None else list(documents),
            add_generation_prompt=add_generation_prompt, **variables)
    except jinja2.exceptions.TemplateError as e:
        raise ChatTemplateError(str(e)) from e
    except (TypeError, ValueError, AttributeError, KeyError) as e:   # a template tripping on
        raise ChatTemplateError(f"{type(e).__name__}: {e}") from e   # input it did not expect


def render_fallback(messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                    tools: Sequence[Mapping[str, Any]] | None = None,
                    variables: Mapping[str, Any] | None = None) -> str:
    """The hand-written ChatML for a checkpoint without a template: no tools, and of the
    template variables only `enable_thinking`."""
    from mtpjax.text import apply_chat_template
    if tools:
        raise ChatTemplateError("this checkpoint has no chat template, and the built-in one "
                                "renders no tools")
    variables = dict(variables or {})
    unknown = set(variables) - {"enable_thinking"}
    if unknown:
        raise TemplateVariableError(f"the built-in chat template takes only 'enable_thinking', not "
                                f"{', '.join(sorted(unknown))}")
    thinking = variables.get("enable_thinking", True)
    if not isinstance(thinking, bool):
        raise TemplateVariableError("'enable_thinking' must be a boolean")
    try:
        return apply_chat_template(list(messages), add_generation_prompt, thinking)
    except (ValueError, KeyError, TypeError) as e:
        raise ChatTemplateError(str(e)) from e
