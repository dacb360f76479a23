"""Fault-tolerant training: without a fault it is data parallelism, bit for bit; with
one, the survivors go on as one process on their rows would, and a new replica heals
from a live peer to the same bits.

Tolerance against one process: fp32 on gloo, where only the order of additions differs
(the mean of the replicas' means against the mean over their rows): a few ulps a step,
which AdamW's normalisation can amplify for tiny gradients, hence rtol=1e-5, atol=1e-6
after a dozen steps. Against `BucketedDataParallel` and between replicas: bitwise (the
same buckets, the same all-reduce, the same divisor)."""

import fault_fns as F
import psutil
import pytest
import torch

from parcourse import RankError
from parcourse.fault import run_replicas, train_replica

TOL = {"rtol": 1e-5, "atol": 1e-6}


def assert_bitwise_alike(run):
    states = {r: res["state"] for r, res in run.results.items()}
    first = states[min(states)]
    for r, state in states.items():
        for name, value in state.items():
            assert torch.equal(value, first[name]), f"replica {r}, {name} differs"


def assert_none_left(run):
    pids = {e.pid for e in run.events}
    alive = [p.pid for p in psutil.Process().children(recursive=True) if p.pid in pids]
    assert not alive, f"replica processes left behind: {alive}"


@pytest.mark.parametrize("replicas", [2, 4])
def test_without_a_fault_it_is_bucketed_data_parallel_bitwise(pools, replicas):
    # 0.0005 MB: the 174 parameters' gradients in two buckets, as BucketedDataParallel
    # cuts them
    run = run_replicas(train_replica, replicas, F.make, F.batch, 6, bucket_mb=0.0005)
    dp = pools[replicas].run(F.bucketed, 6, 0.0005).results
    assert sorted(run.results) == list(range(replicas))
    for r, res in run.results.items():
        assert res["steps"] == 6 and res["failures"] == [] and res["healed"] == []
        for name, value in res["state"].items():
            assert torch.equal(value, dp[r][name]), f"replica {r}, {name}"
    assert all(q.members == list(range(replicas)) for q in run.rounds)
    expected = F.one_process(6, lambda step: range(replicas))
    for name, value in expected.items():
        torch.testing.assert_close(run.results[0]["state"][name], value, **TOL)
    assert_none_left(run)


@pytest.mark.parametrize("replicas", [2, 4])
def test_a_replica_killed_mid_step_the_survivors_go_on_as_one_process(replicas):
    # replica 1 dies after its backward at step 3: that step's all-reduce breaks, is
    # retried without it, and from step 3 the mean is over the survivors' rows
    run = run_replicas(train_replica, replicas, F.make, F.batch, 10, kill=[(1, 3)])
    survivors = [r for r in range(replicas) if r != 1]
    assert sorted(run.results) == survivors
    assert [e.replica for e in run.deaths()] == [1]
    expected = F.one_process(10, lambda step: range(replicas) if step < 3 else survivors)
    for r in survivors:
        res = run.results[r]
        assert [h["step"] for h in res["history"]] == list(range(10)), "a step lost"
        assert [h["members"] for h in res["history"]][2:4] == [list(range(replicas)), survivors]
        assert len(res["failures"]) == 1 and res["failures"][0].startswith("round 3:")
        for name, value in expected.items():
            torch.testing.assert_close(res["state"][name], value, **TOL)
    assert_bitwise_alike(run)
    dropped = [q for q in run.rounds if not q.commit][-1]
    assert dropped.members == survivors and dropped.step == 3
    assert_none_left(run)


def test_a_new_replica_heals_from_a_live_peer_to_the_same_bits():
    # min_replicas=4: the round after the death waits for the replacement, which then
    # receives the weights and AdamW's moments from replica 0 and trains on
    run = run_replicas(
        train_replica, 4, F.make, F.batch, 8, kill=[(2, 3)], replace=True, min_replicas=4
    )
    assert sorted(run.results) == [0, 1, 2, 3]
    new = run.results[2]
    assert new["incarnation"] == 1
    (healed,) = new["healed"]
    assert healed["source"] == 0 and healed["target"] == 2 and healed["nbytes"] > 3 * 174 * 4
    assert [h["step"] for h in new["history"]] == list(range(3, 8))
    assert_bitwise_alike(run)
    first = run.results[0]["optimizer"]["state"]
    for i, state in new["optimizer"]["state"].items():
        for k, v in state.items():
            assert torch.equal(v, first[i][k]), f"optimizer state {i}.{k}"
    # the survivors never lost a step: the replacement took part from step 3 on
    expected = F.one_process(8, lambda step: range(4))
    for name, value in expected.items():
        torch.testing.assert_close(new["state"][name], value, **TOL)
    assert_none_left(run)


def test_the_source_dying_while_it_heals_is_survived():
    # replica 1 dies at step 2; its replacement is to be healed from replica 0, which
    # dies while sending: the replacement heals again, from replica 2, in the next round
    run = run_replicas(
        train_replica,
        3,
        F.make,
        F.batch,
        6,
        kill=[(1, 2), (0, "heal")],
        replace=True,
        min_replicas=3,
    )
    assert sorted(run.results) == [0, 1, 2]
    assert sorted((e.replica, e.incarnation) for e in run.deaths()) == [(0, 0), (1, 0)]
    sources = [h["source"] for res in run.results.values() for h in res["healed"]]
    assert 2 in sources, run.results
    assert any("heal" in f for f in run.results[1]["failures"])
    assert_bitwise_alike(run)
    assert all(res["steps"] == 6 for res in run.results.values())
    assert_none_left(run)


def test_sharded_optimizer_state_is_refused_in_one_line(pool2):
    (message, _) = pool2.run(F.sharded).results
    assert "ZeroRedundancyOptimizer shards it" in message and "\n" not in message


def test_bad_faults_are_refused_before_any_process_starts():
    with pytest.raises(ValueError, match="replica must be below 2"):
        run_replicas(train_replica, 2, F.make, F.batch, 3, kill=[(2, 1)])
    with pytest.raises(ValueError, match='step >= 0 or "heal"'):
        run_replicas(train_replica, 2, F.make, F.batch, 3, kill=[(0, -1)])
    with pytest.raises(ValueError, match="min_replicas=3"):
        run_replicas(train_replica, 2, F.make, F.batch, 3, min_replicas=3)


def test_a_replica_that_raises_names_itself():
    def broken(step, replica):
        if replica == 1 and step == 2:
            raise ValueError("bad rows")
        return F.batch(step, replica)

    with pytest.raises(RankError, match="bad rows") as info:
        run_replicas(train_replica, 2, F.make, broken, 4)
    assert info.value.rank == 1


def test_the_rows_of_a_step_are_those_of_the_loader_read_in_order():
    # a healed replica reads step k's rows without reading the k before: across epochs,
    # in any order
    import numpy as np

    from parcourse.corpus import ShardedLoader
    from parcourse.fault.gpt import rows_at

    tokens = (np.arange(1000) % 251).astype(np.uint16)
    reading = ShardedLoader(tokens, 8, 6, replica=1, replicas=3, seed=2)
    jumping = ShardedLoader(tokens, 8, 6, replica=1, replicas=3, seed=2)
    assert reading.batches_per_epoch == 20
    in_order = [reading.next() for _ in range(45)]
    for step in [0, 44, 3, 21, 20, 19, 40, 1]:
        x, y = rows_at(jumping, step)
        assert torch.equal(x, in_order[step][0]) and torch.equal(y, in_order[step][1]), step


def test_train_fault_tolerant_goes_on_through_a_killed_replica(capsys, tmp_path):
    from parcourse.cli import main

    corpus = str(tmp_path / "corpus")
    argv = ["train", "--fault-tolerant", "--plan", "dp2 tp1 pp1", "--steps", "6"]
    assert main([*argv, "--eval-every", "6", "--kill", "1:3", "--corpus", corpus]) == 0
    out = capsys.readouterr().out
    assert "died        replica 1 (exit -9); a new one started" in out
    # the run goes on to its last step whether or not the replacement (started at once,
    # a new Python) joins before the end: the heal itself is tested above, with min_replicas
    assert "\n     5 " in out and "val loss" in out
    for wrong, says in (
        (["--dp", "2", "--pp", "2"], "--fault-tolerant trains dp's replicas only"),
        (["--plan", "dp2 tp1 pp1", "--out", str(tmp_path / "run")], "keeps no checkpoint"),
    ):
        with pytest.raises(SystemExit) as refused:
            main(["train", "--fault-tolerant", *wrong])
        assert refused.value.code == 2 and says in capsys.readouterr().err


@pytest.mark.parametrize("world_size", [2, 4])
def test_local_sgd_meeting_every_step_is_bsp(pools, world_size):
    # plain SGD: the mean of w - lr g_r is w - lr mean(g_r), up to the order of additions
    results = pools[world_size].run(F.local, "local", 1, 5).results
    expected = F.one_process(5, lambda step: range(world_size), lambda: F.make("sgd-plain"))
    for r in results:
        for name, value in expected.items():
            torch.testing.assert_close(r["state"][name], value, **TOL)


@pytest.mark.parametrize("kind", ["local", "diloco"])
@pytest.mark.parametrize("world_size", [2, 4])
def test_local_sgd_and_diloco_against_a_hand_written_reference(pools, kind, world_size):
    # 7 steps meeting every 3: two meetings, and one step after the last (replicas apart)
    results = pools[world_size].run(F.local, kind, 3, 7).results
    ahead = F.local_reference(kind, 3, 7, world_size)
    params = 174 * 4  # bytes of the weights: 7 x 13 + 13 + 13 x 5 + 5 in fp32
    for r in results:
        assert r["bytes"] == 2 * params  # one all-reduce of the weights a meeting
    for name, value in ahead.items():
        torch.testing.assert_close(results[0]["state"][name], value, **TOL)


def test_local_sgd_refuses_meeting_never():
    from parcourse.fault import LocalSGD

    with pytest.raises(ValueError, match="every must be at least 1 step, got 0"):
        LocalSGD(torch.nn.Linear(2, 2), None, 0)
