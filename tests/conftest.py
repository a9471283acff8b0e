import os

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _timing_cache(tmp_path_factory):
    """Plans' timings go to a cache of this run (``fxapprox.pipeline.timing_cache``), not the user's."""
    previous = os.environ.get("FXAPPROX_CACHE_DIR")
    os.environ["FXAPPROX_CACHE_DIR"] = str(tmp_path_factory.mktemp("timing-cache"))
    yield
    if previous is None:
        os.environ.pop("FXAPPROX_CACHE_DIR", None)
    else:
        os.environ["FXAPPROX_CACHE_DIR"] = previous


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def pytest_collection_modifyitems(config, items):
    """Tests marked ``cuda`` are skipped without a CUDA device; tests marked ``slow`` run only when asked for
    with ``-m`` (e.g. ``-m slow``)."""
    if not torch.cuda.is_available():
        skip_cuda = pytest.mark.skip(reason="needs a CUDA device")
        for item in items:
            if "cuda" in item.keywords:
                item.add_marker(skip_cuda)
    if config.getoption("markexpr"):
        return
    skip_slow = pytest.mark.skip(reason="slow: run with `python -m pytest -m slow`")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip_slow)
