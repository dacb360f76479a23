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

    def __init__(
        self,
        model: ZeroStage1,
        optimizer_factory: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
    ) -> None:
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
        return {
            "stage": self.model.stage,
            "rank": self.model.rank,
            "world_size": self.model.world_size,
        }

    def _check_whose(self, state: dict[str, Any]) -> None:
        expected = tuple(self._whose().values())
        found = (state["stage"], state["rank"], state["world_size"])
        if found != expected:
            raise ValueError(
                f"this checkpoint holds (stage, rank, world_size) = {found}, "
                f"this optimizer is {expected}"
            )


_WHOSE = "parcourse_shard"


def guard_shard_state(optimizer: torch.optim.Optimizer, model: ZeroStage1) -> None:
    """A torch optimizer over `model`'s shards (what `from_config` hands back) made to say
    whose shard its `state_dict()` holds, (stage, rank, world_size) as `ShardedOptimizer`
    does, and to refuse in `load_state_dict` one of another rank, stage or world size,
    or one that does not say: loaded into the wrong rank, a shard's state would train
    wrong without a word (rows that split evenly) or abort the rank (rows that do not)."""
    whose = {"stage": model.stage, "rank": model.rank, "world_size": model.world_size}

    def saved(opt: torch.optim.Optimizer, state: dict[str, Any]) -> dict[str, Any]:
        return {**state, _WHOSE: dict(whose)}

    def loading(opt: torch.optim.Optimizer, state: dict[str, Any]) -> dict[str, Any]:
        found = state.get(_WHOSE)
        if found is None:
            raise ValueError(
                "this optimizer state does not say whose shard it holds (stage, "
                "rank, world_size): save it with this rank's state_dict()"
            )
        got = (found["stage"], found["rank"], found["world_size"])
        if got != tuple(whose.values()):
            raise ValueError(
                f"this optimizer state holds (stage, rank, world_size) = {got}, "
                f"this rank's optimizer is {tuple(whose.values())}"
            )
        return {k: v for k, v in state.items() if k != _WHOSE}

    optimizer.register_state_dict_post_hook(saved)
    optimizer.register_load_state_dict_pre_hook(loading)
