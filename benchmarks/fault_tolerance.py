"""A replica lost mid-run: per-step recovery against torchft and against restart + checkpoint.

    python benchmarks/fault_tolerance.py [--steps 30] [--kill-step 15] [--replicas 4]

The course's GPT (lesson 10's settings, dp only) on the corpus of lesson 10, 4 replicas
on this machine, replica 1 killed (SIGKILL, after its backward) at a fixed step, three
ways, in one run:

1. this course's per-step recovery (`parcourse.fault`): the quorum drops the dead
   replica, the step is retried by the survivors, a replacement heals from a peer;
2. torchft (its Lighthouse, a Manager per replica, its DistributedDataParallel, gloo):
   the same model, rows, optimizer and kill, torchft's defaults but the collective
   timeout (10 s, as ours); its DDP all-reduces inside the backward, so its replica dies
   after the backward, when its gradients are already in the step (killed before,
   torchft 0.2.0's survivors stop at an AssertionError in its DDP's communication hook);
3. `torchrun --max-restarts 1` over `parcourse train --save-every 10`: every worker
   started again, the newest checkpoint read.

For each: committed steps lost (the steps trained again after the kill), seconds from
the kill to the next committed step and to the killed step committed, the whole run's
seconds, the last step's loss (on replica 0's rows) and the validation loss. Target:
per-step recovery loses 0 committed steps and recovers at least 5x faster than restart +
checkpoint.
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing
import os
import queue
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from parcourse.checkpoint import latest, read_meta
from parcourse.corpus import build_corpus
from parcourse.fault import run_replicas
from parcourse.fault.gpt import cross_entropy, rows_at, train_gpt_replica
from parcourse.train import TrainSettings, evaluate, learning_rate

KILLED = 1  # the replica killed


def recovery(history: list[dict[str, Any]], killed_at: float, kill_step: int) -> dict[str, float]:
    """From one survivor's history (each committed step with `at`, when it committed):
    steps trained again, seconds to the next commit and to the killed step's."""
    after = [h for h in history if h["at"] > killed_at]
    back = next(h for h in after if h["step"] == kill_step)
    return {
        "lost": kill_step - after[0]["step"],
        "next_s": after[0]["at"] - killed_at,
        "back_s": back["at"] - killed_at,
    }


def ours(s: TrainSettings, corpus: str, kill_step: int) -> dict[str, Any]:
    began = time.perf_counter()
    run = run_replicas(
        train_gpt_replica, s.plan.dp, s, corpus, kill=[(KILLED, kill_step)], replace=True
    )
    seconds = time.perf_counter() - began
    survivor = run.results[0]
    history = [{**h, "at": h["committed_at"]} for h in survivor["history"]]
    healed = [h for h in survivor["healed"] if h["target"] == KILLED]
    note = (
        f"healed {healed[0]['nbytes'] / 2**20:.2f} MiB in {healed[0]['seconds'] * 1e3:.0f} ms"
        if healed
        else "no replacement joined"
    )
    return {
        **recovery(history, run.killed_at[KILLED], kill_step),
        "seconds": seconds,
        "loss": history[-1]["loss"],
        "val_loss": survivor["val_loss"],
        "note": note,
    }


def _torchft_replica(
    replica: int, address: str, s: Any, corpus: str, kill: int, out: Any, killed_at: Any
) -> None:
    """One torchft replica group of one rank (a process of its own)."""
    import torch.distributed as dist
    import torchft
    from torchft.manager import Manager

    from parcourse.corpus import ShardedLoader, open_corpus
    from parcourse.models import gpt

    torch.set_num_threads(1)
    data = open_corpus(corpus)
    loader = ShardedLoader(
        data.train, s.block_size, s.batch, replica=replica, replicas=s.plan.dp, seed=s.seed
    )
    model = gpt(s.config, seed=s.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=s.lr, weight_decay=s.weight_decay)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=torchft.ProcessGroupGloo(timeout=datetime.timedelta(seconds=10)),
        min_replica_size=1,
        load_state_dict=lambda sd: (
            model.load_state_dict(sd["model"]),
            opt.load_state_dict(sd["optim"]),
        ),
        state_dict=lambda: {"model": model.state_dict(), "optim": opt.state_dict()},
        replica_id=f"replica_{replica}",
        store_addr="127.0.0.1",
        store_port=store.port,
        rank=0,
        world_size=1,
        lighthouse_addr=address,
        hostname="127.0.0.1",
        timeout=datetime.timedelta(seconds=10),
    )
    ddp = torchft.DistributedDataParallel(manager, model)
    wrapped = torchft.Optimizer(manager, opt)
    history = []
    while manager.current_step() < s.steps:
        step = manager.current_step()
        for group in opt.param_groups:
            group["lr"] = learning_rate(step, s)
        wrapped.zero_grad()  # starts the quorum
        loss = cross_entropy(ddp, *rows_at(loader, step))
        loss.backward()  # torchft's DDP all-reduces in the backward's hooks
        if kill == step:  # after it: killed before, the survivors' hooks fail (see docs)
            killed_at.value = time.time()  # shared memory: written before the kill
            os.kill(os.getpid(), signal.SIGKILL)
        torch.nn.utils.clip_grad_norm_(model.parameters(), s.clip)
        if manager.should_commit():
            opt.step()
            history.append({"step": step, "loss": loss.item(), "at": time.time()})
    state = {k: v.numpy().copy() for k, v in model.state_dict().items()}  # by value
    out.put(("done", replica, history, state))
    manager.shutdown(wait=False)


def peer(s: TrainSettings, corpus: str, kill_step: int) -> dict[str, Any]:
    """torchft on the same model, rows and kill (a replacement started as ours is)."""
    os.environ.setdefault("RUST_LOG", "warn")  # torchft logs every quorum and commit at info
    from torchft._torchft import LighthouseServer

    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=5000)
    mp = multiprocessing.get_context("spawn")
    out, killed_at = mp.Queue(), mp.Value("d", 0.0)
    began = time.perf_counter()

    def start(replica: int, kill: int) -> Any:
        args = (replica, lighthouse.address(), s, corpus, kill, out, killed_at)
        p = mp.Process(target=_torchft_replica, args=args)
        p.start()
        return p

    procs = {r: start(r, kill_step if r == KILLED else -1) for r in range(s.plan.dp)}
    done: dict[int, Any] = {}
    replaced = False
    try:
        while len(done) < s.plan.dp:
            if time.perf_counter() - began > 120:
                raise RuntimeError(f"still going after 120 s ({sorted(done)} done)")
            for r, p in procs.items():
                if r not in done and not p.is_alive() and (r != KILLED or replaced):
                    p.join()
                    if out.empty():
                        raise RuntimeError(f"replica {r} exited ({p.exitcode}) before the end")
            if not replaced and not procs[KILLED].is_alive():
                procs[KILLED].join()
                procs[KILLED], replaced = start(KILLED, -1), True  # as ours: at once
            try:
                kind, replica, *rest = out.get(timeout=0.01)
            except queue.Empty:
                continue
            done[replica] = rest
    finally:
        for p in procs.values():
            if p.is_alive():
                p.kill()
            p.join()
        lighthouse.shutdown()
    seconds = time.perf_counter() - began
    history, state = done[0]
    val = _val_batch(s, corpus)
    return {
        **recovery(history, killed_at.value, kill_step),
        "seconds": seconds,
        "loss": history[-1]["loss"],
        "val_loss": evaluate({k: torch.from_numpy(v) for k, v in state.items()}, s.config, *val),
        "note": "replicas " + ", ".join(f"{r}: {len(done[r][0])} steps" for r in sorted(done)),
    }


def _val_batch(s: TrainSettings, corpus: str) -> tuple[torch.Tensor, torch.Tensor]:
    from parcourse.corpus import ShardedLoader, open_corpus

    data = open_corpus(corpus)
    tokens = data.val if len(data.val) > s.block_size * s.eval_batch else data.train
    return ShardedLoader(tokens, s.block_size, s.eval_batch, seed=s.seed + 1).next()


def restart(s: TrainSettings, corpus: str, kill_step: int, work: Path) -> dict[str, Any]:
    """torchrun --max-restarts 1 over `parcourse train`, a checkpoint every 10 steps."""
    out = work / "restart"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        "--nproc-per-node", str(s.plan.dp), "--max-restarts", "1",
        "-m", "parcourse", "train", "--plan", s.plan.label(), "--steps", str(s.steps),
        "--batch", str(s.batch), "--eval-every", str(s.steps), "--save-every", "10",
        "--corpus", corpus, "--out", str(out), "--kill", f"{KILLED}:{kill_step}",
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env["OMP_NUM_THREADS"] = "1"
    began = time.perf_counter()
    job = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    seconds = time.perf_counter() - began
    if job.returncode != 0:
        raise SystemExit(f"torchrun failed ({job.returncode}):\n{job.stderr[-3000:]}")
    found = latest(out / "checkpoints")
    assert found is not None
    history = read_meta(found)["extra"]["history"]
    killed_at = float((out / "killed_at").read_text())
    return {
        **recovery(history, killed_at, kill_step),
        "seconds": seconds,
        "loss": history[-1]["loss"],
        "val_loss": history[-1]["val_loss"],
        "note": "all workers started again, checkpoint of step 10 read",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--kill-step", type=int, default=15)
    parser.add_argument("--replicas", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(1)
    s = TrainSettings(
        plan=f"dp{args.replicas} tp1 pp1", steps=args.steps, eval_every=args.steps, warmup=5
    )
    work = Path(tempfile.mkdtemp(prefix="parcourse-fault-"))
    corpus = str(build_corpus(work / "corpus").directory)
    print(
        f"torch {torch.__version__}, CPU, one thread a replica; the course's GPT "
        f"({s.layers} layers, width {s.width}), {args.replicas} replicas, batch {s.batch}, "
        f"{s.steps} steps, replica {KILLED} killed at step {args.kill_step}"
    )
    rows: dict[str, dict[str, Any]] = {"per-step recovery (ours)": ours(s, corpus, args.kill_step)}
    try:
        rows["torchft 0.2.0"] = peer(s, corpus, args.kill_step)
    except ImportError as e:
        print(f"torchft: not run ({e}); pip install torchft==0.2.0")
    except RuntimeError as e:
        print(f"torchft: failed: {e}")
    rows["restart + checkpoint every 10"] = restart(s, corpus, args.kill_step, work)
    print()
    back = f"to step {args.kill_step}"
    print(f"{'':32} {'steps lost':>10} {'to next commit':>15} {back:>12} "
          f"{'run s':>7} {'last loss':>10} {'val loss':>9}  ")  # fmt: skip
    for name, r in rows.items():
        print(
            f"{name:32} {r['lost']:>10} {r['next_s']:>13.2f} s {r['back_s']:>10.2f} s "
            f"{r['seconds']:>7.1f} {r['loss']:>10.4f} {r['val_loss']:>9.4f}  {r['note']}"
        )
    mine, theirs = rows["per-step recovery (ours)"], rows["restart + checkpoint every 10"]
    print(
        f"\nrecovery, restart + checkpoint / ours: {theirs['back_s'] / mine['back_s']:.1f}x to the "
        f"killed step committed, {theirs['next_s'] / mine['next_s']:.1f}x to the next commit "
        f"(target >= 5x); committed steps lost: {mine['lost']} (target 0)"
    )


if __name__ == "__main__":
    main()
