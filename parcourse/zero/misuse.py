"""The FSDP mistake, caught: an optimizer over the module's own parameters.

Sharding replaces each module parameter by a gathered copy (a view into the unit's
full buffer); what lasts is the shard parameters (`model.parameters()`). An optimizer
built from the module before sharding would step the copies, which changes nothing
that lasts (or nothing at all): its first step raises.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

# A module parameter that a ZeroModel turned into a gathered copy carries this mark.
_SHARDED_AWAY = "_parcourse_sharded_away"
_hook_installed = False


def _check_optimizer(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    for group in optimizer.param_groups:
        for p in group["params"]:
            if getattr(p, _SHARDED_AWAY, False):
                raise RuntimeError(
                    "this optimizer holds the module's own parameters, which ZeRO replaced by "
                    "gathered copies: stepping them trains nothing. Build the optimizer from "
                    "the sharded model, after sharding: torch.optim.AdamW(model.parameters())"
                )


def mark_sharded_away(params: Iterable[nn.Parameter]) -> None:
    """Mark the module's parameters that became gathered copies; from now on, any
    optimizer that steps one of them raises."""
    global _hook_installed
    for p in params:
        setattr(p, _SHARDED_AWAY, True)
    if not _hook_installed:
        register_optimizer_step_pre_hook(_check_optimizer)
        _hook_installed = True
