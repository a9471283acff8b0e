"""Runtime approximate operators (autograd Functions) and pair selectors."""

from fxapprox.ops.conv import sampled_conv2d
from fxapprox.ops.linear import sampled_linear
from fxapprox.ops.sampling import METHODS, register_method, select_pairs

__all__ = ["METHODS", "register_method", "sampled_conv2d", "sampled_linear", "select_pairs"]
