"""global_token_count averages the ranks' counts instead of summing them (an all-reduce with AVG, the DP habit): the loss is divided by C / n, every gradient n times too large.
targets: test_fully_sharded_gradients_are_the_mean_over_every_valid_token
"""

import torch
import torch.distributed as dist

from parallelism_conformance.impls import *
from parallelism_conformance.impls import collectives


def global_token_count(local_count, group=None):
    count = torch.tensor([float(local_count)], dtype=torch.float64)
    collectives.all_reduce(count, op=dist.ReduceOp.AVG, group=group)
    return float(count.item())
