"""The models know nothing of distribution, and building one leaves the caller's RNG alone."""

import torch

from parcourse.models import gpt, mlp


def test_building_a_model_leaves_the_global_random_state_alone():
    state = torch.get_rng_state()
    mlp(8, 16, 4, depth=3, seed=5)
    gpt()
    assert torch.equal(torch.get_rng_state(), state)


def test_same_seed_same_weights():
    a, b = mlp(8, 16, 4, depth=3, seed=5), mlp(8, 16, 4, depth=3, seed=5)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    c = mlp(8, 16, 4, depth=3, seed=6)
    assert not all(torch.equal(p, q) for p, q in zip(a.parameters(), c.parameters()))
