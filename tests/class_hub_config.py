"""The class recipe (classroom/jupyterhub_config.py) as tests/test_class_server.py runs it.

The recipe runs first and sets everything; then only what needs a real class machine is
changed: one class password (JupyterHub's SharedPasswordAuthenticator) instead of sign-ups, and
local processes with a home under the test's folder (SimpleLocalProcessSpawner) instead of
systemd units under unix accounts. The recipe's CPU limit still holds, as cores (below);
its memory limit is not enforced here (systemd does that on the class machine). Everything
listens on 127.0.0.1 at the test's free ports; the test passes its settings in the
environment variable PARCOURSE_TEST_HUB.
"""

import json
import os
from pathlib import Path

from jupyterhub.authenticators.shared import SharedPasswordAuthenticator
from jupyterhub.spawner import SimpleLocalProcessSpawner

c = get_config()  # noqa: F821 (JupyterHub defines get_config when it loads this file)
S = json.loads(os.environ["PARCOURSE_TEST_HUB"])

# The recipe, in a namespace of its own: its settings land in `c`, its functions stay here.
recipe = {"get_config": get_config, "__file__": S["recipe"], "__name__": "class_recipe"}  # noqa: F821
exec(compile(Path(S["recipe"]).read_text(), S["recipe"], "exec"), recipe)

# On 127.0.0.1 at free ports; the database, cookie secret and proxy pid in the test's folder.
c.JupyterHub.bind_url = f"http://127.0.0.1:{S['port']}"
c.JupyterHub.hub_ip = "127.0.0.1"
c.JupyterHub.hub_port = S["hub_port"]
c.ConfigurableHTTPProxy.api_url = f"http://127.0.0.1:{S['proxy_api_port']}"
c.ConfigurableHTTPProxy.command = [S["proxy"]]
c.ConfigurableHTTPProxy.pid_file = f"{S['state']}/proxy.pid"
c.JupyterHub.db_url = f"sqlite:///{S['state']}/jupyterhub.sqlite"
c.JupyterHub.cookie_secret_file = f"{S['state']}/cookie_secret"

# Login: any name with the test's password.
c.JupyterHub.authenticator_class = SharedPasswordAuthenticator
c.SharedPasswordAuthenticator.user_password = S["password"]

# The test itself is a service whose token may create users and see their servers.
c.JupyterHub.services.append({"name": "class-test", "api_token": S["token"]})
c.JupyterHub.load_roles.append(
    {"name": "class-test", "services": ["class-test"], "scopes": ["admin:users", "admin:servers"]}
)


class PinnedSpawner(SimpleLocalProcessSpawner):
    """A local process for each student's server, pinned to `cpu_limit` cores of this
    machine, students taking the cores in turn; its kernels and their ranks inherit the
    affinity, so the limit holds for everything the server starts (as a set of cores where
    systemd gives a quota)."""

    def make_preexec_fn(self, name):
        setup = super().make_preexec_fn(name)  # makes the home and starts there
        cores = sorted(os.sched_getaffinity(0))
        n = min(len(cores), max(1, int(self.cpu_limit or 1)))
        first = (self.user.id - 1) * n
        mine = {cores[(first + i) % len(cores)] for i in range(n)}

        def preexec():
            setup()
            os.sched_setaffinity(0, mine)

        return preexec


c.JupyterHub.spawner_class = PinnedSpawner
c.SimpleLocalProcessSpawner.home_dir_template = S["homes"] + "/{username}"
c.Spawner.cpu_limit = S["cpus_per_student"]
c.Spawner.environment = {
    **c.Spawner.environment,
    "OMP_NUM_THREADS": str(int(S["cpus_per_student"])),
}
# The recipe's hand-out, into the local home (there is no unix account to own it).
c.Spawner.pre_spawn_hook = lambda spawner: recipe["hand_out"](S["build"], spawner.home_dir)
if os.geteuid() == 0:  # CI runs as root; a Jupyter server needs to be told that is fine
    c.Spawner.args = ["--allow-root"]
