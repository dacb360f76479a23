"""ZeRO-Offload: the optimizer's side of ZeRO in host memory (Ren et al. 2021,
arXiv:2101.06840).

Under mixed precision a parameter costs 16 bytes (ZeRO's 2 + 2 + 12): 2 for the 16-bit
weight, 2 for its gradient, and 12 for the optimizer's side, the fp32 master and Adam's
two moments. The optimizer's side is also where the update's arithmetic is light (a few
operations an element), so ZeRO-Offload moves it to the host:

- the fp32 masters (and so the optimizer's state, made beside them) live in host memory,
  pinned when the device is a GPU (`offload_optimizer="cpu"`);
- each unit's gradient goes to the host as soon as its reduce-scatter ends, during
  backward (stage1.py's `_finish`: a non-blocking copy the GPU overlaps with backward);
- the optimizer steps on the host; the next gather copies the new weights back, in the
  compute dtype;
- stage 3 can keep its 16-bit shard of the weights on the host too
  (`offload_params=True`), fetched a unit at a time just before its all-gather.

The device then holds 2 + 2 bytes a parameter (weights and gradients in 16 bits, ZeRO's
stages dividing them), the host 12 (`theory.offload_bytes`). `bytes_by_placement` counts
what a rank holds by where it lives and by category. On a machine without a GPU the
device *is* the host: the placement is then the one the code gives each tensor (it is
exact, and a GPU test checks it against `torch.cuda.memory_allocated`), not two kinds of
memory.
"""

from __future__ import annotations

from typing import Any, Literal, Protocol

import torch

from parcourse.memory import storage_bytes, tensors_in

OffloadTarget = Literal["cpu"] | None
PLACEMENTS: tuple[str, ...] = ("device", "host", "disk")


class _Sharded(Protocol):
    """What the placement counts need of a ZeroModel (stage1.py imports this module)."""

    host: torch.device | None
    offload_params: bool
    units: list[Any]

    def memory_tensors(self) -> dict[str, list[torch.Tensor]]: ...


def check_offload(target: Any) -> OffloadTarget:
    """The offload target a model accepts: None ("none") or "cpu"."""
    if target in (None, "none"):
        return None
    if target == "nvme":
        raise ValueError(
            "offload_optimizer='nvme' keeps the optimizer's state on disk, "
            "which the optimizer does, not the model: use zero.shard(model, "
            "factory, offload_optimizer='nvme', nvme_path=...) or wrap yours in "
            "zero.InfinityOptimizer(model, optimizer, path)"
        )
    if target != "cpu":
        raise ValueError(f"offload_optimizer must be None, 'cpu' or 'nvme', got {target!r}")
    return "cpu"


def host_device() -> torch.device:
    return torch.device("cpu")


def host_tensors(model: _Sharded, optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    """What this rank keeps in host memory because of offload: the masters, their
    gradients, the optimizer's state, and stage 3's offloaded shard of the weights."""
    if model.host is None:
        return []
    out = [u.master for u in model.units]
    out += [sp.grad for u in model.units for sp in u.shard_params if sp.grad is not None]
    if model.offload_params:
        out += [u.compute_shard for u in model.units if u.compute_shard is not None]
    if optimizer is not None:
        out += list(tensors_in(list(optimizer.state.values())))
    return out


def bytes_by_placement(model: _Sharded, optimizer: Any = None) -> dict[str, dict[str, int]]:
    """Bytes this rank holds, {placement: {category: bytes}}, placements device, host and
    disk; the categories of `parcourse.memory` (the masters count as optimizer state,
    as ZeRO counts them). An optimizer with its state on disk (`InfinityOptimizer`)
    reports that state under "disk"."""
    inner = getattr(optimizer, "optimizer", optimizer)  # ShardedOptimizer's torch optimizer
    on_host = {_key(t) for t in host_tensors(model, inner)}
    groups: dict[str, list[torch.Tensor]] = {
        c: list(ts) for c, ts in model.memory_tensors().items()
    }
    if inner is not None:
        groups.setdefault("optimizer", [])
        groups["optimizer"] += list(tensors_in(list(inner.state.values())))
    out: dict[str, dict[str, int]] = {p: {} for p in PLACEMENTS}
    for category, tensors in groups.items():
        host = [t for t in tensors if _key(t) in on_host]
        device = [t for t in tensors if _key(t) not in on_host]
        out["host"][category] = storage_bytes(host)
        out["device"][category] = storage_bytes(device)
    disk = getattr(optimizer, "disk_bytes", None)
    if disk is not None:
        out["disk"]["optimizer"] = disk()
    return out


def _key(t: torch.Tensor) -> tuple[str, int]:
    return (str(t.device), t.untyped_storage().data_ptr())
