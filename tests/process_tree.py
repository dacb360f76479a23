"""Servers the tests start (JupyterLab, JupyterHub) and everything they started: a free port
to give them, and ending them whole. A module of its own so that a test module that skips
(tests/test_browser.py without Playwright) takes nothing another needs with it."""

from __future__ import annotations

import os
import signal
import socket

import psutil


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kill_tree(pid: int, grace_s: float = 10.0) -> list[psutil.Process]:
    """End a process, everything it started (kernels start their own sessions, ranks are
    the kernels' children) and its process group; returns any that survived."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        procs = []
    for p in procs:
        try:
            p.terminate()
        except psutil.NoSuchProcess:
            pass
    _, stubborn = psutil.wait_procs(procs, timeout=grace_s)
    for p in stubborn:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(stubborn, timeout=grace_s)
    try:
        os.killpg(pid, signal.SIGKILL)  # started with start_new_session: pgid == pid
    except (ProcessLookupError, PermissionError):
        pass
    return [p for p in procs if alive(p)]


def alive(p: psutil.Process) -> bool:
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
