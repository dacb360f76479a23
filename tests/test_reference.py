"""The library's reference: every public name (what `__all__` exports in each package of
parcourse, and parcourse.widgets) resolves and, where it is a function or a class, has a
docstring of its own, which the site's reference page renders with its signature."""

import importlib
import inspect
import pkgutil
import typing

import parcourse


def public_packages() -> list[str]:
    """parcourse, every package under it, and parcourse.widgets (shipped from widgets/)."""
    names = ["parcourse"] + [
        m.name for m in pkgutil.walk_packages(parcourse.__path__, "parcourse.") if m.ispkg
    ]
    return sorted({*names, "parcourse.widgets"})


def documented(obj) -> bool:
    doc = obj.__doc__
    if inspect.isclass(obj):  # its own, not one inherited from a base class
        doc = obj.__dict__.get("__doc__")
    return bool(doc and doc.strip())


def test_every_public_name_has_a_docstring():
    missing, seen = [], 0
    for package in public_packages():
        module = importlib.import_module(package)
        assert module.__doc__, f"{package} has no module docstring"
        for name in getattr(module, "__all__", []):
            obj = getattr(module, name)  # an AttributeError: __all__ names a missing one
            if inspect.ismodule(obj) or typing.get_origin(obj) is not None:
                continue  # a submodule (its own page) or a type alias (Literal[...])
            if inspect.isclass(obj) or inspect.isfunction(obj) or inspect.isbuiltin(obj):
                seen += 1
                if not documented(obj):
                    missing.append(f"{package}.{name}")
    assert seen > 150, seen  # the walk found the packages
    assert not missing, "no docstring: " + ", ".join(missing)


def test_the_reference_github_shows_is_up_to_date():
    """docs/reference.md (every public name, its signature and the first paragraph of its
    docstring, what a reader of the repository finds one click from the README) is what
    `python site/build.py --reference` writes now."""
    import importlib.util
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    spec = importlib.util.spec_from_file_location("site_build", repo / "site" / "build.py")
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    assert (repo / "docs" / "reference.md").read_text() == build.reference_markdown(), (
        "docs/reference.md is out of date: python site/build.py --reference"
    )
