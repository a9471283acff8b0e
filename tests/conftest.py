import pytest
import torch


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
