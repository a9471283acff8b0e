"""Runtime approximate operators (autograd Functions) and pair selectors."""

from fxapprox.ops.conv import backward_sampled_conv2d, sampled_conv2d
from fxapprox.ops.linear import backward_sampled_linear, sampled_linear
from fxapprox.ops.sampling import METHODS, register_method, select_pairs

__all__ = ["METHODS", "backward_sampled_conv2d", "backward_sampled_linear", "register_method",
           "sampled_conv2d", "sampled_linear", "select_pairs"]
