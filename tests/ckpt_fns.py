"""Rank functions for checkpointing composed with tensor parallelism."""

import copy

import torch

from parcourse.checkpointing import checkpoint
from parcourse.models import Block, GPTConfig
from parcourse.tensor_parallel.plan import BLOCK_PLAN, apply_tensor_parallel


def tp_block_grads(ctx, checkpointed):
    """One tensor-parallel block with dropout, checkpointed or not: its gradients."""
    torch.manual_seed(0)
    config = GPTConfig(vocab=16, block_size=8, n_layers=1, n_heads=4, d_model=16, dropout=0.3)
    block = apply_tensor_parallel(copy.deepcopy(Block(config)), BLOCK_PLAN, ctx.group, seed=3)
    x = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(1), requires_grad=True)
    out = checkpoint(block, x) if checkpointed else block(x)
    out.square().sum().backward()
    return x.grad, {n: p.grad for n, p in block.named_parameters()}
