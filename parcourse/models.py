"""Small models for the lessons. Nothing here knows about distribution."""

from __future__ import annotations

import torch
from torch import nn


def mlp(d_in: int, d_hidden: int, d_out: int, depth: int = 2,
        seed: int | None = 0) -> nn.Sequential:
    """Linear -> ReLU -> ... -> Linear with `depth` linear layers.

    `seed` gives every rank the same initial weights (None: drawn from the global RNG).
    It seeds this model only: the caller's random state is the same afterwards.
    """
    if depth < 1:
        raise ValueError(f"depth must be >= 1, got {depth}")
    if seed is None:
        return _layers(d_in, d_hidden, d_out, depth)
    # nn.Linear initialises from torch's global CPU generator, so seed that one inside
    # fork_rng, which puts the caller's state back afterwards (devices=[]: CPU only,
    # never initialising CUDA).
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(seed)
        return _layers(d_in, d_hidden, d_out, depth)


def _layers(d_in: int, d_hidden: int, d_out: int, depth: int) -> nn.Sequential:
    dims = [d_in] + [d_hidden] * (depth - 1) + [d_out]
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(dims[:-1], dims[1:])):
        layers.append(nn.Linear(a, b))
        if i < depth - 1:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def param_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
