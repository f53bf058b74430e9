"""Token streams, fixed-length windows, the train/validation split and the per-step batches.

Every sample is a window of `seq_len + 1` tokens (inputs are [:-1], targets [1:]). The order of
samples depends only on the seed and the global batch size, never on how ranks are laid out:
`TokenDataset.global_batch` gives the whole step, `micro_batches` cuts this DP rank's part.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from tensorpar.config.choices import BIN_DTYPES
from tensorpar.data.corpus import default_corpus_text
from tensorpar.errors import LayoutError, TensorparError

_NUMPY_DTYPES = {"uint16": np.uint16, "int32": np.int32}


def load_tokens(path: str | None, tokenizer, bin_dtype: str = "uint16") -> np.ndarray:
    """A 1-D int64 token array: the default corpus (None), a .npy, a raw .bin of `bin_dtype`, or text."""
    if bin_dtype not in BIN_DTYPES:
        raise TensorparError(f"bin dtype '{bin_dtype}' is not supported; use one of {sorted(BIN_DTYPES)}")
    if path is None:
        tokens = _encode(default_corpus_text(), tokenizer)
        source = "the default corpus"
    else:
        if not os.path.exists(path):
            raise TensorparError(f"data file '{path}' does not exist")
        if not os.path.isfile(path):
            raise TensorparError(f"data file '{path}' is not a regular file")
        ext = os.path.splitext(path)[1].lower()
        if ext == ".npy":
            tokens = _load_npy(path)
        elif ext == ".bin":
            tokens = _load_bin(path, bin_dtype)
        else:
            tokens = _encode(_read_text(path), tokenizer)
        source = f"data file '{path}'"
    if tokens.size == 0:
        raise TensorparError(f"{source} holds no tokens")
    return tokens


def _encode(text: str, tokenizer) -> np.ndarray:
    return np.asarray(tokenizer.encode(text), dtype=np.int64).reshape(-1)


def _read_text(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except UnicodeDecodeError as e:
        raise TensorparError(
            f"data file '{path}' is not UTF-8 text (byte {e.start}); token files must end in .npy or .bin"
        ) from e


def _load_npy(path: str) -> np.ndarray:
    try:
        array = np.load(path, allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:  # EOFError: an empty file
        raise TensorparError(f"data file '{path}' is not a readable .npy array: {e or 'it is empty'}") from e
    if not isinstance(array, np.ndarray) or not np.issubdtype(array.dtype, np.integer):
        dtype = getattr(array, "dtype", type(array).__name__)
        raise TensorparError(f"data file '{path}' holds {dtype} values; token ids must be integers")
    return array.reshape(-1).astype(np.int64)


def _load_bin(path: str, bin_dtype: str) -> np.ndarray:
    dtype = np.dtype(_NUMPY_DTYPES[bin_dtype])
    size = os.path.getsize(path)
    if size % dtype.itemsize:
        raise TensorparError(
            f"data file '{path}' has {size} bytes, not a multiple of {dtype.itemsize} ({bin_dtype}); "
            "the file is truncated or the bin dtype is wrong"
        )
    return np.fromfile(path, dtype=dtype).astype(np.int64)


def check_vocab(tokens, vocab_size: int, source: str) -> None:
    """Raise TensorparError if any token id of `source` lies outside [0, vocab_size)."""
    array = np.asarray(tokens)
    if array.size == 0:
        return
    lo, hi = int(array.min()), int(array.max())
    if lo < 0:
        raise TensorparError(f"{source}: token id {lo} is negative; ids must lie in [0, {vocab_size})")
    if hi >= vocab_size:
        raise TensorparError(
            f"{source}: token id {hi} does not fit the vocabulary of size {vocab_size} "
            f"(ids must lie in [0, {vocab_size}); wrong tokenizer or bin dtype?)"
        )


def _as_tensor(tokens) -> torch.Tensor:
    if isinstance(tokens, torch.Tensor):
        array = tokens.detach().cpu().numpy()
    else:
        array = np.asarray(tokens)
    if array.ndim != 1:
        raise TensorparError(f"token stream must be 1-D, got shape {tuple(array.shape)}")
    return torch.from_numpy(np.ascontiguousarray(array, dtype=np.int64))


def check_step(step: int, seed: int, global_batch_size: int) -> None:
    """A TensorparError unless the step, the seed and the global batch size can address samples."""
    if step < 0:
        raise TensorparError(f"step must be >= 0, got {step}")
    if global_batch_size < 1:
        raise TensorparError(f"global batch size must be >= 1, got {global_batch_size}")
    if seed < 0:
        raise TensorparError(f"seed must be >= 0, got {seed}")


def _as_array(tokens) -> np.ndarray:
    """A 1-D integer array of `tokens` without copying a numpy array or a memory map."""
    array = tokens.detach().cpu().numpy() if isinstance(tokens, torch.Tensor) else np.asarray(tokens)
    if array.ndim != 1:
        raise TensorparError(f"token stream must be 1-D, got shape {tuple(array.shape)}")
    if not np.issubdtype(array.dtype, np.integer):
        raise TensorparError(f"token ids must be integers, got {array.dtype}")
    return array


def _windows(tokens: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Non-overlapping [N, seq_len + 1] windows from the start of `tokens` (a view; remainder dropped)."""
    width = seq_len + 1
    n = tokens.numel() // width
    return tokens[: n * width].view(n, width)


def _check_seq_len(seq_len: int) -> None:
    if not isinstance(seq_len, int) or seq_len < 1:
        raise TensorparError(f"seq_len must be a positive integer, got {seq_len!r}")


def eval_windows(tokens, seq_len: int) -> torch.Tensor:
    """Consecutive non-overlapping windows of seq_len + 1 tokens from the start: LongTensor [N, seq_len + 1]."""
    _check_seq_len(seq_len)
    stream = _as_tensor(tokens)
    if stream.numel() < seq_len + 1:
        raise TensorparError(
            f"{stream.numel()} tokens cannot fill one evaluation window of seq_len + 1 = {seq_len + 1} tokens"
        )
    return _windows(stream, seq_len).clone()


def epoch_permutation(n: int, seed: int, epoch: int, stream_id: int | None = None) -> np.ndarray:
    """The order of `n` training samples in epoch `epoch`: fixed by the seed (and a mixture's source number)."""
    entropy = [seed, epoch] if stream_id is None else [seed, epoch, stream_id]
    return np.random.default_rng(entropy).permutation(n)


class TokenDataset:
    """A token stream split into training windows (the start) and validation windows (the end).

    The validation part is the last `val_fraction` of the stream rounded down to whole windows
    (at least one window when val_fraction > 0 and the stream has room for two); the rest is
    training, cut into windows of seq_len + 1 tokens at stride seq_len + 1.
    """

    def __init__(self, tokens, seq_len: int, val_fraction: float = 0.1, stream_id: int | None = None):
        _check_seq_len(seq_len)
        if not 0.0 <= val_fraction < 1.0:
            raise TensorparError(f"val_fraction must lie in [0, 1), got {val_fraction}")
        stream = _as_array(tokens)  # a memory map stays one: windows are read when a batch asks for them
        width = seq_len + 1
        total = stream.size
        num_val = int(total * val_fraction) // width
        if val_fraction > 0 and num_val == 0 and total >= 2 * width:
            num_val = 1
        train_len = total - num_val * width
        if train_len < width:
            raise TensorparError(
                f"{total} tokens are too few: one training window needs seq_len + 1 = {width} tokens "
                f"after {num_val * width} validation tokens (val_fraction {val_fraction})"
            )
        self.seq_len = seq_len
        self.val_fraction = val_fraction
        self.stream_id = stream_id  # a mixture's source number: its own shuffle, independent of the others'
        self._train = stream[: (train_len // width) * width].reshape(-1, width)
        self._val = stream[train_len:].reshape(num_val, width)
        self.num_train_windows = self._train.shape[0]
        self.num_val_windows = num_val
        self.train_tokens = train_len
        self._perms: dict[tuple[int, int], np.ndarray] = {}

    def _permutation(self, seed: int, epoch: int) -> np.ndarray:
        key = (seed, epoch)
        if key not in self._perms:
            if len(self._perms) >= 4:  # a step touches at most a few epochs; keep the cache small
                self._perms.clear()
            self._perms[key] = epoch_permutation(self.num_train_windows, seed, epoch, self.stream_id)
        return self._perms[key]

    def shuffled_indices(self, start: int, stop: int, seed: int) -> np.ndarray:
        """Training-window indices at positions [start, stop) of this dataset's endless shuffled stream (a new
        permutation of the windows each epoch, fixed by the seed)."""
        n = self.num_train_windows
        parts = []
        for epoch in range(start // n, (stop - 1) // n + 1):
            lo, hi = max(start, epoch * n) - epoch * n, min(stop, (epoch + 1) * n) - epoch * n
            parts.append(self._permutation(seed, epoch)[lo:hi])
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    def sample_indices(self, step: int, seed: int, global_batch_size: int) -> np.ndarray:
        """Training-window indices of optimizer step `step`: stream positions [step*G, (step+1)*G)."""
        check_step(step, seed, global_batch_size)
        return self.shuffled_indices(step * global_batch_size, (step + 1) * global_batch_size, seed)

    def describe_samples(self, step: int, seed: int, global_batch_size: int) -> str:
        """Where step `step`'s samples come from, to look at them: their training-window indices."""
        return f"windows {self.sample_indices(step, seed, global_batch_size).tolist()} (seq_len {self.seq_len})"

    def windows(self, indices) -> torch.Tensor:
        """The training windows at `indices`: LongTensor [len(indices), seq_len + 1]."""
        return torch.from_numpy(np.asarray(self._train[np.asarray(indices, dtype=np.int64)], dtype=np.int64))

    def global_batch(self, step: int, seed: int, global_batch_size: int) -> torch.Tensor:
        """The samples of optimizer step `step` (0-based): LongTensor [global_batch_size, seq_len + 1]."""
        return self.windows(self.sample_indices(step, seed, global_batch_size))

    def val_windows(self, max_windows: int | None = None) -> torch.Tensor:
        """The validation windows in stream order (the first `max_windows` of them): [N, seq_len + 1]."""
        n = self.num_val_windows if max_windows is None else min(max(max_windows, 0), self.num_val_windows)
        return torch.from_numpy(np.array(self._val[:n], dtype=np.int64))

    def __repr__(self) -> str:
        return (f"TokenDataset(seq_len={self.seq_len}, train_windows={self.num_train_windows}, "
                f"val_windows={self.num_val_windows})")


def micro_batches(global_batch, dp_rank: int, dp_size: int, micro_batch_size: int) -> list:
    """This DP rank's contiguous rows of the global batch (token windows, or a `Batch`), cut into micro-batches of
    `micro_batch_size` rows."""
    g = len(global_batch)
    if dp_size < 1 or not 0 <= dp_rank < dp_size:
        raise LayoutError(f"dp rank {dp_rank} is not valid for dp size {dp_size}")
    check_batch_layout(g, dp_size, micro_batch_size)
    per_rank = g // dp_size
    mine = global_batch[dp_rank * per_rank:(dp_rank + 1) * per_rank]
    return list(mine.split(micro_batch_size))


def check_batch_layout(g: int, dp_size: int, micro_batch_size: int) -> None:
    """A LayoutError unless a global batch of `g` rows splits into dp_size ranks x whole micro-batches."""
    if micro_batch_size < 1 or g % (dp_size * micro_batch_size):
        per_rank = g // dp_size if g % dp_size == 0 else 0
        valid = [m for m in range(1, per_rank + 1) if per_rank % m == 0]
        hint = (f"valid micro-batch sizes: {', '.join(map(str, valid))}" if valid
                else f"the global batch must be a multiple of dp {dp_size}")
        raise LayoutError(
            f"global batch size {g} does not divide into dp {dp_size} x micro-batch size "
            f"{micro_batch_size}; {hint}"
        )
