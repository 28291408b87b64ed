"""A fully sharded unit recomputes its forward in backward without restoring the random state: the recomputed dropout masks are new ones, so the gradient is of another forward than the loss (allenai/OLMo-core#828).
targets: dropout
"""

import functools

from torch.utils.checkpoint import checkpoint

from parallelism_conformance.impls import *
from parallelism_conformance.impls import fully_sharded

fully_sharded.checkpoint = functools.partial(checkpoint, preserve_rng_state=False)
