import pytest
import torch


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def pytest_collection_modifyitems(config, items):
    """Tests marked ``slow`` run only when asked for with ``-m`` (e.g. ``-m slow``)."""
    if config.getoption("markexpr"):
        return
    skip_slow = pytest.mark.skip(reason="slow: run with `python -m pytest -m slow`")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip_slow)
