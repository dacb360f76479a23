"""The caching allocator: real training steps replayed, fragmentation at the peak.

    python benchmarks/allocator.py [--world-size 2] [--no-3d] [--plot DIR]

Each case records one rank's memory over the setup and two Adam steps of the course's
GPT (torch.profiler's memory events, every rank), replays it through
parcourse.allocator (PyTorch's CUDA caching allocator, modelled), and prints, at the
peak of allocated bytes: allocated, reserved, reserved but unallocated, the largest
free block, and the most reserved over the steps, without and with expandable segments.

1. ZeRO-3 over `--world-size` ranks (its gather/free rhythm): microbatches of 4 and 8,
   each with and without activation checkpointing per block, and batches that grow
   (2, 4, then 8 sequences, as sequence lengths vary).
2. ZeRO-3 on a GPT whose logits pass 10 MiB (vocab 8192, 256 tokens): 6 sequences a
   rank every step, then a batch that grows from 2 to 6 (`ramp_step_trace`), and what
   each needs on a device of RAMP_DEVICE bytes (cache given back and tried again, or
   out of memory).
3. The 3D step, dp 2 x tp 2 x pp 2 with ZeRO-3 over dp, 1F1B over 2 microbatches, on 8
   ranks, each rank replayed (`--no-3d` leaves it out).

CPU kernels allocate what CPU kernels need: a GPU runs other kernels (and NCCL keeps its
own buffers), so the bytes are this machine's, the allocator's arithmetic torch's.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from parcourse import Pool
from parcourse.allocator import compare, format_size, memory_over_time
from parcourse.experiments.allocator import (
    CONFIG,
    RAMP_BATCHES,
    RAMP_CONFIG,
    RAMP_DEVICE,
    hybrid_step_trace,
    replay_rows,
    table,
    zero3_step_trace,
)

ZERO3_CASES: dict[str, dict[str, Any]] = {
    "ZeRO-3, microbatch 4": {"microbatch": 4},
    "ZeRO-3, microbatch 4, recompute": {"microbatch": 4, "recompute": True},
    "ZeRO-3, microbatch 8": {"microbatch": 8},
    "ZeRO-3, microbatch 8, recompute": {"microbatch": 8, "recompute": True},
    "ZeRO-3, microbatch 2, 4, 8": {"per_step": [2, 4, 8]},
}
RAMP_CASES: dict[str, dict[str, Any]] = {
    "vocab 8192, microbatch 6": {"per_step": [max(RAMP_BATCHES)] * len(RAMP_BATCHES)},
    "vocab 8192, microbatch 2 to 6": {"per_step": list(RAMP_BATCHES)},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2, help="ZeRO-3's ranks")
    parser.add_argument("--no-3d", action="store_true", help="leave out the 8-rank 3D step")
    parser.add_argument("--plot", type=Path, default=None, help="a PNG of rank 0 per case here")
    args = parser.parse_args()
    for name, c in (("GPT", CONFIG), ("vocab 8192", RAMP_CONFIG)):
        print(
            f"{name}: {c.n_layers} blocks, d_model {c.d_model}, {c.n_heads} heads, vocab "
            f"{c.vocab}, block_size {c.block_size}; Adam, fp32; CPU, one thread per rank"
        )
    rows = []
    traces = {}
    with Pool(args.world_size, timeout=3600) as pool:
        for case, kwargs in ZERO3_CASES.items():
            results = pool.run(zero3_step_trace, **kwargs).results
            rows += replay_rows(case, results)
            traces[case] = results[0]
        for case, kwargs in RAMP_CASES.items():
            results = pool.run(zero3_step_trace, config=RAMP_CONFIG, **kwargs).results
            rows += replay_rows(case, results)
            traces[case] = results[0]
    if not args.no_3d:
        case = "3D dp2 tp2 pp2, ZeRO-3"
        with Pool(8, timeout=3600) as pool:
            results = pool.run(hybrid_step_trace, {"dp": 2, "tp": 2, "pp": 2}).results
        rows += replay_rows(case, results)
        traces[case] = results[0]
    print("\nat the peak of allocated bytes (MiB)")
    print(table(rows))
    print(f"\non a device of {format_size(RAMP_DEVICE)}, rank 0:")
    for case in RAMP_CASES:
        print(f"  {case}: " + "; ".join(_on_device(r) for r in compare(traces[case], RAMP_DEVICE)))
    if args.plot is not None:
        plot(traces, args.plot)


def _on_device(run: Any) -> str:
    """What a replay under a capacity needed: retries, or where it ran out."""
    kind = "expandable" if run.expandable_segments else "plain"
    if run.oom is not None:
        return f"{kind}: out of memory at event {len(run.allocated)}"
    retries = f"{run.retries} {'retry' if run.retries == 1 else 'retries'}"
    return f"{kind}: {retries}, at most {run.at_peak().max_reserved / 2**20:.0f} MiB"


def plot(traces: dict[str, Any], folder: Path) -> None:
    """Rank 0's memory over each case's steps, one PNG a case."""
    import matplotlib

    matplotlib.use("Agg")
    folder.mkdir(parents=True, exist_ok=True)
    for i, (case, trace) in enumerate(traces.items()):
        plain, grown = compare(trace)
        fig = memory_over_time(plain, expandable=grown, title=f"{case}, rank 0")
        fig.savefig(folder / f"allocator_{i}.png", dpi=110)
        print(f"{folder / f'allocator_{i}.png'}: {case}")


if __name__ == "__main__":
    main()
