"""`python -m parcourse COMMAND`: what a workshop runs from a terminal.

Every command also runs under torchrun, e.g.
`torchrun --nproc-per-node 2 -m parcourse doctor`.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import statistics
import sys
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from parcourse.collectives import SimulatedLink, simulated_link
from parcourse.experiments.all_reduce import all_reduce_with, time_all_reduce
from parcourse.experiments.common import median_of_slowest
from parcourse.launch import Pool, RankContext, _external_env, launch
from parcourse.theory import CostModel, bus_bandwidth, bytes_sent_per_rank
from parcourse.models import GPTConfig
from parcourse.pipeline.schedule import SCHEDULES


_UNITS = {"B": 1, "KB": 1 << 10, "KIB": 1 << 10, "MB": 1 << 20, "MIB": 1 << 20,
          "GB": 1 << 30, "GIB": 1 << 30}


def parse_size(text: str) -> int:
    """'64MB' -> 67108864. Binary units (1 KB = 1024 B), as memory is counted; a bare
    number is bytes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).upper() if match else ""
    if match is None or (unit and unit not in _UNITS):
        raise ValueError(f"cannot read a size from {text!r}; try 4KB, 64MB or 1GB")
    size = int(float(match.group(1)) * _UNITS.get(unit, 1))
    if size <= 0:
        raise ValueError(f"size must be positive, got {text!r}")
    return size


def parse_count(text: str) -> int:
    """'10M' -> 10_000_000, '500k' -> 500_000: decimal, as parameter counts are given."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kKmMbBgG]?)\s*", text)
    if match is None:
        raise ValueError(f"cannot read a count from {text!r}; try 500k, 10M or 1B")
    scale = {"": 1, "K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9}[match.group(2).upper()]
    count = int(float(match.group(1)) * scale)
    if count <= 0:
        raise ValueError(f"count must be positive, got {text!r}")
    return count


def _smoke_all_reduce(ctx: RankContext) -> float:
    t = torch.full((1024,), float(ctx.rank + 1), device=ctx.device)
    with ctx.tracer.span("all_reduce", kind="comm"):
        dist.all_reduce(t, group=ctx.group)
    return t[0].item()


def doctor(args: argparse.Namespace) -> int:
    """Print versions, backends, cores and GPUs; run a 2-rank all_reduce."""
    external = _external_env()
    quiet = external is not None and external[0] != 0  # under torchrun, rank 0 reports

    def say(line: str) -> None:
        if not quiet:
            print(line)

    say(f"python      {platform.python_version()} ({sys.executable})")
    say(f"torch       {torch.__version__} (CUDA build: {torch.version.cuda or 'no'})")
    say(f"platform    {platform.platform()}")
    say(f"cpu cores   {os.cpu_count()} (usable: {len(os.sched_getaffinity(0))})")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    names = [torch.cuda.get_device_name(i) for i in range(gpus)]
    say(f"gpus        {gpus}{' - ' + ', '.join(names) if names else ''}")
    backends = [b for b, ok in (("gloo", dist.is_gloo_available()),
                                ("nccl", dist.is_nccl_available()),
                                ("mpi", dist.is_mpi_available())) if ok]
    say(f"backends    {', '.join(backends) or 'none'}")
    world_size = external[1] if external else args.world_size
    expected = world_size * (world_size + 1) / 2
    t0 = time.perf_counter()
    run = launch(_smoke_all_reduce, world_size, timeout=120)
    cold = time.perf_counter() - t0
    ok = all(r == expected for r in run.results)
    where = "under an external launcher" if external else "launched here"
    say(f"all_reduce  {world_size} ranks {where}, backend {run.backend}: "
        f"{'OK' if ok else 'WRONG ' + str(run.results)} in {cold * 1e3:.0f} ms (with start-up)")
    if not external:
        with Pool(world_size) as pool:
            pool.run(_smoke_all_reduce)
            times = []
            for _ in range(5):
                t0 = time.perf_counter()
                pool.run(_smoke_all_reduce)
                times.append(time.perf_counter() - t0)
        say(f"warm pool   re-run {statistics.median(times) * 1e3:.1f} ms (median of 5)")
    say("doctor      " + ("all good" if ok else "FAILED"))
    return 0 if ok else 1


def _traced_then_timed(ctx: RankContext, algo: str, nbytes: int, dtype: str, repeats: int,
                       link: SimulatedLink | None) -> dict[str, object]:
    """One traced all-reduce (its bytes), then `repeats` timed ones."""
    t = torch.ones(nbytes // getattr(torch, dtype).itemsize, dtype=getattr(torch, dtype),
                   device=ctx.device)
    all_reduce_with(algo, t, ctx, link=link, traced=True)  # type: ignore[arg-type]
    return {"bytes_sent": ctx.tracer.total("bytes_sent"),
            "times": time_all_reduce(ctx, [algo], [nbytes], repeats, dtype, link)}


def allreduce(args: argparse.Namespace) -> int:
    """Time one all-reduce algorithm; print time, algbw, busbw and bytes against theory."""
    external = _external_env()
    world_size = external[1] if external else args.world_size
    dtype = getattr(torch, args.dtype)
    nbytes = parse_size(args.size)
    numel = max(1, nbytes // dtype.itemsize)
    nbytes = numel * dtype.itemsize
    link = simulated_link(args.latency_us, args.bandwidth_gbps)
    run = launch(_traced_then_timed, world_size, args.algo, nbytes, args.dtype, args.repeats,
                 link, timeout=args.timeout)
    if external and external[0] != 0:
        return 0  # every rank has the results; rank 0 prints them
    t = median_of_slowest([r["times"] for r in run.results], (args.algo, nbytes))
    algbw, busbw = bus_bandwidth(nbytes, t, world_size)
    print(f"all-reduce  {args.algo}, {world_size} ranks, backend {run.backend}, "
          f"{nbytes / 2**20:g} MiB of {args.dtype}, median of {args.repeats}")
    where = ""
    if link is not None:
        where = f" (simulated link: {link.latency_s * 1e6:g} us, {link.bandwidth_Bps / 1e9:g} GB/s)"
    print(f"time        {t * 1e3:.3f} ms{where}")
    if link is not None and args.algo != "torch":
        model = CostModel(link.latency_s, link.bandwidth_Bps).all_reduce_s(args.algo, nbytes,
                                                                           world_size)
        print(f"model       {model * 1e3:.3f} ms   (alpha-beta: the link's time; the time above "
              "also holds this machine's own)")
    print(f"algbw       {algbw / 1e9:.3f} GB/s   (size / time)")
    print(f"busbw       {busbw / 1e9:.3f} GB/s   (algbw x 2(N-1)/N)")
    if args.algo != "torch":
        for rank, r in enumerate(run.results):
            theory = bytes_sent_per_rank(args.algo, nbytes, world_size, rank,
                                         itemsize=dtype.itemsize)
            print(f"rank {rank}      sent {r['bytes_sent']:.0f} B (theory {theory:.0f} B)")
    return 0


def ddp(args: argparse.Namespace) -> int:
    """Time training steps under one data-parallel implementation."""
    from parcourse.experiments.data_parallel import train_steps

    external = _external_env()
    world_size = external[1] if external else args.world_size
    run = launch(train_steps, world_size, args.impl, args.steps + 1, width=args.width,
                 depth=args.depth, batch=args.batch, bucket_mb=args.bucket_mb,
                 overlap=not args.no_overlap, latency_us=args.latency_us,
                 bandwidth_gbps=args.bandwidth_gbps, traced=False, timeout=args.timeout)
    if external and external[0] != 0:
        return 0
    # Each step lasts as long as its slowest rank; the first step warms up.
    steps = [max(ts) for ts in zip(*(r["step_s"] for r in run.results))][1:]
    first = run.results[0]
    print(f"ddp         {args.impl}, {world_size} ranks, backend {run.backend}, "
          f"MLP {args.depth} x {args.width} ({first['params'] / 1e6:.2f} M parameters, "
          f"{first['params'] * 4 / 2**20:.1f} MiB of gradients)")
    overlap = "off" if args.no_overlap else "on"
    print(f"buckets     {args.bucket_mb:g} MB, overlap {overlap}" if args.impl != "naive"
          else "buckets     none: one all-reduce per parameter, after backward")
    if args.latency_us or args.bandwidth_gbps:
        print(f"link        simulated: {args.latency_us:g} us, {args.bandwidth_gbps or 'inf'} GB/s")
    print(f"step time   {statistics.median(steps) * 1e3:.1f} ms (median of {len(steps)})")
    print(f"loss        {first['loss'][0]:.4f} -> {first['loss'][-1]:.4f}")
    return 0


def zero(args: argparse.Namespace) -> int:
    """Bytes per rank by category under a ZeRO stage, measured against the formula,
    and the bytes each rank sent in a step against data parallelism's."""
    from parcourse.memory import format_bytes
    from parcourse.experiments.zero import measured_over_formula, memory_by_stage

    external = _external_env()
    world_size = external[1] if external else args.world_size
    run = launch(memory_by_stage, world_size, args.stage, parse_count(args.params),
                 depth=args.depth, batch=args.batch, bucket_mb=args.bucket_mb,
                 timeout=args.timeout)
    if external and external[0] != 0:
        return 0
    result = run.results[0]
    print(f"zero        stage {args.stage}, {world_size} ranks, backend {run.backend}, "
          f"{result['params'] / 1e6:.2f} M parameters, Adam, fp32")
    theory = result["theory"]
    columns = ("params", "grads", "optimizer", "activations", "other")
    header = "".join(f"{c:>12}" for c in columns)
    for label in ("after forward", "peak in backward", "after step"):
        print(f"\n{label}, per rank:{header}")
        for rank, sample in sorted(run.trace.memory_at(label).items()):
            cells = "".join(f"{format_bytes(sample.bytes[c]):>12}" for c in columns)
            print(f"  rank {rank:<13}{cells}")
    print(f"\ntheory, per rank:{''.join(f'{format_bytes(theory[c]):>12}' for c in theory)}"
          "   (params, grads, optimizer)")
    for c, (mean, largest) in measured_over_formula(run).items():
        print(f"  {c:<10} measured / formula {result['checked_at'][c]}: {mean:.3f} "
              f"(largest rank {largest:.3f})")
    if world_size == 1:
        print("\none rank: nothing to communicate, nothing to shard")
    elif result["bytes_sent"] is not None:
        ddp = bytes_sent_per_rank("ring", result["params"] * 4, world_size)
        print("\nsent in one step (counted message by message), per rank, against data "
              "parallelism's ring all-reduce of the gradients, 2(N-1)/N x S:")
        for rank, r in enumerate(run.results):
            print(f"  rank {rank:<4}{r['bytes_sent']:>14,.0f} B   / DDP's {ddp:,.0f} B = "
                  f"{r['bytes_sent'] / ddp:.3f}")
    return 0


def checkpoint(args: argparse.Namespace) -> int:
    """Peak saved activations and step time of a chain of layers under a policy, vs theory."""
    from parcourse.experiments.checkpointing import measure_policy
    from parcourse.memory import format_bytes

    torch.set_num_threads(1)
    r = measure_policy(args.layers, args.policy, width=args.width, batch=args.batch,
                       segments=args.segments, repeats=args.repeats)
    one = r["activation_bytes"]
    print(f"checkpoint  {args.layers} layers Linear({args.width}) + Tanh, batch {args.batch}, "
          f"policy {args.policy}")
    print(f"peak saved  {format_bytes(r['peak_bytes'])} = {r['peak_bytes'] / one:.0f} layer "
          f"outputs (theory {r['theory_bytes'] / one:.0f})")
    print(f"step time   {r['step_s'] * 1e3:.1f} ms (median of {args.repeats}); backward "
          f"recomputes {r['extra_forwards']} layer forwards (theory)")
    return 0


def _tp_config(args: argparse.Namespace) -> GPTConfig:
    return GPTConfig(vocab=args.vocab, block_size=args.block_size, n_layers=args.layers,
                     n_heads=args.heads, d_model=args.width)


def _tp_problem(args: argparse.Namespace) -> str | None:
    """Why these options cannot run, before any rank starts (None: they can)."""
    external = _external_env()
    world_size = external[1] if external else args.world_size
    try:
        config = _tp_config(args)
    except ValueError as e:
        return str(e)
    if config.n_heads % world_size:
        return f"--heads ({config.n_heads}) must be divisible by --world-size ({world_size})"
    if args.sequence_parallel and config.block_size % world_size:
        return (f"--block-size ({config.block_size}) must be divisible by --world-size "
                f"({world_size}) under --sequence-parallel")
    return None


def tp(args: argparse.Namespace) -> int:
    """Train the GPT split over ranks; per-rank bytes and collectives against the
    formulas, the loss beside one process's."""
    from parcourse.experiments.tensor_parallel import one_process_losses, train
    from parcourse.memory import format_bytes
    from parcourse.models import gpt, param_count
    from parcourse.theory import tp_collective_counts, tp_ring_bytes_sent

    external = _external_env()
    world_size = external[1] if external else args.world_size
    config = _tp_config(args)
    run = launch(train, world_size, config, args.steps, args.batch,
                 sequence_parallel=args.sequence_parallel, timeout=args.timeout)
    if external and external[0] != 0:
        return 0
    first = run.results[0]
    how = "sequence parallel" if args.sequence_parallel else "tensor parallel"
    print(f"tp          {world_size} ranks, {how}, backend {run.backend}, collectives: "
          f"{first['algorithm']}")
    print(f"model       GPT, {config.n_layers} layers, d_model {config.d_model}, "
          f"{config.n_heads} heads, vocab {config.vocab}, {config.block_size} tokens "
          f"({param_count(gpt(config)):,} parameters); batch {args.batch}, Adam, fp32")
    print("\nper rank, measured / formula (activations: what one forward keeps for backward)")
    for rank, r in enumerate(run.results):
        for what, label in (("param_bytes", "parameters "), ("activation_bytes", "activations")):
            got, want = r[what], r["theory"][what]
            print(f"  rank {rank:<3} {label} {format_bytes(got):>10}   formula "
                  f"{format_bytes(want):>10}   measured / formula {got / want:.3f}")
    counts = tp_collective_counts(first["collectives"])
    theory = tp_collective_counts(first["theory"]["collectives"])
    same = all(r["collectives"] == r["theory"]["collectives"] for r in run.results)
    print(f"\ncollectives per step: {'as the formula' if same else 'NOT as the formula'} "
          "(each rank; bytes of the whole tensors)")
    for (op, phase), (n, size) in counts.items():
        n_theory, size_theory = theory.get((op, phase), (0, 0))
        print(f"  {op:<15}{phase:<9}{n:>4} x  {format_bytes(size):>10}   formula {n_theory:>3} x "
              f"{format_bytes(size_theory):>10}")
    if first["algorithm"] == "ring":
        sent = tp_ring_bytes_sent(first["theory"]["collectives"], world_size)
        print(f"  sent per rank (ring, counted message by message): {first['bytes_sent']:,.0f} B;"
              f" formula {sent:,.0f} B")
    reference = one_process_losses(config, args.steps, args.batch)
    print(f"\nloss        step   {world_size} ranks    one process")
    for step, (ours, one) in enumerate(zip(first["losses"], reference)):
        print(f"            {step:>4}   {ours:>8.4f}    {one:>8.4f}")
    return 0


def _pipeline_formula(name: str, p: int, m: int, chunks: int, f: float, b: float,
                      w: float) -> tuple[str, float | None]:
    """(the formula's text, its bubble) for a schedule; None where none applies."""
    entry = SCHEDULES[name]
    return entry.formula, None if entry.bubble is None else entry.bubble(p, m, chunks, f, b, w)


def pipeline(args: argparse.Namespace) -> int:
    """A schedule's grid, its simulated and measured bubble beside the formula, and the
    peak in-flight microbatches, from a real run of an MLP or a GPT cut into stages."""
    from parcourse.experiments.pipeline import bubble_of, make_schedule, train
    from parcourse.pipeline import Costs, simulate

    p, m = args.stages, args.microbatches
    try:  # bad sizes are refused here, before any process starts
        schedule = make_schedule(args.schedule, p, m, args.chunks)
    except ValueError as e:
        raise SystemExit(f"pipeline: {e}") from None
    layers = args.layers
    if schedule.stages > layers:
        raise SystemExit(f"pipeline: {schedule.name} on {p} ranks has {schedule.stages} stages; "
                         f"--layers {layers} cannot fill them")
    if args.batch % schedule.microbatches:
        raise SystemExit(f"pipeline: {schedule.microbatches} microbatches do not divide "
                         f"--batch {args.batch}")
    m = schedule.microbatches  # naive runs one
    per_rank = schedule.stages // p
    weight_ms = args.backward_ms / 2 if args.weight_ms is None else args.weight_ms
    f, b, w = args.forward_ms / 1e3, args.backward_ms / 1e3, weight_ms / 1e3
    predicted = simulate(schedule, Costs(forward=f / per_rank, backward=b / per_rank,
                                         weight=w / per_rank))
    simulated = bool(f or b)
    run = launch(train, p, args.schedule, m, 1, model=args.model, chunks=args.chunks,
                 depth=layers, batch=args.batch, forward_ms=args.forward_ms,
                 backward_ms=args.backward_ms, weight_ms=weight_ms,
                 latency_us=args.latency_us, bandwidth_gbps=args.bandwidth_gbps,
                 timeout=args.timeout)
    print(f"pipeline    {schedule.name}, {p} ranks, {schedule.stages} stages, {m} microbatches, "
          f"{args.model} of {layers} layers, backend {run.backend}")
    print(schedule)
    text, formula = _pipeline_formula(args.schedule, p, m, args.chunks, f, b, w)
    shown = f"{formula:.3f}" if formula is not None else ""
    print(f"\nbubble      formula {text} {shown}   simulated {predicted.bubble:.3f}   "
          f"measured {bubble_of(run):.3f}"
          + ("" if simulated else "   (real compute: ranks share cores)"))
    print(f"messages    between ranks per step (simulated): {predicted.messages}")
    print(f"in flight   peak microbatches per rank (simulated; per stage, a stage being "
          f"1/{per_rank} of a rank's layers): {predicted.peak_in_flight}")
    for rank, result in enumerate(run.results):
        print(f"  rank {rank}    peak in-flight activations "
              f"{result['peak_in_flight_bytes']:,.0f} B")
    return 0


def _ranks_option(p: argparse.ArgumentParser, default: int) -> None:
    p.add_argument("--world-size", type=int, default=default,
                   help=f"ranks ({default}; under torchrun, the launcher's)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds before giving up")


def _link_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--latency-us", type=float, default=0.0, help="simulated link latency")
    p.add_argument("--bandwidth-gbps", type=float, default=None,
                   help="simulated link bandwidth in GB/s")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m parcourse",
        description="parcourse: distributed training, built from scratch and measured.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    p = commands.add_parser("doctor", help="check this machine: versions, backends, a 2-rank run")
    p.add_argument("--world-size", type=int, default=2, help="ranks for the smoke run (2)")
    p.set_defaults(func=doctor)

    p = commands.add_parser("allreduce", help="time ring, naive or torch all-reduce")
    _ranks_option(p, 2)
    _link_options(p)
    p.add_argument("--size", default="64MB", help="tensor size, e.g. 4KB, 64MB (64MB)")
    p.add_argument("--algo", choices=("ring", "naive", "torch"), default="ring")
    p.add_argument("--dtype", choices=("float32", "float16", "bfloat16", "int64"),
                   default="float32")
    p.add_argument("--repeats", type=int, default=10)
    p.set_defaults(func=allreduce)

    p = commands.add_parser("ddp", help="time data-parallel training: naive, bucketed, torch")
    _ranks_option(p, 2)
    _link_options(p)
    p.add_argument("--impl", choices=("naive", "bucketed", "torch"), default="bucketed")
    p.add_argument("--bucket-mb", type=float, default=25.0)
    p.add_argument("--no-overlap", action="store_true", help="start buckets after backward")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--depth", type=int, default=6)
    p.add_argument("--batch", type=int, default=256, help="global batch, split over ranks")
    p.set_defaults(func=ddp)

    p = commands.add_parser("zero", help="memory per rank under ZeRO stages 0-3 vs the formula")
    _ranks_option(p, 4)
    p.add_argument("--stage", type=int, choices=(0, 1, 2, 3), default=3,
                   help="0: plain data parallel; 1: optimizer state, 2: + gradients, "
                        "3: + parameters sharded")
    p.add_argument("--params", default="10M", help="model size, e.g. 500k, 10M (10M)")
    p.add_argument("--depth", type=int, default=4, help="layers of the MLP")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--bucket-mb", type=float, default=25.0)
    p.set_defaults(func=zero)

    p = commands.add_parser("checkpoint", help="activation checkpointing: memory and time "
                                               "of a chain of layers under a policy")
    p.add_argument("--layers", type=int, default=64)
    p.add_argument("--policy", choices=("none", "sqrt", "every", "nothing"), default="sqrt",
                   help="keep everything, sqrt(n) segments, every layer, or only the input")
    p.add_argument("--segments", type=int, default=None, help="segments for --policy sqrt")
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.set_defaults(func=checkpoint)

    p = commands.add_parser("pipeline", help="a pipeline schedule: grid, bubble vs formula, "
                                             "in-flight microbatches, measured")
    p.add_argument("--schedule", choices=tuple(SCHEDULES), default="gpipe")
    p.add_argument("--stages", type=int, default=4, help="ranks (" + "; ".join(
        f"{n}: {'--chunks' if e.chunks is None else e.chunks} stages each"
        for n, e in SCHEDULES.items() if e.chunks != 1) + ")")
    p.add_argument("--chunks", type=int, default=2, help="stages per rank for " + ", ".join(
        n for n, e in SCHEDULES.items() if e.chunks is None))
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--model", choices=("mlp", "gpt"), default="mlp")
    p.add_argument("--layers", type=int, default=8,
                   help="layers cut into stages (gpt: embedding, layers - 2 blocks, head)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--forward-ms", type=float, default=20.0,
                   help="simulated forward time of one rank's layers (0 with --backward-ms 0: "
                        "real compute)")
    p.add_argument("--backward-ms", type=float, default=40.0)
    p.add_argument("--weight-ms", type=float, default=None,
                   help="W's part of --backward-ms when a schedule splits it (default: half)")
    p.add_argument("--timeout", type=float, default=600.0)
    _link_options(p)
    p.set_defaults(func=pipeline)

    p = commands.add_parser("tp", help="tensor parallelism: train a tiny GPT split over ranks; "
                                       "bytes and collectives vs the formulas")
    _ranks_option(p, 2)
    p.add_argument("--sequence-parallel", action="store_true",
                   help="also split LayerNorm, dropout and residual along the sequence")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--width", type=int, default=64, help="d_model")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--block-size", type=int, default=32, help="tokens per sequence")
    p.set_defaults(func=tp)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "world_size", 1) < 1:
        parser.error("--world-size must be >= 1")
    for name in ("repeats", "steps", "width", "depth", "batch"):
        if getattr(args, name, 1) < 1:
            parser.error(f"--{name} must be >= 1")
    if getattr(args, "bucket_mb", 1.0) <= 0:
        parser.error("--bucket-mb must be > 0")
    if getattr(args, "layers", 1) < 1:
        parser.error("--layers must be >= 1")
    if hasattr(args, "stages"):
        if args.stages < 1 or args.microbatches < 1:
            parser.error("--stages and --microbatches must be >= 1")
        if args.stages > args.layers:
            parser.error(f"{args.stages} stages need at least {args.stages} layers (--layers)")
        if args.batch % (args.microbatches if SCHEDULES[args.schedule].microbatched else 1):
            parser.error(f"{args.microbatches} microbatches do not divide --batch {args.batch}")
    if getattr(args, "segments", None) is not None and not 1 <= args.segments <= args.layers:
        parser.error(f"--segments must be between 1 and --layers ({args.layers})")
    if args.func is tp and (problem := _tp_problem(args)):
        parser.error(problem)
    if getattr(args, "impl", None) == "torch" and (args.latency_us or args.bandwidth_gbps):
        parser.error("torch's DDP cannot use the simulated link; use --impl naive or bucketed")
    try:
        if hasattr(args, "size"):
            parse_size(args.size)
        if hasattr(args, "params"):
            parse_count(args.params)
    except ValueError as e:
        parser.error(str(e))
    return args.func(args)
