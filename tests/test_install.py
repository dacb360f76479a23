"""`pip install .` gives the whole package, not only what an editable install can see.

The wheel is built from a copy of the source tree and installed into a folder of its
own; a fresh interpreter that cannot see the editable install then imports every
module from that folder. torch and the other dependencies come from this venv, so
nothing is downloaded.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# Not copied for the build: version control, environments, build outputs, and the
# top-level folders that hold no package (so the copy stays small).
_TOP_LEVEL_SKIPPED = {
    ".git",
    ".venv",
    "build",
    "dist",
    "out",
    ".pytest_cache",
    "lessons",
    "tests",
    "benchmarks",
}


def _not_copied(folder: str, names: list[str]) -> set[str]:
    skipped = {n for n in names if n == "__pycache__" or n.endswith(".egg-info")}
    if Path(folder) == REPO:
        skipped |= _TOP_LEVEL_SKIPPED & set(names)
    return skipped


# Runs with -I -S: no PYTHONPATH, no current folder, no site-packages and so no
# editable finder (a .pth file installs it). The installed folder comes first;
# this venv's site-packages follow, added as plain paths so no .pth file runs.
_IMPORT_ALL = """
import importlib, importlib.metadata, importlib.util, json, pkgutil, sys
target, extra = sys.argv[1], json.loads(sys.argv[2])
sys.path[:0] = [target]
sys.path += extra
import parcourse
names = ["parcourse"] + [m.name for m in pkgutil.walk_packages(
    parcourse.__path__, "parcourse.", onerror=lambda name: sys.exit(f"cannot import {name}"))]
files = {}
for name in names:
    if name.rsplit(".", 1)[-1] == "__main__":  # importing it would run the command line
        files[name] = importlib.util.find_spec(name).origin
    else:
        files[name] = importlib.import_module(name).__file__
script = importlib.metadata.entry_points(group="console_scripts", name="parcourse")
files["console script"] = sys.modules[next(iter(script)).load().__module__].__file__
print(json.dumps(files))
"""


def _run(args: list[str], cwd: Path) -> str:
    done = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{' '.join(args)}\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
    return done.stdout


def _source_modules() -> set[str]:
    """Every module in the source tree, named as it is installed."""
    names = set()
    for package, folder in (
        ("parcourse", REPO / "parcourse"),
        ("parcourse.widgets", REPO / "widgets"),
    ):
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            # Only files inside packages (every folder down to them has an __init__.py).
            if all(
                (folder.joinpath(*parts[:i]) / "__init__.py").exists() for i in range(len(parts))
            ):
                names.add(".".join((package, *parts)).removesuffix(".__init__"))
    return names


def test_wheel_installs_and_imports_every_module(tmp_path):
    tree = tmp_path / "source"  # a copy: the build writes build/ and *.egg-info into it
    shutil.copytree(REPO, tree, ignore=_not_copied)
    wheels, target = tmp_path / "wheels", tmp_path / "installed"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
    # --no-build-isolation: the venv's setuptools builds it, nothing is fetched.
    _run(
        [
            *pip,
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "-w",
            str(wheels),
            str(tree),
        ],
        tmp_path,
    )
    (wheel,) = wheels.glob("parcourse-*.whl")
    _run(
        [*pip, "install", "--no-deps", "--no-index", "--target", str(target), str(wheel)], tmp_path
    )

    # This interpreter's paths for torch and the rest, less any that hold a parcourse
    # (the repository root would let the source tree stand in for the wheel).
    extra = [
        p for p in sys.path if os.path.isdir(p) and not os.path.exists(os.path.join(p, "parcourse"))
    ]
    out = _run(
        [sys.executable, "-I", "-S", "-c", _IMPORT_ALL, str(target), json.dumps(extra)], tmp_path
    )
    files = json.loads(out)

    for name, file in files.items():
        assert Path(file).is_relative_to(target), f"{name} came from {file}, not the wheel"
    installed, source = set(files) - {"console script"}, _source_modules()
    assert not source - installed, f"not in the wheel: {sorted(source - installed)}"
    assert not installed - source, f"in the wheel only: {sorted(installed - source)}"
    assert {"parcourse.data_parallel", "parcourse.zero", "parcourse.widgets.panel"} <= installed
    # data the package reads: the lessons' measured peaks (doctor --class)
    assert (target / "parcourse" / "lesson_peaks.json").is_file(), "lesson_peaks.json not shipped"
