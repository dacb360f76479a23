"""CS336's adapters (assignment 2, systems) mapped onto torch's own classes, the peer
the course is compared with: DistributedDataParallel, FSDP2's `fully_shard` (each Linear
and Embedding, then the root; `MixedPrecisionPolicy(param_dtype=compute_dtype)`), and
ZeroRedundancyOptimizer. Copied over the suite's `tests/adapters.py` by
`benchmarks/cs336_systems.py`."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel


def get_ddp(module: nn.Module) -> nn.Module:
    return DistributedDataParallel(module)


def ddp_on_after_backward(ddp_model: Any, optimizer: torch.optim.Optimizer) -> None:
    pass  # DDP's all-reduces finish inside backward


class TorchFSDP(nn.Module):
    """`.module` is the fully_shard'ed model (the suite reads its parameters' gradients)."""

    def __init__(self, module: nn.Module, compute_dtype: torch.dtype | None) -> None:
        super().__init__()
        from cs336_basics.model import Embedding, Linear

        policy = MixedPrecisionPolicy(param_dtype=compute_dtype) if compute_dtype else None
        options = {"mp_policy": policy} if policy is not None else {}
        for m in module.modules():
            if isinstance(m, (Linear, Embedding)):
                fully_shard(m, **options)
        fully_shard(module, **options)
        self.module = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)


def get_fsdp(module: nn.Module, compute_dtype: torch.dtype | None = None) -> nn.Module:
    return TorchFSDP(module, compute_dtype)


def fsdp_on_after_backward(fsdp_model: Any, optimizer: torch.optim.Optimizer) -> None:
    pass  # FSDP2's reduce-scatters finish inside backward


def fsdp_gather_full_params(fsdp_model: Any) -> dict[str, torch.Tensor]:
    return {
        name: p.full_tensor() if isinstance(p, DTensor) else p.detach()
        for name, p in fsdp_model.module.named_parameters()
    }


def get_sharded_optimizer(params: Any, optimizer_cls: type, **kwargs: Any) -> Any:
    return ZeroRedundancyOptimizer(params, optimizer_class=optimizer_cls, **kwargs)


def get_flashattention_autograd_function_pytorch() -> type:
    raise NotImplementedError("attention is not part of this comparison")


def get_flashattention_autograd_function_triton() -> type:
    raise NotImplementedError("attention is not part of this comparison")
