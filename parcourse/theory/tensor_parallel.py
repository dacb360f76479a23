"""Lesson 05: the GPT of parcourse.models split by parcourse.tensor_parallel.GPT_PLAN over N
ranks (fp32; `config` is a parcourse.models.GPTConfig). The parameter bytes each rank holds
(`tp_parameter_bytes`) and the activations it keeps for backward (`tp_activation_bytes`);
every collective of a step (`tp_collectives`, cut by pipeline stage in
`tp_stage_collectives`), counted, in bytes sent on a ring and in seconds on a simulated link.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from parcourse.models import GPTConfig


def tp_parameter_bytes(config: GPTConfig, world_size: int, ep: int = 1) -> dict[str, int]:
    """Theory: parameter bytes on each rank, split ("sharded": 1/N each) or whole
    ("replicated": LayerNorms, position embedding, the biases row-parallel layers add
    after their sum).

    The vocabulary is cut in ceil(vocab / N) rows per rank, padded (`vocab_range`);
    a head tied to the embedding adds nothing. A GPT with experts keeps each block's
    router and its `experts / ep` experts whole on every tp rank ("experts": what ep cuts;
    the router is replicated).
    """
    c, n, layers = config.d_model, world_size, config.n_layers
    mlp = (4 * c * c + 4 * c) + 4 * c * c  # up and its bias, down (its bias: replicated)
    per_block = (3 * c * c + 3 * c) + c * c + (0 if config.experts else mlp)
    vocab_rows = math.ceil(config.vocab / n) * c * (1 if config.tie_weights else 2)
    sharded = layers * per_block // n + vocab_rows
    replicated = (
        layers * (2 * 2 * c + c + (0 if config.experts else c)) + config.block_size * c + 2 * c
    )
    experts = 0
    if config.experts:
        replicated += layers * config.experts * c  # the routers
        experts = layers * (config.experts // ep) * (mlp + c)
    return {
        "sharded": 4 * sharded,
        "replicated": 4 * replicated,
        "experts": 4 * experts,
        "total": 4 * (sharded + replicated + experts),
    }


def tp_activation_bytes(
    config: GPTConfig,
    batch: int,
    seq: int,
    world_size: int,
    sequence_parallel: bool = False,
    ring: bool = False,
) -> dict[str, int]:
    """Theory: bytes autograd keeps for backward on each rank, the forward of the split
    GPT to its logits in training mode (the loss not included), by where they are kept.

    Korthikanti et al. (arXiv:2205.05198, sec. 4) count the same tensors for one
    block in 16 bits: 34 s b h bytes + 5 a s^2 b (without parallelism), of which
    tensor parallelism divides all but 10 s b h by N (LayerNorm inputs, the inputs
    of the first Linear of attention and of the MLP, dropout masks). Here (fp32,
    so every tensor counts twice, masks once, and LayerNorm keeps its mean and
    1/std): "replicated" is what stays whole on every rank; sequence parallelism
    cuts it along the sequence, except the two Linear inputs, which are gathered
    whole and kept (Megatron keeps this rank's chunk and gathers it again in
    backward: one more all-gather per layer, which this course does not do).

    `ring`: the sequence is cut over cp ranks (`seq` this rank's tokens) and attention is
    the ring's (`context_parallel`), which keeps its output and one log-sum-exp per query
    instead of the softmax's scores (`ring_attention_kept`).
    """
    b, t, c, n = batch, seq, config.d_model, world_size
    heads = config.n_heads // n
    cut = n if sequence_parallel else 1  # the residual stream's share of the sequence
    drop = config.dropout > 0
    stream = b * (t // cut) * c  # elements of one residual-stream tensor on this rank
    layer_norm = 4 * stream + 2 * 4 * b * (t // cut)  # input, mean and 1/std
    split = 4 * b * t * (c // n) * (3 + 1 + 4 + 4) + (  # q, k, v; proj; up, down
        4 * b * heads * t * (c // config.n_heads + 1)
        if ring  # the ring's output, lse
        else 4 * b * heads * t * t * (1 + (1 + 1 / 4 if drop else 0))
    )  # softmax; dropout
    per_block = {
        "layer norms, dropout masks": 2 * layer_norm + (2 * stream if drop else 0),
        "inputs of qkv and mlp.up (whole)": 2 * 4 * b * t * c,
        "split over ranks": int(split),  # whole: the mask is 1/4 of a 4-byte number
    }
    result = {k: config.n_layers * v for k, v in per_block.items()}
    result["embeddings, ln_f, head"] = (
        b * t * (8 + 1)
        + 8 * t  # vocab-parallel lookup: local ids and mask; positions
        + (stream if drop else 0)
        + layer_norm
        + 4 * b * t * c
    )  # dropout; ln_f; head input
    result["total"] = sum(result.values())
    return result


TPCollective = tuple[str, str, str, int]  # (op, phase, where, bytes of the whole tensor)


def tp_collectives(
    config: GPTConfig,
    batch: int,
    seq: int,
    world_size: int,
    sequence_parallel: bool = False,
    loss: bool = True,
) -> list[TPCollective]:
    """Theory: every collective of one training step of one microbatch on each rank
    without a pipeline (with one, `tp_stage_collectives`), as the tracer records them
    (op, phase, where, bytes of the whole tensor).

    Without sequence parallelism, per block: two all-reduces forward (after attention's
    and the MLP's row-parallel layer: g) and two backward (before their column-parallel
    layer: f); plus the embedding's g and the head's f; and the loss's three all-reduces
    of B x T numbers. With sequence parallelism each all-reduce of the activations
    becomes a reduce-scatter and an all-gather (one forward, one backward), the same
    bytes on a ring, and the replicated parameters' gradients are all-reduced together.
    """
    if world_size == 1:
        return []
    act = 4 * batch * seq * config.d_model  # bytes of a (B, T, C) activation
    column = ["head"] + [
        f"blocks.{i}.{m}" for i in range(config.n_layers) for m in ("attn.qkv", "mlp.up")
    ]
    row = ["tok_emb"] + [
        f"blocks.{i}.{m}" for i in range(config.n_layers) for m in ("attn.proj", "mlp.down")
    ]
    out: list[TPCollective] = []
    if sequence_parallel:
        out += [
            (op, phase, w, act)
            for w in column
            for op, phase in (("all_gather", "forward"), ("reduce_scatter", "backward"))
        ]
        out += [
            (op, phase, w, act)
            for w in row
            for op, phase in (("reduce_scatter", "forward"), ("all_gather", "backward"))
        ]
        # Per block two LayerNorms (weight, bias) and the biases of attn.proj and mlp.down;
        # ln_f; the position embedding: one all-reduce of them all.
        replicated = (6 * config.n_layers + 2 + config.block_size) * config.d_model
        out.append(("all_reduce", "backward", "replicated grads", 4 * replicated))
    else:
        out += [("all_reduce", "backward", w, act) for w in column]
        out += [("all_reduce", "forward", w, act) for w in row]
    if loss:  # the largest logit, the target's logit, the sum of exp: B x T floats each
        out += [("all_reduce", "forward", "cross entropy", 4 * batch * seq)] * 3
    return sorted(out)


def tp_stage_collectives(
    config: GPTConfig,
    stages: list[list[int]],
    batch: int,
    seq: int,
    world_size: int,
    sequence_parallel: bool = False,
    recompute: bool = False,
    megatron: bool = False,
) -> list[dict[str, list[TPCollective]]]:
    """Theory: `tp_collectives` of one microbatch cut by pipeline stage (`stages`: the
    layers each holds, 0 the embeddings, 1..L the blocks, L + 1 the head), and by the
    action that runs them, "F" (forward) and "B" (backward), with "step": those run once a
    step, after the schedule. Each collective goes with its layer, the loss's with the
    head. Two things are not in the whole model's list (which is a step's without a
    pipeline), as the course's 3D step runs them:

    - under sequence parallelism every stage sums the replicated parameters' gradients
      in an all-reduce of its own at the end of each backward (`ReplicatedGradSync`:
      every such parameter of the whole model, zeros for those it does not hold, so the
      whole model's bytes);
    - a stage recomputed in backward (`recompute`, the course's whole-stage checkpoint)
      runs its forward's collectives again there, the loss's excepted (the loss is
      computed outside the checkpoint).

    `megatron`: as Megatron-LM runs them instead. Recompute runs the blocks' forward
    again, not the embeddings' or the head's, and the replicated gradients are summed
    once a step (`finalize_model_grads`), each stage its own: a block's two LayerNorms
    and two row-parallel biases, the position embedding on the first stage, ln_f on the
    last."""
    by_layer: dict[int, dict[str, list[TPCollective]]] = {}
    replicated: list[TPCollective] = []
    for c in tp_collectives(config, batch, seq, world_size, sequence_parallel):
        where = c[2]
        if where == "replicated grads":
            replicated.append(c)
            continue
        layer = (
            0
            if where == "tok_emb"
            else int(where.split(".")[1]) + 1
            if where.startswith("blocks.")
            else config.n_layers + 1
        )  # head, loss
        mine = by_layer.setdefault(layer, {"F": [], "B": []})
        mine["F" if c[1] == "forward" else "B"].append(c)
        again = 1 <= layer <= config.n_layers if megatron else where != "cross entropy"
        if recompute and c[1] == "forward" and again:
            mine["B"].append(c)
    out: list[dict[str, list[TPCollective]]] = []
    for held in stages:
        mine = {
            kind: [c for lay in held for c in by_layer.get(lay, {}).get(kind, [])]
            for kind in ("F", "B")
        }
        mine["step"] = []
        if replicated and not megatron:
            mine["B"] += replicated
        elif replicated:
            numbers = (
                sum(6 if 1 <= lay <= config.n_layers else 0 for lay in held)
                + (config.block_size if 0 in held else 0)
                + (2 if config.n_layers + 1 in held else 0)
            )
            mine["step"] = [
                ("all_reduce", "backward", "replicated grads", 4 * numbers * config.d_model)
            ]
        out.append(mine)
    return out


def tp_collective_counts(collectives: list[TPCollective]) -> dict[tuple[str, str], tuple[int, int]]:
    """(op, phase) -> (how many, bytes of their tensors), as `count_collectives` gives them."""
    result: dict[tuple[str, str], tuple[int, int]] = {}
    for op, phase, _, size in collectives:
        count, total = result.get((op, phase), (0, 0))
        result[(op, phase)] = (count + 1, total + size)
    return dict(sorted(result.items()))


def tp_ring_bytes_sent(collectives: list[TPCollective], world_size: int) -> float:
    """Theory: bytes each rank sends on a ring for these collectives: 2(N-1)/N x S per
    all-reduce, (N-1)/N x S per all-gather or reduce-scatter (lesson 01). Exact when N
    divides every tensor's number of elements."""
    share = (world_size - 1) / world_size
    return sum((2 if op == "all_reduce" else 1) * share * size for op, _, _, size in collectives)


def tp_link_seconds(
    collectives: list[TPCollective], world_size: int, latency_s: float, bandwidth_Bps: float
) -> float:
    """Theory: seconds these collectives spend on a simulated link (alpha = latency_s,
    beta = bandwidth_Bps), run one after another on the ring with one message per
    chunk, each step waiting for the chunk before it: alpha + S / (N beta) per step,
    2(N-1) steps per all-reduce, N-1 per all-gather or reduce-scatter (lesson 01's
    `CostModel`). Tensor parallelism's collectives are on the critical path (the next
    layer needs what they return), so this adds to the step whole."""
    n = world_size
    if n == 1:
        return 0.0
    return sum(
        (2 * (n - 1) if op == "all_reduce" else n - 1) * (latency_s + size / n / bandwidth_Bps)
        for op, _, _, size in collectives
    )
