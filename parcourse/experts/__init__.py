"""Mixture of experts and expert parallelism (lesson 11, part 2).

A mixture-of-experts layer (`MoE`, layer.py) replaces a block's MLP with E MLPs and a
router (routing.py) that sends each token to its top k of them: E times the MLP's
parameters for k times its compute. `GPTConfig(experts=8, top_k=2)` builds the course's GPT
with one in every block.

- routing.py: `Router` (softmax top-k as Switch and GShard; sigmoid with normalised
  weights as DeepSeek-V3), the capacity that drops what overflows an expert (or none:
  dropless), Switch's balancing loss, the router z-loss, and DeepSeek-V3's balancing
  without a loss (a bias that only chooses, moved from token counts: `update_bias`).
- layer.py: `MoE`, run as a readable loop over experts or batched (sorted by expert,
  padded, one `bmm` a Linear), tested equal; the balancing losses trained through their
  gradient (`AddAuxLoss`), whatever the loop around it.
- parallel.py: expert parallelism: `expert_parallel(model, comm)` cuts each layer's experts
  over an ep group; the kept assignments are dispatched by an all-to-all (counts first,
  then the rows, variable sizes) and combined by the inverse. ep folds into the
  data-parallel ranks; `reduce_gradients` sums an expert's gradient over its copies
  (`expert_groups`) and averages the rest over dp.
"""

from parcourse.experts.layer import (
    MODES,
    AddAuxLoss,
    MoE,
    expert_parameters,
    moe_layers,
    permute,
    set_aux_scale,
    unpermute,
    update_bias,
)
from parcourse.experts.parallel import (
    check_ep,
    expert_groups,
    expert_parallel,
    reduce_gradients,
    run_expert_parallel,
)
from parcourse.experts.routing import SCORES, Router, Routing, capacity, keep_within

__all__ = [
    "MODES",
    "SCORES",
    "AddAuxLoss",
    "MoE",
    "Router",
    "Routing",
    "capacity",
    "check_ep",
    "expert_groups",
    "expert_parallel",
    "expert_parameters",
    "keep_within",
    "moe_layers",
    "permute",
    "reduce_gradients",
    "run_expert_parallel",
    "set_aux_scale",
    "unpermute",
    "update_bias",
]
