"""A device mesh: the ranks laid out on named axes (dp, tp, pp, and the axes the parts of
`parcourse.parts` add), and one process group per axis for each rank.

The layout is row-major with the last axis innermost, so consecutive ranks differ in the
innermost axis, which is tensor parallelism by default: a TP group sits inside a node
(consecutive ranks share a node), where links are fast. Two orders are in use:

- Megatron-LM's default, `RankGenerator(order="tp-cp-ep-dp-pp")` (innermost first: pp
  outermost, then dp, tp innermost), as torchtitan and nanotron lay out their meshes;
- Llama 3's (arXiv:2407.21783, sec. 3.3.2: "[TP, CP, PP, DP]", innermost first) and
  picotron's (`torch.arange(world).view(dp, pp, cp, tp)`): dp outermost, then pp, tp
  innermost.

`Layout` is the pure part (no processes): which rank sits where, every group of an axis,
and a rank's coordinates and back. It equals torch's `init_device_mesh` for the same sizes
in the same order (`torch.arange(world).view(sizes)`). `Mesh` builds the process groups of
a layout on real ranks, once per layout and parent group, every rank creating every group
in the same order, and offers them as arguments to the strategies (never as a global).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist

from parcourse.comm.common import backend_for, global_rank, group_info
from parcourse.parts import AXES, ORDERS

# `ORDERS` (the registry's): outermost first. Axes a shape leaves out have size 1.
__all__ = [
    "AXES",
    "ORDERS",
    "Layout",
    "Mesh",
    "Order",
    "check_ranks_per_node",
    "nodes_of",
    "order_axes",
]
Order = Literal["megatron", "llama3"]


@dataclass(frozen=True)
class Layout:
    """Named axes and their sizes, outermost first; rank = the row-major index of its
    coordinates (the last axis innermost)."""

    axes: tuple[str, ...]
    sizes: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.axes) != len(self.sizes):
            raise ValueError(f"{len(self.axes)} axes {self.axes} but {len(self.sizes)} sizes")
        for axis in self.axes:
            if axis not in AXES:
                raise ValueError(f"unknown axis {axis!r}; the axes are {', '.join(AXES)}")
        repeated = sorted({a for a in self.axes if self.axes.count(a) > 1})
        if repeated:
            raise ValueError(f"axis {', '.join(repeated)} given more than once")
        for axis, size in zip(self.axes, self.sizes):
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ValueError(f"the size of {axis} must be an int >= 1, got {size!r}")

    @classmethod
    def of(cls, shape: Mapping[str, int], order: Order | Sequence[str] = "megatron") -> Layout:
        """`Layout.of({"dp": 2, "tp": 2, "pp": 2})`: the shape's axes placed by `order`
        ("megatron", "llama3", or the axes outermost first, as a sequence or one string
        "tp,dp"); axes it leaves out have size 1."""
        names = order_axes(order)
        unknown = [a for a in shape if a not in AXES]
        if unknown:
            raise ValueError(
                f"unknown axis {', '.join(map(repr, unknown))}; the axes are {', '.join(AXES)}"
            )
        missing = [a for a, size in shape.items() if a not in names and size > 1]
        if missing:
            raise ValueError(f"the order {names} has no place for {', '.join(missing)}")
        # dp, tp and pp are always there (size 1 when the shape leaves them out): every
        # strategy may ask for its group; so are the shape's other axes of size 1 an
        # order leaves out (outermost, where they change no rank's place).
        ones = [a for a in ("pp", "dp", "tp", *shape) if a not in names]
        names = tuple(dict.fromkeys(ones)) + names
        return cls(tuple(names), tuple(shape.get(a, 1) for a in names))

    @property
    def world_size(self) -> int:
        return math.prod(self.sizes)

    def size(self, axis: str) -> int:
        return self.sizes[self._dim(axis)] if axis in self.axes else 1

    def _dim(self, axis: str) -> int:
        if axis not in self.axes:
            raise ValueError(f"no axis {axis!r} in this mesh; it has {', '.join(self.axes)}")
        return self.axes.index(axis)

    def coordinates(self, rank: int) -> dict[str, int]:
        """{axis: coordinate} of `rank`: the row-major digits of the rank, last axis fastest."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is not in a mesh of {self.world_size} ranks")
        coords = {}
        for axis, size in reversed(list(zip(self.axes, self.sizes))):
            rank, coords[axis] = divmod(rank, size)
        return {a: coords[a] for a in self.axes}

    def rank(self, coordinates: Mapping[str, int]) -> int:
        """The rank at these coordinates (axes left out: 0)."""
        rank = 0
        for axis, size in zip(self.axes, self.sizes):
            c = coordinates.get(axis, 0)
            if not 0 <= c < size:
                raise ValueError(f"coordinate {axis}={c} is outside 0..{size - 1}")
            rank = rank * size + c
        return rank

    def groups(self, *axes: str) -> list[list[int]]:
        """Every group of `axes` (one axis, or several flattened, e.g. ("dp", "tp")): the
        ranks that differ only in those axes. Groups are listed in row-major order of the
        other axes; within a group, ranks in row-major order of `axes` as they stand in the
        layout (torch's `DeviceMesh` builds its groups the same way)."""
        dims = sorted({self._dim(a) for a in axes})
        others = [d for d in range(len(self.axes)) if d not in dims]
        out = []
        for fixed in itertools.product(*(range(self.sizes[d]) for d in others)):
            group = []
            for moving in itertools.product(*(range(self.sizes[d]) for d in dims)):
                coords = dict(zip((self.axes[d] for d in others), fixed))
                coords.update(zip((self.axes[d] for d in dims), moving))
                group.append(self.rank(coords))
            out.append(group)
        return out

    def group_of(self, rank: int, *axes: str) -> list[int]:
        """The group of `axes` that holds `rank`."""
        return next(g for g in self.groups(*axes) if rank in g)

    def crosses_nodes(self, rank: int, axes: Sequence[str], ranks_per_node: int | None) -> bool:
        """Whether `rank`'s own group of `axes` spans more than one node (consecutive
        `ranks_per_node` ranks share one; None: one node). An axis' groups can differ:
        with 6 ranks, 3 a node, dp 3 x tp 2, tp's [2 3] crosses and [0 1] does not."""
        return len(nodes_of(self.group_of(rank, *axes), ranks_per_node)) > 1

    def embedding_groups(self) -> list[list[int]]:
        """The first and last stage of each pipeline (one rank when pp is 1): where a tied
        embedding and LM head add up their gradients (Megatron-LM's embedding group)."""
        return [sorted({g[0], g[-1]}) for g in self.groups("pp")]

    def as_tensor(self) -> torch.Tensor:
        """The ranks as a tensor of these sizes (what `DeviceMesh` takes as `mesh`)."""
        return torch.arange(self.world_size).view(*self.sizes)


def order_axes(order: str | Sequence[str]) -> tuple[str, ...]:
    """The axes of `order` outermost first: a named order's ("megatron", "llama3"), or
    the axes themselves ("tp,dp" or ("tp", "dp"))."""
    if isinstance(order, str):
        if order in ORDERS:
            return ORDERS[order]
        if "," not in order:
            raise ValueError(
                f"unknown order {order!r}; choose {', '.join(ORDERS)} or give "
                "the axes outermost first (e.g. tp,dp)"
            )
        order = [a.strip() for a in order.split(",")]
    return tuple(order)


def nodes_of(group: Sequence[int], ranks_per_node: int | None) -> set[int]:
    """The nodes a group's ranks sit on (consecutive `ranks_per_node` ranks share one)."""
    if ranks_per_node is None:
        return {0}
    return {r // ranks_per_node for r in group}


def check_ranks_per_node(world_size: int, ranks_per_node: int | None) -> None:
    if ranks_per_node is None:
        return
    if ranks_per_node < 1 or world_size % ranks_per_node:
        raise ValueError(
            f"ranks_per_node ({ranks_per_node}) must divide the world size ({world_size})"
        )


# (parent's name, layout) -> (the parent, its groups by axes). The parent is kept to be
# compared: a group made again under a name used before (`new_group` with local
# synchronisation names a group by its ranks) is a new group, and a destroyed one's
# groups must not be handed out for it.
_GROUPS: dict[tuple[Any, ...], tuple[Any, dict[tuple[str, ...], dist.ProcessGroup]]] = {}


class Mesh:
    """`Mesh(shape, group=None, order="megatron", ranks_per_node=None)` on this rank.

    `shape`: {"dp": 2, "tp": 2, "pp": 2}; its product must be the size of `group` (the
    world by default), whose ranks are laid out in their order. `mesh.group("tp")` is
    this rank's tensor-parallel process group, to hand to a strategy; `coordinate`,
    `size`, the pipeline's `previous_rank` / `next_rank`, `embedding_group` (the first and
    last stage of this rank's pipeline, where the tied embedding and head live) and
    `device_mesh` (the same layout as a torch `DeviceMesh`, for torch's own parallel
    APIs). Groups are created once per layout and parent group, on every rank in the
    same order.
    """

    def __init__(
        self,
        shape: Mapping[str, int],
        group: dist.ProcessGroup | None = None,
        *,
        order: Order | Sequence[str] = "megatron",
        ranks_per_node: int | None = None,
    ) -> None:
        self.layout = Layout.of(shape, order)
        self.parent, self.local_rank, world = group_info(group)
        if self.layout.world_size != world:
            sizes = (
                " x ".join(f"{a} {s}" for a, s in zip(self.layout.axes, self.layout.sizes) if s > 1)
                or "1"
            )
            raise ValueError(
                f"the mesh {sizes} holds {self.layout.world_size} ranks, the group has {world}"
            )
        check_ranks_per_node(world, ranks_per_node)
        self.ranks_per_node = ranks_per_node
        self._global = [global_rank(self.parent, r) for r in range(world)]
        self._groups: dict[tuple[str, ...], dist.ProcessGroup] = {}
        self._device_mesh: Any = None
        # Created once per layout and parent group in this process: new_group is a
        # collective, and a panel that builds the same mesh again should not pay it again.
        key = (getattr(self.parent, "group_name", id(self.parent)), self.layout)
        parent, self._groups = _GROUPS.get(key, (None, {}))
        if parent is not self.parent:  # first seen, or a new group under an old name
            self._groups = {}
            _GROUPS[key] = (self.parent, self._groups)
        for axis in self.layout.axes:  # every axis a strategy may ask for, 1-rank ones too
            if axis in ("dp", "tp", "pp") or self.layout.size(axis) > 1:
                self._create(axis)
        self._create("embedding")

    def _create(self, *axes: str) -> dist.ProcessGroup:
        """This rank's group of `axes`: every rank creates every such group, in order."""
        if axes in self._groups:
            return self._groups[axes]
        if self.layout.world_size == 1:  # one rank: its group is every axis' group, and
            self._groups[axes] = self.parent  # no other process need take part
            return self.parent
        groups = (
            self.layout.embedding_groups() if axes == ("embedding",) else self.layout.groups(*axes)
        )
        mine = None
        for ranks in groups:
            created = dist.new_group([self._global[r] for r in ranks])
            if self.local_rank in ranks:
                mine = created
        # Every rank is in one group of each axis; only the first and last stages are in
        # an embedding group.
        assert mine is not None or axes == ("embedding",)
        self._groups[axes] = mine  # type: ignore[assignment]  # None: off the embedding
        return mine  # type: ignore[return-value]  # None only off the embedding stages

    # -- what a strategy asks

    def group(self, *axes: str) -> dist.ProcessGroup:
        """This rank's process group of `axes` (several: flattened, e.g. "dp", "tp"). A
        combination asked for the first time is created then: every rank must ask for it,
        in the same order."""
        return self._create(*axes)

    def coordinate(self, axis: str) -> int:
        return self.layout.coordinates(self.local_rank).get(axis, 0)

    def size(self, axis: str) -> int:
        return self.layout.size(axis)

    def ranks(self, *axes: str) -> list[int]:
        """The ranks (of the parent group) in this rank's group of `axes`."""
        return self.layout.group_of(self.local_rank, *axes)

    @property
    def previous_rank(self) -> int | None:
        """The rank of the previous pipeline stage (None on the first)."""
        stage = self.coordinate("pp")
        return None if stage == 0 else self.ranks("pp")[stage - 1]

    @property
    def next_rank(self) -> int | None:
        """The rank of the next pipeline stage (None on the last)."""
        stage = self.coordinate("pp")
        return None if stage == self.size("pp") - 1 else self.ranks("pp")[stage + 1]

    @property
    def embedding_group(self) -> dist.ProcessGroup | None:
        """The first and last stage of this rank's pipeline: where the tied embedding and
        LM head add up their gradients (Megatron-LM's embedding group); None on the ranks
        of the stages in between."""
        return self._groups[("embedding",)]

    def crosses_nodes(self, *axes: str) -> bool:
        """Whether this rank's group of `axes` spans more than one node."""
        return self.layout.crosses_nodes(self.local_rank, axes, self.ranks_per_node)

    @property
    def device_mesh(self) -> Any:
        """The same layout as a torch `DeviceMesh`, with the same axis names, built from
        this mesh's own groups (`DeviceMesh.from_group`), so torch's parallel APIs
        (`parallelize_module`, `fully_shard`) can be handed it."""
        if self._device_mesh is None:
            from torch.distributed.device_mesh import DeviceMesh

            device_type = "cuda" if backend_for(self.parent, "cuda") == "nccl" else "cpu"
            mesh = torch.tensor(self._global).view(*self.layout.sizes)
            self._device_mesh = DeviceMesh.from_group(
                [self._create(a) for a in self.layout.axes],
                device_type,
                mesh=mesh,
                mesh_dim_names=self.layout.axes,
            )
        return self._device_mesh

    def __repr__(self) -> str:
        shape = ", ".join(f"{a}={s}" for a, s in zip(self.layout.axes, self.layout.sizes))
        where = self.layout.coordinates(self.local_rank)
        return f"Mesh({shape}; rank {self.local_rank} at {where})"
