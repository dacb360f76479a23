"""Which ranks do what together, by role, derived once from a run's plan (torchtitan's
`ParallelDims` names its derived meshes the same way: batch, loss, fsdp, efsdp).

    roles = Roles.of(plan, config)
    roles.batch        # dp and ep, say: the axes whose ranks take different rows of the batch
    roles.replicas     # 4: how many ways the batch is cut (dp x ep)
    mesh.group(*roles.dense)   # the group that averages the dense weights' gradients

The roles, in the order Megatron-LM's `finalize_model_grads` uses them:

- `batch`: dp's ranks, and every part's that takes its own rows (ep's): they take
  different rows of the batch, `replicas` ways;
- `dense`: dp's, and every part's holding the same dense weights (ep's, cp's): they
  average the dense weights' gradients (ZeRO shards over them);
- `experts`: dp's, and every part's holding the same experts (cp's): they average each
  expert's gradient (ZeRO shards over them);
- `shard`, `replicate`: ZeRO's slices are cut over `shard`'s ranks, the dense replicas but
  dp's where a part's axis shards on its own (`Axis.shards`: HSDP, each slice replicated
  across `replicate`'s, dp's); otherwise `shard` is `dense` and `replicate` empty; the
  experts' slices over `expert_shard` (`experts` less `replicate`);
- `norm`: the ranks whose gradients differ (tp's, pp's, ep's with experts; under ZeRO also
  `shard`'s, each holding its own slice): they sum the squared gradient norm;
- `loss`: `dense`'s: they average the replicas' losses.

An axis' roles are its `parcourse.part.Axis` flags; this module names no part's axis. A
role lists only the axes of more than one rank beside the core ones, so that the groups
asked for stay the same whatever axes the mesh could have had.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from parcourse.parts import AXIS, NESTED

if TYPE_CHECKING:
    from parcourse.models import GPTConfig
    from parcourse.plan import ParallelPlan


@dataclass(frozen=True)
class Roles:
    """The axes of each role (flattened in this order when a group is made), and the
    sizes they were derived from."""

    batch: tuple[str, ...]
    dense: tuple[str, ...]
    experts: tuple[str, ...]
    shard: tuple[str, ...]
    replicate: tuple[str, ...]
    expert_shard: tuple[str, ...]
    norm: tuple[str, ...]
    sizes: dict[str, int]

    @classmethod
    def of(cls, plan: ParallelPlan, config: GPTConfig | None = None) -> Roles:
        """The roles of `plan`'s mesh; `config`: the model (whether it has the weights an
        axis cuts, e.g. experts; None: as if it had them)."""
        return cls.from_sizes(plan.shape, zero=plan.zero, config=config)

    @classmethod
    def from_sizes(
        cls, sizes: dict[str, int], zero: int = 0, config: GPTConfig | None = None
    ) -> Roles:
        """The roles of a mesh of these axis sizes; `zero`: ZeRO's stage (a sharded
        gradient adds the replicas to the norm's group)."""
        used = [a for a in NESTED if sizes.get(a, 1) > 1]

        def holds(axis: str) -> bool:
            weights = AXIS[axis].holds_weights
            return config is None or weights is None or weights(config)

        dense = ("dp", *(a for a in used if AXIS[a].dense))
        experts = ("dp", *(a for a in used if AXIS[a].experts))
        splits = tuple(a for a in used if AXIS[a].splits_gradients and holds(a))
        replicate = ("dp",) if any(AXIS[a].shards for a in used) else ()
        shard = tuple(a for a in dense if a not in replicate)
        return cls(
            batch=("dp", *(a for a in used if AXIS[a].batch)),
            dense=dense,
            experts=experts,
            shard=shard,
            replicate=replicate,
            expert_shard=tuple(a for a in experts if a not in replicate),
            norm=(*shard, "tp", "pp") if zero else ("tp", "pp", *splits),
            sizes=dict(sizes),
        )

    @property
    def loss(self) -> tuple[str, ...]:
        """The ranks whose losses are averaged into the step's: the dense replicas."""
        return self.dense

    def size(self, role: str) -> int:
        """How many ranks one group of `role` holds."""
        return math.prod(self.sizes.get(a, 1) for a in getattr(self, role))

    @property
    def replicas(self) -> int:
        """How many ways the batch is cut: the ranks that take different rows (dp's, and
        every part's that takes its own, as ep's). The one meaning of `replicas`."""
        return self.size("batch")

    def index(self, coordinates: dict[str, int]) -> int:
        """Which of the `replicas` a rank at these mesh coordinates is: the row-major index
        of its coordinates on the batch's axes (which rows of each batch it takes)."""
        index = 0
        for axis in self.batch:
            index = index * self.sizes.get(axis, 1) + coordinates.get(axis, 0)
        return index

    def label(self, role: str) -> str:
        """'dp-ep-cp': a role's axes as lesson 09's table names them."""
        return "-".join(getattr(self, role))
