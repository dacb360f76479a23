"""The entry points: `ZeroModel(module, stage=...)`, and `shard(...)` for the model and
its optimizer at once.

Each stage is a class of its own, each adding to the one before:
`ZeroStage1` (stage1.py: optimizer state sharded) <- `ZeroStage2` (stage2.py:
gradients reduce-scattered during backward) <- `ZeroStage3` (stage3.py: weights
gathered before use and freed after). `ZeroModel(module, stage)` builds the class for
a stage.
"""

from __future__ import annotations

from abc import ABC
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from parcourse.comm import Algorithm
from parcourse.comm.link import Network
from parcourse.trace import Tracer
from parcourse.zero.infinity import InfinityOptimizer
from parcourse.zero.offload import OffloadTarget
from parcourse.zero.sharded_optimizer import ShardedOptimizer
from parcourse.zero.stage1 import ZeroStage1
from parcourse.zero.stage2 import ZeroStage2
from parcourse.zero.stage3 import ZeroStage3

Stage = Literal[1, 2, 3]
STAGES: dict[int, type[ZeroStage1]] = {1: ZeroStage1, 2: ZeroStage2, 3: ZeroStage3}


STAGE3_ONLY = (
    "offload_params",
    "quantized_weights",
    "fp8_all_gather",
    "hpz_partition_size",
    "quantized_gradients",
    "ranks_per_node",
)


class ZeroModel(ABC):  # noqa: B024 (abstract only so that the stages register under it)
    """`ZeroModel(module, stage, group=None, *, bucket_mb=25.0, prefetch=True,
    compute_dtype=None, algorithm="auto", keep_modules=(), offload_optimizer=None,
    link=None, tracer=None, **stage3_options)`.

    The module sharded with ZeRO `stage` (1, 2 or 3): what this returns is a
    `ZeroStage1`, `ZeroStage2` or `ZeroStage3` (each a subclass of the one before), and
    `isinstance(m, ZeroModel)` holds for all three. Use it like the module; build the
    optimizer from its `parameters()`. The options are `ZeroStage1`'s; `prefetch`
    (start the next module's gather early) is stage 3's, and stages 1-2 ignore it.
    Stage 3 alone takes `offload_params`, `fp8_all_gather` and ZeRO++'s `quantized_weights`,
    `hpz_partition_size`, `quantized_gradients` and `ranks_per_node` (ZeroStage3).
    """

    def __new__(  # type: ignore[misc]  # the stages are ZeroModels by ZeroModel.register, which the type checker cannot see
        cls,
        module: nn.Module,
        stage: Stage,
        group: dist.ProcessGroup | None = None,
        *,
        bucket_mb: float = 25.0,
        prefetch: bool = True,
        compute_dtype: torch.dtype | None = None,
        algorithm: Algorithm = "auto",
        keep_modules: Iterable[nn.Module] = (),
        offload_optimizer: OffloadTarget = None,
        link: Network | None = None,
        tracer: Tracer | None = None,
        **stage3_options: Any,
    ) -> ZeroStage1:
        if stage not in STAGES:
            raise ValueError(f"stage must be 1, 2 or 3, got {stage!r}")
        for name in stage3_options:
            if name not in STAGE3_ONLY:
                raise TypeError(f"ZeroModel got an unexpected keyword argument {name!r}")
        asked = {k: v for k, v in stage3_options.items() if v not in (None, False)}
        if stage != 3 and asked:
            raise ValueError(
                f"{', '.join(asked)}: stage 3 only (ZeRO++ and parameter "
                f"offload act on sharded weights); this is stage {stage}"
            )
        options: dict[str, Any] = {"prefetch": prefetch, **stage3_options} if stage == 3 else {}
        return STAGES[stage](
            module,
            group,
            bucket_mb=bucket_mb,
            compute_dtype=compute_dtype,
            algorithm=algorithm,
            keep_modules=keep_modules,
            offload_optimizer=offload_optimizer,
            link=link,
            tracer=tracer,
            **options,
        )


ZeroModel.register(ZeroStage1)  # and so its subclasses, the stages 2 and 3


def shard(
    model: nn.Module,
    optimizer_factory: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
    stage: Stage = 1,
    group: dist.ProcessGroup | None = None,
    *,
    mixed_precision: torch.dtype | None = None,
    bucket_mb: float = 25.0,
    prefetch: bool = True,
    algorithm: Algorithm = "auto",
    keep_modules: Iterable[nn.Module] = (),
    offload_optimizer: Literal["cpu", "nvme"] | None = None,
    nvme_path: str | Path | None = None,
    link: Network | None = None,
    tracer: Tracer | None = None,
    **stage3_options: Any,
) -> tuple[ZeroStage1, ShardedOptimizer | InfinityOptimizer]:
    """Shard a model and its optimizer with ZeRO `stage`; use the pair as before.

    >>> model, opt = zero.shard(net, lambda ps: torch.optim.Adam(ps, lr=1e-3), stage=2)
    >>> loss_fn(model(x), y).backward(); opt.step(); opt.zero_grad()

    The factory gets `model.parameters()` of the sharded model: build param groups
    from `model.named_parameters()` instead when you need them (as with FSDP2),
    e.g. `opt = torch.optim.AdamW(groups)` after `model = ZeroModel(net, stage)`.

    `mixed_precision=torch.bfloat16` (or float16): parameters, gradients and
    communication in 16 bits, fp32 master weights in the optimizer.
    `offload_optimizer="cpu"`: ZeRO-Offload (masters and optimizer on the host);
    `"nvme"` with `nvme_path`: ZeRO-Infinity (the optimizer's state on disk, an
    `InfinityOptimizer`). Stage 3's options (`offload_params`, ZeRO++'s) as ZeroModel's.
    """
    if offload_optimizer == "nvme" and nvme_path is None:
        raise ValueError(
            "offload_optimizer='nvme' needs nvme_path, the directory for the optimizer's state"
        )
    if nvme_path is not None and offload_optimizer != "nvme":
        raise ValueError(
            "nvme_path is where offload_optimizer='nvme' keeps the optimizer's "
            f"state; offload_optimizer is {offload_optimizer!r}"
        )
    zero_model = ZeroModel(
        model,
        stage,
        group,
        bucket_mb=bucket_mb,
        prefetch=prefetch,
        compute_dtype=mixed_precision,
        algorithm=algorithm,
        keep_modules=keep_modules,
        link=link,
        tracer=tracer,
        offload_optimizer="cpu" if offload_optimizer == "nvme" else offload_optimizer,
        **stage3_options,
    )
    if offload_optimizer == "nvme":
        assert nvme_path is not None
        torch_optimizer = optimizer_factory([p for p in zero_model.parameters() if p.requires_grad])
        return zero_model, InfinityOptimizer(zero_model, torch_optimizer, nvme_path)
    return zero_model, ShardedOptimizer(zero_model, optimizer_factory)
