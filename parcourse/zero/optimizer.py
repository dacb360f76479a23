"""ZeRO stage 1 as a drop-in torch.optim.Optimizer, for loops that already use DDP.

    model = DistributedDataParallel(net)                 # gradients all-reduced, as usual
    opt = ZeroOptimizer(model.parameters(), torch.optim.Adam, lr=1e-3)

Each parameter tensor is owned by one rank (the largest go first, each to the
least-loaded rank); a rank keeps optimizer state only for what it owns, steps
it, and broadcasts it to the others. The same idea as torch's
ZeroRedundancyOptimizer. Whole tensors, unlike `zero.shard`'s flat slices, so
the balance is only as even as the tensor sizes allow.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, overload

import torch
import torch.distributed as dist
from torch import nn

from parcourse.comm import global_rank, group_info


def assign_owners(sizes: list[int], world_size: int) -> list[int]:
    """Owner rank of each tensor: largest first, to the rank with the fewest elements."""
    load = [0] * world_size
    owners = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        rank = min(range(world_size), key=lambda r: (load[r], r))
        owners[i] = rank
        load[rank] += sizes[i]
    return owners


class ZeroOptimizer(torch.optim.Optimizer):
    """`ZeroOptimizer(params, optimizer_class, group=None, **defaults)`."""

    def __init__(
        self,
        params: Iterable[nn.Parameter],
        optimizer_class: type[torch.optim.Optimizer],
        group: dist.ProcessGroup | None = None,
        **defaults: Any,
    ) -> None:
        self.group, self.rank, self.world_size = group_info(group)
        self._built = False
        super().__init__(params, defaults)
        self._all = [p for g in self.param_groups for p in g["params"]]
        self.owners = assign_owners([p.numel() for p in self._all], self.world_size)
        self._class, self._defaults = optimizer_class, defaults
        self.local: torch.optim.Optimizer | None = None
        self._make_local()
        self._built = True

    def _make_local(self) -> None:
        """The same param groups with their own hyperparameters, holding only what this
        rank owns (a group may be empty here). A rank may own nothing at all (more ranks
        than tensors); it keeps no optimizer until it does."""
        owner = {id(p): r for p, r in zip(self._all, self.owners)}
        local_groups = [
            {**g, "params": [p for p in g["params"] if owner[id(p)] == self.rank]}
            for g in self.param_groups
        ]
        if any(g["params"] for g in local_groups):
            self.local = self._class(local_groups, **self._defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """As torch's: a group added later (layers a fine-tuning schedule hands to the
        optimizer part way, say) is trained too. Its tensors go to owners as at
        construction (largest first, to the least-loaded rank), where the others are."""
        super().add_param_group(param_group)
        if not self._built:  # the constructor's own groups: owners are assigned after
            return
        new = self.param_groups[-1]["params"]
        load = [0] * self.world_size
        for p, r in zip(self._all, self.owners):
            load[r] += p.numel()
        owners = [0] * len(new)
        for i in sorted(range(len(new)), key=lambda i: -new[i].numel()):
            owners[i] = min(range(self.world_size), key=lambda r: (load[r], r))
            load[owners[i]] += new[i].numel()
        self._all += new
        self.owners += owners
        mine = [p for p, r in zip(new, owners) if r == self.rank]
        if self.local is not None:
            self.local.add_param_group({**self.param_groups[-1], "params": mine})
        else:
            self._make_local()

    @overload  # as torch.optim.Optimizer.step: a closure's loss comes back
    def step(self, closure: None = None) -> None: ...
    @overload
    def step(self, closure: Callable[[], float]) -> float: ...
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = closure() if closure is not None else None
        if self.local is not None:
            # Every group's hyperparameters, as an LR scheduler (or the user) left them.
            for local, group in zip(self.local.param_groups, self.param_groups):
                local.update((k, v) for k, v in group.items() if k != "params")
            self.local.step()
        works = [
            dist.broadcast(
                p.data, src=global_rank(self.group, owner), group=self.group, async_op=True
            )
            for p, owner in zip(self._all, self.owners)
        ]
        for w in works:
            w.wait()
        return loss

    def local_state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds."""
        if self.local is None:
            return 0
        return sum(
            t.nbytes for s in self.local.state.values() for t in s.values() if torch.is_tensor(t)
        )

    def state_dict(self) -> dict[str, Any]:
        """This rank's shard (a sharded checkpoint: save one file per rank)."""
        return {
            "rank": self.rank,
            "world_size": self.world_size,
            "owners": self.owners,
            "local": self.local.state_dict() if self.local is not None else None,
            "param_groups": [
                {k: v for k, v in g.items() if k != "params"} for g in self.param_groups
            ],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if (state["rank"], state["world_size"], state["owners"]) != (
            self.rank,
            self.world_size,
            self.owners,
        ):
            raise ValueError("this checkpoint was saved by another rank or partition")
        for group, saved in zip(self.param_groups, state["param_groups"]):
            group.update(saved)
        if self.local is not None:
            self.local.load_state_dict(state["local"])
