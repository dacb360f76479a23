"""3D runs that lesson 09, the CLI and benchmarks/hybrid.py launch: where the
tensor-parallel group sits on a two-level network, measured beside the alpha-beta model.

"TP inside a node, PP across nodes": tensor parallelism's collectives are on the critical
path of every layer, so they belong on the fast links; pipeline stages exchange only
activations, once per microbatch. `placement_step_times` times the same training step
with the TP group inside a node and across nodes (the data-parallel group then takes
the other links), on a `Topology`.
"""

from __future__ import annotations

from typing import Any

import torch

from parcourse.comm import Topology
from parcourse.data import progressions
from parcourse.experiments.timing import take_turns
from parcourse.hybrid import Hybrid
from parcourse.launch import RankContext
from parcourse.mesh import Mesh
from parcourse.models import GPTConfig, gpt
from parcourse.theory import CostModel, tp_collectives, tp_link_seconds

# TP innermost: its group is consecutive ranks, one node; outermost: it spans the nodes.
PLACEMENTS: dict[str, tuple[str, ...]] = {"tp inside a node": ("dp", "tp"),
                                          "tp across nodes": ("tp", "dp")}


def placement_step_times(ctx: RankContext, topology: Topology, steps: int = 3, *,
                         config: GPTConfig | None = None, batch: int = 8) -> dict[str, Any]:
    """Seconds per step of the GPT on dp x tp = 2 x 2 (4 ranks, 2 a node), TP inside a
    node and across nodes, taking turns (`timing.take_turns`); one microbatch, so that
    the step's collectives are `theory.tp_collectives`'."""
    config = config or GPTConfig(vocab=64, block_size=16, n_layers=2, n_heads=4, d_model=64)
    if ctx.world_size != 4 or topology.ranks_per_node != 2:
        raise ValueError("placement_step_times runs on 4 ranks, 2 a node")
    x, y = progressions(batch, config.block_size, config.vocab)
    models = {name: Hybrid(gpt(config), Mesh({"dp": 2, "tp": 2}, ctx.group, order=order),
                           schedule="gpipe", microbatches=1, link=topology,
                           optimizer=lambda ps: torch.optim.SGD(ps, lr=0.01))
              for name, order in PLACEMENTS.items()}
    times = take_turns(ctx.group, {name: lambda _, m=m: m.step(x, y)
                                   for name, m in models.items()}, steps)
    param_bytes = sum(p.numel() * 4 for p in models["tp inside a node"].params)
    return {"times": times, "param_bytes": param_bytes}


def placement_predictions(topology: Topology, param_bytes: int, *,
                          config: GPTConfig | None = None, batch: int = 8) -> dict[str, float]:
    """The alpha-beta model's seconds of communication per step for each placement: TP's
    collectives on the ring (`tp_link_seconds`, each replica's batch) over its link, plus
    data parallelism's ring all-reduce of this rank's gradients over the other."""
    config = config or GPTConfig(vocab=64, block_size=16, n_layers=2, n_heads=4, d_model=64)
    collectives = tp_collectives(config, batch // 2, config.block_size, 2)
    inside, between = topology.inside, topology.between

    def seconds(tp_link: Any, dp_link: Any) -> float:
        tp_s = tp_link_seconds(collectives, 2, tp_link.latency_s, tp_link.bandwidth_Bps)
        dp_s = CostModel(dp_link.latency_s, dp_link.bandwidth_Bps).all_reduce_s(
            "ring", param_bytes, 2)
        return tp_s + dp_s

    return {"tp inside a node": seconds(inside, between),
            "tp across nodes": seconds(between, inside)}
