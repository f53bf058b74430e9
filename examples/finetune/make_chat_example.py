"""Write a CPU-sized chat fine-tuning example into a folder: a ChatML tokenizer folder (a small byte-level BPE with
<|im_start|> / <|im_end|> and the ChatML chat template in tokenizer_config.json), 400 conversations asking for sums
(chat.jsonl), the same 400 answered in words ("3 plus 4 is seven.", chat-words.jsonl: what `make demo-lora` teaches
a LoRA adapter), and a small Llama-style model whose vocabulary is the tokenizer's (model.json).

    python examples/finetune/make_chat_example.py runs/chat-example
    tensorpar train --model runs/chat-example/model.json --tokenizer runs/chat-example/tokenizer \
        --data runs/chat-example/chat.jsonl ...            (`make demo-finetune` runs both)
"""

import json
import os
import random
import sys

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>'"
          " + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
SYSTEMS = ["", "You are a helpful assistant.", "Answer briefly.", "You are a calculator that answers in words and "
           "numbers, one sentence, and never says anything else, however the question is put to you."]
ASKS = ["What is {a} plus {b}?", "{a} plus {b}?", "Please add {a} and {b}.", "Could you tell me what {a} plus {b} "
        "makes? I need it for my homework and I am not sure.", "Sum {a} and {b}."]


WORDS = ("zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen "
         "seventeen eighteen").split()


def conversation(rng: random.Random) -> list[dict]:
    a, b = rng.randint(0, 9), rng.randint(0, 9)
    system = rng.choice(SYSTEMS)
    messages = [{"role": "system", "content": system}] if system else []
    return messages + [{"role": "user", "content": rng.choice(ASKS).format(a=a, b=b)},
                       {"role": "assistant", "content": f"{a} plus {b} is {a + b}."}]


def in_words(messages: list[dict]) -> list[dict]:
    """The conversation with its answer's sum spelled out: "3 plus 4 is 7." -> "3 plus 4 is seven."."""
    *head, answer = messages
    left, total = answer["content"].rstrip(".").rsplit(" is ", 1)
    return head + [{"role": "assistant", "content": f"{left} is {WORDS[int(total)]}."}]


def main(folder: str) -> None:
    rng = random.Random(0)
    conversations = [conversation(rng) for _ in range(400)]
    os.makedirs(os.path.join(folder, "tokenizer"), exist_ok=True)
    worded = [in_words(c) for c in conversations]
    for name, rows in (("chat.jsonl", conversations), ("chat-words.jsonl", worded)):
        with open(os.path.join(folder, name), "w") as f:
            for messages in rows:
                f.write(json.dumps({"messages": messages}) + "\n")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([m["content"] for c in conversations + worded for m in c]
                            + ["system\nuser\nassistant\n"] * 50, trainer)
    tok.save(os.path.join(folder, "tokenizer", "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer", "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHATML, "eos_token": "<|im_end|>",
                   "pad_token": "<|endoftext|>"}, f, indent=1)
    model = dict(family="llama", vocab_size=tok.get_vocab_size(), hidden_size=128, num_layers=4, num_heads=4,
                 num_kv_heads=2, ffn_hidden_size=352, max_seq_len=512, norm="rmsnorm", activation="silu",
                 gated_mlp=True, position="rope", tie_embeddings=False)
    with open(os.path.join(folder, "model.json"), "w") as f:
        json.dump(model, f, indent=1)
    print(f"wrote {folder}/: tokenizer/ ({tok.get_vocab_size()} ids, ChatML template), chat.jsonl and "
          f"chat-words.jsonl ({len(conversations)} conversations each), model.json")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "runs/chat-example")
