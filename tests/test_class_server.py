"""The class server (classroom/): the real JupyterHub and its proxy, three students at once.

The hub runs the recipe, classroom/jupyterhub_config.py, through tests/class_hub_config.py,
which keeps its server command, environment, CPU limit and hand-out of the student build,
and swaps what needs a class machine: one class password (SharedPasswordAuthenticator) for
NativeAuthenticator's sign-ups, and
local processes pinned to a core each for systemd units (the memory limit is not enforced
here). Three students log in with their password through the REST API, start their servers,
and at once each runs lesson 00, from the copy the hub handed out into their home, in a
kernel of their own server, over the kernel's websocket, at the lesson's small parameters
(tests/test_lessons.py's SMALL but the world size, which the lesson picks for the one core it
is given: 2 ranks, said in its first cell; injected after the parameters cell as papermill does):
every cell's reply must be "ok". Then each server is stopped, and no process of that
student may remain: not the server, not its kernel, not the kernel's ranks.

What it needs, it installs when missing: jupyterhub at the version pyproject.toml pins
(the [class] extra) with this Python's pip, and configurable-http-proxy at CHP_VERSION with
npm into this environment (sys.prefix/share/). Skips without node and npm.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import time
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import psutil
import pytest
from process_tree import free_port, kill_tree
from test_lessons import SMALL

from parcourse.classroom import student_build

pytest.importorskip("jupyter_server", reason="no Jupyter server (pip install -e '.[lab]')")
websocket = pytest.importorskip("websocket", reason="no websocket-client (jupyter_server's)")
if not (shutil.which("node") and shutil.which("npm")):
    pytest.skip(
        "no node and npm: the hub's proxy, configurable-http-proxy, is a Node program",
        allow_module_level=True,
    )

REPO = Path(__file__).resolve().parent.parent
RECIPE = REPO / "classroom" / "jupyterhub_config.py"
TEST_CONFIG = Path(__file__).with_name("class_hub_config.py")
# Where the recipe hands the student build out, in each student's home.
COURSE_FOLDER = re.search(r'^COURSE_FOLDER = "(\w+)"', RECIPE.read_text(), re.M).group(1)
CHP_VERSION = "5.3.0"
CHP_DIR = Path(sys.prefix) / "share" / "configurable-http-proxy"
CHP = CHP_DIR / "node_modules" / ".bin" / "configurable-http-proxy"
STUDENTS = ["ada", "grace", "linus"]
LESSON = "00_launching_ranks"
CPUS_PER_STUDENT = 1  # a core each: this machine may have 2 for 3 students
HUB_START_S = 120
SERVER_START_S = 180
KERNEL_START_S = 180
CELL_TIMEOUT_S = 180
GRACE_S = 15  # for a stopped server's last processes to exit


def pinned_jupyterhub() -> str:
    match = re.search(r'"jupyterhub==([^"]+)"', (REPO / "pyproject.toml").read_text())
    assert match, "pyproject.toml's [class] extra pins jupyterhub==VERSION"
    return match.group(1)


def install_what_is_missing() -> None:
    """jupyterhub as pinned, with this Python's pip; the proxy with npm, into this venv."""
    wanted = pinned_jupyterhub()
    try:
        have = version("jupyterhub")
    except PackageNotFoundError:
        have = None
    if have != wanted:
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "--quiet", f"jupyterhub=={wanted}"], check=True
        )
    package = CHP_DIR / "node_modules" / "configurable-http-proxy" / "package.json"
    if not package.exists() or json.loads(package.read_text())["version"] != CHP_VERSION:
        subprocess.run(
            [
                "npm",
                "install",
                "--prefix",
                str(CHP_DIR),
                "--cache",
                str(CHP_DIR / "npm-cache"),
                "--no-audit",
                "--no-fund",
                "--loglevel=error",
                f"configurable-http-proxy@{CHP_VERSION}",
            ],
            check=True,
        )


def api(method: str, url: str, token: str | None = None, body: object = None) -> object:
    headers = {"Authorization": f"token {token}"} if token else {}
    data = None
    if body is not None:
        data, headers["Content-Type"] = json.dumps(body).encode(), "application/json"
    request = urllib.request.Request(url, data=data, method=method, headers=headers)
    with urllib.request.urlopen(request, timeout=60) as r:
        raw = r.read()
    return json.loads(raw) if raw else None


def processes_of(student: str, hub_port: int) -> list[psutil.Process]:
    """Every process running for this student of this hub, wherever it now hangs in the
    process tree: the server sets JUPYTERHUB_USER and the hub's address, and its kernels and
    their ranks inherit its environment."""
    found = []
    for p in psutil.process_iter():
        try:
            env = p.environ()
        except psutil.Error:
            continue
        if env.get("JUPYTERHUB_USER") == student and f":{hub_port}/" in env.get(
            "JUPYTERHUB_API_URL", ""
        ):
            found.append(p)
    return found


class PortTaken(RuntimeError):
    """A port picked free was taken by another process before the hub or its proxy bound
    it (free_port cannot hold it): the start is worth one more try, on new ports."""


class Hub:
    """The recipe's hub on 127.0.0.1 (tests/class_hub_config.py), its state under `root`."""

    def __init__(self, root: Path) -> None:
        self.root, self.token, self.password = root, secrets.token_hex(16), secrets.token_hex(8)
        self.port, self.hub_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.build = root / "student-build"
        student_build(REPO / "lessons", self.build)  # python -m parcourse build-student
        settings = {
            "recipe": str(RECIPE),
            "port": self.port,
            "hub_port": self.hub_port,
            "proxy_api_port": free_port(),
            "proxy": str(CHP),
            "state": str(root),
            "homes": str(root / "home"),
            "build": str(self.build),
            "password": self.password,
            "token": self.token,
            "cpus_per_student": CPUS_PER_STUDENT,
        }
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("JUPYTER", "JPY_", "CONFIGPROXY")) and k != "MPLBACKEND"
        }
        env["PARCOURSE_TEST_HUB"] = json.dumps(settings)
        self.log_path = root / "hub.log"
        self._log = self.log_path.open("w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "jupyterhub", "-f", str(TEST_CONFIG)],
            cwd=root,
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self._wait_up()

    def log(self) -> str:
        return self.log_path.read_text()[-6000:]

    def api(self, method: str, path: str, token: str | None = None, body: object = None):
        return api(method, f"{self.url}/hub/api{path}", token or self.token, body)

    def _wait_up(self) -> None:
        deadline = time.monotonic() + HUB_START_S
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:  # through the proxy: both are up
                self.version = api("GET", f"{self.url}/hub/api/")["version"]
                return
            except OSError:
                if "EADDRINUSE" in self.log_path.read_text():
                    self.close()
                    raise PortTaken(f"a port was taken as the hub started:\n{self.log()}") from None
                time.sleep(0.5)
        self.close()
        raise RuntimeError(f"the hub did not start in {HUB_START_S} s:\n{self.log()}")

    def students(self) -> list[psutil.Process]:
        return [p for name in STUDENTS for p in processes_of(name, self.hub_port)]

    def proxies(self) -> list[psutil.Process]:
        """The hub's proxy, found by its port: where the hub is stopped while it starts
        the proxy, the proxy is no longer its child."""
        found = []
        for p in psutil.process_iter(["cmdline"]):
            line = " ".join(p.info["cmdline"] or [])
            if "configurable-http-proxy" in line and f"--port {self.port} " in line:
                found.append(p)
        return found

    def close(self) -> list[psutil.Process]:
        survivors = kill_tree(self.proc.pid)
        for proxy in self.proxies():
            survivors += kill_tree(proxy.pid, grace_s=5)
        survivors += [p for p in self.students() if p not in survivors]
        self.proc.wait(timeout=10)
        self._log.close()
        return survivors


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    install_what_is_missing()
    try:
        server = Hub(tmp_path_factory.mktemp("class-hub"))
    except PortTaken:  # beside other work, once; a second time fails
        server = Hub(tmp_path_factory.mktemp("class-hub"))
    yield server
    survivors = server.close()
    assert not survivors, f"processes of the hub still running: {survivors}"


def wait_for(what: str, done, timeout_s: float, hub: Hub):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if result := done():
            return result
        time.sleep(0.5)
    raise AssertionError(f"{what}: not within {timeout_s} s\n{hub.log()}")


def injected(cells: list[str], parameters: dict) -> list[str]:
    """The lesson's code cells with a cell of `parameters` after its parameters cell."""
    code = "# Parameters\n" + "".join(f"{k} = {v!r}\n" for k, v in parameters.items())
    return [cells[0], code, *cells[1:]]


def run_lesson(hub: Hub, student: str, token: str) -> tuple[float, str]:
    """Lesson 00 from the student's own copy, in a kernel of their server, its world size
    left to the lesson (which reads the one core the student has); returns the seconds and
    what it printed."""
    start = time.monotonic()
    server = f"{hub.url}/user/{student}/api"
    path = f"{COURSE_FOLDER}/{LESSON}.ipynb"
    notebook = api("GET", f"{server}/contents/{path}", token)["content"]  # the handed-out copy
    code = [c for c in notebook["cells"] if c["cell_type"] == "code"]
    assert "parameters" in code[0]["metadata"].get("tags", []), "parameters come first"
    cells = [c["source"] if isinstance(c["source"], str) else "".join(c["source"]) for c in code]
    # As JupyterLab does on opening the notebook: a session, its kernel in the notebook's folder.
    session = api(
        "POST",
        f"{server}/sessions",
        token,
        {"path": path, "type": "notebook", "name": "", "kernel": {"name": "python3"}},
    )
    ws_url = (
        f"ws://127.0.0.1:{hub.port}/user/{student}/api/kernels/"
        f"{session['kernel']['id']}/channels?session_id={uuid.uuid4().hex}"
    )
    ws = websocket.create_connection(
        ws_url, header=[f"Authorization: token {token}"], timeout=KERNEL_START_S
    )
    try:
        said = ""
        parameters = {k: v for k, v in SMALL[LESSON].items() if k != "world_size"}
        for i, code in enumerate(injected(cells, parameters)):
            t0 = time.monotonic()
            status, errors, printed = execute(ws, code, student)
            said += printed
            print(
                f"[class] {student}: cell {i} {status} in {time.monotonic() - t0:.1f} s", flush=True
            )
            assert status == "ok", f"{student}, cell {i}:\n{code}\n" + "\n".join(errors)
    finally:
        ws.close()
    return time.monotonic() - start, said


ANSI = re.compile(r"\x1b\[[0-9;]*m")


def execute(ws, code: str, student: str) -> tuple[str, list[str], str]:
    """One execute_request on the kernel's websocket (Jupyter's JSON messages); its reply's
    status, any error tracebacks and what it printed."""
    msg_id = uuid.uuid4().hex
    ws.send(
        json.dumps(
            {
                "header": {
                    "msg_id": msg_id,
                    "msg_type": "execute_request",
                    "username": student,
                    "session": msg_id,
                    "version": "5.3",
                    "date": datetime.now(timezone.utc).isoformat(),
                },
                "parent_header": {},
                "metadata": {},
                "channel": "shell",
                "buffers": [],
                "content": {
                    "code": code,
                    "silent": False,
                    "store_history": True,
                    "user_expressions": {},
                    "allow_stdin": False,
                    "stop_on_error": True,
                },
            }
        )
    )
    errors, printed, deadline = [], "", time.monotonic() + CELL_TIMEOUT_S
    while time.monotonic() < deadline:
        raw = ws.recv()
        if isinstance(raw, bytes):  # a message with binary buffers (widgets): not ours
            continue
        msg = json.loads(raw)
        if msg.get("parent_header", {}).get("msg_id") != msg_id:
            continue
        if msg["msg_type"] == "stream":
            printed += msg["content"]["text"]
        if msg["msg_type"] == "error":
            errors.append(ANSI.sub("", "\n".join(msg["content"]["traceback"])))
        if msg["msg_type"] == "execute_reply":
            return msg["content"]["status"], errors, printed
    return "timeout", errors, printed


@pytest.mark.notebook
def test_three_students_run_lesson_00_at_once(hub):
    assert hub.version == pinned_jupyterhub()
    world_size = 2  # what lesson 00 picks on one core (parcourse.launch.lesson_ranks)
    hub.api("POST", "/users", body={"usernames": STUDENTS})

    # Each student logs in with their password and gets a token of their own.
    tokens = {
        name: api(
            "POST",
            f"{hub.url}/hub/api/users/{name}/tokens",
            None,
            {"auth": {"username": name, "password": hub.password}, "note": "class test"},
        )["token"]
        for name in STUDENTS
    }
    t0 = time.monotonic()
    with ThreadPoolExecutor(len(STUDENTS)) as pool:  # everyone at once, from here on
        # (the hub answers a start after up to 10 s, "pending", so these are sent together)
        list(pool.map(lambda n: hub.api("POST", f"/users/{n}/server", tokens[n]), STUDENTS))
        for name in STUDENTS:
            wait_for(
                f"{name}'s server",
                lambda n=name: (
                    hub.api("GET", f"/users/{n}", tokens[n])["servers"].get("", {}).get("ready")
                ),
                SERVER_START_S,
                hub,
            )
        print(f"[class] 3 servers ready in {time.monotonic() - t0:.1f} s", flush=True)

        runs = {name: pool.submit(run_lesson, hub, name, tokens[name]) for name in STUDENTS}
        for name, run in runs.items():
            seconds, said = run.result()
            print(f"[class] {name}: lesson {LESSON} passed in {seconds:.1f} s", flush=True)
            assert "1 CPU here: running 2 ranks on 1 core" in said, said[:500]

    # Before stopping: each student's server, kernel and ranks, all on the student's core.
    cores = {}
    for name in STUDENTS:
        procs = processes_of(name, hub.hub_port)
        assert len(procs) >= 2 + world_size, f"{name}: server, kernel and ranks: {procs}"
        affinity = {frozenset(p.cpu_affinity()) for p in procs if p.is_running()}
        assert len(affinity) == 1, f"{name}'s processes are not all pinned alike: {affinity}"
        cores[name] = affinity.pop()
        assert len(cores[name]) == CPUS_PER_STUDENT, (name, cores[name])
        rss = sum(p.memory_info().rss for p in procs if p.is_running()) / 2**20
        print(
            f"[class] {name}: {len(procs)} processes on cores {sorted(cores[name])}, "
            f"{rss:.0f} MB resident",
            flush=True,
        )
    if len(os.sched_getaffinity(0)) > 1:
        assert len(set(cores.values())) > 1, f"every student on the same core: {cores}"

    # Each student stops their server: nothing of theirs may outlive it.
    t1 = time.monotonic()
    with ThreadPoolExecutor(len(STUDENTS)) as pool:
        list(pool.map(lambda n: hub.api("DELETE", f"/users/{n}/server", tokens[n]), STUDENTS))
    for name in STUDENTS:
        wait_for(
            f"{name}'s server to stop",
            lambda n=name: not hub.api("GET", f"/users/{n}", tokens[n])["servers"],
            SERVER_START_S,
            hub,
        )
        deadline = time.monotonic() + GRACE_S
        while (left := processes_of(name, hub.hub_port)) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not left, f"{name}'s server stopped, these remain: " + ", ".join(
            f"{p.pid} {' '.join(p.cmdline())[:80]}" for p in left
        )
    print(
        f"[class] 3 servers stopped and nothing of theirs left {time.monotonic() - t1:.1f} s "
        f"after the stop; {time.monotonic() - t0:.1f} s from the first start",
        flush=True,
    )
