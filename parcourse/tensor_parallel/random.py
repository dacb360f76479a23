"""Dropout under tensor parallelism: which masks must agree across ranks, and which must not.

Where an activation is replicated (whole and identical on every rank of the
group: the residual stream, without sequence parallelism), every rank must drop
the same elements, or the copies drift apart and the ranks no longer compute one
model. Where it is sharded (each rank holds different heads, or under sequence
parallelism different tokens), the masks must differ, or the heads of rank 1
would be dropped exactly where those of rank 0 are: correlated noise that one
process would never draw. Megatron keeps two random states for this, the
default one (seeded alike on every tensor-parallel rank) and a "model-parallel"
one forked per rank (seed + 2718 + rank) (Shoeybi et al., arXiv:1909.08053,
sec. 3; megatron/core/tensor_parallel/random.py, CudaRNGStatesTracker).

Here the two are explicit generators, and each dropout module is given the one
for its region; the caller's global random state is never touched.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

from parcourse.checkpointing import replay_generator

Region = Literal["replicated", "sharded"]
_SHARDED_OFFSET = 2718  # Megatron's offset between the two seeds


class RNGTracker:
    """The two generators of one tensor-parallel rank.

    `replicated`: seeded with `seed` on every rank (draws agree); `sharded`: seeded
    with seed + 2718 + rank (draws differ). Under data parallelism as well, give
    each data-parallel replica its own `seed`.
    """

    def __init__(self, seed: int, rank: int, device: torch.device | str = "cpu") -> None:
        self.seed, self.rank = seed, rank
        self.generators: dict[Region, torch.Generator] = {
            "replicated": torch.Generator(device).manual_seed(seed),
            "sharded": torch.Generator(device).manual_seed(seed + _SHARDED_OFFSET + rank),
        }
        for g in self.generators.values():  # recomputed dropout draws the same masks
            replay_generator(g, owner=self)

    def generator(self, region: Region) -> torch.Generator:
        if region not in self.generators:
            raise ValueError(f"unknown region {region!r}; choose 'replicated' or 'sharded'")
        return self.generators[region]


class TrackedDropout(nn.Module):
    """nn.Dropout drawing its mask from one of an `RNGTracker`'s generators.

    Keeps a boolean mask for backward (1 byte per element), as nn.Dropout does.
    """

    def __init__(self, p: float, tracker: RNGTracker, region: Region) -> None:
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"dropout probability must be in [0, 1), got {p}")
        self.p, self.region = p, region
        self.generator = tracker.generator(region)
        self.tracker = tracker  # its generators are replayed under checkpoint while it lives

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        keep = torch.empty(x.shape, dtype=torch.bool, device=x.device)
        keep.bernoulli_(1.0 - self.p, generator=self.generator)
        return x * keep * (1.0 / (1.0 - self.p))

    def extra_repr(self) -> str:
        return f"p={self.p}, region={self.region}"
