"""The request checks of `tensorpar.serving.protocol` alone, without a server: values that would reach the ranks and
break them are refused with a 400 naming the field."""

import json

import pytest

from tensorpar.serving.protocol import ApiError, ModelInfo, completion_request

INFO = ModelInfo(name="m", context_len=64, vocab_size=300)


class _Bytes:
    def encode(self, text, add_special_tokens=False):
        return [1] * add_special_tokens + list(text.encode())


@pytest.mark.parametrize("field", ["temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
                                   "min_p"])
@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity"])
def test_non_finite_numbers_are_refused(field, value):
    """Python's JSON parser takes NaN and Infinity: a NaN temperature passed the range check and its sampled ids
    crashed rank 0 (the whole server) in the tokenizer's decode."""
    body = json.loads(f'{{"model": "m", "prompt": "hi", "max_tokens": 2, "{field}": {value}}}')
    with pytest.raises(ApiError) as e:
        completion_request(body, _Bytes(), INFO)
    assert e.value.status == 400 and e.value.param == field


def test_finite_numbers_still_pass():
    body = {"model": "m", "prompt": "hi", "max_tokens": 2, "temperature": 0.5, "top_p": 1, "presence_penalty": 0}
    request, _ = completion_request(body, _Bytes(), INFO)
    assert request.sampling.temperature == 0.5


def test_a_prompt_over_the_context_without_max_tokens_is_over_the_context():
    with pytest.raises(ApiError) as e:
        completion_request({"model": "m", "prompt": "x" * 80}, _Bytes(), INFO)
    assert e.value.code == "context_length_exceeded" and "80" in e.value.message, e.value.message
    request, _ = completion_request({"model": "m", "prompt": "x" * 60}, _Bytes(), INFO)
    assert request.max_tokens == 4  # the default 16, as far as the context goes


def test_a_chat_answer_of_no_tokens_is_refused():
    from tensorpar.serving.protocol import chat_request

    class Template:
        def render(self, messages, *options):
            return "".join(m["content"] for m in messages)

    messages = [{"role": "user", "content": "hi"}]
    for key in ("max_tokens", "max_completion_tokens"):
        with pytest.raises(ApiError) as e:
            chat_request({"model": "m", "messages": messages, key: 0}, _Bytes(), INFO, Template())
        assert e.value.param == key and "at least 1" in e.value.message
    with pytest.raises(ApiError) as e:  # the prompt fills the context: no room for an answer
        chat_request({"model": "m", "messages": [{"role": "user", "content": "x" * 64}]}, _Bytes(), INFO, Template())
    assert e.value.code == "context_length_exceeded"


def test_temperatures_too_small_to_divide_by_sample_greedily():
    """vLLM's rule: the logits over 5e-324 overflow to inf, and the sample to a junk token."""
    for temperature, greedy in ((0, True), (5e-324, True), (1e-30, True), (1e-5, False), (0.7, False)):
        request, _ = completion_request({"model": "m", "prompt": "hi", "temperature": temperature}, _Bytes(), INFO)
        assert request.sampling.greedy == greedy, temperature
        assert request.sampling.temperature == (1.0 if greedy else temperature)


def test_vllms_sampling_fields_reach_the_engine_and_bad_ones_are_refused():
    body = {"model": "m", "prompt": "hi", "max_tokens": 4, "presence_penalty": -0.5, "frequency_penalty": 1.5,
            "repetition_penalty": 1.2, "min_p": 0.1, "min_tokens": 2, "stop_token_ids": [7, 9]}
    request, _ = completion_request(body, _Bytes(), ModelInfo(name="m", context_len=64, vocab_size=300,
                                                              eos_ids=frozenset({2})))
    s = request.sampling
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty, s.min_p) == (-0.5, 1.5, 1.2, 0.1)
    assert request.min_tokens == 2 and request.eos_ids == {2, 7, 9}
    for bad, param in (({"repetition_penalty": 0}, "repetition_penalty"), ({"min_p": 1.5}, "min_p"),
                       ({"presence_penalty": -2.5}, "presence_penalty"), ({"min_tokens": 5}, "min_tokens"),
                       ({"stop_token_ids": [300]}, "stop_token_ids"), ({"stop_token_ids": "7"}, "stop_token_ids"),
                       ({"min_tokens": -1}, "min_tokens")):
        with pytest.raises(ApiError) as e:
            completion_request({**body, **bad}, _Bytes(), INFO)
        assert e.value.status == 400 and e.value.param == param, bad


def test_vllm_fields_that_change_the_output_are_refused_not_ignored():
    body = {"model": "m", "prompt": "hi", "max_tokens": 2}
    for extra in ({"use_beam_search": True}, {"guided_json": {"type": "object"}}, {"prompt_logprobs": 0},
                  {"include_stop_str_in_output": True}, {"skip_special_tokens": False}, {"bad_words": ["x"]},
                  {"length_penalty": 2.0}):
        with pytest.raises(ApiError) as e:
            completion_request({**body, **extra}, _Bytes(), INFO)
        assert e.value.status == 400 and e.value.param == next(iter(extra)) and "not supported" in e.value.message
    for harmless in ({"use_beam_search": False}, {"skip_special_tokens": True}, {"bad_words": []}, {"user": "u"}):
        completion_request({**body, **harmless}, _Bytes(), INFO)


THINKING_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}"
                     "{% if add_generation_prompt %}<|assistant|>{% if enable_thinking %}<think>{% endif %}{% endif %}")


@pytest.mark.parametrize("extra", [{}, {"chat_template_kwargs": {"enable_thinking": True}},
                                   {"add_generation_prompt": False}, {"continue_final_message": True}])
def test_chat_prompts_equal_transformers_apply_chat_template(extra):
    """add_generation_prompt, continue_final_message (the last message left open) and chat_template_kwargs (here
    Qwen3's enable_thinking) render what transformers renders."""
    from tensorpar.data.chat_template import ChatTemplate
    from tensorpar.serving.protocol import chat_request

    from serving_model import build_tokenizer

    tokenizer = build_tokenizer()
    messages = [{"role": "user", "content": "What is two plus two?"}, {"role": "assistant", "content": "It is"}]
    expected = tokenizer.apply_chat_template(messages, chat_template=THINKING_TEMPLATE, tokenize=False,
                                             add_generation_prompt=extra.get("add_generation_prompt",
                                                                             not extra.get("continue_final_message")),
                                             continue_final_message=extra.get("continue_final_message", False),
                                             **extra.get("chat_template_kwargs", {}))
    template = ChatTemplate(THINKING_TEMPLATE, {"eos_token": tokenizer.eos_token}, "a test")
    body = {"model": "m", "messages": messages, "max_tokens": 2, **extra}
    request, _ = chat_request(body, _Bytes(), ModelInfo(name="m", context_len=256, vocab_size=300), template)
    assert bytes(request.prompts[0]).decode() == expected
    if extra.get("continue_final_message"):
        assert expected.endswith("It is")
        with pytest.raises(ApiError, match="exclude each other"):
            chat_request({**body, "add_generation_prompt": True}, _Bytes(), INFO, template)
    with pytest.raises(ApiError, match="may not set messages"):
        chat_request({**body, "chat_template_kwargs": {"messages": []}}, _Bytes(), INFO, template)


def test_a_chat_template_that_fails_is_a_400_and_a_broken_one_refused_at_start():
    """A Python error inside the template (here str + int) was a 500 with a traceback in the log; a template with a
    syntax error stopped `serve` with a traceback instead of one line."""
    from tensorpar.errors import TensorparError
    from tensorpar.data.chat_template import ChatTemplate
    from tensorpar.serving.protocol import chat_request

    template = ChatTemplate("{% for m in messages %}{{ m['content'] }}{% endfor %}{{ messages | length + 'x' }}", {},
                            "a test")
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    with pytest.raises(ApiError) as e:
        chat_request(body, _Bytes(), INFO, template)
    assert e.value.status == 400 and e.value.param == "messages" and "TypeError" in e.value.message
    with pytest.raises(TensorparError, match="chat template of a test: line 1"):
        ChatTemplate("{% for m in messages %}{{ m.content ", {}, "a test")


def test_json_mode_is_refused_not_ignored():
    from tensorpar.data.chat_template import ChatTemplate
    from tensorpar.serving.protocol import chat_request

    template = ChatTemplate("{% for m in messages %}{{ m['content'] }}{% endfor %}", {}, "a test")
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for fmt in ({"type": "json_object"}, {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}):
        with pytest.raises(ApiError) as e:
            chat_request({**body, "response_format": fmt}, _Bytes(), INFO, template)
        assert e.value.status == 400 and e.value.param == "response_format"
    chat_request({**body, "response_format": {"type": "text"}}, _Bytes(), INFO, template)


def test_strftime_now_renders_as_in_training_and_transformers():
    """Templates that date their system prompt (strftime_now, which transformers and tensorpar's training renderer
    give) were refused at every chat request: "'strftime_now' is undefined"."""
    import datetime

    from tensorpar.data.chat_template import ChatTemplate

    template = ChatTemplate("{{ strftime_now('%Y') }}|{{ messages[0]['content'] }}", {}, "a test")
    text = template.render([{"role": "user", "content": "a"}], add_generation_prompt=True)
    assert text == f"{datetime.datetime.now().year}|a"


def test_tokenize_gives_what_transformers_tokenizer_gives_and_detokenize_inverts_it(tmp_path):
    """vLLM's /tokenize and /detokenize bodies: a prompt with and without the tokenizer's special tokens (a BOS added
    by its post-processor, as `tokenizer(text)` adds it), a chat's messages as the chat request renders them."""
    from tokenizers.processors import TemplateProcessing

    from tensorpar.data.chat_template import ChatTemplate
    from tensorpar.data.tokenizer import HFTokenizer
    from tensorpar.serving.protocol import chat_prompt, detokenize_request, tokenize_request

    from serving_model import build_tokenizer

    reference = build_tokenizer()
    bos = reference.bos_token_id
    reference._tokenizer.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    reference.save_pretrained(tmp_path)
    ours = HFTokenizer(str(tmp_path))
    info = ModelInfo(name="m", context_len=256, vocab_size=len(reference))
    text = "The quick brown fox"
    plain = tokenize_request({"prompt": text}, ours, info, None)
    assert plain["tokens"] == reference(text, add_special_tokens=False).input_ids and plain["count"] > 1
    special = tokenize_request({"prompt": text, "add_special_tokens": True}, ours, info, None)
    assert special["tokens"] == reference(text).input_ids == [bos] + plain["tokens"]
    request, _ = completion_request({"model": "m", "prompt": text, "add_special_tokens": True, "max_tokens": 1},
                                    ours, info)
    assert request.prompts == [special["tokens"]]
    template = ChatTemplate(THINKING_TEMPLATE, {"eos_token": "</s>"}, "a test")
    body = {"messages": [{"role": "user", "content": "hi"}]}
    assert tokenize_request(body, ours, info, template)["tokens"] == chat_prompt(body, ours, info, template) == \
        reference(reference.apply_chat_template(body["messages"], chat_template=THINKING_TEMPLATE, tokenize=False,
                                                add_generation_prompt=True), add_special_tokens=False).input_ids
    assert detokenize_request({"tokens": plain["tokens"]}, ours, info) == {"prompt": text}
    for bad in ({"tokens": [info.vocab_size]}, {"tokens": "x"}):
        with pytest.raises(ApiError, match="tokens"):
            detokenize_request(bad, ours, info)
    for bad in ({"prompt": 5}, {"model": "other", "prompt": "a"}):
        with pytest.raises(ApiError):
            tokenize_request(bad, ours, info, None)
