"""ZeRO beyond stage 3, as lesson 04's second half and benchmarks/zero.py run it: where
each byte lives under Offload and Infinity, what the host update and the disk cost, and
what ZeRO++ saves across nodes.

`Beyond` is one configuration, checked before any rank starts; `beyond_run` trains it
for a few steps on the ranks, traced, and returns what the lesson draws.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from parcourse.comm.link import SimulatedLink, Topology
from parcourse.data import local_regression
from parcourse.experiments.exercises import ask
from parcourse.experiments.timing import take_turns
from parcourse.experiments.zero import mlp_for
from parcourse.launch import RankContext
from parcourse.models import mlp
from parcourse.theory import offload_bytes, zero_pp_bytes_across
from parcourse.zero import bytes_by_placement, shard
from parcourse.zero.model import Stage
from parcourse.zero.zeropp import BLOCK, bytes_across_nodes, error_bound

OFFLOADS = ("none", "cpu", "nvme")


@dataclass(frozen=True)
class Beyond:
    """One run beyond ZeRO-3: the `stage`, where the optimizer's side lives (`offload`
    none / cpu / nvme), stage 3's `offload_params`, ZeRO++'s three switches, the node
    size, and the link between nodes (`between_us` latency, `between_GBps`; 0 = no
    simulated link). `dtype` is the compute dtype (the masters stay fp32)."""

    stage: Stage = 3
    offload: str = "none"
    offload_params: bool = False
    quantized_weights: bool = False
    hpz: bool = False
    quantized_gradients: bool = False
    ranks_per_node: int = 2
    between_us: float = 0.0
    between_GBps: float = 0.0
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.stage not in (1, 2, 3):
            raise ValueError(f"stage must be 1, 2 or 3, got {self.stage}")
        if self.offload not in OFFLOADS:
            raise ValueError(f"offload must be one of {', '.join(OFFLOADS)}, got {self.offload!r}")
        if self.offload_params and self.offload == "none":
            raise ValueError(
                "offload_params keeps the weights' shard beside the masters on "
                "the host: choose offload 'cpu' or 'nvme' too"
            )
        if self.stage != 3 and (self.offload_params or self.zero_pp):
            raise ValueError("parameter offload and ZeRO++ act on stage 3's sharded weights")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        if self.ranks_per_node < 1:
            raise ValueError(f"ranks_per_node must be >= 1, got {self.ranks_per_node}")

    @property
    def zero_pp(self) -> bool:
        return self.quantized_weights or self.hpz or self.quantized_gradients

    def check(self, world_size: int) -> None:
        """Refuse, before any rank starts, what this world size cannot run."""
        if (self.zero_pp or self.link() is not None) and world_size % self.ranks_per_node:
            raise ValueError(
                f"ranks_per_node ({self.ranks_per_node}) must divide the world size ({world_size})"
            )

    def link(self) -> Topology | None:
        if not (self.between_us or self.between_GBps):
            return None
        return Topology.of(
            self.ranks_per_node,
            between=SimulatedLink.of(self.between_us, self.between_GBps or None),
        )

    def options(self, path: str | None) -> dict[str, Any]:
        """zero.shard's keyword arguments for this configuration."""
        out: dict[str, Any] = {"link": self.link()}
        if self.offload != "none":
            out["offload_optimizer"] = self.offload
        if self.offload == "nvme":
            out["nvme_path"] = path
        if self.dtype != "float32":
            out["mixed_precision"] = getattr(torch, self.dtype)
        if self.stage == 3:
            out.update(
                offload_params=self.offload_params,
                quantized_weights=self.quantized_weights,
                hpz_partition_size=self.ranks_per_node if self.hpz else None,
                quantized_gradients=self.quantized_gradients,
            )
            if self.hpz or self.quantized_gradients:
                out["ranks_per_node"] = self.ranks_per_node
        return out

    def label(self) -> str:
        parts = [f"stage {self.stage}"]
        if self.offload != "none":
            parts.append(f"offload {self.offload}" + (" + params" if self.offload_params else ""))
        parts += [
            name
            for name, on in (
                ("qwZ", self.quantized_weights),
                ("hpZ", self.hpz),
                ("qgZ", self.quantized_gradients),
            )
            if on
        ]
        return ", ".join(parts)


def beyond_run(
    ctx: RankContext,
    settings: Beyond | dict[str, Any],
    params: int = 1_000_000,
    depth: int = 4,
    steps: int = 3,
    batch: int = 32,
    lr: float = 1e-3,
) -> dict[str, Any]:
    """`steps` traced Adam steps of an MLP of about `params` parameters under `settings`.

    Returns the losses, each step's seconds, bytes by placement right after the last
    step (with the formula beside them), the bytes this rank sent across nodes in the last
    step (with ZeRO-3's formula for the same units), and, with the state on disk, the disk
    traffic per step."""
    settings = Beyond(**settings) if isinstance(settings, dict) else settings
    settings.check(ctx.world_size)
    tracer = ctx.tracer
    width, depth = mlp_for(params, depth)
    ctx.tracer.set_status("building the model")
    model = mlp(width, width, width, depth=depth).to(ctx.device)  # a GPU's when it has one
    with tempfile.TemporaryDirectory(prefix="parcourse-nvme-") as path:
        zmodel, opt = shard(
            model,
            lambda ps: torch.optim.Adam(ps, lr=lr),
            settings.stage,
            ctx.group,
            bucket_mb=1.0,
            tracer=tracer,
            **settings.options(path),
        )
        x, y = local_regression(batch, width, width, ctx.rank, ctx.world_size, ctx.device)
        losses, seconds = [], []
        for step in range(steps):
            dist.barrier(group=ctx.group)  # a common start, for the timeline
            counters = len(tracer.data().counters)
            started = time.perf_counter()
            with tracer.span("forward", step=step):
                loss = nn.functional.mse_loss(zmodel(x), y)
            loss.backward()
            with tracer.span("optimizer", step=step):
                opt.step()
            if x.is_cuda:  # the clock stops when the GPU has finished
                torch.cuda.synchronize()
            seconds.append(time.perf_counter() - started)
            losses.append(float(loss.detach()))
            if step < steps - 1:
                opt.zero_grad()
        placement = bytes_by_placement(zmodel, opt)
        disk = opt.disk_stats() if hasattr(opt, "disk_stats") else None
        if hasattr(opt, "close"):
            opt.close()
    n_params = sum(u.numel for u in zmodel.units)
    last = tracer.data().counters[counters:]
    units = [(u.part_numel, len(u.params)) for u in zmodel.units]
    formula = (
        offload_bytes(
            n_params,
            ctx.world_size,
            settings.stage,
            offload_params=settings.offload_params,
            nvme=settings.offload == "nvme",
            param_dtype=getattr(torch, settings.dtype),
        )
        if settings.offload != "none"
        else None
    )
    return {
        "settings": asdict(settings),
        "params": n_params,
        "losses": losses,
        "seconds": seconds,
        "placement": placement,
        "formula": formula,
        "across": bytes_across_nodes(last, settings.ranks_per_node),
        "units": units,
        "disk": disk,
    }


def across_against_zero3(results: list[dict[str, Any]], world_size: int) -> dict[str, float]:
    """Bytes across nodes in a step, summed over ranks: measured, ZeRO++'s formula for
    these switches, and plain ZeRO-3's (fp32) for the same units."""
    s = Beyond(**results[0]["settings"])
    if s.stage != 3:
        raise ValueError("ZeRO++ and its formula are stage 3's")
    units = results[0]["units"]
    measured = sum(r["across"] for r in results)
    ours = zero_pp_bytes_across(
        units,
        world_size,
        s.ranks_per_node,
        quantized_weights=s.quantized_weights,
        hpz=s.hpz,
        quantized_gradients=s.quantized_gradients,
        dtype_bytes=torch.empty((), dtype=getattr(torch, s.dtype)).element_size(),
    )["total"]
    zero3 = zero_pp_bytes_across(units, world_size, s.ranks_per_node)["total"]
    return {
        "measured": measured,
        "formula": ours,
        "zero3": zero3,
        "ratio": measured / zero3 if zero3 else float("nan"),
    }


LINKS = {"none": (0.0, 0.0), "1 ms, 0.1 GB/s": (1000.0, 0.1), "5 ms, 0.02 GB/s": (5000.0, 0.02)}


def _panel_settings(
    stage: Stage,
    offload: str,
    offload_params: bool,
    qwz: bool,
    hpz: bool,
    qgz: bool,
    link: str,
    ranks_per_node: int,
) -> Beyond:
    if link not in LINKS:
        raise ValueError(f"link must be one of {', '.join(LINKS)}, got {link!r}")
    us, gbps = LINKS[link]
    return Beyond(
        stage=stage,
        offload=offload,
        offload_params=offload_params,
        quantized_weights=qwz,
        hpz=hpz,
        quantized_gradients=qgz,
        ranks_per_node=ranks_per_node,
        between_us=us,
        between_GBps=gbps,
        dtype="bfloat16" if offload != "none" else "float32",
    )


def check_panel(world_size: int, **kwargs: Any) -> None:
    """Lesson 04's panel: refuse a configuration before any rank starts."""
    kwargs = {k: v for k, v in kwargs.items() if k not in ("params", "depth", "steps")}
    _panel_settings(**kwargs).check(world_size)


def panel_run(
    ctx: RankContext,
    stage: Stage = 3,
    offload: str = "none",
    offload_params: bool = False,
    qwz: bool = False,
    hpz: bool = False,
    qgz: bool = False,
    link: str = "none",
    ranks_per_node: int = 2,
    params: int = 500_000,
    depth: int = 4,
    steps: int = 3,
) -> dict[str, Any]:
    """`beyond_run` with the panel's controls (16-bit compute when offloading, as
    ZeRO-Offload is used; fp32 otherwise, so that ZeRO++'s bytes compare with fp32
    ZeRO-3's)."""
    settings = _panel_settings(stage, offload, offload_params, qwz, hpz, qgz, link, ranks_per_node)
    return beyond_run(ctx, settings, params, depth, steps)


def ds_config_run(
    ctx: RankContext,
    config: dict[str, Any] | str,
    params: int = 500_000,
    depth: int = 4,
    steps: int = 3,
) -> dict[str, Any]:
    """The MLP trained through `zero.from_config` (DeepSpeed's loop): what it built, the
    losses, and bytes by placement after the last step."""
    from parcourse.zero import from_config

    width, depth = mlp_for(params, depth)
    torch.manual_seed(0)
    engine = from_config(mlp(width, width, width, depth=depth).to(ctx.device), config, ctx.group)
    x, y = local_regression(32, width, width, ctx.rank, ctx.world_size, ctx.device)
    losses = []
    for _ in range(steps):
        loss = nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.optimizer.step()  # not engine.step(): keep the gradients for the count
        losses.append(float(loss.detach()))
        if _ < steps - 1:
            engine.optimizer.zero_grad()
    placement = bytes_by_placement(engine.module, engine.optimizer)
    built = {
        "model": type(engine.module).__name__,
        "optimizer": type(engine.optimizer).__name__,
        "offload": engine.module.offload_optimizer,
        "offload_params": engine.module.offload_params,
        "compute_dtype": str(engine.module.compute_dtype),
    }
    if hasattr(engine.optimizer, "close"):
        engine.optimizer.close()
    return {"built": built, "losses": losses, "placement": placement}


def update_times(
    ctx: RankContext, params: int = 4_000_000, depth: int = 4, steps: int = 10
) -> dict[str, list[float]]:
    """The offloaded update (torch's Adam over the shard parameters, views into the flat
    fp32 masters on the host), foreach and fused, against torch.optim.Adam on tensors of
    their own with the same shapes, taking turns step by step."""
    width, depth = mlp_for(params, depth)
    zmodel, opt = shard(
        mlp(width, width, width, depth=depth),
        lambda ps: torch.optim.Adam(ps, lr=1e-3, foreach=True),
        2,
        ctx.group,
        offload_optimizer="cpu",
        bucket_mb=1.0,
    )
    x, y = local_regression(8, width, width, ctx.rank, ctx.world_size)
    nn.functional.mse_loss(zmodel(x), y).backward()
    zmodel.finish_gradient_sync()
    shards = [p for p in zmodel.parameters() if p.grad is not None]

    def copies() -> list[nn.Parameter]:
        out = [nn.Parameter(p.detach().clone()) for p in shards]
        for c, p in zip(out, shards):
            assert p.grad is not None  # shards are the parameters holding a gradient
            c.grad = p.grad.clone()
        return out

    offloaded_fused = torch.optim.Adam(shards, lr=1e-3, fused=True)
    foreach = torch.optim.Adam(copies(), lr=1e-3, foreach=True)
    fused = torch.optim.Adam(copies(), lr=1e-3, fused=True)
    runs: dict[str, Any] = {
        "offloaded, foreach": lambda _: opt.optimizer.step(),
        "Adam foreach": lambda _: foreach.step(),
        "offloaded, fused": lambda _: offloaded_fused.step(),
        "Adam fused": lambda _: fused.step(),
    }
    return take_turns(ctx.group, runs, steps)


def median_update(per_rank: list[dict[str, list[float]]], name: str) -> float:
    return max(statistics.median(r[name]) for r in per_rank)


# --------------------------------------------------------------------- the exercise


def check_quantize(fn: Any) -> bool:
    """The exercise of lesson 04: `fn(x, block)` -> (int8 values, fp32 scales) for
    ZeRO++'s block-wise quantization; the dequantized values must be within the library's
    bound (`zeropp.error_bound`, half a step of each block's scale)."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(3 * BLOCK + 17, generator=g) * torch.linspace(0.01, 10, 3 * BLOCK + 17)
    answered, got = ask(fn, x, BLOCK)
    if not answered:
        return False
    if not (isinstance(got, (tuple, list)) and len(got) == 2):
        print("expected a pair (q, scales)")
        return False
    q, scales = got
    blocks = -(-x.numel() // BLOCK)
    if not (torch.is_tensor(q) and q.dtype == torch.int8):
        print(f"q should be an int8 tensor, got {getattr(q, 'dtype', type(q).__name__)}")
        return False
    if q.numel() < x.numel() or not torch.is_tensor(scales) or scales.numel() != blocks:
        print(
            f"expected at least {x.numel()} values and one scale per block of {BLOCK} "
            f"({blocks}), got {q.numel()} and {getattr(scales, 'numel', lambda: '?')()}"
        )
        return False
    padded = torch.zeros(blocks * BLOCK, dtype=torch.int8)
    padded[: q.numel()] = q.reshape(-1)[: blocks * BLOCK]
    scales = scales.float().reshape(-1, 1)  # one a block, in whatever shape it came
    back = (padded.view(blocks, BLOCK).float() * scales).view(-1)[: x.numel()]
    err = (back - x).abs()
    bound = error_bound(x)
    if (err > bound).any():
        worst = int((err / bound).argmax())
        print(
            f"element {worst} comes back as {back[worst]:.4f} for {x[worst]:.4f}: off by "
            f"{err[worst]:.2e}, more than half a step ({bound[worst]:.2e}). Is the scale "
            "max|block| / 127, and do you round (not truncate) x / scale?"
        )
        return False
    print(
        f"correct: every element within half a step; the largest error is "
        f"{float((err / bound).max()):.0%} of the bound"
    )
    return True
