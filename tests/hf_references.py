"""transformers' own results as the references of the Hugging Face folder tests (tests/family_models.py,
tests/test_hf_moe.py, tests/test_hf_deepseek.py): a random token file cut into windows, and for each small random model
saved by `save_pretrained`, its mean next-token loss over those windows and its greedy continuations, computed once
when the folders are written; and the pool workers that compute tensorpar's side (`on_ranks`, `generate_in_worker`)."""

import numpy as np
import torch

from tensorpar.commands.generate import generate_text
from tensorpar.config.options import GenerateOptions
from tensorpar.data import load_tokenizer


def reference_loss(model, windows: torch.Tensor) -> float:
    """transformers' mean next-token loss over `windows` [N, seq + 1] (inputs the first seq, targets the last)."""
    with torch.no_grad():
        logits = model(windows[:, :-1]).logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), windows[:, 1:].reshape(-1)).item()


def reference_greedy(model, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """transformers' greedy continuation of each prompt alone."""
    with torch.no_grad():
        return [model.generate(torch.tensor([p]), max_new_tokens=new_tokens, do_sample=False)[0, len(p):].tolist()
                for p in prompts]


def saved_references(root, names, build, *, vocab: int, seq: int, windows: int, prompts, new_tokens: int) -> dict:
    """name -> {folder, loss, tokens (greedy, per prompt), model} for each of `names`, the model `build(i, name)` saved
    under root/name; "data": the token file (`windows` windows of seq + 1 tokens, and 3 more), "windows": its
    windows."""
    tokens = np.random.default_rng(0).integers(0, vocab, size=windows * (seq + 1) + 3).astype(np.int32)
    np.save(root / "tokens.npy", tokens)
    cut = torch.from_numpy(tokens[: windows * (seq + 1)].astype(np.int64)).view(windows, seq + 1)
    out = {"data": str(root / "tokens.npy"), "windows": cut}
    for i, name in enumerate(names):
        model = build(i, name)
        model.save_pretrained(root / name)
        out[name] = dict(folder=str(root / name), loss=reference_loss(model, cut),
                         tokens=reference_greedy(model, prompts, new_tokens), model=model)
    return out


def on_ranks(pools, fn, **options) -> list:
    """`fn(**options)` on the lcm(tp, ep x expert_tp) ranks the layout takes (a shared pool; this process for one
    rank)."""
    world = int(np.lcm(options["tp"], options["ep"] * options.get("expert_tp", 1)))
    return [fn(**options)] if world == 1 else pools(world).run(fn, **options)


def generate_in_worker(prompts: list[list[int]], new_tokens: int, **options) -> list[list[int]]:
    """`tensorpar generate --greedy`'s work on a pool's ranks: the continuations of `prompts` (a batch)."""
    options = GenerateOptions(device="cpu", max_new_tokens=new_tokens, greedy=True, ignore_eos=True, **options)
    sampling = dict(greedy=True, temperature=1.0, top_k=0, top_p=1.0, seed=0)
    return generate_text(options, load_tokenizer(options.checkpoint), prompts, sampling, None)[0]
