"""The guard's passes: the plan checked on the example batch before training (``check_plan``) and made again
from measured errors during training (``replan``). The guard that measures is ``fxapprox.runtime.guard``."""
