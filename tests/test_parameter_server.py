"""Parameter servers: BSP is plain gradient descent; ASP trades waiting for staleness."""

import pytest
import torch
import torch.nn.functional as F
from torch.nn.utils import parameters_to_vector

from parcourse import Pool, RankError
from parcourse.data import regression
from parcourse.experiments.parameter_server import parameter_server_training
from parcourse.models import mlp


def gradient_descent(workers, updates, lr=0.1, d=16, hidden=32, samples=256):
    """Plain torch, written here apart from the library's server: SGD on the mean over
    the workers of each one's MSE on its rows; the loss on all the data after each
    update (once per worker, as the server records it) and the weights at the end."""
    model = mlp(d, hidden, d, depth=2)
    x, y = regression(samples, d, d)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    rows = [torch.tensor_split(torch.arange(samples), workers)[w] for w in range(workers)]
    losses = []
    for _ in range(updates):
        opt.zero_grad()
        sum(F.mse_loss(model(x[r]), y[r]) for r in rows).div(workers).backward()
        opt.step()
        with torch.no_grad():
            losses += [F.mse_loss(model(x), y).item()] * workers
    return losses, parameters_to_vector(model.parameters()).detach()


@pytest.mark.parametrize("world_size", [2, 4])
def test_bsp_equals_gradient_descent_in_one_process(world_size):
    with Pool(world_size) as pool:
        result = pool.run(parameter_server_training, "bsp", 6).results[0]
    losses, weights = gradient_descent(world_size - 1, 6)
    # fp32: the mean of the workers' gradients against autograd's mean, summed in
    # another order: rounding apart, no more
    assert result["loss"] == pytest.approx(losses, rel=1e-5)
    torch.testing.assert_close(result["weights"], weights, rtol=1e-5, atol=1e-6)
    assert result["staleness"] == [0] * 6 * (world_size - 1)
    assert result["loss"][-1] < result["loss"][0]


def test_asp_with_one_worker_is_bsp():
    with Pool(2) as pool:
        asp = pool.run(parameter_server_training, "asp", 5).results[0]
    assert asp["staleness"] == [0] * 5
    losses, weights = gradient_descent(1, 5)
    assert asp["loss"] == pytest.approx(losses, rel=1e-5)
    torch.testing.assert_close(asp["weights"], weights, rtol=1e-5, atol=1e-6)


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
