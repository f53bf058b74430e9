"""A continuation's text where it stands, after its prompt, with a SentencePiece-style tokenizer (Llama 2, Mistral
v0.1: a word's leading space is the "▁" of its token, which decoding drops at the start of a sequence): the served
text, its stream, the log-probs' token texts and offsets equal the whole sequence's decoding, as transformers and
vLLM give them; special tokens keep their text in log-probs."""

import json

import pytest

from tensorpar.data.tokenizer import HFTokenizer, text_after
from tensorpar.serving.engine import ChoiceEvent, EngineRequest, RequestDone
from tensorpar.serving.responses import Answer
from tensorpar.serving.step_plan import TokenLogprob
from tensorpar.serving.text import TextStream

WORDS = ["<unk>", "</s>", "▁You", "▁are", "▁a", "▁answers", "!", "▁is", "▁tool"]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.add_special_tokens([AddedToken("</s>", special=True)])
    path = tmp_path_factory.mktemp("metaspace") / "tokenizer.json"
    tok.save(str(path))
    return HFTokenizer(str(path))


def ids(*words):
    return [WORDS.index(w) for w in words]


PROMPT = ids("▁You", "▁are", "▁a")
NEW = ids("▁answers", "!", "▁is", "▁tool")


def test_a_continuation_reads_as_the_whole_sequence_decodes(tokenizer):
    whole, prompt = tokenizer.decode(PROMPT + NEW), tokenizer.decode(PROMPT)
    assert (prompt, whole) == ("You are a", "You are a answers! is tool")
    assert text_after(tokenizer, PROMPT, NEW) == whole[len(prompt):] == " answers! is tool"
    assert tokenizer.decode(NEW) == "answers! is tool"  # alone: the space that follows the prompt is lost
    assert text_after(tokenizer, [], NEW) == "answers! is tool"  # at the start of a sequence there is none
    stream, streamed = TextStream(tokenizer, ("tool",), PROMPT), ""
    for k in range(1, len(NEW) + 1):
        delta, stopped = stream.add(NEW[:k])
        streamed += delta
    assert stopped and streamed == " answers! is "


def test_no_stop_string_ends_the_continuation_before_min_tokens(tokenizer):
    """vLLM's rule: "!" in the 2nd token's text does not stop a continuation of at least 3 tokens; " is", which ends
    in the 3rd's, does; so would "! is", which begins before it."""
    for stop, min_tokens, expected in ((("!",), 3, " answers! is tool"), (("!",), 2, " answers"),
                                       (("is",), 3, " answers! "), (("! is",), 3, " answers")):
        stream, text = TextStream(tokenizer, stop, PROMPT, min_tokens), ""
        for k in range(1, len(NEW) + 1):
            delta, stopped = stream.add(NEW[:k])
            text += delta
            if stopped:
                break
        assert text + ("" if stopped else stream.flush()) == expected, (stop, min_tokens)


def _events(index=0):
    entries = [TokenLogprob(-0.5, [(t, -0.5), (WORDS.index("</s>"), -1.5)]) for t in NEW]
    return [ChoiceEvent(index, " answers", NEW[:1], entries[:1]), ChoiceEvent(index, "! is", NEW[1:3], entries[1:3]),
            ChoiceEvent(index, " tool", NEW[3:], entries[3:], finish_reason="length")]


@pytest.mark.parametrize("echo", [False, True])
def test_log_prob_texts_and_offsets_follow_the_text_streamed_or_whole(tokenizer, echo):
    request = EngineRequest([PROMPT], 4, top_logprobs=1, prompt_logprobs=echo)
    options = dict(echo=echo, stream=True, include_usage=False, logprobs=True)
    prompt_text = tokenizer.decode(PROMPT)
    streamed, whole = (Answer("completion", "m", request, options, tokenizer, [prompt_text]) for _ in range(2))
    chunks = []
    for i, event in enumerate(_events()):
        if echo and i == 0:
            event.prompt_logprobs = [TokenLogprob(-1.0, []), TokenLogprob(-1.0, [])]
        chunks += [json.loads(c[len("data: "):]) for c in streamed.chunk(event)]
        whole.choices[0].add(event)
    done = whole.whole(RequestDone(3, 4))["choices"][0]
    text = "".join(c["choices"][0]["text"] for c in chunks)
    assert text == done["text"] == (prompt_text if echo else "") + " answers! is tool"
    offsets = [o for c in chunks for o in c["choices"][0]["logprobs"]["text_offset"]]
    tokens = [t for c in chunks for t in c["choices"][0]["logprobs"]["tokens"]]
    assert offsets == done["logprobs"]["text_offset"] and tokens == done["logprobs"]["tokens"]
    assert "".join(tokens) == text and offsets == [sum(map(len, tokens[:i])) for i in range(len(tokens))]
    assert done["logprobs"]["top_logprobs"][-1] == {" tool": -0.5, "</s>": -1.5}  # the EOS by its text
