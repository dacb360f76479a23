"""Lesson 11, experts: what a mixture-of-experts layer sends under expert parallelism
(`moe_all_to_all_bytes`), the expert weights and Adam state a rank of an ep group holds
(`expert_bytes`), the rows it routes (`moe_rows`) and what it keeps for backward
(`moe_activation_bytes`).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from parcourse.models import GPTConfig


def moe_all_to_all_bytes(
    tokens: int, top_k: int, d_model: int, ep: int, experts: int, element_size: int = 4
) -> dict[str, int]:
    """Theory: bytes one rank sends in one MoE layer's step under expert parallelism, its
    `tokens` routed evenly (each expert chosen by tokens x top_k / experts of them, none
    dropped). Forward: the counts (experts / ep int64 to each of the ep - 1 others), the
    dispatch (the rows whose expert lives elsewhere: T k (ep - 1) / ep of d_model each) and
    the combine (as many back); backward: the combine's and the dispatch's gradients, the
    same rows again. In all 4 T k h (ep - 1) / ep elements, and the counts."""
    rows = tokens * top_k * (ep - 1) // ep
    counts = 8 * (experts // ep) * (ep - 1)
    moved = rows * d_model * element_size
    return {
        "counts": counts,
        "forward": counts + 2 * moved,
        "backward": 2 * moved,
        "messages": 5 * (ep - 1),
    }  # counts, dispatch, combine; two back


def expert_bytes(
    config: GPTConfig, ep: int, element_size: int = 4, optimizer_per_element: int = 8
) -> dict[str, int]:
    """Theory: bytes of expert weights a rank of an ep group holds, and its Adam state
    (`optimizer_per_element`: 8 for fp32 Adam's two moments), over every block: experts / ep
    MLPs of (C -> 4C -> C) with biases. The routers and dense layers are not counted."""
    c, h = config.d_model, 4 * config.d_model
    per_expert = c * h + h + h * c + c
    elements = config.n_layers * (config.experts // ep) * per_expert
    return {
        "params": elements * element_size,
        "grads": elements * element_size,
        "optimizer": elements * optimizer_per_element,
    }


def moe_rows(config: GPTConfig, tokens: int, ep: int = 1) -> dict[str, int]:
    """Theory: the rows one MoE layer moves on a rank of an ep group whose every rank
    routes `tokens` tokens evenly (each expert chosen by tokens x top_k / experts of them;
    with a capacity factor, at most cap = ceil(factor x tokens x top_k / experts) kept an
    expert from each rank, GShard's limit): "kept", the assignments it sends (A);
    "received", the rows its experts run (R, as many when routing is even); "padded", the
    rows to which the batched experts pad each held expert (M: the busiest's; with a
    capacity factor the most it can take, ep x cap, which uneven routing cannot exceed;
    dropless, the even share, which uneven routing does: routed as it comes, the busiest
    expert takes more)."""
    e, k = config.experts, config.top_k
    if not e or e % ep:
        raise ValueError(f"{e} experts do not cut over ep {ep}")
    per_expert = tokens * k / e  # from each rank, routed evenly
    if config.capacity_factor is None:
        padded = math.ceil(per_expert * ep)
    else:
        cap = math.ceil(config.capacity_factor * tokens * k / e)
        per_expert, padded = min(per_expert, cap), ep * cap
    kept = round(per_expert * e)
    return {"kept": kept, "received": kept, "padded": padded}


def moe_activation_bytes(config: GPTConfig, tokens: int, ep: int = 1) -> int:
    """Theory: fp32 bytes one MoE layer (`parcourse.experts.MoE`, batched, or cut over ep)
    keeps for backward on a rank for its `tokens` tokens, routed evenly (`moe_rows`: A
    kept, R received, M the padded rows an expert), beyond its input (which the block's
    count holds, as a dense MLP's): the router's logits and probabilities (2 N E), its
    choices (N k int64, and N k bools kept), the balancing loss's share (E) and the
    z-loss's log-sum-exp (N); each kept assignment's token and place in its top k (2 A
    int64), its weight (A) and its output, unweighted and weighted (2 A C: the combine's
    sum keeps its input); each received row's place (2 R int64, and under ep 2 R more:
    the order the rows arrived in and back); and the held experts' padded input and
    GeLU's input and output (E / ep x M x (C + 2 H)). Measured equal to the byte where
    every expert fills its capacity (tests/test_planner.py); dropless, routing at
    initialisation pads to 1.2-1.5 times the even count (docs/experts.md)."""
    n, c, e, k = tokens, config.d_model, config.experts, config.top_k
    rows = moe_rows(config, tokens, ep)
    a, r, m = rows["kept"], rows["received"], rows["padded"]
    router = 4 * 2 * n * e + 8 * n * k + n * k + 4 * e + 4 * n
    assignments = 8 * 2 * a + 4 * a + 4 * 2 * a * c
    received = 8 * 2 * r * (2 if ep > 1 else 1)
    return router + assignments + received + 4 * (e // ep) * m * (c + 2 * 4 * c)
