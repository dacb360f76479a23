"""Where tensor and pipeline parallelism belong on a two-level network, measured beside
the model.

    python benchmarks/hybrid.py [--steps 5] [--repeats 3] [--only tp|pp|torch]

The GPT on dp x tp = 2 x 2, then on dp x pp = 2 x 2 (4 ranks, 2 a node; gloo, one thread
per rank) on a simulated Topology (inside a node: 20 us, 4 GB/s; between nodes: 5 ms,
0.1 GB/s), the same step with the tp (pp) group inside a node and across nodes (dp takes
the other links), taking turns in one run; the median of the slowest rank, beside the
alpha-beta model's communication time (the axis' messages plus dp's all-reduce, each on
its link). Target: TP across nodes clearly slower, by about what the model predicts; for
pp, the difference the model predicts, whichever way it goes.

torch: our Hybrid against PyTorch's own composition of the same GPT (4 blocks, d_model 64,
16 tokens, global batch 16, 2 microbatches per replica, 1F1B, Adam) on dp x tp x pp =
2 x 2 x 2 (8 ranks, gloo on CPU, one thread per rank, no simulated link), as torchtitan
composes it: DTensor `parallelize_module` on the mesh's tp axis, `PipelineStage` +
`Schedule1F1B` over pp, and over dp `replicate` (against ours replicated, ZeRO 0) or FSDP2
`fully_shard` (against our ZeRO-1), every axis one torch DeviceMesh (`Mesh.device_mesh`).
Taking turns in one run; the median of the slowest rank, the largest rank's bytes
(parameters + gradients + optimizer state, from live tensors; gradients as the schedule
left them: ours before dp's reduction, torch's after it, FSDP2's sharded), and both
losses at each step. Target: ours / torch <= 1.0. Should torch's three-axis composition
fail, its exception is printed and the pairs dp x tp and dp x pp (4 ranks) compared.
"""

from __future__ import annotations

import argparse
import math

from parcourse import Pool
from parcourse.comm import SimulatedLink, Topology
from parcourse.experiments.hybrid import PLACEMENTS, placement_predictions, placement_step_times
from parcourse.experiments.timing import median_of_slowest
from parcourse.experiments.torch_3d import compare_steps

# Our Hybrid beside torch's composition: (label, torch's dp wrapper, our ZeRO stage).
AGAINST_TORCH = (("replicate / zero 0", "replicate", 0), ("fully_shard / zero 1", "fsdp", 1))
THREE_AXES = {"dp": 2, "tp": 2, "pp": 2}
PAIRS = ({"dp": 2, "tp": 2}, {"dp": 2, "pp": 2})


def placements(args: argparse.Namespace) -> None:
    """The tp and pp placements on the simulated two-level network."""
    topology = Topology.of(
        2, between=SimulatedLink.of(latency_us=args.between_latency_us, bandwidth_GBps=0.1)
    )
    print(
        "GPT 2 blocks, d_model 64, 16 tokens, batch 8, one microbatch; 4 ranks, 2 a node; "
        f"inside {topology.inside.latency_s * 1e6:g} us, "
        f"{topology.inside.bandwidth_Bps / 1e9:g} GB/s; between "
        f"{topology.between.latency_s * 1e6:g} us, {topology.between.bandwidth_Bps / 1e9:g} "
        "GB/s"
    )
    with Pool(4, timeout=600) as pool:
        for axis in [args.only] if args.only else list(PLACEMENTS):
            names = list(PLACEMENTS[axis])
            print(f"\ndp 2 x {axis} 2\n{'placement':<20}{'step (ms)':>12}{'model comm (ms)':>18}")
            for _ in range(args.repeats):
                results = pool.run(placement_step_times, topology, args.steps, axis=axis).results
                per_rank = [r["times"] for r in results]
                model = placement_predictions(
                    topology, max(r["param_bytes"] for r in results), axis=axis
                )
                med = {name: median_of_slowest(per_rank, name) for name in names}
                for name in names:
                    print(f"{name:<20}{med[name] * 1e3:>12.1f}{model[name] * 1e3:>18.1f}")
                gap = med[names[1]] - med[names[0]]
                predicted = model[names[1]] - model[names[0]]
                print(f"{'across - inside':<20}{gap * 1e3:>12.1f}{predicted * 1e3:>18.1f}")


def _shape(shape: dict[str, int]) -> str:
    return " x ".join(f"{axis} {size}" for axis, size in shape.items())


def _held(memory: dict[str, int]) -> str:
    """Parameters + gradients + optimizer state = total, in KiB."""
    kib = [memory[k] / 1024 for k in ("params", "grads", "optimizer")]
    return "+".join(f"{k:.0f}" for k in kib) + f"={sum(kib):.0f}"


def _failure(error: str) -> str:
    """An exception's first line, and the last frame of its traceback (where it rose)."""
    lines = error.splitlines()
    frames = [line.strip() for line in lines if line.strip().startswith("File ")]
    return lines[0] + (f"\n    at {frames[-1]}" if frames else "")


def against_torch(args: argparse.Namespace) -> None:
    """Our Hybrid and torch's composition of the same GPT, taking turns on each shape."""
    print(
        f"\nours (Hybrid) against torch's composition (parallelize_module + PipelineStage/"
        f"Schedule1F1B + replicate or fully_shard on one DeviceMesh); GPT 4 blocks, "
        f"d_model 64, 16 tokens, global batch 16, 2 microbatches a replica, Adam; gloo on "
        f"CPU; median of {args.steps} steps (slowest rank); KiB held by the largest rank: "
        "params+grads+optimizer=total"
    )
    header = (
        f"{'shape':<20}{'dp: torch / ours':<22}{'ours ms':>9}{'torch ms':>10}"
        f"{'ours/torch':>12}  {'ours KiB':<20}{'torch KiB':<20}"
    )
    losses: list[tuple[str, dict[str, list[float]]]] = []
    shapes = [THREE_AXES]
    while shapes:
        shape = shapes.pop(0)
        failed = False
        # CPU ranks even where there is a GPU: ranks sharing one talk through gloo, and
        # torch's pipelining sends CUDA tensors point to point, which gloo cannot do
        # (seen on an H200: the rank aborts in gloo's writev).
        with Pool(math.prod(shape.values()), timeout=600, device="cpu") as pool:
            for label, data_parallel, zero in AGAINST_TORCH:
                results = pool.run(
                    compare_steps, shape, args.steps, data_parallel=data_parallel, zero=zero
                ).results
                if results[0]["error"] is not None:
                    print(
                        f"{_shape(shape)}, {label}: torch's composition failed on gloo "
                        f"CPU: {_failure(results[0]['error'])}"
                    )
                    failed = True
                    continue
                if header:
                    print(header)
                    header = ""
                times = [r["times"] for r in results]
                ours, theirs = (median_of_slowest(times, name) for name in ("ours", "torch"))
                held = {
                    name: max((r["memory"][name] for r in results), key=lambda m: sum(m.values()))
                    for name in ("ours", "torch")
                }
                print(
                    f"{_shape(shape):<20}{label:<22}{ours * 1e3:>9.1f}{theirs * 1e3:>10.1f}"
                    f"{ours / theirs:>12.2f}  {_held(held['ours']):<20}"
                    f"{_held(held['torch']):<20}"
                )
                last = next(r for r in results if r["losses"]["ours"][0] is not None)
                losses.append((f"{_shape(shape)}, {label}", last["losses"]))
        if failed and shape == THREE_AXES:
            shapes = list(PAIRS)
    print("target: ours/torch <= 1.0")
    for label, both in losses:
        print(
            f"\nlosses (mean over the global batch), {label}\n{'step':>5}{'ours':>10}{'torch':>10}"
        )
        for step, (a, b) in enumerate(zip(both["ours"], both["torch"])):
            print(f"{step:>5}{a:>10.4f}{b:>10.4f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--between-latency-us",
        type=float,
        default=5000.0,
        help="between nodes (5 ms: more than what 4 ranks sharing 2 cores "
        "hide under each other's compute)",
    )
    parser.add_argument("--only", choices=[*sorted(PLACEMENTS), "torch"], default=None)
    args = parser.parse_args()
    if args.only != "torch":
        placements(args)
    if args.only in (None, "torch"):
        against_torch(args)


if __name__ == "__main__":
    main()
