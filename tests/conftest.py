import os

import matplotlib
import pytest

matplotlib.use("Agg")
os.environ.setdefault("MPLBACKEND", "Agg")


@pytest.fixture(scope="module")
def pool2():
    from parcourse import Pool

    with Pool(2, timeout=30) as pool:
        yield pool


@pytest.fixture(scope="module")
def pool4():
    from parcourse import Pool

    with Pool(4, timeout=30) as pool:
        yield pool


@pytest.fixture(scope="module")
def pools():
    """Pools of 2 and 4 ranks, for tests that run at both world sizes."""
    from parcourse import Pool

    made = {n: Pool(n, timeout=60) for n in (2, 4)}
    yield made
    for pool in made.values():
        pool.close()
