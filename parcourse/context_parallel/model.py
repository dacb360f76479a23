"""Context parallelism in the course's GPT: the sequence cut over a cp group, every layer
run on this rank's tokens.

Everything in a GPT but attention works token by token, so a rank holding some of a
sequence's tokens runs the embedding, the MLPs, the LayerNorms and the head on them as
they are. Two things need the whole sequence: the position embedding (a token's position
in the whole sequence, `positions`) and attention (every key for every query:
`context_attention`, its method the plan's `cp_method`). The cut is zigzag, two chunks a
rank, so that the causal mask gives every rank the same work.

    shard = SequenceShard(mesh.group("cp"), method="ring")
    context_parallel(stages, shard)          # each attention and the embedding, in place
    x = shard.cut(tokens)                    # this rank's tokens (the length remembered)
    loss = cross_entropy(model(x), shard.cut(targets)) * shard.loss_scale()

The loss of a rank is the mean over its tokens; `loss_scale` weighs it by its share of
the sequence (cp x its tokens / all of them: 1 when the cut is even), so that the mean
over the cp ranks is the whole sequence's mean, and averaging the gradients over the cp
ranks (with dp's, Megatron-LM's `cp_dp` group) gives one process's.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import nn

from parcourse.comm import Comm
from parcourse.context_parallel.attention import (
    TOKENS,
    Layout,
    Method,
    context_attention,
    positions,
    shard_sequence,
)
from parcourse.models import CausalSelfAttention, GPTEmbedding


class SequenceShard:
    """This rank's part of every sequence, cut over `group` (`layout`: zigzag by default),
    with attention by `method`; `comm` carries the ring's messages (traced, or over a
    simulated link), one over `group` without it. `cut(x)` takes this rank's tokens of a
    batch of whole sequences and remembers their length for the layers that need it."""

    def __init__(
        self,
        group: dist.ProcessGroup,
        method: Method = "ring",
        layout: Layout = "zigzag",
        comm: Comm | None = None,
    ) -> None:
        self.group, self.method, self.layout = group, method, layout
        self.comm = comm if comm is not None else Comm(group)
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        self.tokens: int | None = None  # the whole sequence's length, known at `cut`

    def cut(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's tokens of `x` (whole sequences along `dim`)."""
        self.tokens = x.shape[dim]
        return shard_sequence(x, self.rank, self.size, self.layout, dim=dim)

    def cut_batch(
        self, x: torch.Tensor | None, y: torch.Tensor | None, tokens: int, block_size: int
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """This rank's tokens of a batch's inputs and targets (None where a stage takes
        none), sequences of `tokens` (every rank's attention needs the length)."""
        if tokens > block_size:
            raise ValueError(f"sequences of {tokens} tokens, longer than block_size {block_size}")
        self.tokens = tokens
        return (None if x is None else self.cut(x)), (None if y is None else self.cut(y))

    def _length(self) -> int:
        if self.tokens is None:
            raise RuntimeError(
                "the sequence's length is known once a batch is cut (SequenceShard.cut)"
            )
        return self.tokens

    def positions(self, idx: torch.Tensor) -> torch.Tensor:
        """The positions of this rank's tokens in the whole sequence."""
        return positions(self._length(), self.rank, self.size, self.layout).to(idx.device)

    def loss_scale(self) -> float:
        """cp x this rank's tokens / the sequence's: weighs a mean over this rank's tokens
        so that the cp ranks' mean is the whole sequence's."""
        tokens = self._length()
        return self.size * len(positions(tokens, self.rank, self.size, self.layout)) / tokens

    def attend(self, attention: CausalSelfAttention, qkv: torch.Tensor) -> torch.Tensor:
        """`CausalSelfAttention.attend` over the whole sequence: (B, T here, 3 C) -> (B, T
        here, C), the heads this rank holds (all, or tp's share)."""
        b, t, _ = qkv.shape
        hd = attention.head_dim
        q, k, v = (x.transpose(1, TOKENS) for x in qkv.view(b, t, -1, 3 * hd).split(hd, -1))
        out = context_attention(
            q,
            k,
            v,
            self.group,
            tokens=self._length(),
            method=self.method,
            layout=self.layout,
            causal=True,
            scale=hd**-0.5,
            comm=self.comm,
        )
        return out.transpose(1, TOKENS).reshape(b, t, -1)


def context_parallel(layers: list[nn.Module], shard: SequenceShard) -> list[nn.Module]:
    """Make `layers` (a GPT's, whole or cut into stages) run on `shard`'s tokens: every
    attention attends over the whole sequence, every embedding gives its tokens' whole
    positions. In place; returns `layers`."""
    for layer in layers:
        for module in layer.modules():
            if isinstance(module, CausalSelfAttention):
                module.attend = functools.partial(shard.attend, module)  # type: ignore[method-assign]  # this instance's alone, on purpose
            elif isinstance(module, GPTEmbedding):
                module.positions = shard.positions
    return layers
