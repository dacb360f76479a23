"""Does the suite catch a wrong line? One-line mutations of the library, each with the tests
that must fail on it: each is applied in a scratch copy of the working tree, those tests run
there, and the mutation is "killed" when they fail, "SURVIVED" when they pass.

    python benchmarks/mutations.py [--only NAME ...] [--keep]

Run by hand (each mutation runs its tests, about ten minutes in all on 2 cores), not in
CI. A survivor is a hole in the suite: write the test that kills it. Exit status 1 when
any survives, 2 when a mutation no longer applies (its line changed: update the list).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Mutation:
    name: str
    path: str  # in the repository
    old: str  # must occur exactly once
    new: str
    tests: tuple[str, ...]  # pytest arguments


MUTATIONS = [
    Mutation(
        "DDP from scratch sums instead of averaging",
        "parcourse/data_parallel/naive.py",
        "p.grad.div_(self.world_size)",
        "p.grad.div_(1)",
        ("tests/test_data_parallel.py", "-k", "naive"),
    ),
    Mutation(
        "bucketed DDP sums instead of averaging",
        "parcourse/data_parallel/bucketed.py",
        "view_as(p), world_size, out=p.grad)",
        "view_as(p), 1, out=p.grad)",
        ("tests/test_data_parallel.py", "-k", "bucketed"),
    ),
    Mutation(
        "the ring keeps the left's partial sum instead of adding to it",
        "parcourse/comm/ring.py",
        "reduce_into(flat[c:d], incoming, op)  # add what the left has summed",
        "flat[c:d] = incoming",
        ("tests/test_collectives.py",),
    ),
    Mutation(
        "a tied weight's gradient leaves out this rank's own part",
        "parcourse/pipeline/tied.py",
        "grad += w.grad.detach()",
        "grad += 0 * w.grad.detach()",
        ("tests/test_pipeline_runtime.py", "-k", "gpt"),
    ),
    Mutation(
        "1F1B warms up with one forward too many",
        "parcourse/pipeline/schedule.py",
        "warmup = min(p - s - 1, m)\n        acts = [F(s, i) for i in range(warmup)]",
        "warmup = min(p - s, m)\n        acts = [F(s, i) for i in range(warmup)]",
        ("tests/test_pipeline_schedules.py",),
    ),
    Mutation(
        "recomputation draws fresh random numbers",
        "parcourse/checkpointing.py",
        "torch.set_rng_state(self.cpu)",
        "pass",
        ("tests/test_checkpointing.py",),
    ),
    Mutation(
        "ZeRO's clipping takes each rank's shard for the whole model",
        "parcourse/zero/clip.py",
        "dist.all_reduce(total, group=group)\n        for g in kept:",
        "for g in kept:",
        ("tests/test_zero.py", "-k", "clip"),
    ),
    Mutation(
        "the 3D step's clipping takes the 1-norm",
        "parcourse/zero/clip.py",
        "total += g.double().square().sum()",
        "total += g.double().abs().sum()",
        ("tests/test_hybrid.py", "-k", "clip"),
    ),
    Mutation(
        "ZeRO's gradient shards averaged over twice the ranks (half a step)",
        "parcourse/zero/stage1.py",
        ".div_(self.world_size)\n            .to(unit.master.device",
        ".div_(2 * self.world_size)\n            .to(unit.master.device",
        ("tests/test_zero.py", "-k", "mixed_precision_computes"),
    ),
    Mutation(
        "the cosine runs one step ahead",
        "parcourse/train.py",
        "progress = min(1.0, (step - s.warmup) / span)",
        "progress = min(1.0, (step + 1 - s.warmup) / span)",
        ("tests/test_train.py", "-k", "learning_rate"),
    ),
    Mutation(
        "a resumed loader starts its epoch again",
        "parcourse/corpus.py",
        'self.epoch, self.position = state["epoch"], state["position"]',
        'self.epoch, self.position = state["epoch"], 0',
        ("tests/test_corpus.py", "-k", "resume"),
    ),
    Mutation(
        "a loader that never reshuffles",
        "parcourse/corpus.py",
        "manual_seed(self.seed * 1_000_003 + self.epoch)",
        "manual_seed(self.seed)",
        ("tests/test_corpus.py", "-k", "epoch"),
    ),
    Mutation(
        "every group crosses nodes",
        "parcourse/mesh.py",
        "ranks_per_node)) > 1",
        "ranks_per_node)) >= 1",
        ("tests/test_plan.py", "-k", "crosses"),
    ),
    Mutation(
        "the planner shards the optimizer only from ZeRO-2",
        "parcourse/theory/zero.py",
        '"optimizer": num_params * per["optimizer"] / (n if stage >= 1 else 1)',
        '"optimizer": num_params * per["optimizer"] / (n if stage >= 2 else 1)',
        ("tests/test_planner.py", "-k", "zero or memory"),
    ),
    Mutation(
        "the 3D step's recompute is priced as its input alone",
        "parcourse/planner/predict.py",
        "            h - loss - (x if ls[0] > 0 else 0)\n",
        "            0 * (h - loss - (x if ls[0] > 0 else 0))\n",
        ("tests/test_planner.py", "-k", "memory or recompute"),
    ),
    Mutation(
        "ring attention merges two blocks by the larger one's sum alone",
        "parcourse/context_parallel/attention.py",
        "lse = torch.logaddexp(lse_a, lse_b)",
        "lse = torch.maximum(lse_a, lse_b)",
        ("tests/test_context_parallel.py", "-k", "equals_one_process and 2-even"),
    ),
    Mutation(
        "the median's interval from the normal approximation",
        "benchmarks/collectives.py",
        "<= 0.025:",
        "<= 0.04:",
        ("tests/test_benchmarks.py", "-k", "interval"),
    ),
    Mutation(
        "Switch's balancing loss over the fraction of tokens, not of assignments",
        "parcourse/experts/routing.py",
        "share = counts.to(probs.dtype) / chosen.numel()  # f_e",
        "share = counts.to(probs.dtype) / chosen.shape[0]  # f_e",
        ("tests/test_experts.py", "-k", "by_hand"),
    ),
    Mutation(
        "DeepSeek-V3's bias moves towards the busiest expert",
        "parcourse/experts/routing.py",
        "torch.sign(load.mean() - load)",
        "torch.sign(load - load.mean())",
        ("tests/test_experts.py", "-k", "by_hand"),
    ),
    Mutation(
        "the capacity rounded down instead of up",
        "parcourse/experts/routing.py",
        "return math.ceil(factor * tokens * top_k / experts)",
        "return math.floor(factor * tokens * top_k / experts)",
        ("tests/test_experts.py", "-k", "by_hand"),
    ),
]


def scratch_copy(into: Path) -> None:
    """The working tree's tracked and untracked (not ignored) files."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout
    for name in filter(None, listed.decode().split("\0")):
        src = REPO / name
        if src.is_file():
            dst = into / name
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--only",
        nargs="+",
        metavar="NAME",
        default=None,
        help="mutations whose name contains one of these words",
    )
    parser.add_argument("--keep", action="store_true", help="keep the scratch copy")
    args = parser.parse_args()
    chosen = [m for m in MUTATIONS if args.only is None or any(w in m.name for w in args.only)]
    if not chosen:
        parser.error(f"no mutation matches {args.only}")
    root = Path(tempfile.mkdtemp(prefix="parcourse-mutations-"))
    scratch_copy(root)
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    found = subprocess.run(
        [sys.executable, "-c", "import parcourse; print(parcourse.__file__)"],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
    ).stdout.strip()
    if not found.startswith(str(root)):
        print(f"the scratch copy's parcourse is not the one imported ({found})", file=sys.stderr)
        return 2
    survived, stale = [], []
    print(f"{'mutation':<62} {'result':>9} {'s':>6}")
    for m in chosen:
        path = root / m.path
        original = path.read_text()
        if original.count(m.old) != 1:
            print(
                f"{m.name:<62} {'STALE':>9}  ({m.old!r} is in {m.path} "
                f"{original.count(m.old)} times)"
            )
            stale.append(m)
            continue
        path.write_text(original.replace(m.old, m.new))
        start = time.perf_counter()
        done = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *m.tests],
            cwd=root,
            env=env,
            capture_output=True,
            text=True,
            timeout=1200,
        )
        path.write_text(original)
        result = (
            "killed"
            if done.returncode == 1
            else ("SURVIVED" if done.returncode == 0 else f"error {done.returncode}")
        )
        if done.returncode == 0:
            survived.append(m)
        print(f"{m.name:<62} {result:>9} {time.perf_counter() - start:>6.0f}", flush=True)
        if done.returncode not in (0, 1):
            print(done.stdout[-2000:], done.stderr[-2000:])
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    print(
        f"\n{len(chosen) - len(survived) - len(stale)} killed, {len(survived)} survived, "
        f"{len(stale)} no longer apply"
    )
    return 2 if stale else 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
