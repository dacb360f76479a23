"""Slurm for real on the hosts of `parcourse.launch.hosts`: Debian's `slurm-wlm`, its
controller (`slurmctld`) on the first host and a node daemon (`slurmd`) on each, so that
`srun -N 2 --ntasks-per-node 2 python -m parcourse allreduce` starts the course's ranks
across the hosts as a cluster's scheduler does, and the course reads `SLURM_PROCID`,
`SLURM_NTASKS` and `SLURM_LOCALID` as it does on a real one.

    with Hosts(2) as hosts, Slurm(hosts) as slurm:       # needs root and slurm-wlm
        done = slurm.srun(["python", "-m", "parcourse", "doctor"], nodes=2, tasks_per_node=2)

The cluster is as small as Slurm allows: no accounting, no cgroups (`proctrack/
linuxproc`), no authentication (`auth/none`, one machine's own daemons), every file in a
temporary directory removed on leaving the block. `why_not()` says in one line why this
machine cannot (not root, Slurm not installed).
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from parcourse.launch.hosts import Done, Hosts
from parcourse.launch.hosts import why_not as hosts_why_not

DAEMONS = ("slurmctld", "slurmd", "srun", "sinfo")


def why_not() -> str | None:
    """Why this machine cannot run the hosts' Slurm (None: it can)."""
    if why := hosts_why_not():
        return why
    missing = [d for d in DAEMONS if shutil.which(d) is None]
    if missing:
        return f"{', '.join(missing)} not found: install Debian's slurm-wlm"
    return None


class Slurm:
    """A Slurm cluster of `hosts`' hosts, each one node (named h0, h1, ... at its
    address, with `cpus` CPUs), the controller on the first; up on entering the block,
    down on leaving it."""

    def __init__(self, hosts: Hosts, cpus: int = 2, port: int = 6817) -> None:
        if why := why_not():
            raise RuntimeError(why)
        self.hosts, self.cpus, self.port = hosts, cpus, port
        self.nodes = [f"h{i}" for i in range(len(hosts.hosts))]
        self.directory = Path(tempfile.mkdtemp(prefix="parcourse-slurm-"))
        self.conf = self.directory / "slurm.conf"
        self._daemons: list[subprocess.Popen[str]] = []

    def __enter__(self) -> Slurm:
        try:
            self._up()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def env(self) -> dict[str, str]:
        return {"SLURM_CONF": str(self.conf)}

    def _up(self) -> None:
        self.conf.write_text(self._config())
        # slurmd starts its cgroup plugin whatever tracks the processes; autodetection
        # reads /sys/fs/cgroup, which a container may hold as a tmpfs of v1 hierarchies
        (self.directory / "cgroup.conf").write_text(f"CgroupPlugin={_cgroup_plugin()}\n")
        (self.directory / "state").mkdir()
        ctld = ["slurmctld", "-D", "-i", "-f", str(self.conf)]
        self._daemons.append(self.hosts.start(0, ctld, env=self.env))
        for i, node in enumerate(self.nodes):
            (self.directory / f"spool-{node}").mkdir()
            slurmd = ["slurmd", "-D", "-N", node, "-f", str(self.conf)]
            self._daemons.append(self.hosts.start(i, slurmd, env=self.env))
        self._wait_idle(60.0)

    def _config(self) -> str:
        d = self.directory
        lines = [
            "ClusterName=parcourse",
            # slurmctld checks the controller's name against its machine's own
            f"SlurmctldHost={socket.gethostname()}({self.hosts.hosts[0].address})",
            f"SlurmctldPort={self.port}",
            "SlurmdPort=6818",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/none",
            "CredType=cred/none",
            f"StateSaveLocation={d}/state",
            f"SlurmdSpoolDir={d}/spool-%n",
            f"SlurmctldPidFile={d}/slurmctld.pid",
            f"SlurmdPidFile={d}/slurmd-%n.pid",
            f"SlurmctldLogFile={d}/slurmctld.log",
            f"SlurmdLogFile={d}/slurmd-%n.log",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SwitchType=switch/none",
            "MpiDefault=none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "SchedulerType=sched/builtin",
            "ReturnToService=2",
            "JobCompType=jobcomp/none",
            "AccountingStorageType=accounting_storage/none",
            "JobAcctGatherType=jobacct_gather/none",
            "SlurmctldTimeout=30",
            "SlurmdTimeout=30",
            "InactiveLimit=0",
            "KillWait=5",
            "MinJobAge=5",
        ]
        for node, h in zip(self.nodes, self.hosts.hosts):
            lines.append(f"NodeName={node} NodeAddr={h.address} CPUs={self.cpus} State=UNKNOWN")
        lines.append(
            f"PartitionName=hosts Nodes={','.join(self.nodes)} Default=YES "
            "MaxTime=INFINITE State=UP OverSubscribe=YES"
        )
        return "\n".join(lines) + "\n"

    def _wait_idle(self, seconds: float) -> None:
        """Until every node reports idle to the controller (`sinfo`)."""
        deadline = time.monotonic() + seconds
        said = ""
        while time.monotonic() < deadline:
            if any(d.poll() is not None for d in self._daemons):
                break
            job = self.hosts.start(0, ["sinfo", "-h", "-N", "-o", "%N %t"], env=self.env)
            said = self.hosts.wait([job], 10.0)[0].stdout
            states = dict(line.split() for line in said.splitlines() if line.strip())
            if len(states) == len(self.nodes) and all(s == "idle" for s in states.values()):
                return
            time.sleep(0.5)
        logs = "".join(
            f"\n{p.name}:\n" + p.read_text()[-1500:] for p in sorted(self.directory.glob("*.log"))
        )
        raise RuntimeError(f"Slurm's nodes did not come up (sinfo: {said.strip()!r}){logs}")

    def srun(
        self,
        argv: Sequence[str],
        nodes: int = 2,
        tasks_per_node: int = 2,
        timeout: float = 300.0,
        env: dict[str, str] | None = None,
    ) -> Done:
        """`srun -N nodes --ntasks-per-node tasks_per_node argv` from the first host."""
        cmd = ["srun", "-N", str(nodes), f"--ntasks-per-node={tasks_per_node}", *argv]
        job = self.hosts.start(0, cmd, env={**self.env, **(env or {})})
        return self.hosts.wait([job], timeout)[0]

    def close(self) -> None:
        for daemon in self._daemons:
            if daemon.poll() is None:
                daemon.kill()
                daemon.wait()
        self._daemons.clear()
        shutil.rmtree(self.directory, ignore_errors=True)


def _cgroup_plugin() -> str:
    """cgroup/v2 where /sys/fs/cgroup is a cgroup2 file system, else cgroup/v1."""
    for line in Path("/proc/mounts").read_text().splitlines():
        fields = line.split()
        if len(fields) > 2 and fields[1] == "/sys/fs/cgroup":
            return "cgroup/v2" if fields[2] == "cgroup2" else "cgroup/v1"
    return "cgroup/v1"
