"""What every collective here shares: argument checks, process groups (this rank in
one, its global rank), and the comm span."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Literal

import torch
import torch.distributed as dist

from parcourse.trace import Tracer

Op = Literal["sum", "avg", "max"]
OPS: tuple[str, ...] = ("sum", "avg", "max")
DTYPES: tuple[torch.dtype, ...] = (
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.int32,
    torch.int64,
)
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# An all-gather only copies: bytes (quantized messages, ZeRO++'s) travel too.
GATHER_DTYPES = (*DTYPES, torch.uint8, torch.int8)


def check_args(tensor: torch.Tensor, op: str | None) -> None:
    """Clear errors for what these collectives do not support (op None: a gather)."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(tensor).__name__}")
    if op is not None and op not in OPS:
        raise ValueError(f"unsupported op {op!r}; choose one of {', '.join(OPS)}")
    allowed = GATHER_DTYPES if op is None else DTYPES
    if tensor.dtype not in allowed:
        names = ", ".join(str(d).removeprefix("torch.") for d in allowed)
        raise ValueError(f"unsupported dtype {tensor.dtype}; supported: {names}")
    if op == "avg" and tensor.dtype not in FLOAT_DTYPES:
        raise ValueError(
            f"op 'avg' needs a floating-point tensor, got {tensor.dtype}; use 'sum' and divide"
        )


def reduce_into(acc: torch.Tensor, other: torch.Tensor, op: str) -> None:
    """acc <- acc (op) other, in place."""
    if op == "max":
        torch.maximum(acc, other, out=acc)
    else:  # sum and avg both add; avg divides once at the end
        acc.add_(other)


def group_info(group: dist.ProcessGroup | None) -> tuple[dist.ProcessGroup, int, int]:
    """(group, this rank in it, its size); None means all ranks (WORLD)."""
    group = group or dist.group.WORLD
    if group is None:
        raise RuntimeError(
            "torch.distributed is not initialized: run this inside a Pool, "
            "under torchrun, or after init_process_group"
        )
    if not isinstance(group, dist.ProcessGroup):
        raise ValueError(f"this rank is not a member of the group (got {group!r})")
    # The group's own rank()/size(): dist.get_rank/get_world_size look the group
    # up and map ranks on every call.
    return group, group.rank(), group.size()


def backend_for(group: dist.ProcessGroup, device: torch.device | str) -> str:
    """The backend that moves `device`'s tensors in `group`: "gloo" or "nccl". An NCCL run
    joins its group as "cpu:gloo,cuda:nccl" (parcourse.launch: CPU tensors work there too),
    so which one carries a tensor depends on where it lives."""
    name = str(dist.get_backend(group))
    if ":" not in name:
        return name
    by_device = dict(part.split(":", 1) for part in name.split(","))
    return by_device.get(torch.device(device).type, name)


def global_rank(group: dist.ProcessGroup, group_rank: int) -> int:
    """The global rank of a rank in `group`: what torch.distributed's functions take
    (broadcast's src, isend/irecv's peer); the group's own send/recv take group ranks."""
    if group is dist.group.WORLD:
        return group_rank
    return dist.get_global_rank(group, group_rank)


def comm_span(tracer: Tracer | None, name: str, **meta: object) -> AbstractContextManager[None]:
    """A span of kind "comm" on `tracer`, or nothing without one."""
    return nullcontext() if tracer is None else tracer.span(name, kind="comm", **meta)
