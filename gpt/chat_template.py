"""A model's chat template: a conversation rendered to the text, and the token ids, that transformers'
`tokenizer.apply_chat_template(messages, tokenize=True)` gives.

The template is the model directory's own: `chat_template.jinja` beside its tokenizer, else
`chat_template.json`'s `chat_template`, else tokenizer_config.json's (a string, or a list of named templates:
the one named "default"). It is rendered as transformers renders it: Jinja2's immutable sandbox with
`trim_blocks` and `lstrip_blocks`, the loop controls, a `tojson` that leaves non-ASCII as it is, the helpers
`raise_exception`, `strftime_now`, `namespace` and `dict`, a `{% generation %}` block that renders its body,
and the variables `messages`, `add_generation_prompt`, `tools` (none), the tokenizer's special tokens
(`bos_token`, `eos_token`, `unk_token`) and any keyword a caller adds (Qwen3's `enable_thinking`). The text
becomes ids with the special tokens' text read as those tokens and nothing added around it (transformers'
`add_special_tokens=False`): a template writes its own BOS.

A template is code from whoever made the directory. It runs in the sandbox, within `RENDER_SECONDS` and
`MAX_RENDERED_CHARS`: one that raises (a role it does not accept), loops or writes without end is one line
(`ChatTemplateError`), never a hang.
"""

from __future__ import annotations

import datetime
import json
import sys
import time
from collections.abc import Mapping, Sequence

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from gpt.errors import ConfigError, first_line
from gpt.tokenizer import TextTokenizer

__all__ = ["ChatTemplate", "ChatTemplateError", "TEMPLATE_FILES", "RENDER_SECONDS", "MAX_RENDERED_CHARS", "ROLES",
           "message_text"]

TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")
"""The files beside a tokenizer that hold its chat template (before tokenizer_config.json's `chat_template`)."""
RENDER_SECONDS = 5.0
"""The longest one rendering may take (a conversation renders in about a millisecond)."""
MAX_RENDERED_CHARS = 16 << 20
"""The most text one rendering may write."""


ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
"""The roles a message may have (OpenAI's and Hugging Face's), and the role a template sees for each ("developer" is
OpenAI's newer name for system)."""


def message_text(content) -> str | None:
    """A message's content as text: a string, or a list of text parts (`{"type": "text", "text": ...}`) joined by
    newlines, as vLLM joins them; None for anything else."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(part, dict) and part.get("type") == "text"
                                         and isinstance(part.get("text"), str) for part in content):
        return "\n".join(part["text"] for part in content)
    return None


class ChatTemplateError(ConfigError):
    """A conversation the template refuses, or a template that fails, loops or writes without end."""


class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`, which marks an assistant's text in some templates: its body."""

    tags = {"generation"}

    def parse(self, parser):
        line = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(line)

    @staticmethod
    def _body(caller):
        return caller()


class _Namespace(jinja2.utils.Namespace):
    """Jinja's `namespace`, refusing names with a leading underscore (no way to reach Python's internals)."""

    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attributes = dict(*args, **kwargs)
        for name in attributes:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attributes)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a template may not set {name!r} on a namespace")


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _environment() -> ImmutableSandboxedEnvironment:
    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=[_Generation, jinja2.ext.loopcontrols])
    environment.filters["tojson"] = _tojson
    environment.globals.update(raise_exception=_raise_exception, namespace=_Namespace, dict=dict,
                               strftime_now=lambda format: datetime.datetime.now().strftime(format))
    return environment


def _template_text(files: Mapping[str, str]) -> tuple[str, str] | None:
    """(the template's text, where it was found) among a tokenizer's files by name; None where none holds one."""
    if "chat_template.jinja" in files:
        return files["chat_template.jinja"], "chat_template.jinja"
    for name in ("chat_template.json", "tokenizer_config.json"):
        try:
            record = json.loads(files[name]) if name in files else {}
        except ValueError as e:
            raise ConfigError(f"{name} is not JSON: {first_line(e)}") from None
        template = record.get("chat_template") if isinstance(record, dict) else None
        if isinstance(template, list):  # named templates: the default one
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        if template is not None:
            if not isinstance(template, str):
                raise ConfigError(f"{name}'s chat_template must be a string (or a list of named ones), got "
                                  f"{type(template).__name__}")
            return template, name
    return None


class ChatTemplate:
    """A model's chat template, compiled once; `render` and `ids` for each conversation.

    Args:
      text: the template's Jinja source.
      special_tokens: the tokenizer's special tokens' text by transformers' names (`bos_token`, ...), which the
        template sees as variables.
      where: where the template came from, for messages.
    """

    def __init__(self, text: str, special_tokens: Mapping[str, str | None], where: str = "the chat template"):
        self.text, self.where = text, where
        self.special_tokens = {name: token for name, token in special_tokens.items() if token is not None}
        try:
            self._template = _environment().from_string(text)
        except jinja2.exceptions.TemplateSyntaxError as e:
            raise ConfigError(f"{where} is not a Jinja template: {first_line(e)} (line {e.lineno})") from None

    @classmethod
    def of(cls, tokenizer: TextTokenizer) -> ChatTemplate | None:
        """The template among `tokenizer`'s files (a model's own tokenizer: `TokenizerJson.files`); None where
        it has none (GPT-2's tokenizer, a directory without one)."""
        files = getattr(tokenizer, "files", None) or {}
        found = _template_text(files)
        return None if found is None else cls(found[0], tokenizer.special_tokens(), found[1])

    def render(self, messages: Sequence[Mapping], add_generation_prompt: bool = True, **variables) -> str:
        """The conversation's text. `messages`: dicts with a `role` and a `content` (a string, or as the
        template reads it); `add_generation_prompt`: end with what opens the assistant's turn; `variables`:
        any more the template reads (`enable_thinking=False`). ChatTemplateError when the template refuses the
        conversation, or fails, or runs past RENDER_SECONDS or MAX_RENDERED_CHARS."""
        context = {**self.special_tokens, "tools": None, "documents": None, **variables,
                   "messages": [dict(m) for m in messages], "add_generation_prompt": add_generation_prompt}
        deadline = time.monotonic() + RENDER_SECONDS
        pieces, written = [], 0
        previous = sys.gettrace()
        sys.settrace(_deadline_tracer(deadline, self.where))
        try:
            for piece in self._template.generate(**context):
                written += len(piece)
                if written > MAX_RENDERED_CHARS:
                    raise ChatTemplateError(f"{self.where} wrote more than {MAX_RENDERED_CHARS:,} characters for one "
                                            f"conversation of {len(messages)} messages")
                pieces.append(piece)
        except ChatTemplateError:
            raise
        except jinja2.exceptions.TemplateError as e:  # raise_exception's message, or a sandbox refusal
            raise ChatTemplateError(f"{self.where}: {first_line(e)}") from None
        except (TypeError, ValueError, KeyError, AttributeError, IndexError, ArithmeticError, RecursionError) as e:
            raise ChatTemplateError(f"{self.where} failed on this conversation: {type(e).__name__}: "
                                    f"{first_line(e)}") from None
        finally:
            sys.settrace(previous)
        return "".join(pieces)

    def ids(self, tokenizer: TextTokenizer, messages: Sequence[Mapping], add_generation_prompt: bool = True,
            **variables) -> list[int]:
        """The rendered conversation's token ids: special tokens' text as those tokens, nothing added around."""
        return tokenizer.encode(self.render(messages, add_generation_prompt, **variables), allow_special=True,
                                add_special=False)


def _deadline_tracer(deadline: float, where: str):
    """A trace function that raises ChatTemplateError in the traced code once `deadline` has passed: a loop in a
    template that writes nothing (a `for` over a `for`) is stopped as surely as one that writes."""
    def trace(frame, event, arg):
        if time.monotonic() > deadline:
            raise ChatTemplateError(f"{where} ran past {RENDER_SECONDS:g} s on one conversation: it loops")
        return trace
    return trace
