"""Our 3D-parallel step (`parcourse.hybrid.Hybrid`) beside PyTorch's own composition of the
same GPT, for benchmarks/hybrid.py (`--only torch`).

torch's composition is torchtitan's (`parallelize_llama`, `pipeline_llama`): DTensor
tensor parallelism (`parallelize_module`: ColwiseParallel / RowwiseParallel, the head's
logits left split over the vocabulary for `loss_parallel`) on the mesh's "tp" axis, the
model then cut into pipeline stages (`torch.distributed.pipelining.PipelineStage`, one
per rank of "pp", under Schedule1F1B or ScheduleGPipe), and each stage replicated over
"dp" by FSDP2 (`fully_shard`) or by its replicated variant (`replicate`, DDP built on
FSDP2's machinery, the one `PipelineStage` knows how to hold back until the last
microbatch). Every axis is a dimension of one torch `DeviceMesh`, our `Mesh.device_mesh`,
so that DTensor and FSDP2 see one root mesh.

Both start from `gpt(config)` (the same seed on every rank), train on the same batches
with Adam, and mean their loss over the global batch: torch's schedule scales each
microbatch's gradient by 1/microbatches (`scale_grads`), FSDP2 averages over dp. The
tied embedding and head are one weight held by the first and the last stage; torch's
pipelining has no notion of a weight two stages share, so their gradients are added
here over the embedding group, as Megatron-LM and our `PipelineRuntime` do.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from parcourse.data import progressions
from parcourse.data import shard as shard_rows
from parcourse.experiments.pipeline import TORCH_SCHEDULES
from parcourse.experiments.timing import take_turns
from parcourse.hybrid import Hybrid
from parcourse.launch import RankContext
from parcourse.memory import storage_bytes, tensors_in
from parcourse.mesh import Mesh
from parcourse.models import GPT, GPTConfig, gpt, gpt_layers
from parcourse.pipeline.partition import partition

CONFIG = GPTConfig(vocab=64, block_size=16, n_layers=4, n_heads=4, d_model=64)
DataParallel = Literal["replicate", "fsdp"]
OneStagePerRank = Literal["1f1b", "gpipe"]  # torch's counterparts: TORCH_SCHEDULES


def adam(params: Any) -> torch.optim.Optimizer:
    """Both sides' optimizer (Hybrid's default): Adam, lr 1e-3."""
    return torch.optim.Adam(params, lr=1e-3)


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's piece of a tensor: a DTensor's local shard, a plain tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def held_bytes(tensors: Any) -> int:
    """Bytes of the storages behind this rank's pieces of `tensors` (DTensors: the
    local shard; nested containers as `tensors_in` walks them)."""
    with torch.no_grad():
        return storage_bytes(local(t) for t in tensors_in(tensors))


def torch_tp_plan(model: GPT) -> dict[str, Any]:
    """GPT_PLAN in torch's styles, as `tensor_parallel.training.torch_tensor_parallel`
    writes it (without sequence parallelism): embedding and head split along the
    vocabulary, qkv and mlp.up column-wise, attn.proj and mlp.down row-wise. That
    function builds its own one-axis DeviceMesh from a group, without axis names; FSDP2
    (and `replicate`) joins the dp mesh with the DTensor parameters' mesh
    (`DeviceMesh._concatenate`), which needs named axes of one mesh, and on that one
    raises "TypeError: Invariant encountered: value was None when it should not be".
    Here the plan is applied on the "tp" axis of the mesh that holds every axis."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan: dict[str, Any] = {
        "tok_emb": RowwiseParallel(input_layouts=Replicate()),
        "head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
    }
    for i in range(len(model.blocks)):
        plan |= {
            f"blocks.{i}.attn.qkv": ColwiseParallel(),
            f"blocks.{i}.attn.proj": RowwiseParallel(),
            f"blocks.{i}.mlp.up": ColwiseParallel(),
            f"blocks.{i}.mlp.down": RowwiseParallel(),
        }
    return plan


@dataclass
class TorchComposition:
    """torch's pieces on this rank: its stage module, the schedule that runs it, the
    optimizer, and where the stage sits."""

    stage: nn.Module
    schedule: Any
    optimizer: torch.optim.Optimizer
    mesh: Mesh
    tied: nn.Parameter | None  # the embedding's / head's weight on the first or last stage
    grad_bytes: int = 0

    @property
    def first(self) -> bool:
        return self.mesh.coordinate("pp") == 0

    @property
    def last(self) -> bool:
        return self.mesh.coordinate("pp") == self.mesh.size("pp") - 1

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> float | None:
        """One optimizer step on the global batch, as `Hybrid.step`: the mean loss over
        it on the last stage's ranks, None elsewhere."""
        from torch.distributed.tensor.parallel import loss_parallel

        dp, replica = self.mesh.size("dp"), self.mesh.coordinate("dp")
        # Contiguous: torch's pipelining checks its inputs' strides against the first
        # batch's (torch 2.11 refuses x = tokens[:, :-1], a view with a row of 17)
        args = (shard_rows(inputs, replica, dp).contiguous(),) if self.first else ()
        losses: list[torch.Tensor] = []
        kwargs: dict[str, Any] = (
            {"target": shard_rows(targets, replica, dp).contiguous(), "losses": losses}
            if self.last
            else {}
        )
        if self.mesh.size("tp") > 1:
            with loss_parallel():  # the vocabulary-parallel cross entropy, forward and back
                self.schedule.step(*args, **kwargs)
        else:
            self.schedule.step(*args, **kwargs)
        if self.tied is not None and self.tied.grad is not None:
            with torch.no_grad():  # the tied weight's two gradients, added up
                dist.all_reduce(local(self.tied.grad), group=self.mesh.embedding_group)
        self.grad_bytes = held_bytes(
            [p.grad for p in self.stage.parameters() if p.grad is not None]
        )
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if not self.last:
            return None
        mean = torch.stack([local(loss.detach()) for loss in losses]).mean().reshape(1)
        dist.all_reduce(mean, group=self.mesh.group("dp"))
        return mean.item() / dp

    def memory(self) -> dict[str, int]:
        """Bytes this rank holds, by category, as `Hybrid.memory` counts them: its
        stage's parameters, its gradients when the schedule (and dp's reduction) ended,
        the optimizer's state."""
        return {
            "params": held_bytes(list(self.stage.parameters())),
            "grads": self.grad_bytes,
            "optimizer": held_bytes(list(self.optimizer.state.values())),
        }


def _lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def torch_composition(
    model: GPT,
    mesh: Mesh,
    device: torch.device,
    *,
    schedule: OneStagePerRank = "1f1b",
    microbatches: int = 2,
    data_parallel: DataParallel = "replicate",
) -> TorchComposition:
    """`model` split by torch's own APIs on `mesh`: tp by `parallelize_module` on the
    device mesh's "tp" (skipped at tp 1, as torchtitan skips it), the layers cut as ours
    cuts them (`partition(gpt_layers(model), pp)`), this rank's stage wrapped over "dp" by
    `fully_shard` (each layer, then the stage) or `replicate` (skipped at dp 1), and run
    by torch's counterpart of our `schedule`, `microbatches` per replica. At pp 1 that is
    a schedule of one stage: gradient accumulation over the microbatches, as ours does."""
    import torch.distributed.pipelining as pipelining

    device_mesh = mesh.device_mesh
    if mesh.size("tp") > 1:
        from torch.distributed.tensor.parallel import parallelize_module

        tied = model.head.weight is model.tok_emb.weight
        parallelize_module(model, device_mesh["tp"], torch_tp_plan(model))
        if tied:  # both split alike (vocabulary rows); parallelize_module made two copies
            model.head.weight = model.tok_emb.weight
    pp, coordinate = mesh.size("pp"), mesh.coordinate("pp")
    stage = partition(gpt_layers(model), pp)[coordinate]
    if mesh.size("dp") > 1:
        if data_parallel == "fsdp":
            from torch.distributed.fsdp import fully_shard

            # Left gathered after forward, as torchtitan does under pp: otherwise every
            # microbatch's forward and backward would all-gather the weights again.
            for layer in stage:
                if any(True for _ in layer.parameters()):
                    fully_shard(layer, mesh=device_mesh["dp"], reshard_after_forward=False)
            fully_shard(stage, mesh=device_mesh["dp"], reshard_after_forward=False)
        else:
            from torch.distributed._composable.replicate_with_fsdp import replicate

            replicate(stage, mesh=device_mesh["dp"])
    tied_weight = None
    if pp > 1 and model.config.tie_weights:
        ends = {0: "0.tok_emb.weight", pp - 1: f"{len(stage) - 1}.head.weight"}
        tied_weight = stage.get_parameter(ends[coordinate]) if coordinate in ends else None
    pipeline_stage = pipelining.PipelineStage(stage, coordinate, pp, device, group=mesh.group("pp"))
    runner = getattr(pipelining, TORCH_SCHEDULES[schedule])(
        pipeline_stage, microbatches, loss_fn=_lm_loss
    )
    return TorchComposition(stage, runner, adam(stage.parameters()), mesh, tied_weight)


def compare_steps(
    ctx: RankContext,
    shape: dict[str, int],
    steps: int = 5,
    *,
    config: GPTConfig = CONFIG,
    batch: int = 16,
    microbatches: int = 2,
    schedule: OneStagePerRank = "1f1b",
    data_parallel: DataParallel = "replicate",
    zero: Literal[0, 1, 2] = 0,
) -> dict[str, Any]:
    """Seconds per training step (Adam) of our `Hybrid` and of torch's composition of
    the same GPT on a mesh of `shape`, taking turns (`timing.take_turns`; the first round
    a warm-up), on the same global batch each round (`progressions` seeded by the
    round). Returns each one's times, losses (the warm-up's included; None off the last
    stage) and bytes held after the last step (parameters, gradients, optimizer state);
    if torch's composition raised while being built or in its first step, `error` holds
    its type, message and traceback, and only ours is timed.

    On CPU ranks (`Pool(n, device="cpu")`), where both are built: on ranks sharing a GPU,
    torch's pipelining sends CUDA tensors point to point through gloo, which aborts the
    process (seen on an H200)."""
    if ctx.device.type != "cpu":
        raise ValueError(
            f"compare_steps runs on CPU ranks (Pool(n, device='cpu')); this rank is on {ctx.device}"
        )
    mesh = Mesh(shape, ctx.group)
    ours = Hybrid(
        gpt(config), mesh, schedule=schedule, microbatches=microbatches, zero=zero, optimizer=adam
    )

    def data(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return progressions(batch, config.block_size, config.vocab, seed=i)

    # Step 0, untimed, is the warm-up: ours, then torch's, which fails here if anywhere
    # (a failure that only some ranks meet leaves the others waiting, until the pool's
    # timeout).
    losses: dict[str, list[float | None]] = {"ours": [ours.step(*data(0))]}
    runs: dict[str, Callable[[torch.Tensor, torch.Tensor], float | None]] = {"ours": ours.step}
    error = None
    try:
        theirs = torch_composition(
            gpt(config),
            mesh,
            ctx.device,
            schedule=schedule,
            microbatches=microbatches,
            data_parallel=data_parallel,
        )
        losses["torch"] = [theirs.step(*data(0))]
        runs["torch"] = theirs.step
    except Exception as e:  # noqa: BLE001 - torch's composition failing here is the result
        error = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"

    def turn(name: str) -> Callable[[int], None]:
        def run(i: int) -> None:
            losses[name].append(runs[name](*data(i + 1)))

        return run

    times = take_turns(ctx.group, {name: turn(name) for name in runs}, steps, warmup=0)
    memory = {
        "ours": {k: v for k, v in ours.memory().items() if k in ("params", "grads", "optimizer")}
    }
    if "torch" in runs:
        memory["torch"] = theirs.memory()
    return {"times": times, "losses": losses, "memory": memory, "error": error}
