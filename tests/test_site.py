"""The course as a website (`make site`, site/build.py): it builds from the lessons (executed
at their small parameters), the docs and the reference; every page, image and internal link
resolves, every lesson page shows its figures, a panel says it needs a kernel instead of
showing a dead control, and the reference names every public function and class.

A lesson that tests/test_browser.py runs in this session is not executed again here: the
build takes the notebook that JupyterLab saved after its Run All (world size 3), waiting for
it where another pytest process is still running it; any other lesson, or one whose browser
run failed or did not arrive in time, is executed here by papermill as `make site` does."""

import html.parser
import importlib.util
import inspect
import time
from pathlib import Path
from urllib.parse import unquote, urlparse

import pytest

REPO = Path(__file__).resolve().parent.parent


class _Links(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.links: list[str] = []
        self.ids: set[str] = set()
        self.images = 0

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if "id" in attrs:
            self.ids.add(attrs["id"])
        if tag == "a" and attrs.get("href"):
            self.links.append(attrs["href"])
        if tag in ("img", "script", "link") and (attrs.get("src") or attrs.get("href")):
            self.links.append(attrs.get("src") or attrs["href"])
        if tag == "img":
            self.images += 1


def _build_module():
    spec = importlib.util.spec_from_file_location("site_build", REPO / "site" / "build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# Bounds the wait for another process' browser runs (a lesson there takes up to about
# 2.5 min on 2 cores; several are queued): past it, the lessons still missing run here.
BROWSER_WAIT_S = 900


def browser_runs(request, executed: Path) -> Path | None:
    """The folder of the lessons the browser test ran, once every one it runs in this
    session has arrived or failed (or the wait is over); None where it runs none."""
    names = {
        item.callspec.id + ".ipynb"
        for item in request.session.items
        if getattr(item, "originalname", None) == "test_lesson_in_the_browser"
    }
    if not names:
        return None
    deadline = time.monotonic() + BROWSER_WAIT_S
    pending = names
    while pending and time.monotonic() < deadline:
        pending = {
            n
            for n in pending
            if not (executed / n).exists() and not (executed / f"{n}.failed").exists()
        }
        if pending:
            time.sleep(1)
    if pending:
        print(f"not from the browser test within {BROWSER_WAIT_S} s: {sorted(pending)}")
    return executed


@pytest.mark.notebook
def test_the_site_builds_and_every_link_resolves(tmp_path, request, executed_lessons):
    build = _build_module()
    out = build.build(tmp_path / "site", browser_runs(request, executed_lessons))
    pages = {p: _Links() for p in out.rglob("*.html")}
    for page, parsed in pages.items():
        parsed.feed(page.read_text())
    broken = []
    for page, parsed in pages.items():
        for link in parsed.links:
            url = urlparse(link)
            if url.scheme or link.startswith(("mailto:", "//")):
                continue  # outside the site
            target = (page.parent / unquote(url.path)).resolve() if url.path else page
            if not target.exists():
                broken.append(f"{page.relative_to(out)}: {link}")
            elif (
                url.fragment
                and target.suffix == ".html"
                and target in pages
                and url.fragment not in pages[target].ids
            ):
                broken.append(f"{page.relative_to(out)}: {link} (no such anchor)")
    assert not broken, "\n".join(broken[:20])
    lessons = sorted((REPO / "lessons").glob("[0-9][0-9]_*.ipynb"))
    for lesson in lessons:
        page = out / "lessons" / f"{lesson.stem}.html"
        assert page.exists(), lesson.stem
        assert pages[page].images >= 2, f"{lesson.stem}: its figures are missing"
        text = page.read_text()
        if "RunPanel(" in lesson.read_text():
            assert build.PANEL_NOTE.split(":")[0] in text, lesson.stem
        assert "widget-view" not in text, f"{lesson.stem}: a dead control on the page"
    for name in (
        "docs/README.html",
        "docs/design.html",
        "docs/experts.html",
        "reference.html",
        "index.html",
    ):
        assert (out / name).exists(), name
    reference = (out / "reference.html").read_text()
    import parcourse

    for name in parcourse.__all__:
        obj = getattr(parcourse, name)
        if inspect.isclass(obj) or inspect.isfunction(obj):
            assert f'id="parcourse.{name}"' in reference, name
