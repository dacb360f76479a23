"""Lesson 12, part 1, what `python -m parcourse roofline` and benchmarks/roofline.py run:
this machine measured beside its physical peak, and a sweep that finds where a strategy's
communication stops hiding behind its compute, beside the formula's threshold
(`parcourse.theory.roofline`).

- The peak: cores x clock x FLOPs a cycle from /proc/cpuinfo's flags (`peak_from_cpuinfo`,
  `peak_estimate`), an estimate.
- This machine, measured: a matrix multiply's FLOP/s and a triad's memory bandwidth with one
  thread (`measure_matmul_flops`, `measure_memory_bandwidth`), the course's GPT's FLOP/s and
  the link's latency and bandwidth as the planner measures them (`planner.measure_flops`,
  `planner.measure_links`): `measure_here` on each rank, `measure_machine` to launch it.
- The sweep (`sweep`, `SweepConfig`; `sweep_on_ranks` on each rank): data parallelism
  (lesson 02's buckets) and ZeRO-3 (lesson 04's) over tokens per rank, tensor parallelism
  (lesson 05's layers) over d_model; at each size the step's compute alone, its
  communication alone and the strategy as it runs them, on the course's ring, over this
  machine's loopback or a simulated link. `roofline_figure` draws it.
"""

from __future__ import annotations

import math
import re
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from parcourse.comm import SimulatedLink
from parcourse.experiments.timing import one_thread, take_turns
from parcourse.theory import (
    CostModel,
    bytes_sent_per_rank,
    fit_cost_model,
    zero_communication_bytes,
)
from parcourse.theory.roofline import (
    Machine,
    data_parallel_seconds,
    dp_threshold,
    tensor_parallel_seconds,
    tp_threshold,
    zero3_threshold,
)
from parcourse.trace import Tracer

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure, SubFigure

    from parcourse.launch import Pool, RankContext

# -- the peak, from the processor's flags

# FLOPs a cycle of one core in fp32, by the widest vector instructions the flags name,
# assuming two fused multiply-add units (2 FLOPs a lane each): AVX-512, 16 lanes; AVX2
# with FMA, 8 lanes; AVX without FMA, 8 lanes, an add and a multiply; else SSE's 4. Cores
# with one 512-bit unit, or that run AVX-512 as two 256-bit halves (AMD's Zen 4), reach
# half the first figure: an estimate, and an upper one.
ISA_FLOPS_PER_CYCLE: tuple[tuple[str, frozenset[str], int], ...] = (
    ("avx512f", frozenset({"avx512f"}), 64),
    ("avx2+fma", frozenset({"avx2", "fma"}), 32),
    ("avx", frozenset({"avx"}), 16),
    ("sse2", frozenset(), 8),
)


@dataclass(frozen=True)
class PeakEstimate:
    """A processor's physical peak, estimated: `cores` x `clock_hz` x `flops_per_cycle`
    (fp32, from the instruction set `isa` its flags name; `ISA_FLOPS_PER_CYCLE`)."""

    cores: int
    clock_hz: float
    flops_per_cycle: int
    isa: str

    @property
    def per_core(self) -> float:
        return self.clock_hz * self.flops_per_cycle

    @property
    def flops(self) -> float:
        return self.cores * self.per_core

    def describe(self) -> str:
        return (
            f"{self.cores} cores x {self.clock_hz / 1e9:.2f} GHz x {self.flops_per_cycle} "
            f"FLOPs a cycle ({self.isa}, fp32): an estimate"
        )


def peak_from_cpuinfo(text: str, cores: int | None = None) -> PeakEstimate | None:
    """The peak `text` (what /proc/cpuinfo holds) implies for `cores` cores (by default its
    processors): the clock from the model name's "@ 2.60GHz" where it says one, else the
    highest "cpu MHz" (the current clock: lower when idle); the FLOPs a cycle from the
    first processor's flags. None where the text has no flags or no clock (not x86 Linux)."""
    flags_line = re.search(r"^flags\s*:(.*)$", text, re.MULTILINE)
    nominal = re.search(r"^model name\s*:.*@\s*([\d.]+)\s*GHz", text, re.MULTILINE)
    mhz = [float(m) for m in re.findall(r"^cpu MHz\s*:\s*([\d.]+)", text, re.MULTILINE)]
    if flags_line is None or not (nominal or mhz):
        return None
    clock = float(nominal.group(1)) * 1e9 if nominal else max(mhz) * 1e6
    flags = set(flags_line.group(1).split())
    isa, per_cycle = next((name, n) for name, need, n in ISA_FLOPS_PER_CYCLE if need <= flags)
    counted = len(re.findall(r"^processor\s*:", text, re.MULTILINE))
    return PeakEstimate(cores or max(1, counted), clock, per_cycle, isa)


def peak_estimate(path: str | Path = "/proc/cpuinfo") -> PeakEstimate | None:
    """This machine's peak over the cores this process may use (`usable_cpus`), from
    `path`; None where it cannot be read."""
    from parcourse.launch import usable_cpus

    try:
        text = Path(path).read_text()
    except OSError:
        return None
    return peak_from_cpuinfo(text, usable_cpus())


# -- this machine, measured


def measure_matmul_flops(n: int = 1024, seconds: float = 0.2, windows: int = 5) -> float:
    """FLOP/s of an n x n by n x n fp32 matrix product in this process with one thread
    (2 n^3 FLOPs a product): the median of `windows` windows over about `seconds` in all,
    after one untimed (a moment of another process's work falls in one window)."""
    with one_thread():
        a, b = torch.randn(n, n), torch.randn(n, n)
        a @ b
        rates = []
        for _ in range(windows):
            start, done = time.perf_counter(), 0
            while time.perf_counter() - start < seconds / windows:
                a @ b
                done += 1
            rates.append(2 * n**3 * done / (time.perf_counter() - start))
        return statistics.median(rates)


def measure_memory_bandwidth(numbers: int = 1 << 24, repeats: int = 5) -> float:
    """Bytes/s of STREAM's triad, a = b + 3 c, over fp32 arrays of `numbers` each (64 MiB
    by default: twice this machine's L3 cache each), one thread: 3 x 4 bytes an element
    (two read, one written, as STREAM counts them), its best of `repeats` after one."""
    with one_thread():
        a, b, c = torch.empty(numbers), torch.rand(numbers), torch.rand(numbers)
        best = math.inf
        for k in range(repeats + 1):
            start = time.perf_counter()
            torch.add(b, c, alpha=3.0, out=a)
            if k:
                best = min(best, time.perf_counter() - start)
        return 3 * 4 * numbers / best


# The all-reduces the ring's cost model is fitted to: 16 KiB (its latency), 1 MiB, 8 MiB
# (on shared cores a step's latency swings by a millisecond: the largest must take longer)
RING_SIZES = (1 << 14, 1 << 20, 1 << 23)


def measure_ring(
    ctx: RankContext,
    link: SimulatedLink | None = None,
    sizes: tuple[int, ...] = RING_SIZES,
    repeats: int = 5,
) -> CostModel:
    """A rank function: the course's ring all-reduce (`Comm(algorithm="ring")`, what the
    sweep's strategies send with) timed at each of `sizes` bytes over `link` (None: this
    machine's loopback), the slowest rank's median of `repeats` after one, and lesson
    01's alpha-beta model fitted to them (`fit_cost_model`): the link as the ring meets
    it, its Python, its wake-ups and this machine's copies included. One rank: free."""
    from parcourse.comm import Comm

    if ctx.world_size == 1:
        return CostModel(0.0, math.inf)
    comm = Comm(ctx.group, algorithm="ring", link=link)
    seconds = []
    for size in sizes:
        t = torch.zeros(size // 4)
        times = []
        for k in range(repeats + 1):
            dist.barrier(group=ctx.group)
            start = time.perf_counter()
            comm.all_reduce(t)
            if k:
                times.append(time.perf_counter() - start)
        slowest = torch.tensor([statistics.median(times)], dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=ctx.group)
        seconds.append(slowest.item())
    return fit_cost_model("ring", ctx.world_size, sizes, seconds)


@dataclass(frozen=True)
class Measured:
    """This machine as its ranks measured it at once (`measure_here`): a rank's matrix
    multiply (`flops`, the median over the ranks) and the course's GPT's forward and
    backward (`model_flops`, `planner.measure_flops`), its memory's triad; gloo's link
    as `planner.measure_links` finds it (a message's one-way latency `p2p_s`, a large
    message's bandwidth `link_Bps`), and the course's ring over it (`ring`, alpha and
    beta fitted to its all-reduces, `measure_ring`); with the `peak` estimate."""

    world_size: int
    flops: float
    model_flops: float
    memory_Bps: float
    p2p_s: float
    link_Bps: float
    ring: CostModel
    peak: PeakEstimate | None = None

    def machine(self) -> Machine:
        """The `Machine` the course's ring meets here: a rank's matrix multiply, its
        memory, and the ring's alpha and beta (beta at most gloo's own: where the fit
        cannot tell a byte's time from the latency's noise, it reads no limit)."""
        beta = min(self.ring.beta_Bps, self.link_Bps)
        return Machine("this machine", self.flops, self.memory_Bps, self.ring.alpha_s, beta)


def measure_here(ctx: RankContext, model_flops: bool = True) -> dict[str, Any]:
    """A rank function: this rank's matrix multiply and triad (every rank at once, one
    thread each), the course's GPT's FLOP/s (`planner.measure_flops` on lesson 09's GPT;
    `model_flops=False` skips it), gloo's link (`planner.measure_links`, its large
    message 4 MiB rather than 1 MiB: on shared cores a 1 MiB message is within the
    latency's noise) and the course's ring over it (`measure_ring`)."""
    from parcourse.experiments.hybrid import LESSON_CONFIG
    from parcourse.planner import measure_flops, measure_links

    dist.barrier(group=ctx.group)
    out: dict[str, Any] = {
        "flops": measure_matmul_flops(),
        "memory_Bps": measure_memory_bandwidth(),
        "model_flops": measure_flops(LESSON_CONFIG) if model_flops else 0.0,
    }
    out["links"] = measure_links(ctx, big=1 << 20, repeats=10)
    out["ring"] = measure_ring(ctx)
    return out


def measured_from(results: list[dict[str, Any]], world_size: int) -> Measured:
    """`Measured` from every rank's `measure_here`."""
    links = results[0]["links"]
    return Measured(
        world_size,
        statistics.median(r["flops"] for r in results),
        statistics.median(r["model_flops"] for r in results),
        statistics.median(r["memory_Bps"] for r in results),
        links["p2p_s"],
        links["bandwidth_Bps"],
        results[0]["ring"],
        peak_estimate(),
    )


def measure_machine(world_size: int = 2, pool: Pool | None = None) -> Measured:
    """This machine measured on `world_size` ranks (`measure_here`), on `pool` if given
    (of that size), else on ranks started for it: a few seconds."""
    from parcourse.launch import launch

    if pool is not None and pool.world_size != world_size:
        raise ValueError(
            f"a pool of {pool.world_size} ranks measures {pool.world_size}, not {world_size}"
        )
    run = pool.run(measure_here) if pool is not None else launch(measure_here, world_size)
    return measured_from(run.results, world_size)


# -- the sweep

Strategy = Literal["dp", "zero3", "tp"]
SWEEP_STRATEGIES: tuple[str, ...] = ("dp", "zero3", "tp")
# Where the sweep cannot centre on the threshold (one rank: nothing to send): sizes.
FALLBACK_SIZES = {"dp": (8, 32, 128, 512), "zero3": (8, 32, 128, 512), "tp": (96, 192, 384, 768)}
# The widest a sweep goes (a step of tp at d 1536 and 96 tokens is a second here).
MAX_SIZE = {"dp": 4096, "zero3": 4096, "tp": 1152}


@dataclass(frozen=True)
class SweepConfig:
    """One measured sweep. `strategy`: "dp" (lesson 02's `BucketedDataParallel`, buckets
    of `bucket_mb`), "zero3" (`ZeroStage3`, a unit a layer, prefetching) over tokens per
    rank for an MLP of `depth` square layers of `width` (`bucket_mb` None: a bucket a
    layer, its weight and bias); or "tp" (lesson 05's column- and
    row-parallel layers, `tp_blocks` MLP blocks d -> 4d -> d) over d_model, `tp_tokens`
    tokens a step. `sizes`: the tokens or widths; () for seven around the formula's
    threshold, from an eighth of it to eight times it. `link`: a simulated link for every
    message (None: this machine's loopback). Each size's three steps take turns
    `rounds` times after one (`take_turns`), the slowest rank's median kept."""

    strategy: Strategy = "dp"
    sizes: tuple[int, ...] = ()
    link: SimulatedLink | None = None
    width: int = 512
    depth: int = 4
    bucket_mb: float | None = None
    tp_blocks: int = 2
    tp_tokens: int = 96
    rounds: int = 5

    def __post_init__(self) -> None:
        if self.strategy not in SWEEP_STRATEGIES:
            raise ValueError(
                f"unknown strategy {self.strategy!r}; choose one of {', '.join(SWEEP_STRATEGIES)}"
            )
        small = [
            f"{k}={getattr(self, k)}"
            for k in ("width", "depth", "tp_blocks", "tp_tokens", "rounds")
            if getattr(self, k) < 1
        ]
        if small or any(s < 1 for s in self.sizes):
            raise ValueError(
                f"sizes, width, depth, tp_blocks, tp_tokens and rounds must be >= 1, got "
                f"{', '.join(small) or self.sizes}"
            )
        if self.bucket_mb is not None and not self.bucket_mb > 0:
            raise ValueError(f"bucket_mb must be > 0 (or None: a layer), got {self.bucket_mb}")

    @property
    def unit(self) -> Literal["tokens per rank", "d_model"]:
        return "d_model" if self.strategy == "tp" else "tokens per rank"

    @property
    def overlapped(self) -> bool:
        """Whether the strategy hides its communication behind compute: data parallelism's
        buckets and ZeRO-3's prefetch do; tensor parallelism's all-reduces sit on the
        critical path (the next layer needs them)."""
        return self.strategy != "tp"


@dataclass(frozen=True)
class SweepRow:
    """One size of a sweep: the slowest rank's median seconds of the step's compute
    alone, its communication alone and the strategy's step (`both_s`), the roofline's
    two lines at that size, and the bytes rank 0 sent in one step, counted message by
    message and by the formula."""

    size: int
    compute_s: float
    communication_s: float
    both_s: float
    predicted_compute_s: float
    predicted_communication_s: float
    bytes_sent: float
    bytes_formula: float

    @property
    def exposed_s(self) -> float:
        """What of the step waited on communication: its time beyond its compute alone."""
        return max(0.0, self.both_s - self.compute_s)


@dataclass(frozen=True)
class Sweep:
    """A sweep's rows beside the machine its prediction used (`machine`: the matrix
    multiply's FLOP/s and the link as the ring meets it, `Measured.machine`), the model's
    parameters and the pieces its communication is cut into (buckets, units, or tp's
    all-reduces a step), and the formula's threshold (`formula_crossover`)."""

    config: SweepConfig
    world_size: int
    machine: Machine
    params: int
    pieces: int
    formula_crossover: float
    rows: tuple[SweepRow, ...] = field(default_factory=tuple)

    def predicted_s(self, row: SweepRow) -> float:
        """The roofline's step: the slower of the two lines where the strategy overlaps
        them, their sum where it does not (tp)."""
        both = (row.predicted_compute_s, row.predicted_communication_s)
        return max(both) if self.config.overlapped else sum(both)

    @property
    def measured_crossover(self) -> float | None:
        """Where the measured compute alone catches up with the communication alone,
        between the two sizes it falls between (log-log); None outside the sweep."""
        rows = self.rows
        if any(r.communication_s <= 0 or r.compute_s <= 0 for r in rows):
            return None  # nothing sent (one rank)
        for a, b in zip(rows, rows[1:]):
            ra, rb = (math.log(r.compute_s / r.communication_s) for r in (a, b))
            if ra <= 0 <= rb and rb > ra:
                t = -ra / (rb - ra)
                return math.exp(math.log(a.size) + t * (math.log(b.size) - math.log(a.size)))
        return None


@dataclass
class _Steps:
    """A size's three steps (round number -> None), what the strategy's rank 0 sends
    in one by the formula, and the model's parameters and communication's pieces."""

    run: dict[str, Callable[[int], object]]
    formula_bytes: float
    params: int
    pieces: int


def _backward(model: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> None:
    """One forward and backward (the loss a sum: its own cost is nothing)."""
    model(x).sum().backward()


def _dp_model(
    ctx: RankContext, config: SweepConfig, counter: Tracer
) -> tuple[nn.Module, nn.Module, float, int]:
    """The MLP twice: plain (compute alone) and under the strategy, its ring's bytes
    counted on `counter`, over `config.link`; and rank 0's bytes of a step by the formula,
    and the pieces the communication is cut into. dp: each bucket's all-reduce,
    2 (N-1)/N x its bytes (its gradients and a used-flag a parameter); ZeRO-3: each unit's
    two all-gathers and reduce-scatter (`zero_communication_bytes` of its padded buffer,
    and the flags the reduce-scatter carries a parameter)."""
    from parcourse.data_parallel import BucketedDataParallel
    from parcourse.models import mlp
    from parcourse.zero import ZeroStage3

    n, link = ctx.world_size, config.link
    plain = mlp(config.width, config.width, config.width, depth=config.depth)
    model = mlp(config.width, config.width, config.width, depth=config.depth)
    if config.strategy == "dp":
        layer_mb = (config.width**2 + config.width) * 4 / 2**20  # exact: a power of 2
        ddp = BucketedDataParallel(
            model, ctx.group, bucket_mb=config.bucket_mb or layer_mb, algorithm="ring", link=link
        )
        ddp.comm.tracer = counter  # the ring's messages counted (the wrapper traces none)
        formula = sum(
            bytes_sent_per_rank("ring", 4 * (b.numel + len(b.params)), n, ctx.rank, itemsize=4)
            for b in ddp.buckets
        )
        return plain, ddp, formula, len(ddp.buckets)
    zero = ZeroStage3(model, ctx.group, algorithm="ring", link=link, tracer=counter)
    formula = sum(
        zero_communication_bytes(3, 4 * u.padded, n) + 4 * (n - 1) * len(u.params)
        for u in zero.units
    )
    return plain, zero, formula, len(zero.units)


def _dp_steps(
    plain: nn.Module, wrapped: nn.Module, tokens: int, width: int
) -> dict[str, Callable[[int], object]]:
    """Compute alone (the plain MLP), communication alone (the strategy's step on no
    tokens: every collective of its step, no compute but a gradient of zeros) and the
    strategy's step on `tokens` tokens, each leaving no gradient behind."""
    x, nothing = torch.randn(tokens, width), torch.randn(0, width)

    def step(model: nn.Module, batch: torch.Tensor) -> Callable[[int], object]:
        def run(_: int) -> None:
            _backward(model, batch)
            model.zero_grad(set_to_none=True)

        return run

    return {
        "compute": step(plain, x),
        "communication": step(wrapped, nothing),
        "both": step(wrapped, x),
    }


def _tp_steps(ctx: RankContext, config: SweepConfig, d_model: int, counter: Tracer) -> _Steps:
    """`config.tp_blocks` MLP blocks (d -> 4d -> d, no biases) of width `d_model`, split
    by lesson 05's `ColumnParallelLinear` and `RowParallelLinear` over the pool's ranks on
    the course's ring (its bytes counted on `counter`): compute alone (each rank's own
    share of the matrices, plain), communication alone (the same all-reduces of a
    (tokens, d) activation, g forward and f backward, one after another) and the split
    blocks' step. Rank 0's bytes by the formula: 2 all-reduces a block, each
    2 (N-1)/N x its bytes."""
    from parcourse.comm import Comm
    from parcourse.tensor_parallel import ColumnParallelLinear, RowParallelLinear, TPComm

    n, d, hidden = ctx.world_size, d_model, 4 * d_model
    comm = TPComm(Comm(ctx.group, tracer=counter, link=config.link, algorithm="ring"))
    torch.manual_seed(0)  # the same whole weights on every rank, each keeping its share
    split: list[nn.Module] = []
    plain: list[nn.Module] = []
    for i in range(config.tp_blocks):
        up, down = nn.Linear(d, hidden, bias=False), nn.Linear(hidden, d, bias=False)
        split += [
            ColumnParallelLinear(up, comm, name=f"blocks.{i}.mlp.up"),
            nn.GELU(),
            RowParallelLinear(down, comm, name=f"blocks.{i}.mlp.down"),
        ]
        plain += [
            nn.Linear(d, hidden // n, bias=False),
            nn.GELU(),
            nn.Linear(hidden // n, d, bias=False),
        ]
    blocks, alone = nn.Sequential(*split), nn.Sequential(*plain)
    x = torch.randn(config.tp_tokens, d, requires_grad=True)  # so that the first f runs
    activation = torch.randn(config.tp_tokens, d)

    def step(model: nn.Module) -> Callable[[int], object]:
        def run(_: int) -> None:
            _backward(model, x)
            model.zero_grad(set_to_none=True)
            x.grad = None

        return run

    def all_reduces(_: int) -> None:
        for i in range(config.tp_blocks):
            comm.all_reduce(activation, "forward", f"blocks.{i}.mlp.down")
        for i in reversed(range(config.tp_blocks)):
            comm.all_reduce(activation, "backward", f"blocks.{i}.mlp.up")

    each = bytes_sent_per_rank("ring", activation.nbytes, n, ctx.rank, itemsize=4)
    params = sum(p.numel() for p in blocks.parameters())
    return _Steps(
        {"compute": step(alone), "communication": all_reduces, "both": step(blocks)},
        2 * config.tp_blocks * each,
        params,
        2 * config.tp_blocks,
    )


def _formula(config: SweepConfig, machine: Machine, n: int, params: int, pieces: int) -> float:
    """The formula's threshold for the sweep's model on `machine` (fp32), its latencies
    counted: the size at which the roofline's two lines cross."""
    if config.strategy == "tp":
        return tp_threshold(machine, n, bytes_per_number=4, tokens=config.tp_tokens, block="mlp")
    at = dp_threshold if config.strategy == "dp" else zero3_threshold
    return at(machine, n, bytes_per_number=4, params=params, pieces=pieces)


def _predicted(
    config: SweepConfig, machine: Machine, n: int, size: int, params: int, pieces: int
) -> dict[str, float]:
    """The roofline's two lines at `size` (fp32)."""
    if config.strategy == "tp":
        return tensor_parallel_seconds(
            machine,
            n,
            size,
            config.tp_tokens,
            block="mlp",
            bytes_per_number=4,
            layers=config.tp_blocks,
        )
    stage: Literal[0, 3] = 0 if config.strategy == "dp" else 3
    return data_parallel_seconds(
        machine, n, params, size, stage=stage, bytes_per_number=4, pieces=pieces
    )


def _sizes_around(config: SweepConfig, threshold: float) -> tuple[int, ...]:
    """`config.sizes`, or seven from an eighth of the threshold to eight times it (tp's
    widths in twelves, so that 4 d cuts over 1 to 4 ranks), below `MAX_SIZE`."""
    if config.sizes:
        return config.sizes
    if not 0 < threshold < math.inf:
        return FALLBACK_SIZES[config.strategy]
    step = 12 if config.strategy == "tp" else 1
    top = MAX_SIZE[config.strategy]
    sizes = {min(top, max(step, step * round(threshold * 2.0**k / step))) for k in range(-3, 4)}
    return tuple(sorted(sizes))


def sweep_on_ranks(ctx: RankContext, config: SweepConfig) -> dict[str, Any]:
    """A rank function: the machine measured (the ranks' mean matrix-multiply FLOP/s, so
    that every rank centres the sweep on the same threshold, and the ring over
    `config.link`, `measure_ring`), then at each size the
    three steps of `config` taking turns (`take_turns`), and the bytes this rank sent in
    one more of the strategy's steps, counted by the ring, beside the formula's."""
    with one_thread():
        dist.barrier(group=ctx.group)
        flops = torch.tensor([measure_matmul_flops() / ctx.world_size], dtype=torch.float64)
        dist.all_reduce(flops, group=ctx.group)
        ring = measure_ring(ctx, config.link)
        machine = Machine(
            f"this machine, {link_label(config.link)}",
            flops.item(),
            measure_memory_bandwidth(),
            ring.alpha_s,
            ring.beta_Bps,
        )
        counter, n = Tracer(ctx.rank), ctx.world_size
        if config.strategy == "tp":
            params, pieces = 0, 2 * config.tp_blocks
            model: tuple[nn.Module, nn.Module, float, int] | None = None
        else:
            model = _dp_model(ctx, config, counter)
            params, pieces = sum(p.numel() for p in model[0].parameters()), model[3]
        threshold = _formula(config, machine, n, params, pieces)
        sizes = _sizes_around(config, threshold)
        times, sent, formula = [], [], []
        for size in sizes:
            if model is None:
                steps = _tp_steps(ctx, config, size, counter)
            else:
                plain, wrapped, nbytes, _ = model
                steps = _Steps(
                    _dp_steps(plain, wrapped, size, config.width), nbytes, params, pieces
                )
            times.append(take_turns(ctx.group, steps.run, config.rounds))
            before = counter.total("bytes_sent")
            steps.run["both"](0)
            sent.append(counter.total("bytes_sent") - before)
            formula.append(steps.formula_bytes)
    return {
        "machine": machine,
        "sizes": sizes,
        "times": times,
        "bytes": sent,
        "formula_bytes": formula,
        "params": params,
        "pieces": pieces,
        "threshold": threshold,
    }


def sweep(
    config: SweepConfig | None = None, world_size: int = 2, pool: Pool | None = None
) -> Sweep:
    """Run `config`'s sweep (the default: data parallelism over this machine's loopback)
    on `world_size` ranks, on `pool` if given (of that size), else on ranks started for
    it, and gather it: at each size the slowest rank's median of each step, rank 0's
    bytes, the roofline's prediction."""
    from parcourse.launch import launch

    config = config or SweepConfig()
    if pool is not None and pool.world_size != world_size:
        raise ValueError(
            f"a pool of {pool.world_size} ranks sweeps {pool.world_size}, not {world_size}"
        )
    if config.strategy == "tp" and any(4 * s % world_size for s in config.sizes):
        raise ValueError(
            f"tp cuts 4 x d_model over {world_size} ranks: sizes {config.sizes} do not all cut"
        )
    run = (
        pool.run(sweep_on_ranks, config)
        if pool is not None
        else launch(sweep_on_ranks, world_size, config)
    )
    return gathered(config, run.results)


def gathered(config: SweepConfig, results: list[dict[str, Any]]) -> Sweep:
    """A `Sweep` from every rank's `sweep_on_ranks(ctx, config)` (a panel runs that on
    its pool): at each size the slowest rank's median of each step, rank 0's bytes, the
    roofline's prediction."""
    from parcourse.experiments.timing import median_of_slowest

    first, world_size = results[0], len(results)
    machine, params, pieces = first["machine"], first["params"], first["pieces"]
    rows = []
    for i, size in enumerate(first["sizes"]):
        at = [r["times"][i] for r in results]
        line = _predicted(config, machine, world_size, size, params, pieces)
        rows.append(
            SweepRow(
                size,
                median_of_slowest(at, "compute"),
                median_of_slowest(at, "communication"),
                median_of_slowest(at, "both"),
                line["compute"],
                line["communication"],
                first["bytes"][i],
                first["formula_bytes"][i],
            )
        )
    return Sweep(config, world_size, machine, params, pieces, first["threshold"], tuple(rows))


def link_label(link: SimulatedLink | None) -> str:
    """A link in words: this machine's loopback, or the simulated one's figures."""
    if link is None:
        return "loopback, as measured"
    speed = "unlimited" if math.isinf(link.bandwidth_Bps) else f"{link.bandwidth_Bps / 1e9:g} GB/s"
    return f"simulated: {link.latency_s * 1e6:g} us, {speed}"


NAMES = {"dp": "data parallelism", "zero3": "ZeRO-3", "tp": "tensor parallelism"}


def format_sweep(s: Sweep) -> str:
    """The sweep as a table: each size's three measured steps, the roofline's step, the
    exposed communication, and rank 0's bytes against the formula's; then the measured
    crossover beside the formula's."""
    c = s.config
    unit = "d_model" if c.strategy == "tp" else "tokens"
    lines = [
        f"{NAMES[c.strategy]}, {s.world_size} ranks, link {link_label(c.link)}: the "
        f"prediction at {s.machine.flops / 1e9:.1f} GFLOP/s, {s.machine.latency_s * 1e6:.0f} us "
        f"and {s.machine.link_Bps / 1e9:.2f} GB/s a ring step",
        f"{unit:>8} {'compute':>9} {'comm.':>9} {'step':>9} {'roofline':>9} {'exposed':>9} "
        f"{'bytes':>10} {'formula':>10}  (ms; bytes of rank 0, one step)",
    ]
    for r in s.rows:
        lines.append(
            f"{r.size:>8} {1e3 * r.compute_s:>9.2f} {1e3 * r.communication_s:>9.2f} "
            f"{1e3 * r.both_s:>9.2f} {1e3 * s.predicted_s(r):>9.2f} {1e3 * r.exposed_s:>9.2f} "
            f"{r.bytes_sent:>10.0f} {r.bytes_formula:>10.0f}"
        )
    got = s.measured_crossover
    ratio = (
        f", measured / formula {got / s.formula_crossover:.2f}"
        if got and s.formula_crossover
        else ""
    )
    lines.append(
        f"crossover ({c.unit}): measured "
        + (f"{got:.0f}" if got is not None else "outside the sweep")
        + f", formula {s.formula_crossover:.0f}{ratio}"
    )
    return "\n".join(lines)


def roofline_figure(s: Sweep, ax: Axes | None = None) -> Figure | SubFigure:
    """A sweep's measured step time against the roofline's prediction, log-log over its
    sizes: the compute alone and the communication alone (the colours of a timeline's
    compute and collective), the strategy's step (its mesh axis' colour), the roofline's
    (dashed), the step's wait on communication beyond its compute hatched (as a timeline
    draws waiting), and the two crossovers: the formula's (dashed) and the measured one."""
    import matplotlib.pyplot as plt

    from parcourse import plots
    from parcourse.parts import AXIS_COLORS

    if ax is None:
        fig, ax = plt.subplots(figsize=(8, 4), layout="constrained")
    figure = ax.figure
    c = s.config
    x = [r.size for r in s.rows]
    ms = [
        [1e3 * v for v in vs]
        for vs in zip(*((r.compute_s, r.communication_s, r.both_s) for r in s.rows))
    ]
    compute, comm, both = ms if s.rows else ([], [], [])
    colour = AXIS_COLORS["tp" if c.strategy == "tp" else "dp"]
    collective = plots.SPAN_COLORS["all-gather" if c.strategy == "zero3" else "all-reduce"]
    ax.plot(x, compute, "o-", color=plots.SPAN_COLORS["compute"], label="compute alone")
    ax.plot(x, comm, "s-", color=collective, label="communication alone")
    ax.plot(x, both, "D-", color=colour, linewidth=2.2, label=f"{NAMES[c.strategy]}, measured")
    ax.plot(x, [1e3 * s.predicted_s(r) for r in s.rows], "--", color=colour, label="roofline")
    ax.fill_between(
        x,
        compute,
        both,
        where=[b > a for a, b in zip(compute, both)],
        facecolor="none",
        edgecolor=plots.SPAN_COLORS["idle"],
        hatch="////",
        linewidth=0.0,
        label="waiting on communication",
    )
    ax.axvline(
        s.formula_crossover,
        color="0.3",
        linestyle="--",
        linewidth=1,
        label=f"formula: {s.formula_crossover:.0f}",
    )
    if (got := s.measured_crossover) is not None:
        ax.axvline(got, color="0.3", linewidth=1, label=f"measured: {got:.0f}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel(c.unit)
    ax.set_ylabel("step (ms)")
    ax.set_title(f"{NAMES[c.strategy]}, {s.world_size} ranks, {link_label(c.link)}", loc="left")
    ax.legend(frameon=False, **plots.LEGEND_OUTSIDE)
    ax.grid(alpha=0.3, which="both")
    return figure


# -- lesson 12's exercise: data parallelism's threshold from its formula

# (FLOP/s, link bytes/s, ranks, bytes a number): this machine's order, an H100 pair over
# NVLink, eight over InfiniBand in fp32.
THRESHOLD_CASES = ((50e9, 1e9, 2, 2), (989e12, 450e9, 8, 2), (989e12, 50e9, 8, 4))


def check_dp_threshold(fn: Callable[[float, float, int, int], float]) -> bool:
    """Lesson 12's exercise: `fn(flops, link_Bps, world_size, bytes_per_number)` returns
    the tokens a rank at which data parallelism's compute (6 P T FLOPs) equals its ring
    all-reduce (2 (N-1)/N P b bytes), checked against `theory.dp_threshold` at three
    machines; prints one verdict, naming the mistake when it is a common one."""
    from parcourse.experiments.exercises import ask
    from parcourse.theory import dp_threshold

    for flops, link, n, b in THRESHOLD_CASES:
        machine = Machine("case", flops, 1e12, 0.0, link)
        want = dp_threshold(machine, n, bytes_per_number=b)
        where = f"with flops {flops:g}, link_Bps {link:g}, world_size {n}, bytes {b}, "
        ok, got = ask(fn, flops, link, n, b, where=where)
        if not ok:
            return False
        if isinstance(got, bool) or not isinstance(got, (int, float)) or not math.isfinite(got):
            print(f"Not yet: {where}return a number of tokens, not {got!r}")
            return False
        if not math.isclose(got, want, rel_tol=1e-6):
            print(f"Not yet: {where}{_threshold_mistake(got, want, n)}")
            return False
    print("Correct: T* = (N-1)/N x b/3 x F/W; the model's size cancels.")
    return True


def _threshold_mistake(got: float, want: float, n: int) -> str:
    """What a wrong threshold most likely left out, from its ratio to the right one."""
    ratio = got / want
    hints = (  # the first that matches: with 2 ranks, (N-1)/N left out also doubles it
        (n / (n - 1), "the ring sends 2 (N-1)/N of the gradients' bytes, not 2 of them"),
        (3.0, "compute is 6 P T (forward 2, backward 4), not 2 P T"),
        (1.5, "compute is 6 P T (forward 2, backward 4), not 4 P T"),
        (2.0, "the ring sends 2 (N-1)/N P b bytes, not twice that"),
        (0.5, "the ring sends 2 (N-1)/N P b bytes: a reduce-scatter and an all-gather"),
    )
    for r, said in hints:
        if math.isclose(ratio, r, rel_tol=1e-6):
            return f"{got:.4g} tokens is {ratio:.3g} x the answer: {said}."
    return f"{got:.4g} tokens, the formula gives {want:.4g}: solve 6 P T / F = 2 (N-1)/N P b / W."
