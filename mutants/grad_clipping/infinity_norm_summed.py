"""clip_grad_norm_ combines the ranks' partial infinity norms with a sum, as it does the p-th powers of a p-norm: the infinity norm must take the maximum.
targets: test_the_norm_is_global_and_every_rank_clips_by_it
"""

import math

import torch.distributed as dist

import parallelism_conformance.impls.grad_clipping as _bundled
from parallelism_conformance.impls import *
from parallelism_conformance.impls import collectives

_all_reduce = collectives.all_reduce


def _summing_all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
    return _all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=async_op)


_bundled.collectives = type("Collectives", (), {"all_reduce": staticmethod(_summing_all_reduce)})
_bundled.math = math
