"""A small Llama saved by transformers with a real tokenizer and a chat template: what the serving tests and
bench/serve.py serve, and what transformers and lm-eval's `hf` model read back. Built locally, nothing downloaded."""

from __future__ import annotations

import torch

TEXT = ("The quick brown fox jumps over the lazy dog. A tensor-parallel model splits its attention heads and its "
        "feed-forward neurons across ranks; every rank holds a shard of the weights. Question: what is two plus "
        "two? Answer: four. The capital of France is Paris, and the capital of Italy is Rome. ")
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def build_tokenizer(vocab_size: int = 400):
    """A byte-level BPE tokenizer trained on TEXT, as transformers' PreTrainedTokenizerFast."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TEXT * 4], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def save_llama(folder, *, seed: int = 7, hidden: int = 64, layers: int = 2, heads: int = 4, kv_heads: int = 2,
               ffn: int = 128, context: int = 256) -> str:
    """Save the model and its tokenizer in `folder`; the vocabulary is the tokenizer's, made odd (it does not divide
    by the TP size: the last shard is padded)."""
    import transformers

    tokenizer = build_tokenizer()
    vocab = len(tokenizer) + (1 - len(tokenizer) % 2)
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn,
                                      num_hidden_layers=layers, num_attention_heads=heads,
                                      num_key_value_heads=kv_heads, max_position_embeddings=context,
                                      bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                                      tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).float().eval()
    with torch.no_grad():
        for p in model.parameters():  # away from HF's zero biases and unit norms; a wider spread of logits
            p.add_(torch.randn_like(p) * 0.05)
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return str(folder)
