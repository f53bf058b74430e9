"""A tokenizer's chat template, rendered with Jinja2 exactly as transformers' `apply_chat_template` renders it, and
where the assistant's turns lie in the rendered text.

The template comes from a Hugging Face tokenizer folder (`chat_template` in tokenizer_config.json, or
chat_template.jinja beside it) or from a file (`--chat-template FILE`). It is compiled in Jinja2's immutable
sandbox with transformers' settings (trim_blocks, lstrip_blocks, the loopcontrols extension, its `tojson`
filter, `raise_exception` and `strftime_now`) and sees what transformers gives it: the messages (keys whose
value is null dropped, a message's reasoning also under `reasoning_content`), `add_generation_prompt`, and the
tokenizer's special tokens (`bos_token`, `eos_token`, ... from tokenizer_config.json).

The assistant's turns: where the template marks them with ``{% generation %} ... {% endgeneration %}`` (as
transformers' `return_assistant_tokens_mask` reads them), the marked text. Otherwise by rendering prefixes:
assistant message i spans from the end of the messages before it rendered with the generation prompt to the
end of the messages up to it (its content and whatever the template closes the turn with, e.g. <|eot_id|> or
<|im_end|>); one that opens the conversation, from where the template writes its content. That needs each such
render to be a prefix of the whole conversation's; a template for which it is not (one that rewrites earlier turns,
e.g. drops their reasoning) is refused, naming the conversation and the message, with the way out: a template with
generation markers.
"""

from __future__ import annotations

import datetime
import json
import os
import re

from tensorpar.data import tokenizer
from tensorpar.errors import TensorparError

# The tokenizer_config.json entries transformers passes to the template (its special_tokens_map).
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# A Python error inside a template (str + int on a message's content that is not text, say): the template's failure
# on these messages, reported as its own refusals are.
TEMPLATE_ERRORS = (TypeError, ValueError, KeyError, IndexError, AttributeError, ArithmeticError)


def _jinja():
    try:
        import jinja2  # noqa: PLC0415 - only runs that read conversations need it
        import jinja2.ext  # noqa: PLC0415
        import jinja2.sandbox  # noqa: PLC0415
    except ImportError:
        raise TensorparError("rendering chat templates needs the 'jinja2' package (pip install jinja2)") from None
    return jinja2


def _special_tokens(config: dict) -> dict[str, str]:
    """The special tokens' texts of a tokenizer_config.json, which templates read as variables."""
    texts = {k: tokenizer.special_token_text(config.get(k)) for k in SPECIAL_TOKEN_KEYS}
    return {k: text for k, text in texts.items() if isinstance(text, str)}


def _template_of(config: dict, folder: str) -> str | None:
    """The default chat template of a tokenizer folder: chat_template.jinja, else tokenizer_config.json's."""
    jinja_file = os.path.join(folder, "chat_template.jinja")
    if os.path.isfile(jinja_file):
        with open(jinja_file, encoding="utf-8") as f:
            return f.read()
    template = config.get("chat_template")
    if isinstance(template, list):  # several named templates: transformers uses "default"
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "  # transformers' marker of where a continued message ends
OPENING_STAND_IN = "TENSORPAR_OPENING_ASSISTANT_CONTENT"  # the content `_opening` renders a leading assistant turn with


class ChatTemplate:
    """A compiled chat template and the special tokens it is rendered with."""

    def __init__(self, text: str, special_tokens: dict[str, str], source: str):
        jinja2 = _jinja()
        self.source, self.text = source, text
        self.special_tokens = dict(special_tokens)
        self.marked = _has_generation_tag(text)  # the template marks the assistant's text itself
        self._spans: list[tuple[int, int]] | None = None  # filled while a render tracks generation blocks
        self._blocks: list[str] = []
        try:
            self._template = _environment(jinja2, self).from_string(text)
        except jinja2.TemplateSyntaxError as e:
            raise TensorparError(f"chat template of {source}: line {e.lineno}: {e.message}") from None

    @classmethod
    def load(cls, tokenizer_folder: str | None, template_file: str | None = None) -> "ChatTemplate":
        """The template of `template_file` if given, else the tokenizer folder's; the special tokens from the
        folder's tokenizer_config.json either way."""
        folder = tokenizer_folder if tokenizer_folder and os.path.isdir(tokenizer_folder) else (
            os.path.dirname(tokenizer_folder) if tokenizer_folder else None)
        if template_file is not None:
            if not os.path.isfile(template_file):
                raise TensorparError(f"--chat-template file '{template_file}' does not exist")
            with open(template_file, encoding="utf-8") as f:
                config = tokenizer.tokenizer_config(tokenizer.tokenizer_folder(folder)) if folder else {}
                return cls(f.read(), _special_tokens(config), f"'{template_file}'")
        template = cls.of_folder(folder) if folder else None
        if template is None:
            where = f"the tokenizer folder '{folder}'" if folder else "the tokenizer (none was given: bytes)"
            raise TensorparError(f"conversations need a chat template and {where} has none (no chat_template in "
                                 f"tokenizer_config.json, no chat_template.jinja): give --tokenizer a Hugging Face "
                                 f"tokenizer folder that has one, or --chat-template FILE")
        return template

    @classmethod
    def of_folder(cls, folder: str) -> "ChatTemplate | None":
        """The template of a tokenizer, Hugging Face model or tensorpar checkpoint folder (a checkpoint's root: its
        latest step's files), or None when it has none."""
        folder = tokenizer.tokenizer_folder(folder)
        config = tokenizer.tokenizer_config(folder)
        text = _template_of(config, folder)
        return None if text is None else cls(text, _special_tokens(config), f"the tokenizer folder '{folder}'")

    def render(self, messages: list[dict], add_generation_prompt: bool = False, continue_final_message: bool = False,
               variables: dict | None = None, tools: list | None = None) -> str:
        """The conversation as the template writes it (what `apply_chat_template(..., tokenize=False)` returns, with
        the same `add_generation_prompt`, `continue_final_message`, extra template `variables` and `tools`, the
        functions' JSON schemas).

        `continue_final_message` ends the text with the last message's content, open: transformers' way, a tag
        appended to the content and everything from it on cut off."""
        jinja2 = _jinja()
        messages = plain_messages(messages)
        if continue_final_message:
            if add_generation_prompt:
                raise TensorparError("continue_final_message and add_generation_prompt exclude each other")
            if not messages or not isinstance(messages[-1].get("content"), str):
                raise TensorparError("continue_final_message needs a last message with text content to continue")
            final = messages[-1]["content"]
            messages[-1] = {**messages[-1], "content": final + CONTINUE_TAG}
        try:
            text = self._template.render(messages=messages, tools=tools, documents=None,
                                         add_generation_prompt=add_generation_prompt,
                                         **{**self.special_tokens, **(variables or {})})
        except jinja2.TemplateError as e:
            raise TensorparError(f"chat template of {self.source}: {e}") from None
        except TEMPLATE_ERRORS as e:
            raise TensorparError(f"chat template of {self.source}: {type(e).__name__}: {e}") from None
        if continue_final_message:
            if final.strip() not in text or CONTINUE_TAG.strip() not in text:
                raise TensorparError(f"continue_final_message: the chat template of {self.source} does not write the "
                                     f"last message's content as given, so it cannot be continued")
            at = text.rindex(CONTINUE_TAG.strip())
            text = text[:at] if text[at:at + len(CONTINUE_TAG)] == CONTINUE_TAG else text[:at].rstrip()
        return text

    def render_with_spans(self, messages: list[dict], tools: list | None = None) -> tuple[str, list[tuple[int, int]]]:
        """(the rendered conversation, the [start, end) character spans of the assistant's turns in it)."""
        if self.marked:
            return self._render_tracked(messages, tools)
        text = self.render(messages, tools=tools)
        spans = []
        for i, message in enumerate(messages):
            if message.get("role") != "assistant":
                continue
            before = self._opening(messages, i, tools)
            upto = self.render(messages[: i + 1], tools=tools)
            if not (upto.startswith(before) and text.startswith(upto)):
                raise _not_a_prefix(i, before, upto, text)
            spans.append((len(before), len(upto)))
        return text, spans

    def _opening(self, messages: list[dict], i: int, tools: list | None) -> str:
        """The text before assistant message i's turn: the messages before it rendered with the generation prompt, or,
        for a conversation that opens with it (no messages before it to render), what the template writes before its
        content (the message rendered alone with a stand-in content, cut there)."""
        if i > 0:
            return self.render(messages[:i], add_generation_prompt=True, tools=tools)
        alone = self.render([{**messages[0], "content": OPENING_STAND_IN}], tools=tools)
        return alone[: alone.index(OPENING_STAND_IN)] if OPENING_STAND_IN in alone else alone

    def _render_tracked(self, messages: list[dict], tools: list | None) -> tuple[str, list[tuple[int, int]]]:
        """Render block by block, recording where each {% generation %} block lands (transformers' way)."""
        jinja2 = _jinja()
        self._spans, self._blocks = [], []
        try:
            for block in self._template.generate(messages=plain_messages(messages), tools=tools, documents=None,
                                                 add_generation_prompt=False, **self.special_tokens):
                self._blocks.append(block)
            return "".join(self._blocks), self._spans
        except jinja2.TemplateError as e:
            raise TensorparError(f"chat template of {self.source}: {e}") from None
        except TEMPLATE_ERRORS as e:
            raise TensorparError(f"chat template of {self.source}: {type(e).__name__}: {e}") from None
        finally:
            self._spans = None

    def _generation_block(self, caller) -> str:
        text = caller()
        if self._spans is not None:
            start = len("".join(self._blocks))
            self._spans.append((start, start + len(text)))
        return text


def _not_a_prefix(i: int, before: str, upto: str, text: str) -> TensorparError:
    what = ("the messages before it, rendered with the generation prompt, are not how the conversation up to it "
            "starts" if not upto.startswith(before) else "the conversation up to it is not how the whole one starts")
    return TensorparError(f"message {i} (assistant): {what}, so the template rewrites earlier turns and its tokens "
                          f"cannot be told from the prompt's; give --chat-template FILE with a template that marks "
                          f"the assistant's text with {{% generation %}} ... {{% endgeneration %}}")


def _has_generation_tag(text: str) -> bool:
    return re.search(r"\{%-?\s*generation\s*-?%\}", text) is not None


def plain_messages(messages: list[dict]) -> list[dict]:
    """The messages as transformers hands them to the template: keys whose value is None dropped, and a message's
    reasoning (under any of its names) also as `reasoning_content` and `thinking`."""
    out = []
    for message in messages:
        message = {k: v for k, v in message.items() if v is not None}
        reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def _environment(jinja2, owner: ChatTemplate):
    """Jinja2's immutable sandbox with transformers' settings, filters and globals, and the generation tag."""

    class GenerationTag(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_support"), [], [], body).set_lineno(lineno)

        def _support(self, caller):
            return owner._generation_block(caller)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                       extensions=[GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env
