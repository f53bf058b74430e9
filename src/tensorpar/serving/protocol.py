"""The OpenAI API's requests, checked: a request body in, an `EngineRequest` out, or an `ApiError` that the server
answers in OpenAI's error shape, {"error": {"message", "type", "param", "code"}}, with its HTTP status.

Fields of the OpenAI API or vLLM's that change what is generated and that the server cannot honour (logit bias,
best_of > 1, tools, beam search, guided decoding, ...) are refused, never silently ignored; fields neither defines
are ignored (as vLLM does). vLLM's extensions it honours: `top_k`, `min_p`, `repetition_penalty`, `min_tokens`,
`stop_token_ids`, `ignore_eos`, `add_special_tokens`, and for chats `add_generation_prompt`,
`continue_final_message`, `chat_template_kwargs`. Temperature 0 is greedy decoding.
"""

from __future__ import annotations

import dataclasses
import json
import math

from tensorpar.errors import TensorparError
from tensorpar.inference.generation import MIN_TEMPERATURE
from tensorpar.serving.engine import EngineRequest
from tensorpar.serving.step_plan import Sampling

MAX_LOGPROBS = 20
MAX_N = 16
MAX_STOP = 4
DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions


class ApiError(Exception):
    def __init__(self, message: str, *, status: int = 400, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.status, self.param, self.code, self.type = message, status, param, code, type

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclasses.dataclass(frozen=True)
class ModelInfo:
    """What the checks need to know of the served model."""

    name: str
    context_len: int
    vocab_size: int
    eos_ids: frozenset[int] = frozenset()


def _type_name(kind) -> str:
    names = {int: "an integer", float: "a number", bool: "a boolean", str: "a string", list: "an array",
             dict: "an object"}
    return names[kind]


def field(body: dict, name: str, kind, default=None, *, low=None, high=None, nullable: bool = True):
    """body[name] checked: its type (an int is a number; a bool is not an int), its range; `default` if absent or
    null (when nullable)."""
    value = body.get(name)
    if value is None:
        if name in body and not nullable:
            raise ApiError(f"'{name}' must be {_type_name(kind)}, got null", param=name)
        return default
    ok = isinstance(value, kind) and not (kind in (int, float) and isinstance(value, bool))
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        ok, value = True, float(value)
    if not ok:
        raise ApiError(f"'{name}' must be {_type_name(kind)}, got {type(value).__name__} {value!r:.40}", param=name)
    if kind is float and not math.isfinite(value):  # JSON's NaN / Infinity, which Python's parser takes
        raise ApiError(f"'{name}' must be a finite number, got {value}", param=name)
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = f"at least {low}" if high is None else f"at most {high}" if low is None else f"in [{low}, {high}]"
        raise ApiError(f"'{name}' must be {bounds}, got {value}", param=name)
    return value


def check_model(body: dict, info: ModelInfo) -> None:
    model = field(body, "model", str)
    if model is None:
        raise ApiError("'model' is required (GET /v1/models lists the served model)", param="model")
    if model != info.name:
        raise ApiError(f"The model `{model}` does not exist: this server serves `{info.name}`", status=404,
                       param="model", code="model_not_found")


# vLLM's request fields that change what is generated and that this server does not implement: refused when set (a
# field neither API defines is ignored, as vLLM does).
_VLLM_UNSUPPORTED = ("use_beam_search", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
                     "structured_outputs", "allowed_token_ids", "bad_words", "logits_processors", "prompt_logprobs",
                     "truncate_prompt_tokens")
_VLLM_DEFAULTS = {"include_stop_str_in_output": False, "skip_special_tokens": True,
                  "spaces_between_special_tokens": True, "length_penalty": 1.0}


def _refuse_unsupported(body: dict) -> None:
    if field(body, "logit_bias", dict):
        raise ApiError("'logit_bias' is not supported by this server (leave it unset)", param="logit_bias")
    if field(body, "best_of", int, 1, low=1) != 1:
        raise ApiError("'best_of' other than 1 is not supported by this server", param="best_of")
    for name in ("tools", "functions", "suffix", *_VLLM_UNSUPPORTED):
        value = body.get(name)
        if not (value is None or value is False or value in ([], {}, "")):  # 0 asks for something (prompt_logprobs)
            raise ApiError(f"'{name}' is not supported by this server", param=name)
    for name, default in _VLLM_DEFAULTS.items():
        if name in body and body[name] != default:
            raise ApiError(f"'{name}' other than {json.dumps(default)} is not supported by this server", param=name)
    response_format = body.get("response_format")
    if response_format is not None and not (isinstance(response_format, dict) and response_format.get("type") == "text"):
        raise ApiError("'response_format' other than {\"type\": \"text\"} (JSON mode, JSON schemas) is not supported "
                       "by this server", param="response_format")


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise ApiError("'stop' must be a string or an array of strings", param="stop")
    if len(stop) > MAX_STOP:
        raise ApiError(f"'stop' takes at most {MAX_STOP} sequences, got {len(stop)}", param="stop")
    return tuple(stop)


def sampling(body: dict) -> tuple[Sampling, int | None]:
    """(the sampling parameters, the seed or None)."""
    temperature = field(body, "temperature", float, 1.0, low=0.0, high=2.0)
    top_p = field(body, "top_p", float, 1.0, low=0.0, high=1.0)
    if top_p == 0.0:
        raise ApiError("'top_p' must be in (0, 1], got 0", param="top_p")
    top_k = field(body, "top_k", int, 0, low=-1)
    seed = field(body, "seed", int)
    repetition = field(body, "repetition_penalty", float, 1.0, low=0.0)
    if repetition == 0.0:
        raise ApiError("'repetition_penalty' must be positive (1: none), got 0", param="repetition_penalty")
    greedy = temperature < MIN_TEMPERATURE
    return Sampling(greedy=greedy, temperature=1.0 if greedy else temperature, top_k=max(top_k, 0), top_p=top_p,
                    min_p=field(body, "min_p", float, 0.0, low=0.0, high=1.0),
                    presence_penalty=field(body, "presence_penalty", float, 0.0, low=-2.0, high=2.0),
                    frequency_penalty=field(body, "frequency_penalty", float, 0.0, low=-2.0, high=2.0),
                    repetition_penalty=repetition), seed


def _is_ids(value) -> bool:
    """Whether `value` is a JSON array of integers (true and false are not ids)."""
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def _check_vocabulary(ids: list[int], info: ModelInfo, what: str, param: str) -> None:
    """Refuse token ids outside the model's vocabulary: "<what> outside the vocabulary [0, V): <the first five>"."""
    bad = [t for t in ids if not 0 <= t < info.vocab_size]
    if bad:
        raise ApiError(f"{what} outside the vocabulary [0, {info.vocab_size}): {bad[:5]}", param=param)


def _stop_tokens(body: dict, info: ModelInfo, max_tokens: int) -> tuple[frozenset[int], int]:
    """(the tokens that end a continuation: the EOS unless `ignore_eos`, and `stop_token_ids`; `min_tokens`, how many
    tokens come before any of them may)."""
    ids = body.get("stop_token_ids")
    if ids is None:
        ids = []
    if not _is_ids(ids):
        raise ApiError("'stop_token_ids' must be an array of token ids", param="stop_token_ids")
    _check_vocabulary(ids, info, "'stop_token_ids' has ids", "stop_token_ids")
    min_tokens = field(body, "min_tokens", int, 0, low=0)
    if min_tokens > max_tokens:
        raise ApiError(f"'min_tokens' ({min_tokens}) must be at most max_tokens ({max_tokens})", param="min_tokens")
    eos = frozenset() if field(body, "ignore_eos", bool, False) else info.eos_ids
    return eos | frozenset(ids), min_tokens


def _prompts(body: dict, tokenizer, info: ModelInfo) -> list[list[int]]:
    prompt = body.get("prompt")
    if prompt is None:
        raise ApiError("'prompt' is required: a string, an array of strings, an array of token ids or an array of "
                       "arrays of token ids", param="prompt")
    special = field(body, "add_special_tokens", bool, False)
    if isinstance(prompt, str):
        prompts = [tokenizer.encode(prompt, add_special_tokens=special)]
    elif _is_ids(prompt) and prompt:
        prompts = [list(prompt)]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        prompts = [tokenizer.encode(p, add_special_tokens=special) for p in prompt]
    elif isinstance(prompt, list) and prompt and all(_is_ids(p) for p in prompt):
        prompts = [list(p) for p in prompt]
    else:
        raise ApiError("'prompt' must be a string, an array of strings, an array of token ids or an array of "
                       "arrays of token ids (none of them empty)", param="prompt")
    for i, ids in enumerate(prompts):
        if not ids:
            raise ApiError(f"prompt {i} is empty: the model needs at least one token", param="prompt")
        _check_vocabulary(ids, info, f"prompt {i} has token ids", "prompt")
    return prompts


def check_length(prompts: list[list[int]], max_tokens: int, info: ModelInfo) -> None:
    longest = max(len(p) for p in prompts)
    if longest + max_tokens > info.context_len:
        raise ApiError(f"This model's maximum context length is {info.context_len} tokens. However, you requested "
                       f"{longest + max_tokens} tokens ({longest} in the prompt, {max_tokens} for the completion). "
                       f"Please reduce the length of the prompt or the completion.", param="max_tokens",
                       code="context_length_exceeded")


def _stream(body: dict) -> tuple[bool, bool]:
    """(stream, include_usage)."""
    stream = field(body, "stream", bool, False)
    options = field(body, "stream_options", dict, {})
    return stream, bool(field(options, "include_usage", bool, False))


def completion_request(body, tokenizer, info: ModelInfo) -> tuple[EngineRequest, dict]:
    """(the engine's request, what the answer needs: echo, stream, include_usage, prompts' text) of a
    /v1/completions body."""
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object")
    check_model(body, info)
    _refuse_unsupported(body)
    prompts = _prompts(body, tokenizer, info)
    max_tokens = field(body, "max_tokens", int, None, low=0)
    if max_tokens is None:
        max_tokens = max(0, min(DEFAULT_COMPLETION_TOKENS, info.context_len - max(len(p) for p in prompts)))
    check_length(prompts, max_tokens, info)
    logprobs = field(body, "logprobs", int, None, low=0, high=MAX_LOGPROBS)
    echo = field(body, "echo", bool, False)
    n = field(body, "n", int, 1, low=1, high=MAX_N)
    stream, usage = _stream(body)
    sample, seed = sampling(body)
    eos, min_tokens = _stop_tokens(body, info, max_tokens)
    request = EngineRequest(prompts, max_tokens, n, sample, seed, -1 if logprobs is None else logprobs,
                            echo and logprobs is not None, _stop(body), eos, min_tokens)
    return request, dict(echo=echo, stream=stream, include_usage=usage, logprobs=logprobs is not None)


def _messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError("'messages' must be a non-empty array of {\"role\", \"content\"} objects", param="messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError(f"messages[{i}] must be an object with a string 'role'", param="messages")
        content = m.get("content")
        if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise ApiError(f"messages[{i}].content: only text parts are supported", param="messages")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise ApiError(f"messages[{i}].content must be a string or an array of text parts", param="messages")
        out.append({**m, "content": content})
    return out


def chat_prompt(body: dict, tokenizer, info: ModelInfo, template) -> list[int]:
    """The token ids of a chat body's `messages` rendered with the chat `template` (and vLLM's
    add_generation_prompt, continue_final_message, chat_template_kwargs, add_special_tokens)."""
    messages = _messages(body)
    if template is None:
        raise ApiError("this checkpoint has no chat template (tokenizer_config.json 'chat_template' or "
                       "chat_template.jinja): use /v1/completions", param="messages")
    variables = field(body, "chat_template_kwargs", dict, {})
    reserved = sorted(set(variables) & {"messages", "tools", "documents", "add_generation_prompt"})
    if reserved:
        raise ApiError(f"'chat_template_kwargs' may not set {', '.join(reserved)}: they are the request's own",
                       param="chat_template_kwargs")
    continue_final = field(body, "continue_final_message", bool, False)
    generation_prompt = field(body, "add_generation_prompt", bool, not continue_final)
    try:
        text = template.render(messages, generation_prompt, continue_final, variables)
    except TensorparError as e:  # the template's raise_exception, or its error on messages it does not take
        raise ApiError(str(e), param="messages") from None
    return _prompts({"prompt": text, "add_special_tokens": field(body, "add_special_tokens", bool, False)},
                    tokenizer, info)[0]


def tokenize_request(body, tokenizer, info: ModelInfo, template) -> dict:
    """vLLM's /tokenize: the token ids a completion's `prompt` (text) or a chat's `messages` becomes."""
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object")
    if body.get("model") is not None:
        check_model(body, info)
    if "messages" in body:
        ids = chat_prompt(body, tokenizer, info, template)
    elif isinstance(body.get("prompt"), str):
        ids = _prompts(body, tokenizer, info)[0]
    else:
        raise ApiError("'prompt' (a string) or 'messages' is required", param="prompt")
    return {"count": len(ids), "max_model_len": info.context_len, "tokens": ids}


def detokenize_request(body, tokenizer, info: ModelInfo) -> dict:
    """vLLM's /detokenize: the text of `tokens`."""
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object")
    if body.get("model") is not None:
        check_model(body, info)
    tokens = body.get("tokens")
    if not _is_ids(tokens):
        raise ApiError("'tokens' must be an array of token ids", param="tokens")
    _check_vocabulary(tokens, info, "'tokens' has ids", "tokens")
    return {"prompt": tokenizer.decode(tokens, skip_special_tokens=False)}  # as vLLM: special tokens' text kept


def chat_request(body, tokenizer, info: ModelInfo, template) -> tuple[EngineRequest, dict]:
    """As `completion_request`, for /v1/chat/completions: the messages rendered with the chat `template`
    (`tensorpar.data.chat_template.ChatTemplate`: as training renders conversations; None when the checkpoint has
    none)."""
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object")
    check_model(body, info)
    _refuse_unsupported(body)
    if field(body, "echo", bool, False):
        raise ApiError("'echo' (vLLM's: the last message before the answer) is not supported by this server",
                       param="echo")
    prompt = chat_prompt(body, tokenizer, info, template)
    prompts = [prompt]
    max_tokens = field(body, "max_completion_tokens", int, None, low=1)  # an answer of no tokens: refused, as vLLM
    max_tokens = field(body, "max_tokens", int, max_tokens, low=1)
    if max_tokens is None:
        max_tokens = max(1, info.context_len - len(prompt))  # a prompt that fills the context leaves no room
    check_length(prompts, max_tokens, info)
    logprobs = field(body, "logprobs", bool, False)
    top = field(body, "top_logprobs", int, 0, low=0, high=MAX_LOGPROBS)
    if top and not logprobs:
        raise ApiError("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    n = field(body, "n", int, 1, low=1, high=MAX_N)
    stream, usage = _stream(body)
    sample, seed = sampling(body)
    eos, min_tokens = _stop_tokens(body, info, max_tokens)
    request = EngineRequest(prompts, max_tokens, n, sample, seed, top if logprobs else -1, False, _stop(body), eos,
                            min_tokens)
    return request, dict(echo=False, stream=stream, include_usage=usage, logprobs=logprobs)
