"""Cut a chain of layers into consecutive stages: by layer count or by parameter count."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from torch import nn

By = Literal["layers", "params"]


def stage_bounds(sizes: Sequence[int], stages: int) -> list[tuple[int, int]]:
    """[start, end) of each stage over items of the given sizes, every stage non-empty,
    each ending where the running total first reaches its share of the whole."""
    n = len(sizes)
    if stages > n:
        raise ValueError(f"{stages} stages need at least {stages} layers; the model has {n}")
    total = sum(sizes)
    bounds, start, running = [], 0, 0
    for s in range(stages):
        if s == stages - 1:
            end = n
        else:
            target = total * (s + 1) / stages
            end = start + 1  # at least one layer
            running += sizes[start]
            # keep taking layers while the next one brings us closer to the target and
            # leaves one for each stage still to come
            while end < n - (stages - s - 1) and abs(running + sizes[end] - target) <= abs(
                running - target
            ):
                running += sizes[end]
                end += 1
        bounds.append((start, end))
        start = end
    return bounds


def partition(
    layers: Sequence[nn.Module] | nn.Sequential, stages: int, by: By = "layers"
) -> list[nn.Sequential]:
    """The layers cut into `stages` consecutive nn.Sequential stages, balanced by layer
    count or by parameter count."""
    layers = list(layers)
    if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1:
        raise ValueError(f"stages must be an integer >= 1, got {stages!r}")
    if by == "layers":
        sizes = [1] * len(layers)
    elif by == "params":
        sizes = [sum(p.numel() for p in layer.parameters()) for layer in layers]
    else:
        raise ValueError(f"by must be 'layers' or 'params', got {by!r}")
    return [nn.Sequential(*layers[a:b]) for a, b in stage_bounds(sizes, stages)]


def tied_weights(stages: Sequence[nn.Module]) -> list[dict[int, str]]:
    """Weights more than one stage uses (the embedding and the head), as PipelineRuntime's
    `tied`: {stage: the weight's name in that stage}."""
    where: dict[int, dict[int, str]] = {}
    for s, module in enumerate(stages):
        for name, p in module.named_parameters():
            where.setdefault(id(p), {})[s] = name
    return [group for group in where.values() if len(group) > 1]
