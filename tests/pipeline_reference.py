"""The pipelines' reference, in plain torch: what `experiments.pipeline.train` must equal."""

import torch

from parcourse.experiments.pipeline import model_and_data


def one_process(
    steps=2,
    *,
    model="mlp",
    depth=8,
    width=16,
    batch=16,
    lr=0.05,
    accumulate=1,
    frozen=(),
    weight_decay=0.0,
):
    """The reference, in plain torch here: the same model and data as `train` (built by
    `model_and_data`, nothing of the pipeline's), SGD on the whole batch (or its
    `accumulate` parts, gradients added up); the weights afterwards."""
    _, whole, x, y, loss_fn = model_and_data(model, depth, width, batch)
    for name in frozen:
        whole.get_parameter(name).requires_grad_(False)
    opt = torch.optim.SGD(whole.parameters(), lr=lr, weight_decay=weight_decay)
    for _ in range(steps):
        for xs, ys in zip(x.chunk(accumulate), y.chunk(accumulate)):
            loss_fn(whole(xs), ys).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in whole.named_parameters()}
