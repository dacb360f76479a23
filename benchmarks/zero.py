"""ZeRO: bytes per rank against the formula; step time and peak memory against torch's own.

    python benchmarks/zero.py [--params 4M] [--steps 10]

1. Bytes per rank by category (our accounting of live tensor storages) under
   stages 0-3, world size 4, against the ZeRO formula, each at the point where it
   holds (after the step; stage 0-1 gradients at the backward peak). Target:
   within 2% for parameters, gradients and optimizer state. And the bytes each
   rank sent in a step, counted message by message, against data parallelism's
   2(N-1)/N x S: stages 1-2 equal, stage 3 1.5x.
2. Step time, world size 2, alternating step by step in one run: stage 1 vs
   torch's ZeroRedundancyOptimizer (target <= 1.15), stage 3 vs FSDP2
   fully_shard (target <= 1.0).
3. Peak memory in a step, stage 3 vs FSDP2, both measured by torch's MemTracker.

Beyond stage 3 (`--only beyond` runs just these):

4. ZeRO-Offload and ZeRO-Infinity, world size 2, bf16 compute: step time against the
   same stage without offload (the price of the transfers and the host update), and bytes
   per parameter on the device, the host and the disk, measured beside the formula. On a
   machine without a GPU the device and the host are the same RAM: the placement is
   the code's, exact, and the copies between them are memory copies.
5. The host update: torch's Adam over the offloaded shard (views into the flat fp32
   masters) against torch.optim.Adam on tensors of its own of the same shapes, foreach
   and fused. Target <= 1.0.
6. Infinity's disk traffic per step: bytes read and written, seconds, GB/s.
7. ZeRO++, world size 4 in two nodes of 2 on a two-level simulated topology: bytes across
   nodes per step / ZeRO-3's (target <= 0.3) for each switch and all three, step time,
   and the loss over 50 steps against ZeRO-3 in fp32.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from parcourse import Pool
from parcourse.cli import parse_count
from parcourse.experiments.timing import median_of_slowest
from parcourse.experiments.zero import (
    measured_over_formula,
    memory_by_stage,
    peak_memory,
    step_times,
)
from parcourse.experiments.zero_beyond import (
    Beyond,
    across_against_zero3,
    beyond_run,
    median_update,
    update_times,
)
from parcourse.launch.plan import make_plan
from parcourse.memory import format_bytes
from parcourse.theory import bytes_sent_per_rank, zero_communication_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", default="4M")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument(
        "--only",
        choices=("stages", "beyond"),
        default=None,
        help="run sections 1-3 (stages) or 4-7 (beyond) only",
    )
    parser.add_argument("--loss-steps", type=int, default=50)
    parser.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="sections 1-3: where the ranks compute (auto: a GPU if there is "
        "one; ranks sharing a GPU talk through gloo)",
    )
    args = parser.parse_args()
    params = parse_count(args.params)
    if args.only != "beyond":
        stages(params, args.steps, args.device)
    if args.only != "stages":
        beyond(params, args.steps, args.loss_steps)


def stages(params: int, steps: int, device: str = "auto") -> None:
    plan = make_plan(2, "auto", device, None)
    where = "CPU" if plan.devices[0] == "cpu" else f"{torch.cuda.get_device_name(0)}"
    print(
        f"torch {torch.__version__}, {plan.backend} on {where}, one thread per rank; MLP of "
        f"4 layers, {params / 1e6:g} M parameters, Adam, fp32"
    )

    print(
        "\n1. bytes per rank, world size 4 (largest rank; measured / formula), and bytes "
        "sent per rank in a step / DDP's"
    )
    print(
        f"{'stage':>5}{'params':>22}{'grads':>22}{'optimizer':>22}  within 2%"
        f"{'sent / DDP':>12}{'theory':>8}"
    )
    with Pool(4, timeout=3600, device=device) as pool:
        for stage in (0, 1, 2, 3):
            run = pool.run(memory_by_stage, stage, params, bucket_mb=25.0)
            result = run.results[0]
            worst, cells = 0.0, ""
            for c, (_, largest) in measured_over_formula(run).items():
                worst = max(worst, abs(largest - 1))
                cells += f"{format_bytes(largest * result['theory'][c]):>11} ({largest:.3f})"
            ddp = bytes_sent_per_rank("ring", result["params"] * 4, 4)
            sent = "-" if stage == 0 else f"{max(r['bytes_sent'] for r in run.results) / ddp:.3f}"
            theory = zero_communication_bytes(stage, 1.0, 4) / zero_communication_bytes(0, 1.0, 4)
            print(
                f"{stage:>5}{cells}  {'met' if worst <= 0.02 else 'MISSED':>9}{sent:>12}"
                f"{theory:>8.2f}"
            )

    configs = {
        "DDP + Adam": {"kind": "ddp"},
        "stage 1": {"kind": "zero", "stage": 1},
        "ZeroRedundancyOptimizer": {"kind": "zero_redundancy"},
        "stage 3": {"kind": "zero", "stage": 3},
        "FSDP2 fully_shard": {"kind": "fsdp2"},
    }
    with Pool(2, timeout=3600, device=device) as pool:
        per_rank = pool.run(step_times, configs, steps, params=params).results
        med = {n: median_of_slowest(per_rank, n) for n in configs}
        print("\n2. step time, world size 2 (median, slowest rank)")
        for name, t in med.items():
            print(f"{name:>26}: {t * 1e3:7.1f} ms")
        r1 = med["stage 1"] / med["ZeroRedundancyOptimizer"]
        r3 = med["stage 3"] / med["FSDP2 fully_shard"]
        print(
            f"stage 1 / ZeroRedundancyOptimizer = {r1:.2f} (target <= 1.15: "
            f"{'met' if r1 <= 1.15 else 'MISSED'})"
        )
        print(f"stage 3 / FSDP2 = {r3:.2f} (target <= 1.0: {'met' if r3 <= 1.0 else 'MISSED'})")

        print(
            "\n3. peak memory in a step, world size 2, torch's MemTracker (rank 0"
            f"{', ranks sharing one GPU' if where != 'CPU' else ''})"
        )
        ours = pool.run(peak_memory, {"kind": "zero", "stage": 3}, params).results[0]
        theirs = pool.run(peak_memory, {"kind": "fsdp2"}, params).results[0]
        for key in ("param", "grad", "opt", "act", "temp", "total"):
            print(
                f"{key:>8}: stage 3 {format_bytes(ours.get(key, 0)):>10}   "
                f"FSDP2 {format_bytes(theirs.get(key, 0)):>10}"
            )
        print(f"peak, stage 3 / FSDP2 = {ours['total'] / theirs['total']:.2f}")


def beyond(params: int, steps: int, loss_steps: int) -> None:
    print(
        f"\nBeyond stage 3: torch {torch.__version__}, gloo on CPU (no GPU: device and host "
        f"are the same RAM), MLP of {params / 1e6:g} M parameters, Adam"
    )
    configs = [
        Beyond(stage=2, dtype="bfloat16"),
        Beyond(stage=2, offload="cpu", dtype="bfloat16"),
        Beyond(stage=2, offload="nvme", dtype="bfloat16"),
        Beyond(stage=3, dtype="bfloat16"),
        Beyond(stage=3, offload="cpu", dtype="bfloat16"),
        Beyond(stage=3, offload="cpu", offload_params=True, dtype="bfloat16"),
        Beyond(stage=3, offload="nvme", offload_params=True, dtype="bfloat16"),
    ]
    print(
        "\n4. offload, world size 2, bf16: step time (median of the slowest rank) and bytes "
        "per parameter by placement, measured (formula)"
    )
    print(f"{'configuration':>34}{'ms':>8}{'x none':>8}{'device':>14}{'host':>14}{'disk':>14}")
    disks = {}
    with Pool(2, timeout=3600) as pool:
        base: dict[int, float] = {}
        for s in configs:
            results = pool.run(beyond_run, s, params, steps=steps + 1).results
            t = max(statistics.median(r["seconds"][1:]) for r in results)
            base.setdefault(s.stage, t)
            r = results[0]
            cells = ""
            for where in ("device", "host", "disk"):
                got = sum(r["placement"][where].values()) / r["params"]
                want = sum(r["formula"][where].values()) / r["params"] if r["formula"] else None
                cells += f"{got:>7.2f} ({want:.2f})" if want is not None else f"{got:>14.2f}"
            print(f"{s.label():>34}{t * 1e3:>8.1f}{t / base[s.stage]:>8.2f}{cells}")
            if r["disk"]:
                disks[s.label()] = (r["disk"], r["params"], t)

        print("\n5. the host update, world size 2 (median of the slowest rank)")
        per_rank = pool.run(update_times, params, steps=steps).results
        med = {n: median_update(per_rank, n) for n in per_rank[0]}
        for name, t in med.items():
            print(f"{name:>22}: {t * 1e3:7.2f} ms")
        for way in ("foreach", "fused"):
            ratio = med[f"offloaded, {way}"] / med[f"Adam {way}"]
            print(
                f"offloaded / Adam {way} = {ratio:.2f} (target <= 1.0: "
                f"{'met' if ratio <= 1.0 else 'MISSED'})"
            )

    print("\n6. Infinity: disk traffic per step (rank 0; the first step reads nothing)")
    for label, (disk, n, t) in disks.items():
        per = disk["steps"]
        written = disk["bytes_written"] / per
        print(
            f"{label:>34}: read {format_bytes(disk['bytes_read'] / per)} and wrote "
            f"{format_bytes(written)} a step ({written / n:.2f} bytes/param), "
            f"{disk['read_s'] / per * 1e3:.1f} ms reading and "
            f"{disk['write_s'] / per * 1e3:.1f} ms writing (on threads, beside the update) in a "
            f"{t * 1e3:.0f} ms step; {disk['read_GBps']:.2f} GB/s read, "
            f"{disk['write_GBps']:.2f} GB/s written"
        )

    print(
        "\n7. ZeRO++, world size 4, nodes of 2, simulated links (inside 20 us, 4 GB/s; "
        "between 1000 us, 0.1 GB/s), fp32"
    )
    link = {"between_us": 1000.0, "between_GBps": 0.1}
    small = max(params // 8, 200_000)
    plus = {
        "ZeRO-3": Beyond(**link),
        "qwZ": Beyond(quantized_weights=True, **link),
        "hpZ": Beyond(hpz=True, **link),
        "qgZ": Beyond(quantized_gradients=True, **link),
        "qwZ + hpZ + qgZ": Beyond(
            quantized_weights=True, hpz=True, quantized_gradients=True, **link
        ),
    }
    print(
        f"{'':>16}{'across/step':>14}{'formula':>12}{'/ ZeRO-3':>10}{'ms/step':>10}"
        f"{'loss diff':>11}"
    )
    with Pool(4, timeout=3600) as pool:
        losses: dict[str, list[float]] = {}
        for name, s in plus.items():
            run = pool.run(beyond_run, s, small, steps=loss_steps)
            a = across_against_zero3(run.results, 4)
            t = max(statistics.median(r["seconds"][1:]) for r in run.results)
            losses[name] = run.results[0]["losses"]
            base = losses["ZeRO-3"]  # the loss falls 100x: measure against where it starts
            diff = max(abs(x - y) for x, y in zip(losses[name], base)) / base[0]
            print(
                f"{name:>16}{format_bytes(a['measured']):>14}{format_bytes(a['formula']):>12}"
                f"{a['ratio']:>10.3f}{t * 1e3:>10.1f}{diff:>10.2%}"
            )
        ratio = across_against_zero3(
            pool.run(beyond_run, plus["qwZ + hpZ + qgZ"], small, steps=1).results, 4
        )["ratio"]
        print(
            f"bytes across nodes, all three / ZeRO-3 = {ratio:.3f} (target <= 0.3: "
            f"{'met' if ratio <= 0.3 else 'MISSED'}); loss diff: the largest difference "
            f"from ZeRO-3's loss over {loss_steps} steps, over ZeRO-3's first loss"
        )


if __name__ == "__main__":
    main()
