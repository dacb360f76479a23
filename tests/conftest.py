import os

import matplotlib
import pytest

matplotlib.use("Agg")
os.environ.setdefault("MPLBACKEND", "Agg")


@pytest.fixture(scope="module")
def pool2():
    from parcourse import Pool

    with Pool(2, timeout=30) as pool:
        yield pool


@pytest.fixture(scope="module")
def pool4():
    from parcourse import Pool

    with Pool(4, timeout=30) as pool:
        yield pool


@pytest.fixture(scope="module")
def pools():
    """Pools of 2 and 4 ranks, for tests that run at both world sizes."""
    from parcourse import Pool

    made = {n: Pool(n, timeout=60) for n in (2, 4)}
    yield made
    for pool in made.values():
        pool.close()


@pytest.hookimpl(trylast=True)  # after -k and -m have deselected what will not run
def pytest_collection_modifyitems(config, items):
    """A lesson that tests/test_browser.py runs (small parameters at world size 3, in a
    real kernel, failing on any cell's error) is not also executed by papermill: nbval
    still runs it at its defaults (world size 4), and papermill's two runs (world sizes
    2 and 3) would cost CI about 35 s a lesson. The browser test also tries the panels at
    their controls' ends in its kernel, so papermill's run of the lesson for that goes
    too (15-25 s a lesson). Without Chromium the browser test module skips, collects
    nothing, and papermill's runs stay."""

    def name(item):
        return getattr(item, "originalname", None)

    in_browser = {item.callspec.id for item in items if name(item) == "test_lesson_in_the_browser"}
    for item in items:
        if (
            name(item)
            in (
                "test_lesson_executes_with_small_parameters",
                "test_lesson_executes_at_world_size_3",
                "test_panels_run_at_their_controls_ends",
            )
            and item.callspec.id in in_browser
        ):
            reason = "tests/test_browser.py runs this lesson (small, world size 3)"
            if name(item) == "test_panels_run_at_their_controls_ends":
                reason = "tests/test_browser.py tries these panels at their ends"
            item.add_marker(pytest.mark.skip(reason=reason))
