"""Configuration: small frozen dataclasses, validated on construction (:class:`ApproxConfig` in
``approx_config.py``, its fields' checks in ``validation.py``; :class:`LayerOverride` pins layers by name)."""

from fxapprox.config.approx_config import AUTO_METHODS, ApproxConfig
from fxapprox.config.validation import ACTIVATION_BITS, POLICIES
from fxapprox.pipeline.overrides import LayerOverride

__all__ = ["ACTIVATION_BITS", "AUTO_METHODS", "POLICIES", "ApproxConfig", "LayerOverride"]
