"""The optimizer half of `zero.shard(...)`: the user's torch optimizer over a ZeroModel's
shards, stepped once the gradients are reduced, saved rank by rank. `InfinityOptimizer`
(infinity.py) is the same with the optimizer's state kept on disk."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from parcourse.zero.stage1 import ZeroStage1


class ShardedOptimizer:
    """The optimizer half of `parcourse.zero.shard(...)`: yours, over the model's shards.

    A thin wrapper: `ZeroModel.parameters()` are already what an optimizer steps.
    """

    def __init__(self, model: ZeroStage1,
                 optimizer_factory: Callable[[list[nn.Parameter]], torch.optim.Optimizer]) -> None:
        self.model = model
        self.shard_params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = optimizer_factory(self.shard_params)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        return self.optimizer.state

    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = closure() if closure is not None else None
        self.model.finish_gradient_sync()
        self.optimizer.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.model.zero_grad(set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """This rank's shard of the optimizer state (a sharded checkpoint)."""
        return {**self._whose(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._check_whose(state)
        self.optimizer.load_state_dict(state["optimizer"])

    def _whose(self) -> dict[str, int]:
        """Which shard a checkpoint holds: the stage, and this rank of how many."""
        return {"stage": self.model.stage, "rank": self.model.rank,
                "world_size": self.model.world_size}

    def _check_whose(self, state: dict[str, Any]) -> None:
        expected = tuple(self._whose().values())
        found = (state["stage"], state["rank"], state["world_size"])
        if found != expected:
            raise ValueError(f"this checkpoint holds (stage, rank, world_size) = {found}, "
                             f"this optimizer is {expected}")
