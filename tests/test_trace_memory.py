"""Tracer and memory accounting: exact bytes, one clock across ranks."""

import json

import pytest
import torch
from rankfns import sleep_then_barrier
from torch import nn

from parcourse import Tracer, launch
from parcourse.memory import SavedActivations, format_bytes, live_bytes


def small_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))


def test_adam_categories_match_exact_bytes():
    model = small_model()
    n_params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.Adam(model.parameters())
    x, y = torch.randn(16, 32), torch.randn(16, 8)
    nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()

    measured = live_bytes(model, optimizer)
    exact = {"params": 4 * n_params, "grads": 4 * n_params, "optimizer": 2 * 4 * n_params}
    for category, expected in exact.items():
        # rtol 1%: Adam also keeps one 4-byte `step` tensor per parameter tensor.
        assert measured[category] == pytest.approx(expected, rel=0.01), category
    assert measured["activations"] == 0 and measured["other"] == 0


def test_each_storage_counts_once():
    emb = nn.Embedding(100, 16)
    head = nn.Linear(16, 100, bias=False)
    head.weight = emb.weight  # tied
    model = nn.ModuleDict({"emb": emb, "head": head})
    assert live_bytes(model)["params"] == 100 * 16 * 4
    view = emb.weight.detach()[:10]
    assert live_bytes(model, other=[view])["other"] == 0, "a view of a parameter is a parameter"
    buffer = torch.empty(1000)
    assert live_bytes(other={"a": buffer, "b": [buffer[:5]]})["other"] == 4000


def test_saved_activations_are_counted_until_backward():
    model = small_model()
    x = torch.randn(16, 32)
    acts = SavedActivations()
    with acts:
        out = model(x)
    during = live_bytes(model, activations=acts)["activations"]
    # Saved for backward: the input of the first Linear (16x32) and the ReLU output
    # (16x64), which the second Linear saves again (same storage, counted once).
    assert during == 4 * (16 * 32 + 16 * 64)
    out.sum().backward()
    del out
    assert live_bytes(model, activations=acts)["activations"] == 4 * 16 * 32  # x is still ours
    del x
    assert live_bytes(model, activations=acts)["activations"] == 0


def test_tracer_records_spans_counters_memory():
    tracer = Tracer(rank=3)
    model = small_model()
    with tracer.span("outer", kind="compute", step=1):
        with tracer.span("inner", kind="comm", bucket=0):
            tracer.count("bytes_sent", 100)
        tracer.count("bytes_sent", 50)
    start = tracer.now()
    tracer.add_span("async all_reduce", start, start + 10, kind="comm")
    sample = tracer.memory("after init", model=model)
    data = tracer.data()
    inner, outer, manual = data.spans
    assert (inner.name, inner.depth, inner.meta) == ("inner", 1, {"bucket": 0})
    assert (outer.name, outer.depth, outer.rank) == ("outer", 0, 3)
    assert outer.start_ns <= inner.start_ns <= inner.end_ns <= outer.end_ns
    assert manual.end_ns - manual.start_ns == 10
    assert tracer.total("bytes_sent") == 150
    assert sample.bytes["params"] == 4 * sum(p.numel() for p in model.parameters())
    with pytest.raises(ValueError, match="unknown span kind"):
        with tracer.span("x", kind="network"):
            pass
    with pytest.raises(ValueError, match="ends .* before it starts"):
        tracer.add_span("backwards", 10, 5)


def test_spans_from_all_ranks_share_one_clock_across_a_barrier():
    run = launch(sleep_then_barrier, 4, 0.02)
    trace = run.trace
    before = trace.spans_of(name="before")
    after = trace.spans_of(name="after")
    barrier = trace.spans_of(name="barrier")
    assert len(before) == len(after) == len(barrier) == 4
    # Nobody leaves the barrier before everybody has entered it.
    assert max(s.end_ns for s in before) <= min(s.start_ns for s in after)
    assert max(s.start_ns for s in barrier) <= min(s.end_ns for s in barrier)
    # The first to come waited longer than the last: rank 0 slept least, but the ranks
    # leave the common start a few milliseconds apart on busy cores, so who came when
    # is read from the trace (its clock, the waits from each rank's own spans).
    waits = {s.rank: s.duration_s for s in barrier}
    came = sorted(barrier, key=lambda s: s.start_ns)
    assert waits[came[0].rank] > waits[came[-1].rank]


def test_chrome_export(tmp_path):
    run = launch(sleep_then_barrier, 2, 0.001)
    path = run.trace.to_chrome(tmp_path / "run.trace.json")
    events = json.loads(path.read_text())["traceEvents"]
    complete = [e for e in events if e["ph"] == "X"]
    assert {e["name"] for e in complete} == {"before", "barrier", "after"}
    assert {e["tid"] for e in complete} == {0, 1}
    assert all(e["ts"] >= 0 and e["dur"] >= 0 for e in complete)
    names = [e["args"]["name"] for e in events if e["ph"] == "M"]
    assert names == ["rank 0", "rank 1"]


def test_format_bytes():
    assert format_bytes(512) == "512 B"
    assert format_bytes(1536) == "1.5 KiB"
    assert format_bytes(3 * 1024**3) == "3.0 GiB"


def test_saved_bytes_over_a_step_ramps_and_bumps():
    """The curve lesson 08 draws: no checkpointing holds n + 1 layer outputs at its top
    and comes back to nothing; sqrt checkpointing of 16 layers peaks at 2 sqrt(n) = 8 and
    rises again once per segment as backward recomputes it."""
    from parcourse.experiments.checkpointing import saved_bytes_over_a_step

    curves = saved_bytes_over_a_step(16, ["none", "sqrt"], width=8, batch=4)
    none = [y for _, y in curves["none"]]
    assert max(none) == 17 and none[-1] == 0
    sqrt = [y for _, y in curves["sqrt"]]
    assert max(sqrt) == 8
    rises = sum(1 for a, b, c in zip(sqrt, sqrt[1:], sqrt[2:]) if b < a and c > b)
    assert rises >= 3  # a dip then a rise between segments, for 4 segments
