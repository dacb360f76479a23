"""Tensor-parallel runs: training.py (what the CLI, the benchmark and lesson 05 share:
the GPT trained split over ranks against the formulas and against torch's DTensor
tensor parallelism) and lesson.py (lesson 05's own runs and its exercise's check)."""

from parcourse.experiments.tensor_parallel.lesson import (
    check_g,
    label_of,
    memory_by_tp_size,
    split_matmul,
    split_mlp,
    split_shapes,
    tp_step,
)
from parcourse.experiments.tensor_parallel.training import (
    batch_for,
    collectives_in,
    link_step_times,
    one_process_losses,
    shared_comm,
    step_times,
    torch_tensor_parallel,
    train,
)

__all__ = [
    "batch_for",
    "check_g",
    "collectives_in",
    "label_of",
    "link_step_times",
    "memory_by_tp_size",
    "one_process_losses",
    "shared_comm",
    "split_matmul",
    "split_mlp",
    "split_shapes",
    "step_times",
    "torch_tensor_parallel",
    "tp_step",
    "train",
]
