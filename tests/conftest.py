import json
import os
from pathlib import Path

# A run's limit guards a hang, not this machine's speed: the suite runs beside other
# work (three pytest processes on two cores, and whatever else), where a lesson's run
# that takes 5 s quiet has taken 57 s. The kernels nbval and papermill start inherit it.
os.environ.setdefault("PARCOURSE_TIMEOUT", "300")

import matplotlib
import pytest
from cell_limits import limit, too_long

matplotlib.use("Agg")


def _start_kernel_twice():
    """nbval starts a lesson's kernel once, waiting up to its startup timeout (300 s). A
    kernel whose port another process took in the moment between jupyter_client choosing
    it and the kernel binding it never answers (seen once here: all 23 cells of a lesson
    errored). A kernel starts in seconds even on a loaded machine: wait 120 s, and start
    a new one once more if the first never answered (as the grader does)."""
    import nbval.kernel

    first_try = nbval.kernel.start_new_kernel

    def start(startup_timeout=60, kernel_name="python", **kwargs):
        try:
            return first_try(min(startup_timeout, 120), kernel_name, **kwargs)
        except RuntimeError:
            return first_try(startup_timeout, kernel_name, **kwargs)

    nbval.kernel.start_new_kernel = start


_start_kernel_twice()

# Each file's measured seconds (benchmarks/suite.py --write-costs, from a `make test` run).
COSTS = json.loads((Path(__file__).parent / "suite_costs.json").read_text())
UNMEASURED_S = 10.0  # a file not measured yet: about a typical file's
# `make check`: a contributor's run in under two minutes on 2 cores (the README's Tests):
# the pure files whole (plans, parts, schedules, layouts, figures, the reference), the
# planner's pure functions, the lessons' hygiene, the router's formulas by hand, and one
# small "trains to the same weights as one process" a strategy, at world size 2.
CHECK = (
    "tests/test_plan.py",
    "tests/test_parts.py",
    "tests/test_plots.py",
    "tests/test_mesh.py",
    "tests/test_zero_layout.py",
    "tests/test_pipeline_split.py",
    "tests/test_pipeline_schedules.py",
    "tests/test_trace_memory.py",
    "tests/test_reference.py",
    "tests/test_parameter_server.py",
    "tests/test_checkpointing.py",
    "tests/test_context_parallel.py",
    "tests/test_lessons.py::test_lesson_hygiene",
    "tests/test_lessons.py::test_there_are_lessons",
    "tests/test_lessons.py::test_every_lesson_says_which_world_sizes_it_runs_at",
    "tests/test_planner.py::test_activations_against_korthikanti",
    "tests/test_planner.py::test_plans_are_ranked_by_predicted_step_time",
    "tests/test_planner.py::test_zero_2_waits_only_for_its_last_reduce_scatter",
    "tests/test_planner.py::test_nothing_fits_says_why",
    "tests/test_experts.py::test_switch_balancing_loss_by_hand",
    "tests/test_experts.py::test_gshard_capacity_by_hand",
    "tests/test_experts.py::test_deepseek_v3_bias_by_hand",
    "tests/test_collectives.py::test_random_floats_match_within_reduction_order[2]",
    "tests/test_data_parallel.py::test_same_weights_as_one_process[sgd-bucketed-2]",
    "tests/test_zero.py::test_same_weights_as_one_process[adam-3-2]",
    "tests/test_tensor_parallel.py::test_three_adam_steps_reach_the_same_weights[fp32-sp-2]",
    "tests/test_pipeline_runtime.py::test_same_weights_as_one_process[1f1b-2-2]",
    "tests/test_experts.py::test_expert_parallel_layer_equals_one_process[softmax-0.75-0-2]",
    "tests/test_hybrid.py::test_3d_on_eight_ranks_equals_one_process[shape0]",
    "tests/test_hsdp.py::test_hsdp_in_3d_equals_one_process[x tp 2-1]",
)
# Last, whatever the costs say: it takes the lessons the browser test ran (tests/test_site.py).
LAST = ("tests/test_site.py",)
os.environ.setdefault("MPLBACKEND", "Agg")


@pytest.fixture(scope="session")
def executed_lessons(tmp_path_factory) -> Path:
    """A folder every pytest process of the run shares (`make test` runs several): the
    browser test leaves each lesson it ran there, executed, and the site's build takes them
    instead of executing the lessons again (tests/test_site.py)."""
    base = tmp_path_factory.getbasetemp()
    shared = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "executed"
    shared.mkdir(exist_ok=True)
    return shared


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


def pytest_itemcollected(item):
    if item.nodeid.startswith(CHECK):  # before -m reads the marks
        item.add_marker(pytest.mark.check)


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
    costliest_first(items)


def costliest_first(items):
    """Files costliest first (tests/suite_costs.json), each file's tests kept together and in
    order. `make test` hands whole files to its pytest processes in this order
    (`--dist loadfile --no-loadscope-reorder`), the longest-processing-time rule: the long
    lessons and browser runs start at once and the short files fill in behind them, and
    the processes end close together. tests/test_site.py goes last."""
    file_of = {id(item): item.nodeid.split("::")[0] for item in items}
    first_seen = {}
    for item in items:
        first_seen.setdefault(file_of[id(item)], len(first_seen))

    def key(item):
        f = file_of[id(item)]
        return (f in LAST, -COSTS.get(f, UNMEASURED_S), first_seen[f])

    items.sort(key=key)  # stable: a file's own order stays


def _nbval_cell(item):
    """(lesson, code cell) for one of nbval's items, else None."""
    cell = getattr(item, "cell_num", None)
    return (Path(str(item.fspath)).stem, cell) if cell is not None else None


def pytest_runtest_setup(item):
    """nbval's cell timeout, set for each cell from what it takes at the lesson's defaults
    (tests/cell_limits.py): nbval reads the option as the cell starts."""
    if where := _nbval_cell(item):
        item.config.option.nbval_cell_timeout = limit(*where, "defaults")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    where = _nbval_cell(item)
    if where and report.failed and "Timeout of" in str(report.longrepr):
        report.sections.append(("cell limit", too_long(*where, "defaults", call.duration)))
    return report
