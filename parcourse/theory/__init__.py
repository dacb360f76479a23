"""Every formula that a lesson's chart, an exercise check or a benchmark compares a
measurement with. Pure arithmetic: no processes, nothing sent; each chart's dashed line is
arithmetic and nothing else.

One module a topic, in the course's order: collectives.py (lesson 01: one all-reduce's bytes
and time), zero.py (lessons 03-04), tensor_parallel.py (05: the split GPT's bytes and
collectives), pipelines.py (06-07: bubbles, microbatches in flight, each named schedule's
formula), checkpointing.py (08), mesh.py (09: what a rank of the whole mesh holds), layers.py
(what one GPT layer computes, moves and holds, which the planner prices), context.py and
experts.py (11), roofline.py (12: each strategy's compute beside its communication on a
machine, and the threshold where they cross). Every name is importable from here:
`from parcourse.theory import gpipe_bubble`.
"""

from parcourse.theory.checkpointing import (
    checkpoint_extra_forwards,
    checkpoint_peak_activations,
    checkpoint_segments,
)
from parcourse.theory.collectives import (
    CostModel,
    bus_bandwidth,
    bytes_sent_per_rank,
    fit_cost_model,
    flat_ring_bytes_across,
    hierarchical_bytes,
)
from parcourse.theory.context import (
    all_gather_attention_bytes,
    ring_attention_bytes,
    ring_attention_kept,
    ulysses_bytes,
)
from parcourse.theory.experts import (
    expert_bytes,
    moe_activation_bytes,
    moe_all_to_all_bytes,
    moe_rows,
)
from parcourse.theory.layers import (
    attention_flops,
    attention_traffic,
    gpt_layer_bytes,
    gpt_layer_flops,
    gpt_layer_traffic,
    korthikanti_layer_bytes,
    moe_flops,
)
from parcourse.theory.mesh import mesh_bytes
from parcourse.theory.pipelines import (
    bubble_fraction,
    deepseek_table,
    dualpipe_apart_bubble_time,
    dualpipe_bubble_time,
    dualpipe_formula,
    dualpipe_v_peak_in_flight,
    gpipe_bubble,
    gpipe_formula,
    gpipe_peak_in_flight,
    interleaved_bubble,
    interleaved_peak_in_flight,
    one_f_one_b_bubble_time,
    one_f_one_b_peak_in_flight,
    zero_bubble_h1_bubble_time,
    zero_bubble_h1_formula,
    zero_bubble_h1_peak_in_flight,
)
from parcourse.theory.roofline import (
    STRATEGIES,
    Machine,
    Threshold,
    context_parallel_seconds,
    cp_threshold,
    data_parallel_seconds,
    dp_threshold,
    ep_min_width,
    ep_threshold,
    expert_parallel_seconds,
    published_machines,
    tensor_parallel_seconds,
    thresholds,
    tp_threshold,
    zero3_threshold,
)
from parcourse.theory.tensor_parallel import (
    TPCollective,
    tp_activation_bytes,
    tp_collective_counts,
    tp_collectives,
    tp_link_seconds,
    tp_parameter_bytes,
    tp_ring_bytes_sent,
    tp_stage_collectives,
)
from parcourse.theory.zero import (
    adam_bytes_per_param,
    offload_bytes,
    zero_bytes,
    zero_checked_at,
    zero_communication_bytes,
    zero_pp_bytes_across,
)

__all__ = [
    "STRATEGIES",
    "Machine",
    "Threshold",
    "context_parallel_seconds",
    "cp_threshold",
    "data_parallel_seconds",
    "dp_threshold",
    "ep_min_width",
    "ep_threshold",
    "expert_parallel_seconds",
    "published_machines",
    "tensor_parallel_seconds",
    "thresholds",
    "tp_threshold",
    "zero3_threshold",
    "CostModel",
    "TPCollective",
    "adam_bytes_per_param",
    "all_gather_attention_bytes",
    "attention_flops",
    "attention_traffic",
    "bubble_fraction",
    "bus_bandwidth",
    "bytes_sent_per_rank",
    "flat_ring_bytes_across",
    "hierarchical_bytes",
    "checkpoint_extra_forwards",
    "checkpoint_peak_activations",
    "checkpoint_segments",
    "deepseek_table",
    "dualpipe_apart_bubble_time",
    "dualpipe_bubble_time",
    "dualpipe_formula",
    "dualpipe_v_peak_in_flight",
    "expert_bytes",
    "fit_cost_model",
    "gpipe_bubble",
    "gpipe_formula",
    "gpipe_peak_in_flight",
    "gpt_layer_bytes",
    "gpt_layer_flops",
    "gpt_layer_traffic",
    "interleaved_bubble",
    "interleaved_peak_in_flight",
    "korthikanti_layer_bytes",
    "mesh_bytes",
    "moe_activation_bytes",
    "moe_all_to_all_bytes",
    "moe_flops",
    "moe_rows",
    "offload_bytes",
    "one_f_one_b_bubble_time",
    "one_f_one_b_peak_in_flight",
    "ring_attention_bytes",
    "ring_attention_kept",
    "tp_activation_bytes",
    "tp_collective_counts",
    "tp_collectives",
    "tp_link_seconds",
    "tp_parameter_bytes",
    "tp_ring_bytes_sent",
    "tp_stage_collectives",
    "ulysses_bytes",
    "zero_bubble_h1_bubble_time",
    "zero_bubble_h1_formula",
    "zero_bubble_h1_peak_in_flight",
    "zero_bytes",
    "zero_checked_at",
    "zero_communication_bytes",
    "zero_pp_bytes_across",
]
