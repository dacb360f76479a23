"""Mixed precision for a step that runs backward itself (the 3D step, `parcourse.hybrid`).

A loop with FSDP2 calls torch's `ShardedGradScaler` between backward and the optimizer:
`scale(loss).backward()`, `unscale_(optimizer)` before clipping, `step(optimizer)`,
`update()`. `Hybrid.step()` runs the schedule's backward itself, so `StepPrecision` makes
those calls at the step's moments:

- `loss(loss)`: scaled (fp16), as `scaler.scale`;
- `unscale(optimizer)`: after the gradients are reduced into the slices: divided by the
  scale, and one all-reduce over every rank of the mesh says whether any slice holds an
  inf or a nan (a tp or pp rank's slices are no other rank's);
- `step(stepper, optimizer)`: the optimizer stepped, or skipped on every rank alike;
  the scale updated; `skipped_steps` counts the skips.

`check` refuses in one line what the step cannot keep: a compute dtype without ZeRO's
fp32 masters, a scaler under bf16 or fp32, a plain `torch.amp.GradScaler` (its infs
this rank's only), a `ShardedGradScaler` over other ranks than the mesh's. A disabled
scaler (`enabled=False`, or one made for "cuda" where there is none) is no scaler, as in
a torch loop. The balancing losses of MoE layers are scaled with the loss
(`Hybrid.step`), as Megatron-LM's `MoEAuxLossAutoScaler` is.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from parcourse.zero.mixed_precision import check_compute_dtype, frozen_in_compute_dtype


class StepPrecision:
    """The compute dtype (None: the weights' own) and the loss scaler (None: none) of a
    step over `group` (every rank of its mesh)."""

    def __init__(
        self, compute_dtype: torch.dtype | None, scaler: Any, zero: int, group: Any
    ) -> None:
        if scaler is not None and not scaler.is_enabled():  # GradScaler(enabled=False):
            scaler = None  # a no-op, as in a torch loop
        self.compute_dtype = check(compute_dtype, scaler, zero, group)
        self.scaler, self.skipped_steps = scaler, 0
        if scaler is not None:  # its scale made on every rank: the stages that take no
            scaler.scale(torch.zeros(())).detach()  # loss never scale one themselves

    def cast_frozen(self, modules: Iterable[nn.Module], trainable: list[nn.Parameter]) -> None:
        """The weights of `modules` other than `trainable` (ZeRO's units' weights, in the
        compute dtype already): frozen ones, which run forward on a copy in the compute
        dtype, as under `ZeroModel`."""
        if self.compute_dtype is None:
            return
        for module in modules:
            frozen_in_compute_dtype(module, trainable, self.compute_dtype)

    def scale(self) -> float:
        return float(self.scaler.get_scale()) if self.scaler is not None else 1.0

    def loss(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale(loss) if self.scaler is not None else loss

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def step(self, stepper: Callable[[Callable[[], Any] | None], None], optimizer: Any) -> None:
        """`stepper(optimizer_step)`: the gradient sync's step (its all-gathers after the
        optimizer's); `skipped_steps` counts those the scaler skipped."""
        if self.scaler is None:
            stepper(None)
            return
        found = self.scaler._found_inf_per_device(optimizer).values()  # unscale_'s
        self.skipped_steps += any(float(f) > 0 for f in found)
        stepper(lambda: self.scaler.step(optimizer))
        self.scaler.update()


def check(
    compute_dtype: torch.dtype | None, scaler: Any, zero: int, group: Any
) -> torch.dtype | None:
    """The compute dtype a step over `group` runs in, refused in one line where it cannot
    be kept: fp32 masters live in ZeRO's slices, a loss scaler is fp16's, and it must
    find an inf on any rank of the group."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    compute_dtype = check_compute_dtype(compute_dtype)
    if compute_dtype is not None and not zero:
        raise ValueError(
            f"compute_dtype {compute_dtype} keeps fp32 masters in ZeRO's slices: add zero=1 "
            "(its bytes on the wire are the buckets' own), or compute in fp32"
        )
    if scaler is None:
        return compute_dtype
    if compute_dtype != torch.float16:
        raise ValueError(
            f"a loss scaler keeps fp16's small gradients in range; in {compute_dtype or 'fp32'} "
            "nothing underflows: drop it, or pass compute_dtype=torch.float16"
        )
    if not isinstance(scaler, ShardedGradScaler):
        raise ValueError(
            f"a {type(scaler).__name__} finds an inf in this rank's gradients only, and the "
            "3D step's ranks hold different ones (the step would be skipped on some): pass "
            "torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler(process_group="
            "<the mesh's group>)"
        )
    world = dist.group.WORLD
    covered = set(dist.get_process_group_ranks(scaler.process_group or world))
    mesh = set(dist.get_process_group_ranks(group or world))
    if covered != mesh:
        missing, extra = sorted(mesh - covered), sorted(covered - mesh)
        raise ValueError(
            f"the ShardedGradScaler's group is not the mesh's (it leaves out ranks {missing}, "
            f"takes in ranks {extra}): an inf would skip the step on some ranks only, or "
            "the all-reduce wait for ranks not stepping; give it the mesh's group (mesh.parent)"
        )
    return compute_dtype
