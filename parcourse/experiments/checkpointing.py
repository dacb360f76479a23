"""Checkpointing runs that lesson 08, the CLI and benchmarks/checkpointing.py launch: peak
saved-activation bytes and step time of a chain of equal layers under each policy."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any, Literal

import torch
from torch import nn

from parcourse.checkpointing import (
    Policy,
    checkpoint_sequential,
    run_layers,
    run_with_policy,
    segment_count,
)
from parcourse.experiments.exercises import NOT_WRITTEN
from parcourse.experiments.timing import one_thread
from parcourse.launch import RankContext
from parcourse.memory import PeakSavedBytes
from parcourse.theory import checkpoint_extra_forwards, checkpoint_peak_activations


def chain(n_layers: int, width: int, seed: int = 0) -> list[nn.Module]:
    """n equal layers, Linear then Tanh: each saves one tensor of its output's size (the
    Linear its input, which is the previous Tanh's output; the Tanh its output)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return [nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(n_layers)]


def measure_policy(
    n_layers: int,
    policy: Policy,
    *,
    width: int = 64,
    batch: int = 32,
    segments: int | None = None,
    repeats: int = 3,
) -> dict[str, Any]:
    """One chain under `policy`: the peak of saved activations over forward and backward
    (measured), the step time (median of `repeats`, in one thread), and the theory for
    both."""
    layers = chain(n_layers, width)
    params = [p for layer in layers for p in layer.parameters()]
    x = torch.randn(batch, width, generator=torch.Generator().manual_seed(1))
    seg: int | Literal["sqrt"] = segments if segments is not None else "sqrt"
    peaks, times = [], []
    with one_thread():
        for _ in range(repeats):
            for p in params:
                p.grad = None
            start = time.perf_counter()
            with PeakSavedBytes(exclude=params) as saved:
                run_with_policy(layers, x, policy, seg).sum().backward()  # sum() saves nothing
            times.append(time.perf_counter() - start)
            peaks.append(saved.peak)
    one = batch * width * 4  # one layer output, fp32
    k = segment_count(n_layers, seg) if policy == "sqrt" else None
    return {
        "n_layers": n_layers,
        "policy": policy,
        "peak_bytes": max(peaks),
        "theory_bytes": checkpoint_peak_activations(n_layers, policy, k) * one,
        "step_s": statistics.median(times),
        "extra_forwards": checkpoint_extra_forwards(n_layers, policy),
        "activation_bytes": one,
    }


def saved_bytes_over_a_step(
    n_layers: int, policies: list[Policy], *, width: int = 64, batch: int = 32
) -> dict[str, list[tuple[float, float]]]:
    """For each policy, the activations held over one forward and backward of a chain of
    `n_layers`: (position among the step's saves and releases, as a fraction; bytes held
    in layer outputs) at every change, the picture checkpointing is known by (a ramp
    through forward; under checkpointing a bump per segment as backward recomputes it).
    In order of events, not of time: a step's first calls can take most of its time."""
    layers = chain(n_layers, width)
    params = [p for layer in layers for p in layer.parameters()]
    x = torch.randn(batch, width, generator=torch.Generator().manual_seed(1))
    one = batch * width * 4
    curves: dict[str, list[tuple[float, float]]] = {}
    for policy in policies:
        for p in params:
            p.grad = None
        with PeakSavedBytes(exclude=params, record=True) as saved:
            run_with_policy(layers, x, policy, "sqrt").sum().backward()
        assert saved.history is not None
        n = len(saved.history) + 1
        curves[policy] = [(0.0, 0.0)] + [
            ((i + 1) / n, live / one) for i, (_, live) in enumerate(saved.history)
        ]
    return curves


def sweep(n_values: list[int], policies: list[Policy], **kwargs: Any) -> list[dict[str, Any]]:
    """`measure_policy` for every n and policy (one process: checkpointing needs no ranks)."""
    return [measure_policy(n, policy, **kwargs) for n in n_values for policy in policies]


def measure_on_rank(
    ctx: RankContext,
    n_layers: int,
    policy: Policy,
    width: int = 64,
    batch: int = 32,
    segments: int | None = None,
) -> dict[str, Any]:
    """`measure_policy` as a rank function, for a panel (checkpointing needs one rank):
    after a warm-up step on a short chain (a process's first step pays for allocations
    and lazy set-up, whatever the length), the median of 3 steps; of 1 under "nothing",
    whose n^2 / 2 layer forwards make each step long. `repeats` says which."""
    measure_policy(2, policy, width=width, batch=batch, repeats=1)  # warm-up, not timed
    repeats = 1 if policy == "nothing" else 3
    ctx.tracer.set_status(
        f"{policy}: {repeats} step{'s' * (repeats > 1)} of {n_layers} layers"
        + (f" ({n_layers * (n_layers + 1) // 2} layer forwards)" if policy == "nothing" else "")
    )
    out = measure_policy(
        n_layers, policy, width=width, batch=batch, segments=segments, repeats=repeats
    )
    return {**out, "repeats": repeats}


def dropout_gradients(
    preserve_rng_state: bool, n_layers: int = 6, width: int = 16
) -> tuple[torch.Tensor, torch.Tensor]:
    """The input gradient of a chain with dropout, without and with checkpointing (3
    segments); with `preserve_rng_state=False` the recomputation draws new masks."""

    def layers() -> list[nn.Module]:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            return [
                nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Dropout(0.5))
                for _ in range(n_layers)
            ]

    grads = []
    for checkpointed in (False, True):
        x = torch.randn(8, width, generator=torch.Generator().manual_seed(1), requires_grad=True)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(5)  # the same masks in the first forward, both times
            chain = layers()
            y = (
                checkpoint_sequential(chain, 3, x, preserve_rng_state=preserve_rng_state)
                if checkpointed
                else run_layers(chain, x)
            )
            y.sum().backward()
        assert x.grad is not None  # x requires grad
        grads.append(x.grad)
    return grads[0], grads[1]


BackwardFn = Callable[
    [Callable[..., torch.Tensor], tuple[torch.Tensor, ...], torch.Tensor],
    tuple[torch.Tensor | None, ...],
]


def check_backward_exercise(backward: BackwardFn) -> bool:
    """Lesson 08's exercise: `backward(fn, inputs, grad_output)` is checkpoint's backward:
    it gets what forward kept (fn and its inputs) and the gradient of fn's output, and
    returns the gradients of the inputs (and fills the parameters' .grad). Checked
    against autograd without checkpointing. Prints one short verdict."""

    class Learners(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, fn: Any, *inputs: torch.Tensor) -> torch.Tensor:
            ctx.fn = fn
            ctx.save_for_backward(*inputs)
            with torch.no_grad():
                return fn(*inputs)

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> Any:
            return (None, *backward(ctx.fn, tuple(ctx.saved_tensors), grad))

    g = torch.Generator().manual_seed(0)
    for width in (3, 8):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(width)
            layer = nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width))
        x = torch.randn(4, width, generator=g, requires_grad=True)
        layer(x).square().sum().backward()
        expected = []
        for t in (x, *layer.parameters()):
            assert t.grad is not None  # autograd fills every leaf's gradient
            expected.append(t.grad.clone())
        x.grad = None
        layer.zero_grad(set_to_none=True)
        try:
            Learners.apply(layer, x).square().sum().backward()
        except NotImplementedError:
            print(NOT_WRITTEN)
            return False
        except Exception as e:  # noqa: BLE001 - a learner's bug, shown as one line
            print(
                f"Not yet: backward raised {type(e).__name__}: {str(e).splitlines()[0]}. "
                "Hint: run fn again on inputs detached from the old graph, with grad "
                "enabled, then torch.autograd.backward(output, grad_output)."
            )
            return False
        got = [x.grad] + [p.grad for p in layer.parameters()]
        names = ["the input"] + [f"parameter {n}" for n, _ in layer.named_parameters()]
        for name, want, o in zip(names, expected, got):
            if (
                name == "the input"
                and o is not None
                and torch.allclose(o, 2 * want, rtol=1e-5, atol=1e-6)
            ):
                print(
                    "Not quite: the gradient of the input is twice what it should be. "
                    "Hint: recompute from fresh leaves, t.detach().requires_grad_(): "
                    "backpropagating into the kept inputs themselves fills their .grad, "
                    "and autograd then adds what you return to it."
                )
                return False
            if o is None or not torch.allclose(o, want, rtol=1e-5, atol=1e-6):
                print(
                    f"Not quite: the gradient of {name} is "
                    f"{'missing' if o is None else 'wrong'}. Hint: recompute from "
                    "fresh leaves (t.detach().requires_grad_()), backpropagate grad_output "
                    "through the recomputed output, and return each leaf's .grad; the "
                    "parameters get theirs on the way."
                )
                return False
    print("Correct: recompute, then backpropagate: the same gradients as without checkpointing.")
    return True
