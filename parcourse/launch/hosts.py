"""Hosts of one's own on one Linux machine: network namespaces, each with an address of
its own, joined by a bridge, the link out of each host rate-limited by the kernel (`tbf`).
Each host runs a torchrun agent; the agents meet by c10d rendezvous, as on two real nodes.

    with Hosts(2, rate_mbit=1000) as hosts:              # needs root
        done = hosts.torchrun(["-m", "parcourse", "doctor"], nproc_per_node=2, timeout=120)

What a learner meets on real nodes meets them here too: each agent must say the address
it is reachable at (`--local-addr`: a namespace's hostname resolves to the machine's own
address, which the other hosts cannot reach, and the workers wait for it forever), gloo
must be told which interface carries the traffic (`GLOO_SOCKET_IFNAME`), and one host is
the rendezvous host (`--rdzv-conf is_host=1`). Ranks on one host talk over its loopback
(their own addresses), unlimited; across hosts every byte leaves through a `tbf` queue.

Everything is torn down on leaving the block, a failure included: every process in a
namespace killed, every namespace (and so every veth end) deleted; `leftovers` says what
is left of a tag, for a test to check. `why_not()` says in one line why this machine
cannot (not root, no iproute2).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import IO

# The subnet the hosts' addresses are on, inside their namespaces only.
SUBNET = "10.77.0"


def why_not() -> str | None:
    """Why this machine cannot make hosts (None: it can)."""
    if not sys.platform.startswith("linux"):
        return "hosts are Linux network namespaces; this is not Linux"
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_NET_ADMIN); use the simulated network"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` not found: install iproute2"
    return None


@dataclass(frozen=True)
class Host:
    """One host: its namespace, the interface that leads out of it (eth0 on every host,
    as a cluster's nodes name theirs alike, so one `GLOO_SOCKET_IFNAME` serves all: what
    Slurm's tasks, started with srun's environment, need), its address."""

    namespace: str
    interface: str
    address: str


@dataclass(frozen=True)
class Done:
    """What one host's command left: its exit code (None: killed at the deadline) and
    output."""

    host: Host
    returncode: int | None
    stdout: str
    stderr: str


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def leftovers(tag: str) -> list[str]:
    """The namespaces of `tag` still there."""
    listed = _ip("netns", "list", check=False).stdout.split()
    return [name for name in listed if name.startswith(tag)]


class Hosts:
    """`n` hosts on a bridge (in a namespace of its own, the switch); `rate_mbit`: each
    host's outgoing link limited to that many Mbit/s (None: as fast as the kernel copies).
    `tag`: the names' prefix (unique to this process by default)."""

    def __init__(self, n: int = 2, rate_mbit: float | None = None, tag: str | None = None) -> None:
        if why := why_not():
            raise RuntimeError(why)
        if not 2 <= n <= 200:
            raise ValueError(f"2 to 200 hosts, got {n}")
        if rate_mbit is not None and not rate_mbit > 0:
            raise ValueError(f"rate_mbit must be positive, got {rate_mbit}")
        self.tag = tag or f"pc{os.getpid() % 100000}"
        self.rate_mbit = rate_mbit
        self.switch = f"{self.tag}sw"
        self.hosts = [Host(f"{self.tag}h{i}", "eth0", f"{SUBNET}.{i + 1}") for i in range(n)]
        self._running: list[subprocess.Popen[str]] = []
        self._output: dict[int, tuple[IO[str], IO[str]]] = {}
        self._host_of: dict[int, int] = {}  # a job's host, by the job's id

    # -- up and down

    def __enter__(self) -> Hosts:
        try:
            self._up()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _up(self) -> None:
        if leftovers(self.tag):
            raise RuntimeError(f"namespaces of {self.tag!r} exist already: {leftovers(self.tag)}")
        sw = self.switch
        _ip("netns", "add", sw)
        _ip("-n", sw, "link", "add", "br0", "type", "bridge")
        _ip("-n", sw, "link", "set", "br0", "up")
        for i, h in enumerate(self.hosts):
            _ip("netns", "add", h.namespace)
            port = f"p{i}"
            _ip("link", "add", h.interface, "netns", h.namespace, "type", "veth", "peer",
                "name", port, "netns", sw)  # fmt: skip
            _ip("-n", sw, "link", "set", port, "master", "br0")
            _ip("-n", sw, "link", "set", port, "up")
            _ip("-n", h.namespace, "addr", "add", f"{h.address}/24", "dev", h.interface)
            _ip("-n", h.namespace, "link", "set", h.interface, "up")
            _ip("-n", h.namespace, "link", "set", "lo", "up")
            if self.rate_mbit is not None:
                self._limit(h)

    def _limit(self, h: Host) -> None:
        """A token bucket on the host's way out: `rate_mbit`, a burst of 10 ms of it."""
        rate = float(self.rate_mbit or 0)
        burst = max(32 * 1024, int(rate * 1e6 / 8 / 100))
        subprocess.run(
            ["tc", "-n", h.namespace, "qdisc", "add", "dev", h.interface, "root", "tbf",
             "rate", f"{rate}mbit", "burst", str(burst), "latency", "400ms"],
            capture_output=True, text=True, check=True, timeout=30,
        )  # fmt: skip

    def close(self) -> None:
        """Kill what runs in the hosts, then delete them (safe to call twice)."""
        for job in self._running:
            if job.poll() is None:
                _kill_group(job)
        self._running.clear()
        for files in self._output.values():
            for f in files:
                f.close()
        self._output.clear()
        for ns in [h.namespace for h in self.hosts] + [self.switch]:
            _kill_namespace(ns)
            _ip("netns", "del", ns, check=False)

    # -- running things in them

    def start(
        self, host: int, argv: Sequence[str], env: dict[str, str] | None = None
    ) -> subprocess.Popen[str]:
        """`argv` in host `host`'s namespace, in a session of its own (so that a kill
        takes its children too), with gloo told which interface is the host's."""
        h = self.hosts[host]
        full = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
        full.update(GLOO_SOCKET_IFNAME=h.interface, OMP_NUM_THREADS="1", **(env or {}))
        # Output to files, not pipes: a job that writes more than a pipe holds while
        # nobody reads would stop there. Closed by `wait` or `close`.
        out = tempfile.TemporaryFile("w+")  # noqa: SIM115
        err = tempfile.TemporaryFile("w+")  # noqa: SIM115
        job = subprocess.Popen(
            ["ip", "netns", "exec", h.namespace, *argv],
            env=full,
            stdout=out,
            stderr=err,
            text=True,
            start_new_session=True,
        )
        self._running.append(job)
        self._output[id(job)] = (out, err)
        self._host_of[id(job)] = host
        return job

    def torchrun(
        self,
        argv: Sequence[str],
        nproc_per_node: int = 2,
        timeout: float = 300.0,
        port: int = 29400,
        options: Sequence[str] = (),
        local_addr: bool = True,
        first_failure: bool = False,
        nnodes: str | None = None,
        rdzv_conf: str = "",
    ) -> list[Done]:
        """One torchrun agent a host, meeting at the first host by c10d rendezvous, each
        running `argv` (e.g. ["-m", "parcourse", "doctor"]) on `nproc_per_node` workers.
        `local_addr=False`: the agents not told their addresses (what a learner forgets).
        `nnodes`: torchrun's (every host by default; "1:2" an elastic job), `rdzv_conf`
        more of the rendezvous' settings ("last_call_timeout=2"). Waits as `wait`
        does."""
        return self.wait(
            self.agents(argv, nproc_per_node, port, options, local_addr, nnodes, rdzv_conf),
            timeout,
            first_failure,
        )

    def agents(
        self,
        argv: Sequence[str],
        nproc_per_node: int = 2,
        port: int = 29400,
        options: Sequence[str] = (),
        local_addr: bool = True,
        nnodes: str | None = None,
        rdzv_conf: str = "",
    ) -> list[subprocess.Popen[str]]:
        """The agents of `torchrun`, started and not waited for (job i on host i)."""
        jobs = []
        for i, h in enumerate(self.hosts):
            conf = ",".join(c for c in (f"is_host={int(i == 0)}", rdzv_conf) if c)
            agent = [
                sys.executable, "-m", "torch.distributed.run",
                "--nnodes", nnodes or str(len(self.hosts)),
                "--nproc-per-node", str(nproc_per_node),
                "--rdzv-backend", "c10d", "--rdzv-id", self.tag,
                "--rdzv-endpoint", f"{self.hosts[0].address}:{port}", "--rdzv-conf", conf,
                *(["--local-addr", h.address] if local_addr else []), *options, *argv,
            ]  # fmt: skip
            jobs.append(self.start(i, agent))
        return jobs

    def lose(self, host: int) -> None:
        """Every process in host `host` killed (SIGKILL), as a machine that loses power:
        torchrun's workers run in sessions of their own, so killing an agent's process
        group alone would leave them running."""
        _kill_namespace(self.hosts[host].namespace)
        for job in self._running:
            if job.poll() is None and self._host_of[id(job)] == host:
                _kill_group(job)

    def wait(
        self, jobs: list[subprocess.Popen[str]], timeout: float, first_failure: bool = False
    ) -> list[Done]:
        """Each job's output (job i ran on host i), waiting at most `timeout` seconds in
        all, or with `first_failure` until one job fails; what still runs then is killed
        (its `returncode` None)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            codes = [job.poll() for job in jobs]
            if all(c is not None for c in codes) or (first_failure and any(codes)):
                break
            time.sleep(0.1)
        done = []
        for h, job in zip(self.hosts, jobs):
            code = job.poll()
            if code is None:
                _kill_group(job)
            out, err = self._output.pop(id(job))
            texts = []
            for f in (out, err):
                f.seek(0)
                texts.append(f.read())
                f.close()
            done.append(Done(h, code, *texts))
        return done


def _kill_namespace(namespace: str) -> None:
    for pid in _ip("netns", "pids", namespace, check=False).stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


def _kill_group(job: subprocess.Popen[str]) -> None:
    try:
        os.killpg(job.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    job.wait()
