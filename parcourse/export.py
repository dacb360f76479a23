"""The 3D step's whole state, on every rank: what `Hybrid.full_state_dict` returns, the unsplit
GPT's state dict (the same keys, fp32 values), to compare with one process or to load into
one. Its sharded twin, the checkpoint every rank writes its own piece of, is
`parcourse.checkpoint`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from parcourse.tensor_parallel.state_dict import whole_parameters

if TYPE_CHECKING:
    from parcourse.hybrid import Hybrid


def full_state_dict(model: Hybrid) -> dict[str, torch.Tensor]:
    """Each stage's parameters gathered over tp (and a part's cut, such as the experts',
    over its axis), then every stage's over pp (replicas are equal); the buffers where
    this rank's stages hold them."""
    with model.whole_weights():
        mine = whole_parameters(model.model, model.tp_comm.group, only=model.params)
        mine.update(_whole_cut(model))
    # this rank's stages' buffers (a balancing bias moves only where its layer runs)
    stage_buffers = {id(b) for m in model.runtime.stages.values() for b in m.buffers()}
    kept = model.model.state_dict().keys()
    mine.update(
        {
            name: b.detach().cpu().clone()
            for name, b in model.model.named_buffers()
            if id(b) in stage_buffers and name in kept
        }
    )
    stages: list[Any] = [None] * model.mesh.size("pp")
    dist.all_gather_object(
        stages, {k: v.cpu() for k, v in mine.items()}, group=model.mesh.group("pp")
    )
    state: dict[str, torch.Tensor] = {}
    for part in stages:
        state.update(part)
    buffers = {name: b.detach().cpu().clone() for name, b in model.model.named_buffers()}
    return {k: state[k] if k in state else buffers[k] for k in model.model.state_dict()}


def _whole_cut(model: Hybrid) -> dict[str, torch.Tensor]:
    """The weights a part cut over its axis along dim 0 (`Hybrid.cut_over`: the experts
    over ep), every rank's slice gathered, in rank order as they were cut."""
    out = {}
    held = {id(q) for q in model.params}
    for name, p in model.model.named_parameters():
        axis = model.cut_over.get(id(p))
        if axis is None or id(p) not in held:
            continue
        parts = [torch.empty_like(p) for _ in range(model.mesh.size(axis))]
        dist.all_gather(parts, p.detach().contiguous(), group=model.mesh.group(axis))
        out[name] = torch.cat(parts).cpu()
    return out
