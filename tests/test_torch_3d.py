"""Our Hybrid and torch's composition of the same GPT (parcourse.experiments.torch_3d, what
benchmarks/hybrid.py --only torch times) both train, and start from the same loss.

On 4 ranks, the two pairs of axes, each with one of torch's dp wrappers, so that every
piece of torch's composition runs: dp x tp (DTensor tensor parallelism, `loss_parallel`,
`replicate`, a pipeline of one stage) and dp x pp (`PipelineStage`, the tied embedding
summed over the first and last stage, `fully_shard`). The step-0 losses come from the
same weights and batch before any update: rel 1e-4 leaves room for fp32 sums in a
different order (split matmuls over tp, microbatches, replicas), about 1e-7 relative.
"""

import math

import pytest

from parcourse import Pool
from parcourse.experiments.torch_3d import compare_steps


@pytest.fixture(scope="module")
def pool4():
    with Pool(4, timeout=120, device="cpu") as pool:
        yield pool


@pytest.mark.parametrize(
    ("shape", "data_parallel"),
    [
        ({"dp": 2, "tp": 2}, "replicate"),
        ({"dp": 2, "pp": 2}, "fsdp"),
    ],
)
def test_ours_and_torchs_composition_time_a_step_from_the_same_loss(pool4, shape, data_parallel):
    results = pool4.run(compare_steps, shape, 1, data_parallel=data_parallel).results
    assert results[0]["error"] is None, results[0]["error"]
    for r in results:
        for name in ("ours", "torch"):
            assert len(r["times"][name]) == 1
            assert all(math.isfinite(t) and t > 0 for t in r["times"][name])
    last_stage = [r["losses"] for r in results if r["losses"]["ours"][0] is not None]
    assert len(last_stage) == 4 // shape.get("pp", 1)  # the last stage's ranks report
    for losses in last_stage:  # before any update, and after one Adam step, which moves
        # the loss by 0.7% (they agree to every printed digit; an update 1% off would not)
        assert len(losses["ours"]) == len(losses["torch"]) == 2
        assert losses["torch"] == pytest.approx(losses["ours"], rel=1e-5)
