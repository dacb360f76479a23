"""Training in fewer bits: the course's GPT on the corpus under ZeRO-2, once per precision,
its final loss against fp32's and the bytes each rank sends a step.

    python benchmarks/low_precision.py [--world-size 2] [--steps 60] [--corpus runs/corpus]

Then the wire formats: the same GPT in fp32 under bucketed data parallelism with each
communication hook of `parcourse.data_parallel.compress` (bf16, FP8 e4m3 with a scale a
128 values, PowerSGD at rank 4 from step 10 with error feedback), and under ZeRO-3 in bf16
with and without `fp8_all_gather`: the loss, each step's gradient error against the exact
fp32 average (`Measured`, an uncounted second all-reduce), and the bytes a rank sends a
step (the mean over ranks of the last step) against the formula.

Precisions: fp32; bf16 compute (fp32 masters); fp16 compute with torch's ShardedGradScaler
over the group; fp16 with no scaler; FP8 (`parcourse.fp8.convert_to_float8`: every
Linear's products on e4m3 / e5m2 operands, fp32 elsewhere). The same seed, data and Adam
for each; bytes counted message by message by the course's ring (`tracer.total`),
against the formula 2 (N-1)/N x P x the message's bytes an element (ZeRO-2 sends what
data parallelism does). FP8 in this table changes the compute only: its messages are fp32 (the
wire formats below move fewer bits). There is no GPU here: no step times.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from parcourse import fp8, zero  # noqa: E402
from parcourse.comm import Comm  # noqa: E402
from parcourse.corpus import ShardedLoader, build_corpus, open_corpus  # noqa: E402
from parcourse.data_parallel import BucketedDataParallel  # noqa: E402
from parcourse.data_parallel import compress as C  # noqa: E402
from parcourse.launch import Pool, RankContext  # noqa: E402
from parcourse.models import GPTConfig, gpt  # noqa: E402

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


def train(ctx: RankContext, corpus_dir: str, precision: str, steps: int) -> dict[str, Any]:
    """`steps` Adam steps of the GPT under ZeRO-2 in `precision`; this rank's losses, the
    bytes it sent a step, its parameter count, and the steps a scaler skipped."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    torch.manual_seed(0)
    model = gpt(CONFIG)
    if precision == "fp8":
        fp8.convert_to_float8(model)
    dtype = PRECISIONS[precision]
    norms = [m for m in model.modules() if isinstance(m, nn.LayerNorm)]
    zmodel = zero.ZeroModel(
        model, 2, ctx.group, compute_dtype=dtype, keep_modules=norms, tracer=ctx.tracer
    )
    opt = torch.optim.Adam(zmodel.parameters(), lr=3e-3)
    scaler = (
        ShardedGradScaler("cpu", process_group=ctx.group) if precision == "fp16 + scaler" else None
    )
    loader = ShardedLoader(
        open_corpus(corpus_dir).train,
        CONFIG.block_size,
        BATCH,
        replica=ctx.rank,
        replicas=ctx.world_size,
    )
    losses, skipped, sent = [], 0, 0.0
    for _ in range(steps):
        x, y = loader.next()
        before = ctx.tracer.total("bytes_sent")
        loss = nn.functional.cross_entropy(zmodel(x).flatten(0, 1).float(), y.flatten())
        if scaler is not None:
            scale = scaler.get_scale()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            skipped += scaler.get_scale() < scale
        else:
            loss.backward()
            opt.step()
        opt.zero_grad(set_to_none=True)
        sent = ctx.tracer.total("bytes_sent") - before
        losses.append(loss.item())
    params = sum(p.numel() for p in model.parameters())
    return {"losses": losses, "sent": sent, "params": params, "skipped": skipped}


WIRES = ("fp32", "bf16", "e4m3", "PowerSGD r=4", "ZeRO-3 bf16", "ZeRO-3 bf16, FP8 gather")
POWERSGD_RANK, POWERSGD_START = 4, 10  # start: at most steps - 2, for a short run


def train_wire(ctx: RankContext, corpus_dir: str, wire: str, steps: int) -> dict[str, Any]:
    """`steps` Adam steps of the GPT with gradients (or ZeRO-3's weights) sent as `wire`;
    this rank's losses, the bytes it sent in the last step, each step's gradient error, and
    the formula's bytes a rank."""
    torch.manual_seed(0)
    model = gpt(CONFIG)
    n = ctx.world_size
    measured = None
    formula = float("nan")
    if wire.startswith("ZeRO-3"):
        norms = [m for m in model.modules() if isinstance(m, nn.LayerNorm)]
        net: nn.Module = zero.ZeroModel(
            model,
            3,
            ctx.group,
            compute_dtype=torch.bfloat16,
            keep_modules=norms,
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
    loader = ShardedLoader(
        open_corpus(corpus_dir).train,
        CONFIG.block_size,
        BATCH,
        replica=ctx.rank,
        replicas=ctx.world_size,
    )
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


def wires(pool: Pool, corpus: str, steps: int) -> None:
    n = pool.world_size
    print()
    print(
        f"Wire formats: the same GPT, bucketed data parallelism over {n} ranks in fp32 (or "
        f"ZeRO-3 in bf16), {steps} Adam steps"
    )
    print(
        f"{'wire':<24}{'loss':>8}{'vs fp32':>9}{'grad error':>12}"
        f"{'bytes / step':>14}{'formula':>11}"
    )
    base = None
    for wire in WIRES:
        results = pool.run(train_wire, corpus, wire, steps).results
        loss = statistics.fmean(results[0]["losses"][-5:])
        base = loss if base is None else base
        sent = statistics.fmean(r["sent"] for r in results)
        errors = results[0]["errors"]
        error = f"{statistics.fmean(errors):.2e}" if errors else "-"
        formula = results[0]["formula"]
        shown = "-" if formula != formula else f"{formula:,.0f}"
        print(f"{wire:<24}{loss:>8.3f}{loss / base:>9.3f}{error:>12}{sent:>14,.0f}{shown:>11}")
    print(
        "(grad error: |average - fp32's| / |fp32's| a step, the mean over steps; PowerSGD's "
        "over the steps from 10 on, plain all-reduces before it. ZeRO-3's rows: its gathers, "
        "reduce-scatter and flags; FP8 halves the gathers' bytes)"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--corpus", default=str(REPO / "runs" / "corpus"))
    args = p.parse_args()
    if args.world_size < 2 or args.steps < 5:
        p.error("--world-size must be at least 2 and --steps at least 5")
    corpus = build_corpus(args.corpus)
    n = args.world_size
    print(
        f"GPT {CONFIG.n_layers} x {CONFIG.d_model} (vocab {CONFIG.vocab}), ZeRO-2 over {n} "
        f"ranks, the corpus, {args.steps} Adam steps; loss: mean of the last 5 steps"
    )
    print(
        f"{'precision':<16}{'loss':>8}{'vs fp32':>9}{'skipped':>9}"
        f"{'bytes sent / step':>19}{'formula':>11}"
    )
    fp32_loss = None
    with Pool(n) as pool:
        for precision in PRECISIONS:
            results = pool.run(train, str(corpus.directory), precision, args.steps).results
            r = results[0]
            loss = statistics.fmean(r["losses"][-5:])
            fp32_loss = loss if fp32_loss is None else fp32_loss
            each = (PRECISIONS[precision] or torch.float32).itemsize
            formula = 2 * (n - 1) / n * r["params"] * each
            print(
                f"{precision:<16}{loss:>8.3f}{loss / fp32_loss:>9.3f}{r['skipped']:>9}"
                f"{r['sent']:>19,.0f}{formula:>11,.0f}"
            )
        print(
            "(bytes of rank 0 in its last step; the formula counts parameters only, the "
            "messages also carry padding rows and one used-flag a parameter)"
        )
        wires(pool, str(corpus.directory), args.steps)


if __name__ == "__main__":
    main()
