"""Activation checkpointing: ours against torch.utils.checkpoint, same chain, alternating.

    python benchmarks/checkpointing.py [--layers 64] [--width 256] [--batch 512] [--steps 15]

1. Step time (forward + backward) of a chain of equal layers cut into sqrt(n)
   checkpointed segments: ours (parcourse.checkpointing.checkpoint_sequential)
   against torch.utils.checkpoint.checkpoint (use_reentrant=False) on the same
   segments, and torch's checkpoint_sequential (which leaves the last segment
   unchecked), alternating step by step in one process; medians and the ratio.
   Target: ours / torch <= 1.05.
2. Peak memory in a step, measured by torch's MemTracker (an independent tool) for
   both, and by our PeakSavedBytes. Target: ours / torch <= 1.0.
3. Measured peak saved activations and step time over n for every policy, beside
   the theory (n + 1, 2 sqrt n, 3 layer outputs; 0, n, n(n-1)/2 extra forwards).
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from collections.abc import Callable

import torch
from torch.utils.checkpoint import checkpoint as torch_checkpoint
from torch.utils.checkpoint import checkpoint_sequential as torch_checkpoint_sequential

from parcourse.checkpointing import checkpoint_sequential, run_layers, segment_count
from parcourse.experiments.checkpointing import chain, sweep
from parcourse.memory import PeakSavedBytes, format_bytes


def torch_segments(layers: list[torch.nn.Module], k: int, x: torch.Tensor) -> torch.Tensor:
    """torch's checkpoint over the same k segments as ours (every segment checkpointed)."""
    bounds = [round(i * len(layers) / k) for i in range(k + 1)]
    for start, end in zip(bounds, bounds[1:]):
        x = torch_checkpoint(run_layers, layers[start:end], x, use_reentrant=False)
    return x


def peak_by_memtracker(step: Callable[[], None], layers: list[torch.nn.Module]) -> dict[str, int]:
    """Peak bytes by category (param, grad, act, temp, ..., total) in one step."""
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tracker.track_external(*layers)
        with tracker:
            step()
    peak = tracker.get_tracker_snapshot("peak")
    return {str(k).split(".")[-1].lower(): int(v) for k, v in peak[next(iter(peak))].items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=64)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--steps", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(1)
    n = args.layers
    k = segment_count(n, "sqrt")
    layers = chain(n, args.width)
    params = [p for layer in layers for p in layer.parameters()]
    x = torch.randn(args.batch, args.width)
    print(
        f"torch {torch.__version__}, CPU, one thread; {n} layers Linear({args.width}) + Tanh, "
        f"batch {args.batch}, {k} segments"
    )

    runs = {
        "ours": lambda: checkpoint_sequential(layers, k, x),
        "torch checkpoint": lambda: torch_segments(layers, k, x),
        "torch checkpoint_sequential": lambda: torch_checkpoint_sequential(
            layers, k, x, use_reentrant=False
        ),
        "no checkpointing": lambda: run_layers(layers, x),
    }

    def step(name: str) -> None:
        for p in params:
            p.grad = None
        runs[name]().sum().backward()

    times: dict[str, list[float]] = {name: [] for name in runs}
    for name in runs:
        step(name)  # warm-up
    for _ in range(args.steps):
        for name in runs:  # alternating, so that load on the machine hits all alike
            start = time.perf_counter()
            step(name)
            times[name].append(time.perf_counter() - start)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    print(f"\n1. step time (median of {args.steps})")
    for name, t in med.items():
        print(f"{name:>30}: {t * 1e3:7.1f} ms")
    ratio = med["ours"] / med["torch checkpoint"]
    print(
        f"ours / torch checkpoint = {ratio:.2f} (target <= 1.05: "
        f"{'met' if ratio <= 1.05 else 'MISSED'})"
    )

    print("\n2. peak memory in a step")
    print(f"{'':>30}  {'MemTracker total':>16}  {'of it activations':>17}")
    peaks = {}
    for name in runs:
        tracked = peak_by_memtracker(lambda name=name: step(name), layers)
        peaks[name] = tracked["total"]
        print(
            f"{name:>30}  {format_bytes(tracked['total']):>16}  "
            f"{format_bytes(tracked.get('act', 0)):>17}"
        )
    with PeakSavedBytes(exclude=params) as saved:
        step("ours")
    print(
        f"ours, saved activations by PeakSavedBytes: {format_bytes(saved.peak)} "
        f"({saved.peak / (args.batch * args.width * 4):.0f} layer outputs; theory 2 x {k})"
    )
    mem_ratio = peaks["ours"] / peaks["torch checkpoint"]
    print(
        f"ours / torch checkpoint (MemTracker) = {mem_ratio:.2f} "
        f"({peaks['ours']} / {peaks['torch checkpoint']} bytes; target <= 1.0: "
        f"{'met' if mem_ratio <= 1.0 else 'MISSED'})"
    )

    print(
        "\n3. every policy over n (width 64, batch 32): peak saved activations in layer "
        "outputs, measured / theory, and step time"
    )
    print(f"{'n':>5}{'policy':>9}{'measured':>10}{'theory':>8}{'step ms':>10}{'extra fwd':>11}")
    for r in sweep([16, 64, 256], ["none", "sqrt", "every", "nothing"], repeats=1):
        if r["n_layers"] == 256 and r["policy"] == "nothing":
            continue  # 32640 extra layer forwards: minutes, and the curve is clear by 64
        one = r["activation_bytes"]
        print(
            f"{r['n_layers']:>5}{r['policy']:>9}{r['peak_bytes'] // one:>10}"
            f"{r['theory_bytes'] // one:>8}{r['step_s'] * 1e3:>10.1f}{r['extra_forwards']:>11}"
        )


if __name__ == "__main__":
    main()
