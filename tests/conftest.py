import getpass
import os
import tempfile

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
# Inductor's on-disk cache does not key its C++ kernels by ATEN_CPU_CAPABILITY: a kernel built for avx2
# and reloaded under ATEN_CPU_CAPABILITY=default fails to compile (torch 2.13, seen here). One cache per
# capability keeps the suite runnable under each (docs/testing.md varies it).
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(
    tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}_{os.environ.get('ATEN_CPU_CAPABILITY', 'native')}"))


def pytest_addoption(parser):
    parser.addoption("--margins", metavar="PATH", default=None,
                     help="write every parity bound of the session and the value measured against it "
                          "to PATH (JSON; python -m tests.margins PATH... prints the table)")


def pytest_sessionfinish(session, exitstatus):
    path = session.config.getoption("--margins")
    if path:
        from tests import margins

        margins.write(path)


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
    large = pytest.mark.skip(reason="beyond the suite's time budget: run with PARATRAIN_LARGE=1")
    for item in items:
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(skip)
        if "large" in item.keywords and os.environ.get("PARATRAIN_LARGE") != "1":
            item.add_marker(large)
