"""Saving and loading a sharded model: whole weights in, whole weights out.

A ZeroModel's own parameters are gathered copies (freed at stage 3, refreshed only by
the next forward at stages 1-2), so `module.state_dict()` would save the wrong weights.
`full_state_dict` gathers every unit's masters (fp32) on every rank; `load_full_state_dict`
lets each rank take its own rows, so no rank waits for another. The optimizer's state is
saved rank by rank (`ShardedOptimizer.state_dict`, a sharded checkpoint), or made whole
weight by weight (`whole_optimizer_state`, what the 3D step's checkpoints store, so that
they load on another mesh) and cut back into this rank's rows
(`load_sharded_optimizer_state`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from parcourse._compat import all_gather_single
from parcourse.comm import Comm
from parcourse.zero.layout import FlatUnit

STATE_DICT_REFUSED = (
    "a ZeroModel's own parameters are gathered copies (freed at stage 3, refreshed "
    "only by the next forward at stages 1-2), so state_dict() would save the wrong "
    "weights. Call model.full_state_dict() on every rank (it gathers the shards), and "
    "model.load_full_state_dict(state) to load one."
)
LOAD_STATE_DICT_REFUSED = (
    "use model.load_full_state_dict(state), with the keys of "
    "model.full_state_dict(): it loads each rank's rows"
)


def _names(module: nn.Module) -> dict[int, str]:
    """Each parameter's first name (a tied parameter has several)."""
    return {id(p): n for n, p in module.named_parameters(remove_duplicate=True)}


def full_state_dict(
    module: nn.Module, units: list[FlatUnit], group: dist.ProcessGroup
) -> dict[str, torch.Tensor]:
    """The unsharded weights (gathered fp32 masters) and buffers, on every rank."""
    sharded = {id(p) for u in units for p in u.params}
    names = _names(module)
    state = {
        k: v.detach().clone()
        for k, v in module.state_dict(keep_vars=True).items()
        if id(v) not in sharded
    }
    for unit in units:
        full = unit.gathered_masters(lambda part, out: all_gather_single(out, part, group=group))
        for p, view in zip(unit.params, unit.views(full)):
            state[names[id(p)]] = view.clone()
    for name, p in module.named_parameters(remove_duplicate=False):
        if name not in state:  # the second name of a tied parameter
            state[name] = state[names[id(p)]]
    return {k: state[k] for k in module.state_dict()}


@torch.no_grad()
def load_full_state_dict(
    module: nn.Module, units: list[FlatUnit], state: dict[str, torch.Tensor]
) -> None:
    """Load unsharded weights (as `full_state_dict` returns them): every rank takes its
    own rows, so no rank waits for another. The next forward gathers them."""
    mine = module.state_dict(keep_vars=True)
    missing, unexpected = set(mine) - set(state), set(state) - set(mine)
    if missing or unexpected:  # strict, as torch's load_state_dict
        raise KeyError(
            " and ".join(
                f"{what} {sorted(keys)}"
                for what, keys in (("the state lacks", missing), ("the model has no", unexpected))
                if keys
            )
        )
    sharded = {id(p) for u in units for p in u.params}
    names = _names(module)
    shapes = {names[id(p)]: shape for u in units for p, shape in zip(u.params, u.shapes)}
    wrong = [
        f"{name}: {tuple(state[name].shape)} for {tuple(shapes.get(name, value.shape))}"
        for name, value in mine.items()
        if tuple(state[name].shape) != tuple(shapes.get(name, value.shape))
    ]
    if wrong:  # copy_ would broadcast, and a flat unit would take any shape of its size
        raise ValueError("shapes differ from the model's: " + "; ".join(wrong))
    for name, value in mine.items():
        if id(value) not in sharded:  # buffers, kept and frozen parameters
            value.copy_(state[name])
    for unit in units:
        unit.settle()  # a gather in flight (a prefetch no forward used) reads old weights
        full = torch.cat([state[names[id(p)]].reshape(-1).to(unit.dtype) for p in unit.params])
        if unit.master is unit.full and unit.gathered():
            unit.full.copy_(full)
        elif unit.master is not unit.full:
            unit.pack_part(full, unit.master)
        unit.gathered_version = -1  # gather again before the next forward


@torch.no_grad()
def whole_optimizer_state(
    units: list[FlatUnit], optimizer: torch.optim.Optimizer, comm: Comm
) -> dict[int, dict[str, torch.Tensor]]:
    """id(weight) -> the optimizer's state of it, whole: what is shaped like a weight's
    shard (Adam's moments) all-gathered over `comm`'s group into the weight's shape, the
    rest (Adam's step) as it is. A collective: every rank of the group calls it, with the
    same units and optimizer."""
    out: dict[int, dict[str, torch.Tensor]] = {}
    for unit in units:
        states = [optimizer.state.get(sp, {}) for sp in unit.shard_params]
        for p in unit.params:
            out[id(p)] = {}
        for key in sorted({k for st in states for k in st}):  # alike on every rank
            values = [st.get(key) for st in states]
            if all(
                v is None or (torch.is_tensor(v) and v.shape == sp.shape)
                for v, sp in zip(values, unit.shard_params)
            ):
                shards = [
                    torch.zeros_like(sp) if v is None else v
                    for v, sp in zip(values, unit.shard_params)
                ]
                for p, whole in zip(unit.params, _whole(unit, shards, comm)):
                    out[id(p)][key] = whole
            else:
                for p, v in zip(unit.params, values):
                    if v is not None:
                        out[id(p)][key] = v
    return out


def _whole(unit: FlatUnit, shards: list[torch.Tensor], comm: Comm) -> list[torch.Tensor]:
    """Tensors shaped like the unit's shards, made whole from every rank's, one per weight
    in the weights' shapes."""
    part = torch.zeros(unit.part_numel, dtype=shards[0].dtype, device=shards[0].device)
    for i, s in enumerate(shards):
        unit.shard_of(part, i).copy_(s)
    whole = torch.empty(comm.size * unit.part_numel, dtype=part.dtype, device=part.device)
    comm.all_gather(part, whole)
    flat = torch.empty(unit.numel, dtype=part.dtype, device=part.device)
    unit.unpack(whole.view(comm.size, unit.part_numel), into=flat)
    return [
        flat[o : o + n].view(shape)
        for o, n, shape in zip(unit.full_offsets, unit.numels, unit.shapes)
    ]


@torch.no_grad()
def load_sharded_optimizer_state(
    units: list[FlatUnit],
    optimizer: torch.optim.Optimizer,
    per_weight: dict[int, dict[str, torch.Tensor]],
) -> None:
    """The optimizer's state of whole weights (as `whole_optimizer_state` gives it) into
    the shards: what is shaped like a weight cut to this rank's rows, the rest copied."""
    for unit in units:
        states: list[dict[str, torch.Tensor]] = [{} for _ in unit.params]
        for key, first in per_weight[id(unit.params[0])].items():
            if first.shape == unit.params[0].shape:
                flat = torch.cat([per_weight[id(p)][key].reshape(-1) for p in unit.params])
                part = torch.zeros(unit.part_numel, dtype=flat.dtype, device=flat.device)
                unit.pack_part(flat, part)
                for i, state in enumerate(states):
                    state[key] = unit.shard_of(part, i).clone()
            else:
                for state, p in zip(states, unit.params):
                    state[key] = per_weight[id(p)][key].clone()
        for sp, state in zip(unit.shard_params, states):
            optimizer.state[sp] = state
