"""A JupyterHub for a class taking the course, on one Linux machine (classroom/README.md).

Plain JupyterHub, set up the way The Littlest JupyterHub sets up a server:

- students sign up with a username and password (NativeAuthenticator) and the instructor
  approves each one at /hub/authorize;
- each student's server runs as a systemd unit (systemdspawner) under a unix account of
  their own, created at their first start, with a CPU and a memory limit: every process
  the server starts (kernels, and the ranks the kernels start) counts against them, and
  stopping the server stops them all;
- the course is installed once, in the environment this hub runs from, and every student's
  server and kernels run from it (read-only to them);
- at each start, the student build (`python -m parcourse build-student`) is copied into
  the student's home, each notebook only if it is not there yet.

Run as root: sudo /opt/parcourse/bin/jupyterhub -f classroom/jupyterhub_config.py
(tests/test_class_server.py runs this file with a test login and local processes instead.)
"""

import importlib.util
import os
import pwd
import shutil
import subprocess
import sys
from pathlib import Path

c = get_config()  # noqa: F821 (JupyterHub defines get_config when it loads this file)

# ---- What to set for a class ----------------------------------------------------------------
# What each student's server may use (classroom/README.md). The lessons start their ranks as
# processes, each a Python with its own torch: lesson 00 at world size 2 holds about 0.75 GB
# resident (server, kernel and 2 ranks, measured by tests/test_class_server.py); a lesson at
# its default world size 4, with the panels' pools (at most 2 kept), holds up to about 8
# ranks beside the kernel. Per-lesson peaks have not been measured: run the heaviest lesson
# you teach as one student before the class (`systemctl status jupyter-NAME-singleuser`
# shows the unit's memory) and set these from it.
CPUS_PER_STUDENT = 2  # cores' worth of CPU time (a quota: the ranks share it)
MEM_PER_STUDENT = "4G"  # everything the server started; past it a rank or the kernel is killed
HUB_FILES = Path("/srv/parcourse")  # the hub's database, cookie secret and proxy's pid
# The student build: `python -m parcourse build-student /srv/parcourse/student`.
STUDENT_BUILD = HUB_FILES / "student"
COURSE_FOLDER = "parcourse"  # ~/parcourse in each student's home
ADMINS = {"instructor"}  # must sign up like everyone else; approved automatically
IDLE_CULL_AFTER_S = 3600  # stop servers unused this long (if jupyterhub-idle-culler is installed)
UNIX_NAME = "jupyter-{USERNAME}"  # each student's unix account, as The Littlest JupyterHub names it
# ----------------------------------------------------------------------------------------------

# The course, installed once: this hub's own environment (/opt/parcourse in the README).
COURSE_ENV = Path(sys.prefix)

# Listens on every interface, port 8000. Put HTTPS in front of it (a reverse proxy such as
# Caddy or nginx), or give it a certificate: c.JupyterHub.ssl_key / c.JupyterHub.ssl_cert.
c.JupyterHub.bind_url = "http://:8000"
c.JupyterHub.db_url = f"sqlite:///{HUB_FILES / 'jupyterhub.sqlite'}"
c.JupyterHub.cookie_secret_file = str(HUB_FILES / "jupyterhub_cookie_secret")
c.ConfigurableHTTPProxy.pid_file = str(HUB_FILES / "jupyterhub-proxy.pid")

# Login: students sign up at /hub/signup; the instructor approves them at /hub/authorize.
# (A class with GitHub or university accounts: an OAuthenticator instead, e.g.
# c.JupyterHub.authenticator_class = "github" with oauthenticator's allowed_organizations.)
c.JupyterHub.authenticator_class = "native"
c.NativeAuthenticator.open_signup = False
c.NativeAuthenticator.minimum_password_length = 8
# JupyterHub 5 and later let no one in unless told whom: NativeAuthenticator's approval
# already decides that.
c.Authenticator.allow_all = True
c.Authenticator.admin_users = ADMINS
if spec := importlib.util.find_spec("nativeauthenticator"):  # its sign-up pages
    c.JupyterHub.template_paths = [str(Path(spec.origin).parent / "templates")]

# Each student's server: a systemd unit, running as their unix account, with the limits.
c.JupyterHub.spawner_class = "systemdspawner.SystemdSpawner"
c.Spawner.cpu_limit = float(CPUS_PER_STUDENT)  # systemd's CPUQuota
c.Spawner.mem_limit = MEM_PER_STUDENT  # systemd's memory limit
c.SystemdSpawner.username_template = UNIX_NAME
c.SystemdSpawner.isolate_tmp = True  # a /tmp of their own (the ranks' files go there)
c.SystemdSpawner.disable_user_sudo = True
c.Spawner.cmd = [str(COURSE_ENV / "bin" / "jupyterhub-singleuser")]
c.Spawner.environment = {
    "PATH": f"{COURSE_ENV / 'bin'}:/usr/local/bin:/usr/bin:/bin",
    # torch would start a thread per core of the machine; a student has CPUS_PER_STUDENT.
    "OMP_NUM_THREADS": str(CPUS_PER_STUDENT),
}
c.Spawner.default_url = f"/lab/tree/{COURSE_FOLDER}"
# Thirty servers starting at once on a busy machine take longer than the defaults allow.
c.Spawner.start_timeout = 180
c.Spawner.http_timeout = 120


def hand_out(build, home, uid=None, gid=None):
    """Copy the student build into home/COURSE_FOLDER: each notebook only if it is not there
    yet, so a student's work is never overwritten and a lesson added later still arrives.
    Owned by uid:gid when given (the hub runs as root)."""
    notebooks = sorted(Path(build).glob("*.ipynb"))
    if not notebooks:
        raise RuntimeError(
            f"no student build in {build}: python -m parcourse build-student {build}"
        )
    folder = Path(home) / COURSE_FOLDER
    folder.mkdir(parents=True, exist_ok=True)
    for notebook in notebooks:
        copy = folder / notebook.name
        if not copy.exists():
            shutil.copyfile(notebook, copy)
            if uid is not None:
                os.chown(copy, uid, gid)
    if uid is not None:
        os.chown(folder, uid, gid)


def unix_account(hub_name):
    """The student's unix account, created at their first start."""
    name = UNIX_NAME.format(USERNAME=hub_name)
    try:
        return pwd.getpwnam(name)
    except KeyError:
        subprocess.run(["useradd", "--create-home", "--shell", "/bin/bash", name], check=True)
        return pwd.getpwnam(name)


def before_start(spawner):
    account = unix_account(spawner.user.name)
    hand_out(STUDENT_BUILD, account.pw_dir, account.pw_uid, account.pw_gid)


c.Spawner.pre_spawn_hook = before_start

# Optional: stop servers left idle (their kernels and ranks with them).
if importlib.util.find_spec("jupyterhub_idle_culler"):
    c.JupyterHub.services = [
        {
            "name": "idle-culler",
            "command": [
                sys.executable,
                "-m",
                "jupyterhub_idle_culler",
                f"--timeout={IDLE_CULL_AFTER_S}",
            ],
        }
    ]
    c.JupyterHub.load_roles = [
        {
            "name": "idle-culler",
            "scopes": ["list:users", "read:users:activity", "read:servers", "delete:servers"],
            "services": ["idle-culler"],
        }
    ]
