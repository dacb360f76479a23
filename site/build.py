"""Build the course as a static site: `python site/build.py [--out out/site]` (`make site`).

1. The lessons, executed at their small parameters (lessons/small_parameters.json) by
   papermill, or taken from `--executed DIR` where the test suite already ran them; a
   panel's output (an ipywidgets view, dead without a kernel) becomes a note saying so.
2. The sources staged in OUT/../site-src: the README as the front page, docs/, the
   lessons, a reference page (every package's `__all__`, rendered by autodoc from the
   docstrings with the signatures) and an index of the lessons.
3. Sphinx (myst-nb for the notebooks and Markdown) writes the HTML into OUT.

Sphinx was chosen for being the one tool that renders all three kinds of page (Markdown,
executed notebooks through myst-nb, and the API from docstrings through autodoc) in one
build, with no Node.js on the machine.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import pkgutil
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PANEL_NOTE = (
    "This panel needs a running kernel: open this lesson in JupyterLab "
    "(`make lab`) and run it to use the panel."
)


def lessons() -> list[Path]:
    return sorted((REPO / "lessons").glob("[0-9][0-9]_*.ipynb"))


def execute(lesson: Path, out: Path) -> None:
    """The lesson at its small parameters, executed into `out`."""
    import papermill

    small = json.loads((REPO / "lessons" / "small_parameters.json").read_text())
    # The kernel inherits this process' environment: a test's MPLBACKEND=Agg would leave
    # every figure undrawn, where the page needs the notebook's own (inline) backend.
    backend = os.environ.pop("MPLBACKEND", None)
    try:
        papermill.execute_notebook(
            str(lesson),
            str(out),
            parameters=small[lesson.stem],
            kernel_name="python3",
            cwd=str(lesson.parent),
            progress_bar=False,
            execution_timeout=600,
            start_timeout=300,
        )  # a busy machine starts kernels slowly
    finally:
        if backend is not None:
            os.environ["MPLBACKEND"] = backend


def static(notebook: dict) -> dict:
    """The executed notebook for a static page: a cell a test appended dropped, a panel's
    widget view replaced by a note, papermill's own markings kept out of the text."""
    cells = [c for c in notebook["cells"] if c.get("id") != "then"]
    for cell in cells:
        outputs = []
        for o in cell.get("outputs", []):
            data = o.get("data", {})
            if "application/vnd.jupyter.widget-view+json" in data:
                outputs.append(
                    {
                        "output_type": "display_data",
                        "metadata": {},
                        "data": {"text/markdown": f"*{PANEL_NOTE}*", "text/plain": PANEL_NOTE},
                    }
                )
            else:
                outputs.append(o)
        if cell["cell_type"] == "code":
            cell["outputs"] = outputs
    notebook["cells"] = cells
    notebook.get("metadata", {}).pop("widgets", None)
    return notebook


def reference() -> str:
    """The reference page: every package's public names (its `__all__`), in package
    order, by autodoc."""
    import parcourse

    packages = sorted(
        {
            "parcourse",
            "parcourse.widgets",
            *(m.name for m in pkgutil.walk_packages(parcourse.__path__, "parcourse.") if m.ispkg),
        }
    )
    parts = [
        "# Library reference\n",
        "Every public name of each package (what its `__all__` exports), with its "
        "signature and docstring.\n",
    ]
    for name in packages:
        module = importlib.import_module(name)
        if not getattr(module, "__all__", None):
            continue
        parts.append(
            f"\n## `{name}`\n\n```{{eval-rst}}\n.. automodule:: {name}\n"
            "   :members:\n   :imported-members:\n   :undoc-members:\n```\n"
        )
    return "".join(parts)


def stage(src: Path, executed: dict[str, Path]) -> None:
    """The Sphinx sources under `src`."""
    shutil.rmtree(src, ignore_errors=True)
    (src / "lessons").mkdir(parents=True)
    shutil.copy(REPO / "site" / "conf.py", src / "conf.py")
    shutil.copytree(REPO / "docs", src / "docs")
    (src / "classroom").mkdir()  # the class server's recipe, which the README links to
    shutil.copy(REPO / "classroom" / "README.md", src / "classroom" / "README.md")
    readme = (REPO / "README.md").read_text()
    (src / "index.md").write_text(
        readme + "\n\n```{toctree}\n:hidden:\n\nlessons/index\n"
        "docs/README\nreference\nclassroom/README\n```\n"
    )
    names = []
    for lesson in lessons():
        notebook = json.loads(executed[lesson.stem].read_text())
        (src / "lessons" / lesson.name).write_text(json.dumps(static(notebook)))
        names.append(lesson.stem)
    (src / "lessons" / "index.md").write_text(
        "# Lessons\n\n```{toctree}\n:maxdepth: 1\n\n" + "\n".join(names) + "\n```\n"
    )
    (src / "reference.md").write_text(reference())
    pages = sorted(p.stem for p in (src / "docs").glob("*.md") if p.stem != "README")
    index = src / "docs" / "README.md"
    index.write_text(
        index.read_text() + "\n\n```{toctree}\n:hidden:\n\n" + "\n".join(pages) + "\n```\n"
    )


def build(out: Path, executed_dir: Path | None = None) -> Path:
    """Execute (or take) the lessons, stage the sources, run Sphinx; returns `out`."""
    src = out.parent / "site-src"
    executed: dict[str, Path] = {}
    run_dir = out.parent / "site-executed"
    run_dir.mkdir(parents=True, exist_ok=True)
    for lesson in lessons():
        found = executed_dir / lesson.name if executed_dir is not None else None
        if found is not None and found.exists():
            executed[lesson.stem] = found
            continue
        start = time.perf_counter()
        print(f"executing {lesson.name} at its small parameters ...", flush=True)
        execute(lesson, run_dir / lesson.name)
        print(f"  {time.perf_counter() - start:.0f} s", flush=True)
        executed[lesson.stem] = run_dir / lesson.name
    stage(src, executed)
    shutil.rmtree(out, ignore_errors=True)
    done = subprocess.run(
        [sys.executable, "-m", "sphinx", "-b", "html", "-q", str(src), str(out)],
        capture_output=True,
        text=True,
    )
    if done.returncode:
        raise RuntimeError(f"sphinx failed:\n{done.stderr[-4000:]}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(REPO / "out" / "site"))
    parser.add_argument(
        "--executed",
        default=None,
        metavar="DIR",
        help="take executed lessons from here where present",
    )
    parser.add_argument(
        "--reference",
        action="store_true",
        help="only write docs/reference.md (the reference GitHub shows)",
    )
    args = parser.parse_args()
    if args.reference:
        (REPO / "docs" / "reference.md").write_text(reference_markdown())
        print(f"wrote {REPO / 'docs' / 'reference.md'}")
        return
    out = build(Path(args.out), Path(args.executed) if args.executed else None)
    print(f"the site: {out / 'index.html'}")


def reference_markdown() -> str:
    """docs/reference.md: every package's public names with their signatures and the first
    paragraph of their docstrings, as plain Markdown that GitHub shows (the site's reference
    page has the whole docstrings). `python site/build.py --reference` writes it;
    tests/test_reference.py fails when it is out of date."""
    import inspect
    import typing

    import parcourse

    packages = sorted(
        {
            "parcourse",
            "parcourse.widgets",
            *(m.name for m in pkgutil.walk_packages(parcourse.__path__, "parcourse.") if m.ispkg),
        }
    )
    lines = [
        "# Library reference",
        "",
        "Every public name of each package (what its `__all__` exports): its signature and "
        "the first paragraph of its docstring. `make site` renders the whole docstrings. "
        "Generated by `python site/build.py --reference`; a test fails when it is out of "
        "date.",
        "",
    ]
    for name in packages:
        module = importlib.import_module(name)
        public = getattr(module, "__all__", None)
        if not public:
            continue
        doc = (module.__doc__ or "").strip().split("\n\n")[0]
        lines += [f"## `{name}`", "", " ".join(doc.split()), ""]
        for attr in public:
            obj = getattr(module, attr)
            if inspect.ismodule(obj) or typing.get_origin(obj) is not None:
                continue
            if not (inspect.isclass(obj) or inspect.isfunction(obj)):
                continue
            try:
                signature = str(inspect.signature(obj))
            except (TypeError, ValueError):
                signature = ""
            kind = "class " if inspect.isclass(obj) else ""
            first = " ".join((obj.__doc__ or "").strip().split("\n\n")[0].split())
            lines += [f"- **{kind}`{attr}{signature}`**", f"  {first}" if first else "", ""]
    return "\n".join(line for line in lines).replace("\n\n\n", "\n\n") + "\n"


if __name__ == "__main__":
    main()
