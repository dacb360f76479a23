"""Lessons 03-04: bytes per rank of the weights, gradients and Adam's state under each ZeRO
stage (`zero_bytes`, `zero_checked_at` for the moment each figure holds) and the bytes each
stage sends (`zero_communication_bytes`); beyond stage 3, where ZeRO-Offload puts them
(`offload_bytes`) and what ZeRO++ sends across nodes (`zero_pp_bytes_across`).
"""

from __future__ import annotations

import torch


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


def zero_bytes(
    num_params: float,
    world_size: int,
    stage: int,
    param_dtype: torch.dtype = torch.float32,
    grad_shard_dtype: torch.dtype = torch.float32,
) -> dict[str, float]:
    """Theory: bytes per rank for parameters, gradients and Adam state under ZeRO.

    stage 0 is plain data parallelism (everything replicated); stage 1 divides
    the optimizer state by N, stage 2 also the gradients, stage 3 also the
    parameters (ZeRO paper, Figure 1). Stages 0 and 1 hold the full gradient
    while backward builds it (`zero_checked_at` says when each figure holds).

    With mixed precision the course's gradient shards of stages 2-3 are handed to
    the optimizer in fp32, the dtype of the masters it steps (as FSDP2 does), so they
    cost 4 bytes / N per parameter; the paper keeps them in 16 bits, 2 / N
    (`grad_shard_dtype=torch.bfloat16`, what the planner counts for published runs).
    """
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0, 1, 2 or 3, got {stage}")
    per = adam_bytes_per_param(param_dtype)
    n = world_size
    return {
        "params": num_params * per["params"] / (n if stage >= 3 else 1),
        "grads": num_params * per["grads"]
        if stage < 2
        else num_params * torch.empty((), dtype=grad_shard_dtype).element_size() / n,
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


def offload_bytes(
    num_params: int,
    world_size: int,
    stage: int,
    *,
    offload_params: bool = False,
    nvme: bool = False,
    param_dtype: torch.dtype = torch.bfloat16,
) -> dict[str, dict[str, float]]:
    """Theory: bytes per rank by placement (device, host, disk) and category under
    ZeRO-Offload (arXiv:2101.06840), right after an Adam step (before zero_grad).

    The device keeps the 16-bit weights (all of them at stages 1-2, its 1/N share at
    stage 3, none with `offload_params`); the host keeps the fp32 masters (4/N a
    parameter), the fp32 gradient shards they are stepped with (4/N) and Adam's moments
    (8/N), which ZeRO-Infinity (`nvme`) moves to disk. So the device's 16 bytes a
    parameter (2 + 2 + 12) become 2 + 2 while backward builds the gradients (one
    bucket of them at a time at stages 2-3), and 0 + 2 with the weights offloaded too.
    """
    if stage not in (1, 2, 3):
        raise ValueError(f"stage must be 1, 2 or 3, got {stage}")
    if offload_params and stage != 3:
        raise ValueError("offload_params is stage 3's")
    n = world_size
    half = torch.empty((), dtype=param_dtype).element_size()
    device = {
        "params": 0.0 if offload_params else num_params * half / (n if stage == 3 else 1),
        "grads": 0.0,
        "optimizer": 0.0,
    }
    host = {
        "params": num_params * half / n if offload_params else 0.0,
        "grads": num_params * 4 / n,
        "optimizer": num_params * (4 if nvme else 12) / n,
    }
    disk = {"optimizer": num_params * 8 / n if nvme else 0.0}
    return {"device": device, "host": host, "disk": disk}


def zero_pp_bytes_across(
    units: list[tuple[int, int]],
    world_size: int,
    ranks_per_node: int,
    *,
    quantized_weights: bool = False,
    hpz: bool = False,
    quantized_gradients: bool = False,
    block: int = 256,
    dtype_bytes: int = 4,
) -> dict[str, int]:
    """Theory: bytes that cross nodes in one ZeRO-3 step, summed over ranks, for units
    given as (part_numel, parameters) (each rank's part of a unit's buffer, and how many
    parameters it holds: their used-flags travel with the gradients).

    A ring over N ranks in nodes of k consecutive ranks crosses nodes on N/k of its N
    hops, and each rank sends N-1 parts: an all-gather or reduce-scatter of parts of b
    bytes sends (N/k)(N-1)b across. ZeRO++ (arXiv:2306.10209): qwZ sends int8 and a
    scale per `block`; hpZ's backward gather stays inside the node; qgZ's second
    all-to-all, the only one across nodes, sends each rank's N/k - 1 parts once.
    """
    n, k = world_size, ranks_per_node
    if n % k:
        raise ValueError(f"ranks_per_node ({k}) must divide the world size ({n})")
    hops = (n // k) * (n - 1)

    def int8(numel: int) -> int:
        blocks = -(-numel // block)
        return blocks * block + 4 * blocks

    forward = sum(hops * (int8(p) if quantized_weights else p * dtype_bytes) for p, _ in units)
    backward = 0 if hpz and k < n else forward
    if quantized_gradients:
        grads = sum(n * (n // k - 1) * (int8(p) + 4 * f) for p, f in units)
    else:
        grads = sum(hops * (p + f) * dtype_bytes for p, f in units)
    return {
        "forward": forward,
        "backward": backward,
        "gradients": grads,
        "total": forward + backward + grads,
    }
