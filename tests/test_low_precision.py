"""Lesson 03's fewer bits (`parcourse.experiments.low_precision`): the formats read from
torch.finfo, the shares of values a format loses, one outlier against each scale's
granularity, the figures, and the loss scaler's exercise: its check passes torch's own
update and names each mistake."""

import math

import pytest
import torch

from parcourse.experiments import low_precision as lp


def test_the_formats_are_torchs():
    fp16, bf16, e4m3, e5m2 = (lp.format_facts(n) for n in ("fp16", "bf16", "e4m3", "e5m2"))
    assert (fp16["exponent"], fp16["mantissa"], fp16["largest"]) == (5, 10, 65504.0)
    assert fp16["smallest"] == 2.0**-24 and fp16["smallest_normal"] == 2.0**-14
    assert (bf16["exponent"], bf16["mantissa"]) == (8, 7)
    assert (e4m3["exponent"], e4m3["mantissa"], e4m3["largest"]) == (4, 3, 448.0)
    assert (e5m2["exponent"], e5m2["mantissa"], e5m2["largest"]) == (5, 2, 57344.0)
    assert e4m3["smallest"] == 2.0**-9  # 2**-6 x eps 2**-3


def test_shares_below_a_format_and_what_a_scale_moves():
    values = torch.tensor([1e-9, 1e-6, 1e-3, 0.0])  # an exact 0 is no format's loss
    assert lp.below(values, "fp16") == pytest.approx((1 / 3, 1 / 3))  # 0, subnormal, normal
    assert lp.below(values, "fp16", 2.0**16) == (0.0, 0.0)  # 6.6e-5 is normal
    assert lp.below(values, "bf16") == (0.0, 0.0)  # fp32's range
    # half the smallest subnormal rounds to 0 (to even); just above it rounds up to it
    half = lp.format_facts("fp16")["smallest"] / 2
    assert lp.below(torch.tensor([half * 0.99, half * 1.01]), "fp16") == (0.5, 0.5)
    assert torch.tensor(half * 0.99).half().item() == 0.0
    assert torch.tensor(half * 1.01).half().item() > 0.0


def test_one_outlier_costs_what_its_scale_covers():
    """e4m3 keeps 3 mantissa bits: about 2**-4 of relative error where a value is in range.
    One scale a tensor loses every small value beside an outlier of 900; one a row keeps
    the other rows; one a 1 x 128 block keeps the rest of the outlier's row too."""
    errors = lp.outlier_errors()
    own = 2.0**-4
    assert [errors[w]["scales"] for w in errors] == [1, 4, 16]
    assert all(errors[w]["its block"] > 0.5 for w in errors)  # shares the outlier's scale
    assert errors["tensor"]["other rows"] > 0.5
    assert errors["row"]["other rows"] < own and errors["row"]["rest of its row"] > 0.5
    assert errors["block 1 x 128"]["rest of its row"] < own
    assert errors["block 1 x 128"]["other rows"] < own


def test_the_figures_draw():
    import matplotlib

    matplotlib.use("Agg")
    grads = torch.tensor([1e-9, 1e-6, 1e-3, 0.0, 0.2])
    assert lp.draw_formats().axes
    assert lp.draw_gradients(grads, 2.0**16).axes
    assert lp.draw_losses({"fp32": [3.0, 2.5], "fp16, no scaler": [3.0, 2.6]}).axes


def right(scale, good_steps, flags, interval):
    if any(flags):
        return False, scale * 0.5, 0
    good_steps += 1
    if good_steps == interval:
        return True, scale * 2.0, 0
    return True, scale, good_steps


def own_rank_only(scale, good_steps, flags, interval):
    return right(scale, good_steps, flags[:1], interval)


def no_reset_after_growth(scale, good_steps, flags, interval):
    take, new, good = right(scale, good_steps, flags, interval)
    return take, new, good if new <= scale else good_steps + 1


def count_kept_after_inf(scale, good_steps, flags, interval):
    take, new, good = right(scale, good_steps, flags, interval)
    return take, new, good_steps if not take else good


def no_backoff(scale, good_steps, flags, interval):
    take, new, good = right(scale, good_steps, flags, interval)
    return take, scale if not take else new, good


def halves_once_a_rank(scale, good_steps, flags, interval):
    take, new, good = right(scale, good_steps, flags, interval)
    return take, scale * 0.5 ** sum(flags) if not take else new, good


def grows_a_step_late(scale, good_steps, flags, interval):
    if any(flags):
        return False, scale * 0.5, 0
    if good_steps == interval:
        return True, scale * 2.0, 0
    return True, scale, good_steps + 1


@pytest.mark.parametrize(
    "answer, said",
    [
        (own_rank_only, "rank 2 found an inf: every rank skips"),
        (no_reset_after_growth, "after growing, the count of good steps starts again at 0"),
        (count_kept_after_inf, "an inf starts the count of good steps again at 0"),
        (no_backoff, "after an inf the scale backs off: times 0.5"),
        (halves_once_a_rank, "halve the scale once, however many ranks found an inf"),
        (grows_a_step_late, "good step number 3 in a row grows the scale"),
    ],
)
def test_the_scaler_check_names_the_mistake(answer, said, capsys):
    assert lp.check_scaler_update(answer) is False
    out = capsys.readouterr().out
    assert said in out and len(out.strip().splitlines()) == 1, out


def test_the_scaler_check_passes_torchs_own_update(capsys):
    """The check's reference is GradScaler's own update; a hand-written right answer and
    one answering in tensors (what a learner calling torch may return) both pass."""

    def in_tensors(scale, good_steps, flags, interval):
        take, new, good = right(scale, good_steps, flags, interval)
        return torch.tensor(take), torch.tensor(new), torch.tensor(good)

    assert lp.check_scaler_update(right) and lp.check_scaler_update(in_tensors)
    assert capsys.readouterr().out.count("Correct") == 2
    # the reference is GradScaler.update's, step by step
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=3)
    scale, good = 2.0**16, 0
    w = torch.nn.Parameter(torch.ones(1))
    opt = torch.optim.SGD([w], lr=0.0)
    for flags in lp.SCALER_STEPS:
        scaler.scale(w.sum())  # the scaler starts its scale on the first loss it scales
        w.grad = torch.full((1,), math.inf if any(flags) else 1.0)  # what backward left
        scaler.step(opt)
        scaler.update()
        _, scale, good = lp._reference_update(scale, good, flags, 3)
        assert scaler.get_scale() == scale
