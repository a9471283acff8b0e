"""fxapprox: a torch.fx compiler that makes training steps cheaper with approximate tensor ops.

Example::

    >>> import torch, torchvision, fxapprox
    >>> approx = fxapprox.approximate(torchvision.models.resnet18(), budget=0.5)
    >>> loss = approx(torch.randn(8, 3, 64, 64)).sum(); loss.backward()   # planned on this batch
    >>> approx.report.show()
    >>> fxapprox.export(approx, "out/resnet18")
"""

from fxapprox import distributed
from fxapprox.api import ApproxGraphModule, analyse, approximate
from fxapprox.bench import BenchResult, LayerFidelity, bench
from fxapprox.config import ApproxConfig, LayerOverride
from fxapprox.errors import AnalysisError, FxApproxError, PlanNotReadyError, TraceError
from fxapprox.export import export
from fxapprox.plan import LayerDecision, Plan
from fxapprox.report import Report
from fxapprox.calibration import recalibrate_bn
from fxapprox.runtime.host_sync import count_host_syncs
from fxapprox.runtime.saved_activations import SavedActivationStats
from fxapprox.runtime.saved_tensors import count_saved_bytes
from fxapprox.schedule import SparseThenDense

__version__ = "0.1.0"

__all__ = [
    "AnalysisError", "ApproxConfig", "ApproxGraphModule", "BenchResult", "FxApproxError", "LayerDecision",
    "LayerFidelity", "LayerOverride", "Plan", "PlanNotReadyError", "Report", "SavedActivationStats",
    "SparseThenDense", "TraceError", "analyse", "approximate", "bench", "count_host_syncs", "count_saved_bytes",
    "distributed",
    "export", "recalibrate_bn",
]
