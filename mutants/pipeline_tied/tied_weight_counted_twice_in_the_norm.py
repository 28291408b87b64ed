"""clip_grad_norm_ over the pipeline ignores ``tied``: the embedding on the first stage and the head on the last each add the tied weight's (synchronised) gradient to the norm, so it counts twice, the norm is too large and every step is over-clipped (Megatron-LM#7227: sqrt(2) times the norm when the tied weight dominates).
targets: test_the_tied_weight_counts_once_in_the_clipped_norm
"""

import parallelism_conformance.impls.grad_clipping as _bundled
from parallelism_conformance.impls import *


def clip_grad_norm_(module, max_norm, norm_type=2.0, pp_group=None, tied=None):
    return _bundled.clip_grad_norm_(module, max_norm, norm_type, pp_group)
