"""What a step of the course's 3D training costs on this machine, measured: the rank
functions the planner's "this machine" cluster is built from (`here.measured_here`), run
on a `Pool`. What the links cost is measured in `links`.

- One rank alone: `measure_costs` (a layer call's fixed cost, the FLOP rate, Adam's
  step; the one-rank probe step `measure_sharing` is set against) or `measure_flops`.
- Every rank at once: `measure_sharing` (what sharing the cores costs a rank's own work)
  and `measure_waits` (a message's and a collective's processor time where a step meets
  them).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from parcourse.models import GPTConfig
from parcourse.planner.links import _groups_of, _round_trip
from parcourse.planner.predict import model_flops_per_token
from parcourse.theory import gpt_layer_flops

if TYPE_CHECKING:
    import torch


def measure_flops(config: GPTConfig, batch: int = 4, repeats: int = 5) -> float:
    """FLOP/s one rank reaches here (one thread) on the GPT's own forward and backward:
    `model_flops_per_token` x tokens over the median time of a step in this process.
    What `Cluster.this_machine` takes: small models run far below a CPU's peak, so the
    rate is measured on the model itself."""
    import time

    import torch
    import torch.nn.functional as F

    from parcourse.models import gpt

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        net = gpt(config)
        x = torch.randint(config.vocab, (batch, config.block_size))
        times = []
        for _ in range(repeats + 1):
            start = time.perf_counter()
            F.cross_entropy(net(x).flatten(0, 1), x.flatten()).backward()
            times.append(time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
    median = sorted(times[1:])[len(times[1:]) // 2]
    return model_flops_per_token(config) * batch * config.block_size / median


def measure_costs(
    ctx: Any, config: GPTConfig, batches: tuple[int, int] = (1, 16), repeats: int = 9
) -> dict[str, float]:
    """What the course's 3D step costs here beyond its links, measured alone (a rank
    function for a pool of one rank, one thread: ranks waiting beside it would share
    its cores): the FLOP/s a layer's work goes at ("flops") and `Overheads`' fixed
    costs, which `Cluster.this_machine(costs=...)` takes.

        with Pool(1) as pool:
            costs = pool.run(measure_costs, config).results[0]

    The step is run as the planner's configurations run it (`Hybrid` on one rank, traced,
    Adam), and its F and B actions timed: at two batch sizes, the difference is FLOPs at
    the rate (a tiny model runs far below it otherwise); the rest is fixed, and a model
    of one block beside one of several splits it into a cost per layer and one per
    stage. The optimizer: torch's Adam over the model's tensors, over one tensor of as
    many numbers, and over one number. Data parallelism's own work on the gradients, a
    tensor's (`_bookkeeping`): lesson 02's buckets ("dp_tensor_s"), and ZeRO-1's step
    beyond Adam's over the whole weights ("zero_tensor_s")."""
    import torch

    if ctx.world_size != 1:
        raise ValueError(
            f"measure_costs measures one rank alone: run it on a pool of one "
            f"rank, not {ctx.world_size} (the others would share its cores)"
        )
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _costs_alone(ctx.group, config, batches, repeats)
    finally:
        torch.set_num_threads(threads)


def _costs_alone(
    group: Any, config: GPTConfig, batches: tuple[int, int], repeats: int
) -> dict[str, float]:
    """`measure_costs`' figures, measured in this order: the FLOP rate and a layer's and a
    stage's fixed costs (`_flop_rate`, `_fixed_costs`), Adam's step (`_adam_costs`), data
    parallelism's bookkeeping (`_bookkeeping`) and the probe step (`_probe_cpu`)."""
    from parcourse.models import gpt

    rate, small = _flop_rate(group, config, batches, repeats)
    fixed = _fixed_costs(group, config, batches[0], rate, small, repeats)
    weights = [p.detach() for p in gpt(config).parameters()]
    t_model, adam = _adam_costs(weights, repeats)
    bucketed, sharded = _bookkeeping(group, config, repeats)
    # The step alone, its quickest of three takes: a busy moment elsewhere on the machine
    # slows it as sharing would, and that is what `measure_sharing` is set against
    return {
        "flops": rate,
        "probe_cpu_s": _probe_cpu(group, config, takes=3),
        **fixed,
        **adam,
        "dp_tensor_s": bucketed / len(weights),
        "zero_tensor_s": max(0.0, sharded - t_model) / len(weights),
    }


def _action_seconds(group: Any, config: GPTConfig, batch: int, repeats: int) -> tuple[float, float]:
    """Median seconds of an F and of a B of the whole model, one microbatch of `batch`
    sequences, on `group` (one rank), traced."""
    import statistics

    import torch

    from parcourse.data import progressions
    from parcourse.hybrid import Hybrid
    from parcourse.mesh import Mesh
    from parcourse.models import gpt
    from parcourse.trace import Tracer

    tracer = Tracer(0)
    model = Hybrid(
        gpt(config),
        Mesh({"dp": 1, "tp": 1, "pp": 1}, group),
        microbatches=1,
        tracer=tracer,
        optimizer=lambda ps: torch.optim.Adam(ps, lr=1e-3),
    )
    x, y = progressions(batch, config.block_size, config.vocab)
    for _ in range(repeats + 1):
        model.step(x, y)
    spans = [sp for sp in tracer.data().spans if sp.kind == "compute"]
    forward, backward = (
        statistics.median(sp.duration_s for sp in spans if sp.meta.get("action") == kind)
        for kind in ("F", "B")
    )
    return forward, backward


def _forward_flops(config: GPTConfig, batch: int) -> float:
    """The whole model's forward FLOPs on `batch` sequences."""
    return sum(
        gpt_layer_flops(config, lay, batch * config.block_size)
        for lay in range(config.n_layers + 2)
    )


def _flop_rate(
    group: Any, config: GPTConfig, batches: tuple[int, int], repeats: int
) -> tuple[float, tuple[float, float]]:
    """The FLOP/s a layer's work goes at: the whole model's F and B at two batch sizes,
    their difference in FLOPs over their difference in seconds (what is fixed cancels);
    and the F's and B's seconds at the smaller batch."""
    small, large = batches
    tries = []
    for _ in range(3):  # the larger batch must take visibly longer: a busy moment can hide it
        (f1, b1) = _action_seconds(group, config, small, repeats)
        (f2, b2) = _action_seconds(group, config, large, repeats)
        tries.append(((f2 + b2) - (f1 + b1), (f1, b1), (f2, b2)))
        if tries[-1][0] > 0.1 * (f1 + b1):
            break
    extra, (f1, b1), (f2, b2) = max(tries, key=lambda t: t[0])
    if extra <= 0:
        raise RuntimeError(
            f"batch {large} took {1e3 * (f2 + b2):.2f} ms a forward and backward, batch "
            f"{small} {1e3 * (f1 + b1):.2f} ms, three times over: something else is using "
            "this machine's cores, so its FLOP rate cannot be told apart; measure again later"
        )
    rate = 3 * (_forward_flops(config, large) - _forward_flops(config, small)) / extra
    return rate, (f1, b1)


def _fixed_costs(
    group: Any,
    config: GPTConfig,
    small: int,
    rate: float,
    seconds: tuple[float, float],
    repeats: int,
) -> dict[str, float]:
    """What an F and a B cost beyond their FLOPs at `rate`, split into a cost per layer
    and one per stage: the model (its F's and B's `seconds` at batch `small`) beside one
    of one block (or of two, for a model of one)."""
    fixed = {}
    for layers in sorted({1, max(2, config.n_layers)}):
        cfg = dataclasses.replace(config, n_layers=layers)
        f, b = seconds if layers == config.n_layers else _action_seconds(group, cfg, small, repeats)
        work = _forward_flops(cfg, small) / rate
        fixed[layers] = (f - work, b - 2 * work)
    (f_one, b_one), (f_many, b_many) = fixed[1], fixed[max(fixed)]
    many = max(fixed) + 2  # layers: the blocks, the embeddings and the head
    per_layer = (max(0.0, (f_many - f_one) / (many - 3)), max(0.0, (b_many - b_one) / (many - 3)))
    return {
        "forward_layer_s": per_layer[0],
        "backward_layer_s": per_layer[1],
        "forward_stage_s": max(0.0, f_many - many * per_layer[0]),
        "backward_stage_s": max(0.0, b_many - many * per_layer[1]),
    }


def _adam_costs(weights: list[torch.Tensor], repeats: int) -> tuple[float, dict[str, float]]:
    """torch's Adam over the model's `weights`, over one tensor of as many numbers, and
    over one number: its step's seconds over the model, and what it costs per step, per
    tensor and per number (`Overheads`)."""
    import torch

    numbers = sum(w.numel() for w in weights)
    t_model = _adam_s(weights, repeats)
    t_flat, t_one = _adam_s([torch.zeros(numbers)], repeats), _adam_s([torch.zeros(1)], repeats)
    per_tensor = max(0.0, (t_model - t_flat) / max(1, len(weights) - 1))
    return t_model, {
        "optimizer_step_s": max(0.0, t_one - per_tensor),
        "optimizer_tensor_s": per_tensor,
        "optimizer_number_s": max(0.0, (t_flat - t_one) / max(1, numbers - 1)),
    }


def _adam_s(tensors: list[torch.Tensor], repeats: int) -> float:
    """The median seconds of torch's Adam step over copies of `tensors`, after three."""
    import statistics
    import time

    import torch

    params = [torch.nn.Parameter(t.clone()) for t in tensors]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.Adam(params, lr=1e-3)
    times = []
    for _ in range(3 + 2 * repeats):
        start = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times[3:])


def _bookkeeping(group: Any, config: GPTConfig, repeats: int) -> tuple[float, float]:
    """What data parallelism does to the gradients beside its collectives, for the whole
    model on one rank (a group of one, so the collectives cost next to nothing): lesson
    02's buckets packed and unpacked; and ZeRO-1's step (`zero.stages`): the gradients
    packed into the reduce-scatter's buffer and their rows added to the shards, the
    shards' Adam, the updated rows written back into the weights. Medians, seconds."""
    import statistics
    import time

    import torch

    from parcourse.comm import Comm
    from parcourse.data_parallel.bucketed import make_buckets
    from parcourse.models import gpt
    from parcourse.zero.stages import ShardedStages

    params = [p for p in gpt(config).parameters() if p.requires_grad]
    buckets = make_buckets(params, 25.0)
    stages = ShardedStages(
        [params],
        Comm(group, algorithm="auto"),
        lambda shards: torch.optim.Adam(shards, lr=1e-3),
        stage=1,
    )
    packed, stepped = [], []
    for _ in range(3 + 2 * repeats):
        for p in params:
            p.grad = torch.randn_like(p)
        start = time.perf_counter()
        for bucket in buckets:
            bucket.pack()
        for bucket in buckets:
            bucket.unpack(1)
        packed.append(time.perf_counter() - start)
        start = time.perf_counter()
        for unit in stages.units:
            stages.reduce(unit)
        stages.step()
        stepped.append(time.perf_counter() - start)
    return statistics.median(packed[3:]), statistics.median(stepped[3:])


def _probe_cpu(
    group: Any, config: GPTConfig, batch: int = 2, steps: int = 8, takes: int = 1
) -> float:
    """The processor time of one step of `config`'s 3D step on a rank by itself (`group`
    of one): the median of `steps` after two, the least of `takes` such medians."""
    import statistics
    import time

    import torch

    from parcourse.data import progressions
    from parcourse.hybrid import Hybrid
    from parcourse.mesh import Mesh
    from parcourse.models import gpt

    model = Hybrid(
        gpt(config),
        Mesh({"dp": 1, "tp": 1, "pp": 1}, group),
        microbatches=1,
        optimizer=lambda ps: torch.optim.Adam(ps, lr=1e-3),
    )
    x, y = progressions(batch, config.block_size, config.vocab)
    times = []
    for _ in range(2 + steps * takes):
        start = time.thread_time()
        model.step(x, y)
        times.append(time.thread_time() - start)
    return min(statistics.median(times[2 + k * steps : 2 + (k + 1) * steps]) for k in range(takes))


def measure_sharing(ctx: Any, config: GPTConfig) -> float:
    """What a rank's own work costs here when every rank of the pool works at once (a
    rank function): each runs `config`'s 3D step on a group of its own, all together,
    and the mean over the ranks of a step's processor time comes back. `measure_costs`
    times the same step on a pool of one ("probe_cpu_s"); the ratio is what sharing the
    cores costs the work itself (`Cluster.shared_cpu`): with more ranks than cores, the
    cores switch between them and lose their caches, and the course's step, mostly
    Python at these sizes, takes more processor time (seen here: 1.1 to 1.7 times)."""
    import torch
    import torch.distributed as dist

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    own = dist.new_group([ctx.rank], use_local_synchronization=True)  # this rank's alone
    try:
        dist.barrier(group=ctx.group)
        spent = torch.tensor([_probe_cpu(own, config) / ctx.world_size])
        dist.all_reduce(spent, group=ctx.group)
        return spent.item()
    finally:
        dist.destroy_process_group(own)
        torch.set_num_threads(threads)


def measure_waits(ctx: Any, config: GPTConfig, steps: int = 4) -> dict[str, Any]:
    """What a message and a collective cost a step in processor time here, where they
    meet it (a rank function, for more ranks than cores): after the course's own work,
    with every rank working at once. `measure_links` times them back to back, where
    each finds the last one's caches warm; in a step each follows Python work, and the
    rank that waited likely wakes to cold caches, on a core another rank just left. So
    every rank runs rounds of work, once alone and once with a wait after each round;
    the difference per round, over the ranks, is the wait's processor time (what the
    wait does to the work around it included):

    - a message after a stage's work (the whole GPT's forward and backward, batch 2:
      about a stage's two actions here), both ends: "message_cpu_s" (ranks 2k and
      2k + 1 in ping-pong, the mean over the ranks paired);
    - a tiny collective after a layer's forward and backward (one block's), by group
      size (each that divides the world size, every group at once), as tensor
      parallelism calls it (`Comm`, torch's): "collective_cpu_s" (all-reduce),
      "gather_cpu_s" (all-gather), "scatter_cpu_s" (reduce-scatter).

    Seen here: a message and a collective of 2 up to 2.5 times what they cost back to
    back (`measure_links`), a collective of 4 about as much; an all-gather of 4 about
    two thirds of an all-reduce."""
    import torch
    import torch.nn.functional as F

    from parcourse.comm import Comm
    from parcourse.models import gpt

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    net = gpt(config)
    tokens = torch.randint(config.vocab, (2, config.block_size))
    hidden = torch.randn(2, config.block_size, config.d_model, requires_grad=True)
    flag = torch.zeros(16)

    def action() -> None:
        F.cross_entropy(net(tokens).flatten(0, 1), tokens.flatten()).backward()

    def layer() -> None:
        net.blocks[0](hidden).sum().backward()

    try:
        out: dict[str, Any] = {"collective_cpu_s": {}, "gather_cpu_s": {}, "scatter_cpu_s": {}}
        if ctx.world_size > 1:
            paired = ctx.world_size - ctx.world_size % 2  # an odd world's last rank waits not
            out["message_cpu_s"] = _per_wait(
                ctx, action, lambda: _round_trip(ctx, flag), 6, 3 * steps, paired
            )
        for size in range(2, ctx.world_size + 1):
            if ctx.world_size % size:
                continue
            with _groups_of(ctx, size) as group:
                comm = Comm(group)
                whole = torch.zeros(16 * size)
                # each called before the next size's group is made
                waits: dict[str, Callable[[], object]] = {
                    "collective_cpu_s": lambda: comm.all_reduce(flag)
                }
                if config.n_heads % size == 0:  # a size tensor parallelism can take
                    waits["gather_cpu_s"] = lambda: comm.all_gather(flag, whole)
                    waits["scatter_cpu_s"] = lambda: comm.reduce_scatter(whole)
                for key, wait in waits.items():
                    out[key][size] = _per_wait(ctx, layer, wait, 8, steps)
        return out
    finally:
        torch.set_num_threads(threads)


def _per_wait(
    ctx: Any,
    work: Callable[[], object],
    wait: Callable[[], object],
    rounds: int,
    takes: int,
    members: int | None = None,
) -> float:
    """A wait's processor time after `work` (`measure_waits`): `takes` pairs of `rounds`
    rounds of work alone and as many with a wait after each, in turn, the first of the
    two alternating (so a busy moment elsewhere falls on both), after two such pairs, the
    median difference per round; its mean over the ranks that wait (`members`, all by
    default), clipped at 0 only then."""
    import statistics
    import time

    import torch
    import torch.distributed as dist

    extra = []
    for take in range(2 + takes):
        spent = {}
        for then in (None, wait) if take % 2 else (wait, None):
            dist.barrier(group=ctx.group)
            start = time.process_time()
            for _ in range(rounds):
                work()
                if then is not None:
                    then()
            spent[then is None] = time.process_time() - start
        if take >= 2:
            extra.append((spent[False] - spent[True]) / rounds)
    total = torch.tensor([statistics.median(extra)])
    dist.all_reduce(total, group=ctx.group)
    return max(0.0, total.item() / (members or ctx.world_size))


__all__ = ["measure_costs", "measure_flops", "measure_sharing", "measure_waits"]
