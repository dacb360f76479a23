"""Backward split into I (input gradient) and W (weight gradients), as zero-bubble
schedules run it: together they give exactly what one backward gives.

Bitwise: I and W run the very autograd nodes one backward runs, on the same saved
tensors, in the same order within each node; only when a weight is reached from two
groups of nodes could sums be ordered differently (none of these models has that).
"""

import pytest
import torch
from torch import nn

from parcourse.models import GPTConfig, gpt, gpt_layers
from parcourse.pipeline.split import input_gradient


def both_ways(module, x, *, input_grad=True):
    """(gradients of one backward, of I then W), for the weights and the input."""
    results = []
    for split in (False, True):
        module.zero_grad(set_to_none=True)
        xi = x.detach().clone().requires_grad_(input_grad) if x.is_floating_point() else x
        y = module(xi)
        g = torch.ones_like(y) if y.dim() else None
        if split:
            dx, later = input_gradient(y, g, xi, list(module.parameters()))
            assert all(p.grad is None for p in module.parameters())  # I touches no weight
            later()
        else:
            y.backward(g)
            dx = xi.grad if input_grad and x.is_floating_point() else None
        results.append(
            ([None if p.grad is None else p.grad.clone() for p in module.parameters()], dx)
        )
    return results


def assert_same(a, b):
    (wa, xa), (wb, xb) = a, b
    for ga, gb in zip(wa, wb):
        assert (ga is None) == (gb is None)
        if ga is not None:
            assert torch.equal(ga, gb)
    if xa is not None:
        assert torch.equal(xa, xb)


def test_a_chain_of_layers():
    torch.manual_seed(0)
    chain = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(4)])
    assert_same(*both_ways(chain, torch.randn(4, 8)))


def test_gpt_blocks_embedding_and_tied_head():
    model = gpt(GPTConfig(n_layers=2, d_model=32, block_size=8))
    layers = gpt_layers(model)
    blocks = nn.Sequential(*layers[1:-1])
    assert_same(*both_ways(blocks, torch.randn(2, 8, 32)))
    # The first stage: token ids need no gradient, so I has nothing to do and W is all.
    whole = nn.Sequential(*layers)  # embedding and head share one weight
    assert_same(*both_ways(whole, torch.randint(0, 64, (2, 8))))


def test_frozen_and_unused_weights():
    torch.manual_seed(0)

    class WithUnused(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
            self.unused = nn.Linear(8, 8)

        def forward(self, x):
            return self.body(x)

    net = WithUnused()
    net.body[0].weight.requires_grad_(False)
    (w1, x1), (w2, x2) = both_ways(net, torch.randn(4, 8))
    assert_same((w1, x1), (w2, x2))
    assert w2[-1] is None  # the unused layer gets no gradient, as with one backward


def test_output_that_does_not_depend_on_the_input():
    net = nn.Linear(4, 4)
    x = torch.randn(2, 4, requires_grad=True)
    y = net(torch.randn(2, 4))  # x unused
    dx, later = input_gradient(y, torch.ones_like(y), x, list(net.parameters()))
    assert torch.equal(dx, torch.zeros_like(x))
    later()
    assert net.weight.grad is not None


@pytest.mark.parametrize("accumulate", [1, 3])
def test_weight_gradients_accumulate_like_backward(accumulate):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 6), nn.ReLU(), nn.Linear(6, 2))
    xs = [torch.randn(3, 6) for _ in range(accumulate)]
    for x in xs:
        net(x).sum().backward()
    expected = [p.grad.clone() for p in net.parameters()]
    net.zero_grad(set_to_none=True)
    for x in xs:
        x = x.requires_grad_(True)
        _, later = input_gradient(net(x).sum(), None, x, list(net.parameters()))
        later()
    for p, e in zip(net.parameters(), expected):
        torch.testing.assert_close(p.grad, e, rtol=0, atol=0)
