"""Training data: the embedded default corpus or a user's files, tokenised without any download.

Text is tokenised as raw bytes (vocabulary 256): nothing to download and nothing to train, which is
what a smoke-test or kernel-benchmark run needs. Pre-tokenised data (`.npy` of token ids) brings its
own vocabulary. Batches are a pure function of (seed, step), so a resumed run sees exactly the batches
an uninterrupted one would.
"""

from __future__ import annotations

import gzip
import hashlib
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

BYTE_VOCAB = 256


def default_corpus() -> bytes:
    """The embedded corpus (CPython standard-library docstrings, about 1 MB)."""
    with resources.files("moe_kernels.train").joinpath("data/corpus.txt.gz").open("rb") as f:
        return gzip.decompress(f.read())


def load_tokens(path: str | Path | None) -> tuple[Tensor, int]:
    """Token ids (int64) and vocabulary size. None: the embedded corpus. `.txt`/`.md`/other text:
    bytes. `.npy`: an integer array of token ids (vocabulary = max id + 1)."""
    if path is None:
        return torch.frombuffer(bytearray(default_corpus()), dtype=torch.uint8).long(), BYTE_VOCAB
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"training data not found: {path}")
    if path.suffix == ".npy":
        ids = np.load(path)
        if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer) or ids.size == 0 or ids.min() < 0:
            raise ValueError(f"{path}: expected a non-empty 1-D array of non-negative integer token ids")
        return torch.from_numpy(ids.astype(np.int64)), int(ids.max()) + 1
    data = path.read_bytes()
    if not data:
        raise ValueError(f"{path}: empty file")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long(), BYTE_VOCAB


def fingerprint(tokens: Tensor, vocab_size: int, *, sample: int = 1 << 20) -> dict:
    """Identifies a token stream independently of its file's path: the length, the vocabulary and a hash
    of the tokens (of `sample` evenly spaced ones for a longer stream)."""
    n = len(tokens)
    if n > sample:
        tokens = tokens[torch.linspace(0, n - 1, sample, dtype=torch.float64).long()]
    digest = hashlib.sha256(tokens.to(torch.int64).contiguous().numpy().tobytes()).hexdigest()
    return {"tokens": n, "vocab_size": vocab_size, "sha256": digest}


def decode_bytes(ids: Tensor) -> str:
    return bytes(ids.to(torch.uint8).tolist()).decode("utf-8", errors="replace")


@dataclass
class TokenData:
    """Train/validation split (the last `val_fraction` of the tokens) and deterministic batches."""

    tokens: Tensor
    vocab_size: int
    seq_len: int
    batch_size: int
    seed: int = 0
    val_fraction: float = 0.05
    rank: int = 0  # data-parallel rank and world: each rank takes its slice of the global batch
    world: int = 1

    def __post_init__(self):
        n_val = max(int(len(self.tokens) * self.val_fraction), self.seq_len + 1)
        self.train, self.val = self.tokens[:-n_val], self.tokens[-n_val:]
        if len(self.train) <= self.seq_len + 1:
            raise ValueError(
                f"only {len(self.tokens)} tokens: too few for seq_len={self.seq_len} with a validation split"
            )

    def _windows(self, source: Tensor, starts: Tensor) -> tuple[Tensor, Tensor]:
        idx = starts[:, None] + torch.arange(self.seq_len + 1)  # [B, S+1]
        chunk = source[idx]
        return chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()

    def batch(self, step: int, micro: int = 0, micro_batches: int = 1) -> tuple[Tensor, Tensor]:
        """Inputs and next-token targets [B, S] for a training step: random windows seeded by step (this
        rank's B of the world's B * world). With gradient accumulation the step draws B * world *
        micro_batches windows and micro-batch `micro` of rank r takes the (micro * world + r)-th B of them:
        on one rank, the micro-batches together are the batch of B * micro_batches sequences."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        B = self.batch_size
        starts = torch.randint(0, len(self.train) - self.seq_len - 1, (B * self.world * micro_batches,), generator=g)
        first = (micro * self.world + self.rank) * B
        return self._windows(self.train, starts[first : first + B])

    def eval_batches(self, count: int):
        """The same `count` validation batches every time (evenly spaced windows; each rank its slice)."""
        span = len(self.val) - self.seq_len - 1
        B, per_batch = self.batch_size, self.batch_size * self.world
        starts = torch.linspace(0, max(span, 0), count * per_batch).long()
        for i in range(count):
            chunk = starts[i * per_batch : (i + 1) * per_batch]
            yield self._windows(self.val, chunk[self.rank * B : (self.rank + 1) * B])
