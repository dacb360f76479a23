"""FP8 with its scales (parcourse.fp8): quantise and dequantise within each format's
error bound, the block scales equal to a hand-written loop over the blocks, delayed
scaling from the amax history, and an FP8 Linear's output and gradients within the error
its operands' rounding allows, training beside fp32."""

import pytest
import torch
from torch import nn

from parcourse import fp8


def _values(rows=48, cols=300, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g)
    x[3, 7] = 900.0  # an outlier: what per-row and per-block scales are for
    x[5] *= 1e-4  # a row of small values
    return x


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize(
    ("granularity", "block"),
    [("tensor", (1, 128)), ("row", (1, 128)), ("block", (1, 128)), ("block", (16, 32))],
)
def test_a_round_trip_lies_within_the_formats_bound(fmt, granularity, block):
    x = _values()
    q = fp8.quantize(x, fmt, granularity, block)
    assert q.data.dtype == fp8.FORMATS[fmt] and q.data.shape == x.shape
    back = fp8.dequantize(q)
    bound = fp8.error_bound(q, fmt) * (1 + 1e-6) + 1e-30  # fp32's own rounding of x * scale
    assert ((back - x).abs() <= bound).all()
    # the bound is tight: some value comes within a fifth of it
    assert ((back - x).abs() / bound).max() > 0.2
    # each group's largest value lands on the format's largest
    assert float(q.data.float().abs().max()) == torch.finfo(fp8.FORMATS[fmt]).max


def test_finer_scales_keep_more_of_the_small_row():
    """One outlier (900) sets the tensor's scale: the row of 1e-4 values falls below e4m3's
    smallest numbers there and is lost; a row's or a block's own scale keeps it."""
    x = _values()
    errors = {
        g: fp8.relative_error(fp8.dequantize(fp8.quantize(x, "e4m3", g))[5], x[5])
        for g in ("tensor", "row", "block")
    }
    assert errors["tensor"] > 0.5 and errors["row"] < 0.05 and errors["block"] < 0.05, errors


def test_block_scales_equal_a_loop_over_the_blocks():
    """DeepSeek-V3's 128 x 128 (here 16 x 32, with ragged edges) and 1 x 128 blocks: one
    scale a block, 448 over its largest magnitude, in row-major order of the blocks."""
    x = _values(40, 70)
    for block in ((16, 32), (1, 128)):
        q = fp8.quantize(x, "e4m3", "block", block)
        br, bc = block
        expected = [
            448.0 / float(x[r : r + br, c : c + bc].abs().max())
            for r in range(0, 40, br)
            for c in range(0, 70, bc)
        ]
        assert q.scale.tolist() == pytest.approx(expected, rel=1e-7)
        assert q.nbytes == x.numel() + 4 * len(expected)


def test_delayed_scaling_uses_the_historys_largest_amax_and_saturates():
    history = fp8.AmaxHistory(length=2)
    assert float(history.scale()) == 1.0
    for amax in (4.0, 8.0, 2.0):
        history.record(torch.tensor([amax, -1.0]))
    assert float(history.scale()) == 448.0 / 8.0  # 4.0 has left the history
    x = torch.tensor([[1.0, -20.0]])  # beyond what the scale expects: saturates at 448
    q = fp8.quantize(x, "e4m3", scale=history.scale())
    assert q.data.float().tolist() == [[56.0, -448.0]]


def test_bad_arguments_are_refused_in_one_line():
    x = torch.ones(2, 2)
    with pytest.raises(ValueError, match="fmt must be one of e4m3, e5m2"):
        fp8.quantize(x, "e3m4")
    with pytest.raises(ValueError, match="granularity must be tensor, row or block"):
        fp8.quantize(x, "e4m3", "column")
    with pytest.raises(ValueError, match="block must be two whole numbers"):
        fp8.quantize(x, "e4m3", "block", (0, 128))
    with pytest.raises(ValueError, match="1-D or 2-D"):
        fp8.quantize(torch.ones(2, 2, 2))
    with pytest.raises(ValueError, match="granularity must be 'tensor'"):
        fp8.quantize(x, "e4m3", "row", scale=torch.ones(1))
    with pytest.raises(ValueError, match="length must be"):
        fp8.AmaxHistory(0)


@pytest.mark.parametrize("granularity", ["tensor", "row", "block"])
def test_an_fp8_linear_is_fp32s_within_its_operands_rounding(granularity):
    """Forward and both gradients of Float8Linear against nn.Linear in fp32 with the same
    weights: e4m3 operands are off by at most 2**-4 relative each, e5m2 gradients 2**-3, so
    a product's relative error is at most about their sum; measured, 3.5% for the output
    (errors of random sign partly cancel over the sums)."""
    torch.manual_seed(0)
    ref = nn.Linear(96, 40)
    f8 = fp8.Float8Linear.from_linear(nn.Linear(96, 40), fp8.Recipe(granularity, (1, 32)))
    f8.load_state_dict(ref.state_dict())
    x = torch.randn(2, 12, 96)
    x8, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
    g = torch.randn(2, 12, 40)
    (f8(x8) * g).sum().backward()
    (ref(xr) * g).sum().backward()
    assert fp8.relative_error(f8(x), ref(x)) < 2**-4 + 2**-4
    assert fp8.relative_error(x8.grad, xr.grad) < 2**-3 + 2**-4
    assert fp8.relative_error(f8.weight.grad, ref.weight.grad) < 2**-3 + 2**-4
    assert torch.equal(f8.bias.grad, ref.bias.grad)  # the bias stays fp32
    assert f8.weight.dtype == torch.float32 and fp8.relative_error(f8(x), ref(x)) > 0


def test_a_model_converted_to_fp8_trains_beside_fp32():
    """convert_to_float8 swaps every Linear, keeping its weights; 30 Adam steps of a small
    MLP on a regression land near fp32's loss (within 10%), and far below the start."""

    def mlp():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 4))

    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(256, 16, generator=g), torch.randn(256, 4, generator=g)
    losses = {}
    for name, model in (("fp32", mlp()), ("fp8", fp8.convert_to_float8(mlp()))):
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        for _ in range(30):
            loss = nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        losses[name] = nn.functional.mse_loss(model(x), y).item()
    converted = fp8.convert_to_float8(mlp())
    assert all(isinstance(m, fp8.Float8Linear) for m in (converted[0], converted[2]))
    assert losses["fp8"] == pytest.approx(losses["fp32"], rel=0.1), losses
    assert losses["fp8"] < 0.9, losses
