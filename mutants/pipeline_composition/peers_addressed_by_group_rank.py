"""pipeline_step sends to and receives from the group rank of the peer stage as if it were a global rank: right on the whole world and on pipelines of the first ranks, wrong on any other pipeline group.
targets: data_parallel_pipelines

The classic mix-up of torch.distributed's two rank spaces: dist.send(tensor, dst=stage) where dst
must be dist.get_global_rank(group, stage). A pipeline test on the whole world cannot see it; on a
pp x dp mesh, replica d's pipeline is ranks d, dp + d, ..., and its messages go to replica 0's.
"""

from parallelism_conformance.impls import *
from parallelism_conformance.impls import pipeline_parallel as _bundled
from parallelism_conformance.impls.pipeline_parallel import *

_bundled._Peers.global_rank = lambda self, stage: stage % self.p
