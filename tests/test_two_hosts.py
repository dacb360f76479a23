"""Two hosts for real: the course across Linux network namespaces (`parcourse.launch.hosts`),
a torchrun agent in each, meeting by c10d rendezvous; the link between them a kernel queue
(`tbf`) at 1 Gbit/s. Needs root (CI runs as root); skips with the reason otherwise.
Every test leaves no namespace and no process behind, a failing one included."""

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from parcourse.launch.hosts import Hosts, leftovers, why_not
from parcourse.launch.slurm import Slurm
from parcourse.launch.slurm import why_not as slurm_why_not

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


def test_a_lost_host_and_the_run_resharded_onto_the_host_left(hosts, tmp_path):
    """An elastic job (`--nnodes 1:2 --max-restarts 1`, `train --dp -1`: dp is what the
    world leaves) on both hosts, dp 4; once the checkpoint after step 40 is committed,
    every process of the second host is killed, as a machine that loses power. The first
    host's workers fail naming the host they lost, its agent starts them again, the
    rendezvous closes with the one host left, and `train` resumes on dp 2 from the newest
    checkpoint, resharded: nothing committed is lost, and the final weights are those of a
    run resumed by hand from that checkpoint on dp 2 (the same mesh and reductions: equal
    to fp32's last bit, within 1e-6)."""
    import shutil

    from parcourse.checkpoint import full_state_dict, read_meta
    from parcourse.cli import main
    from parcourse.corpus import build_corpus

    corpus = str(build_corpus(tmp_path / "corpus").directory)
    out = tmp_path / "run"
    # 240 short steps: the run goes on well past the first checkpoint when the host goes
    settings = ["--pp", "1", "--steps", "240", "--eval-every", "240", "--save-every", "40"]
    settings += ["--batch", "8", "--corpus", corpus]
    argv = ["-m", "parcourse", "train", "--dp", "-1", *settings, "--out", str(out)]
    jobs = hosts.agents(
        argv,
        nnodes="1:2",
        options=["--max-restarts", "1"],
        # each round closes 20 s after its first host joined: the first round must hold
        # both hosts even when the second agent starts late on a loaded machine (a round
        # closed with one host would start the job on dp 2, then grow it)
        rdzv_conf="last_call_timeout=20,join_timeout=120",
    )
    first = out / "checkpoints" / "step-00000040"
    deadline = time.monotonic() + 240
    while not first.exists() and time.monotonic() < deadline and jobs[0].poll() is None:
        time.sleep(0.05)
    assert first.exists(), hosts.wait(jobs, 1)
    assert read_meta(first)["plan"] == "dp4 tp1 pp1 1f1b m2"  # both hosts were in it
    hosts.lose(1)
    done = hosts.wait(jobs[:1], timeout=300)[0]
    assert done.returncode == 0, done.stderr[-4000:]
    resumed = re.search(r"resumed     from (\S+), after step (\d+)", done.stdout)
    assert resumed is not None, done.stdout + done.stderr[-3000:]
    assert int(resumed.group(2)) >= 40
    assert "train       dp2 tp1 pp1" in done.stdout, done.stdout
    assert "lost its peer at 10.77.0.2 mid-collective" in done.stderr, done.stderr[-4000:]
    # the same checkpoint resumed by hand on one host's two ranks, no failure
    again = tmp_path / "again"
    shutil.copytree(resumed.group(1), again / "checkpoints" / Path(resumed.group(1)).name)
    assert main(["train", "--dp", "2", *settings, "--out", str(again), "--resume"]) == 0
    ours = full_state_dict(out / "checkpoints" / "step-00000240")
    theirs = full_state_dict(again / "checkpoints" / "step-00000240")
    assert ours.keys() == theirs.keys()
    for name, tensor in ours.items():
        torch.testing.assert_close(tensor, theirs[name], rtol=0, atol=1e-6, msg=name)


@pytest.mark.skipif(slurm_why_not() is not None, reason=str(slurm_why_not()))
def test_srun_across_two_hosts_runs_the_course_as_slurm_places_it(hosts):
    """Debian's Slurm on the hosts (slurmctld on the first, a slurmd on each):
    `srun -N 2 --ntasks-per-node 2` starts `allreduce` across them, the course reading
    SLURM_PROCID and SLURM_NTASKS, every rank sending the ring's bytes; and `train3d`,
    which reads 2 ranks a node from SLURM_NTASKS_PER_NODE (tp inside a host, dp across),
    equal to one process (rtol 1e-4, as above)."""
    with Slurm(hosts) as slurm:
        env = {"MASTER_ADDR": hosts.hosts[0].address, "MASTER_PORT": "29500"}
        argv = [sys.executable, "-m", "parcourse", "allreduce", "--size", "1MB"]
        done = slurm.srun(argv, nodes=2, tasks_per_node=2, timeout=240, env=env)
        assert done.returncode == 0, done.stderr[-3000:]
        assert "all-reduce  ring, 4 ranks, backend gloo" in done.stdout
        assert done.stdout.count("sent 1572864 B (theory 1572864 B)") == 4, done.stdout
        argv = [sys.executable, "-m", "parcourse", "train3d", "--dp", "2", "--tp", "2"]
        argv += ["--pp", "1", "--steps", "3"]
        done = slurm.srun(argv, nodes=2, tasks_per_node=2, timeout=300, env=env)
        assert done.returncode == 0, done.stderr[-3000:]
        assert "inside a node: tp; across nodes: dp" in done.stdout, done.stdout
        diff = re.search(r"largest difference from one process after 3 steps: (\S+)", done.stdout)
        assert diff is not None and float(diff.group(1)) < 1e-4, done.stdout
    assert not slurm.directory.exists()  # its files gone, and its daemons
    assert subprocess.run(["pgrep", "-f", str(slurm.conf)], capture_output=True).returncode == 1


def test_lesson_09s_placements_run_on_the_real_link():
    """Lesson 09's cell on real hosts (`placements_on_hosts`): the four placements, each
    a train3d run across two hosts, a step time each; at 5 Mbit/s with the model of
    lesson 09's simulated placements, dp's gradients outweigh the activations, so the
    placement that keeps dp inside a host is the faster (by far more than the noise)."""
    from parcourse.experiments.hosts import placements_on_hosts

    small = {"layers": 2, "width": 64, "heads": 4, "block_size": 16, "batch": 8}
    real = placements_on_hosts(5.0, steps=2, model=small)
    assert list(real) == ["tp", "pp"]
    assert list(real["pp"]) == ["pp inside a node", "pp across nodes"]
    assert real["pp"]["pp across nodes"] < real["pp"]["pp inside a node"] / 2, real
