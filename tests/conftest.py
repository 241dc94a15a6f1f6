import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def pools():
    """pools(n) -> a live RankPool of n gloo ranks, shared by the tests of the session."""
    from tests.pool import Pools

    manager = Pools()
    yield manager
    manager.close()


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_gpu = torch.cuda.is_available()
    except ImportError:  # pragma: no cover
        has_gpu = False
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU")
    for item in items:
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(skip)
