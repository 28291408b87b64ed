"""clip_grad_norm_ accepts pp_group and ignores it: each pipeline rank clips by the norm of its own stages only (torchtitan#596 and #649: clip_grad_norm_ saw only the local pipeline stage).
targets: test_pipeline_stages_clip_by_the_norm_of_every_stage
"""

import parallelism_conformance.impls.grad_clipping as _bundled
from parallelism_conformance.impls import *


def clip_grad_norm_(module, max_norm, norm_type=2.0, pp_group=None):
    return _bundled.clip_grad_norm_(module, max_norm, norm_type)
