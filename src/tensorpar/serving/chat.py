"""A checkpoint's chat template: the Jinja template Hugging Face tokenizers carry, rendered as transformers renders
it (`apply_chat_template` with add_generation_prompt=True), in a sandbox."""

from __future__ import annotations

import datetime
import json
import os

from tensorpar.errors import TensorparError


class ChatTemplate:
    def __init__(self, source: str, special_tokens: dict[str, str] | None = None):
        try:
            import jinja2
            from jinja2.sandbox import ImmutableSandboxedEnvironment
        except ImportError as e:
            raise TensorparError("chat templates need jinja2: pip install 'tensorpar[serve]'") from e

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, ensure_ascii=False, indent=indent)
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)  # as transformers' renderer
        try:
            self._template = env.from_string(source)
        except jinja2.exceptions.TemplateSyntaxError as e:
            raise TensorparError(f"the checkpoint's chat template: line {e.lineno}: {e.message}") from None
        self._error = jinja2.exceptions.TemplateError
        self.special_tokens = dict(special_tokens or {})

    def render(self, messages: list[dict]) -> str:
        """The prompt text of `messages`, ending where the assistant's answer starts."""
        try:
            return self._template.render(messages=messages, add_generation_prompt=True, **self.special_tokens)
        except self._error as e:
            raise ValueError(f"the chat template refused the messages: {e}") from e
        except (TypeError, ValueError, KeyError, IndexError, AttributeError, ArithmeticError) as e:
            # a Python error inside the template: the request's messages are what it cannot take (a 400, not a 500)
            raise ValueError(f"the chat template failed on the messages: {type(e).__name__}: {e}") from e


def _token_text(value) -> str | None:
    return value.get("content") if isinstance(value, dict) else value if isinstance(value, str) else None


def load_chat_template(folder: str) -> ChatTemplate | None:
    """The template of a checkpoint folder: chat_template.jinja, else tokenizer_config.json's 'chat_template' (a
    string, or a list of named ones: 'default'); None when it has none. A tensorpar checkpoint's root reads its
    latest step's files."""
    from tensorpar.data.tokenizer import tokenizer_folder

    folder = tokenizer_folder(folder)
    config = {}
    path = os.path.join(folder, "tokenizer_config.json")
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    special = {name: text for name in ("bos_token", "eos_token", "unk_token", "pad_token")
               if (text := _token_text(config.get(name))) is not None}
    source = None
    jinja_file = os.path.join(folder, "chat_template.jinja")
    if os.path.isfile(jinja_file):
        with open(jinja_file, encoding="utf-8") as f:
            source = f.read()
    elif isinstance(config.get("chat_template"), str):
        source = config["chat_template"]
    elif isinstance(config.get("chat_template"), list):
        named = {t.get("name"): t.get("template") for t in config["chat_template"] if isinstance(t, dict)}
        source = named.get("default")
    return ChatTemplate(source, special) if source else None
