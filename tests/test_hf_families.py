"""Every Hugging Face transformers family (transformers 5, hierarchical capture), one tiny model each.

Runs ``benchmarks/zoo_coverage_hf.check_family``: build from a tiny config with random weights, approximate at
budget 0.5 (FLOP-ranked policy), then eval outputs equal the original's (atol 1e-4), one train step has finite
gradients, the plan's exact FLOPs equal a counted exact step (within 1%) and some layer is sampled. A family that
cannot be built or run on CPU here is skipped. Three fast families run by default; the whole list (every entry
of the causal-LM auto mapping and a few encoder / vision / seq2seq families) is marked ``slow``:
``python -m pytest -m slow tests/test_hf_families.py``. ``benchmarks/zoo_coverage_hf.py`` prints the table.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")
if int(transformers.__version__.split(".")[0]) < 5:
    pytest.skip(f"needs transformers >= 5 (found {transformers.__version__})", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from zoo_coverage_hf import FAST, check_family, families  # noqa: E402

ALL = tuple(families())


def _run(family: str) -> None:
    transformers.logging.set_verbosity_error()
    result = check_family(family)
    if result["status"] == "skipped":
        pytest.skip(f"{family}: {result['reason']}")
    assert result["status"] == "pass", f"{family}: {result['reason']}\n{result['traceback'] or ''}"


@pytest.mark.parametrize("family", FAST)
def test_fast_family(family):
    _run(family)


@pytest.mark.slow
@pytest.mark.parametrize("family", ALL)
def test_every_family(family):
    _run(family)
