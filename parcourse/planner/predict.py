"""The planner's predictions (`parcourse.planner` says what it is) of one configuration
from its inputs (`parcourse.planner.inputs`: Choice, Cluster, models): memory, then
time, read top to bottom in two parts marked by rules, the second using the first. One
file, because time prices what memory lays out (`stage_layers`, `seq_here`,
`expert_numbers`, and `predict_memory`'s bytes for dp's reduction): each half is read
with the other.

Time is one pricer a term, each a function of one record (`StepInputs`): the stage's own
work, tp's collectives, cp's ring and ep's all-to-alls a microbatch on each stage; the
pipeline's step simulated on them; dp's reduction and the optimizer's step; then what a
step waits for shared cores (`predict_time` calls them in turn). The formulas themselves
(FLOPs and bytes moved a layer, ZeRO, bubbles) live in `parcourse.theory`; what is
measured on this machine, in `parcourse.planner.links` and `costs` (and `here`); the
search over every configuration, in `parcourse.planner.search`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from parcourse.comm import SimulatedLink
from parcourse.context_parallel import positions
from parcourse.mesh import Layout
from parcourse.models import GPTConfig
from parcourse.parts import PART_AXES
from parcourse.pipeline.actions import Schedule
from parcourse.pipeline.partition import stage_bounds
from parcourse.pipeline.simulate import Costs, SimulatedCompute, in_flight, simulate
from parcourse.plan import _schedule
from parcourse.planner.inputs import Choice, Cluster, Dtype, check_dtype
from parcourse.theory import (
    CostModel,
    TPCollective,
    attention_flops,
    attention_traffic,
    expert_bytes,
    gpt_layer_bytes,
    gpt_layer_flops,
    gpt_layer_traffic,
    korthikanti_layer_bytes,
    moe_flops,
    moe_rows,
    tp_link_seconds,
    tp_stage_collectives,
    zero_bytes,
)

# --------------------------------------------------------------------------- memory


def unpriced(config: GPTConfig, choice: Choice, dtype: str = "fp32") -> str:
    """What the planner does not count (one sentence; empty if it counts it all), which it
    refuses rather than price as if it were not there: experts but in fp32 under ZeRO
    0-1 (as the course's 3D step runs them), and context parallelism but the ring's in
    fp32."""
    if config.experts and (dtype != "fp32" or choice.zero > 1):
        return (
            f"the planner prices a mixture of experts in fp32 under ZeRO 0-1 (each "
            f"expert sharded over its own group), not in {dtype} under ZeRO-{choice.zero}"
        )
    if choice.cp > 1 and (choice.cp_method != "ring" or dtype != "fp32"):
        return (
            f"cp {choice.cp}: the planner prices the ring in fp32 only (its memory and "
            f"its messages), not {choice.cp_method} in {dtype}"
        )
    return ""


def seq_here(config: GPTConfig, choice: Choice) -> int:
    """The most tokens of a sequence a rank holds: all of them, or its share of them cut
    over cp (zigzag: two chunks a rank, the busiest rank's)."""
    if choice.cp == 1:
        return config.block_size
    return max(len(positions(config.block_size, r, choice.cp, "zigzag")) for r in range(choice.cp))


Checkpoint = Literal["stage", "block"]  # what full recompute checkpoints: see predict_memory


def stage_layers(config: GPTConfig, choice: Choice) -> list[list[int]]:
    """The GPT's layers (0 the embeddings, 1..L the blocks, L + 1 the head) on each
    stage, cut by layer count as the 3D step cuts them (`partition`)."""
    plan = _schedule(choice.schedule, choice.pp, choice.microbatches, choice.chunks)
    if choice.split == "blocks":
        k = config.n_layers // plan.stages
        stages = [list(range(1 + s * k, 1 + (s + 1) * k)) for s in range(plan.stages)]
        stages[0].insert(0, 0)
        stages[-1].append(config.n_layers + 1)
        return stages
    return [list(range(a, b)) for a, b in stage_bounds([1] * (config.n_layers + 2), plan.stages)]


def _layer_bytes(
    config: GPTConfig, layer: int, choice: Choice, batch: int, dtype: Dtype, pipelined: bool
) -> Mapping[str, float]:
    if dtype == "fp32":
        if choice.recompute == "selective":
            raise ValueError(
                "selective recompute is counted in 16 bits only (the course's "
                "3D step recomputes whole stages)"
            )
        return gpt_layer_bytes(
            config,
            layer,
            choice.tp,
            batch=batch,
            sequence_parallel=choice.sequence_parallel,
            pipelined=pipelined,
            seq=seq_here(config, choice),
            ring=choice.cp > 1,
            ep=choice.ep,
        )
    return korthikanti_layer_bytes(
        config,
        layer,
        choice.tp,
        batch=batch,
        sequence_parallel=choice.sequence_parallel,
        pipelined=pipelined,
        selective=choice.recompute == "selective",
    )


def _stage_input_bytes(
    config: GPTConfig, first_layer: int, choice: Choice, batch: int, dtype: Dtype
) -> float:
    """A stage's input, which it keeps for each microbatch under full recompute: the
    batch's token ids on the first stage; the residual stream elsewhere, cut along the
    sequence under sequence parallelism."""
    seq = seq_here(config, choice)
    if first_layer == 0:
        return 8 * batch * seq
    cut = choice.tp if choice.sequence_parallel else 1
    return (4 if dtype == "fp32" else 2) * batch * (seq // cut) * config.d_model


def predict_memory(
    config: GPTConfig,
    choice: Choice,
    global_batch: int,
    dtype: Dtype = "fp32",
    checkpoint: Checkpoint = "stage",
) -> list[dict[str, float]]:
    """Bytes on each pipeline rank (every dp and tp rank of it alike), by category:
    "params", "grads", "optimizer", "activations" (the peak the schedule holds) and
    "total".

    Full recompute, `checkpoint`: "stage", the course's 3D step's, each stage one
    checkpoint (a microbatch in flight keeps the stage's input; its backward rebuilds
    the whole stage at once); "block", Megatron-LM's (`--recompute-granularity full
    --recompute-method uniform --recompute-num-layers 1`), each block one (a microbatch
    keeps every block's input and the embeddings' and the head's own; a backward
    rebuilds one block at a time). Either way the loss runs outside, keeping its own."""
    check_dtype(dtype)
    if checkpoint not in ("stage", "block"):
        raise ValueError(f"checkpoint {checkpoint!r} is neither stage nor block")
    choice.check(config, global_batch, step=False)  # what any implementation could run
    if why := unpriced(config, choice, dtype):
        raise ValueError(why)
    plan = _schedule(choice.schedule, choice.pp, choice.microbatches, choice.chunks)
    layers = stage_layers(config, choice)
    batch = global_batch // (choice.replicas * choice.microbatches)
    pipelined = plan.stage_rank[0] != plan.stage_rank[-1]
    kinds: dict[int, Mapping[str, float]] = {}  # the blocks are alike: count one of them

    def counted(lay: int) -> Mapping[str, float]:
        kind = min(lay, 1) if lay <= config.n_layers else lay
        if kind not in kinds:
            kinds[kind] = _layer_bytes(config, lay, choice, batch, dtype, pipelined)
        return kinds[kind]

    per_stage = [[counted(lay) for lay in ls] for ls in layers]
    params = [sum(b["params"] for b in st) for st in per_stage]
    held, rebuilt = _held_and_rebuilt(
        config, choice, layers, per_stage, counted(1), batch, dtype, checkpoint
    )
    out = []
    for rank in range(choice.pp):
        memory = _weights_on_rank(config, choice, plan, layers, params, rank, dtype)
        memory["activations"] = _activation_peak(plan.actions[rank], held, rebuilt)
        memory["total"] = sum(memory.values())
        out.append(memory)
    return out


def _held_and_rebuilt(
    config: GPTConfig,
    choice: Choice,
    layers: list[list[int]],
    per_stage: list[list[Mapping[str, float]]],
    block_bytes: Mapping[str, float],
    batch: int,
    dtype: Dtype,
    checkpoint: Checkpoint,
) -> tuple[list[float], list[float]]:
    """The activations each stage keeps for a microbatch in flight, and what its backward
    rebuilds beside them (nothing but under full recompute: `predict_memory`'s
    `checkpoint`). `per_stage`: each stage's layers' bytes; `block_bytes`: a block's."""
    held = [sum(b["activations"] for b in st) for st in per_stage]
    rebuilt = [0.0] * len(held)
    if choice.recompute == "full" and checkpoint == "stage":
        inputs = [_stage_input_bytes(config, ls[0], choice, batch, dtype) for ls in layers]
        losses = [sum(b["loss"] for b in st) for st in per_stage]
        # rebuilt: all the stage's layers keep, but for the loss's, and for its input,
        # which the first block keeps too (the embedding keeps ids of its own, not the
        # batch's: the first stage rebuilds all of its layers' and holds the batch too)
        rebuilt = [
            h - loss - (x if ls[0] > 0 else 0)
            for h, loss, x, ls in zip(held, losses, inputs, layers)
        ]
        held = [x + loss for x, loss in zip(inputs, losses)]
    elif choice.recompute == "full":
        stream = _stage_input_bytes(config, 1, choice, batch, dtype)  # a block's input
        block = block_bytes["activations"]
        is_block = [[1 <= lay <= config.n_layers for lay in ls] for ls in layers]
        rebuilt = [block - stream if any(bs) else 0.0 for bs in is_block]
        held = [
            sum(stream if b else kept["activations"] for b, kept in zip(bs, st))
            for bs, st in zip(is_block, per_stage)
        ]
    return held, rebuilt


def _weights_on_rank(
    config: GPTConfig,
    choice: Choice,
    plan: Schedule,
    layers: list[list[int]],
    params: list[float],
    rank: int,
    dtype: Dtype,
) -> dict[str, float]:
    """Weights, gradients and Adam's state on pipeline rank `rank` as ZeRO's theory counts
    them (`params`: each stage's fp32 bytes); 16-bit gradient shards as the paper keeps
    them (2/dp a parameter). ZeRO shards the dense weights over dp x ep x cp (ep's ranks
    hold the same ones) and each stage's experts, cut over ep, over dp x cp; under HSDP
    over the shard's ranks only (`Roles.shard`, `Roles.expert_shard`)."""
    mine = [s for s, r in enumerate(plan.stage_rank) if r == rank]
    pipelined = plan.stage_rank[0] != plan.stage_rank[-1]
    roles = choice.roles
    n, z = roles.size("shard"), choice.zero
    half = torch.float32 if dtype == "fp32" else torch.bfloat16
    p = sum(params[s] for s in mine) / 4  # parameters (numbers) on this rank
    held_experts = _experts_held(config, choice, layers, mine)
    memory = zero_bytes(p - held_experts, n, z, half, grad_shard_dtype=half)
    if held_experts:
        for key, value in zero_bytes(
            held_experts, roles.size("expert_shard"), z, half, grad_shard_dtype=half
        ).items():
            memory[key] += value
    if z >= 2 and dtype == "fp32":
        # The tied embedding and head, when the pipeline holds them in two stages: numbers.
        tied = (
            math.ceil(config.vocab / choice.tp) * config.d_model
            if config.tie_weights and plan.stages > 1
            else 0
        )
        # The course's 3D step (fp32) reduces a stage's gradients at a time: whole
        # until then (`_zero_2_peak`), where the paper's buckets keep 1/dp of them.
        memory["grads"] = _zero_2_peak(
            plan.actions[rank],
            {s: params[s] / 4 for s in mine},
            tied,
            {0, *([plan.stages - 1] if pipelined else [])} & set(mine),
            {0, plan.stages - 1} & set(mine),
            n,
        )
    return memory


def _experts_held(
    config: GPTConfig, choice: Choice, layers: list[list[int]], mine: list[int]
) -> int:
    """The experts' own numbers a pipeline rank holds of its stages `mine` under ep (0
    without it: they count as dense weights)."""
    if choice.ep == 1:
        return 0
    return sum(expert_numbers(config, choice, lay) for s in mine for lay in layers[s])


def expert_numbers(config: GPTConfig, choice: Choice, layer: int) -> int:
    """The experts' own numbers a rank holds of `layer` (a block's experts / ep MLPs,
    their biases too; 0 elsewhere and for a dense GPT)."""
    if not config.experts or not 1 <= layer <= config.n_layers:
        return 0
    return expert_bytes(config, choice.ep, element_size=1)["params"] // config.n_layers


def _activation_peak(actions: Any, held: list[float], rebuilt: list[float]) -> float:
    """The most a rank's activations reach: those held for its microbatches in flight
    (`held`, each stage's per microbatch) after each action, and during each backward
    (B) what it rebuilds beside them (`rebuilt`: a stage's recomputed forward, all of
    it at once when the backward starts, under full recompute)."""
    alive = in_flight(actions, held)
    before = [0.0, *alive[:-1]]
    return max(
        [*alive, *(b + rebuilt[a.stage] for a, b in zip(actions, before) if a.kind == "B")],
        default=0.0,
    )


def _zero_2_peak(
    actions: Any, numbers: dict[int, float], tied: float, holds: set[int], uses: set[int], dp: int
) -> float:
    """The course's ZeRO-2 (`Hybrid(zero=2)`, fp32), walked along this rank's actions: after
    each B or W of stage s, s's gradients are whole (its other stages' already gone into
    slices), beside the tied weight's (whole from the first backward of a stage in `uses`
    until the end: it is reduced after the schedule) and the slices of every stage reduced
    so far; then s's go into its slice. After the schedule: the tied weight's whole
    gradient and every slice. The peak, in bytes. `numbers`: each stage's parameters, the
    tied weight's `tied` among those of the stages in `holds`."""
    own = {s: n - (tied if s in holds else 0) for s, n in numbers.items()}
    slices: set[int] = set()
    tied_live, peak = False, 0.0
    for a in actions:
        if a.kind not in ("B", "W"):
            continue
        tied_live = tied_live or a.stage in uses
        held = (
            own[a.stage] + (tied if tied_live else 0) + sum(math.ceil(own[s] / dp) for s in slices)
        )
        peak = max(peak, held)
        slices.add(a.stage)
    after = (tied if tied_live else 0) + sum(math.ceil(own[s] / dp) for s in slices)
    return 4 * max(peak, after)


# --------------------------------------------------------------------------- time


def stage_compute(
    config: GPTConfig,
    choice: Choice,
    global_batch: int,
    flops: float,
    bandwidth: float | None = None,
    dtype: Dtype = "fp32",
) -> SimulatedCompute:
    """Seconds of each stage's forward and backward of one microbatch at `flops` FLOP/s:
    the planner's compute alone (backward twice forward, and what recompute runs again
    first). With `bandwidth` (a GPU's memory, B/s) the layers' memory-bound work
    (`gpt_layer_traffic`, numbers of `dtype`) is added at it, backward's 1.5 times
    forward's (each op reads its input and its output's gradient and writes its input's
    gradient: 3 tensors for forward's 2). `Hybrid(compute=...)` pads a run's actions to
    them: the planner's check here, a GPU's compute on a laptop (`scaled`)."""
    # a rank's tokens of a microbatch: its share of each sequence under cp (the
    # busiest's); attention counted over the whole sequence, as Megatron-LM counts it
    tokens = global_batch // (choice.replicas * choice.microbatches) * seq_here(config, choice)
    number = 2 if dtype == "bf16" else 4
    per_byte = 0.0 if bandwidth is None else 1 / bandwidth
    sp = choice.sequence_parallel
    forward, backward = [], []
    for ls in stage_layers(config, choice):
        experts = sum(moe_flops(config, lay, tokens) for lay in ls)  # whole on each tp rank
        f = (
            (sum(gpt_layer_flops(config, lay, tokens) for lay in ls) - experts) / choice.tp
            + experts
        ) / flops
        moved = per_byte * sum(
            gpt_layer_traffic(config, lay, tokens, choice.tp, sp, number) for lay in ls
        )
        again = {
            "none": 0.0,
            "full": f + moved,
            "selective": sum(attention_flops(config, lay, tokens) for lay in ls) / choice.tp / flops
            + per_byte
            * sum(attention_traffic(config, lay, tokens, choice.tp, number) for lay in ls),
        }[choice.recompute]
        forward.append(f + moved)
        backward.append(2 * f + 1.5 * moved + again)
    return SimulatedCompute(forward=forward, backward=backward)


def model_flops_per_token(config: GPTConfig) -> float:
    """Forward + backward FLOPs of one token (3 x forward: backward is twice), the model's
    own (no recompute): what MFU counts."""
    return 3 * sum(gpt_layer_flops(config, lay, 1) for lay in range(config.n_layers + 2))


@dataclass(frozen=True)
class StepInputs:
    """What every pricer of a step reads (`predict_time`): the configuration, the model,
    the global batch, the cluster (its costs) and the dtype, and what follows from them,
    each derived once here (`_step_inputs`)."""

    config: GPTConfig
    choice: Choice
    global_batch: int
    cluster: Cluster
    dtype: Dtype
    schedule: Schedule  # the choice's, built
    layers: list[list[int]]  # each stage's (`stage_layers`)
    on_rank: list[list[int]]  # each pipeline rank's stages
    batch: int  # a microbatch's sequences on a rank
    seq: int  # a sequence's tokens on a rank (`seq_here`)
    tokens: int  # a rank's tokens of a microbatch
    number: int  # bytes a number of `dtype` (activations, weights, gradients)
    # The gradients are averaged, and ZeRO shards, over dp x ep x cp (cp's ranks hold the
    # same weights, and ep's the same dense ones): priced as data parallelism over those
    # ranks, a choice whose dp is theirs; the experts (cut over ep) over dp x cp.
    dense_group: Choice
    expert_group: Choice
    cores: int  # the cores the ranks share (a GPU each: as many as the ranks)
    # More ranks than cores, each computing on them: each one's own work costs more
    # processor time (`worse`: `Cluster.shared_cpu`, else 1), and, with a pipeline
    # (`loaded`), a woken receiver waits for a core while the other stages compute: hops
    # and tp's collectives cost what they were measured to cost so.
    shared: bool
    loaded: bool
    worse: float
    # How many ranks a core runs the optimizer's step and dp's bookkeeping for at once:
    # every rank on shared cores; with the compute simulated (`scaled`) a stage's dp x tp
    # ranks, the others asleep (a pipeline's stages end a backward apart); 1 with a GPU
    # each.
    at_once: float
    head_apart: bool  # the head on another stage than the embeddings
    experts_on: list[int]  # the bytes of experts each pipeline rank holds
    tensors_on: list[int]  # the parameter tensors each pipeline rank holds

    @functools.cached_property
    def memory(self) -> list[dict[str, float]]:
        """Each pipeline rank's bytes (`predict_memory`), counted when a pricer first
        reads them (dp's and the optimizer's, after the pipeline's step): a plan that the
        pipeline's simulator cannot run is refused in the simulator's words."""
        return predict_memory(self.config, self.choice, self.global_batch, self.dtype)

    def hop_link(self, axis: str) -> SimulatedLink:
        """The link a message of `axis`'s group (pp's hops, cp's ring, ep's all-to-alls)
        takes: its latency as measured while the other ranks compute (`loaded`), where it
        was."""
        link = _group_link(self.cluster, self.choice, axis)
        if self.loaded and self.cluster.loaded_p2p_s is not None:
            return SimulatedLink(self.cluster.loaded_p2p_s, link.bandwidth_Bps)
        return link

    def on_ranks(self, forward: list[float], backward: list[float]) -> list[float]:
        """A term's seconds in a step on each pipeline rank, from its seconds in each
        stage's forward and backward of a microbatch."""
        m = self.choice.microbatches
        return [sum(forward[s] + backward[s] for s in mine) * m for mine in self.on_rank]


def _step_inputs(
    config: GPTConfig, choice: Choice, global_batch: int, cluster: Cluster, dtype: Dtype
) -> StepInputs:
    """The record every pricer of `predict_time` reads."""
    plan = _schedule(choice.schedule, choice.pp, choice.microbatches, choice.chunks)
    layers = stage_layers(config, choice)
    batch = global_batch // (choice.replicas * choice.microbatches)
    seq = seq_here(config, choice)
    # ZeRO's and the gradients' groups (`Roles.shard`: the dense replicas, less dp's under
    # HSDP), priced as data parallelism over them: a choice whose dp is theirs
    roles, alone = choice.roles, dict[str, Any]((a, 1) for a in PART_AXES)
    dense = dataclasses.replace(choice, dp=roles.size("shard"), **alone)
    cores = cluster.cores or choice.gpus
    shared = choice.gpus > cores and not cluster.compute_simulated
    if cluster.compute_simulated:
        at_once = max(1.0, dense.dp * choice.tp / cores)
    else:
        at_once = choice.gpus / cores if shared else 1.0
    on_rank = [[s for s, r in enumerate(plan.stage_rank) if r == rank] for rank in range(choice.pp)]
    blocks = config.n_layers + 2
    head_apart = plan.stages > 1 and _stage_of(layers, 0) != _stage_of(layers, blocks - 1)
    number = 2 if dtype == "bf16" else 4
    return StepInputs(
        config,
        choice,
        global_batch,
        cluster,
        dtype,
        plan,
        layers,
        on_rank,
        batch,
        seq,
        batch * seq,
        number,
        dense,
        dataclasses.replace(choice, dp=roles.size("expert_shard"), **alone),
        cores,
        shared,
        shared and choice.pp > 1,
        cluster.shared_cpu if shared else 1.0,
        at_once,
        head_apart,
        [number * _experts_held(config, choice, layers, mine) for mine in on_rank],
        [
            sum(_layer_tensors(config, lay, head_apart) for s in mine for lay in layers[s])
            for mine in on_rank
        ],
    )


def _group_link(cluster: Cluster, choice: Choice, axis: str) -> SimulatedLink:
    """The slow link if a group of `axis` spans nodes under the plan's order (Megatron-
    LM's by default: tp innermost, then cp, ep, dp, pp outermost), else the fast one."""
    return cluster.between if _spans_nodes(cluster, choice, axis) else cluster.inside


def _spans_nodes(cluster: Cluster, choice: Choice, axis: str) -> bool:
    """Whether a group of `axis` spans nodes of `cluster.gpus_per_node` consecutive
    ranks: a group of s ranks `stride` apart (the sizes of the axes inside it) lies in
    one node where its span, s x stride, divides a node, and crosses otherwise."""
    layout = Layout.of(choice.shape, choice.order)
    if layout.size(axis) == 1 or choice.gpus <= cluster.gpus_per_node:
        return False
    inner = math.prod(layout.sizes[layout.axes.index(axis) :])
    return cluster.gpus_per_node % inner != 0


def predict_time(
    config: GPTConfig, choice: Choice, global_batch: int, cluster: Cluster, dtype: Dtype = "fp32"
) -> dict[str, float]:
    """Seconds of one step, split: "compute" (the slowest rank's F and B), "tp" (its
    collectives, on the critical path: each stage's own, in its F and B, as
    `tp_stage_collectives` counts them; Megatron-LM's where the layers are split as it
    splits them, `Choice.split`), "cp" and "ep" (its ring attention's messages and its
    all-to-alls, each exposed in its action), "bubble" (the rest of the pipeline's step:
    idle and messages, the tied weights' exchange), "dp" (what the step waits for of the
    gradients' reduction, after it or, ZeRO-2's, during it, the buckets' or ZeRO's own
    work on them, and the loss's mean over the replicas), "optimizer" (its step, on the
    rank with the most parameters), "cores" (on shared cores, waiting for one: what the
    ranks' processor time over the cores adds beyond the rest; 0 with a GPU each) and
    "step"; with "sharing" (what compute is slowed by on shared cores), "tokens_per_s"
    and "mfu" (model FLOPs against the dense peak).

    Where ranks share fewer cores (`cluster.cores`), each rank's own work costs
    `cluster.shared_cpu` times its processor time alone, and the ranks computing at once
    share the cores: compute is slowed by (ranks busy on average) / cores, read from the
    simulated timeline itself until it settles (a pipeline's idle ranks leave their core to the
    others; tp's collectives are not idle: every rank of a stage computes and waits in
    step); the optimizer, which every rank runs at once, by ranks / cores. With the
    compute simulated (`cluster.compute_simulated`, `scaled`), only the optimizer, which
    a stage's dp x tp ranks run at once (a pipeline's stages end apart).

    One pricer a term, each reading the same `StepInputs`: a microbatch's seconds on
    each stage of tp's collectives (`_tp_on_stages`), cp's ring (`_cp_on_stages`), ep's
    all-to-alls (`_ep_on_stages`) and the stage's own work (`_compute_on_stages`); the
    pipeline's step simulated on them (`_pipeline_step`); dp's reduction, hidden behind
    the compute it reads from that step (`_dp_step`); the optimizer's step
    (`_optimizer_step`); then the shared cores' correction (`_waiting_for_cores`)."""
    if why := unpriced(config, choice, dtype):
        raise ValueError(why)
    x = _step_inputs(config, choice, global_batch, cluster, dtype)
    tp, cp, ep, work = _tp_on_stages(x), _cp_on_stages(x), _ep_on_stages(x), _compute_on_stages(x)
    pipeline = _pipeline_step(x, work, tp, cp, ep)
    cp_s, ep_s = (x.on_ranks(t.forward, t.backward)[pipeline.busiest] for t in (cp, ep))
    dp_s = _dp_step(x, pipeline.compute)
    optimizer = _optimizer_step(x)
    step = pipeline.step + dp_s + optimizer
    waiting = _waiting_for_cores(x, work, tp, cp, ep, step)
    step += waiting
    model_flops = model_flops_per_token(config) * global_batch * config.block_size
    return {
        "compute": pipeline.compute,
        "tp": pipeline.tp,
        "cp": cp_s,
        "ep": ep_s,
        "bubble": pipeline.step - pipeline.compute - pipeline.tp - cp_s - ep_s,
        "dp": dp_s,
        "optimizer": optimizer,
        "cores": waiting,
        "step": step,
        "sharing": pipeline.sharing,
        "tokens_per_s": global_batch * config.block_size / step,
        "mfu": model_flops / (step * cluster.peak_flops * choice.gpus),
    }


# -- a microbatch's seconds on each stage, by term


@dataclass(frozen=True)
class OnStages:
    """A term's seconds in one microbatch's actions on each stage, in its forward (F) and
    its backward (B), and the messages a rank sends for them (cp's and ep's; their
    processor time is `_waiting_for_cores`')."""

    forward: list[float]
    backward: list[float]
    messages: list[int]


@dataclass(frozen=True)
class TPOnStages:
    """tp's collectives: their seconds in each stage's F and B of a microbatch (and, of
    B's, those a split backward's W runs), those once a step after the schedule (the
    busiest pipeline rank's), and each stage's counted by op (`_tp_counted`)."""

    forward: list[float]
    backward: list[float]
    weight: list[float]
    once: float
    counted: tuple[dict[str, dict[str, tuple[int, float]]], ...]


def _compute_on_stages(x: StepInputs) -> OnStages:
    """Each stage's own work of a microbatch: its FLOPs and bytes (`stage_compute`, with
    what recompute runs again), each layer's call and the stage's own in forward and in
    backward (`Overheads`; backward runs forward's calls again first under full
    recompute), `x.worse` times as costly on shared cores; there, with a pipeline, each
    action's sends and receives (one from the stage before and one to the stage after)
    take processor time, half a message's at each end."""
    cluster, ov = x.cluster, x.cluster.overheads
    message = cluster.message_cpu_s / 2 if x.loaded else 0.0
    flop_s = stage_compute(
        x.config, x.choice, x.global_batch, cluster.flops, cluster.memory_bandwidth, x.dtype
    ).of(len(x.layers))
    forward, backward = [], []
    for s, ls in enumerate(x.layers):
        hops = message * ((s > 0) + (s < len(x.layers) - 1))
        calls = ov.forward_layer_s * len(ls)
        again = calls if x.choice.recompute == "full" else 0.0
        forward.append(x.worse * (flop_s["F"][s] + calls + ov.forward_stage_s) + hops)
        backward.append(
            x.worse * (flop_s["B"][s] + ov.backward_layer_s * len(ls) + again + ov.backward_stage_s)
            + hops
        )
    return OnStages(forward, backward, [0] * len(x.layers))


def _tp_on_stages(x: StepInputs) -> TPOnStages:
    """tp's collectives of a microbatch on each stage, in its forward and its backward
    (`_tp_counted`), on the link its group uses; where a collective's own cost was
    measured (`measure_links`), it holds the link's latency: only the bytes are added to
    it. And those once a step, after the schedule (Megatron-LM's sum of the replicated
    gradients), on the pipeline rank with the most."""
    config, choice, cluster = x.config, x.choice, x.cluster
    loaded_tp = cluster.loaded_collective_s.get(choice.tp) if x.loaded else None
    link = _group_link(cluster, choice, "tp")
    counted = _tp_counted(
        config,
        tuple(map(tuple, x.layers)),
        x.batch,
        x.seq,
        choice.tp,
        choice.sequence_parallel,
        choice.recompute == "full",
        choice.split == "blocks",
        x.number,
    )
    measured = choice.tp in cluster.collective_s or loaded_tp is not None

    def seconds(by_op: dict[str, tuple[int, float]]) -> float:
        # n collectives of one op, of B bytes in all, on the ring: as one of B bytes with
        # n latencies a hop; and each one's own cost, by its op (or an all-reduce's as
        # measured while the other ranks compute)
        return sum(
            tp_link_seconds(
                _one_collective(op, size),
                choice.tp,
                n * (0.0 if measured else link.latency_s),
                link.bandwidth_Bps,
            )
            + n * (cluster.collective(op, choice.tp) if loaded_tp is None else loaded_tp)
            for op, (n, size) in by_op.items()
        )

    return TPOnStages(
        [seconds(by["F"]) for by in counted],
        [seconds(by["B"]) for by in counted],
        # of those, a split backward's W's. (On the first stage, whose input needs no
        # gradient, I does nothing and W runs the whole backward; priced, like a run's
        # simulated compute, as on the other stages.)
        [seconds(by["W"]) for by in counted],
        max(sum(seconds(counted[s]["step"]) for s in mine) for mine in x.on_rank),
        counted,
    )


def _one_collective(op: str, size: float) -> list[TPCollective]:
    """A collective of `op` of `size` bytes, as `tp_link_seconds` takes them."""
    # TPCollective counts a tensor's bytes, whole; these are several tensors' at the
    # dtype's size, which need not be, and the formula takes any number
    return [(op, "", "", size)]  # type: ignore[list-item]  # a float size: see above


@functools.lru_cache(maxsize=4096)
def _tp_counted(
    config: GPTConfig,
    layers: tuple[tuple[int, ...], ...],
    batch: int,
    seq: int,
    tp: int,
    sequence_parallel: bool,
    recompute: bool,
    megatron: bool,
    element: int,
) -> tuple[dict[str, dict[str, tuple[int, float]]], ...]:
    """tp's collectives of one microbatch of `seq` tokens a sequence (a rank's share under
    cp) on each stage (`tp_stage_collectives`), in its
    forward ("F") and backward ("B"; "W": those of them a split backward's W runs), and
    those once a step ("step"), counted by op: how
    many and their bytes in all, the activations' at `element` bytes a number (the
    loss's and the replicated gradients' stay fp32). Built once for the configurations
    that share them (a search asks again for every schedule, ZeRO stage and microbatch
    count of a shape)."""

    def count(collectives: list[TPCollective]) -> dict[str, tuple[int, float]]:
        ops: dict[str, tuple[int, float]] = {}
        for op, _, where, size in collectives:
            n, total = ops.get(op, (0, 0.0))
            fp32 = where in ("cross entropy", "replicated grads")
            ops[op] = (n + 1, total + (size if fp32 else size * element / 4))
        return ops

    out = []
    for by in tp_stage_collectives(
        config, [list(ls) for ls in layers], batch, seq, tp, sequence_parallel, recompute, megatron
    ):
        counted = {kind: count(collectives) for kind, collectives in by.items()}
        # A split backward's W: the sum of the replicated gradients (the rest of B, on
        # the input gradient's path, is I's)
        counted["W"] = count([c for c in by["B"] if c[2] == "replicated grads"])
        out.append(counted)
    return tuple(out)


def _cp_on_stages(x: StepInputs) -> OnStages:
    """Ring attention's messages in one microbatch on each stage (the course's `_Ring`,
    `parcourse.context_parallel`), as seconds they add to its forward and its backward,
    and how many a rank sends. Each block of the stage, at cp P: forward, P - 1 hops of K
    and V (a rank's tokens of the microbatch x d_model / tp, fp32), each sent while the rank
    attends to the block it holds, so it adds only what it takes beyond that block's
    compute (its queries against 1/P of the keys, `attention_flops` at the cluster's
    FLOP rate); backward, the same P - 1 hops of K and V beside twice that compute, and P
    hops of the held block's dK and dV, each sent after it and waited for (all of it);
    under full recompute the forward's again. The busiest rank's tokens (`seq_here`)."""
    config, choice = x.config, x.choice
    link = x.hop_link("cp")
    if choice.cp == 1:
        return _nothing_on(x.layers)
    p, tokens = choice.cp, x.tokens
    block = 2 * tokens * config.d_model / choice.tp * 4  # K and V of a rank's tokens, fp32
    hop = link.latency_s + block / link.bandwidth_Bps
    core = attention_flops(config, 1, tokens) / choice.tp / p / x.cluster.flops  # one block
    forward = (p - 1) * max(0.0, hop - core)
    backward = (p - 1) * max(0.0, hop - 2 * core) + p * hop
    messages = (p - 1) * (2 + (choice.recompute == "full")) + p
    return _each_block(config, choice, x.layers, forward, backward, messages)


def _ep_on_stages(x: StepInputs) -> OnStages:
    """Expert parallelism's all-to-alls in one microbatch on each stage, as seconds they
    add to its forward and its backward, and how many a rank runs. Each MoE block, at ep
    P, its tokens routed evenly (`moe_rows`): forward, an all-to-all of the counts (E /
    P int64 a peer), the dispatch and the combine (the kept rows, A / P of them to each
    peer, d_model fp32 each); backward, the combine's and the dispatch's gradients. The
    course's all-to-all posts its P - 1 sends and receives at once and waits for them all
    (`parcourse.comm.all_to_all`): a latency and the rank's bytes over its link, each
    waited for in the step (`parcourse.experts.parallel`); under full recompute the
    forward's again."""
    config, choice = x.config, x.choice
    link = x.hop_link("ep")
    if choice.ep == 1:
        return _nothing_on(x.layers)
    p, c = choice.ep, config.d_model
    rows = moe_rows(config, x.tokens, p)["kept"] / p  # to each peer
    counts = link.latency_s + (p - 1) * 8 * config.experts // p / link.bandwidth_Bps
    moved = link.latency_s + (p - 1) * 4 * rows * c / link.bandwidth_Bps
    forward, backward = counts + 2 * moved, 2 * moved
    messages = 5 + 3 * (choice.recompute == "full")
    return _each_block(config, choice, x.layers, forward, backward, messages)


def _nothing_on(layers: list[list[int]]) -> OnStages:
    """No seconds and no messages on any stage: an axis of size 1."""
    stages = len(layers)
    return OnStages([0.0] * stages, [0.0] * stages, [0] * stages)


def _each_block(
    config: GPTConfig,
    choice: Choice,
    layers: list[list[int]],
    forward: float,
    backward: float,
    messages: int,
) -> OnStages:
    """A block's `forward` and `backward` seconds (its forward's again under full
    recompute) and its `messages`, times the blocks on each stage."""
    again = forward if choice.recompute == "full" else 0.0
    blocks = [sum(1 <= lay <= config.n_layers for lay in ls) for ls in layers]
    return OnStages(
        [n * forward for n in blocks],
        [n * (backward + again) for n in blocks],
        [n * messages for n in blocks],
    )


# -- the pipeline's step


@dataclass(frozen=True)
class PipelineStep:
    """The pipeline's step simulated on the stages' costs: what compute is slowed by on
    shared cores (`sharing`, 1 on a GPU each), the busiest pipeline rank, its own work
    (`compute`) and its tp collectives (`tp`, those once a step too), and the whole
    step's seconds before dp's reduction and the optimizer (`step`: the schedule's,
    tp's once a step and the tied weights' exchange)."""

    sharing: float
    busiest: int
    compute: float
    tp: float
    step: float


def _pipeline_step(
    x: StepInputs, work: OnStages, tp: TPOnStages, cp: OnStages, ep: OnStages
) -> PipelineStep:
    """The course's simulator on each stage's forward and backward (its `work`, slowed on
    shared cores by what they settle at, `_settled`; its `tp` collectives; `cp`'s ring
    and `ep`'s all-to-alls, each exposed in its action), with the activations'
    point-to-point messages between stages on pp's link; then tp's collectives once a
    step and the tied weights' exchange."""
    msg_f = [c + e for c, e in zip(cp.forward, ep.forward)]
    msg_b = [c + e for c, e in zip(cp.backward, ep.backward)]
    link = x.hop_link("pp")
    activation = x.number * x.tokens * x.config.d_model
    if x.choice.sequence_parallel:
        activation //= x.choice.tp

    def simulated(slow: float) -> tuple[tuple[float, ...], float]:
        return _simulated(
            (x.choice.schedule, x.choice.pp, x.choice.microbatches, x.choice.chunks),
            tuple(slow * f + t + c for f, t, c in zip(work.forward, tp.forward, msg_f)),
            tuple(slow * b + t + c for b, t, c in zip(work.backward, tp.backward, msg_b)),
            tuple(slow * b / 2 + t for b, t in zip(work.backward, tp.weight)),
            link.latency_s,
            link.bandwidth_Bps,
            activation,
        )

    tp_on, msg_on = x.on_ranks(tp.forward, tp.backward), x.on_ranks(msg_f, msg_b)
    slow, busy, step = _settled(x, simulated, tp_on, msg_on)
    busiest = max(range(x.choice.pp), key=lambda r: busy[r])
    return PipelineStep(
        slow,
        busiest,
        busy[busiest] - tp_on[busiest] - msg_on[busiest],
        tp_on[busiest] + tp.once,
        step + tp.once + _tied_exchange(x, link),
    )


def _settled(
    x: StepInputs,
    simulated: Callable[[float], tuple[tuple[float, ...], float]],
    tp_on: list[float],
    msg_on: list[float],
) -> tuple[float, tuple[float, ...], float]:
    """What compute is slowed by on shared cores, with the simulated step's busy seconds
    of each rank and its step there: the ranks busy on average over the cores, read from
    the timeline until it settles (1 on a GPU each). The replicas and the tp ranks of a
    stage compute in step with each other, and wait on their collectives together:
    those waits are not idle time that other ranks could use."""
    slow, (busy_s, step_s) = 1.0, simulated(1.0)
    if not x.shared:
        return slow, busy_s, step_s
    choice = x.choice
    for _ in range(6):
        busy = sum(b - t - c for b, t, c in zip(busy_s, tp_on, msg_on))
        at_once = (
            busy
            / (step_s - max(tp_on) - max(msg_on))
            * choice.dp
            * choice.tp
            * choice.cp
            * choice.ep
            * choice.dp_shard
        )
        want = max(1.0, at_once / x.cores)
        if abs(want - slow) < 1e-3 * slow:
            break
        slow, (busy_s, step_s) = want, simulated(want)
    return slow, busy_s, step_s


@functools.lru_cache(maxsize=4096)
def _simulated(
    schedule: tuple[str, int, int, int],
    forward: tuple[float, ...],
    backward: tuple[float, ...],
    weight: tuple[float, ...],
    latency: float,
    bandwidth: float,
    message_bytes: float,
) -> tuple[tuple[float, ...], float]:
    """The simulator's timeline of a schedule on these costs, run once (configurations
    that differ only in what the pipeline does not see, ZeRO's stage say, share it): what
    the planner reads of it, each rank's busy seconds and the step's. `weight`: the W
    part of each stage's backward, where the schedule splits it."""
    timeline = simulate(
        _schedule(*schedule),
        Costs(
            forward=list(forward),
            backward=list(backward),
            weight=list(weight),
            latency=latency,
            bandwidth=bandwidth,
            message_bytes=message_bytes,
        ),
    )
    return tuple(timeline.busy), timeline.step_time


def _tied_exchange(x: StepInputs, link: SimulatedLink) -> float:
    """The tied embedding's and head's gradients summed between the pipeline ranks that
    hold them, both ways at once, on pp's `link` (0 where one rank holds both)."""
    config, layers, rank = x.config, x.layers, x.schedule.stage_rank
    if not (
        config.tie_weights
        and x.head_apart
        and rank[_stage_of(layers, 0)] != rank[_stage_of(layers, config.n_layers + 1)]
    ):
        return 0.0
    tied = x.number * math.ceil(config.vocab / x.choice.tp) * config.d_model
    return link.latency_s + tied / link.bandwidth_Bps


def _stage_of(layers: list[list[int]], layer: int) -> int:
    """The stage that holds `layer`."""
    return next(s for s, ls in enumerate(layers) if layer in ls)


# -- data parallelism and the optimizer


def _dp_step(x: StepInputs, compute: float) -> float:
    """Data parallelism's seconds that the step waits for: the gradients' reduction
    (`_dp_seconds`, ZeRO-2's hidden behind the busiest rank's `compute`) over the ranks
    holding the same dense weights (the tied weights, cut apart, a unit of their own),
    and each stage's experts over their own group; each ring's own cost as measured;
    the loss's mean over the replicas (torch's all-reduce); and dp's own work on the
    gradients beside its collectives (`_bookkeeping_on_ranks`)."""
    choice, cluster = x.choice, x.cluster
    apart = x.config.tie_weights and x.schedule.stages > 1
    dense = [mem["params"] - e for mem, e in zip(x.memory, x.experts_on)]
    dp_s = _reduced(x, x.dense_group, dense, apart, compute)
    if choice.ep > 1 and x.expert_group.dp > 1:  # each stage's experts over their own group
        dp_s += _reduced(x, x.expert_group, x.experts_on, False, compute)
    if x.dense_group.dp > 1:
        dp_s += cluster.collective_s.get(x.dense_group.dp, 0.0)
    return dp_s + _replicated(x, apart) + max(_bookkeeping_on_ranks(x)) * x.at_once


def _replicated(x: StepInputs, tied: bool) -> float:
    """HSDP: each slice summed across dp's ranks once a step, after the schedule
    (`ShardedStages.sum_replicas`): a ring all-reduce of a rank's slices (its dense
    weights' bytes over the shard's ranks, its experts' over theirs) over dp's ranks, on
    the slow link where the data-parallel ranks span nodes, each unit's ring its own cost
    as measured. 0 without HSDP."""
    choice, cluster, roles = x.choice, x.cluster, x.choice.roles
    replicas = roles.size("replicate")
    if replicas == 1 or not choice.zero:
        return 0.0
    shard, experts = roles.size("shard"), roles.size("expert_shard")
    slices = max(
        mem["params"]
        if choice.zero >= 3  # ZeRO-3 holds the slices alone
        else (mem["params"] - e) / shard + e / experts
        for mem, e in zip(x.memory, x.experts_on)
    )
    # the replicas' ring spans nodes where the dense group (shards and replicas) does
    link = _group_link(cluster, dataclasses.replace(x.dense_group, dp=roles.size("dense")), "dp")
    units = x.schedule.stages // choice.pp + tied + (choice.ep > 1)
    ring = CostModel(link.latency_s, link.bandwidth_Bps).all_reduce_s(
        "ring",
        slices,  # bytes need not be whole; the formula takes any
        replicas,
    )
    return ring + units * cluster.ring_s.get(replicas, 0.0)


def _reduced(
    x: StepInputs, group: Choice, params: Sequence[float], tied: bool, compute: float
) -> float:
    """`_dp_seconds` over `group`'s dp ranks of each pipeline rank's `params` bytes (the
    link, or each ring as measured)."""
    cluster = x.cluster
    link = _group_link(cluster, group, "dp")
    if group.dp in cluster.ring_s or group.dp in cluster.collective_s:
        link = SimulatedLink(0.0, link.bandwidth_Bps)
    return _dp_seconds(
        group,
        [{"params": p} for p in params],
        link,
        compute,
        x.schedule.stages // x.choice.pp,
        tied,
        cluster.ring_s.get(group.dp, cluster.collective_s.get(group.dp, 0.0)),
    )


def _dp_seconds(
    choice: Choice,
    memory: list[dict[str, float]],
    link: SimulatedLink,
    compute: float,
    stages: int = 1,
    tied: bool = False,
    fixed: float = 0.0,
) -> float:
    """Data parallelism's exposed seconds for the gradients, over a rank's `stages` (and
    the tied weights' unit where `tied`): the bytes over `link` and `fixed` seconds a ring
    of the course's beyond them (`_dp_rings`). The gradients are as many bytes as the
    weights (both fp32, or both 16-bit); a reduce-scatter or an all-gather moves half of
    what the ring all-reduce moves. ZeRO 0-1: one all-reduce (or a reduce-scatter and an
    all-gather of each unit) after the schedule, all of it exposed (the course's 3D step).
    ZeRO-2: a reduce-scatter of a stage's gradients after each microbatch's backward of
    it, one at a time, which the rank's actions after it hide as far as their compute
    goes (the busiest rank's `compute`, less a microbatch's stage before the first); the
    last one has nothing after it, and the tied weights' reduce-scatter and the
    all-gathers of the updated weights come after the schedule: exposed (the course's 3D
    step; the tied weights' bytes are counted with their stages', their own cost apart).
    ZeRO-3 as the course's 3D step runs it (`Hybrid(zero=3)`): before each action of a
    stage (F and B, or F, I and W where backward is split) an all-gather of the stage's
    weights, which the action waits for, after the reduce-scatter still in flight; and a
    reduce-scatter per microbatch's backward: all of it exposed."""
    if choice.dp == 1:
        return 0.0
    weights = max(mem["params"] for mem in memory) * (choice.dp if choice.zero >= 3 else 1)
    ring = CostModel(link.latency_s, link.bandwidth_Bps).all_reduce_s(
        # bytes need not be whole (ZeRO's shards); the ring's formula takes any number
        "ring",
        weights,  # fractional bytes: see above
        choice.dp,
    )
    rings = _dp_rings(choice, stages, tied, exposed=True) * fixed
    if choice.zero < 2:
        return ring + rings
    if choice.zero == 2:
        after = choice.microbatches * stages - 1  # the reduce-scatters with actions after
        scatter = ring / 2 / stages + fixed / 2  # a stage's
        spill = max(0.0, after * scatter - compute * after / (after + 1))  # not hidden
        return ring / 2 + ring / 2 / stages + rings + spill
    kinds = 3 if choice.schedule_value().splits_backward else 2  # actions a microbatch
    return choice.microbatches * (kinds + 1) * ring / 2 + rings


def _dp_rings(choice: Choice, stages: int, tied: bool = False, exposed: bool = False) -> float:
    """How many of the course's rings data parallelism runs in a step over a rank's
    units, its `stages` and the tied weights where it holds them (`tied`): an all-reduce
    of each under ZeRO 0 (a stage's bucket, for models that fit one); under ZeRO-1 a
    reduce-scatter and an all-gather of each unit, half a ring each; under ZeRO-2 also a
    reduce-scatter of each stage per microbatch (the tied weights' once). `exposed`:
    under ZeRO-2 only those a step waits for after the schedule, the last stage's last
    reduce-scatter, the tied weights' and the all-gathers (the others go on while the
    rank's next actions run: `_dp_seconds`). Under ZeRO-3 an all-gather of a stage's units
    before each of its actions and a reduce-scatter after each microbatch's backward."""
    m, units = choice.microbatches, stages + tied
    if choice.zero == 2:
        return (units + 1 + tied) / 2 if exposed else stages * (m + 1) / 2 + tied
    if choice.zero == 3:
        kinds = 3 if choice.schedule_value().splits_backward else 2
        return (m * kinds * units + m * stages + tied) / 2
    return float(units)  # ZeRO 0: an all-reduce of each stage's bucket (lesson 02's) and
    #                     the tied weights'; ZeRO-1: a reduce-scatter and an all-gather each


def _bookkeeping_on_ranks(x: StepInputs) -> list[float]:
    """Data parallelism's own work on each pipeline rank's gradients beside its
    collectives, per tensor (`Overheads`): lesson 02's buckets, or ZeRO 1-2's step beyond
    Adam's (ZeRO-3's per action is not counted)."""
    ov = x.cluster.overheads
    per_tensor = (
        ov.zero_tensor_s
        if x.choice.zero in (1, 2)
        else ov.dp_tensor_s
        if x.dense_group.dp > 1 and not x.choice.zero
        else 0.0
    )
    return [x.worse * per_tensor * tensors for tensors in x.tensors_on]


def _optimizer_step(x: StepInputs) -> float:
    """The optimizer's step on the pipeline rank whose step is the longest
    (`_optimizer_on_ranks`), run by `x.at_once` ranks a core."""
    return max(_optimizer_on_ranks(x)) * x.at_once


def _optimizer_on_ranks(x: StepInputs) -> list[float]:
    """Each pipeline rank's optimizer step alone (`Overheads.optimizer_s`) over its
    tensors and its numbers: ZeRO steps each weight's rows here (`zero.stages`), the
    dense weights' over their group, the experts' over theirs."""
    dense, experts = x.dense_group.dp, x.expert_group.dp
    out = []
    for rank, tensors in enumerate(x.tensors_on):
        numbers = x.memory[rank]["params"] / x.number * (dense if x.choice.zero >= 3 else 1)
        if x.choice.zero:
            held = x.experts_on[rank] / x.number
            numbers = (numbers - held) / dense + held / experts
        out.append(x.worse * x.cluster.overheads.optimizer_s(tensors, numbers))
    return out


def _layer_tensors(config: GPTConfig, layer: int, head_apart: bool) -> int:
    """Parameter tensors of one layer of the course's GPT: the two embeddings; a block's
    two LayerNorms and four Linears, each a weight and a bias; the final LayerNorm and
    the head, whose weight is the token embedding's when tied, unless the head sits on
    another stage (`head_apart`), which then holds a copy."""
    if layer == 0:
        return 2
    if layer <= config.n_layers:  # with experts: the router and four stacked tensors
        return 13 if config.experts else 12
    return 2 + (0 if config.tie_weights and not head_apart else 1)


# -- the shared cores' correction


def _waiting_for_cores(
    x: StepInputs, work: OnStages, tp: TPOnStages, cp: OnStages, ep: OnStages, step: float
) -> float:
    """On shared cores, what a step of `step` seconds waits for a core: it cannot beat
    its ranks' processor time over the cores: each rank's layers (its messages' share
    with them, `cp`'s and `ep`'s own too), its collectives' (gloo's threads too: tp's per
    microbatch; dp's rings, a stage's or the tied weights' each under ZeRO, and the
    loss's mean on the last stage) and its optimizer. Where that is longer, the ranks
    wait for a core. A collective's processor time is measured (`measure_links`,
    `measure_waits`) or counts none (`Cluster.collective_cpu`). 0 with a GPU each."""
    if not x.shared:
        return 0.0
    cluster, choice, m = x.cluster, x.choice, x.choice.microbatches
    dense, experts = x.dense_group, x.expert_group
    last = x.schedule.stage_rank[-1]  # the ranks holding the tied embedding and head
    apart = x.config.tie_weights and x.schedule.stages > 1
    tied_on = {x.schedule.stage_rank[0], last} if apart else set()
    optimizers, keeping = _optimizer_on_ranks(x), _bookkeeping_on_ranks(x)
    cpu = 0.0
    for rank, mine in enumerate(x.on_rank):
        tp_cpu = sum(
            (1 if kind == "step" else m) * n * cluster.collective_cpu(op, choice.tp)
            for s in mine
            for kind, by in tp.counted[s].items()
            if kind != "W"
            for op, (n, _) in by.items()
        )
        cpu += (
            m
            * sum(
                work.forward[s]
                + work.backward[s]
                + (cp.messages[s] + ep.messages[s]) * cluster.message_cpu_s
                for s in mine
            )
            + optimizers[rank]
            + keeping[rank]
            + tp_cpu
        )
        if dense.dp > 1:
            cpu += _dp_rings(dense, len(mine), rank in tied_on) * cluster.ring_cpu_s.get(
                dense.dp, 0.0
            ) + (rank == last) * cluster.collective_cpu_s.get(dense.dp, 0.0)
        if choice.ep > 1 and experts.dp > 1:
            cpu += _dp_rings(experts, len(mine)) * cluster.ring_cpu_s.get(experts.dp, 0.0)
    return max(0.0, cpu * dense.dp * choice.tp / x.cores - step)


__all__ = [
    "model_flops_per_token",
    "predict_memory",
    "predict_time",
    "stage_compute",
    "stage_layers",
]
