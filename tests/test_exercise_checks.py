"""Every exercise check of every lesson answers a wrong answer with a few lines of hint, never
a traceback from the course's code: an answer of the wrong type, None (a missing return), a
raise, an off-by-one number, and a still-unwritten stub. The right answers passing is tested
beside each exercise; here only that nothing a learner writes crashes Run All."""

import pytest


def _raises(*args, **kwargs):
    raise ValueError("the learner's own bug")


def _stub(*args, **kwargs):
    raise NotImplementedError


def _none(*args, **kwargs):
    return None


def _text(*args, **kwargs):
    return "wrong"


def _one(*args, **kwargs):
    return 1


def _list_of_one(*args, **kwargs):
    return [1]


WRONG = [_raises, _stub, _none, _text, _one, _list_of_one]


def _checks():
    from parcourse.experiments import (
        all_reduce,
        allocator,
        checkpointing,
        context_parallel,
        data_parallel,
        experts,
        hybrid,
        launching,
        low_precision,
        pipeline,
        planning,
        roofline,
        training,
        zero,
        zero_beyond,
    )

    return {  # lesson: check, taking (answer) or (answer, pool)
        "00 average": (launching.check_average, True),
        "01 ring step": (all_reduce.check_ring_step, True),
        "02 buckets": (data_parallel.check_buckets, False),
        "02 launch rule": (data_parallel.check_launch_rule, False),
        "03 rows": (zero.check_rows, False),
        "03 scaler update": (low_precision.check_scaler_update, False),
        "04 unpack": (zero.check_unpack, False),
        "04 quantize": (zero_beyond.check_quantize, False),
        "06 schedule": (pipeline.check_schedule_exercise, False),
        "07 1F1B": (pipeline.check_one_f_one_b_exercise, False),
        "08 backward": (checkpointing.check_backward_exercise, False),
        "09 coordinates": (hybrid.check_coordinates, False),
        "09 plan": (planning.check_plan, False),
        "10 rows": (training.check_replica_rows, False),
        "11 merge": (context_parallel.check_merge, False),
        "11 dispatch": (experts.check_dispatch, False),
        "12 best fit": (allocator.check_best_fit, False),
        "12 coalesce": (allocator.check_coalesce, False),
        "12 threshold": (roofline.check_dp_threshold, False),
    }


@pytest.mark.parametrize("name", list(_checks()))
def test_a_wrong_answer_gets_a_hint_not_a_traceback(name, pool2, capsys):
    check, on_ranks = _checks()[name]
    for wrong in WRONG:
        try:
            passed = check(wrong, pool2) if on_ranks else check(wrong)
        except Exception as e:  # noqa: BLE001 - what the test is for
            pytest.fail(f"{name}: {wrong.__name__} crashed the check: {type(e).__name__}: {e}")
        out = capsys.readouterr().out
        assert passed is False, (name, wrong.__name__)
        assert out.strip() and "Traceback" not in out, (name, wrong.__name__, out)
        assert len(out.strip().splitlines()) <= 3, (name, wrong.__name__, out)


def test_tensor_parallels_g_gets_a_hint_for_a_wrong_class(pool2, capsys):
    """Lesson 05's check takes an autograd Function: None, a class that is not one, and one
    whose forward raises."""
    import torch

    from parcourse.experiments.tensor_parallel.lesson import check_g

    class Raises(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, group=None):
            raise ValueError("the learner's own bug")

    for wrong in (None, int, Raises):
        try:
            passed = check_g(wrong, pool2)
        except Exception as e:  # noqa: BLE001
            pytest.fail(f"{wrong}: crashed the check: {type(e).__name__}: {e}")
        out = capsys.readouterr().out
        assert passed is False and out.strip() and "Traceback" not in out, (wrong, out)


def test_a_missing_return_is_named_as_one(capsys):
    """A function that computes its answer and forgets to return it raises nothing: the
    hint says so, instead of blaming a TypeError the learner's code never raised."""
    from parcourse.experiments.data_parallel import check_launch_rule
    from parcourse.experiments.zero import check_unpack

    def launch_rule(ready, buckets, next_bucket, launch):
        while next_bucket < len(buckets) and all(i in ready for i in buckets[next_bucket]):
            launch(next_bucket)
            next_bucket += 1

    for check in (check_launch_rule, check_unpack):
        assert check(_none if check is check_unpack else launch_rule) is False
        out = capsys.readouterr().out
        assert "is a return missing?" in out and "raised" not in out, out


def test_lesson_11s_checks_name_the_mistake_not_its_symptom(capsys):
    """The merge: weights not unsqueezed over head_dim (a broadcasting error, answered with
    the fix), exp(lse) taken alone (overflows only on the large scores, said once), a nan
    on ordinary scores (no overflow blamed); the dispatch: rows per rank as a dict."""
    import torch

    from parcourse.experiments.context_parallel import check_merge
    from parcourse.experiments.experts import check_dispatch, dispatch_plan

    def unsqueeze_forgotten(a, la, b, lb):
        lse = torch.logaddexp(la, lb)
        return a * torch.exp(la - lse) + b * torch.exp(lb - lse), lse

    def exp_alone(a, la, b, lb):
        lse = torch.log(torch.exp(la) + torch.exp(lb))
        wa, wb = torch.exp(la) / torch.exp(lse), torch.exp(lb) / torch.exp(lse)
        return a * wa[..., None] + b * wb[..., None], lse

    def log_of_negative(a, la, b, lb):
        lse = torch.logaddexp(la, lb)
        return a * torch.log(la - lse)[..., None] + b, lse

    def rows_as_dict(c, e, r):
        rows, order = dispatch_plan(c, e, r)
        return dict(enumerate(rows)), order

    for check, wrong, said, not_said in (
        (check_merge, unsqueeze_forgotten, "weight[..., None]", None),
        (check_merge, exp_alone, "overflows", None),
        (check_merge, log_of_negative, "ordinary scores", "overflow fp32"),
        (check_dispatch, rows_as_dict, "not a dict", "got [0, 1]"),
    ):
        assert check(wrong) is False
        out = capsys.readouterr().out
        assert said in out and len(out.strip().splitlines()) == 1, (wrong.__name__, out)
        assert out.count("overflow") <= 1, out
        assert not_said is None or not_said not in out, (wrong.__name__, out)
