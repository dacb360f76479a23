"""Sphinx's configuration for the course's site (`make site`; site/build.py stages the
sources and runs Sphinx on them): the README as the front page, docs/ as pages, the lessons
as executed notebooks (myst-nb, never executed here: build.py runs them first), and the
library's reference from its docstrings (autodoc)."""

project = "parcourse"
author = "the parcourse authors"
extensions = ["myst_nb", "sphinx.ext.autodoc"]
root_doc = "index"
exclude_patterns = ["_build"]
nb_execution_mode = "off"  # executed at their small parameters by build.py
nb_merge_streams = True
myst_heading_anchors = 3  # links to #headings in the README and the docs
autodoc_member_order = "bysource"
default_role = "literal"  # a docstring's `name` reads as code, as in the source
autodoc_typehints = "signature"
html_theme = "alabaster"
html_title = "parcourse"
html_theme_options = {
    "description": "distributed training, built from scratch and measured",
    "page_width": "1100px",
    "sidebar_width": "240px",
}
suppress_warnings = ["myst.header", "mystnb.unknown_mime_type"]


def _plain_text(app, what, name, obj, options, lines):
    """The docstrings are plain text with `names` in backticks, not reStructuredText: a
    `*rest` or a `clip_grad_norm_` there is not emphasis or a link. Escape what
    reStructuredText would read as markup, outside the backticks and doctest lines."""
    import re

    for i, line in enumerate(lines):
        if line.lstrip().startswith((">>>", "...")):
            continue
        parts = line.split("`")
        for j in range(0, len(parts), 2):  # outside the backticks
            text = parts[j].replace("\\", "\\\\").replace("*", "\\*").replace("|", "\\|")
            parts[j] = re.sub(r"(\w)_(?=\W|$)", r"\1\\_", text)
        lines[i] = "`".join(parts)


def setup(app):
    app.connect("autodoc-process-docstring", _plain_text)
