"""Tensor (and sequence) parallelism equals one process: every layer, the MLP, attention,
a block and the whole GPT, forward and backward, at 2 and 4 ranks; Adam trains to the
same weights; the loss never gathers the logits; collectives, bytes and memory per rank
equal the formulas exactly; misuse raises ValueError before anything changes.

Tolerance (tp_fns.TOL, rtol=1e-5, atol=1e-6): fp32 on gloo; a split matrix multiply
and the all-reduce add the same terms as one process in another order.
"""

import os
import re

import pytest
import torch
import tp_fns as TP

from parcourse import RankError
from parcourse.comm import SimulatedLink
from parcourse.experiments.tensor_parallel import (
    check_g,
    memory_by_tp_size,
    split_matmul,
    tp_step,
    train,
)
from parcourse.models import gpt
from parcourse.theory import (
    tp_activation_bytes,
    tp_collective_counts,
    tp_collectives,
    tp_link_seconds,
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
def test_vocab_parallel_embedding_with_a_vocabulary_no_size_divides(
    pools, world_size, sequence_parallel
):
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
    assert len(results) == world_size
    for losses in results:  # every rank's, each step's
        assert len(losses) == 3
        for ref, split in losses:
            assert split == pytest.approx(ref, rel=1e-5)


@SIZES
@pytest.mark.parametrize(
    ("reduction", "scale", "ignore_index"),
    [("mean", 1.0, -100), ("sum", 1.0, 7), ("none", 1.0, -100), ("mean", 1000.0, -100)],
)
def test_vocab_parallel_cross_entropy(pools, world_size, reduction, scale, ignore_index):
    pools[world_size].run(TP.cross_entropy, reduction, scale, ignore_index)


@SIZES
@SP
def test_collectives_bytes_and_memory_equal_the_formulas(pools, world_size, sequence_parallel):
    config, batch = TP.CONFIG, TP.B
    results = (
        pools[world_size].run(train, config, 2, batch, sequence_parallel=sequence_parallel).results
    )
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
    assert regions == {
        "drop": "replicated",
        "blocks.0.attn.attn_drop": "sharded",
        "blocks.0.drop": "replicated",
        "blocks.1.attn.attn_drop": "sharded",
        "blocks.1.drop": "replicated",
    }
    assert same == [True, True], "block outputs differ across ranks"
    assert draws == {"replicated": True, "sharded": False}


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("no match", r"plan\['blocks.\*.mlp.gate'\] matches no module of GPT"),
        ("unknown style", r"plan\['blocks.\*.mlp.up'\]: unknown style 'colum'"),
        ("wrong module", r"blocks.0.ln1: 'column' splits an nn.Linear, this is a LayerNorm"),
        ("two styles", r"blocks.0.mlp.up: the plan says both 'column' and 'row'"),
        ("tied split one way", r"tok_emb and head share a weight"),
        ("not a plan", r"a plan maps module names to styles, got list"),
        ("indivisible hidden", r"0: 6 output features cannot be split over 4 ranks"),
        ("indivisible heads", r"blocks.0.attn.qkv: 3 attention heads cannot be split over 4 ranks"),
    ],
)
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
        p.numel() for p in gpt(config).parameters()
    )
    assert (
        tp_parameter_bytes(config, 1)["replicated"] + tp_parameter_bytes(config, 1)["sharded"]
        == tp_parameter_bytes(config, 1)["total"]
    )
    assert tp_collectives(config, 3, 8, 1) == []
    # Per block: 2 all-reduces forward, 2 backward; with sequence parallelism an
    # all-gather and a reduce-scatter in place of each, the same bytes on a ring
    # (apart from the all-reduces of the replicated parameters' gradients).
    n, layers, act = 4, config.n_layers, 4 * 3 * 8 * config.d_model
    plain = tp_collective_counts(tp_collectives(config, 3, 8, n, loss=False))
    assert plain == {
        ("all_reduce", "backward"): (2 * layers + 1, (2 * layers + 1) * act),
        ("all_reduce", "forward"): (2 * layers + 1, (2 * layers + 1) * act),
    }
    sp = tp_collectives(config, 3, 8, n, sequence_parallel=True, loss=False)
    activations = [c for c in sp if c[0] != "all_reduce"]
    assert len(activations) == 2 * len(tp_collectives(config, 3, 8, n, loss=False))
    assert tp_ring_bytes_sent(activations, n) == tp_ring_bytes_sent(
        tp_collectives(config, 3, 8, n, loss=False), n
    )
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


# --------------------------------------------------------------------------- lesson 05


@pytest.mark.parametrize(
    ("g", "verdict"),
    [
        ("GoodG", "Correct: g sums the partial sums forward"),
        ("AllReduceBothWaysG", "the gradient of the MLP's input is 2 x one process's"),
        ("IdentityG", "g's output differs from one process's"),
        ("StubG", "Not written yet"),
    ],
)
def test_exercise_check_accepts_g_and_rejects_wrong_answers(pools, capsys, g, verdict):
    passed = check_g(getattr(TP, g), pools[2])
    out = capsys.readouterr().out
    assert passed == (g == "GoodG")
    assert verdict in out
    assert out.count("\n") == 1, "one short verdict"


@SIZES
@pytest.mark.parametrize("how", ["column", "row"])
def test_split_matmul_is_exact_and_shows_each_rank_its_shard(pools, world_size, how):
    results = pools[world_size].run(split_matmul, how).results
    k = 12 // world_size
    for r in results:
        assert torch.equal(r["y"], r["expected"])
        assert r["a"].shape == ((12, k) if how == "column" else (k, 12))
        assert r["mine"].shape == ((4, k) if how == "column" else (4, 12))
    if how == "row":  # the partial sums add up to Y
        assert torch.equal(sum(r["mine"] for r in results), results[0]["expected"])


def test_a_backward_after_one_that_raised_sums_the_replicated_gradients(pools):
    """Sequence parallelism sums the LayerNorms' and biases' gradients at a backward's
    end; a backward that raised never reached it, and every later one had then skipped
    the sum, training each rank on its own tokens' part."""
    pools[2].run(TP.after_a_failed_backward)


def test_backward_calls_inside_one_sum_sum_the_replicated_gradients_once(pools):
    """A split backward's W runs a backward call per group of weights; inside `one_sum`
    they sum the replicated gradients once, at its end, to the same gradients as one
    process; one that raised there leaves the next backward right."""
    pools[2].run(TP.one_sum_over_two_backwards)


def test_autograd_grad_of_a_replicated_weight_is_refused(pools):
    """Under sequence parallelism a LayerNorm's gradient is summed over the ranks at the
    end of loss.backward(); torch.autograd.grad had returned this rank's part silently."""
    for error in pools[2].run(TP.autograd_grad_refused).results:
        assert error is not None and "call loss.backward() and read .grad" in error, error


def test_a_replicated_weight_unfrozen_after_splitting_is_refused(pools):
    """Under sequence parallelism a LayerNorm frozen at the split has no hook to sum its
    gradient over tp; unfrozen later it would train on this rank's tokens alone."""
    with pytest.raises(RankError, match="ln_f.weight, ln_f.bias did not require a gradient"):
        pools[2].run(TP.thawed_after_splitting)


@SP
def test_a_weight_frozen_before_splitting_stays_frozen(pools, sequence_parallel):
    """As torch's parallelize_module keeps requires_grad: a split layer's weight had come
    out as a new, trainable Parameter."""
    for got in pools[2].run(TP.frozen_before_splitting, sequence_parallel).results:
        assert got == dict.fromkeys(got, False), got


def test_memory_by_tp_size_equals_the_formulas_at_every_size(pools):
    # TP.CONFIG's 4 heads do not split over 3 ranks.
    results = pools[4].run(memory_by_tp_size, TP.CONFIG, TP.B, (1, 2, 4)).results
    assert sorted(results[0]) == [(k, sp) for k in (1, 2, 4) for sp in (False, True)]
    assert sorted(results[3]) == [(4, False), (4, True)]  # rank 3 sits out sizes 1 and 2
    for r in results:
        for got in r.values():
            assert got["param_bytes"] == got["theory"]["param_bytes"]
            assert got["activation_bytes"] == got["theory"]["activation_bytes"]
    if os.path.isdir("/proc/self/task"):
        # Its groups go when it is done (a panel runs it again on ranks that live on),
        # gloo's threads too, which end when a destroyed group is collected.
        from rankfns import settled_threads

        before = pools[4].run(settled_threads).results
        pools[4].run(memory_by_tp_size, TP.CONFIG, TP.B, (1, 2, 4))
        after = pools[4].run(settled_threads).results
        assert all(a <= b for a, b in zip(after, before)), (after, before)  # none left


@SP
def test_traced_step_labels_f_and_g_and_pays_the_link(pools, sequence_parallel):
    link = SimulatedLink.of(latency_us=300)
    run = pools[2].run(tp_step, TP.CONFIG, TP.B, 1, sequence_parallel=sequence_parallel, link=link)
    r = run.results[0]
    assert r["collectives"] == r["theory"]["collectives"]
    assert r["param_bytes"] == r["theory"]["param_bytes"]
    assert r["activation_bytes"] == r["theory"]["activation_bytes"]
    comm = [s for s in run.trace.spans if s.kind == "comm"]
    assert comm and all("segment" not in s.meta for s in comm), "the ring's steps left out"
    labels = {(s.meta["op"], s.meta["phase"], s.meta["label"]) for s in comm if s.rank == 0}
    if sequence_parallel:
        assert ("all_gather", "forward", "f") in labels
        assert ("reduce_scatter", "forward", "g") in labels
        assert ("all_reduce", "backward", "grads") in labels
    else:
        assert labels == {
            ("all_reduce", "forward", "g"),
            ("all_reduce", "backward", "f"),
            ("all_reduce", "forward", "loss"),
        }
    # Every message waits out the link after the one before it: a lower bound.
    model = tp_link_seconds(r["theory"]["collectives"], 2, link.latency_s, link.bandwidth_Bps)
    assert min(x["comm_s"][0] for x in run.results) >= 0.99 * model
    # The timeline starts at the traced step (the warm-up and the memory forward are gone).
    forward = min(s.start_ns for s in run.trace.spans if s.name == "forward")
    assert run.trace.t0_ns >= forward - 5_000_000


def test_link_seconds_formula():
    act, n = 4 * 3 * 8 * TP.CONFIG.d_model, 4
    one = [("all_reduce", "forward", "x", act)]
    assert tp_link_seconds(one, 1, 1e-3, 1e9) == 0.0
    assert tp_link_seconds(one, n, 1e-3, 1e9) == pytest.approx(2 * (n - 1) * (1e-3 + act / n / 1e9))
    half = [("all_gather", "forward", "x", act), ("reduce_scatter", "forward", "x", act)]
    assert tp_link_seconds(half, n, 1e-3, 1e9) == pytest.approx(tp_link_seconds(one, n, 1e-3, 1e9))


def test_a_collectives_wait_for_a_late_partner_is_drawn_as_waiting(pools):
    """Rank 1 enters the first all-reduce 0.2 s after rank 0: drawn, rank 0 waits those
    0.2 s (an idle span) and communicates only after; a wait cannot be shorter than the
    sleep, and the communication after it is bounded by the whole collective."""
    from parcourse.trace import with_collective_waits

    trace = pools[2].run(TP.late_partner, 0.2).trace
    comm = [s for s in trace.spans if s.kind == "comm"]
    assert {tuple(s.meta["group"]) for s in comm} == {(0, 1)}
    drawn = with_collective_waits(trace)
    waits = [s for s in drawn.spans if s.kind == "idle"]
    first = [s for s in drawn.spans if s.rank == 0 and s.meta.get("where") == "late"]
    assert [s.kind for s in first] == ["idle", "comm"]
    assert first[0].duration_s >= 0.19
    entered = min(s.start_ns for s in comm if s.rank == 1)
    assert first[1].start_ns == entered, "the communication starts when the last rank came"
    assert all(s.rank == 0 for s in waits if s.duration_s > 0.05), "rank 1 did not wait"
