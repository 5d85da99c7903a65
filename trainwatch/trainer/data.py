"""Built-in training data: English text shipped in the package, read as bytes.

The batch for (seed, step, rank) is a pure function of those three numbers. A
resumed run therefore sees exactly the batches an uninterrupted run would have
seen, with no sampler or iterator state to save in the checkpoint.
"""

from __future__ import annotations

import hashlib
from importlib import resources

import torch

CORPUS_FILES = ("corpus.txt",)
"""Text files under trainwatch/trainer/data/ that make up the corpus."""


def load_corpus() -> torch.Tensor:
    """The corpus as a 1-D uint8 tensor of bytes."""
    root = resources.files("trainwatch.trainer").joinpath("data")
    raw = b"".join(root.joinpath(name).read_bytes() for name in CORPUS_FILES)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def batch_seed(seed: int, step: int, rank: int) -> int:
    """A 63-bit generator seed for one (seed, step, rank); hashing keeps nearby
    triples (step 1 vs 2, rank 0 vs 1) from giving correlated streams."""
    digest = hashlib.sha256(f"trainwatch-batch:{seed}:{step}:{rank}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def get_batch(corpus: torch.Tensor, *, seed: int, step: int, rank: int, batch_size: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets), each (batch_size, seq_len) int64 on the CPU: random windows
    of the corpus, targets shifted one byte to the right."""
    if corpus.numel() < seq_len + 2:
        raise ValueError(f"corpus of {corpus.numel()} bytes is too short for --seq-len {seq_len}")
    gen = torch.Generator().manual_seed(batch_seed(seed, step, rank))
    starts = torch.randint(0, corpus.numel() - seq_len - 1, (batch_size,), generator=gen)
    window = starts[:, None] + torch.arange(seq_len + 1)[None, :]
    chunk = corpus[window].long()
    return chunk[:, :-1], chunk[:, 1:]
