"""Lesson 03's fewer bits, and what benchmarks/low_precision.py tables: the formats and
where this GPT's gradients fall in them, a scale a tensor, a row or a block against one
outlier, training in each precision (fp32, bf16, fp16 with and without loss scaling, FP8)
and with each wire format, and the exercise: a loss scaler's update."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from matplotlib.axes import Axes
from matplotlib.figure import Figure, SubFigure
from torch import nn

from parcourse import fp8, zero
from parcourse.comm import Comm
from parcourse.corpus import ShardedLoader, open_corpus
from parcourse.data_parallel import BucketedDataParallel
from parcourse.data_parallel import compress as C
from parcourse.experiments.exercises import ask
from parcourse.launch import RankContext
from parcourse.models import GPTConfig, gpt

# Each format as torch has it; bits, range and eps read from torch.finfo.
FORMATS: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "e5m2": torch.float8_e5m2,
    "e4m3": torch.float8_e4m3fn,
}
# each precision's compute dtype under ZeRO (None: the fp32 parameters'): its messages'
PRECISIONS: dict[str, torch.dtype | None] = {
    "fp32": None,
    "bf16": torch.bfloat16,
    "fp16 + scaler": torch.float16,
    "fp16, no scaler": torch.float16,
    "fp8": None,
}
CONFIG = GPTConfig(vocab=256, block_size=64, n_layers=2, n_heads=4, d_model=64)
BATCH = 16
WIRES = ("fp32", "bf16", "e4m3", "PowerSGD r=4", "ZeRO-3 bf16", "ZeRO-3 bf16, FP8 gather")
POWERSGD_RANK, POWERSGD_START = 4, 10  # start: at most steps - 2, for a short run


def format_facts(name: str) -> dict[str, float]:
    """One format's bits (sign, exponent, mantissa), largest value, smallest normal and
    subnormal, and eps (the gap above 1), from torch.finfo."""
    info = torch.finfo(FORMATS[name])
    mantissa = round(-math.log2(info.eps))
    return {
        "bits": info.bits,
        "exponent": info.bits - 1 - mantissa,
        "mantissa": mantissa,
        "largest": info.max,
        "smallest_normal": info.smallest_normal,
        "smallest": info.smallest_normal * info.eps,  # the smallest subnormal
        "eps": info.eps,
    }


def draw_formats(ax: Axes | None = None) -> Figure | SubFigure:
    """Each format's range on one log2 axis (subnormals lighter), with its bits and eps."""
    from parcourse.plots import _axes

    fig, ax = _axes(ax, (11, 3))
    names = list(FORMATS)
    for i, name in enumerate(names):
        f = format_facts(name)
        lo, normal, hi = (math.log2(f[k]) for k in ("smallest", "smallest_normal", "largest"))
        ax.barh(i, normal - lo, left=lo, color=f"C{i}", alpha=0.35, height=0.6)
        ax.barh(i, hi - normal, left=normal, color=f"C{i}", height=0.6)
        ax.text(
            hi + 3,
            i,
            f"1 + {f['exponent']:.0f} + {f['mantissa']:.0f} bits, eps 2^-{f['mantissa']:.0f}",
            va="center",
            fontsize=8,
        )
    ax.set_yticks(range(len(names)), names)
    ax.invert_yaxis()
    ax.set_xlim(-155, 215)
    ax.set_xlabel("log2 |value|  (lighter: subnormals, fewer significant bits)")
    ax.grid(axis="x", alpha=0.3)
    return fig


def draw_gradients(
    magnitudes: torch.Tensor, scale: float = 2.0**16, ax: Axes | None = None
) -> Figure | SubFigure:
    """Where gradient `magnitudes` fall on fp16's range, unscaled and times `scale`."""
    from parcourse.plots import LEGEND_OUTSIDE, _axes

    fig, ax = _axes(ax, (11, 3))
    g = magnitudes[magnitudes > 0].double().log2()
    edges = torch.arange(math.floor(g.min()), math.ceil(g.max()) + 2, dtype=torch.float64)
    shift = math.log2(scale)
    for extra, color, label in (
        (0.0, "black", "gradients"),
        (shift, "crimson", f"gradients x 2^{shift:.0f} (loss scaled)"),
    ):
        counts = torch.histogram(g, edges).hist / g.numel()
        ax.stairs(counts.numpy(), (edges + extra).numpy(), color=color, label=label)
    f = format_facts("fp16")
    for key, text in (("smallest", "fp16's smallest"), ("smallest_normal", "smallest normal")):
        ax.axvline(math.log2(f[key]), color="C2", linestyle="--")
        ax.text(math.log2(f[key]) + 0.3, ax.get_ylim()[1] * 0.9, text, color="C2", fontsize=8)
    ax.axvline(math.log2(f["largest"]), color="C2", linestyle="--")
    ax.text(
        math.log2(f["largest"]) - 0.3,
        ax.get_ylim()[1] * 0.9,
        "fp16's largest",
        color="C2",
        fontsize=8,
        ha="right",
    )
    ax.set_xlabel("log2 |gradient value|")
    ax.set_ylabel("share of values")
    ax.grid(alpha=0.3)
    ax.legend(**LEGEND_OUTSIDE)
    return fig


def gradient_magnitudes(corpus_dir: str, seed: int = 0) -> torch.Tensor:
    """|gradient| of every parameter value of the GPT after one fp32 forward and backward
    on a batch of the corpus, in this process."""
    torch.manual_seed(seed)
    model = gpt(CONFIG)
    loader = ShardedLoader(open_corpus(corpus_dir).train, CONFIG.block_size, BATCH)
    x, y = loader.next()
    loss = nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
    loss.backward()
    return torch.cat([p.grad.abs().flatten() for p in model.parameters() if p.grad is not None])


def below(magnitudes: torch.Tensor, name: str, scale: float = 1.0) -> tuple[float, float]:
    """Of the nonzero `magnitudes x scale`, the shares that `name` flushes to zero (below
    half its smallest subnormal) and that land among its subnormals (fewer significant
    bits). Exact zeros are left out: no format loses them."""
    f = format_facts(name)
    v = magnitudes[magnitudes != 0].double() * scale
    zero_share = (v < f["smallest"] / 2).double().mean().item()
    sub_share = ((v >= f["smallest"] / 2) & (v < f["smallest_normal"])).double().mean().item()
    return zero_share, sub_share


def outlier_errors(seed: int = 0) -> dict[str, dict[str, float]]:
    """A (4, 512) tensor of values near 1e-3 with one outlier of 900 at [0, 0], through
    e4m3 with each granularity of scale: the number of scales, and the relative error
    (|back - x| / |x| over the values) of the outlier's block, the rest of its row,
    and the other rows."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 512, generator=g) * 1e-3
    x[0, 0] = 900.0
    ways: dict[str, tuple[fp8.Granularity, tuple[int, int]]] = {
        "tensor": ("tensor", (1, 128)),
        "row": ("row", (1, 128)),
        "block 1 x 128": ("block", (1, 128)),
    }
    out = {}
    for label, (granularity, block) in ways.items():
        q = fp8.quantize(x, "e4m3", granularity, block)
        back = fp8.dequantize(q)
        parts = {
            "its block": (slice(0, 1), slice(1, 128)),
            "rest of its row": (slice(0, 1), slice(128, None)),
            "other rows": (slice(1, None), slice(None)),
        }
        out[label] = {"scales": float(q.scale.numel())}
        for part, where in parts.items():
            out[label][part] = fp8.relative_error(back[where], x[where])
    return out


def _loader(ctx: RankContext, corpus_dir: str) -> ShardedLoader:
    """This rank's batches of the corpus: the same for every precision and wire format."""
    return ShardedLoader(
        open_corpus(corpus_dir).train,
        CONFIG.block_size,
        BATCH,
        replica=ctx.rank,
        replicas=ctx.world_size,
    )


def _norms(model: nn.Module) -> list[nn.Module]:
    """The LayerNorms, which ZeRO keeps whole and in fp32 (`keep_modules`)."""
    return [m for m in model.modules() if isinstance(m, nn.LayerNorm)]


def train(ctx: RankContext, corpus_dir: str, precision: str, steps: int) -> dict[str, Any]:
    """`steps` Adam steps of the GPT under ZeRO-2 in `precision`; this rank's losses, the
    bytes it sent a step, its parameter count, the steps a scaler skipped (how many, and
    which, from 1) and its scale at each step."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    torch.manual_seed(0)
    model = gpt(CONFIG)
    if precision == "fp8":
        fp8.convert_to_float8(model)
    dtype = PRECISIONS[precision]
    zmodel = zero.ZeroModel(
        model, 2, ctx.group, compute_dtype=dtype, keep_modules=_norms(model), tracer=ctx.tracer
    )
    opt = torch.optim.Adam(zmodel.parameters(), lr=3e-3)
    scaler = (
        ShardedGradScaler("cpu", process_group=ctx.group) if precision == "fp16 + scaler" else None
    )
    loader = _loader(ctx, corpus_dir)
    losses, skipped, scales, sent = [], [], [], 0.0
    for step in range(1, steps + 1):
        x, y = loader.next()
        before = ctx.tracer.total("bytes_sent")
        loss = nn.functional.cross_entropy(zmodel(x).flatten(0, 1).float(), y.flatten())
        if scaler is not None:
            scale = scaler.get_scale()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            scales.append(scale)
            if scaler.get_scale() < scale:  # backed off: this step found an inf, and skipped
                skipped.append(step)
        else:
            loss.backward()
            opt.step()
        opt.zero_grad(set_to_none=True)
        sent = ctx.tracer.total("bytes_sent") - before
        losses.append(loss.item())
    params = sum(p.numel() for p in model.parameters())
    return {
        "losses": losses,
        "sent": sent,
        "params": params,
        "skipped": len(skipped),
        "skipped_steps": skipped,
        "scales": scales,
    }


def sent_formula(params: int, world_size: int, precision: str) -> float:
    """Bytes a rank sends a ZeRO-2 step (what data parallelism's all-reduce sends):
    2 (N-1)/N x P x the message's bytes an element."""
    each = (PRECISIONS[precision] or torch.float32).itemsize
    return 2 * (world_size - 1) / world_size * params * each


def train_wire(ctx: RankContext, corpus_dir: str, wire: str, steps: int) -> dict[str, Any]:
    """`steps` Adam steps of the GPT with gradients (or ZeRO-3's weights) sent as `wire`;
    this rank's losses, the bytes it sent in the last step, each step's gradient error, and
    the formula's bytes a rank."""
    if wire not in WIRES:
        raise ValueError(f"wire must be one of {', '.join(WIRES)}, got {wire!r}")
    torch.manual_seed(0)
    model = gpt(CONFIG)
    n = ctx.world_size
    measured = None
    formula = float("nan")
    if wire.startswith("ZeRO-3"):
        net: nn.Module = zero.ZeroModel(
            model,
            3,
            ctx.group,
            compute_dtype=torch.bfloat16,
            keep_modules=_norms(model),
            tracer=ctx.tracer,
            fp8_all_gather="FP8" in wire,
        )
    else:
        ddp = BucketedDataParallel(model, ctx.group, algorithm="ring", tracer=ctx.tracer)
        ddp.comm.tracer = ctx.tracer  # its ring's messages (and the used-flags') counted too
        comm = Comm(ctx.group, algorithm="ring", tracer=ctx.tracer)
        flags = sum(len(b.params) for b in ddp.buckets)
        numels = [b.numel for b in ddp.buckets]
        if wire == "fp32":
            formula = sum(C.wire_bytes(k + len(b.params), n) for k, b in zip(numels, ddp.buckets))
        else:
            if wire.startswith("PowerSGD"):
                start = min(POWERSGD_START, steps - 2)
                state: Any = C.PowerSGDState(
                    comm, matrix_approximation_rank=POWERSGD_RANK, start_powerSGD_iter=start
                )
                hook: Any = C.powerSGD_hook
                formula = sum(
                    C.powersgd_bytes([p.shape for p in b.params], n, POWERSGD_RANK)
                    for b in ddp.buckets
                )
            else:
                state, hook = C.LowPrecision(comm, wire), C.low_precision_hook
                formula = sum(C.wire_bytes(k, n, wire) for k in numels)
            formula += C.wire_bytes(flags, n)  # the used-flags' own all-reduce
            measured = C.Measured(state, hook, ctx.group)
            ddp.register_comm_hook(measured, C.measured_hook)
        formula /= n
        net = ddp
    opt = torch.optim.Adam(net.parameters(), lr=3e-3)
    loader = _loader(ctx, corpus_dir)
    losses, sent = [], 0.0
    for _ in range(steps):
        x, y = loader.next()
        before = ctx.tracer.total("bytes_sent")
        loss = nn.functional.cross_entropy(net(x).flatten(0, 1).float(), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sent = ctx.tracer.total("bytes_sent") - before
        losses.append(loss.item())
    errors = measured.errors if measured is not None else []
    if wire.startswith("PowerSGD"):  # the steps it compressed
        errors = errors[min(POWERSGD_START, steps - 2) :]
    return {"losses": losses, "sent": sent, "errors": errors, "formula": formula}


def draw_losses(
    curves: dict[str, Sequence[float]], ax: Axes | None = None, title: str = ""
) -> Figure | SubFigure:
    """Loss against step, one line a precision (or wire format)."""
    from parcourse.plots import LEGEND_OUTSIDE, _axes

    fig, ax = _axes(ax, (9, 3.6))
    for name, losses in curves.items():
        ax.plot(
            range(1, len(losses) + 1),
            losses,
            label=name,
            linestyle=":" if "no scaler" in name else "-",
        )
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (rank 0's batch)")
    ax.grid(alpha=0.3)
    ax.legend(**LEGEND_OUTSIDE)
    if title:
        ax.set_title(title)
    return fig


# The exercise: a dynamic loss scaler's update, as torch.amp.GradScaler's (growth 2,
# backoff 0.5) over ranks as ShardedGradScaler's (the flags all-reduced, a sum: non-zero
# on every rank when any rank found an inf).
GROWTH, BACKOFF = 2.0, 0.5
# found-inf flags of four ranks, step by step: one rank alone, two at once, runs of clean
# steps long enough to grow, and growth right after a back-off.
SCALER_STEPS: list[list[bool]] = [
    [False] * 4,
    [False, False, True, False],
    [False] * 4,
    [False] * 4,
    [False] * 4,
    [False] * 4,
    [False] * 4,
    [False] * 4,
    [True, False, False, True],
    [False] * 4,
    [False] * 4,
    [False] * 4,
    [False, True, False, False],
]


def _reference_update(scale: float, good: int, flags: Sequence[bool], interval: int):
    """torch's own update (`torch._amp_update_scale_`, what GradScaler.update runs) with
    found_inf the sum of the ranks' flags, as ShardedGradScaler all-reduces them:
    (step taken, scale, good steps)."""
    s = torch.tensor(float(scale))
    tracker = torch.tensor(int(good), dtype=torch.int32)
    found = torch.tensor(float(sum(flags)))
    torch._amp_update_scale_(s, tracker, found, GROWTH, BACKOFF, interval)
    return not any(flags), s.item(), int(tracker.item())


def _as_answer(got: Any) -> tuple[bool, float, int] | None:
    if not (isinstance(got, (tuple, list)) and len(got) == 3):
        return None
    try:
        take, scale, good = (x.item() if torch.is_tensor(x) else x for x in got)
        if not isinstance(take, bool) and take not in (0, 1):
            return None
        return bool(take), float(scale), int(good)
    except (TypeError, ValueError, RuntimeError):
        return None


def check_scaler_update(fn: Callable[[float, int, list[bool], int], Any]) -> bool:
    """Lesson 03's exercise: `fn(scale, good_steps, found_inf_on_ranks, growth_interval)`
    returns (take_step, new_scale, new_good_steps) after one step, as torch's GradScaler
    with the flag all-reduced over the ranks. Runs a scripted sequence of steps against
    torch's own update, from 2**16 with an interval of 3; prints one short verdict."""
    interval = 3
    scale, good = 2.0**16, 0
    for step, flags in enumerate(SCALER_STEPS):
        answered, got = ask(
            fn, scale, good, list(flags), interval, where=f"at step {step} (flags {flags}), "
        )
        if not answered:
            return False
        answer = _as_answer(got)
        if answer is None:
            print(
                "Not yet: return three values, (take_step, new_scale, new_good_steps), got "
                f"{type(got).__name__}{' (is a return missing?)' * (got is None)}."
            )
            return False
        want = _reference_update(scale, good, flags, interval)
        if answer != want:
            hint = _hint(answer, want, flags, scale, good, interval)
            print(
                f"Not quite at step {step} (scale {scale:g}, {good} good steps, flags "
                f"{flags}): expected {want}, got {answer}. Hint: {hint}"
            )
            return False
        _, scale, good = want
    print("Correct: the same steps skipped and the same scales as torch's GradScaler.")
    return True


def _hint(
    got: tuple[bool, float, int],
    want: tuple[bool, float, int],
    flags: Sequence[bool],
    scale: float,
    good: int,
    interval: int,
) -> str:
    if got[0] != want[0]:
        if any(flags) and not all(flags):
            found = [str(r) for r, f in enumerate(flags) if f]
            who = f"rank {found[0]}" if len(found) == 1 else f"ranks {', '.join(found)}"
            return (
                f"{who} found an inf: every rank skips (ShardedGradScaler all-reduces "
                "the flags, a sum), or the ranks' weights part ways."
            )
        return "take_step is True (the step is taken) unless some rank found an inf."
    if any(flags):
        if got[1] == scale * BACKOFF ** sum(flags) and sum(flags) > 1:
            return "halve the scale once, however many ranks found an inf."
        if got[1] != scale * BACKOFF:
            return f"after an inf the scale backs off: times {BACKOFF}."
        return "an inf starts the count of good steps again at 0."
    if good + 1 == interval:
        if got[1] != scale * GROWTH:
            return (
                f"good step number {interval} in a row grows the scale (times {GROWTH:g}); "
                "count this step too."
            )
        return "after growing, the count of good steps starts again at 0."
    if got[1] != scale:
        return f"the scale grows only when the good steps reach growth_interval ({interval})."
    return "a good step adds one to the count of good steps."
