"""Parameter servers: BSP is plain gradient descent; ASP trades waiting for staleness."""

import pytest

from parcourse import Pool, RankError
from parcourse.experiments.parameter_server import parameter_server_training, reference_bsp


@pytest.mark.parametrize("world_size", [2, 4])
def test_bsp_equals_gradient_descent_in_one_process(world_size):
    with Pool(world_size) as pool:
        result = pool.run(parameter_server_training, "bsp", 6).results[0]
    expected = reference_bsp(world_size, 6)
    assert result["loss"] == pytest.approx(expected, rel=1e-5)  # fp32, same sums in order
    assert result["staleness"] == [0] * 6 * (world_size - 1)
    assert result["loss"][-1] < result["loss"][0]


def test_asp_with_one_worker_is_bsp():
    with Pool(2) as pool:
        asp = pool.run(parameter_server_training, "asp", 5).results[0]
    assert asp["staleness"] == [0] * 5
    assert asp["loss"] == pytest.approx(reference_bsp(2, 5), rel=1e-5)


def test_asp_gradients_are_stale_with_several_workers():
    with Pool(4) as pool:
        run = pool.run(parameter_server_training, "asp", 8, straggler_ms=5.0)
    result = run.results[0]
    assert len(result["loss"]) == 8 * 3, "every gradient applied exactly once"
    assert max(result["staleness"]) >= 2, "three workers: weights move while one computes"
    assert min(result["staleness"]) >= 0
    assert run.results[1:] == [None, None, None]
    assert run.trace.spans_of(rank=1, name="gradient"), "workers traced"


def test_bad_arguments():
    with Pool(1) as pool:
        with pytest.raises(RankError, match="at least 2 ranks"):
            pool.run(parameter_server_training, "bsp")
    with Pool(2) as pool:
        with pytest.raises(RankError, match="unknown mode 'ssp'"):
            pool.run(parameter_server_training, "ssp")
