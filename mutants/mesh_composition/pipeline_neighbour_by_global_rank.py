"""pipeline_step finds the next and previous stage at its own global rank + and - 1 (the stage offset added to the global rank): right on a pipeline of consecutive ranks, but on a pp x dp x tp mesh, where the next stage is dp tp ranks away, it sends activations along the tensor-parallel dimension.
targets: pp_dp_tp_mesh

On the whole world (test_pipeline_parallel) the pipeline's ranks are 0..p-1 and global rank +- 1 is
the neighbouring stage. With tensor parallelism innermost, global rank + 1 is the next shard of the
same stage.
"""

import torch.distributed as dist

from parallelism_conformance.impls import *
from parallelism_conformance.impls import pipeline_parallel as _bundled
from parallelism_conformance.impls.pipeline_parallel import *


def _global_neighbour(self, stage):
    mine = dist.get_rank(self.group) if self.group is not None else dist.get_rank()
    return dist.get_rank() + (stage % self.p - mine)


_bundled._Peers.global_rank = _global_neighbour
