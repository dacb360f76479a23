"""The lessons tests/test_browser.py does not run (its HERE), in the browser the same way: a
module of its own, so that `make test`'s processes run the two halves side by side."""

import pytest
from test_browser import HERE, LESSONS, browser, lab, lesson_in_the_browser  # noqa: F401


@pytest.mark.notebook
@pytest.mark.parametrize("path", [p for p in LESSONS if p.stem not in HERE], ids=lambda p: p.stem)
def test_lesson_in_the_browser(path, lab, browser, executed_lessons):  # noqa: F811 - fixtures
    lesson_in_the_browser(path, lab, browser, executed_lessons)
