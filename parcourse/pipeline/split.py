"""Backward split in two, as zero-bubble schedules need it: I, the gradient of a stage's
input (the stage before waits for it), then later W, the gradient of its weights.

Autograd computes a node's outputs only for the edges a call needs, so

    I:  torch.autograd.grad(y, x, grad, retain_graph=True)

runs backward along the path from the output y to the input x and skips each weight's
gradient. W needs the gradient that reached each operation using a weight, the
*boundary* nodes: on the input path, with an edge into a part of the graph that leads
only to weights. A hook on each keeps the gradients that reach it during I; W then
runs those nodes again from the kept gradients, for their weight edges only:

    W:  torch.autograd.backward(boundary outputs, kept gradients, inputs=weights)

one call per group of boundary nodes that share weights (one call for all would
also run the input path between them again). The graph stays alive from I to W:
W still needs what forward saved for the weight gradients.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge


def _node(t: torch.Tensor) -> Node | None:
    return get_gradient_edge(t).node if t.requires_grad else None


def _graph(root: Node) -> dict[Node, list[Node]]:
    """Every node reachable from `root`, with the nodes its edges lead to."""
    edges: dict[Node, list[Node]] = {}
    todo = [root]
    while todo:
        node = todo.pop()
        if node in edges:
            continue
        edges[node] = [n for n, _ in node.next_functions if n is not None]
        todo.extend(edges[node])
    return edges


def _reaching(edges: dict[Node, list[Node]], targets: set[Node]) -> set[Node]:
    """The nodes from which some target can be reached (targets included): a walk
    from the targets along the edges reversed."""
    parents: dict[Node, list[Node]] = {}
    for node, nexts in edges.items():
        for n in nexts:
            parents.setdefault(n, []).append(node)
    found, todo = set(), [t for t in targets if t in edges]
    while todo:
        node = todo.pop()
        if node not in found:
            found.add(node)
            todo.extend(parents.get(node, []))
    return found


@dataclass
class WeightGradient:
    """What I leaves for W: the output (when no boundary exists: W is the whole
    backward) or the boundary nodes' kept gradients, grouped by shared weights."""

    weights: list[torch.Tensor]
    output: torch.Tensor | None = None
    grad: torch.Tensor | None = None
    groups: list[tuple[list[Node], set[Node]]] = field(default_factory=list)
    of_node: dict[Node, torch.Tensor] = field(default_factory=dict)  # weight by its node
    kept: dict[Node, tuple[torch.Tensor | None, ...]] = field(default_factory=dict)

    def __call__(self) -> None:
        """W: accumulate every weight's gradient into `.grad`, then let the graph go."""
        # Into .grad through backward(inputs=...), not autograd.grad and an addition: a
        # weight's hooks then see a backward, as without the split (sequence
        # parallelism sums its replicated weights' gradients at a backward's end).
        if self.output is not None:
            leaves = [w for w in self.weights if w.requires_grad]
            if leaves:
                torch.autograd.backward(self.output, self.grad, inputs=leaves)
        for boundary, leaf_nodes in self.groups:
            outputs, grads_out = [], []
            for node in boundary:
                for i, g in enumerate(self.kept.get(node, ())):
                    if g is not None:
                        outputs.append(GradientEdge(node, i))
                        grads_out.append(g)
            if not outputs:
                continue
            # A boundary node that another one's weight path runs into would get that
            # gradient on top of its own: pin each to what it received during I.
            pins = (
                [
                    node.register_prehook(lambda _, kept=self.kept[node]: kept)
                    for node in boundary
                    if node in self.kept
                ]
                if len(boundary) > 1
                else []
            )
            try:
                torch.autograd.backward(
                    outputs,
                    grads_out,
                    retain_graph=True,
                    inputs=[self.of_node[n] for n in leaf_nodes],
                )
            finally:
                for pin in pins:
                    pin.remove()
        self.output = self.grad = None
        self.groups, self.kept, self.of_node = [], {}, {}


def input_gradient(
    output: torch.Tensor,
    grad: torch.Tensor | None,
    input: torch.Tensor,
    weights: Sequence[torch.Tensor],
) -> tuple[torch.Tensor | None, WeightGradient]:
    """I: the gradient of `input` (None when it needs none) and the W still to run."""
    weights = [w for w in weights if w.requires_grad]
    later = WeightGradient(weights)
    root, x = output.grad_fn, _node(input)
    edges = _graph(root) if root is not None else {}
    on_input_path = _reaching(edges, {x}) if x is not None else set()
    if root is None or root not in on_input_path:
        # The output does not depend on the input (the first stage): W is all of it.
        later.output, later.grad = output, grad
        return (torch.zeros_like(input) if input.requires_grad else None), later
    later.of_node = {get_gradient_edge(w).node: w for w in weights}  # all require grad
    weight_nodes = set(later.of_node)
    to_weights = _reaching(edges, weight_nodes) - on_input_path
    boundary = {
        n: {t for t in nexts if t in to_weights} for n, nexts in edges.items() if n in on_input_path
    }
    boundary = {n: ts for n, ts in boundary.items() if ts}
    # The weights reachable past each boundary node; nodes sharing a weight form a group.
    leaves_of: dict[Node, set[Node]] = {}
    for node, starts in boundary.items():
        seen, todo = set(), list(starts)
        while todo:
            n = todo.pop()
            if n in seen:
                continue
            seen.add(n)
            todo.extend(t for t in edges.get(n, []) if t in to_weights)
        leaves_of[node] = seen & weight_nodes
    groups: list[tuple[list[Node], set[Node]]] = []
    for node, leaves in leaves_of.items():
        merged = [g for g in groups if g[1] & leaves]
        group = ([node] + [n for g in merged for n in g[0]], leaves.union(*(g[1] for g in merged)))
        groups = [g for g in groups if not any(g is h for h in merged)] + [group]
    later.groups = groups
    hooks = [
        node.register_prehook(lambda grads, node=node: later.kept.__setitem__(node, grads))
        for node in boundary
    ]
    try:
        (dx,) = torch.autograd.grad(output, input, grad, retain_graph=True)
    finally:
        for hook in hooks:
            hook.remove()
    return dx, later
