"""Chat templates: the tokenizer's own, rendered with jinja2 as transformers' ``apply_chat_template``
renders it (a sandboxed environment with ``trim_blocks``/``lstrip_blocks``, ``loopcontrols``,
its ``tojson``, ``raise_exception`` and ``strftime_now``, the special tokens as variables), so
a prompt rendered here is the one transformers would build, without importing transformers.

Where the template is: ``chat_template.jinja`` beside the tokenizer (transformers >= 4.43 saves it
there), else ``tokenizer_config.json``'s ``chat_template`` (a string, or a list of named templates
of which "default" is used).
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from ..tokenizer import read_chat_template
from .protocol import RequestError

SPECIAL = ("bos_token", "eos_token", "unk_token", "pad_token")


def find_template(tokenizer_dir) -> str | None:
    """The tokenizer's chat template source, or None when it ships none (OPT)."""
    tokenizer_dir = Path(tokenizer_dir)
    template = read_chat_template(tokenizer_dir, _config(tokenizer_dir))
    if isinstance(template, dict):  # named templates: the default one is the chat template
        template = template.get("default")
    return template if isinstance(template, str) and template.strip() else None


def _config(tokenizer_dir: Path) -> dict:
    path = tokenizer_dir / "tokenizer_config.json"
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


class ChatTemplate:
    """A compiled chat template and the special tokens it may refer to."""

    def __init__(self, source: str, special_tokens: dict[str, str | None]):
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            # transformers' filter: jinja's own escapes HTML characters, which would change the prompt
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self.template = env.from_string(source)
        self.special_tokens = special_tokens
        self.errors = (jinja2.exceptions.TemplateError,)

    @classmethod
    def from_dir(cls, tokenizer_dir) -> "ChatTemplate | None":
        source = find_template(tokenizer_dir)
        if source is None:
            return None
        config = _config(Path(tokenizer_dir))
        special = {}
        for name in SPECIAL:
            token = config.get(name)
            special[name] = token.get("content") if isinstance(token, dict) else token
        return cls(source, special)

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The prompt text of ``messages``; a template's own refusal (``raise_exception``: roles
        out of order, say) becomes a 400 on ``messages``."""
        try:
            return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                        tools=None, documents=None, **self.special_tokens)
        except self.errors as exc:
            raise RequestError(f"the model's chat template refused these messages: {exc}", "messages",
                               code="invalid_messages") from None
