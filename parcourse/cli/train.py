"""`python -m parcourse train`: the GPT trained on the standard library's source (real
text, as bytes) on a dp x tp x pp mesh, with warm-up and cosine learning rate, clipping,
validation loss, and text sampled from the trained weights at the end."""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING, Any

from parcourse.cli.options import mesh_against_launcher, plan_from, plan_options, ranks
from parcourse.launch import launch
from parcourse.parts import CORE_AXES, PART_FIELDS

if TYPE_CHECKING:
    from parcourse.train import TrainSettings

HELP = "train the GPT on real text (the standard library's source) on a 3D mesh"


def add_arguments(p: argparse.ArgumentParser) -> None:
    from parcourse.train import TrainSettings

    d = TrainSettings()
    # --plan, and --dp ... --zero from the plan's fields (what TrainSettings holds of it)
    plan_options(p, d.plan, (*CORE_AXES, *PART_FIELDS, "schedule", "microbatches", "zero"))
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--batch", type=int, default=d.batch, help="global, in sequences")
    p.add_argument("--block-size", type=int, default=d.block_size, help="bytes a sequence")
    p.add_argument("--layers", type=int, default=d.layers)
    p.add_argument("--width", type=int, default=d.width)
    p.add_argument("--heads", type=int, default=d.heads)
    p.add_argument(
        "--experts",
        type=int,
        default=d.experts,
        help="every block's MLP a mixture of this many experts (0: dense)",
    )
    p.add_argument("--top-k", type=int, default=d.top_k, help="experts a token goes to")
    p.add_argument("--lr", type=float, default=d.lr, help="peak, after the warm-up")
    p.add_argument("--clip", type=float, default=d.clip)
    p.add_argument("--eval-every", type=int, default=d.eval_every)
    p.add_argument("--corpus", default="runs/corpus", help="where the corpus is built once")
    p.add_argument("--out", default=None, help="a run directory: checkpoints go to OUT/checkpoints")
    p.add_argument(
        "--save-every",
        type=int,
        default=d.save_every,
        help="steps between checkpoints (0: only at the end); needs --out",
    )
    p.add_argument(
        "--async-save",
        action="store_true",
        help="write checkpoints in the background while training goes on",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="start from the newest checkpoint in --out, on this mesh (after a "
        "restart by torchrun --max-restarts, without being asked)",
    )
    p.add_argument(
        "--change",
        default=None,
        metavar="SETTING[,SETTING]",
        type=lambda text: [t.strip() for t in text.split(",") if t.strip()],
        help="with --resume: settings that may differ from the saved run's "
        "(e.g. steps, for a longer run); the others must match",
    )
    p.add_argument(
        "--kill",
        default=None,
        metavar="RANK:STEP",
        help="a fault on purpose: that rank kills itself (SIGKILL) when it "
        "reaches that step (not again after a restart)",
    )
    p.add_argument(
        "--fault-tolerant",
        action="store_true",
        help="dp's replicas under a quorum a step (lesson 13): a replica killed by --kill "
        "is dropped, the step retried by the others, a new one healed from a live peer; "
        "dp only (tp, pp, cp, ep 1, no ZeRO)",
    )
    p.add_argument("--prompt", default="def ", help="the start of the sampled text")
    p.add_argument("--timeout", type=float, default=1800.0)


def _settings(args: argparse.Namespace) -> TrainSettings:
    from parcourse.train import TrainSettings

    return TrainSettings(
        plan=args.parallel_plan,
        steps=args.steps,
        batch=args.batch,
        block_size=args.block_size,
        layers=args.layers,
        width=args.width,
        heads=args.heads,
        lr=args.lr,
        experts=args.experts,
        top_k=args.top_k,
        min_lr=min(args.lr, 3e-4),
        clip=args.clip,
        eval_every=args.eval_every,
        save_every=args.save_every,
        async_save=args.async_save,
    )


def check(args: argparse.Namespace) -> str | None:
    if isinstance(read := plan_from(args), str):
        return read
    settings = _settings(args)
    if problems := settings.problems():
        return "; ".join(problems)
    if problem := mesh_against_launcher(args.parallel_plan):
        return problem
    if args.clip <= 0:
        return f"--clip must be positive, got {args.clip}"
    if args.fault_tolerant and (problem := _fault_tolerant_problem(args, settings)):
        return problem
    if (args.resume or args.save_every) and args.out is None:
        return "--resume and --save-every need --out (the run's directory)"
    if args.save_every < 0:
        return f"--save-every must be 0 or more, got {args.save_every}"
    if args.resume and (problem := _resumable(args, settings)):
        return problem
    if args.kill is not None:
        try:
            rank, step = _kill(args)
        except ValueError:
            return f"--kill takes RANK:STEP (two whole numbers), got {args.kill!r}"
        world = settings.world_size
        if not (0 <= rank < world and 0 <= step < args.steps):
            return (
                f"--kill {args.kill}: the rank must be below {world} and the step below "
                f"{args.steps}"
            )
    return None


# What a resumed run must share with the run it resumes: everything that shapes its
# weights (the mesh, the schedule and ZeRO may change: a checkpoint loads on any layout).
RESUMED_ALIKE = (
    "steps",
    "batch",
    "block_size",
    "layers",
    "width",
    "heads",
    "lr",
    "min_lr",
    "warmup",
    "weight_decay",
    "clip",
    "seed",
)


def _resumable(args: argparse.Namespace, settings: Any) -> str | None:
    """`--resume`, before any rank starts: the newest checkpoint that can be loaded (a
    newer one that cannot is named on stderr, in one line), and every setting that shapes
    the weights as it was saved, unless `--change` names it."""
    import dataclasses

    from parcourse.checkpoint import check_compatible, read_meta, resume_problem

    root = f"{args.out}/checkpoints"
    found, said = resume_problem(root)
    if found is None:
        return said or f"--resume: no checkpoint under {root}"
    if said is not None:
        print(said, file=sys.stderr)
    meta = read_meta(found)
    try:
        check_compatible(meta, settings.config)
    except ValueError as e:
        return f"--resume from {found}: {e}"
    saved = meta["extra"].get("settings", {})
    changed = set(args.change or ())
    unknown = changed - set(RESUMED_ALIKE)
    if unknown:
        return (
            f"--change {', '.join(sorted(unknown))}: what may change on resuming is one "
            f"of {', '.join(RESUMED_ALIKE)}"
        )
    now = dataclasses.asdict(settings)
    differ = [
        f"--{k.replace('_', '-')} {now[k]} (saved: {saved[k]})"
        for k in RESUMED_ALIKE
        if k in saved and saved[k] != now[k] and k not in changed
    ]
    if differ:
        return (
            f"--resume from {found} with other settings: {', '.join(differ)}; give "
            f"--change {','.join(k.split()[0][2:].replace('-', '_') for k in differ)} "
            "to change them on purpose, or the saved values"
        )
    return None


def _fault_tolerant_problem(args: argparse.Namespace, s: TrainSettings) -> str | None:
    plan = s.plan
    if plan.gpus != plan.dp or plan.zero or s.experts:
        return (
            f"--fault-tolerant trains dp's replicas only, one process each: give --plan "
            f"'dp{plan.dp} tp1 pp1' (not {plan.label()}), no --zero, no --experts"
        )
    if args.out is not None or args.resume:
        return "--fault-tolerant keeps no checkpoint: a new replica heals from a peer (no --out)"
    if os.environ.get("WORLD_SIZE") is not None:
        return "--fault-tolerant starts its replicas itself: run it without torchrun"
    return None


def _kill(args: argparse.Namespace) -> tuple[int, int]:
    rank, step = args.kill.split(":")
    return int(rank), int(step)


class _Progress:
    """A tqdm bar over the run's steps, from what the ranks report (`read_step_status`):
    the loss, tokens per second since the first step seen and the MFU they make, beside
    the planner's prediction of both for this mesh here."""

    def __init__(self, s: Any) -> None:
        from tqdm import tqdm

        from parcourse.planner import measure_flops
        from parcourse.train import planned

        self.tokens = s.batch * s.block_size
        self.plan = planned(s, measure_flops(s.config))
        self.bar = tqdm(
            total=s.steps, unit="step", desc="train", file=sys.stderr, dynamic_ncols=True
        )
        self.first: tuple[int, float] | None = None

    def update(self, statuses: list[str], elapsed: float) -> None:
        from parcourse.train import read_step_status

        found = [r for r in map(read_step_status, statuses) if r is not None]
        if not found:
            return
        done, loss = min(d for d, _ in found), found[0][1]  # steps every rank finished
        if self.first is None:
            self.first = (done, elapsed)
        rate, plan = "", self.plan
        if done > self.first[0] and elapsed > self.first[1]:
            per_s = (done - self.first[0]) * self.tokens / (elapsed - self.first[1])
            rate = f", {per_s:,.0f} tokens/s"
            if plan is not None:
                mfu = per_s * plan["flops_per_token"] / plan["ranks_flops"]
                rate += f", MFU {mfu:.0%} (planned {plan['tokens_per_s']:,.0f}, {plan['mfu']:.0%})"
        self.bar.n = done
        self.bar.set_postfix_str(f"loss {loss:.3f}{rate}", refresh=False)
        self.bar.refresh()

    def __enter__(self) -> _Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.bar.close()


def _restarted() -> bool:
    """Whether torchrun (--max-restarts) has restarted this job's workers."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0


def run(args: argparse.Namespace) -> int:
    from parcourse.corpus import build_corpus
    from parcourse.train import sample, train_on_corpus

    settings = _settings(args)
    corpus = build_corpus(args.corpus)
    if args.fault_tolerant:
        return _run_fault_tolerant(args, settings, str(corpus.directory))
    where = ranks(argparse.Namespace(world_size=settings.world_size))
    from parcourse.checkpoint import latest

    restarted = _restarted()
    resume = args.resume or (
        restarted and args.out is not None and latest(f"{args.out}/checkpoints") is not None
    )
    kill = _kill(args) if args.kill is not None and not restarted else None
    run_args = (settings, str(corpus.directory), args.out, resume, kill)
    if where.external:
        trained = launch(train_on_corpus, where.world_size, *run_args, timeout=args.timeout)
    else:
        from parcourse.launch import Pool

        with Pool(where.world_size, timeout=args.timeout) as pool, _Progress(settings) as bar:
            trained = pool.run(train_on_corpus, *run_args, on_progress=bar.update)
    if where.quiet:
        return 0
    s = settings
    print(
        f"train       {s.plan.label()} = {where.world_size} ranks; "
        f"GPT {s.layers} blocks, width {s.width}, "
        f"{s.block_size} bytes a sequence, global batch {s.batch}; AdamW, peak lr "
        f"{s.lr:g}, warm-up {s.warmup}, cosine, clip {s.clip:g}"
    )
    print(
        f"corpus      {corpus.meta['files']['train']} + {corpus.meta['files']['val']} files "
        f"of Python {corpus.meta['python']}'s standard library, "
        f"{corpus.meta['bytes']['train'] / 1e6:.1f} + {corpus.meta['bytes']['val'] / 1e6:.1f}"
        f" MB (train + validation), sha256 {corpus.meta['sha256'][:16]}"
    )
    first = trained.results[0]
    if first["resumed_from"]:
        print(f"resumed     from {first['resumed_from']}, after step {first['started_at']}")
    for path in first["saved"]:
        print(f"saved       {path}")
    losses = first["history"]
    evals = trained.results[0]["history"]
    tokens = s.batch * s.block_size
    print(f"\n{'step':>6} {'lr':>9} {'loss':>8} {'val loss':>9} {'grad norm':>10} {'tokens/s':>9}")
    for mine, ev in zip(losses, evals):
        if "val_loss" not in ev and mine["step"] % max(1, s.eval_every // 2):
            continue
        seconds = max(r["history"][mine["step"]]["seconds"] for r in trained.results)
        val = f"{ev['val_loss']:>9.3f}" if ev.get("val_loss") is not None else f"{'':>9}"
        print(
            f"{mine['step']:>6} {mine['lr']:>9.2e} {mine['loss']:>8.3f} {val} "
            f"{mine['grad_norm']:>10.3f} {tokens / seconds:>9.0f}"
        )
    state, config = trained.results[0]["state"], s.config
    print(f"\nsample      greedy, after {args.prompt!r}:")
    print(sample(state, config, args.prompt, 160))
    print(f"\nsample      temperature 0.8, after {args.prompt!r}:")
    print(sample(state, config, args.prompt, 160, temperature=0.8))
    return 0


def _run_fault_tolerant(args: argparse.Namespace, s: TrainSettings, corpus: str) -> int:
    """dp's replicas under `parcourse.fault`'s coordinator: the quorum of each round, then
    the losses of replica 0's committed steps and its validation loss."""
    from parcourse.fault import run_replicas
    from parcourse.fault.gpt import train_gpt_replica

    kill = [_kill(args)] if args.kill is not None else []
    run = run_replicas(
        train_gpt_replica, s.plan.dp, s, corpus, kill=kill, replace=True, timeout=args.timeout
    )
    print(
        f"train       {s.plan.dp} fault-tolerant replicas; GPT {s.layers} blocks, width {s.width}"
    )
    for e in run.deaths():
        print(f"died        replica {e.replica} (exit {e.exitcode}); a new one started")
    print(f"\n{'round':>6} {'members':<14} {'commit':<7} {'step':>5}  heal")
    for q in run.rounds:
        heal = ", ".join(f"{t} <- {src}" for t, src in q.heal.items())
        commit = "yes" if q.commit else "no"
        print(f"{q.round:>6} {str(q.members):<14} {commit:<7} {q.step:>5}  {heal}")
    first = run.results[min(run.results)]
    for h in first["healed"]:
        print(
            f"healed      replica {h['target']} from {h['source']}: "
            f"{h['nbytes'] / 2**20:.2f} MiB in {h['seconds'] * 1e3:.0f} ms"
        )
    print(f"\n{'step':>6} {'loss':>8} {'members':<14}")
    for h in first["history"]:
        if h["step"] % max(1, s.eval_every // 2) == 0 or h["step"] == s.steps - 1:
            print(f"{h['step']:>6} {h['loss']:>8.3f} {h['members']}")
    print(f"\nval loss    {first['val_loss']:.3f} (replica {min(run.results)}'s final weights)")
    return 0
