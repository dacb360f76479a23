"""The run panel drives real ranks; errors land in the panel, not the kernel."""

import ipywidgets as W
import pytest
from parcourse.widgets import RunPanel, close_shared_pools, shared_pool
from rankfns import fail_on, fail_on_rank, slow

from parcourse import limit_pools
from parcourse.experiments import launching


@pytest.fixture(autouse=True, scope="module")
def _pools():
    yield
    close_shared_pools()
    limit_pools(None)  # shared_pool set the notebook's limit; other test modules keep none


def test_panel_runs_on_creation_and_on_click():
    op = W.Dropdown(options=launching.COLLECTIVES, value="all_reduce")
    seen = []

    def render(run, op, numel):
        seen.append(op)
        return f"{op}: {[after.tolist() for _, after in run.results]}"

    panel = RunPanel(
        launching.show_collective,
        {"op": op, "numel": W.IntSlider(2, 1, 8)},
        render,
        world_size=2,
        check=launching.check_collective_args,
    )
    assert panel.last_error is None
    assert panel.summary == "all_reduce: [[2, 4], [2, 4]]"
    op.value = "all_gather"
    panel.button.click()
    assert panel.summary == "all_gather: [[0, 1, 2, 3], [0, 1, 2, 3]]"
    assert seen == ["all_reduce", "all_gather"]
    assert "2 ranks" in panel.status.value and not panel.button.disabled


def test_panel_shows_errors_and_recovers():
    panel = RunPanel(fail_on, {"bad_rank": W.IntSlider(1, 0, 1)}, world_size=2, run_now=False)
    assert panel.run() is None
    assert "RankError: rank 1 raised ValueError" in panel.last_error
    assert "failed" in panel.status.value
    bad = RunPanel(
        launching.show_collective,
        {"op": W.Dropdown(options=["reduce_scatter"]), "numel": W.IntSlider(3, 1, 8)},
        world_size=2,
        check=launching.check_collective_args,
        run_now=False,
    )
    bad.button.click()  # a learner's click: the error goes into the panel
    assert "not divisible by world_size=2" in bad.last_error
    ok = RunPanel(slow, {"seconds": W.FloatSlider(0.01)}, world_size=2)
    assert ok.last_error is None and ok.last_run.results == [0, 1]


def test_trying_a_panel_at_its_edges_names_what_failed_and_accepts_refusals():
    """try_edges: a rank that fails at a control's end is a problem; a one-line refusal
    by the panel's check, before any rank starts, is not. Values come back after."""

    def check(world_size, bad_rank, flag, op):
        if op == "refused":
            raise ValueError("op 'refused' is refused here")

    panel = RunPanel(
        fail_on_rank,
        {
            "bad_rank": W.IntSlider(5, 0, 5),
            "flag": W.Checkbox(False),
            "op": W.Dropdown(options=["fine", "refused"]),
        },
        world_size=2,
        check=check,
        title="edges",
    )
    assert panel.last_error is None  # bad_rank 5: no rank fails
    assert panel.edges() == [("bad_rank", 0), ("flag", True), ("op", "refused")]
    problems = panel.try_edges()
    assert len(problems) == 1 and problems[0].startswith("edges, bad_rank = 0: ")
    assert panel.params() == {"bad_rank": 5, "flag": False, "op": "fine"}
    # From a start of its own, which runs first; each end is one move from it (bad_rank 5
    # now too, and flag fails there: rank 1 still fails).
    problems = panel.try_edges(start={"bad_rank": 1})
    assert [p.split(":")[0] for p in problems] == [
        "edges, bad_rank = 1",
        "edges, bad_rank = 0",
        "edges, flag = True",
    ]
    assert panel.params() == {"bad_rank": 5, "flag": False, "op": "fine"}
    with pytest.raises(ValueError, match="no control named rank"):
        panel.try_edges(start={"rank": 1})
    # a list of (label, value) options whose values are dicts (lesson 09's mesh shapes)
    shapes = RunPanel(
        fail_on_rank,
        {"shape": W.Dropdown(options=[("dp 2", {"dp": 2}), ("tp 2", {"tp": 2})])},
        world_size=2,
        run_now=False,
    )
    assert shapes.edges() == [("shape", {"tp": 2})]


def test_world_size_control_picks_a_shared_pool():
    ws = W.IntSlider(2, 1, 4)
    panel = RunPanel(launching.hello, {"world_size": ws})
    assert len(panel.last_run.results) == 2
    ws.value = 3
    panel.run()
    assert len(panel.last_run.results) == 3
    assert shared_pool(3) is shared_pool(3)


def test_memory_calculator_follows_the_formula():
    from parcourse.widgets import MemoryCalculator

    calc = MemoryCalculator(params_billions=7.0, world_size=8, stage=0)
    assert calc.params.value == 7.0, "no slider snapping 7 to 6.31"
    # 7B parameters, bf16 + fp32 master: 16 bytes each = 104.3 GiB before sharding
    assert "104.3 GiB" in calc.out.value and "fits on H200 (141 GB)" in calc.out.value
    ax = calc.figure.axes[0]
    heights = [bar.get_height() for bar in ax.patches]
    assert heights[:3] == pytest.approx([7e9 * 2 / 2**30, 7e9 * 2 / 2**30, 7e9 * 12 / 2**30])
    gpu_lines = sorted(line.get_ydata()[0] for line in ax.get_lines())
    assert gpu_lines == [24, 80, 141], "GPUs up to a little above the total are drawn"
    calc.stage.value = 3
    # (2 + 4 + 12) bytes x 7e9 / 8: sharded gradients reach the optimizer in fp32
    assert "14.7 GiB" in calc.out.value
    calc.params.value = 70.5  # typed, kept as typed
    assert calc.bytes_per_rank()["params"] == pytest.approx(70.5e9 * 2 / 8)
    assert calc.world.options == tuple(2**k for k in range(11))
    calc.dtype.value = "fp32"
    calc.params.value = 7.0
    assert calc.bytes_per_rank()["optimizer"] == pytest.approx(8 * 7e9 / 8)
    with pytest.raises(ValueError, match="power of two"):
        MemoryCalculator(world_size=6)


def test_a_panel_that_fails_when_made_raises():
    # Made (and run) by a lesson cell: a broken panel must fail the notebook in CI.
    def render(run, missing):  # the controls do not match
        return "never"

    with pytest.raises(TypeError, match="unexpected keyword argument"):
        RunPanel(
            launching.show_collective,
            {"op": W.Dropdown(options=["all_reduce"]), "numel": W.IntSlider(2, 1, 8)},
            render,
            world_size=2,
        )


def test_panel_says_when_it_starts_ranks_what_they_do_and_what_it_clamped():
    seconds = W.FloatSlider(0.4, min=0.0, max=0.5)
    panel = RunPanel(slow, {"world_size": W.IntSlider(3, 1, 4), "seconds": seconds}, run_now=False)
    seen = []
    panel.status.observe(lambda change: seen.append(change["new"]), names="value")
    shared_pool(3).close()  # a world size whose ranks are not up: the first click starts them
    panel.run()
    text = "\n".join(seen)
    assert "starting 3 ranks" in text and "the first run starts the ranks" in text, text
    assert "ranks 0, 1, 2: in &#x27;slow step&#x27;" in text, "one line for ranks doing the same"
    # how long starting took, unless it was too short to say (a start under 0.05 s, not
    # "of which 0.0 s starting the ranks" right after "starting 3 ranks…")
    said = "s starting the ranks" in panel.status.value
    assert said == (panel.last_run.startup_s >= 0.05), panel.status.value
    seen.clear()
    seconds.value = 0.7  # typed beyond the slider: ipywidgets clamps it to 0.5, silently
    panel.run()
    assert not any("starting" in s for s in seen), "a warm pool starts nothing"
    assert "seconds = 0.5 is the slider&#x27;s maximum" in panel.status.value
    panel.run()  # nothing moved since: no note, and no "0.0 s starting the ranks"
    assert "maximum" not in panel.status.value and "starting" not in panel.status.value


def test_explorer_zooms_reads_spans_and_exports(tmp_path):
    import json

    from rankfns import sleep_then_barrier

    panel = RunPanel(
        sleep_then_barrier,
        {"seconds": W.FloatSlider(0.02, min=0.0, max=0.1)},
        world_size=2,
        title="Barrier, then work",
    )
    explorer = panel.explorer
    assert explorer.widget.layout.display != "none"
    assert explorer.table.value == ""  # nothing drawn while closed
    explorer.widget.selected_index = 0  # a learner opens it
    names = {s.name for s in explorer.spans_in_range()}
    assert names >= {"before", "barrier", "after"}
    assert "<td>barrier</td>" in explorer.table.value and "duration (ms)" in explorer.table.value
    explorer.rank.value = 1  # one rank
    assert {s.rank for s in explorer.spans_in_range()} == {1}
    explorer.rank.value = -1
    lo, hi = explorer.range.value
    first = min(s.end_ns for s in explorer.spans_in_range()) - panel.last_run.trace.t0_ns
    explorer.range.value = (lo, first / 1e6 * 0.5)  # before any span has ended
    assert all(
        s.start_ns - panel.last_run.trace.t0_ns <= first / 2 + 1 for s in explorer.spans_in_range()
    )
    explorer.folder = tmp_path
    path = explorer.write()
    events = json.loads(path.read_text())
    events = events["traceEvents"] if isinstance(events, dict) else events
    assert {e["name"] for e in events if e.get("ph") == "X"} >= {"before", "barrier", "after"}
    assert path.name.startswith("barrier-then-work-")
    assert "ui.perfetto.dev" in explorer.exported.value


def test_planner_panel_plans_when_made_and_refuses_a_bad_batch():
    from parcourse.widgets import PlannerPanel

    panel = PlannerPanel(model_name="1.3B", gpus=8, gpu="a100", batch=64, seq=2048)
    assert " fit, " in panel.text and "configurations in" in panel.status.value
    # the table shown as it is: one row a line, scrolled sideways rather than wrapped
    table = panel.out.outputs[0]["data"]["text/html"]
    assert "white-space: pre;" in table and "overflow-x: auto" in table
    panel.batch.value = 0
    panel.update()
    # refused in words, and the last result (for other inputs) taken away
    assert "must be above 0" in panel.status.value and panel.text == ""
    assert not panel.out.outputs
    with pytest.raises(ValueError, match="gpus must be one of"):
        PlannerPanel(gpus=12)


PANEL_CELL = """
import matplotlib.pyplot as plt
import ipywidgets as W
from parcourse.experiments import launching
from parcourse.widgets import MemoryCalculator, RunPanel

def render(run):
    fig, ax = plt.subplots()
    ax.plot([0, 1])
    return [fig, f"{len(run.results)} rank"]

panel = RunPanel(launching.hello, {}, render, world_size=1)
panel.run()
panel._fail("shown as an error")
calculator = MemoryCalculator()
panel
"""


def test_a_panel_cell_leaves_the_clients_shell_socket_alone():
    """The cause of the stalled panel cells (#32): a headless client (nbclient) stands in
    for the browser's Output widget and, for each output the kernel routes into one during
    a cell, sends the widget's state back on its shell socket, where that send can swallow
    the readiness of the cell's execute_reply (benchmarks/panel_stall.py measured the
    reply taken in at the client's 300 s timeout). The panels set their outputs instead:
    while a panel cell runs, the client sends nothing but the cell itself."""
    import nbformat
    from nbclient import NotebookClient

    for attempt in (1, 2):
        notebook = nbformat.v4.new_notebook()
        notebook.cells = [nbformat.v4.new_code_cell(PANEL_CELL)]
        client = NotebookClient(notebook, kernel_name="python3", timeout=120, startup_timeout=300)
        sent = []

        def count_what_the_client_sends(client=client, sent=sent, **_):
            send = client.kc.shell_channel.send

            def counted(msg):
                sent.append(msg["header"]["msg_type"])
                return send(msg)

            client.kc.shell_channel.send = counted

        client.on_notebook_start = count_what_the_client_sends
        try:
            client.execute()
            break
        except RuntimeError as e:
            # Only the kernel's own start is tried again (as tests/test_lessons.py does):
            # jupyter_client picks its ports before the kernel binds them, and beside
            # other work another process can take one in between ("Address already in use")
            if attempt == 2 or "Kernel died before replying" not in str(e):
                raise
    outputs = notebook.cells[0].outputs
    assert any("application/vnd.jupyter.widget-view+json" in o.get("data", {}) for o in outputs)
    assert [t for t in sent if t not in ("execute_request", "kernel_info_request")] == []
    assert "execute_request" in sent  # what was counted is the client's shell socket
    state = client.widget_state  # what the panel showed, as the client recorded it
    shown = [o for s in state.values() for o in s.get("outputs", [])]
    assert any("image/png" in o.get("data", {}) for o in shown)
    assert any("shown as an error" in o.get("data", {}).get("text/html", "") for o in shown)


def test_the_planners_figure_keeps_its_words_inside_and_apart():
    """Lesson 09's planner chart: each MFU label inside its axes, the two legends side by
    side without touching, and the table's numbers in line however long a plan's name."""
    import matplotlib.pyplot as plt

    from parcourse.experiments import figures
    from parcourse.planner import Cluster, format_plans, model, plan

    cluster = Cluster.preset("a100", 8)
    plans = plan(model("1.3B", 2048), cluster, 64, dtype="bf16")
    fig = figures.plan_bars(plans, cluster.memory, top=6)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    mem_ax, time_ax = fig.axes
    box = time_ax.get_window_extent(renderer)
    for text in time_ax.texts:
        assert box.x0 <= text.get_window_extent(renderer).x1 <= box.x1, text.get_text()
    left, right = (ax.get_legend().get_window_extent(renderer) for ax in (mem_ax, time_ax))
    assert left.x1 <= right.x0, "the legends overlap"
    plt.close(fig)
    lines = format_plans(plans, 6).splitlines()[:7]
    ends = {len(line) - len(line.split(" (pp ")[-1]) for line in lines[1:]}
    assert len(ends) == 1, "the rows' columns do not line up"
