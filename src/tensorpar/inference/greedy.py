"""Greedy decoding by re-running the whole sequence each step (no KV cache): short samples after training.

Each rank holds a vocabulary shard of the logits; the winning token is found without gathering
them: every rank proposes its best (value, token id), one all-gather of 2 numbers per rank, and
the best proposal wins (ties go to the lowest id, as torch.argmax does).
"""

from __future__ import annotations

import torch

from tensorpar.inference.generation import check_generate_args, tp_argmax_rows


def tp_argmax(local_logits: torch.Tensor, model) -> int:
    """The global argmax token of vocabulary-sharded logits [V_local] (a collective over the TP group)."""
    return int(tp_argmax_rows(model.mask_padding(local_logits.float())[None], model.tp_group)[0])


@torch.no_grad()
def greedy_generate(model, prompt_ids: list[int], max_new_tokens: int, eos_id: int | None = None) -> list[int]:
    """The new token ids (not the prompt). Call on every TP rank; all get the same result."""
    check_generate_args([prompt_ids], max_new_tokens, model.cfg.vocab_size)
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    tp = model.tp_group.size
    ids = list(prompt_ids)
    new: list[int] = []
    for _ in range(max_new_tokens):
        window = ids[-model.cfg.max_seq_len :]
        length = len(window)
        if model.sequence_parallel and length % tp:
            # Right padding is invisible to the real positions under causal attention.
            window = window + [0] * (tp - length % tp)
        logits = model(torch.tensor([window], device=device))
        token = tp_argmax(logits[0, length - 1], model)
        ids.append(token)
        new.append(token)
        if eos_id is not None and token == eos_id:
            break
    model.train(was_training)
    return new
