"""CS336's adapters (assignment 2, systems) mapped onto the course's classes: copied over
the suite's `tests/adapters.py` by `benchmarks/cs336_systems.py`.

DDP: `BucketedDataParallel`. FSDP: ZeRO-3 (`ZeroModel(module, 3)`) over the Linear and
Embedding weights, every other module with parameters (RMSNorm) kept whole, as the
suite's FSDP shards only those two; `compute_dtype` is ZeroModel's. The sharded
optimizer: `ZeroOptimizer` (the course's ZeroRedundancyOptimizer)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from parcourse.data_parallel import BucketedDataParallel
from parcourse.zero import ZeroModel, ZeroOptimizer


def get_ddp(module: nn.Module) -> nn.Module:
    return BucketedDataParallel(module)


def ddp_on_after_backward(ddp_model: Any, optimizer: torch.optim.Optimizer) -> None:
    ddp_model.finish_gradient_sync()


class CourseFSDP(nn.Module):
    """The suite reads `model.module.named_parameters()` for the gradients an optimizer
    steps: here `.module` is the ZeroModel, whose parameters are this rank's shards."""

    def __init__(self, module: nn.Module, compute_dtype: torch.dtype | None) -> None:
        super().__init__()
        from cs336_basics.model import Embedding, Linear

        kept = [
            m
            for m in module.modules()
            if list(m.parameters(recurse=False)) and not isinstance(m, (Linear, Embedding))
        ]
        self.module = ZeroModel(module, 3, compute_dtype=compute_dtype, keep_modules=kept)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def named_parameters(self, *args: Any, **kwargs: Any):  # the shards, not the module's
        return self.module.named_parameters(*args, **kwargs)


def get_fsdp(module: nn.Module, compute_dtype: torch.dtype | None = None) -> nn.Module:
    return CourseFSDP(module, compute_dtype)


def fsdp_on_after_backward(fsdp_model: Any, optimizer: torch.optim.Optimizer) -> None:
    fsdp_model.module.finish_gradient_sync()


def fsdp_gather_full_params(fsdp_model: Any) -> dict[str, torch.Tensor]:
    return fsdp_model.module.full_state_dict()


def get_sharded_optimizer(params: Any, optimizer_cls: type, **kwargs: Any) -> Any:
    return ZeroOptimizer(params, optimizer_cls, **kwargs)


def get_flashattention_autograd_function_pytorch() -> type:
    raise NotImplementedError("attention is not part of this comparison")


def get_flashattention_autograd_function_triton() -> type:
    raise NotImplementedError("attention is not part of this comparison")
