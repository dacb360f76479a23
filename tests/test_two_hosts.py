"""Two hosts for real: the course across Linux network namespaces (`parcourse.launch.hosts`),
a torchrun agent in each, meeting by c10d rendezvous; the link between them a kernel queue
(`tbf`) at 1 Gbit/s. Needs root (CI runs as root); skips with the reason otherwise.
Every test leaves no namespace and no process behind, a failing one included."""

import re
import subprocess
import sys

import pytest

from parcourse.launch.hosts import Hosts, leftovers, why_not

pytestmark = pytest.mark.skipif(why_not() is not None, reason=str(why_not()))


@pytest.fixture
def hosts():
    made = Hosts(2, rate_mbit=1000)
    with made:
        yield made
    assert leftovers(made.tag) == []


SERVE = (
    "import socket, sys; s = socket.create_server((sys.argv[1], 29555)); print('up', flush=True);"
    " c, _ = s.accept(); c.sendall(b'hello from ' + sys.argv[1].encode()); c.close()"
)
ASK = (
    "import socket, sys, time\n"
    "for _ in range(100):\n"
    "    try: c = socket.create_connection((sys.argv[1], 29555), timeout=2); break\n"
    "    except OSError: time.sleep(0.1)\n"
    "print(c.recv(100).decode())"
)


def test_hosts_reach_each_other_by_address_and_go_even_on_failure():
    """A server on the first host, a client on the second reaching it at its address;
    then a block that raises with a process still running in a host: the process is
    killed and the namespaces deleted."""
    with Hosts(2, rate_mbit=1000) as hosts:
        a, b = hosts.hosts
        server = hosts.start(0, [sys.executable, "-c", SERVE, a.address])
        client = hosts.start(1, [sys.executable, "-c", ASK, a.address])
        said = hosts.wait([server, client], timeout=60)
        assert said[1].stdout.strip() == f"hello from {a.address}", said
        # the second host does not hold the first one's address
        here = subprocess.run(
            ["ip", "-n", b.namespace, "-brief", "addr"], capture_output=True, text=True
        )
        assert a.address not in here.stdout and b.address in here.stdout
    assert leftovers(hosts.tag) == []
    failing = Hosts(2)
    with pytest.raises(RuntimeError, match="planted"):
        with failing:
            sleeper = failing.start(1, [sys.executable, "-c", "import time; time.sleep(600)"])
            raise RuntimeError("planted")
    assert sleeper.poll() is not None  # killed
    assert leftovers(failing.tag) == []


def test_doctor_across_two_hosts(hosts):
    """`python -m parcourse doctor` under one agent a host: a 4-rank all_reduce across
    the hosts (2 ranks each)."""
    done = hosts.torchrun(["-m", "parcourse", "doctor"], nproc_per_node=2, timeout=300)
    assert all(d.returncode == 0 for d in done), [d.stderr[-2000:] for d in done]
    said = "".join(d.stdout for d in done)
    assert "all_reduce  4 ranks under an external launcher, backend gloo: OK" in said
    assert "doctor      all good" in said


def test_train3d_with_tp_inside_a_host_and_dp_across_equals_one_process(hosts):
    """train3d on dp 2 x tp 2 across two hosts: the plan reads 2 ranks a node from
    torchrun's local world size, so tp's groups stay inside a host and dp's cross; the
    losses and weights are one process's (to fp32's order of sums, as tests/test_hybrid.py:
    rtol 1e-4; the weights within 1e-4)."""
    argv = ["-m", "parcourse", "train3d", "--dp", "2", "--tp", "2", "--pp", "1", "--steps", "3"]
    done = hosts.torchrun(argv, nproc_per_node=2, timeout=400)
    assert all(d.returncode == 0 for d in done), [d.stderr[-2000:] for d in done]
    said = "".join(d.stdout for d in done)
    assert "dp2 tp2 pp1 1f1b m2 2/node" in said
    assert "inside a node: tp; across nodes: dp" in said
    for ours, one in re.findall(r"^\s+\d+\s+(\d+\.\d+)\s+(\d+\.\d+)$", said, re.M):
        assert float(ours) == pytest.approx(float(one), rel=1e-4)
    diff = re.search(r"largest difference from one process after 3 steps: (\S+)", said)
    assert diff is not None and float(diff.group(1)) < 1e-4, said


def test_an_agent_not_told_its_address_fails_naming_the_fix(hosts):
    """Without --local-addr the workers are told to meet at the rendezvous host's name,
    which resolves here but not on the other host: the workers there fail within
    seconds naming the store they cannot reach and --local-addr, instead of waiting out
    the store's timeout. (The first host's workers wait for them: killed once the
    other host's agent has failed.)"""
    done = hosts.torchrun(
        ["-m", "parcourse", "doctor"],
        nproc_per_node=2,
        timeout=240,
        local_addr=False,
        first_failure=True,
    )
    failed = [d for d in done if d.returncode not in (0, None)]
    assert failed, [d.returncode for d in done]
    assert "cannot reach torchrun's store at MASTER_ADDR" in failed[0].stderr
    assert "give each agent --local-addr" in failed[0].stderr
