"""Cross-entropy over logits split along the vocabulary, never gathering them whole.

The LM head is column-parallel over the vocabulary, so rank r holds the logits of
its range of tokens, (B, T, V / N). Gathering them would cost B x T x V values on
every rank, the largest activation of a small-vocabulary-heavy model. Megatron
(Shoeybi et al., arXiv:1909.08053, sec. 3: "fuse the output of the parallel GEMM
with the cross entropy loss") needs only three all-reduces of B x T numbers:

1. the maximum logit of each token (so that exp never overflows: logits - max <= 0);
2. the target's logit (only the rank holding the target's column has it, the others add 0);
3. the sum of exp(logit - max) over the vocabulary.

Then loss = log(sum exp) - (target logit - max) on every rank, and the gradient,
softmax - one_hot(target), is computed locally on each rank's columns.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import torch
import torch.distributed as dist

from parcourse.comm import Comm
from parcourse.tensor_parallel.comm import TPComm
from parcourse.tensor_parallel.layers import vocab_range
from parcourse.trace import Tracer

Reduction = Literal["mean", "sum", "none"]


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        logits: torch.Tensor,
        target: torch.Tensor,
        comm: TPComm,
        vocab_size: int,
        ignore_index: int,
    ) -> torch.Tensor:
        start, end = vocab_range(vocab_size, comm.rank, comm.size)
        real = end - start  # this rank's columns that are tokens; the rest pad its shard
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # 16-bit: in fp32
        if real < logits.shape[-1]:
            logits = logits.clone()
            logits[..., real:] = float("-inf")  # padding is never a token: exp(-inf) = 0
        where = "cross entropy"
        # 1. the largest logit of each token, over all ranks
        top = comm.all_reduce(logits.amax(dim=-1), "forward", where, op="max")  # (N,)
        shifted = logits - top.unsqueeze(-1)  # (N, V / N), <= 0
        # 2. the target's (shifted) logit, from the rank holding its column
        ignored = target == ignore_index
        local = target - start
        mine = (local >= 0) & (local < real) & ~ignored
        local = local.masked_fill(~mine, 0)
        picked = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(~mine, 0.0)
        picked = comm.all_reduce(picked, "forward", where)
        # 3. the sum of exp over the whole vocabulary
        exp = shifted.exp()
        sum_exp = comm.all_reduce(exp.sum(dim=-1), "forward", where)
        loss = (sum_exp.log() - picked).masked_fill(ignored, 0.0)  # (N,)
        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), local, mine, ignored)
        return loss

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        softmax, local, mine, ignored = ctx.saved_tensors
        # d loss / d logits = softmax - one_hot(target), on this rank's columns only.
        grad_logits = softmax.clone()  # a copy: backward may run again (retain_graph)
        grad_logits.scatter_add_(-1, local.unsqueeze(-1), -mine.to(softmax.dtype).unsqueeze(-1))
        grad_logits.mul_(grad.masked_fill(ignored, 0.0).unsqueeze(-1))
        return grad_logits, None, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    group: dist.ProcessGroup,
    vocab_size: int,
    *,
    ignore_index: int = -100,
    reduction: Reduction = "mean",
    tracer: Tracer | None = None,
    comm: TPComm | None = None,
) -> torch.Tensor:
    """F.cross_entropy(full_logits, target) from this rank's vocabulary shard of the logits.

    `logits`: (..., ceil(vocab_size / N)), rank r's columns being the tokens of
    `vocab_range(vocab_size, r, N)` (what a vocab-parallel head returns); `target`:
    (...), the same on every rank. `reduction` "mean" averages over the targets that
    are not `ignore_index`, as F.cross_entropy does. Same value on every rank.
    `comm` (a layer's, with its tracer) may stand for `group` and `tracer`.
    """
    comm = comm or TPComm(Comm(group, tracer=tracer))
    width = math.ceil(vocab_size / comm.size)
    if logits.shape[-1] != width:
        raise ValueError(
            f"logits have {logits.shape[-1]} columns; a vocabulary of {vocab_size} "
            f"over {comm.size} ranks gives each ceil({vocab_size} / {comm.size}) "
            f"= {width}"
        )
    if target.shape != logits.shape[:-1]:
        raise ValueError(
            f"target has shape {tuple(target.shape)}; expected "
            f"{tuple(logits.shape[:-1])}, the logits' without the last dim"
        )
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"unknown reduction {reduction!r}; choose 'mean', 'sum' or 'none'")
    flat_logits = logits.reshape(-1, width)
    flat_target = target.reshape(-1)
    loss = _VocabParallelCrossEntropy.apply(
        flat_logits, flat_target, comm, vocab_size, ignore_index
    )
    if reduction == "none":
        return loss.view(target.shape)
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / (flat_target != ignore_index).sum()
