"""The gradients that a pipeline's ranks add up after its schedule: weights that several
stages share (a GPT's token embedding on the first stage and its LM head on the last,
Megatron-LM's embedding group) and, when a schedule holds two copies of every stage
(DualPipe), each weight of one copy with its twin's.

`gradient_groups` names them once from the schedule and the stages; `SharedGradients`
holds this rank's part of them, remembers what their gradients held before a step
(accumulation over steps), and after the schedule sums what the step added over the ranks
that hold each, in rank order, so that every copy gets the same bits. The runtime
(`pipeline.runtime`) calls it; nothing here knows the schedule's actions.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from parcourse.comm import Comm
from parcourse.pipeline.actions import Schedule

_PER_MODEL_STAGE = 1 << 12  # tags for the copies' gradients: model stage x this + parameter


def gradient_groups(
    schedule: Schedule, stages: dict[int, nn.Module], tied: Sequence[dict[int, str]]
) -> list[tuple[int, dict[int, str]]]:
    """(tag offset, {stage: parameter name}) for every weight whose gradient ranks add up:
    the tied ones, and, when the schedule holds copies of stages (DualPipe), every other
    parameter of each copy with its twin. A tied group names stages; under copies it
    grows to the same weight in every copy."""
    if not schedule.copy_of:
        return [(k, dict(g)) for k, g in enumerate(tied)]
    twins = {
        s: [t for t in range(schedule.stages) if schedule.model_stage(t) == schedule.model_stage(s)]
        for s in range(schedule.stages)
    }
    groups = [(k, {t: name for s, name in g.items() for t in twins[s]}) for k, g in enumerate(tied)]
    in_tied = {(schedule.model_stage(s), name) for _, g in groups for s, name in g.items()}
    for s in sorted(stages):
        j = schedule.model_stage(s)
        if s != min(t for t in twins[s] if t in stages):
            continue  # one entry per model stage this rank holds a copy of
        for i, (name, _) in enumerate(stages[s].named_parameters()):
            if (j, name) not in in_tied:
                groups.append(
                    (len(tied) + 1 + j * _PER_MODEL_STAGE + i, {t: name for t in twins[s]})
                )
    return sorted(groups, key=lambda g: g[0])  # the same order on every rank: by tag


class SharedGradients:
    """`SharedGradients(groups, stages, rank, peer)`: of `groups` (`gradient_groups`),
    those whose gradient is summed over ranks and that this rank holds (`held`: tag
    offset, the ranks that hold it, a name, this rank's copies); `peer(stage)` is the
    rank that holds a stage."""

    def __init__(
        self,
        groups: list[tuple[int, dict[int, str]]],
        stages: dict[int, nn.Module],
        rank: int,
        peer: Callable[[int], int],
    ) -> None:
        self.rank = rank
        self.held: list[tuple[int, list[int], str, list[nn.Parameter]]] = []
        for k, group in groups:
            ranks = sorted({peer(s) for s in group})
            mine = {
                id(p): p
                for s, name in sorted(group.items())
                if s in stages
                for p in [stages[s].get_parameter(name)]
            }
            if not mine or (len(ranks) < 2 and len(mine) < 2):
                continue  # on one rank, the stages share one Parameter: nothing to add
            self.held.append((k, ranks, next(iter(group.values())), list(mine.values())))
        self._before: dict[int, torch.Tensor] = {}

    def remember(self) -> None:
        """Before a step: what the gradients hold (accumulation over steps), so that only
        what the step adds is summed over their ranks."""
        self._before = {
            id(w): w.grad.detach().clone()
            for *_, weights in self.held
            for w in weights
            if w.grad is not None
        }

    def add_up(self, comm: Comm, first_tag: int) -> None:
        """Each weight's gradient summed over the ranks that hold it (messages tagged from
        `first_tag` on), in rank order. A rank holding two of them (DualPipe's embedding
        of one copy and head of the other) adds its own first. A gradient kept from an
        earlier step was summed then, and is the same on every copy."""
        for k, ranks, name, weights in self.held:
            before = next((self._before[id(w)] for w in weights if id(w) in self._before), None)
            # Flat, with one more element: 1 where this rank's copy is trainable. The ranks
            # must agree: frozen everywhere, it keeps no gradient, as in one process.
            local = torch.zeros(
                weights[0].numel() + 1, dtype=weights[0].dtype, device=weights[0].device
            )
            grad = local[:-1].view_as(weights[0])
            local[-1] = float(weights[0].requires_grad)
            for w in weights:
                if w.grad is not None:
                    grad += w.grad.detach()
                    if id(w) in self._before:
                        grad -= self._before[id(w)]
            tag = first_tag + k
            sends = [comm.send(local, r, tag) for r in ranks if r != self.rank]
            parts = []
            for r in ranks:
                if r == self.rank:
                    parts.append(local)
                else:
                    part = torch.empty_like(local)
                    comm.recv(part, r, tag).wait()
                    parts.append(part)
            for w in sends:
                w.wait()
            total = parts[0].clone()
            for part in parts[1:]:
                total += part
            trainable = round(float(total[-1]))
            if trainable == 0:
                continue  # frozen on every rank that holds it
            if trainable != len(ranks):
                raise RuntimeError(
                    f"the tied weight {name} is frozen on some of ranks "
                    f"{ranks} and not on others: freeze it on all or none"
                )
            total = total[:-1].view_as(weights[0])
            if before is not None:
                total = before + total
            for w in weights:
                w.grad = total.clone()
