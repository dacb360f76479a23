"""Lesson 12, the roofline: for each strategy, its step's compute beside its communication
on a machine (`Machine`: FLOP/s, memory bandwidth, a link's latency and bandwidth), and the
threshold below which the communication takes longer: tokens per rank for data
parallelism, ZeRO-3, context parallelism and expert parallelism, d_model for tensor
parallelism. The derivations follow "How to Scale Your Model" (Austin et al., the JAX
scaling book, part 5: "How to Parallelize a Transformer for Training"), counted with the
course's own byte formulas (`collectives.CostModel`, `zero.zero_communication_bytes`,
`context.ring_attention_bytes`, `experts.moe_all_to_all_bytes`) so that a threshold agrees
with what the rest of the course prints.

Each strategy has two functions: `*_seconds` (the two lines of its roofline: compute and
communication seconds of one step, as a dict) and `*_threshold` (where they cross). The
thresholds depend on the machine only through F / W, FLOPs a byte of the link: the ratio
of a machine's two speeds, its "arithmetic intensity" of the network.

    h100 = published_machines()[0]               # H100 over NVLink
    dp_threshold(h100, 8)                        # tokens per rank: about 1.9k in bf16
    tp_threshold(h100, 8)                        # d_model: about 3.4k
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Literal

from parcourse.theory.collectives import CostModel
from parcourse.theory.context import ring_attention_bytes
from parcourse.theory.experts import moe_all_to_all_bytes
from parcourse.theory.zero import zero_communication_bytes

TPBlock = Literal["gpt", "mlp"]
# Forward FLOPs a token of one block, over d_model^2, and the all-reduces of a (tokens,
# d_model) activation one step of it runs under tensor parallelism (Megatron-LM's f and g,
# as `tensor_parallel_collectives` counts them): a GPT block (qkv 3d^2, proj d^2, up and down
# 8d^2: 2 x 12 d^2; g after proj and down, f before qkv and up) or its MLP alone.
TP_BLOCKS: dict[str, tuple[int, int]] = {"gpt": (24, 4), "mlp": (16, 2)}
# The all-to-alls one MoE layer's step runs (counts, dispatch, combine; two back): each
# sends to every peer at once, so it pays the latency once (`SimulatedLink`).
EP_ROUNDS = 5


@dataclass(frozen=True)
class Machine:
    """What one rank computes at (`flops`, FLOP/s), its memory's bandwidth (`memory_Bps`)
    and its link to the others (`latency_s`, `link_Bps`: bytes/s one way, what a ring's
    step sends at). `published_machines()` for H100 and H200 nodes; `bandwidth_only()`
    drops the latency, as the scaling book's thresholds do."""

    name: str
    flops: float
    memory_Bps: float
    latency_s: float
    link_Bps: float

    def __post_init__(self) -> None:
        if not (self.flops > 0 and self.memory_Bps > 0 and self.link_Bps > 0):
            raise ValueError(
                f"{self.name}: flops, memory_Bps and link_Bps must be > 0, got "
                f"{self.flops}, {self.memory_Bps} and {self.link_Bps}"
            )
        if self.latency_s < 0:
            raise ValueError(f"{self.name}: latency_s must be >= 0, got {self.latency_s}")

    @property
    def flops_per_link_byte(self) -> float:
        """F / W: FLOPs a rank computes in the time its link sends one byte."""
        return self.flops / self.link_Bps

    @property
    def flops_per_memory_byte(self) -> float:
        """F / M: FLOPs in the time its memory reads or writes one byte (the classic
        roofline's ridge point: below it, an elementwise kernel waits on memory)."""
        return self.flops / self.memory_Bps

    def bandwidth_only(self) -> Machine:
        """The same machine with a link of no latency."""
        return dataclasses.replace(self, latency_s=0.0)


def published_machines() -> list[Machine]:
    """H100 and H200 (dense bf16 peak, HBM bandwidth), each over NVLink (inside a node)
    and over InfiniBand (between nodes): the figures of the planner's presets
    (`Cluster.PRESETS`), not a second table. The peak, as the scaling book computes with,
    not the fraction a run reaches (`Cluster.achievable`)."""
    from parcourse.planner.inputs import Cluster

    machines = []
    for gpu in ("h100", "h200"):
        cluster = Cluster.preset(gpu, gpus=8)
        assert cluster.memory_bandwidth is not None  # every preset has one
        for over, link in (("NVLink", cluster.inside), ("InfiniBand", cluster.between)):
            machines.append(
                Machine(
                    f"{gpu.upper()} {over}",
                    cluster.peak_flops,
                    cluster.memory_bandwidth,
                    link.latency_s,
                    link.bandwidth_Bps,
                )
            )
    return machines


def _crossing(compute: float, fixed: float, per_unit: float, power: int) -> float:
    """The x > 0 where compute x x^power = fixed + per_unit x x (power 1 or 2): the size at
    which a step's compute (its seconds at x = 1: `compute`) catches up with its
    communication (`fixed` seconds of latency and `per_unit` a unit of x); inf where it
    never does."""
    if power == 1:
        return fixed / (compute - per_unit) if compute > per_unit else math.inf
    # compute x^2 - per_unit x - fixed = 0, its positive root
    return (per_unit + math.sqrt(per_unit**2 + 4 * compute * fixed)) / (2 * compute)


# -- data parallelism and ZeRO-3: tokens per rank


def data_parallel_seconds(
    machine: Machine,
    world_size: int,
    params: float,
    tokens: float,
    *,
    stage: Literal[0, 3] = 0,
    bytes_per_number: int = 2,
    pieces: int = 1,
) -> dict[str, float]:
    """Theory: one step's compute and communication on a rank of a data-parallel group of
    `world_size` (ZeRO `stage` 0: plain data parallelism; 3: weights sharded too) for a
    model of `params` parameters and `tokens` tokens a rank.

    Compute: 6 P B FLOPs (forward 2 P B, backward twice that: the gradients of the
    activations and of the weights), at `machine.flops`. Communication, each rank on a
    ring: the gradients' all-reduce, 2 (N-1)/N x S bytes for S = P x `bytes_per_number`
    (stage 0), or ZeRO-3's all-gather forward, all-gather backward and reduce-scatter,
    3 (N-1)/N x S (`zero_communication_bytes`), at `machine.link_Bps`; each of the
    `pieces` the model is cut into (buckets, units) paying its ring's steps' latency,
    2 (N-1) a piece (`CostModel.all_reduce_s`), 3 (N-1) under ZeRO-3."""
    if stage not in (0, 3):
        raise ValueError(f"stage must be 0 (data parallelism) or 3 (ZeRO-3), got {stage}")
    n = world_size
    nbytes = params * bytes_per_number
    if stage == 0:
        ring = CostModel(machine.latency_s, machine.link_Bps)
        comm = pieces * ring.all_reduce_s("ring", nbytes / pieces, n)
    else:
        steps = pieces * 3 * (n - 1) if n > 1 else 0
        comm = steps * machine.latency_s + zero_communication_bytes(3, nbytes, n) / machine.link_Bps
    return {"compute": 6 * params * tokens / machine.flops, "communication": comm}


def dp_threshold(
    machine: Machine,
    world_size: int,
    *,
    bytes_per_number: int = 2,
    params: float | None = None,
    pieces: int = 1,
) -> float:
    """Theory: tokens per rank below which data parallelism's all-reduce takes longer
    than its compute (`data_parallel_seconds`, stage 0).

    6 P B / F = 2 (N-1)/N x P b / W  gives  B* = (N-1)/N x b/3 x F/W:

    the model's size cancels (compute and bytes both grow with P), and what is left is
    the machine's FLOPs a byte of link. The scaling book's "B / X > C / W" (bf16, its
    count of one all-reduce a weight's gradient). With `params` (and its `pieces`), the
    ring's latencies are counted too: a small model is latency-bound, and its threshold
    grows as it shrinks; without, the bandwidth alone (the book's)."""
    return _dp_like(machine, world_size, 0, bytes_per_number, params, pieces)


def zero3_threshold(
    machine: Machine,
    world_size: int,
    *,
    bytes_per_number: int = 2,
    params: float | None = None,
    pieces: int = 1,
) -> float:
    """Theory: tokens per rank below which ZeRO-3's gathers and reduce-scatter take longer
    than its compute (`data_parallel_seconds`, stage 3).

    6 P B / F = 3 (N-1)/N x P b / W  gives  B* = (N-1)/N x b/2 x F/W:

    1.5 times data parallelism's, its 1.5 times the bytes (ZeRO paper, sec. 7). The
    scaling book counts FSDP at DDP's threshold, keeping the forward's gathered weights
    for backward; the course's ZeRO-3 gathers them again (`parcourse.zero.stage3`).
    `params` and `pieces`: as `dp_threshold`'s, 3 (N-1) latencies a piece."""
    return _dp_like(machine, world_size, 3, bytes_per_number, params, pieces)


def _dp_like(
    machine: Machine,
    world_size: int,
    stage: Literal[0, 3],
    bytes_per_number: int,
    params: float | None,
    pieces: int,
) -> float:
    """Where `data_parallel_seconds`' compute (linear in tokens) meets its communication
    (constant): at one token, their ratio."""
    at = machine if params is not None else machine.bandwidth_only()
    one = data_parallel_seconds(
        at,
        world_size,
        params or 1.0,
        1,
        stage=stage,
        bytes_per_number=bytes_per_number,
        pieces=pieces,
    )
    return one["communication"] / one["compute"]


# -- tensor parallelism: d_model


def tensor_parallel_seconds(
    machine: Machine,
    tp: int,
    d_model: float,
    tokens: float,
    *,
    block: TPBlock = "gpt",
    bytes_per_number: int = 2,
    layers: int = 1,
) -> dict[str, float]:
    """Theory: one step's compute and communication on a rank of a tensor-parallel group of
    `tp` for `layers` blocks of width `d_model` on `tokens` tokens (every rank of the group
    the same tokens).

    Compute: 3 x 24 d^2 FLOPs a token a GPT block (its four matrix products, 2 x 12 d^2
    forward, `gpt_layer_flops` without the attention core's 4 T d, which grows with the
    sequence rather than d^2 and only adds compute), or 3 x 16 d^2 its MLP alone
    (`block="mlp"`), a tp-th on each rank. Communication: Megatron-LM's all-reduces of a
    (tokens, d) activation, 4 a GPT block's step (g after attn.proj and mlp.down forward,
    f before attn.qkv and mlp.up backward: `tp_collectives`), 2 an MLP's, each on a ring
    (`CostModel.all_reduce_s`: 2 (N-1) latencies, 2 (N-1)/N x its bytes). They are on the
    critical path: the next layer needs what they return, so nothing hides them."""
    if block not in TP_BLOCKS:
        raise ValueError(f"unknown block {block!r}; choose one of {', '.join(TP_BLOCKS)}")
    flops_d2, all_reduces = TP_BLOCKS[block]
    ring = CostModel(machine.latency_s, machine.link_Bps)
    activation = tokens * d_model * bytes_per_number
    return {
        "compute": layers * 3 * flops_d2 * d_model**2 * tokens / (tp * machine.flops),
        "communication": layers * all_reduces * ring.all_reduce_s("ring", activation, tp),
    }


def tp_threshold(
    machine: Machine,
    tp: int,
    *,
    bytes_per_number: int = 2,
    tokens: float | None = None,
    block: TPBlock = "gpt",
) -> float:
    """Theory: d_model below which tensor parallelism's all-reduces take longer than the
    compute they split (`tensor_parallel_seconds`).

    A GPT block: 72 d^2 B / (N F) = 4 x 2 (N-1)/N x B d b / W  gives  d* = (N-1) b F / (9 W);
    its MLP alone: 48 d^2 B / (N F) = 2 x 2 (N-1)/N x B d b / W, d* = (N-1) b F / (12 W).

    The tokens cancel, and the group's size does not: each rank's compute shrinks as 1/N
    while its bytes stay, so the wider the group the wider the model must be (the book:
    "F > Y C / W", the MLP's width F against the group's size Y). With `tokens`, the
    ring's latencies are counted too (then d* is the positive root of a quadratic)."""
    at = machine if tokens is not None else machine.bandwidth_only()
    b, count = bytes_per_number, tokens or 1.0
    compute = tensor_parallel_seconds(at, tp, 1, count, block=block, bytes_per_number=b)
    latency = tensor_parallel_seconds(at, tp, 0, count, block=block, bytes_per_number=b)
    fixed = latency["communication"]
    return _crossing(compute["compute"], fixed, compute["communication"] - fixed, 2)


# -- context parallelism (ring attention): tokens per rank


def context_parallel_seconds(
    machine: Machine,
    cp: int,
    d_model: float,
    tokens: float,
    *,
    bytes_per_number: int = 2,
    causal: bool = False,
) -> dict[str, float]:
    """Theory: one step of ring attention's compute and communication on a rank holding
    `tokens` tokens of a sequence cut over `cp` ranks (pass-KV, flash attention's backward
    over the ring).

    Compute: attention's two matrix products for this rank's queries against the whole
    sequence, 2 x 2 x T_r x (N T_r) x d forward (`attention_flops`' count, the whole
    sequence; `causal` halves it), three times that with backward. Communication:
    `ring_attention_bytes`, K and V 2 d b bytes a token: N-1 blocks passed on forward, again
    backward, and N gradients of a block: (3N - 2) x 2 d b x T_r bytes, and its 3N - 2
    messages' latencies. Each block's message hides behind the block before's compute."""
    lengths = [1] * cp  # the bytes grow with the tokens a rank holds: counted for one
    counted = ring_attention_bytes(lengths, 0, 2 * bytes_per_number)
    per_token_d = counted["forward"] + counted["backward"]  # bytes, a token and a unit of d
    flops = 3 * 2 * 2 * tokens * (cp * tokens) * d_model / (2 if causal else 1)
    comm = (
        counted["messages"] * machine.latency_s + per_token_d * tokens * d_model / machine.link_Bps
    )
    return {"compute": flops / machine.flops, "communication": comm if cp > 1 else 0.0}


def cp_threshold(
    machine: Machine,
    cp: int,
    d_model: float,
    *,
    bytes_per_number: int = 2,
    causal: bool = False,
) -> float:
    """Theory: tokens per rank below which ring attention's K/V messages take longer than
    its attention compute (`context_parallel_seconds`).

    12 N T_r^2 d / F = (3N - 2) x 2 d b T_r / W  gives  T_r* = (3N - 2)/N x b F / (6 W),

    b F / (2 W) for a long ring: compute grows with T_r^2 (every query against the whole
    sequence), bytes with T_r, so long sequences hide the ring whatever d_model (which
    cancels but for the latency: with it, the positive root of a quadratic). `causal`
    halves the compute and about doubles the threshold."""
    if cp < 2:
        return 0.0
    b = bytes_per_number
    one = context_parallel_seconds(machine, cp, d_model, 1, bytes_per_number=b, causal=causal)
    none = context_parallel_seconds(machine, cp, d_model, 0, bytes_per_number=b, causal=causal)
    fixed = none["communication"]
    return _crossing(one["compute"], fixed, one["communication"] - fixed, 2)


# -- expert parallelism: tokens per rank


def expert_parallel_seconds(
    machine: Machine,
    ep: int,
    d_model: float,
    tokens: float,
    *,
    top_k: int = 2,
    experts: int = 8,
    bytes_per_number: int = 2,
) -> dict[str, float]:
    """Theory: one MoE layer's step of expert compute and all-to-alls on a rank of an ep
    group routing `tokens` tokens evenly (`moe_rows`: its experts run as many rows as it
    sends, tokens x top_k).

    Compute: each row through an expert MLP (d -> 4d -> d: 2 x 8 d^2 FLOPs forward,
    `moe_flops`' count), three times that with backward: 48 k d^2 T. Communication:
    `moe_all_to_all_bytes`, the rows whose expert lives elsewhere there and back, forward
    and backward, 4 T k d b (N-1)/N bytes, and the counts; five all-to-alls' latency
    (`EP_ROUNDS`)."""
    # bytes at ep x k tokens, where the rows cut evenly: per token, and the counts apart
    sample = moe_all_to_all_bytes(ep, top_k, 1, ep, experts, bytes_per_number)
    counts = sample["counts"]
    per_token_d = (sample["forward"] + sample["backward"] - counts) / ep
    comm = (EP_ROUNDS * machine.latency_s if ep > 1 else 0.0) + (
        counts + per_token_d * tokens * d_model
    ) / machine.link_Bps
    flops = 3 * top_k * 16 * d_model**2 * tokens
    return {"compute": flops / machine.flops, "communication": comm}


def ep_threshold(
    machine: Machine,
    ep: int,
    d_model: float,
    *,
    top_k: int = 2,
    experts: int = 8,
    bytes_per_number: int = 2,
) -> float:
    """Theory: tokens per rank below which expert parallelism's all-to-alls take longer
    than the expert compute they feed (`expert_parallel_seconds`).

    Compute and bytes both grow with the tokens (48 k d^2 T / F against 4 k d b (N-1)/N
    T / W), so in the bandwidth alone the tokens cancel and the rule is in d_model
    (`ep_min_width`); what is left for the tokens is the fixed cost, the all-to-alls'
    latency and the counts:

        T* = (5 alpha + counts / W) / (48 k d^2 / F - 4 k d b (N-1)/N / W),

    inf where d_model is at or below `ep_min_width` (communication-bound at any count)."""
    if ep < 2:
        return 0.0
    one, none = (
        expert_parallel_seconds(
            machine,
            ep,
            d_model,
            tokens,
            top_k=top_k,
            experts=experts,
            bytes_per_number=bytes_per_number,
        )
        for tokens in (1, 0)
    )
    fixed = none["communication"]
    return _crossing(one["compute"], fixed, one["communication"] - fixed, 1)


def ep_min_width(machine: Machine, ep: int, *, bytes_per_number: int = 2) -> float:
    """Theory: the d_model at or below which expert parallelism is communication-bound at
    any number of tokens: 48 k d^2 / F = 4 k d b (N-1)/N / W, d = (N-1)/N x b F / (12 W)
    (top_k cancels)."""
    return (ep - 1) / ep * bytes_per_number * machine.flops_per_link_byte / 12


# -- the table


@dataclass(frozen=True)
class Threshold:
    """One strategy's threshold on a machine: below `value` (in `unit`), its
    communication takes longer than its compute; `rule` is the formula."""

    strategy: str
    value: float
    unit: Literal["tokens per rank", "d_model"]
    rule: str


STRATEGIES: tuple[str, ...] = ("dp", "ZeRO-3", "tp", "cp", "ep")


def thresholds(
    machine: Machine,
    world_size: int,
    *,
    bytes_per_number: int = 2,
    d_model: int = 4096,
    top_k: int = 2,
    experts: int = 8,
) -> list[Threshold]:
    """Theory: every strategy's threshold on `machine` for a group of `world_size` ranks
    (`STRATEGIES`' order), in the bandwidth alone as the scaling book gives them, but ep's,
    which needs the all-to-alls' latency (`ep_threshold`); `d_model`, `top_k` and
    `experts`: the model cp's latency-free rule does not need and ep's does."""
    n, b = world_size, bytes_per_number
    per_rank: Literal["tokens per rank", "d_model"] = "tokens per rank"
    return [
        Threshold(
            "dp", dp_threshold(machine, n, bytes_per_number=b), per_rank, "(N-1)/N x b/3 x F/W"
        ),
        Threshold(
            "ZeRO-3",
            zero3_threshold(machine, n, bytes_per_number=b),
            per_rank,
            "(N-1)/N x b/2 x F/W",
        ),
        Threshold(
            "tp", tp_threshold(machine, n, bytes_per_number=b), "d_model", "(N-1) x b/9 x F/W"
        ),
        Threshold(
            "cp",
            cp_threshold(machine.bandwidth_only(), n, d_model, bytes_per_number=b),
            per_rank,
            "(3N-2)/N x b/6 x F/W",
        ),
        Threshold(
            "ep",
            ep_threshold(machine, n, d_model, top_k=top_k, experts=experts, bytes_per_number=b),
            per_rank,
            "5 alpha / (48 k d^2/F - 4 k d b (N-1)/N / W)",
        ),
    ]
