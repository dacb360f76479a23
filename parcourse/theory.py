"""Every formula that a lesson's chart, an exercise check or a benchmark compares a
measurement with, in one place. Pure arithmetic: no processes, no torch.distributed.
"""

from __future__ import annotations

import math

import torch


# --------------------------------------------------------------------------- ZeRO (lessons 03-04)


def adam_bytes_per_param(param_dtype: torch.dtype = torch.float32) -> dict[str, int]:
    """Theory: bytes per parameter for weights, gradients and Adam state.

    fp32 training: 4 + 4 + 8 (two fp32 moments) = 16. Mixed precision keeps
    16-bit weights and gradients plus fp32 master weights, momentum and
    variance: 2 + 2 + 12 = 16 as well (ZeRO paper, sec. 3.1: K = 12).
    """
    size = torch.empty((), dtype=param_dtype).element_size()
    if param_dtype == torch.float32:
        return {"params": 4, "grads": 4, "optimizer": 8}
    return {"params": size, "grads": size, "optimizer": 12}


def zero_bytes(num_params: int, world_size: int, stage: int,
               param_dtype: torch.dtype = torch.float32) -> dict[str, float]:
    """Theory: bytes per rank for parameters, gradients and Adam state under ZeRO.

    stage 0 is plain data parallelism (everything replicated); stage 1 divides
    the optimizer state by N, stage 2 also the gradients, stage 3 also the
    parameters (ZeRO paper, Figure 1). Stages 0 and 1 hold the full gradient
    while backward builds it (`zero_checked_at` says when each figure holds).

    With mixed precision the gradient shards of stages 2-3 are handed to the
    optimizer in fp32, the dtype of the masters it steps (as FSDP2 does), so they
    cost 4 bytes / N per parameter where the paper counts 2 / N.
    """
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0, 1, 2 or 3, got {stage}")
    per = adam_bytes_per_param(param_dtype)
    n = world_size
    return {
        "params": num_params * per["params"] / (n if stage >= 3 else 1),
        "grads": num_params * per["grads"] if stage < 2 else num_params * 4 / n,
        "optimizer": num_params * per["optimizer"] / (n if stage >= 1 else 1),
    }


def zero_checked_at(stage: int) -> dict[str, str]:
    """The memory sample (of `experiments` runs) at which each `zero_bytes` figure holds:
    after the optimizer step, except the full gradient of stages 0-1, which exists at
    the peak of backward (stage 1 reduce-scatters it when backward ends, keeping 1/N)."""
    grads = "peak in backward" if stage < 2 else "after step"
    return {"params": "after step", "grads": grads, "optimizer": "after step"}


def zero_communication_bytes(stage: int, nbytes: float, world_size: int) -> float:
    """Theory: bytes each rank sends per step for S = nbytes of parameters (= of gradients).

    A ring all-reduce sends 2(N-1)/N S (lesson 01); reduce-scatter and all-gather
    half of that each. DDP (stage 0): one all-reduce. Stages 1 and 2:
    reduce-scatter the gradients, all-gather the updated parameters: DDP's
    volume, since an all-reduce is exactly those two. Stage 3: all-gather in
    forward, again in backward, reduce-scatter: 1.5x DDP (ZeRO paper, sec. 7).
    """
    half = (world_size - 1) / world_size * nbytes
    return {0: 2 * half, 1: 2 * half, 2: 2 * half, 3: 3 * half}[stage]


# --------------------------------------------------------------------------- checkpointing (08)


def checkpoint_segments(n_layers: int, policy: str, segments: int | None = None) -> int:
    """Segments a chain of n layers is cut into: "sqrt" ceil(sqrt n) (or `segments`),
    "every" n, "none" and "nothing" 1 (not checkpointed in segments)."""
    if policy == "sqrt":
        return segments or max(1, math.ceil(math.sqrt(n_layers)))
    return n_layers if policy == "every" else 1


def checkpoint_peak_activations(n_layers: int, policy: str, segments: int | None = None) -> int:
    """Theory: the most layer outputs alive at once for a chain of n equal layers, each
    saving one tensor the size of its output (the next layer's input shares it),
    counting the chain's input.

    none: the input and all n outputs, n + 1. Checkpointed in k segments of L = n/k
    layers: the k segment inputs, plus one segment's L outputs while it is recomputed,
    k + L (2 sqrt n for k = sqrt n: Chen et al., arXiv:1604.06174). nothing: the input,
    then one layer at a time recomputed with its rebuilt input, 1 + 2.
    """
    if policy == "none":
        return n_layers + 1
    if policy == "nothing":
        return 3
    k = checkpoint_segments(n_layers, policy, segments)
    return k + math.ceil(n_layers / k)


def checkpoint_extra_forwards(n_layers: int, policy: str) -> int:
    """Theory: layer forwards that backward recomputes. none: 0; in segments: every layer
    once, n (one extra forward); nothing: layer i's input from the start, n(n-1)/2."""
    if policy == "none":
        return 0
    if policy == "nothing":
        return n_layers * (n_layers - 1) // 2
    return n_layers
