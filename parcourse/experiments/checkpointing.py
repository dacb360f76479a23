"""Checkpointing runs that lesson 08, the CLI and benchmarks/checkpointing.py launch: peak
saved-activation bytes and step time of a chain of equal layers under each policy."""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
from torch import nn

from parcourse.checkpointing import Policy, run_with_policy, segment_count
from parcourse.memory import PeakSavedBytes
from parcourse.theory import checkpoint_extra_forwards, checkpoint_peak_activations


def chain(n_layers: int, width: int, seed: int = 0) -> list[nn.Module]:
    """n equal layers, Linear then Tanh: each saves one tensor of its output's size (the
    Linear its input, which is the previous Tanh's output; the Tanh its output)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return [nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(n_layers)]


def measure_policy(n_layers: int, policy: Policy, *, width: int = 64, batch: int = 32,
                   segments: int | None = None, repeats: int = 3) -> dict[str, Any]:
    """One chain under `policy`: the peak of saved activations over forward and backward
    (measured), the step time (median of `repeats`), and the theory for both."""
    layers = chain(n_layers, width)
    params = [p for layer in layers for p in layer.parameters()]
    x = torch.randn(batch, width, generator=torch.Generator().manual_seed(1))
    seg: int | str = segments if segments is not None else "sqrt"
    peaks, times = [], []
    for _ in range(repeats):
        for p in params:
            p.grad = None
        start = time.perf_counter()
        with PeakSavedBytes(exclude=params) as saved:
            run_with_policy(layers, x, policy, seg).sum().backward()  # sum() saves nothing
        times.append(time.perf_counter() - start)
        peaks.append(saved.peak)
    one = batch * width * 4  # one layer output, fp32
    k = segment_count(n_layers, seg) if policy == "sqrt" else None  # type: ignore[arg-type]
    return {"n_layers": n_layers, "policy": policy, "peak_bytes": max(peaks),
            "theory_bytes": checkpoint_peak_activations(n_layers, policy, k) * one,
            "step_s": statistics.median(times),
            "extra_forwards": checkpoint_extra_forwards(n_layers, policy),
            "activation_bytes": one}


def sweep(n_values: list[int], policies: list[Policy], **kwargs: Any) -> list[dict[str, Any]]:
    """`measure_policy` for every n and policy (one process: checkpointing needs no ranks)."""
    return [measure_policy(n, policy, **kwargs) for n in n_values for policy in policies]
