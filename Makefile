# Two commands do all the set-up on a fresh machine:
#   make lab    create .venv, install everything, open JupyterLab on lessons/
#   make test   the same set-up, then the whole test suite (what CI runs)
PYTHON ?= python3
VENV ?= .venv
TORCH_VERSION ?= 2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.parcourse-installed

.PHONY: lab test check lint install doctor bench bench-fault clean site

install: $(STAMP)

# torch first, pinned: with it installed, the package's torch range is already met
# and pip does not go looking for a newer (CUDA) build.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet "torch==$(TORCH_VERSION)"
	$(PY) -m pip install --quiet -e ".[dev]"
	$(PY) -c "import torch; print('torch', torch.__version__, '| cuda build:', torch.version.cuda)"
	touch $(STAMP)

# As root (workshop containers often are), JupyterLab needs --allow-root.
# Extra options: make lab LAB_ARGS="--no-browser --port 8890"
ROOT_FLAG := $(if $(filter 0,$(shell id -u)),--allow-root,)
LAB_ARGS ?=

lab: $(STAMP)
	$(VENV)/bin/jupyter lab lessons/ $(ROOT_FLAG) $(LAB_ARGS)

# Several pytest processes, each taking whole files (a module's pools start once, a
# lesson's cells run in order in one kernel): most of the suite's time is ranks asleep
# in simulated compute and kernels and browsers starting, not work.
# Files go costliest first (tests/conftest.py, tests/suite_costs.json); the report in
# out/suite.xml is what `python benchmarks/suite.py` reads (the slowest items, their share).
TEST_WORKERS ?= 3
test: $(STAMP)
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder \
		--durations=25 --junitxml=out/suite.xml

# A contributor's quick run, under two minutes on 2 cores: the tests tests/conftest.py's
# CHECK names (pure functions, hygiene, one small equivalence a strategy).
check: $(STAMP)
	$(PY) -m pytest -n 2 --dist loadfile --no-loadscope-reorder -m check -q

# What .ci/run checks before the tests: ruff's lint (import order included) and its
# format, over everything but the lessons (their cells are checked by running them), and
# mypy over the library (pyproject.toml's [tool.mypy]) with no error.
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

# The course as a static site in out/site (the lessons executed at their small parameters,
# the docs, the library's reference): open out/site/index.html.
site: $(STAMP)
	$(PY) site/build.py --out out/site

doctor: $(STAMP)
	$(PY) -m parcourse doctor

bench: $(STAMP)
	$(PY) benchmarks/launch.py

# A replica lost mid-run: the course's per-step recovery, torchft's, torchrun's restart.
bench-fault: $(STAMP)
	$(PY) -m pip install --quiet -e ".[fault]"
	$(PY) benchmarks/fault_tolerance.py

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache build dist
