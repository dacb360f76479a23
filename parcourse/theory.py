"""Every formula that a lesson's chart, an exercise check or a benchmark compares a
measurement with, in one place. Pure arithmetic: no processes, nothing sent.

One file on purpose, about 860 lines: it is not read front to back but looked up, by
the section headers below (collectives, ZeRO, checkpointing, tensor parallelism and
the mesh, pipelines with what a layer computes and moves, long context and experts),
and keeping every formula together is what lets a learner see that each chart's dashed
line is arithmetic and nothing else.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch

from parcourse.comm import chunk_bounds, ring_steps

if TYPE_CHECKING:
    from parcourse.models import GPTConfig


# ------------------------------------------------------------------------ collectives (lesson 01)


def bytes_sent_per_rank(
    algo: Literal["ring", "naive"],
    nbytes: int,
    world_size: int,
    rank: int = 0,
    root: int = 0,
    itemsize: int | None = None,
) -> float:
    """Theory: bytes one rank sends in one all-reduce of `nbytes`.

    ring: 2(N-1)/N x S on every rank; naive: (N-1) x S at the root, S elsewhere.
    The ring cuts chunks between elements; given their `itemsize`, the count is
    exact also when N does not divide the elements (chunks then differ by one,
    and each rank sends the chunks `ring_steps` names: a few elements more or
    less than 2(N-1)/N x S).
    """
    n = world_size
    if n == 1:
        return 0.0
    if algo == "naive":
        return (n - 1) * nbytes if rank == root else float(nbytes)
    if itemsize is None or (nbytes // itemsize) % n == 0:
        return 2 * (n - 1) / n * nbytes
    bounds = chunk_bounds(nbytes // itemsize, n)
    sent = [c for _, c, _ in ring_steps(rank, n, ("reduce-scatter", "all-gather"))]
    return float(sum(bounds[c][1] - bounds[c][0] for c in sent) * itemsize)


@dataclass(frozen=True)
class CostModel:
    """The alpha-beta model: a message of b bytes arrives alpha + b / beta seconds
    after it starts to leave; messages sent together pay alpha once (as on a
    `SimulatedLink`)."""

    alpha_s: float
    beta_Bps: float

    def all_reduce_s(self, algo: Literal["ring", "naive"], nbytes: int, world_size: int) -> float:
        """Predicted time of one all-reduce of `nbytes` over `world_size` ranks.

        ring: 2(N-1) steps, one after another, each alpha + (S/N) / beta:
        2(N-1) alpha + 2(N-1)/N x S / beta.
        naive: the N-1 tensors reach the root together and queue on its incoming
        link, then the N-1 results queue on its outgoing link:
        2 alpha + 2(N-1) x S / beta.
        """
        latencies, nbytes_in_turn = _shape(algo, nbytes, world_size)
        return latencies * self.alpha_s + nbytes_in_turn / self.beta_Bps


def _shape(algo: str, nbytes: float, n: int) -> tuple[int, float]:
    """(latencies paid one after another, bytes through one link one after another)."""
    if algo not in ("ring", "naive"):
        raise ValueError(f"unknown algorithm {algo!r}; choose 'ring' or 'naive'")
    if n == 1:
        return 0, 0.0
    if algo == "ring":
        return 2 * (n - 1), 2 * (n - 1) * nbytes / n
    return 2, 2 * (n - 1) * float(nbytes)


def fit_cost_model(
    algo: Literal["ring", "naive"], world_size: int, sizes: Sequence[int], seconds: Sequence[float]
) -> CostModel:
    """Fit alpha and beta of `CostModel.all_reduce_s` to measured times by least squares.

    t = latencies x alpha + bytes x (1/beta) is linear in (alpha, 1/beta). Needs
    at least two ranks and two distinct sizes; both are kept >= 0.
    """
    if len(sizes) != len(seconds) or len(set(sizes)) < 2:
        raise ValueError("need times for at least two distinct sizes")
    if world_size < 2:
        raise ValueError("one rank sends nothing: there is no alpha or beta to fit")
    rows = [_shape(algo, s, world_size) for s in sizes]
    a = torch.tensor(rows, dtype=torch.float64)
    t = torch.tensor(list(seconds), dtype=torch.float64).unsqueeze(1)
    # Weight by 1/t so small messages (latency-bound) count as much as large ones.
    w = 1 / t
    alpha, inv_beta = torch.linalg.lstsq(a * w, t * w).solution.flatten().tolist()
    alpha, inv_beta = max(alpha, 0.0), max(inv_beta, 1e-15)
    return CostModel(alpha, 1 / inv_beta)


def bus_bandwidth(nbytes: int, seconds: float, world_size: int) -> tuple[float, float]:
    """(algorithm bandwidth, bus bandwidth) in bytes/s, as nccl-tests define them.

    algbw = S / t. busbw = algbw x 2(N-1)/N: what each link carried, comparable
    across world sizes and with the link's own bandwidth.
    """
    algbw = nbytes / seconds
    return algbw, algbw * 2 * (world_size - 1) / world_size


# --------------------------------------------------------------------------- ZeRO (lessons 03-04)


def adam_bytes_per_param(param_dtype: torch.dtype = torch.float32) -> dict[str, int]:
    """Theory: bytes per parameter for weights, gradients and Adam state.

    fp32 training: 4 + 4 + 8 (two fp32 moments) = 16. Mixed precision keeps
    16-bit weights and gradients plus fp32 master weights, momentum and
    variance: 2 + 2 + 12 = 16 as well (ZeRO paper, sec. 3.1: K = 12).
    """
    size = torch.empty((), dtype=param_dtype).element_size()
    if param_dtype == torch.float32:
        return {"params": 4, "grads": 4, "optimizer": 8}
    return {"params": size, "grads": size, "optimizer": 12}


def zero_bytes(
    num_params: float,
    world_size: int,
    stage: int,
    param_dtype: torch.dtype = torch.float32,
    grad_shard_dtype: torch.dtype = torch.float32,
) -> dict[str, float]:
    """Theory: bytes per rank for parameters, gradients and Adam state under ZeRO.

    stage 0 is plain data parallelism (everything replicated); stage 1 divides
    the optimizer state by N, stage 2 also the gradients, stage 3 also the
    parameters (ZeRO paper, Figure 1). Stages 0 and 1 hold the full gradient
    while backward builds it (`zero_checked_at` says when each figure holds).

    With mixed precision the course's gradient shards of stages 2-3 are handed to
    the optimizer in fp32, the dtype of the masters it steps (as FSDP2 does), so they
    cost 4 bytes / N per parameter; the paper keeps them in 16 bits, 2 / N
    (`grad_shard_dtype=torch.bfloat16`, what the planner counts for published runs).
    """
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0, 1, 2 or 3, got {stage}")
    per = adam_bytes_per_param(param_dtype)
    n = world_size
    return {
        "params": num_params * per["params"] / (n if stage >= 3 else 1),
        "grads": num_params * per["grads"]
        if stage < 2
        else num_params * torch.empty((), dtype=grad_shard_dtype).element_size() / n,
        "optimizer": num_params * per["optimizer"] / (n if stage >= 1 else 1),
    }


def offload_bytes(
    num_params: int,
    world_size: int,
    stage: int,
    *,
    offload_params: bool = False,
    nvme: bool = False,
    param_dtype: torch.dtype = torch.bfloat16,
) -> dict[str, dict[str, float]]:
    """Theory: bytes per rank by placement (device, host, disk) and category under
    ZeRO-Offload (arXiv:2101.06840), right after an Adam step (before zero_grad).

    The device keeps the 16-bit weights (all of them at stages 1-2, its 1/N share at
    stage 3, none with `offload_params`); the host keeps the fp32 masters (4/N a
    parameter), the fp32 gradient shards they are stepped with (4/N) and Adam's moments
    (8/N), which ZeRO-Infinity (`nvme`) moves to disk. So the device's 16 bytes a
    parameter (2 + 2 + 12) become 2 + 2 while backward builds the gradients (one
    bucket of them at a time at stages 2-3), and 0 + 2 with the weights offloaded too.
    """
    if stage not in (1, 2, 3):
        raise ValueError(f"stage must be 1, 2 or 3, got {stage}")
    if offload_params and stage != 3:
        raise ValueError("offload_params is stage 3's")
    n = world_size
    half = torch.empty((), dtype=param_dtype).element_size()
    device = {
        "params": 0.0 if offload_params else num_params * half / (n if stage == 3 else 1),
        "grads": 0.0,
        "optimizer": 0.0,
    }
    host = {
        "params": num_params * half / n if offload_params else 0.0,
        "grads": num_params * 4 / n,
        "optimizer": num_params * (4 if nvme else 12) / n,
    }
    disk = {"optimizer": num_params * 8 / n if nvme else 0.0}
    return {"device": device, "host": host, "disk": disk}


def zero_pp_bytes_across(
    units: list[tuple[int, int]],
    world_size: int,
    ranks_per_node: int,
    *,
    quantized_weights: bool = False,
    hpz: bool = False,
    quantized_gradients: bool = False,
    block: int = 256,
    dtype_bytes: int = 4,
) -> dict[str, int]:
    """Theory: bytes that cross nodes in one ZeRO-3 step, summed over ranks, for units
    given as (part_numel, parameters) (each rank's part of a unit's buffer, and how many
    parameters it holds: their used-flags travel with the gradients).

    A ring over N ranks in nodes of k consecutive ranks crosses nodes on N/k of its N
    hops, and each rank sends N-1 parts: an all-gather or reduce-scatter of parts of b
    bytes sends (N/k)(N-1)b across. ZeRO++ (arXiv:2306.10209): qwZ sends int8 and a
    scale per `block`; hpZ's backward gather stays inside the node; qgZ's second
    all-to-all, the only one across nodes, sends each rank's N/k - 1 parts once.
    """
    n, k = world_size, ranks_per_node
    if n % k:
        raise ValueError(f"ranks_per_node ({k}) must divide the world size ({n})")
    hops = (n // k) * (n - 1)

    def int8(numel: int) -> int:
        blocks = -(-numel // block)
        return blocks * block + 4 * blocks

    forward = sum(hops * (int8(p) if quantized_weights else p * dtype_bytes) for p, _ in units)
    backward = 0 if hpz and k < n else forward
    if quantized_gradients:
        grads = sum(n * (n // k - 1) * (int8(p) + 4 * f) for p, f in units)
    else:
        grads = sum(hops * (p + f) * dtype_bytes for p, f in units)
    return {
        "forward": forward,
        "backward": backward,
        "gradients": grads,
        "total": forward + backward + grads,
    }


def zero_checked_at(stage: int) -> dict[str, str]:
    """The memory sample (of `experiments` runs) at which each `zero_bytes` figure holds:
    after the optimizer step, except the full gradient of stages 0-1, which exists at
    the peak of backward (stage 1 reduce-scatters it when backward ends, keeping 1/N)."""
    grads = "peak in backward" if stage < 2 else "after step"
    return {"params": "after step", "grads": grads, "optimizer": "after step"}


def zero_communication_bytes(stage: int, nbytes: float, world_size: int) -> float:
    """Theory: bytes each rank sends per step for S = nbytes of parameters (= of gradients).

    A ring all-reduce sends 2(N-1)/N S (lesson 01); reduce-scatter and all-gather
    half of that each. DDP (stage 0): one all-reduce. Stages 1 and 2:
    reduce-scatter the gradients, all-gather the updated parameters: DDP's
    volume, since an all-reduce is exactly those two. Stage 3: all-gather in
    forward, again in backward, reduce-scatter: 1.5x DDP (ZeRO paper, sec. 7).
    """
    half = (world_size - 1) / world_size * nbytes
    return {0: 2 * half, 1: 2 * half, 2: 2 * half, 3: 3 * half}[stage]


# --------------------------------------------------------------------------- checkpointing (08)


def checkpoint_segments(n_layers: int, policy: str, segments: int | None = None) -> int:
    """Segments a chain of n layers is cut into: "sqrt" ceil(sqrt n) (or `segments`),
    "every" n, "none" and "nothing" 1 (not checkpointed in segments)."""
    if policy == "sqrt":
        return segments or max(1, math.ceil(math.sqrt(n_layers)))
    return n_layers if policy == "every" else 1


def checkpoint_peak_activations(n_layers: int, policy: str, segments: int | None = None) -> int:
    """Theory: the most layer outputs alive at once for a chain of n equal layers, each
    saving one tensor the size of its output (the next layer's input shares it),
    counting the chain's input.

    none: the input and all n outputs, n + 1. Checkpointed in k segments of L = n/k
    layers: the k segment inputs, plus one segment's L outputs while it is recomputed,
    k + L (2 sqrt n for k = sqrt n: Chen et al., arXiv:1604.06174). nothing: the input,
    then one layer at a time recomputed with its rebuilt input, 1 + 2.
    """
    if policy == "none":
        return n_layers + 1
    if policy == "nothing":
        return 3
    k = checkpoint_segments(n_layers, policy, segments)
    return k + math.ceil(n_layers / k)


def checkpoint_extra_forwards(n_layers: int, policy: str) -> int:
    """Theory: layer forwards that backward recomputes. none: 0; in segments: every layer
    once, n (one extra forward); nothing: layer i's input from the start, n(n-1)/2."""
    if policy == "none":
        return 0
    if policy == "nothing":
        return n_layers * (n_layers - 1) // 2
    return n_layers


# --------------------------------------------------------------------------- TP (lesson 05)
#
# For the GPT of parcourse.models split by parcourse.tensor_parallel.GPT_PLAN over N
# ranks (fp32). `config` is a parcourse.models.GPTConfig.

TPCollective = tuple[str, str, str, int]  # (op, phase, where, bytes of the whole tensor)


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
    tp, pp, ep = shape.get("tp", 1), shape.get("pp", 1), shape.get("ep", 1)
    dp = shape.get("dp", 1) * shape.get("cp", 1)  # the ranks that share the experts
    held = tp_parameter_bytes(config, tp, ep)
    experts = held["experts"] / pp
    dense = held["total"] - held["experts"]
    if pp > 1 and config.tie_weights:
        dense += 4 * math.ceil(config.vocab / tp) * config.d_model  # the head's own copy
    dense /= pp
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"zero must be 0, 1, 2 or 3, got {zero}")
    params = dense + experts
    shard = dense / (dp * ep) + experts / dp  # this rank's rows, under ZeRO
    optimizer = 2 * (shard if zero else params)
    grads = params if zero < 2 else params / stages_per_rank + shard
    return {"params": shard if zero == 3 else params, "grads": grads, "optimizer": optimizer}


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
    per_block = {
        "layer norms, dropout masks": 2 * layer_norm + (2 * stream if drop else 0),
        "inputs of qkv and mlp.up (whole)": 2 * 4 * b * t * c,
        "split over ranks": 4 * b * t * (c // n) * (3 + 1 + 4 + 4)  # q, k, v; proj; up, down
        + (
            4 * b * heads * t * (c // config.n_heads + 1)
            if ring  # the ring's output, lse
            else 4 * b * heads * t * t * (1 + (1 + 1 / 4 if drop else 0))
        ),  # softmax; dropout
    }
    per_block["split over ranks"] = int(per_block["split over ranks"])
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


def gpt_layer_bytes(
    config: GPTConfig,
    layer: int,
    tp: int = 1,
    *,
    batch: int = 1,
    sequence_parallel: bool = False,
    pipelined: bool = False,
    seq: int | None = None,
    ring: bool = False,
    ep: int = 1,
) -> dict[str, int]:
    """Theory, layer by layer: fp32 bytes of one layer of the course's GPT on a rank of a
    tp group, as the pipeline cuts it (`gpt_layers`: layer 0 the embeddings, 1..L the
    blocks, L + 1 ln_f, the head and the loss): its parameters, and what autograd keeps
    for backward for one microbatch of `batch` sequences (`tp_activation_bytes`' count,
    layer by layer, plus the loss's own).

    The loss keeps the softmax (or log-softmax) of this rank's logits, the targets
    (int64) and, vocabulary-parallel (tp > 1), the target masks and the count the mean
    divides by. `pipelined`: the head is on another stage than the embedding, so a tied
    head holds its own copy of the weight (Megatron-LM's embedding group). "loss": the
    part of "activations" the loss keeps (0 but on the last layer), which a stage
    recomputed in backward still holds: the loss runs after the checkpointed stage.
    `seq`: the tokens a rank holds of each sequence (the block size by default; fewer
    when context parallelism cuts it), `ring`: its attention the ring's
    (`tp_activation_bytes`). With experts (`config.experts`), a block's MLP is a mixture
    of experts, whole on every tp rank: its router and experts / `ep` experts, and what
    it keeps routed evenly (`moe_activation_bytes`) in place of the MLP's GeLU input and
    output."""
    if not 0 <= layer <= config.n_layers + 1:
        raise ValueError(f"layer {layer} is not one of the GPT's {config.n_layers + 2}")
    c, n, t, b = config.d_model, tp, config.block_size if seq is None else seq, batch
    vocab_rows = math.ceil(config.vocab / n) * c
    per_block_params = ((3 * c * c + 3 * c) + c * c + (4 * c * c + 4 * c) + 4 * c * c) // n + (
        2 * 2 * c + c + c
    )  # split; LayerNorms and the row-parallel layers' biases
    acts = tp_activation_bytes(
        dataclasses.replace(config, n_layers=1), b, t, n, sequence_parallel, ring
    )
    block_acts = acts["total"] - acts["embeddings, ln_f, head"]
    if config.experts:  # attention split, the norms and proj's bias, router, experts
        per_block_params = (
            (3 * c * c + 3 * c + c * c) // n
            + 2 * 2 * c
            + c
            + c * config.experts
            + expert_bytes(config, ep, 1)["params"] // config.n_layers
        )
        block_acts += moe_activation_bytes(config, b * t, ep) - 4 * b * t * (c // n) * 8
    cut = n if sequence_parallel else 1
    stream = b * (t // cut) * c
    drop = config.dropout > 0
    layer_norm = 4 * stream + 2 * 4 * b * (t // cut)
    tokens = b * t
    loss = 0
    if layer == 0:
        params = vocab_rows + config.block_size * c  # the position embedding: every position
        held = tokens * (8 + 1) + 8 * t + (stream if drop else 0)
    elif layer <= config.n_layers:
        params, held = per_block_params, block_acts
    else:
        head = vocab_rows if (not config.tie_weights or pipelined) else 0
        params = 2 * c + head
        loss = 4 * tokens * math.ceil(config.vocab / n) + 8 * tokens
        loss += 2 * tokens + 8 if n > 1 else 4  # masks and the count; nll's total weight
        held = layer_norm + 4 * tokens * c + loss
    return {"params": 4 * params, "activations": held, "loss": loss}


def korthikanti_layer_bytes(
    config: GPTConfig,
    layer: int,
    tp: int = 1,
    *,
    batch: int = 1,
    sequence_parallel: bool = False,
    pipelined: bool = False,
    selective: bool = False,
) -> dict[str, float]:
    """Theory for 16-bit training, layer by layer as `gpt_layer_bytes` (whose "params",
    fp32 bytes of the layer's numbers, it shares): the activations one microbatch keeps,
    from Korthikanti et al. 2022 (arXiv:2205.05198, Table 2) with s the sequence, b the
    microbatch, h the width, a the heads, t the tensor-parallel size. A block keeps
    sbh(10 + 24/t + 5as/(ht)) bytes, sbh(34/t + 5as/(ht)) under sequence parallelism (the
    paper's 34sbh + 5as^2b without parallelism, 10sbh of it not split by tp); the
    embeddings their dropout mask (sbh, / t under sequence parallelism) when dropout is
    on; the last layer ln_f's input and the head's (4sbh, / t under sequence parallelism)
    and the loss's fp32 logits (4sbv / t, sec. 4.3). `selective`: attention's core is
    recomputed in backward, so its 5as^2b term is not kept (sec. 5). "loss": the logits'
    part, as in `gpt_layer_bytes`."""
    s, b, h, a, t = config.block_size, batch, config.d_model, config.n_heads, tp
    params = gpt_layer_bytes(config, layer, tp, pipelined=pipelined)["params"]
    cut = t if sequence_parallel else 1
    loss = 0.0
    if layer == 0:
        held = s * b * h / cut if config.dropout > 0 else 0.0
    elif layer <= config.n_layers:
        attention = 0.0 if selective else 5 * a * s * s * b / t
        held = (34 * s * b * h / t if sequence_parallel else s * b * h * (10 + 24 / t)) + attention
    else:
        loss = 4 * s * b * config.vocab / t
        held = 4 * s * b * h / cut + loss
    return {"params": params, "activations": held, "loss": loss}


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


# --------------------------------------------------------------------------- pipelines (06-07)


def gpipe_bubble(stages: int, microbatches: int) -> float:
    """Idle fraction of a GPipe or 1F1B step with equal stages and free messages:
    (p - 1) / (m + p - 1) (Huang et al., arXiv:1811.06965). Each rank works m (F + B)
    of the (m + p - 1)(F + B) the step lasts."""
    return (stages - 1) / (microbatches + stages - 1)


def gpipe_peak_in_flight(stages: int, microbatches: int, stage: int) -> int:
    """Microbatches whose activations `stage` holds at once under GPipe: all m."""
    return microbatches


def one_f_one_b_peak_in_flight(stages: int, microbatches: int, stage: int) -> int:
    """Under 1F1B: the warm-up's p - s - 1 forwards plus one, at most m: min(p - s, m)."""
    return min(stages - stage, microbatches)


def interleaved_bubble(ranks: int, chunks: int, microbatches: int) -> float:
    """Interleaved 1F1B with equal chunks and free messages (Narayanan et al., SC 2021):
    the bubble's time shrinks by the number of chunks per rank, (p - 1)(F + B) / v,
    while the work stays m (F + B): (p - 1) / (v m + p - 1)."""
    return (ranks - 1) / (chunks * microbatches + ranks - 1)


def interleaved_peak_in_flight(ranks: int, chunks: int, microbatches: int, rank: int) -> int:
    """Chunk-microbatches rank r holds at once under interleaved 1F1B: its warm-up,
    (v - 1) rounds of min(p, m) plus 2 (p - 1 - r) (1F1B's p - 1 - r when v = 1), plus
    one, at most v m. Each is a
    v-th of a stage, so rank 0 holds about p (1 + (p - 1) / (p v)) stages' worth (for
    m >= p): more than 1F1B's p."""
    per_round = min(ranks, microbatches)
    warmup = (chunks - 1) * per_round + (2 if chunks > 1 else 1) * (ranks - 1 - rank)
    return min(warmup + 1, chunks * microbatches)


def zero_bubble_h1_bubble_time(
    stages: int, forward: float, backward: float, weight: float
) -> float:
    """Idle time of each rank under ZB-H1 (Qi et al., arXiv:2401.10241, with B the whole
    backward, I + W): (p - 1)(F + B - 2W), against 1F1B's (p - 1)(F + B). Valid while
    W <= F and the Ws held back fit in the bubble at the end."""
    return (stages - 1) * (forward + backward - 2 * weight)


def one_f_one_b_bubble_time(stages: int, forward: float, backward: float) -> float:
    """Idle time of each rank under GPipe and 1F1B: (p - 1)(F + B)."""
    return (stages - 1) * (forward + backward)


def bubble_fraction(
    bubble_time: float, microbatches: int, forward: float, backward: float
) -> float:
    """Idle fraction from the idle time per rank: bubble / (bubble + m (F + B))."""
    return bubble_time / (bubble_time + microbatches * (forward + backward))


def zero_bubble_h1_peak_in_flight(stages: int, microbatches: int) -> int:
    """ZB-H1 holds min(p, m) microbatches on every stage (a microbatch is held until its
    W): 1F1B's peak, which 1F1B reaches on stage 0 only."""
    return min(stages, microbatches)


def dualpipe_bubble_time(
    ranks: int, forward_backward: float, backward: float, weight: float
) -> float:
    """DualPipe's bubble as DeepSeek-V3's report gives it (arXiv:2412.19437, table 2):
    (PP/2 - 1)(F&B + B - 3W) of idle time per rank, where F&B is a forward and a
    backward of two microbatches run overlapped on one device, F, B and W those of one
    stage. The course's simulator (`Costs.overlap`, F&B a fraction of F + B) gives the
    busiest rank exactly this idle time when the input-gradient part of backward takes
    what a forward takes (F = B - W, as the zero-bubble papers assume) and F&B >= B
    (tests/test_pipeline_schedules.py); elsewhere its own figure. Run one after the
    other, as this course's runtime runs a pair, see `dualpipe_apart_bubble_time`."""
    return (ranks / 2 - 1) * (forward_backward + backward - 3 * weight)


def dualpipe_apart_bubble_time(ranks: int, forward: float, backward: float, weight: float) -> float:
    """DualPipe's idle time per rank when each pair's forward and backward run one after
    the other (this course's runtime): (PP/2 - 1)(F + B - 2W), half ZB-H1's, for F = B - W.
    Not from the report: it is what the simulator gives on those costs, for every even
    PP tried (tests/test_pipeline_schedules.py), the pairs' own overlap aside."""
    return (ranks / 2 - 1) * (forward + backward - 2 * weight)


def deepseek_table(
    ranks: int, forward: float, backward: float, weight: float, forward_backward: float
) -> dict[str, dict[str, float]]:
    """DeepSeek-V3's report, table 2: for 1F1B, ZB1P (zero-bubble, ZB-H1 here) and
    DualPipe, the bubble (idle time per rank), the parameters a rank holds (x one
    stage's) and the activations (microbatches in flight on a rank, x one stage's)."""
    p = ranks
    return {
        "1F1B": {
            "bubble": one_f_one_b_bubble_time(p, forward, backward),
            "parameters": 1,
            "activations": p,
        },
        "ZB1P": {
            "bubble": zero_bubble_h1_bubble_time(p, forward, backward, weight),
            "parameters": 1,
            "activations": p,
        },
        "DualPipe": {
            "bubble": dualpipe_bubble_time(p, forward_backward, backward, weight),
            "parameters": 2,
            "activations": p + 1,
        },
    }


def dualpipe_v_peak_in_flight(ranks: int) -> int:
    """DualPipeV holds 2p + 1 chunk-microbatches on every rank (m >= 2p): p + 1/2 stages'
    worth, near 1F1B's p on stage 0."""
    return 2 * ranks + 1


# -- what a layer computes and moves (the planner prices them)


def gpt_layer_flops(config: GPTConfig, layer: int, tokens: int) -> float:
    """Theory: forward FLOPs of one layer of the GPT (0 the embeddings, 1..n the blocks,
    n + 1 the head) for `tokens` tokens (2 per multiply-add; attention's
    two matrix products over the whole sequence; with experts, each token's top_k
    experts and the router, `moe_flops`)."""
    c, t = config.d_model, config.block_size
    if layer == 0:
        return 0.0
    if layer <= config.n_layers and config.experts:  # attention, and `moe_flops`
        return tokens * (2 * 4 * c * c + 2 * 2 * t * c) + moe_flops(config, layer, tokens)
    if layer <= config.n_layers:
        return tokens * (2 * 12 * c * c + 2 * 2 * t * c)
    return tokens * 2 * c * config.vocab


def attention_flops(config: GPTConfig, layer: int, tokens: int) -> float:
    """Theory: attention's core (scores and their weighted sum): what selective recompute redoes."""
    return (
        tokens * 2 * 2 * config.block_size * config.d_model
        if 1 <= layer <= config.n_layers
        else 0.0
    )


def gpt_layer_traffic(
    config: GPTConfig, layer: int, tokens: int, tp: int, sequence_parallel: bool, number: int
) -> float:
    """Theory: bytes one layer's memory-bound work reads and writes in its forward, on one
    of `tp` ranks, for `tokens` tokens of `number` bytes a number (a dropout mask: 1 a number),
    counted as Megatron-LM runs it, its elementwise kernels fused: in a block, two layer
    norms (read the stream, write it), two bias + dropout + residual adds (read the
    branch and the stream, write the stream, and the mask), bias + GeLU (read and write
    the MLP's 4h), and attention's scale + mask + softmax (read and write the a x s
    scores a token) and their dropout (read, write, the mask); the embeddings' sum (read
    two, write one) and dropout; the head's final layer norm and its loss over the
    logits, in fp32 as Megatron-LM's default computes it (the logits cast: read, write
    4 bytes; then its vocabulary-parallel cross-entropy, unfused: the max, minus it,
    exp, sum, divide: 8 reads and writes a logit). The tp-cut parts (MLP, heads,
    logits) a `tp`-th, and the stream's too under sequence parallelism. The matrix
    products' own reads are theirs (`achievable`)."""
    h = config.d_model
    mask = 1 if config.dropout > 0 else 0
    stream = 1 / tp if sequence_parallel else 1.0
    if layer == 0:
        return tokens * stream * h * (3 * number + mask * (2 * number + 1))
    if layer <= config.n_layers:
        norms = 2 * 2 * h * number
        adds = 2 * (3 * h * number + mask * h)
        return tokens * (stream * (norms + adds) + 8 * h * number / tp) + attention_traffic(
            config, layer, tokens, tp, number
        )
    return tokens * (stream * 2 * h * number + (number + 4 + 8 * 4) * config.vocab / tp)


def attention_traffic(config: GPTConfig, layer: int, tokens: int, tp: int, number: int) -> float:
    """Of `gpt_layer_traffic`, attention's core (softmax and its dropout, over the a x s
    scores a token): what selective recompute runs again."""
    if not 1 <= layer <= config.n_layers:
        return 0.0
    mask = 1 if config.dropout > 0 else 0
    return tokens * config.n_heads * config.block_size * (2 * number + mask * (2 * number + 1)) / tp


# -- each named schedule's bubble, as `parcourse.pipeline.SCHEDULES` holds it


def gpipe_formula(p: int, m: int, v: int, f: float, b: float, w: float) -> float:
    """GPipe's and 1F1B's bubble fraction as a schedule's formula (`NamedSchedule.bubble`:
    ranks p, microbatches m, chunks v, costs F, B, W)."""
    return gpipe_bubble(p, m)


def zero_bubble_h1_formula(p: int, m: int, v: int, f: float, b: float, w: float) -> float | None:
    """ZB-H1's bubble fraction from its idle time (None with no costs: real compute)."""
    if f + b <= 0:  # real compute: no costs to put in the formula
        return None
    return bubble_fraction(zero_bubble_h1_bubble_time(p, f, b, w), m, f, b)


def dualpipe_formula(p: int, m: int, v: int, f: float, b: float, w: float) -> float | None:
    """The idle fraction with each pair run one after the other, as the course's runtime
    runs them; it holds where F = B - W (dualpipe_apart_bubble_time)."""
    if f + b <= 0 or abs(f - (b - w)) > 1e-9 * (f + b):
        return None
    return bubble_fraction(dualpipe_apart_bubble_time(p, f, b, w), m, f, b)


# ------------------------------------------------------- long context and experts (11)


def ring_attention_bytes(
    lengths: list[int], rank: int, bytes_per_token: int, grad_bytes_per_token: int | None = None
) -> dict[str, int]:
    """Theory: bytes `rank` sends in one step of ring attention (pass-KV, with flash
    attention's backward over the ring), its ring holding `lengths` tokens on each rank, K
    and V together `bytes_per_token` a token (2 x batch x heads x head dim x element size;
    their gradients `grad_bytes_per_token`, in the dtype they are summed in: the same by
    default). Forward: P - 1 messages, the blocks of ranks rank, rank - 1, ...,
    rank - P + 2 passed on (each the one received the step before). Backward: the same
    P - 1 blocks again, and P messages of the gradient of the block held at each step,
    the last one taking each block's gradient home."""
    p = len(lengths)
    grad = bytes_per_token if grad_bytes_per_token is None else grad_bytes_per_token
    passed = sum(lengths[(rank - s) % p] for s in range(p - 1))
    gradients = sum(lengths[(rank - s) % p] for s in range(p)) if p > 1 else 0
    return {
        "forward": passed * bytes_per_token,
        "backward": passed * bytes_per_token + gradients * grad,
        "messages": 2 * (p - 1) + (p if p > 1 else 0),
    }


def all_gather_attention_bytes(lengths: list[int], bytes_per_token: int) -> dict[str, int]:
    """Theory: bytes each rank sends in one step of all-gather attention (Llama 3's), its
    group holding `lengths` tokens on each rank, K and V together `bytes_per_token` a token.
    Forward: K and V each gathered by a ring, every block padded to the longest: P - 1
    messages of it each. Backward: their gradients summed back to their owners, a
    reduce-scatter of the same sizes. The same on every rank, whatever its own share."""
    p = len(lengths)
    moved = (p - 1) * max(lengths) * bytes_per_token
    return {"forward": moved, "backward": moved, "messages": 4 * (p - 1)}


def ulysses_bytes(lengths: list[int], rank: int, bytes_per_token: int) -> dict[str, int]:
    """Theory: bytes `rank` sends in one step of Ulysses attention, its group holding
    `lengths` tokens on each rank; `bytes_per_token`: one of q, k, v or the output, a token
    (batch x heads x head dim x element size). Forward: q, k and v each go from a sequence
    cut to a head cut (this rank's tokens, 1/P of the heads, to each of the P - 1 others),
    then the output back (the others' tokens, this rank's heads); backward the same four
    the other way. Per link 4 N h / P against sequence parallelism's 4 N h (Jacobs et al.)."""
    p = len(lengths)
    mine = (p - 1) * lengths[rank] * bytes_per_token // p  # a sequence cut, sent
    theirs = (sum(lengths) - lengths[rank]) * bytes_per_token // p  # a head cut, sent
    return {"forward": 3 * mine + theirs, "backward": 3 * theirs + mine, "messages": 8 * (p - 1)}


def ring_attention_kept(
    tokens_here: int, batch: int, heads: int, head_dim: int, element_size: int = 4
) -> dict[str, int]:
    """Theory: bytes ring attention keeps for backward on a rank holding `tokens_here`
    tokens, beyond its q, k and v (which the layer before keeps anyway): its output and
    one log-sum-exp per query and head, in the dtype the blocks are summed in
    (`element_size`: 4 for fp32 and 16-bit inputs, 8 for fp64). No scores, no other rank's
    block: flash attention's backward over the ring rebuilds them."""
    rows = batch * heads * tokens_here
    return {
        "output": rows * head_dim * element_size,
        "lse": rows * element_size,
        "total": rows * (head_dim + 1) * element_size,
    }


def moe_all_to_all_bytes(
    tokens: int, top_k: int, d_model: int, ep: int, experts: int, element_size: int = 4
) -> dict[str, int]:
    """Theory: bytes one rank sends in one MoE layer's step under expert parallelism, its
    `tokens` routed evenly (each expert chosen by tokens x top_k / experts of them, none
    dropped). Forward: the counts (experts / ep int64 to each of the ep - 1 others), the
    dispatch (the rows whose expert lives elsewhere: T k (ep - 1) / ep of d_model each) and
    the combine (as many back); backward: the combine's and the dispatch's gradients, the
    same rows again. In all 4 T k h (ep - 1) / ep elements, and the counts."""
    rows = tokens * top_k * (ep - 1) // ep
    counts = 8 * (experts // ep) * (ep - 1)
    moved = rows * d_model * element_size
    return {
        "counts": counts,
        "forward": counts + 2 * moved,
        "backward": 2 * moved,
        "messages": 5 * (ep - 1),
    }  # counts, dispatch, combine; two back


def expert_bytes(
    config: GPTConfig, ep: int, element_size: int = 4, optimizer_per_element: int = 8
) -> dict[str, int]:
    """Theory: bytes of expert weights a rank of an ep group holds, and its Adam state
    (`optimizer_per_element`: 8 for fp32 Adam's two moments), over every block: experts / ep
    MLPs of (C -> 4C -> C) with biases. The routers and dense layers are not counted."""
    c, h = config.d_model, 4 * config.d_model
    per_expert = c * h + h + h * c + c
    elements = config.n_layers * (config.experts // ep) * per_expert
    return {
        "params": elements * element_size,
        "grads": elements * element_size,
        "optimizer": elements * optimizer_per_element,
    }


def moe_rows(config: GPTConfig, tokens: int, ep: int = 1) -> dict[str, int]:
    """Theory: the rows one MoE layer moves on a rank of an ep group whose every rank
    routes `tokens` tokens evenly (each expert chosen by tokens x top_k / experts of them;
    with a capacity factor, at most cap = ceil(factor x tokens x top_k / experts) kept an
    expert from each rank, GShard's limit): "kept", the assignments it sends (A);
    "received", the rows its experts run (R, as many when routing is even); "padded", the
    rows to which the batched experts pad each held expert (M: the busiest's; with a
    capacity factor the most it can take, ep x cap, which uneven routing cannot exceed;
    dropless, the even share, which uneven routing does: routed as it comes, the busiest
    expert takes more)."""
    e, k = config.experts, config.top_k
    if not e or e % ep:
        raise ValueError(f"{e} experts do not cut over ep {ep}")
    per_expert = tokens * k / e  # from each rank, routed evenly
    if config.capacity_factor is None:
        padded = math.ceil(per_expert * ep)
    else:
        cap = math.ceil(config.capacity_factor * tokens * k / e)
        per_expert, padded = min(per_expert, cap), ep * cap
    kept = round(per_expert * e)
    return {"kept": kept, "received": kept, "padded": padded}


def moe_activation_bytes(config: GPTConfig, tokens: int, ep: int = 1) -> int:
    """Theory: fp32 bytes one MoE layer (`parcourse.experts.MoE`, batched, or cut over ep)
    keeps for backward on a rank for its `tokens` tokens, routed evenly (`moe_rows`: A
    kept, R received, M the padded rows an expert), beyond its input (which the block's
    count holds, as a dense MLP's): the router's logits and probabilities (2 N E), its
    choices (N k int64, and N k bools kept), the balancing loss's share (E) and the
    z-loss's log-sum-exp (N); each kept assignment's token and place in its top k (2 A
    int64), its weight (A) and its output, unweighted and weighted (2 A C: the combine's
    sum keeps its input); each received row's place (2 R int64, and under ep 2 R more:
    the order the rows arrived in and back); and the held experts' padded input and
    GeLU's input and output (E / ep x M x (C + 2 H)). Measured equal to the byte where
    every expert fills its capacity (tests/test_planner.py); dropless, routing at
    initialisation pads to 1.2-1.5 times the even count (docs/experts.md)."""
    n, c, e, k = tokens, config.d_model, config.experts, config.top_k
    rows = moe_rows(config, tokens, ep)
    a, r, m = rows["kept"], rows["received"], rows["padded"]
    router = 4 * 2 * n * e + 8 * n * k + n * k + 4 * e + 4 * n
    assignments = 8 * 2 * a + 4 * a + 4 * 2 * a * c
    received = 8 * 2 * r * (2 if ep > 1 else 1)
    return router + assignments + received + 4 * (e // ep) * m * (c + 2 * 4 * c)


def moe_flops(config: GPTConfig, layer: int, tokens: int) -> float:
    """Theory: of `gpt_layer_flops`, a MoE block's router and experts (forward, `tokens`
    tokens each through top_k experts): 2 C E + top_k x 16 C^2 a token; what tensor
    parallelism does not cut (each tp rank runs the experts whole)."""
    if not config.experts or not 1 <= layer <= config.n_layers:
        return 0.0
    c = config.d_model
    return tokens * (2 * c * config.experts + config.top_k * 2 * 8 * c * c)
