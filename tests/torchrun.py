"""Run a job under torchrun from a test, and never leave it behind."""

import os
import signal
import subprocess
import sys


def torchrun(*args: str, timeout: float) -> tuple[int, str, str]:
    """`python -m torch.distributed.run ARGS` (RANK and WORLD_SIZE of the test's own
    environment removed, one thread per worker): (exit code, stdout, stderr). In a
    session of its own, so that a hang kills torchrun *and* its workers, not torchrun
    alone."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env["OMP_NUM_THREADS"] = "1"
    job = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        stdout, stderr = job.communicate(timeout=timeout)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
    return job.returncode, stdout, stderr
