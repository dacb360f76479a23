"""Lesson 08: a chain of n equal layers checkpointed by a policy ("none", "sqrt", "every",
"nothing"): the segments it is cut into, the most layer outputs alive at once, and the
layer forwards backward recomputes.
"""

from __future__ import annotations

import math


def checkpoint_segments(n_layers: int, policy: str, segments: int | None = None) -> int:
    """Segments a chain of n layers is cut into: "sqrt" ceil(sqrt n) (or `segments`),
    "every" n, "none" and "nothing" 1 (not checkpointed in segments)."""
    if policy == "sqrt":
        return segments or max(1, math.ceil(math.sqrt(n_layers)))
    return n_layers if policy == "every" else 1


def checkpoint_peak_activations(n_layers: int, policy: str, segments: int | None = None) -> int:
    """Theory: the most layer outputs alive at once for a chain of n equal layers, each
    saving one tensor the size of its output (the next layer's input shares it),
    counting the chain's input.

    none: the input and all n outputs, n + 1. Checkpointed in k segments of L = n/k
    layers: the k segment inputs, plus one segment's L outputs while it is recomputed,
    k + L (2 sqrt n for k = sqrt n: Chen et al., arXiv:1604.06174). nothing: the input,
    then one layer at a time recomputed with its rebuilt input, 1 + 2.
    """
    if policy == "none":
        return n_layers + 1
    if policy == "nothing":
        return 3
    k = checkpoint_segments(n_layers, policy, segments)
    return k + math.ceil(n_layers / k)


def checkpoint_extra_forwards(n_layers: int, policy: str) -> int:
    """Theory: layer forwards that backward recomputes. none: 0; in segments: every layer
    once, n (one extra forward); nothing: layer i's input from the start, n(n-1)/2."""
    if policy == "none":
        return 0
    if policy == "nothing":
        return n_layers * (n_layers - 1) // 2
    return n_layers
