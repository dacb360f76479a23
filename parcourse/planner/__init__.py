"""The planner (lesson 09, part 2): for a model, a cluster and a global batch, predict each
configuration's memory per rank and step time, rank the ones that fit, say why the others
do not, and check the prediction against a measured run.

    choices = plan(config, Cluster.preset("h100", gpus=64), global_batch=1024)
    choices.ranked[0]                     # the fastest that fits: its memory and time
    choices.rejected[:3]                  # and why others do not
    predict_memory(config, Choice(dp=2, tp=2, pp=2), global_batch=16)  # per pp rank

Memory is counted per pipeline rank (the busiest is not always the last: the first holds
the embedding and, under 1F1B, the most microbatches), by category, from the formulas in
`parcourse.theory` (one home each): parameters, gradients and Adam's state layer by layer
(`gpt_layer_bytes`), divided as ZeRO divides them over dp; the activations one microbatch
keeps on each stage times the microbatches the schedule holds at once, which the pipeline
simulator's `in_flight` counts from the schedule's own actions (not a second formula). In
fp32 this is the course's GPT counted exactly, checked against `Hybrid.memory()`; in 16
bits, mixed precision (2 + 2 + 12 bytes a parameter, ZeRO paper) and Korthikanti et al.'s
activations (`korthikanti_layer_bytes`).

Step time: each stage's forward and backward from its FLOPs at the cluster's achievable
rate, beside, on a GPU, its memory-bound work's bytes at the memory's bandwidth (and,
here, a fixed cost per layer call: `Overheads`), plus tensor parallelism's
collectives on the link its group uses; the pipeline's bubble and point-to-point
messages from the course's simulator on those costs; then the data-parallel reduction
of the gradients (exposed: the 3D step does it after the schedule, but for ZeRO-2's
reduce-scatters during it, which what follows hides) and the optimizer's step. On this
machine, ranks beyond the cores share them (`predict_time`), and every cost is measured:
`measured_here`. `scaled` gives that cluster a simulated compute, as a GPU's beside this
machine's real links: a run pads each stage's forward and backward to the planner's
compute seconds (`stage_compute`), and the check sees the schedule, the collectives and
the messages, with no ranks sharing cores for their compute (for the optimizer, they
still do).

Six modules, read in this order: `inputs` (a configuration, the cluster and the named
models, with their checks), `predict` (one configuration's memory and time, in two parts
marked by rules, the second using the first; the formulas themselves live in
`parcourse.theory`), `search` (every configuration predicted, ranked, and why the others
are out), `links` and `costs` (what this machine's messages and collectives cost, and what a rank's
own work costs, measured) and `here` (the cluster built from those costs, and a
configuration run for real beside its prediction, and what else held the processors
meanwhile).
"""

from parcourse.planner.costs import measure_costs, measure_flops, measure_sharing, measure_waits
from parcourse.planner.here import (
    Contention,
    measure,
    measured_against_predicted,
    measured_here,
    scaled,
)
from parcourse.planner.inputs import MODELS, Choice, Cluster, Overheads, model, parameters
from parcourse.planner.links import measure_links, measure_paced
from parcourse.planner.predict import (
    model_flops_per_token,
    predict_memory,
    predict_time,
    stage_compute,
    stage_layers,
)
from parcourse.planner.search import Planned, Plans, bound_of, choices, format_plans, plan

__all__ = [
    "MODELS",
    "Choice",
    "Cluster",
    "Contention",
    "Overheads",
    "Planned",
    "Plans",
    "bound_of",
    "choices",
    "format_plans",
    "measure",
    "measure_costs",
    "measure_flops",
    "measure_links",
    "measure_paced",
    "measure_sharing",
    "measure_waits",
    "measured_against_predicted",
    "measured_here",
    "model",
    "model_flops_per_token",
    "parameters",
    "plan",
    "predict_memory",
    "predict_time",
    "scaled",
    "stage_compute",
    "stage_layers",
]
