"""Tensor (and sequence) parallelism equals one process: every layer, the MLP, attention,
a block and the whole GPT, forward and backward, at 2 and 4 ranks; Adam trains to the
same weights; the loss never gathers the logits; collectives, bytes and memory per rank
equal the formulas exactly; misuse raises ValueError before anything changes.

Tolerance (tp_fns.TOL, rtol=1e-5, atol=1e-6): fp32 on gloo; a split matrix multiply
and the all-reduce add the same terms as one process in another order.
"""

import re

import pytest
import torch

import tp_fns as TP
from parcourse.experiments.tensor_parallel import train
from parcourse.models import gpt
from parcourse.theory import (
    tp_activation_bytes,
    tp_collective_counts,
    tp_collectives,
    tp_parameter_bytes,
    tp_ring_bytes_sent,
)

SIZES = pytest.mark.parametrize("world_size", [2, 4])
SP = pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "sp"])


@SIZES
@SP
@pytest.mark.parametrize("gather_output", [False, True], ids=["sharded", "gathered"])
def test_column_parallel_linear(pools, world_size, sequence_parallel, gather_output):
    pools[world_size].run(TP.column, gather_output, sequence_parallel)


@SIZES
@SP
@pytest.mark.parametrize("input_is_parallel", [True, False], ids=["split", "whole"])
def test_row_parallel_linear(pools, world_size, sequence_parallel, input_is_parallel):
    pools[world_size].run(TP.row, input_is_parallel, sequence_parallel)


@SIZES
@SP
def test_vocab_parallel_embedding_with_a_vocabulary_no_size_divides(pools, world_size,
                                                                      sequence_parallel):
    pools[world_size].run(TP.vocab_embedding, sequence_parallel)


@SIZES
@SP
@pytest.mark.parametrize("what", ["mlp", "attention", "block"])
def test_module_split_by_its_plan(pools, world_size, sequence_parallel, what):
    pools[world_size].run(TP.module, what, sequence_parallel)


@SIZES
@SP
@pytest.mark.parametrize("tie_weights", [True, False], ids=["tied", "untied"])
def test_whole_gpt_to_its_loss(pools, world_size, sequence_parallel, tie_weights):
    pools[world_size].run(TP.whole_gpt, sequence_parallel, tie_weights)


@SP
def test_gradients_accumulated_over_microbatches(pools, sequence_parallel):
    pools[2].run(TP.accumulated, sequence_parallel)


@SIZES
@SP
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_three_adam_steps_reach_the_same_weights(pools, world_size, sequence_parallel, dtype):
    # fp32: the same losses; fp64: the same weights too (tp_fns.adam_steps says why).
    results = pools[world_size].run(TP.adam_steps, sequence_parallel, dtype).results
    for ref, split in results[0]:
        assert split == pytest.approx(ref, rel=1e-5)


@SIZES
@pytest.mark.parametrize(("reduction", "scale", "ignore_index"),
                         [("mean", 1.0, -100), ("sum", 1.0, 7), ("none", 1.0, -100),
                          ("mean", 1000.0, -100)])
def test_vocab_parallel_cross_entropy(pools, world_size, reduction, scale, ignore_index):
    pools[world_size].run(TP.cross_entropy, reduction, scale, ignore_index)


@SIZES
@SP
def test_collectives_bytes_and_memory_equal_the_formulas(pools, world_size, sequence_parallel):
    config, batch = TP.CONFIG, TP.B
    results = pools[world_size].run(train, config, 2, batch,
                                    sequence_parallel=sequence_parallel).results
    for r in results:
        assert r["algorithm"] == "ring"  # gloo: bytes counted message by message
        assert r["collectives"] == r["theory"]["collectives"]
        assert r["bytes_sent"] == tp_ring_bytes_sent(r["collectives"], world_size)
        assert r["param_bytes"] == r["theory"]["param_bytes"]
        assert r["activation_bytes"] == r["theory"]["activation_bytes"]
    assert results[0]["losses"] == pytest.approx(results[-1]["losses"], rel=1e-6)


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "sp"])
def test_dropout_masks_agree_where_activations_are_replicated(pools, sequence_parallel):
    regions, same, draws = pools[2].run(TP.dropout, sequence_parallel).results[0]
    if sequence_parallel:  # every dropout sees different tokens on each rank
        assert set(regions.values()) == {"sharded"}
        assert draws == {"sharded": False}
        return
    assert regions == {"drop": "replicated", "blocks.0.attn.attn_drop": "sharded",
                       "blocks.0.drop": "replicated", "blocks.1.attn.attn_drop": "sharded",
                       "blocks.1.drop": "replicated"}
    assert same == [True, True], "block outputs differ across ranks"
    assert draws == {"replicated": True, "sharded": False}


@pytest.mark.parametrize(("case", "message"), [
    ("no match", r"plan\['blocks.\*.mlp.gate'\] matches no module of GPT"),
    ("unknown style", r"plan\['blocks.\*.mlp.up'\]: unknown style 'colum'"),
    ("wrong module", r"blocks.0.ln1: 'column' splits an nn.Linear, this is a LayerNorm"),
    ("two styles", r"blocks.0.mlp.up: the plan says both 'column' and 'row'"),
    ("tied split one way", r"tok_emb and head share a weight"),
    ("not a plan", r"a plan maps module names to styles, got list"),
    ("indivisible hidden", r"0: 6 output features cannot be split over 4 ranks"),
    ("indivisible heads", r"blocks.0.attn.qkv: 3 attention heads cannot be split over 4 ranks"),
])
def test_bad_plans_raise_before_changing_anything(pools, case, message):
    text, unchanged = pools[4].run(TP.bad_plan, case).results[0]
    assert text is not None, "no ValueError"
    assert re.search(message, text), text
    assert unchanged


def test_sequence_parallel_needs_a_sequence_the_ranks_divide(pools):
    text = pools[2].run(TP.uneven_sequence).results[0]
    assert text == "tok_emb: dim 1 of size 7 cannot be cut into 2 equal chunks"


def test_formulas_without_ranks():
    config = TP.CONFIG
    # One rank holds everything: the formula counts the model's parameters.
    assert tp_parameter_bytes(config, 1)["total"] == 4 * sum(
        p.numel() for p in gpt(config).parameters())
    assert tp_parameter_bytes(config, 1)["replicated"] + tp_parameter_bytes(
        config, 1)["sharded"] == tp_parameter_bytes(config, 1)["total"]
    assert tp_collectives(config, 3, 8, 1) == []
    # Per block: 2 all-reduces forward, 2 backward; with sequence parallelism an
    # all-gather and a reduce-scatter in place of each, the same bytes on a ring
    # (apart from the all-reduces of the replicated parameters' gradients).
    n, layers, act = 4, config.n_layers, 4 * 3 * 8 * config.d_model
    plain = tp_collective_counts(tp_collectives(config, 3, 8, n, loss=False))
    assert plain == {("all_reduce", "backward"): (2 * layers + 1, (2 * layers + 1) * act),
                     ("all_reduce", "forward"): (2 * layers + 1, (2 * layers + 1) * act)}
    sp = tp_collectives(config, 3, 8, n, sequence_parallel=True, loss=False)
    activations = [c for c in sp if c[0] != "all_reduce"]
    assert len(activations) == 2 * len(tp_collectives(config, 3, 8, n, loss=False))
    assert tp_ring_bytes_sent(activations, n) == tp_ring_bytes_sent(
        tp_collectives(config, 3, 8, n, loss=False), n)
    # Sequence parallelism divides the LayerNorm inputs (and masks) by N, not the rest.
    tp, spar = (tp_activation_bytes(config, 3, 8, n, s) for s in (False, True))
    assert spar["layer norms, dropout masks"] * n == tp["layer norms, dropout masks"]
    assert spar["split over ranks"] == tp["split over ranks"]
    assert spar["total"] < tp["total"]


def test_cli_tp_trains_and_prints_against_the_formulas(capsys):
    from parcourse.cli import main

    assert main(["tp", "--world-size", "2", "--steps", "3", "--sequence-parallel"]) == 0
    out = capsys.readouterr().out
    assert "tp          2 ranks, sequence parallel" in out
    assert out.count("measured / formula 1.000") == 4  # params and activations, 2 ranks
    assert "collectives per step: as the formula" in out
    assert "loss" in out and "one process" in out
