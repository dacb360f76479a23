"""The planner checked on this machine (`parcourse.planner` says what it is): the
`Cluster` built from what a step costs here (`measured_here`, from the measurements in
`links` and `costs`), and a configuration run for real (`measure`) beside its prediction
(`measured_against_predicted`), with what else held the processors meanwhile
(`Contention`). `measure` runs on a `Pool`.
"""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path
from typing import Any

from parcourse.launch import usable_cpus
from parcourse.models import GPTConfig
from parcourse.pipeline.simulate import SimulatedCompute
from parcourse.planner.costs import measure_costs, measure_sharing, measure_waits
from parcourse.planner.inputs import Choice, Cluster, Overheads
from parcourse.planner.links import measure_links
from parcourse.planner.predict import model_flops_per_token, predict_memory


def measured_here(gpus: int, config: GPTConfig, pool: Any = None) -> Cluster:
    """`Cluster.this_machine` with what a step of `config` costs here measured: one rank
    alone (`measure_costs`), then `gpus` ranks at once (`measure_links` and
    `measure_sharing`, on `pool` if given: a pool of `gpus` ranks; with more ranks than
    cores `measure_waits` too, whose in-step costs of a message and a collective take
    the place of `measure_links`' back-to-back ones). Seconds: short runs of processes
    (about 30 s for 8 ranks on 2 cores)."""
    from parcourse.launch import Pool

    if pool is not None and pool.world_size != gpus:
        raise ValueError(
            f"a pool of {pool.world_size} ranks measures {pool.world_size} GPUs' links, not {gpus}"
        )
    with Pool(1, timeout=300) as alone:
        costs = alone.run(measure_costs, config).results[0]
    links, together = None, costs["probe_cpu_s"]

    def on(ranks: Any) -> tuple[dict[str, Any], float]:
        links = ranks.run(measure_links).results[0]
        if gpus > usable_cpus():  # on shared cores: a wait's processor time in a step
            waits = ranks.run(measure_waits, config).results[0]
            links = {**links, **waits}
        return links, ranks.run(measure_sharing, config).results[0]

    if gpus > 1 and pool is not None:
        links, together = on(pool)
    elif gpus > 1:
        with Pool(gpus, timeout=300) as ranks:
            links, together = on(ranks)
    return Cluster.this_machine(
        gpus, costs=costs, links=links, shared_cpu=max(1.0, together / costs["probe_cpu_s"])
    )


def measure(
    ctx: Any,
    config: GPTConfig,
    choice: Choice,
    global_batch: int,
    steps: int = 2,
    compute: SimulatedCompute | None = None,
) -> dict[str, Any]:
    """Run `choice` here (the 3D step, traced, `steps` Adam steps): this rank's memory by
    category (`Hybrid.memory`), its pipeline coordinate, the step times after the first
    and, in each of those steps, the seconds this rank spent in tp's blocking
    collectives ("tp_s", zeros without tp). `compute`: each stage's simulated seconds
    (`stage_compute`; see `scaled`)."""
    import time

    import torch

    from parcourse.data import progressions
    from parcourse.hybrid import Hybrid
    from parcourse.mesh import Mesh
    from parcourse.models import gpt

    mesh = Mesh(choice.shape, ctx.group, order=choice.order, ranks_per_node=choice.ranks_per_node)
    model = Hybrid.from_plan(
        gpt(config),
        mesh,
        choice,
        tracer=ctx.tracer,
        compute=compute,
        optimizer=lambda ps: torch.optim.Adam(ps, lr=1e-3),
    )
    x, y = progressions(global_batch, config.block_size, config.vocab)
    times, tp_s = [], []
    for _ in range(steps):
        start, blocked = time.perf_counter(), model.tp_comm.comm.blocked_s
        model.step(x, y)
        times.append(time.perf_counter() - start)
        tp_s.append(model.tp_comm.comm.blocked_s - blocked)
    return {
        "memory": model.memory(),
        "pp": mesh.coordinate("pp"),
        "times": times[1:],
        "tp_s": tp_s[1:],
    }


def scaled(
    cluster: Cluster,
    config: GPTConfig,
    global_batch: int,
    alone_s: float = 12.0,
    collectives: dict[str, dict[int, float]] | None = None,
) -> Cluster:
    """`cluster` (`measured_here`) with its compute simulated, as a GPU's next to its
    links: a FLOP rate at which one rank alone would take `alone_s` seconds for a step of
    `config` on `global_batch` sequences. A run pads each stage's forward and backward to
    those seconds (`measure(compute=stage_compute(...))`): the real math runs, then the
    rank sleeps, freeing its core, so ranks no longer share cores for their compute,
    and what the check sees is the schedule, the collectives and the messages. The
    layers' own call costs go into the padding; the optimizer's and data parallelism's
    bookkeeping stay (they are not padded), and the ranks of a stage (dp x tp) run them
    at once and share the cores for them (`Cluster.compute_simulated`). dp's reduction
    and the messages run on every rank at once too, and are priced as measured with the
    ranks idle; no cores are counted as shared for them, which is small for the course's
    GPT but not for a large model here.

    `collectives`: torch's collectives as such a step meets them, each after an idle gap
    (`measure_paced` on the ranks), in place of `cluster`'s back-to-back figures for the
    sizes they give: tp's, and, an all-reduce's, the loss's mean over dp (on this
    machine a group of 2 costs up to twice as much so)."""
    if not (math.isfinite(alone_s) and alone_s > 0):
        raise ValueError(f"alone_s must be a finite number of seconds > 0, got {alone_s}")
    paced = collectives or {}
    unknown = set(paced) - {"collective_s", "gather_s", "scatter_s"}
    if unknown:
        raise ValueError(
            f"collectives: unknown {', '.join(sorted(unknown))}; give "
            "measure_paced's collective_s, gather_s and scatter_s"
        )
    flops = model_flops_per_token(config) * global_batch * config.block_size / alone_s
    ov = cluster.overheads

    def paced_or(key: str, measured: dict[int, float]) -> dict[int, float]:
        """`cluster`'s figures of `key`, those `collectives` gives in their place."""
        return {**measured, **paced[key]} if key in paced else measured

    return dataclasses.replace(
        cluster,
        name="this machine, compute simulated",
        peak_flops=flops,
        achievable=1.0,
        compute_simulated=True,
        shared_cpu=1.0,
        collective_s=paced_or("collective_s", cluster.collective_s),
        gather_s=paced_or("gather_s", cluster.gather_s),
        scatter_s=paced_or("scatter_s", cluster.scatter_s),
        overheads=Overheads(
            optimizer_step_s=ov.optimizer_step_s,
            optimizer_tensor_s=ov.optimizer_tensor_s,
            optimizer_number_s=ov.optimizer_number_s,
            dp_tensor_s=ov.dp_tensor_s,
            zero_tensor_s=ov.zero_tensor_s,
        ),
    )


def measured_against_predicted(
    results: list[dict[str, Any]], config: GPTConfig, choice: Choice, global_batch: int
) -> list[dict[str, Any]]:
    """Per pipeline rank: the largest measured bytes of each category over its ranks beside
    the prediction."""
    predicted = predict_memory(config, choice, global_batch)
    rows = []
    for rank, pred in enumerate(predicted):
        mine = [r["memory"] for r in results if r["pp"] == rank]
        got = {k: max(m[k] for m in mine) for k in ("params", "grads", "optimizer", "activations")}
        got["total"] = sum(got.values())
        rows.append({"pp": rank, "measured": got, "predicted": pred})
    return rows


def proc_stat(text: str) -> tuple[int, int]:
    """(steal, all) processor ticks since boot from /proc/stat's text, all the
    processors together: steal, the time the host ran something else; all, every
    field from user to steal (guest time is already in user)."""
    fields = text.split("\n", 1)[0].split()
    if fields[:1] != ["cpu"] or len(fields) < 9:
        raise ValueError(f"not /proc/stat's first line: {text[:80]!r}")
    ticks = [int(f) for f in fields[1:9]]  # user nice system idle iowait irq softirq steal
    return ticks[7], sum(ticks)


class Contention:
    """What else held the processors while `pool`'s ranks ran (a context manager around
    the run), each a share of all the processors' time in that window:

    - `steal`: the host's other tenants, the time this machine's processors were ready
      to run and the host ran something else (a virtual machine on a shared host;
      /proc/stat);
    - `others`: this machine's other processes (a browser, a second notebook, a
      build), the processor time of every process but this one and the ranks, each
      read from its own counters. A process that both starts and ends within the
      window is missed, so a build of many short processes reads low. (Busy time
      from /proc/stat less the ranks' own would read low too: it is sampled at each
      tick, and misses much of ranks that run in bursts shorter than one.)

    Both read near 0 on a quiet machine of one's own; either may make a measured step
    slower than predicted (others' work once the cores are all busy), and the planner
    cannot know of it. Both stay None where they cannot be read: without /proc/stat
    (Linux only), for a pool of ranks started by a launcher (the other local ranks
    are not this process's to tell apart), or when the run raised."""

    HEADER = f"{'steal':>5} {'others':>6}"  # the columns `str` fills
    _TICK_S = 1 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self.steal: float | None = None
        self.others: float | None = None
        self.cpu_s: float | None = None  # all the processors' seconds in the window

    def _sample(self) -> tuple[tuple[int, int], set[int], dict[tuple[int, float], float]] | None:
        """/proc/stat's ticks, this process's and the ranks' pids, and the seconds every
        process has run, by (pid, start time)."""
        import psutil

        if getattr(self.pool, "external", False):
            return None
        try:
            ticks = proc_stat(Path("/proc/stat").read_text())
            own = {os.getpid(), *self.pool.pids}
        except Exception:  # noqa: BLE001 - a reading, never a reason to stop a run
            return None
        seconds = {}
        for p in psutil.process_iter(["create_time", "cpu_times"]):
            times = p.info["cpu_times"]
            if times is not None:  # None: gone, or not ours to read
                seconds[p.pid, p.info["create_time"]] = times.user + times.system
        return ticks, own, seconds

    def __enter__(self) -> Contention:
        self._start = self._sample()
        return self

    def __exit__(self, kind: object, *exc: object) -> None:
        end = None if kind is not None or self._start is None else self._sample()
        if end is None or self._start is None:
            return
        (steal0, every0), own0, before = self._start
        (steal1, every1), own1, after = end
        if every1 <= every0:
            return  # no tick went by
        ours = own0 | own1  # a rank started or ended within the window too
        others = sum(
            s - before.get(key, 0.0)
            for key, s in after.items()  # new: all of it
            if key[0] not in ours
        )
        self.cpu_s = (every1 - every0) * self._TICK_S
        self.steal = (steal1 - steal0) / (every1 - every0)
        # each process's counters and /proc/stat's ticks round apart: on a machine busy to
        # the last cycle the sum reads a little over all of it
        self.others = min(1.0, others / self.cpu_s)

    def __str__(self) -> str:
        if self.steal is None or self.others is None:
            return f"{'-':>5} {'-':>6}"
        return f"{self.steal:>5.0%} {self.others:>6.0%}"

    def said(self) -> str:
        """The same in words, for a line of its own."""
        if self.steal is None or self.others is None:
            return "what else held the processors: not known here"
        return (
            f"other processes held {self.others:.0%} of the processors, the host's "
            f"other tenants {self.steal:.0%}"
        )


__all__ = [
    "Contention",
    "measure",
    "measured_against_predicted",
    "measured_here",
    "proc_stat",
    "scaled",
]
