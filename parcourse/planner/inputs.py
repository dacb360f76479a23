"""The planner's inputs: a configuration (`Choice`, the run's `ParallelPlan`), the cluster
(`Cluster`, with `Overheads`: presets for A100, H100 and H200 nodes, and this machine),
and the named model shapes (`model`). `parcourse.planner.predict` predicts from them
and `search` ranks every configuration; `links` and `costs` measure this machine's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from parcourse.comm import SimulatedLink, Topology
from parcourse.models import GPTConfig
from parcourse.plan import ParallelPlan
from parcourse.theory import gpt_layer_bytes

Dtype = Literal["fp32", "bf16"]
DTYPES: tuple[str, ...] = ("fp32", "bf16")


def check_dtype(dtype: str) -> None:
    """Memory and time count the same bytes a number: one of `DTYPES`, or a ValueError
    (a misspelt one would count memory in 16 bits and time in 4-byte numbers)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")


GiB = 2**30


# A configuration the planner predicts is the run's one plan record: the same fields, the
# same rules (`ParallelPlan.problems`), the same label as `train3d --plan` reads.
Choice = ParallelPlan


@dataclass(frozen=True)
class Overheads:
    """What a step costs beyond its FLOPs and its links, in seconds. On this machine
    (`measure_costs`), each layer's call in forward and in backward (Python, the
    runtime's bookkeeping, a CPU's kernel launches: a tiny model spends most of its time
    there) and each stage's per microbatch (the pipeline runtime's action, the loss);
    the optimizer's step: per step, per parameter tensor and per parameter. On a real
    cluster only the last: Adam's update reads and writes about 28 bytes a parameter
    (fp32 master, two moments, the gradient, the new weights) at the GPU's memory
    bandwidth."""

    forward_layer_s: float = 0.0
    backward_layer_s: float = 0.0
    forward_stage_s: float = 0.0
    backward_stage_s: float = 0.0
    optimizer_step_s: float = 0.0
    optimizer_tensor_s: float = 0.0
    optimizer_number_s: float = 0.0
    # data parallelism's own work on the gradients beside its collectives, per tensor
    # (`measure_costs`): lesson 02's buckets packed and unpacked, or ZeRO 1-2's step beyond
    # Adam's (the gradients packed for the reduce-scatter and added to the shards, the
    # gathered rows written into the weights)
    dp_tensor_s: float = 0.0
    zero_tensor_s: float = 0.0

    def optimizer_s(self, tensors: float, numbers: float) -> float:
        """One optimizer step over `tensors` tensors of `numbers` parameters in all."""
        if not numbers:
            return 0.0
        return (
            self.optimizer_step_s
            + tensors * self.optimizer_tensor_s
            + numbers * self.optimizer_number_s
        )


@dataclass(frozen=True)
class Cluster:
    """GPUs and their links: `memory` bytes per GPU, `peak_flops` (dense, the dtype's),
    `achievable` (the fraction of it a step's matrix products reach), links inside a node
    and between nodes, and `memory_bandwidth` (bytes/s of a GPU's own memory, what its
    memory-bound work runs at: layer norms, GeLU, softmax, dropout, residual adds).
    `Cluster.preset("h100", gpus=64)`; `Cluster.this_machine(world_size, ...)` for the
    laptop the course runs on.

    The presets' `achievable`, 0.65, goes with their `memory_bandwidth`: with the
    memory-bound work priced apart, it puts
    Narayanan et al. 2021's ten runs (1.7B to 1T parameters on A100s, their Table 1)
    within 15% of their achieved TFLOP/s for any value from 0.59 to 0.71, and
    Korthikanti et al. 2022's Table 5 iteration times within 16%
    (`benchmarks/planner.py --only paper`): a fraction read off those records, not
    measured. A cluster built by hand without a bandwidth prices its whole compute at
    `achievable` (0.5 by default, about what such records reach over a whole step)."""

    name: str
    gpus: int
    gpus_per_node: int
    memory: float
    peak_flops: float
    achievable: float = 0.5
    inside: SimulatedLink = field(default_factory=lambda: SimulatedLink.of(3, 300.0))
    between: SimulatedLink = field(default_factory=lambda: SimulatedLink.of(10, 25.0))
    # Seconds a collective costs beyond its bytes, by group size (measured here by
    # `measure_links`: gloo on shared cores pays milliseconds a call); 0 on a real cluster,
    # whose links' latency already says it.
    collective_s: dict[int, float] = field(default_factory=dict)
    overheads: Overheads = field(default_factory=Overheads)
    # The CPU cores the ranks share (this machine); None: a GPU each. With more ranks
    # than cores, the ranks computing at once share them (`predict_time`).
    cores: int | None = None
    # The same for the course's ring all-reduce of messages (data parallelism's on gloo).
    ring_s: dict[int, float] = field(default_factory=dict)
    # With more ranks than cores: a message's latency, and tp's collective by group size,
    # measured while the other ranks compute (as a pipeline's other stages do); what a
    # pipeline's hops and its stages' collectives cost here. None / empty: as above.
    loaded_p2p_s: float | None = None
    loaded_collective_s: dict[int, float] = field(default_factory=dict)
    # The processor time of a message, both ends (`measure_links`; with more ranks than
    # cores `measure_waits`: after a stage's work, as a step meets it): on shared cores a
    # pipeline's sends and receives take it from the stages computing.
    message_cpu_s: float = 0.0
    # A collective's processor time on each member, by group size (gloo's threads too):
    # torch's all-reduce and the course's ring (`measure_links`; with more ranks than
    # cores, torch's after a layer's work, `measure_waits`, and its all-gather and
    # reduce-scatter, which sequence parallelism calls: `gather_cpu_s`, `scatter_cpu_s`;
    # where not measured, an all-reduce's). On shared cores a step cannot beat its
    # ranks' processor time over the cores.
    collective_cpu_s: dict[int, float] = field(default_factory=dict)
    ring_cpu_s: dict[int, float] = field(default_factory=dict)
    # With more ranks than cores: a rank's own work in processor time when every rank
    # works at once, per its time alone (`measure_sharing`: cores switching between ranks
    # lose their caches). 1.0: no loss.
    shared_cpu: float = 1.0
    gather_cpu_s: dict[int, float] = field(default_factory=dict)
    scatter_cpu_s: dict[int, float] = field(default_factory=dict)
    # torch's tiny all-gather and reduce-scatter by group size, as `collective_s` is its
    # all-reduce (`measure_links`); where not measured, an all-reduce's.
    gather_s: dict[int, float] = field(default_factory=dict)
    scatter_s: dict[int, float] = field(default_factory=dict)
    # Each rank's compute simulated (`scaled`): it sleeps through it, freeing its core,
    # so the ranks share `cores` only for what is not padded, the optimizer.
    compute_simulated: bool = False
    # A GPU's memory bandwidth (B/s): the layers' memory-bound work is priced apart from
    # their matrix products (`stage_compute`). None: not apart (this machine, whose FLOP
    # rate is measured on the layers themselves, memory-bound work and all).
    memory_bandwidth: float | None = None

    PRESETS = {  # memory, dense bf16 peak, NVLink / InfiniBand per GPU (GB/s, one way),
        #          memory bandwidth (B/s)
        "a100": (80 * 10**9, 312e12, 300.0, 25.0, 2.0e12),
        "h100": (80 * 10**9, 989e12, 450.0, 50.0, 3.35e12),
        "h200": (141 * 10**9, 989e12, 450.0, 50.0, 4.8e12),
    }

    @classmethod
    def preset(
        cls, name: str, gpus: int, gpus_per_node: int = 8, achievable: float = 0.65
    ) -> Cluster:
        if name not in cls.PRESETS:
            raise ValueError(f"unknown GPU {name!r}; choose one of {', '.join(cls.PRESETS)}")
        memory, flops, nvlink, ib, hbm = cls.PRESETS[name]
        return cls(
            name,
            gpus,
            min(gpus, gpus_per_node),
            memory,
            flops,
            achievable,
            SimulatedLink.of(3, nvlink),
            SimulatedLink.of(10, ib),
            overheads=Overheads(optimizer_number_s=28 / hbm),
            memory_bandwidth=hbm,
        )

    @classmethod
    def this_machine(
        cls,
        gpus: int,
        flops: float | None = None,
        memory: float = 64 * GiB,
        topology: Topology | None = None,
        cores: int | None = None,
        links: dict[str, Any] | None = None,
        costs: dict[str, Any] | None = None,
        shared_cpu: float = 1.0,
    ) -> Cluster:
        """The course's ranks here, one core's worth each at most: `flops` what one rank
        reaches alone (`measure_flops`), or, with `costs` (`measure_costs` on one rank),
        the rate a layer's FLOPs go at beside what each call and the optimizer cost
        (`Overheads`). More ranks than `cores` share them. The topology's links, or,
        with `links` (`measure_links` on the ranks), gloo's own: a message's latency
        and each collective's cost by group size; `shared_cpu` what sharing the cores
        costs a rank's own work (`measure_sharing`)."""
        from parcourse.launch import usable_cpus

        if (flops is None) == (costs is None):
            raise ValueError("give one of flops (measure_flops) and costs (measure_costs)")
        cores = cores or usable_cpus()
        if links is not None:
            link = SimulatedLink(links["p2p_s"], links["bandwidth_Bps"])
            topology = Topology(gpus, link, link)
        topology = topology or Topology(gpus, SimulatedLink(), SimulatedLink())
        overheads = Overheads(
            **{k: v for k, v in (costs or {}).items() if k in Overheads.__dataclass_fields__}
        )
        loaded = (links or {}).get("loaded", {})
        return cls(
            "this machine",
            gpus,
            topology.ranks_per_node,
            memory,
            flops if flops is not None else (costs or {})["flops"],  # one of them, as checked
            1.0,
            topology.inside,
            topology.between,
            dict(links["collective_s"]) if links is not None else {},
            overheads,
            cores,
            dict(links.get("ring_s", {})) if links is not None else {},
            loaded.get("p2p_s"),
            dict(loaded.get("collective_s", {})),
            (links or {}).get("message_cpu_s", 0.0),
            dict((links or {}).get("collective_cpu_s", {})),
            dict((links or {}).get("ring_cpu_s", {})),
            shared_cpu,
            dict((links or {}).get("gather_cpu_s", {})),
            dict((links or {}).get("scatter_cpu_s", {})),
            dict((links or {}).get("gather_s", {})),
            dict((links or {}).get("scatter_s", {})),
        )

    def collective_cpu(self, op: str, size: int) -> float:
        """The processor time of one of torch's collectives (`op`: "all_reduce",
        "all_gather", "reduce_scatter") on each member of a group of `size`: an
        all-gather or a reduce-scatter not measured costs an all-reduce's, and an
        all-reduce not measured 0."""
        by_op = {
            "all_reduce": {},
            "all_gather": self.gather_cpu_s,
            "reduce_scatter": self.scatter_cpu_s,
        }
        if op not in by_op:
            raise ValueError(f"unknown collective {op!r}; choose one of {', '.join(by_op)}")
        return by_op[op].get(size, self.collective_cpu_s.get(size, 0.0))

    def collective(self, op: str, size: int) -> float:
        """What one of torch's collectives costs beyond its bytes (`op` as in
        `collective_cpu`) in a group of `size`: an all-gather or a reduce-scatter not
        measured costs an all-reduce's, and an all-reduce not measured 0."""
        by_op = {"all_reduce": {}, "all_gather": self.gather_s, "reduce_scatter": self.scatter_s}
        if op not in by_op:
            raise ValueError(f"unknown collective {op!r}; choose one of {', '.join(by_op)}")
        return by_op[op].get(size, self.collective_s.get(size, 0.0))

    @property
    def flops(self) -> float:
        return self.peak_flops * self.achievable


# GPT-style shapes (4h MLP, GELU, learned positions, a vocabulary of 51200 as Megatron-LM's
# GPT runs), named by their size: (layers, width, heads).
MODELS: dict[str, tuple[int, int, int]] = {
    "1.3B": (24, 2048, 16),
    "6.7B": (32, 4096, 32),
    "13B": (40, 5120, 40),
    "70B": (80, 8192, 64),
    "175B": (96, 12288, 96),
}


def model(name: str, seq: int = 2048, vocab: int = 51200) -> GPTConfig:
    """A named GPT-style shape (`MODELS`) at sequence length `seq`."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}")
    layers, width, heads = MODELS[name]
    return GPTConfig(vocab=vocab, block_size=seq, n_layers=layers, n_heads=heads, d_model=width)


def parameters(config: GPTConfig) -> int:
    """The model's parameters (numbers; a tied head counted once)."""
    return sum(gpt_layer_bytes(config, lay)["params"] for lay in range(config.n_layers + 2)) // 4
