"""Split a model over a tensor-parallel group by a plan written as data.

    model = gpt(TINY)                                     # the single-process model
    apply_tensor_parallel(model, GPT_PLAN, group=group)   # now split, in place
    logits = model(idx)                                   # (B, T, vocab / N) on each rank
    loss = vocab_parallel_cross_entropy(logits, target, group, TINY.vocab)

A plan maps module names to a style; a `*` stands for one part of a name
(`blocks.*.mlp.up` is the up projection of every block):

- "column": an nn.Linear split by output features (`ColumnParallelLinear`);
- "row": an nn.Linear split by input features (`RowParallelLinear`), fed by a
  column-parallel layer (Megatron's pairing, arXiv:1909.08053, sec. 3);
- "vocab": an nn.Embedding or an LM head split along the vocabulary
  (`VocabParallelEmbedding`; `ColumnParallelLinear(vocab=True)`); a head tied to
  the embedding stays tied;
- "replicate": whole on every rank, as is every module the plan does not name
  (LayerNorm, position embedding: splitting them would cost more communication
  than they cost to compute).

Each rank keeps its part of the model's own weights, so the split model starts
from exactly the single-process one. Nothing is communicated while splitting.

With `sequence_parallel=True` (Korthikanti et al., arXiv:2205.05198, sec. 4.2.2),
the activations outside the column/row pairs (LayerNorm, dropout, residual) are
cut along the sequence: (B, T / N, C) on each rank. Column layers all-gather the
sequence instead of f, row layers and the vocab-parallel embedding
reduce-scatter it instead of g, a replicated embedding looks up this rank's
positions only, and the gradients of the replicated parameters, each rank's
from its own tokens only, are summed over the group (`ReplicatedGradSync`).

Dropout: every nn.Dropout is replaced by a `TrackedDropout` drawing from the
"sharded" generator where its input differs across ranks (inside a module that
holds both a column and a row layer, such as attention's dropout on the
probabilities of this rank's heads; everywhere under sequence parallelism), and
from the "replicated" one elsewhere (the same mask on every rank).
"""

from __future__ import annotations

from collections.abc import Mapping
from fnmatch import fnmatchcase
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from parcourse.comm import Algorithm, Comm, group_info
from parcourse.tensor_parallel.comm import TPComm
from parcourse.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    SequenceChunkEmbedding,
    VocabParallelEmbedding,
)
from parcourse.tensor_parallel.random import Region, RNGTracker, TrackedDropout
from parcourse.tensor_parallel.replicated import ReplicatedGradSync
from parcourse.trace import Tracer

Style = Literal["column", "row", "vocab", "replicate"]
STYLES: tuple[str, ...] = ("column", "row", "vocab", "replicate")
Plan = Mapping[str, Style]
_PARALLEL = (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    SequenceChunkEmbedding,
    TrackedDropout,
)


def prefixed(prefix: str, plan: Plan) -> dict[str, Style]:
    """The plan of a submodule, as seen from its parent: prefixed("mlp", MLP_PLAN)."""
    return {f"{prefix}.{name}": style for name, style in plan.items()}


# Megatron's pairs: one all-reduce forward, one backward, nothing in between.
MLP_PLAN: dict[str, Style] = {"up": "column", "down": "row"}
ATTENTION_PLAN: dict[str, Style] = {"qkv": "column", "proj": "row"}  # heads split over ranks
BLOCK_PLAN: dict[str, Style] = {
    "ln1": "replicate",
    **prefixed("attn", ATTENTION_PLAN),
    "ln2": "replicate",
    **prefixed("mlp", MLP_PLAN),
}
GPT_PLAN: dict[str, Style] = {
    "tok_emb": "vocab",
    "pos_emb": "replicate",
    **prefixed("blocks.*", BLOCK_PLAN),
    "ln_f": "replicate",
    "head": "vocab",
}


def gpt_plan(experts: int = 0) -> dict[str, Style]:
    """GPT_PLAN, or for a GPT whose MLPs are mixtures of experts the same without the MLP
    pair: each expert whole on every tp rank, which all see the same tokens (Megatron-LM's
    expert tensor-parallel size 1; ep cuts the experts instead)."""
    if not experts:
        return GPT_PLAN
    return {k: v for k, v in GPT_PLAN.items() if not k.startswith("blocks.*.mlp.")}


def apply_tensor_parallel(
    model: nn.Module,
    plan: Plan,
    group: dist.ProcessGroup,
    *,
    sequence_parallel: bool = False,
    tracer: Tracer | None = None,
    algorithm: Algorithm = "torch",
    seed: int = 0,
    comm: Comm | None = None,
) -> nn.Module:
    """Split `model` in place over `group` as `plan` says; returns `model`.

    Raises ValueError, before changing anything, for a plan that names no module,
    an unknown style, a style that does not fit the module, tied weights split two
    ways, or sizes the group cannot split (heads, hidden features), naming the
    module. `tracer` receives every collective (spans and counters); `seed` seeds
    dropout (see `RNGTracker`); `algorithm` as for `Comm`. `comm`: the Comm to talk
    through instead of one made of `group`, `tracer` and `algorithm`, e.g.
    `Comm(group, tracer=tracer, link=link, algorithm="ring")` puts the model on a
    simulated link.
    """
    if comm is not None and comm.group is not group_info(group)[0]:
        raise ValueError("comm must be a Comm on `group`")
    tp = TPComm(comm if comm is not None else Comm(group, tracer=tracer, algorithm=algorithm))
    styles = _resolve(model, plan, tp.size)
    modules = dict(model.named_modules())
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    tracker = RNGTracker(seed, tp.rank, device)
    sharded: dict[int, nn.Parameter] = {}  # original weight -> its shard (tied weights)
    for name, module in modules.items():
        style = styles.get(name, "replicate")
        new = _parallel(module, style, tp, sequence_parallel, name) if name else module
        if new is module:
            continue
        if style != "replicate":  # a weight tied to one already split shares its shard
            assert isinstance(new.weight, nn.Parameter)  # the split layers' own
            new.weight = sharded.setdefault(id(module.weight), new.weight)
        _replace(model, name, new)
    for name, module in modules.items():
        if name and type(module) is nn.Dropout:
            region: Region = (
                "sharded"
                if sequence_parallel or _splits_inside(name, modules, styles)
                else "replicated"
            )
            dropout = TrackedDropout(module.p, tracker, region)
            dropout.train(module.training)
            _replace(model, name, dropout)
    if sequence_parallel:
        _sum_replicated_grads(model, tp)
    return model


def sharded_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters that tensor parallelism split (each rank holds a different part)."""
    params: dict[int, nn.Parameter] = {}
    for m in model.modules():
        if isinstance(m, (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)):
            params[id(m.weight)] = m.weight
        if isinstance(m, ColumnParallelLinear) and m.bias is not None:
            params[id(m.bias)] = m.bias
    return list(params.values())


# --------------------------------------------------------------------------- checks


def _matches(pattern: str, name: str) -> bool:
    parts, names = pattern.split("."), name.split(".")
    return len(parts) == len(names) and all(fnmatchcase(n, p) for p, n in zip(parts, names))


def _resolve(model: nn.Module, plan: Plan, world_size: int) -> dict[str, Style]:
    """Module name -> style, every entry checked against the module it names."""
    if not isinstance(plan, Mapping):
        raise ValueError(f"a plan maps module names to styles, got {type(plan).__name__}")
    modules = dict(model.named_modules())
    for name, m in modules.items():
        if isinstance(m, _PARALLEL):
            raise ValueError(f"{name}: this model is already split ({type(m).__name__})")
    styles: dict[str, Style] = {}
    for pattern, style in plan.items():
        if style not in STYLES:
            raise ValueError(
                f"plan[{pattern!r}]: unknown style {style!r}; choose one of {', '.join(STYLES)}"
            )
        matched = [n for n in modules if n and _matches(pattern, n)]
        if not matched:
            raise ValueError(f"plan[{pattern!r}] matches no module of {type(model).__name__}")
        for name in matched:
            if styles.get(name, style) != style:
                raise ValueError(f"{name}: the plan says both {styles[name]!r} and {style!r}")
            styles[name] = style
    for name, style in styles.items():
        _check_fits(name, modules[name], style, modules, world_size)
    _check_tied(model, styles)
    return styles


def _check_fits(
    name: str, m: nn.Module, style: Style, modules: dict[str, nn.Module], world_size: int
) -> None:
    kind = type(m).__name__
    if style in ("column", "row") and not isinstance(m, nn.Linear):
        raise ValueError(f"{name}: {style!r} splits an nn.Linear, this is a {kind}")
    if style == "vocab" and not isinstance(m, (nn.Linear, nn.Embedding)):
        raise ValueError(
            f"{name}: 'vocab' splits an nn.Embedding or an LM head (nn.Linear), this is a {kind}"
        )
    if style not in ("column", "row"):
        return
    assert isinstance(m, nn.Linear)
    # Inside attention the split must fall between heads: a rank computes whole heads.
    parent = modules[name.rpartition(".")[0]]
    heads = getattr(parent, "n_heads", None)
    if isinstance(heads, int) and heads % world_size:
        raise ValueError(f"{name}: {heads} attention heads cannot be split over {world_size} ranks")
    features = m.out_features if style == "column" else m.in_features
    which = "output" if style == "column" else "input"
    if features % world_size:
        raise ValueError(
            f"{name}: {features} {which} features cannot be split over {world_size} ranks"
        )


def _check_tied(model: nn.Module, styles: dict[str, Style]) -> None:
    """A weight shared by several modules must be split the same way in all of them."""
    seen: dict[int, tuple[str, Style]] = {}
    for name, m in model.named_modules(remove_duplicate=False):
        for p in m.parameters(recurse=False):
            style = styles.get(name, "replicate")
            first = seen.setdefault(id(p), (name, style))
            if first[1] != style or (style in ("column", "row") and first[0] != name):
                raise ValueError(
                    f"{first[0]} and {name} share a weight, which the plan splits "
                    f"as {first[1]!r} and {style!r}; tied weights can only be "
                    "split both 'vocab' or left replicated"
                )


def _splits_inside(name: str, modules: dict[str, nn.Module], styles: dict[str, Style]) -> bool:
    """Whether the module's parent holds a column and a row layer: what runs between them
    (attention's probabilities) differs from rank to rank."""
    parent = name.rpartition(".")[0]
    children = {
        styles.get(f"{parent}.{c}" if parent else c) for c, _ in modules[parent].named_children()
    }
    return {"column", "row"} <= children


# --------------------------------------------------------------------------- changes


def _parallel(
    m: nn.Module, style: Style, comm: TPComm, sequence_parallel: bool, name: str
) -> nn.Module:
    if style == "vocab" and isinstance(m, nn.Embedding):
        return VocabParallelEmbedding(m, comm, sequence_parallel=sequence_parallel, name=name)
    if style in ("column", "row", "vocab"):
        assert isinstance(m, nn.Linear)  # `_check_fits` refused anything else
        if style == "row":
            return RowParallelLinear(m, comm, sequence_parallel=sequence_parallel, name=name)
        return ColumnParallelLinear(
            m, comm, sequence_parallel=sequence_parallel, vocab=style == "vocab", name=name
        )
    if sequence_parallel and type(m) is nn.Embedding:
        return SequenceChunkEmbedding(m, comm, name=name)
    return m


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, attr = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, attr, new)


def _sum_replicated_grads(model: nn.Module, comm: TPComm) -> None:
    """Under sequence parallelism each rank's replicated parameters (LayerNorm, biases
    added after a reduce-scatter, position embedding) see only its tokens: their
    gradients are summed over the group, in one all-reduce per backward."""
    split = {id(p) for p in sharded_parameters(model)}
    ReplicatedGradSync(
        [p for p in model.parameters() if id(p) not in split and p.requires_grad], comm
    )
    # A replicated parameter frozen at the split has no hook: unfrozen, its gradient would
    # stay this rank's tokens' part. The module holding it refuses to run then (its own
    # module, not the root: a pipeline runs stages, never the whole model).
    owners: dict[str, list[tuple[str, nn.Parameter]]] = {}
    for n, p in model.named_parameters():
        if id(p) not in split and not p.requires_grad:
            owners.setdefault(n.rpartition(".")[0], []).append((n, p))
    for owner, frozen in owners.items():

        def check_frozen(
            module: nn.Module, args: Any, frozen: list[tuple[str, nn.Parameter]] = frozen
        ) -> None:
            thawed = [n for n, p in frozen if p.requires_grad]
            if thawed:
                raise ValueError(
                    f"{', '.join(thawed)} did not require a gradient when the "
                    "model was split with sequence parallelism and now does: "
                    "split it after unfreezing (its gradient would not be "
                    "summed over tp)"
                )

        model.get_submodule(owner).register_forward_pre_hook(check_frozen)
