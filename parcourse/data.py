"""Synthetic data, made on the spot (no downloads), and how ranks split a batch."""

from __future__ import annotations

import torch

from parcourse.ranges import chunk_bounds


def regression(n: int, d_in: int, d_out: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, y) with y a fixed random linear map of x plus a little noise."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d_in, generator=g)
    w = torch.randn(d_in, d_out, generator=g) / d_in**0.5
    return x, x @ w + 0.01 * torch.randn(n, d_out, generator=g)


def shard_bounds(n: int, rank: int, world_size: int) -> tuple[int, int]:
    """[start, end) of this rank's rows: contiguous, the first n % world_size ranks get one more."""
    return chunk_bounds(n, world_size)[rank]


def shard(batch: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """This rank's rows of a batch (data parallelism: same model, different data)."""
    start, end = shard_bounds(batch.shape[0], rank, world_size)
    return batch[start:end]


def local_regression(
    n: int, d_in: int, d_out: int, rank: int, world_size: int, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows, on `device`, of the batch `regression(n, d_in, d_out)` all ranks share."""
    x, y = regression(n, d_in, d_out)
    return shard(x, rank, world_size).to(device), shard(y, rank, world_size).to(device)


def progressions(
    batch: int, block_size: int, vocab: int, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token sequences for a language model: (x, y), each (batch, block_size), y = x
    shifted left by one.

    Each row counts modulo `vocab` from a random start with a random stride
    (1 to 7): once it has seen two tokens, a model that attends to them can predict
    every next one, so the loss falls from ln(vocab) towards 0 within a few hundred
    steps of a tiny GPT.
    """
    if vocab < 8:
        raise ValueError(f"vocab must be >= 8 (strides go up to 7), got {vocab}")
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(vocab, (batch, 1), generator=g)
    stride = torch.randint(1, 8, (batch, 1), generator=g)
    tokens = (start + stride * torch.arange(block_size + 1)) % vocab  # (batch, block_size + 1)
    return tokens[:, :-1], tokens[:, 1:]
