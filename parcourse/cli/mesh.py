"""`python -m parcourse mesh`: a mesh shape laid out on ranks: the grid of coordinates, each
axis' groups, and which groups cross a node boundary (no processes)."""

from __future__ import annotations

import argparse

from parcourse.mesh import AXES, ORDERS, Layout, check_ranks_per_node, nodes_of

HELP = "a device mesh: each rank's coordinates and each axis' groups (no processes)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--shape",
        default="pp=2,dp=2,tp=2",
        help="axis=size pairs, e.g. pp=2,dp=2,tp=2 (axes: " + ", ".join(AXES) + ")",
    )
    p.add_argument(
        "--order",
        default="megatron",
        help="megatron (pp, dp, tp innermost), llama3 (dp, pp, tp innermost), or "
        "the axes outermost first, e.g. dp,pp,tp",
    )
    p.add_argument(
        "--ranks-per-node",
        type=int,
        default=None,
        help="consecutive ranks that share a node (marks groups that cross nodes)",
    )


def parse_shape(text: str) -> dict[str, int]:
    """'pp=2,dp=2,tp=2' -> {'pp': 2, 'dp': 2, 'tp': 2}."""
    shape = {}
    for part in text.split(","):
        axis, sep, size = part.strip().partition("=")
        if not sep or not size.strip().lstrip("-").isdigit():
            raise ValueError(f"cannot read {part!r} in --shape; write axis=size, e.g. tp=2")
        shape[axis.strip()] = int(size)
    return shape


def _layout(args: argparse.Namespace) -> Layout:
    order = args.order if args.order in ORDERS else tuple(a.strip() for a in args.order.split(","))
    return Layout.of(parse_shape(args.shape), order)


def check(args: argparse.Namespace) -> str | None:
    try:
        layout = _layout(args)
        check_ranks_per_node(layout.world_size, args.ranks_per_node)
    except ValueError as e:
        return str(e)
    return None


def run(args: argparse.Namespace) -> int:
    layout = _layout(args)
    per_node = args.ranks_per_node
    shown = [a for a, s in zip(layout.axes, layout.sizes) if s > 1] or [layout.axes[-1]]
    sizes = " x ".join(f"{a} {layout.size(a)}" for a in shown)
    nodes = f", {per_node} ranks a node" if per_node else ""
    print(
        f"mesh        {sizes} = {layout.world_size} ranks, order {args.order} "
        f"({shown[0]} outermost, {shown[-1]} innermost){nodes}"
    )
    print("\nrank" + ("  node" if per_node else "") + "".join(f"{a:>4}" for a in shown))
    for rank in range(layout.world_size):
        coords = layout.coordinates(rank)
        node = f"{rank // per_node:>6}" if per_node else ""
        print(f"{rank:>4}{node}" + "".join(f"{coords[a]:>4}" for a in shown))
    print("\ngroups" + ("   (* crosses a node boundary)" if per_node else ""))
    for axis in shown:
        print(f"  {axis:<10}" + " ".join(_group(g, per_node) for g in layout.groups(axis)))
    print(
        "  embedding "
        + " ".join(_group(g, per_node) for g in layout.embedding_groups())
        + "   (first and last stage of each pipeline: the tied embedding and head)"
    )
    return 0


def _group(ranks: list[int], per_node: int | None) -> str:
    return f"[{', '.join(map(str, ranks))}]" + ("*" if len(nodes_of(ranks, per_node)) > 1 else "")
