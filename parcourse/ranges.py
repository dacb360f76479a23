"""How a range of n items (elements, rows, sequences, vocabulary entries) is cut among
ranks: the one rule every strategy and the data use, so that shards line up everywhere.
No torch.distributed here: the data and the formulas use it too."""

from __future__ import annotations

from typing import Literal

Cut = Literal["tensor_split", "chunk"]


def chunk_bounds(numel: int, n: int, cut: Cut = "tensor_split") -> list[tuple[int, int]]:
    """[start, end) of n chunks covering numel, cut as torch cuts them:

    - "tensor_split": the first numel % n chunks get one more (torch.tensor_split), so
      shards line up with what torch's collectives do; the ring's chunks, and a batch's
      rows over data-parallel ranks.
    - "chunk": ceil(numel / n) each, the last ones fewer, or none (torch.chunk, FSDP2's
      shards, Megatron's VocabUtility over a vocabulary padded to a multiple of n).
    """
    if cut == "chunk":
        size = -(-numel // n)
        return [(min(i * size, numel), min((i + 1) * size, numel)) for i in range(n)]
    if cut != "tensor_split":
        raise ValueError(f"unknown cut {cut!r}; choose 'tensor_split' or 'chunk'")
    base, extra = divmod(numel, n)
    bounds, start = [], 0
    for i in range(n):
        end = start + base + (1 if i < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds
