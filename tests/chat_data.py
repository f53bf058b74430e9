"""Local chat tokenizer folders (Llama-3 and Qwen2.5 templates, a small byte-level BPE with their special tokens) and
conversations whose prompts differ widely in length: what the fine-tuning tests train on, with no download."""

import json
import random

LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
    "message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")

# Qwen2.5-Instruct's template (its tool branches included).
QWEN25_TEMPLATE = (
    "{%- if tools %}\n    {{- '<|im_start|>system\\n' }}\n    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- messages[0]['content'] }}\n    {%- else %}\n"
    "        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}\n    {%- endif %}\n"
    "    {{- \"\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\" }}\n"
    "    {%- for tool in tools %}\n        {{- \"\\n\" }}\n        {{- tool | tojson }}\n    {%- endfor %}\n"
    "    {{- \"\\n</tools><|im_end|>\\n\" }}\n{%- else %}\n    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n    {%- else %}\n"
    "        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
    "<|im_end|>\\n' }}\n    {%- endif %}\n{%- endif %}\n{%- for message in messages %}\n"
    "    {%- if (message.role == \"user\") or (message.role == \"system\" and not loop.first) or "
    "(message.role == \"assistant\" and not message.tool_calls) %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
    "    {%- elif message.role == \"assistant\" %}\n        {{- '<|im_start|>' + message.role }}\n"
    "        {%- if message.content %}\n            {{- '\\n' + message.content }}\n        {%- endif %}\n"
    "        {%- for tool_call in message.tool_calls %}\n            {%- if tool_call.function is defined %}\n"
    "                {%- set tool_call = tool_call.function %}\n            {%- endif %}\n"
    "            {{- '\\n<tool_call>\\n{\"name\": \"' }}\n            {{- tool_call.name }}\n"
    "            {{- '\", \"arguments\": ' }}\n            {{- tool_call.arguments | tojson }}\n"
    "            {{- '}\\n</tool_call>' }}\n        {%- endfor %}\n        {{- '<|im_end|>\\n' }}\n"
    "    {%- elif message.role == \"tool\" %}\n"
    "        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != \"tool\") %}\n"
    "            {{- '<|im_start|>user' }}\n        {%- endif %}\n        {{- '\\n<tool_response>\\n' }}\n"
    "        {{- message.content }}\n        {{- '\\n</tool_response>' }}\n"
    "        {%- if loop.last or (messages[loop.index0 + 1].role != \"tool\") %}\n"
    "            {{- '<|im_end|>\\n' }}\n        {%- endif %}\n    {%- endif %}\n{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n    {{- '<|im_start|>assistant\\n' }}\n{%- endif %}\n")

# A ChatML template that marks the assistant's text itself, as transformers' return_assistant_tokens_mask reads it.
MARKED_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{% else %}"
    "{{ message['content'] + '<|im_end|>' }}{% endif %}{{ '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

STYLES = {
    "llama3": dict(special=["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                            "<|eot_id|>"],
                   config={"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}, template=LLAMA3_TEMPLATE),
    "qwen": dict(special=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                 config={"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None},
                 template=QWEN25_TEMPLATE),
    "marked": dict(special=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                   config={"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}, template=MARKED_TEMPLATE),
}

VOCAB = 512  # the tokenizer's ids (with its special tokens): the test models' vocabulary
WORDS = ("the model adds two numbers and then it says what the sum is so that a reader who asks gets a short "
         "clear answer about apples pears seven eleven plus minus times why how when please thanks").split()


def conversations(n: int, seed: int = 0, words: int = 30) -> list[list[dict]]:
    """`n` conversations: an optional system prompt of up to `words` words, 1-2 user/assistant exchanges whose
    prompts run from 0 to `words` words and answers are short sums: the masked prompts differ widely in length."""
    rng = random.Random(seed)

    def text(lo, hi):
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))

    out = []
    for _ in range(n):
        messages = [{"role": "system", "content": text(1, words)}] if rng.random() < 0.5 else []
        for _ in range(rng.randint(1, 2)):
            a, b = rng.randint(1, 9), rng.randint(1, 9)
            messages.append({"role": "user", "content": f"{text(0, words)} {a} plus {b}?".strip()})
            messages.append({"role": "assistant", "content": f"{a} plus {b} is {a + b}. {text(0, 4)}".strip()})
        out.append(messages)
    return out


def write_tokenizer_folder(folder, style: str) -> str:
    """A Hugging Face tokenizer folder (tokenizer.json + tokenizer_config.json with the style's chat template)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    spec = STYLES[style]
    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=spec["special"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    sample = [m["content"] for c in conversations(200, seed=99) for m in c] + ["system user assistant\n\n"] * 20
    tok.train_from_iterator(sample, trainer)
    tok.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": spec["template"],
              "model_max_length": 4096, **{k: v for k, v in spec["config"].items() if v is not None}}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return str(folder)


def write_chat_jsonl(path, n: int, seed: int = 0, words: int = 30) -> str:
    with open(path, "w") as f:
        for messages in conversations(n, seed, words):
            f.write(json.dumps({"messages": messages}) + "\n")
    return str(path)
