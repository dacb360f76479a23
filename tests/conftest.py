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
