"""Lesson 09: what a rank of the whole mesh (dp x cp x tp x pp x ep) holds of the GPT's
parameters, gradients and Adam state under each ZeRO stage (`mesh_bytes`), from its
tensor-parallel share (`tp_parameter_bytes`).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from parcourse.theory.tensor_parallel import tp_parameter_bytes

if TYPE_CHECKING:
    from parcourse.models import GPTConfig


def mesh_bytes(
    config: GPTConfig, shape: dict[str, int], zero: int = 0, stages_per_rank: int = 1
) -> dict[str, float]:
    """Theory: bytes per rank for parameters, gradients and Adam state of the GPT on a
    dp x tp x pp mesh (fp32), for stages that balance: a rank holds its tensor-parallel
    share (`tp_parameter_bytes`) of 1/pp of the model, where a tied embedding and head
    cut apart by the pipeline count twice (each end holds a copy, as Megatron-LM's
    embedding group does). dp replicates all of it; under ZeRO-1 each replica keeps Adam's
    two moments for 1/dp of the parameters (it steps its rows of the whole weights in
    place, `parcourse.zero.stages`). Under ZeRO-2 (a stage's gradients reduce-scattered
    after each microbatch) a rank holds one of its `stages_per_rank` stages' full gradient
    beside its shards: P/v + P/dp. Under ZeRO-3 the weights too, between two actions: its
    rows of them (P/dp), with ZeRO-2's gradients. With the sequence cut over cp, the cp
    ranks hold the same weights as dp's replicas do, and ZeRO shards over dp x cp. With
    experts cut over ep, a rank holds 1/ep of them; ep's ranks replicate the rest, so ZeRO
    shards the dense weights over dp x cp x ep and the experts over dp x cp."""
    from parcourse.roles import Roles

    roles = Roles.from_sizes(shape, zero=zero, config=config)
    tp, pp, ep = shape.get("tp", 1), shape.get("pp", 1), shape.get("ep", 1)
    held = tp_parameter_bytes(config, tp, ep)
    experts = held["experts"] / pp
    dense: float = held["total"] - held["experts"]  # a float once cut over pp
    if pp > 1 and config.tie_weights:
        dense += 4 * math.ceil(config.vocab / tp) * config.d_model  # the head's own copy
    dense /= pp
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"zero must be 0, 1, 2 or 3, got {zero}")
    params = dense + experts
    # this rank's rows, under ZeRO: the dense weights' over the shard's ranks (the dense
    # replicas, less dp's under HSDP), the experts' over the ranks that share them
    # (`parcourse.roles`)
    shard = dense / roles.size("shard") + experts / roles.size("expert_shard")
    optimizer = 2 * (shard if zero else params)
    grads = params if zero < 2 else params / stages_per_rank + shard
    return {"params": shard if zero == 3 else params, "grads": grads, "optimizer": optimizer}
