"""Mixture of experts and expert parallelism: the layer's loop and batched forms agree;
expert parallelism over 2 and 4 ranks equals the whole layer in one process (outputs and
every gradient, router included), uneven token counts, an expert that receives no token and
capacity drops included; a GPT with experts trained data parallel with ep 2 and 4 equals one
process; the balancing bias moved after accumulated microbatches equals one batch's; the
all-to-all's counted bytes equal the formula."""

import pytest
import torch
from expert_fns import (
    CONFIG,
    counted_bytes,
    dispatch_then_combine,
    experts_that_receive_nothing,
    layer_against_one_process,
    one_process,
    train_dp_ep,
)

from parcourse.experts import MoE, check_ep, expert_parallel, update_bias
from parcourse.models import GPTConfig, gpt
from parcourse.theory import expert_bytes, moe_all_to_all_bytes

# fp32. An expert's rows arrive from the ranks in another order and are padded to another
# length than in one process, so its batched products may block their sums differently:
# rounding of a few 1e-7 on values of order 1, and Adam's step divides a gradient by its
# own size, so two steps move a weight that rounding's worth again.
TOL = 1e-5


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
@pytest.mark.parametrize("capacity_factor", [None, 1.0], ids=["dropless", "capacity1"])
def test_loop_and_batched_are_the_same_layer(score, capacity_factor):
    torch.manual_seed(0)
    m = MoE(
        16,
        8,
        2,
        score=score,
        capacity_factor=capacity_factor,
        aux_loss=0.01,
        z_loss=0.001,
        mode="loop",
    )
    x = torch.randn(4, 10, 16, requires_grad=True)
    results = []
    for mode in ("loop", "batched"):
        m.mode = mode
        y = m(x)
        results.append((y, torch.autograd.grad(y.square().sum(), [x, *m.parameters()])))
    (y1, g1), (y2, g2) = results
    assert torch.allclose(y1, y2, atol=1e-6)
    for a, b in zip(g1, g2):
        assert torch.allclose(a, b, atol=1e-6)
    if capacity_factor is not None:
        assert m.last.dropped > 0  # 80 assignments, 8 experts of 20: some overflow


def test_capacity_drops_second_choices_first():
    """GShard's priority: every first choice before any second one, then token order."""
    from parcourse.experts import keep_within

    chosen = torch.tensor([[0, 1], [0, 1], [1, 0]])
    kept = keep_within(chosen, 2, 2)  # room for 2 an expert
    # expert 0: tokens 0 and 1 first, token 2 second (dropped); expert 1: token 2 first,
    # then token 0 second, token 1 second (dropped)
    assert kept.tolist() == [[True, True], [True, False], [True, False]]


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize(
    "score,capacity_factor,starved",
    [("softmax", None, 3), ("sigmoid", 1.0, None), ("softmax", 0.75, 0)],
)
def test_expert_parallel_layer_equals_one_process(
    pools, world_size, score, capacity_factor, starved
):
    """8 experts, top 2, ranks holding 5, 8, 11 and 14 tokens; an expert that no token
    chooses (its bias -1e4: it receives nothing on any rank), capacity drops the same as
    one process's (each rank's tokens are routed and capped as the whole layer caps
    them)."""
    for errors, drops, ref_drops, counts in (
        pools[world_size]
        .run(layer_against_one_process, 8, 2, score, capacity_factor, starved)
        .results
    ):
        assert drops == ref_drops
        if starved is not None:
            assert counts[starved] == 0
        for name, error in errors.items():
            assert error < TOL, (name, error)


@pytest.mark.parametrize("world_size", [2, 4])
def test_dispatch_then_combine_returns_the_tokens(pools, world_size):
    assert all(pools[world_size].run(dispatch_then_combine, 8, 2, 13).results)


@pytest.mark.parametrize("world_size", [2, 4])
def test_all_to_all_bytes_equal_the_formula(pools, world_size):
    """8 experts, top 2, 16 tokens a rank routed evenly, d_model 8, fp32: forward the
    counts, the dispatch and the combine; backward the two again."""
    want = moe_all_to_all_bytes(16, 2, 8, world_size, 8)
    for forward, backward in pools[world_size].run(counted_bytes, 8, 2, 16).results:
        assert (forward, backward) == (want["forward"], want["backward"])


@pytest.mark.parametrize(
    "world_size,ep,changes",
    [
        (2, 2, {}),
        (4, 2, {"capacity_factor": 1.0, "router": "sigmoid"}),
        (4, 4, {"bias_rate": 0.01, "aux_loss": 0.0, "z_loss": 0.001}),
    ],
)
def test_gpt_with_experts_data_parallel_equals_one_process(pools, world_size, ep, changes):
    """Data parallel over every rank, experts cut over ep of them (ep 2 of 4: each expert
    held twice, its gradient summed over both copies). One process's weights, losses and
    balancing bias after two Adam steps (TOL)."""
    want, want_losses = one_process(world_size, **changes)
    for got, losses in pools[world_size].run(train_dp_ep, ep, **changes).results:
        assert losses == pytest.approx(want_losses, abs=TOL)
        assert got.keys() == want.keys()
        for name in want:
            assert torch.allclose(got[name], want[name], atol=TOL), name


def test_the_balancing_bias_after_accumulated_microbatches_is_one_batchs():
    """DeepSeek-V3's bias moves from the tokens counted since the last update: four
    microbatches of 4 sequences, then one update, give the bias one batch of 16 gives."""
    config = GPTConfig(**{**CONFIG, "bias_rate": 0.1, "aux_loss": 0.0})
    x = torch.randint(
        0, config.vocab, (16, config.block_size), generator=torch.Generator().manual_seed(0)
    )
    whole, parts = gpt(config), gpt(config)
    whole(x)
    for chunk in x.split(4):
        parts(chunk)
    update_bias(whole)
    update_bias(parts)
    biases = [
        [b for n, b in m.named_buffers() if n.endswith("router.bias")] for m in (whole, parts)
    ]
    assert all(torch.equal(a, b) for a, b in zip(*biases))
    assert any(b.abs().sum() > 0 for b in biases[0])


def test_expert_bytes_count_the_held_experts():
    config = GPTConfig(**CONFIG)
    model = expert_parallel(gpt(config), _OneRank())
    held = sum(
        p.numel() * 4
        for n, p in model.named_parameters()
        if n.endswith(("up_weight", "up_bias", "down_weight", "down_bias"))
    )
    assert expert_bytes(config, 1)["params"] == held
    assert expert_bytes(config, 4)["params"] == held // 4
    assert expert_bytes(config, 4)["optimizer"] == 2 * held // 4


class _OneRank:
    rank, size = 0, 1


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"experts": 4, "top_k": 5}, "top_k must be between 1 and the 4 experts"),
        ({"experts": 4, "capacity_factor": 0.0}, "capacity_factor must be > 0"),
        ({"experts": 4, "router": "relu"}, "unknown router score 'relu'"),
        ({"experts": -1}, "experts must be an int >= 0"),
    ],
)
def test_bad_settings_are_refused_in_one_line(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GPTConfig(**kwargs)


def test_experts_that_do_not_divide_by_ep_are_refused():
    with pytest.raises(ValueError, match="6 experts do not divide by ep 4"):
        check_ep(6, 4)
    with pytest.raises(ValueError, match="has no MoE layer"):
        expert_parallel(gpt(GPTConfig()), _OneRank())


def test_ranks_whose_experts_receive_nothing_still_run_backward(pools):
    for counts, has_grad in pools[4].run(experts_that_receive_nothing).results:
        assert counts == [6, 0, 0, 0] and has_grad


def test_lesson_11s_routing_example_counts_before_and_after_the_drops():
    """What lesson 11 prints: chosen per expert (before the capacity), kept (after, none
    above the capacity), and the two apart by the assignments dropped."""
    from parcourse.experiments.experts import routing_example

    dropless = routing_example(12, 8, 2, capacity_factor=None)
    assert dropless["capacity"] is None and dropless["kept_counts"] == dropless["counts"]
    r = routing_example(12, 8, 2, capacity_factor=1.0)
    assert r["capacity"] == 3  # ceil(1.0 x 12 x 2 / 8)
    assert max(r["kept_counts"]) <= 3 < max(r["counts"])
    assert sum(r["counts"]) - sum(r["kept_counts"]) == r["dropped"] > 0


def test_the_layers_timeline_names_forward_and_backward(pools):
    """`ep_layer`'s trace on 2 ranks, in order on each: the counts, the dispatch, the
    experts and the combine forward, then the combine's backward, the experts' backward
    (autograd's, traced by `BackwardSpan`) and the dispatch's; each all-to-all with its
    group's ranks, so that the wait for a partner is drawn as waiting."""
    from parcourse.experiments.experts import ep_layer

    run = pools[2].run(ep_layer, 16, 4)
    for rank in range(2):
        spans = sorted((s for s in run.trace.spans if s.rank == rank), key=lambda s: s.start_ns)
        assert [(s.name, s.meta.get("label")) for s in spans] == [
            ("counts", "counts"),
            ("dispatch", "dispatch"),
            ("forward: experts", "experts"),
            ("combine", "combine"),
            ("combine grad", "combine grad"),
            ("backward: experts", "experts"),
            ("dispatch grad", "dispatch grad"),
        ]
        assert all(s.meta["group"] == (0, 1) for s in spans if s.kind == "comm")


def test_lesson_11s_dispatch_exercise_names_each_mistake(capsys):
    """The solution passes and matches the library's `permute`; rows per expert, an
    unstable sort and the routing's own order are each named."""
    from parcourse.experiments.experts import check_dispatch, dispatch_plan
    from parcourse.experts import Routing, permute

    assert check_dispatch(dispatch_plan)
    chosen = torch.tensor([[2, 0], [1, 2], [3, 0], [0, 3], [2, 1]])
    routing = Routing(
        chosen,
        torch.ones(5, 2),
        torch.ones(5, 2, dtype=torch.bool),
        torch.bincount(chosen.flatten(), minlength=4),
        torch.zeros(()),
        torch.zeros(()),
    )
    sort = permute(routing, 4)
    assert dispatch_plan(chosen.tolist(), 4, 2)[1] == (sort.tokens * 2 + sort.slots).tolist()
    capsys.readouterr()

    def per_expert(c, e, r):
        return [sum(row.count(x) for row in c) for x in range(e)], dispatch_plan(c, e, r)[1]

    def unstable(c, e, r):
        flat = [x for row in c for x in row]
        return dispatch_plan(c, e, r)[0], sorted(range(len(flat)), key=lambda i: (flat[i], -i))

    def unsorted(c, e, r):
        return dispatch_plan(c, e, r)[0], list(range(len(c) * len(c[0])))

    for wrong, said in (
        (per_expert, "rows per expert"),
        (unstable, "stable sort"),
        (unsorted, "the routing's own order"),
    ):
        assert check_dispatch(wrong) is False
        assert said in capsys.readouterr().out


def _one_process_after_sgd(schedule, steps, rows, lr=0.05, **model):
    """The GPT of `hidden_traffic` trained `steps` SGD steps in one process on both
    pipelines' batches (each pipeline's loss a mean over its rows, the two averaged)."""
    from parcourse.experiments.experts import traffic_batch, traffic_config

    config = traffic_config(**model)
    whole = gpt(config)
    opt = torch.optim.SGD(whole.parameters(), lr=lr)
    batches = [traffic_batch(config, rows * schedule.microbatches, q) for q in range(2)]
    for _ in range(steps):
        loss = (
            sum(
                torch.nn.functional.cross_entropy(whole(x).flatten(0, 1), y.flatten())
                for x, y in batches
            )
            / 2
        )
        loss.backward()
        opt.step()
        opt.zero_grad()
    return whole, config


@pytest.mark.parametrize(
    "name,overlap",
    [("dualpipe", True), ("dualpipe", False), ("1f1b", False)],
    ids=["dualpipe-overlapped", "dualpipe-apart", "1f1b"],
)
def test_dualpipe_hiding_the_all_to_all_trains_as_one_process(pool4, name, overlap):
    """Two pipelines of 2 ranks, the experts cut over the two ranks holding the same
    stages (ep 2), the all-to-all over a simulated link. Under DualPipe with its pairs
    overlapped (a forward's all-to-all in one thread while the other's backward computes,
    `PipelineRuntime(turns=)`), apart, and under 1F1B: every rank's weights after two SGD
    steps equal one process's (TOL above: the experts' rows arrive in another order and
    microbatches sum gradients in another order)."""
    from parcourse.experiments.experts import hidden_traffic
    from parcourse.pipeline.schedule import schedule_by_name

    schedule = schedule_by_name(name, 2, 4, 1)
    model = {"layers": 2, "width": 16, "experts": 4}
    whole, config = _one_process_after_sgd(schedule, 2, rows=1, **model)
    want = dict(whole.named_parameters())
    results = pool4.run(
        hidden_traffic, schedule, overlap, steps=2, rows=1, latency_us=300, **model
    ).results
    held = config.experts // 2
    for rank, got in enumerate(results):
        here = rank // 2  # the pipeline, and the rank's place in its ep group
        for n, p in got["weights"].items():
            ref = want[n].detach()
            if p.shape != ref.shape:  # an expert weight: this rank's slice
                ref = ref[here * held : (here + 1) * held]
            assert torch.allclose(p, ref, atol=TOL), (rank, n)
        assert got["steps"][-1]["waited"] > 0  # the all-to-alls ran under the turns


def test_overlapped_pairs_take_turns_on_one_device(pool4):
    """DualPipe's pairs overlapped, compute simulated (each piece between all-to-alls
    holds the turn for its share of 6 ms forward, 12 ms backward): the turn's holders
    never overlap (one device), the waits of the pairs were partly hidden (the other
    thread computed during them), and the weights are the same bits as with the pairs run
    apart: hiding the traffic changes no number."""
    from parcourse.experiments.experts import hidden_traffic
    from parcourse.pipeline.schedule import dualpipe

    model = {
        "layers": 2,
        "width": 16,
        "experts": 4,
        "rows": 1,
        "steps": 2,
        "forward_ms": 6,
        "backward_ms": 12,
        "latency_us": 1000,
    }
    together, apart = (
        pool4.run(hidden_traffic, dualpipe(2, 8), overlap, **model).results
        for overlap in (True, False)
    )
    for a, b in zip(together, apart):
        for n in a["weights"]:
            assert torch.equal(a["weights"][n], b["weights"][n]), n
        held = sorted((start, end) for _, start, end in a["held"])
        assert all(end <= nxt for (_, end), (nxt, _) in zip(held, held[1:]))
        assert {kind for kind, _, _ in a["held"]} == {"F", "B", "I", "W"}
        last = a["steps"][-1]
        assert last["exposed"] < last["waited"]
        assert b["steps"][-1]["exposed"] == pytest.approx(b["steps"][-1]["waited"], abs=1e-6)


def test_taking_turns_and_exposed_waits_by_hand():
    """The simulator's pair on one device: compute needs the device, waits do not; an
    action's waits are exposed only when the other has no compute to run beside them."""
    from parcourse.pipeline.schedule import dualpipe, one_f_one_b
    from parcourse.pipeline.simulate import exposed_waits, taking_turns

    # F: 1 compute, 2 wait, 1 compute; B: 2 compute, 1 wait, 2 compute.
    # F 0-1, B 1-3 (F's wait ends at 3), F 3-4, B 4-6: 6, nothing exposed.
    assert taking_turns([1, 2, 1], [2, 1, 2]) == 6
    # F's wait of 5 outlasts B's 3 of compute: 2 exposed, 7 in all
    assert taking_turns([1, 5, 1], [3]) == 7
    assert taking_turns([1], [1]) == 2
    parts = {"F": [1.0, 0.5, 1.0], "B": [2.0, 0.5, 2.0], "I": [1.0, 0.5, 1.0], "W": [2.0]}
    exposed, _ = exposed_waits(one_f_one_b(2, 4), lambda a: parts[a.kind], overlap=False)
    assert exposed == [4 * 1.0, 4 * 1.0]  # every action's wait, nothing beside it
    schedule = dualpipe(2, 8)
    apart, _ = exposed_waits(schedule, lambda a: parts[a.kind], overlap=False)
    hidden, _ = exposed_waits(schedule, lambda a: parts[a.kind], overlap=True)
    per_rank = [sum(sum(parts[a.kind][1::2]) for a in acts) for acts in schedule.actions]
    assert apart == pytest.approx(per_rank)
    pairs = len(schedule.together) // 2  # each rank's pairs hide both their waits
    assert hidden == pytest.approx([w - pairs * 1.0 for w in per_rank])


# -- the router's formulas against their papers, worked by hand


def _router_on(logits: list[list[float]], **kwargs):
    """A router whose gate gives exactly `logits` (N tokens x E experts): the tokens are
    the rows of the identity, the gate's weight the logits' transpose."""
    from parcourse.experts import Router

    n, e = len(logits), len(logits[0])
    router = Router(n, e, **kwargs)
    with torch.no_grad():
        router.gate.weight.copy_(torch.tensor(logits).t())
    return router, torch.eye(n)


def test_switch_balancing_loss_by_hand():
    """Switch Transformer (Fedus et al. 2021), eq. 4-6: loss = E x sum_e f_e P_e, P_e the
    mean router probability of expert e, f_e the share it received; with top-k routing the
    share of the N k assignments (the course's `Routing.aux_loss`). Two tokens, four
    experts, top 2: token 0 chooses experts 0 and 1, token 1 experts 0 and 2, so f = (2, 1,
    1, 0) / 4."""
    import math

    logits = [[3.0, 2.0, 0.0, 0.0], [2.5, 0.0, 1.0, 0.0]]
    router, x = _router_on(logits, top_k=2)
    routing = router(x)
    probs = [[math.exp(v) / sum(math.exp(w) for w in row) for v in row] for row in logits]
    mean_p = [(probs[0][e] + probs[1][e]) / 2 for e in range(4)]
    f = [2 / 4, 1 / 4, 1 / 4, 0.0]
    assert routing.counts.tolist() == [2, 1, 1, 0]
    aux = float(routing.aux_loss.detach())
    assert aux == pytest.approx(4 * sum(a * b for a, b in zip(f, mean_p)))
    # the router z-loss (ST-MoE, eq. 5): the mean of each token's logsumexp squared
    z = sum(math.log(sum(math.exp(v) for v in row)) ** 2 for row in logits) / 2
    assert float(routing.z_loss.detach()) == pytest.approx(z)


def test_gshard_capacity_by_hand():
    """GShard (Lepikhin et al. 2020): an expert takes at most ceil(factor x N x k / E)
    assignments, rounded up; first choices before second ones, each in token order."""
    from parcourse.experts import capacity, keep_within

    assert capacity(10, 4, 2, 1.0) == 5  # 20 assignments over 4 experts
    assert capacity(7, 3, 1, 1.25) == 3  # 2.92, rounded up
    assert capacity(9, 4, 2, 1.0) == 5  # 4.5, rounded up
    assert capacity(8, 4, 2, None) is None  # dropless
    # three tokens' (first, second) choices, at most 2 an expert: expert 0's queue holds
    # tokens 0, 1, 2 (first choices), so token 2's first choice is the one dropped
    chosen = torch.tensor([[0, 1], [0, 1], [0, 2]])
    assert keep_within(chosen, 3, 2).tolist() == [[True, True], [True, True], [False, True]]
    # one an expert: every first choice fits, every second finds its expert full
    chosen = torch.tensor([[0, 1], [1, 2], [2, 0]])
    assert keep_within(chosen, 3, 1).tolist() == [[True, False], [True, False], [True, False]]


def test_deepseek_v3_bias_by_hand():
    """DeepSeek-V3 (2024), sec. 2.1.2: after each step each expert's bias moves by the rate
    towards balance, down for an expert above the mean load and up for one below; over
    steps the busiest expert gets fewer tokens, while the combine weights stay the
    unbiased scores'."""
    from parcourse.experts import Router

    router = Router(4, 4, top_k=1, score="sigmoid", bias_rate=0.1)
    router.update_bias(torch.tensor([6, 2, 2, 2]))  # mean 3
    assert router.bias.tolist() == pytest.approx([-0.1, 0.1, 0.1, 0.1])
    # 16 tokens that all prefer expert 0, some more than others: the bias peels them off
    # one by one, the most hesitant first
    logits = [[0.3 + 0.02 * t, 0.2, 0.1, 0.0] for t in range(16)]
    router, x = _router_on(logits, top_k=1, score="sigmoid", bias_rate=0.01)
    router.train()
    loads = []
    for _ in range(8):
        routing = router(x)
        loads.append(int(routing.counts[0]))
        router.update_bias()
    assert loads[0] == 16 and loads[-1] < 4, loads
    assert all(later <= earlier for earlier, later in zip(loads, loads[1:])), loads
    scores = router.gate(x).sigmoid()
    weights = scores.gather(1, routing.experts) / scores.gather(1, routing.experts).sum(-1, True)
    torch.testing.assert_close(routing.weights, weights)  # no bias in the weights
