"""Activation checkpointing: same gradients as without it, and the memory the theory says.

Gradients are compared bitwise: checkpointing recomputes the same operations on the same
inputs in the same order (and replays the same random numbers), so nothing may differ.
"""

import pytest
import torch
from torch import nn

from parcourse.checkpointing import (
    checkpoint,
    checkpoint_sequential,
    recompute_from_input,
    run_with_policy,
)

POLICIES = ["none", "sqrt", "every", "nothing"]


def dropout_chain(n=9, width=8):
    g = torch.Generator().manual_seed(1)
    layers = [nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Dropout(0.3)) for _ in range(n)]
    with torch.no_grad():
        for p in (p for layer in layers for p in layer.parameters()):
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return layers


def run(policy, segments="sqrt"):
    layers = dropout_chain()
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(2), requires_grad=True)
    torch.manual_seed(5)
    y = run_with_policy(layers, x, policy, segments)
    y.square().sum().backward()
    after = torch.rand(3)  # the caller's random stream, as it is after the step
    return y.detach(), x.grad, [p.grad for layer in layers for p in layer.parameters()], after


@pytest.mark.parametrize("policy", POLICIES[1:])
def test_policies_give_the_same_gradients_with_dropout(policy):
    reference = run("none")
    got = run(policy)
    assert torch.equal(got[0], reference[0]), "output"
    assert torch.equal(got[1], reference[1]), "input gradient"
    assert all(torch.equal(a, b) for a, b in zip(got[2], reference[2])), "weight gradients"
    assert torch.equal(got[3], reference[3]), "recomputing drew from the caller's stream"


def test_without_the_saved_random_state_dropout_differs():
    """The RNG subtlety: recomputing without replaying the state draws new masks."""
    layers = dropout_chain()
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(2), requires_grad=True)
    torch.manual_seed(5)
    checkpoint_sequential(layers, 3, x, preserve_rng_state=False).square().sum().backward()
    assert not torch.equal(x.grad, run("none")[1])


@pytest.mark.parametrize("segments", [1, 2, 4, 9])
def test_any_segment_count(segments):
    assert torch.equal(run("sqrt", segments)[1], run("none")[1])


def test_keywords_constants_several_outputs_and_inputs_without_grad():
    lin = nn.Linear(3, 3)

    def f(a, scale, *, b, tag="x"):
        return {"sum": (lin(a) * scale + b).sum(), "proj": lin(b), "tag": tag}

    a = torch.randn(2, 3)  # requires no grad: lin's parameters still get theirs
    b = torch.randn(2, 3, requires_grad=True)
    results = []
    for fn in (lambda: checkpoint(f, a, 2.0, b=b, tag="y"), lambda: f(a, 2.0, b=b, tag="y")):
        lin.zero_grad()
        b.grad = None
        out = fn()
        (out["sum"] + out["proj"].sum()).backward()
        results.append((out["tag"], lin.weight.grad.clone(), lin.bias.grad.clone(), b.grad))
    (tag1, *grads1), (tag2, *grads2) = results
    assert tag1 == tag2 == "y"
    assert all(torch.equal(g1, g2) for g1, g2 in zip(grads1, grads2))


def test_unused_outputs_and_an_input_returned_as_it_is():
    lin = nn.Linear(3, 3)

    def f(a, b):
        return lin(a), lin(b).tanh(), b  # the second output is not used below

    a = torch.randn(2, 3, requires_grad=True)
    b = torch.randn(2, 3, requires_grad=True)
    results = []
    for fn in (lambda: checkpoint(f, a, b), lambda: f(a, b)):
        lin.zero_grad()
        a.grad = b.grad = None
        y, _, b_out = fn()
        (y.square().sum() + b_out.sum()).backward()
        results.append((a.grad, b.grad, lin.weight.grad.clone(), lin.bias.grad.clone()))
    assert all(torch.equal(g1, g2) for g1, g2 in zip(*results))


@pytest.mark.skipif(
    not hasattr(torch.autograd.Function, "boxed_grads_call"),
    reason="without boxed_grads_call, torch holds a checkpoint's incoming "
    "gradient to the end of its backward",
)
def test_peak_in_a_step_is_no_more_than_torchs_checkpoint():
    """MemTracker's peak over forward and backward, against torch.utils.checkpoint
    (non-reentrant) on the same segments (equal to the byte here). Before backward_taking,
    ours held the incoming gradient and the recomputed output to the end of each segment's
    backward: 2 layer outputs more at the peak."""
    import warnings

    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.utils.checkpoint import checkpoint as torch_checkpoint

    from parcourse.checkpointing import run_layers
    from parcourse.experiments.checkpointing import chain

    layers = chain(8, 32)
    x = torch.randn(16, 32)

    def ours():
        return checkpoint_sequential(layers, 4, x)

    def torchs():
        y = x
        for start in range(0, 8, 2):
            y = torch_checkpoint(run_layers, layers[start : start + 2], y, use_reentrant=False)
        return y

    peaks = []
    for step in (ours, torchs):
        for layer in layers:
            layer.zero_grad(set_to_none=True)
        tracker = MemTracker()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tracker.track_external(*layers)
            with tracker:
                step().sum().backward()
        peak = tracker.get_tracker_snapshot("peak")
        peaks.append(peak[next(iter(peak))]["Total"])
    assert peaks[0] <= peaks[1]


def test_only_the_inputs_are_saved():
    from parcourse.memory import PeakSavedBytes

    layers = [nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(6)]
    params = [p for layer in layers for p in layer.parameters()]
    x = torch.randn(8, 16, requires_grad=True)
    with PeakSavedBytes(exclude=params) as saved:
        y = checkpoint(lambda t: nn.Sequential(*layers)(t), x)
        after_forward = saved.live
        y.sum().backward()
    assert after_forward == x.nbytes  # the input, nothing else, until backward
    assert saved.peak == 7 * x.nbytes  # recomputed: the input and six outputs
    assert saved.live == 0


def test_misuse_raises_clearly():
    lin = nn.Linear(3, 3)
    x = torch.randn(2, 3, requires_grad=True)
    with pytest.raises(RuntimeError, match="torch.autograd.grad"):
        torch.autograd.grad(checkpoint(lin, x).sum(), x)
    with pytest.raises(ValueError, match="returned no tensor"):
        checkpoint(lambda t: "nothing", x)
    with pytest.raises(TypeError, match="needs a callable"):
        checkpoint(3, x)
    with pytest.raises(ValueError, match="between 1 and the 2 layers"):
        checkpoint_sequential([lin, lin], 3, x)
    with pytest.raises(ValueError, match="unknown policy"):
        run_with_policy([lin], x, "half")
    with pytest.raises(TypeError, match="one tensor in"):
        recompute_from_input([lin], (x,))


@pytest.mark.parametrize("n", [16, 64, 256])
def test_peak_saved_activations_follow_the_theory(n):
    from parcourse.experiments.checkpointing import measure_policy

    policies = ["none", "sqrt", "nothing"] if n < 256 else ["none", "sqrt"]  # n^2/2 forwards
    peaks = {}
    for policy in policies:
        r = measure_policy(n, policy, width=32, batch=8, repeats=1)
        # sqrt: the 10%; the chain's layers save exactly what the formula counts.
        assert r["peak_bytes"] == pytest.approx(r["theory_bytes"], rel=0.10), policy
        peaks[policy] = r["peak_bytes"] // r["activation_bytes"]
    assert peaks["none"] == n + 1  # linear in n
    if "nothing" in peaks:
        assert peaks["nothing"] == 3  # constant in n


def test_cli_prints_peak_and_theory(capsys):
    from parcourse.cli import main

    assert (
        main(
            [
                "checkpoint",
                "--layers",
                "16",
                "--policy",
                "sqrt",
                "--width",
                "16",
                "--batch",
                "4",
                "--repeats",
                "1",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "= 8 layer outputs (theory 8)" in out and "recomputes 16 layer forwards" in out
    with pytest.raises(SystemExit):
        main(["checkpoint", "--layers", "4", "--segments", "5"])


@pytest.mark.parametrize("world_size", [2, 4])
def test_checkpointed_tensor_parallel_block_recomputes_its_communication(pools, world_size):
    """The recomputation runs f and g again (every rank alike) and replays the tensor-
    parallel dropout generators: the same gradients as without checkpointing, bitwise."""
    import ckpt_fns

    plain = pools[world_size].run(ckpt_fns.tp_block_grads, False).results
    checked = pools[world_size].run(ckpt_fns.tp_block_grads, True).results
    for (x_a, grads_a), (x_b, grads_b) in zip(plain, checked):
        assert torch.equal(x_a, x_b)
        for name in grads_a:
            assert torch.equal(grads_a[name], grads_b[name]), name


@pytest.mark.parametrize("world_size", [2, 4])
def test_gpipe_with_recomputation(pools, world_size):
    """Each stage keeps only its microbatches' inputs: less in flight, same weights."""
    from pipeline_reference import one_process

    from parcourse.experiments.pipeline import train
    from parcourse.pipeline import gpipe

    def peak(run):
        counts = [
            c.meta["now"] for c in run.trace.counters if c.rank == 0 and c.name == "in_flight_bytes"
        ]
        return max(counts)

    plain = pools[world_size].run(train, gpipe(world_size, 4), 2)
    recomputed = pools[world_size].run(train, gpipe(world_size, 4), 2, recompute=True)
    assert peak(recomputed) < peak(plain) / 2
    expected = one_process(2)
    got = {}
    for r in recomputed.results:
        got.update(r["weights"])
    for name in expected:  # fp32, microbatches summed in another order: rtol 1e-5
        torch.testing.assert_close(got[name], expected[name], rtol=1e-5, atol=1e-6)


def test_selective_recomputation_of_attention():
    """The GPT with its attention cores recomputed: bitwise the same gradients (dropout
    on), and the T^2 tensors gone from what forward keeps."""
    from parcourse.checkpointing import recompute_attention
    from parcourse.data import progressions
    from parcourse.memory import PeakSavedBytes
    from parcourse.models import GPTConfig, gpt

    config = GPTConfig(vocab=32, block_size=64, n_layers=2, n_heads=4, d_model=32, dropout=0.2)
    x, y = progressions(4, 64, config.vocab)

    def run(selective):
        model = gpt(config)
        if selective:
            assert recompute_attention(model) == 2
        torch.manual_seed(7)
        with PeakSavedBytes(exclude=model.parameters()) as saved:
            logits = model(x)
            kept = saved.live
            nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()).backward()
        return kept, {n: p.grad for n, p in model.named_parameters()}

    kept_all, grads_all = run(False)
    kept_selective, grads_selective = run(True)
    for name in grads_all:
        assert torch.equal(grads_all[name], grads_selective[name]), name
    # Per block and head, the scores, softmax, dropout mask and dropped scores: (B, T, T)
    # floats three times and bools once. They no longer stay after forward.
    t2 = 2 * 4 * config.n_heads * 64 * 64 * (3 * 4 + 1)
    assert kept_all - kept_selective >= t2 * 0.9
    with pytest.raises(ValueError, match="no CausalSelfAttention"):
        recompute_attention(nn.Linear(2, 2))


def test_backward_exercise_check_names_the_mistake(capsys):
    from parcourse.experiments.checkpointing import check_backward_exercise

    def right(fn, inputs, grad_output):
        inputs = [t.detach().requires_grad_(t.requires_grad) for t in inputs]
        with torch.enable_grad():
            output = fn(*inputs)
        torch.autograd.backward(output, grad_output)
        return tuple(t.grad for t in inputs)

    def not_detached(fn, inputs, grad_output):  # backpropagates into the kept inputs
        with torch.enable_grad():
            output = fn(*inputs)
        torch.autograd.backward(output, grad_output)
        return tuple(t.grad for t in inputs)

    def no_grad_leaves(fn, inputs, grad_output):  # detached, but nothing to fill
        inputs = [t.detach() for t in inputs]
        with torch.enable_grad():
            output = fn(*inputs)
        torch.autograd.backward(output, grad_output)
        return tuple(t.grad for t in inputs)

    assert check_backward_exercise(right)
    assert not check_backward_exercise(not_detached)
    assert "twice" in capsys.readouterr().out
    assert not check_backward_exercise(no_grad_leaves)
    out = capsys.readouterr().out
    assert "the input is missing" in out and "fresh leaves" in out


def test_replayed_generators_live_as_long_as_what_keeps_them():
    """Tensor parallelism's dropout generators stay registered for replay while a dropout
    module keeps them (the tracker that made them may go), and not after; torch 2.11's
    generators cannot be weakly referenced, so the registration follows an owner."""
    import gc

    from parcourse.checkpointing import _extra_generators, replay_generator
    from parcourse.tensor_parallel import RNGTracker, TrackedDropout

    tracker = RNGTracker(0, 0)
    dropout = TrackedDropout(0.1, tracker, "sharded")
    generator = dropout.generator
    del tracker
    gc.collect()
    assert any(g is generator for g in _extra_generators())
    del dropout
    gc.collect()
    assert not any(g is generator for g in _extra_generators())
    with pytest.raises(TypeError, match="owner="):
        replay_generator(torch.Generator(), owner=1)


@pytest.mark.parametrize("how", ["checkpoint", "recompute_from_input"])
def test_recomputation_runs_in_the_first_runs_autocast(how):
    """Under torch.autocast (bf16 on the CPU) the recomputation computes in the dtypes
    the first run did, as torch's checkpoint: the same gradients as without
    checkpointing, bit for bit (it had recomputed in fp32, its gradients off by 1e-2)."""
    torch.manual_seed(0)
    layers = [nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16)]
    x = torch.randn(8, 16, requires_grad=True)

    def grads(wrapped):
        for p in (*layers[0].parameters(), *layers[2].parameters()):
            p.grad = None
        x.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = wrapped()
        y.float().square().sum().backward()
        return [x.grad.clone(), layers[0].weight.grad.clone()]

    plain = grads(lambda: nn.Sequential(*layers)(x))
    if how == "checkpoint":
        got = grads(lambda: checkpoint(nn.Sequential(*layers), x))
    else:
        got = grads(lambda: recompute_from_input(layers, x))
    for a, b in zip(got, plain):
        assert torch.equal(a, b)


def test_recomputation_leaves_out_an_autocast_the_first_run_was_not_in():
    """A forward outside autocast, its backward called inside one: the recomputation runs
    as the forward did (autocast off), as torch's checkpoint does."""
    torch.manual_seed(0)
    layer = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16))
    x = torch.randn(8, 16, requires_grad=True)

    def grad(wrapped):
        layer.zero_grad(set_to_none=True)
        y = wrapped()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y.square().sum().backward()
        return layer[0].weight.grad.clone()

    assert torch.equal(grad(lambda: checkpoint(layer, x)), grad(lambda: layer(x)))
