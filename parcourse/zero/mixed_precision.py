"""Mixed precision under ZeRO: 16-bit compute, fp32 masters (Micikevicius et al.,
arXiv:1710.03740; the ZeRO paper's 2 + 2 + 12 bytes per parameter).

With `compute_dtype=torch.bfloat16` (or float16), parameters, gradients and the
messages that carry them are 16-bit; the optimizer steps fp32 masters and gets
fp32 gradients (as FSDP2 with a bf16 `param_dtype`). Here:

- the compute dtype a model accepts (`check_compute_dtype`);
- the masters: this rank's rows in a tensor of their own (`own_master`), and the
  16-bit copy of them that stage 3 gathers (`compute_copy`);
- the casts: inputs into the compute dtype, outputs (the loss) back to fp32, and
  kept modules (FSDP's ignored modules, e.g. norms) running in their own dtype.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Protocol

import torch
from torch import nn
from torch.utils._pytree import tree_map_only


class _Unit(Protocol):
    """What the masters need of a flat unit (layout.FlatUnit)."""

    full: torch.Tensor
    master: torch.Tensor
    dtype: torch.dtype
    compute_dtype: torch.dtype | None
    part_numel: int
    host: torch.device | None
    params_on_host: bool

    def pack_part(self, full: torch.Tensor, part: torch.Tensor) -> None: ...


def check_compute_dtype(compute_dtype: torch.dtype | None) -> torch.dtype | None:
    """The compute dtype a model runs in: None (the parameters' own), bf16 or fp16.

    fp16 is taken as FSDP2 takes `param_dtype=torch.float16`: pair it with loss scaling
    (torch's `ShardedGradScaler`, or `from_config`'s `fp16` section). Without it a
    gradient below fp16's smallest number (6e-8) is 0: with a loss scaled by 1e-6, 87%
    of a GPT's gradient elements were, against 0.15% in bf16."""
    if compute_dtype not in (None, torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(
            f"compute_dtype must be torch.bfloat16, torch.float16 or None, got {compute_dtype}"
        )
    return None if compute_dtype == torch.float32 else compute_dtype


# A plain torch.amp.GradScaler looks for infs in this rank's gradients only: under ZeRO
# each rank holds its own rows, so an inf in one rank's rows skips the step there alone.
STEPS_DISAGREE = (
    "the optimizer stepped on {stepped} of {world} ranks since the last forward: under "
    "fp16 a torch.amp.GradScaler skips a step on the rank whose gradient rows hold an "
    "inf and steps on the others, and the shards no longer belong to one model. Use "
    "torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler(process_group=<the "
    "model's group>), which agrees across ranks, or from_config's fp16 section"
)


# --------------------------------------------------------------------------- masters


def own_master(
    unit: _Unit, weights: torch.Tensor, host: torch.device | None = None
) -> torch.Tensor:
    """This rank's rows of the unit in a tensor of their own, in the parameters' dtype
    (fp32): under mixed precision, when the weights are sharded (stage 3), or when the
    masters live on the `host` (ZeRO-Offload; pinned there when the device is a GPU).

    `weights`: the given parameters one after another, in their own dtype. The masters
    are packed from them, never from the 16-bit copy the model computes with: mixed
    precision's contract is that the masters are the user's fp32 weights, exactly."""
    master = torch.zeros(unit.part_numel, dtype=unit.dtype, device=weights.device)
    unit.pack_part(weights, master)
    if host is not None and torch.device(host) != weights.device:
        master = (
            master.to(host, copy=True).pin_memory()
            if weights.is_cuda
            else master.to(host, copy=True)
        )
    return master


def compute_copy(unit: _Unit) -> torch.Tensor:
    """What stage 3 all-gathers: the master itself, or a copy of it in the compute dtype
    on the device (on the host under parameter offload), kept (and refreshed when an
    optimizer steps the master) so that it is not cast or moved every time."""
    if unit.compute_dtype is None and unit.host is None:
        return unit.master
    where = unit.master.device if unit.params_on_host else unit.full.device
    copy = unit.master.to(where, unit.compute_dtype or unit.dtype, copy=True)
    return copy.pin_memory() if unit.params_on_host and unit.full.is_cuda else copy


# --------------------------------------------------------------------------- casts


def cast_floats(tree: Any, dtype: torch.dtype | None) -> Any:
    """Every floating-point tensor in `tree` (args, kwargs, outputs) cast to `dtype`."""
    if dtype is None:
        return tree
    return tree_map_only(
        torch.Tensor, lambda t: t.to(dtype) if torch.is_floating_point(t) else t, tree
    )


def forward_in(
    compute_dtype: torch.dtype, forward: Callable[..., Any], args: Any, kwargs: Any
) -> Any:
    """Mixed precision: inputs in, outputs out of the compute dtype; the loss stays fp32."""
    args, kwargs = cast_floats((args, kwargs), compute_dtype)
    return cast_floats(forward(*args, **kwargs), torch.float32)


def _cast_inputs_to_params(module: nn.Module, args: Any, kwargs: Any) -> Any:
    dtype = next(module.parameters()).dtype
    return cast_floats((args, kwargs), dtype)


def keep_in_own_dtype(modules: Iterable[nn.Module], compute_dtype: torch.dtype) -> None:
    """Kept modules run in their own dtype (fp32), their inputs cast to it, and hand
    back `compute_dtype` to the sharded modules after them."""

    def cast_output(module: nn.Module, args: Any, output: Any) -> Any:
        return cast_floats(output, compute_dtype)

    for m in modules:
        m.register_forward_pre_hook(_cast_inputs_to_params, with_kwargs=True)
        m.register_forward_hook(cast_output)


def frozen_in_compute_dtype(
    module: nn.Module, leave: Iterable[nn.Parameter], compute_dtype: torch.dtype
) -> None:
    """Weights frozen before wrapping are not sharded: they stay whole in the module, in
    their own dtype (what an export and a reload see), and each forward of the module
    that holds them runs on a copy in the compute dtype, made again only after the
    weight changed (a load), as FSDP2's `param_dtype` casts every weight. `leave`: the
    sharded weights and the kept modules' (those run in their own dtype)."""
    left = {id(p) for p in leave}
    for owner in module.modules():
        names = [
            name
            for name, p in owner.named_parameters(recurse=False)
            if id(p) not in left and p.is_floating_point() and p.dtype != compute_dtype
        ]
        if names:
            _FrozenCopies(owner, names, compute_dtype)


class _FrozenCopies:
    """One module's frozen weights swapped for their compute-dtype copies during its
    forward, and back after it (a forward that raises included)."""

    def __init__(self, owner: nn.Module, names: list[str], compute_dtype: torch.dtype) -> None:
        self.names, self.dtype = names, compute_dtype
        self.copies: dict[str, tuple[tuple[int, int], nn.Parameter]] = {}
        self.originals: list[dict[str, nn.Parameter | None]] = []
        owner.register_forward_pre_hook(self.swap_in)
        owner.register_forward_hook(self.swap_back, always_call=True)

    def swap_in(self, owner: nn.Module, args: Any) -> None:
        originals = {name: owner._parameters[name] for name in self.names}
        self.originals.append(originals)
        for name, p in originals.items():
            if p is None or p.requires_grad:  # unfrozen since: refused by the wrapper
                continue
            key = (id(p), p._version)
            if self.copies.get(name, (None,))[0] != key:
                self.copies[name] = (
                    key,
                    nn.Parameter(p.detach().to(self.dtype), requires_grad=False),
                )
            owner._parameters[name] = self.copies[name][1]

    def swap_back(self, owner: nn.Module, args: Any, output: Any) -> None:
        if self.originals:
            owner._parameters.update(self.originals.pop())
