"""Under sequence parallelism the replicated router's gradient is all-reduced over the default group (the world) instead of the layer's own group: on a layer that spans the world nothing shows, but with the expert-parallel group one tensor-parallel group of a dp x tp mesh, each replica's router gradient already holds every replica's tokens, and the trainer's data-parallel sum counts them dp times.
targets: test_expert_parallel_on_the_tensor_parallel_group_inside_data_parallel
"""

import parallelism_conformance.impls.expert_parallel as _bundled
from parallelism_conformance.impls import *


class ExpertParallelMoE(_bundled.ExpertParallelMoE):
    def _logits(self, x):
        if not self.sequence_parallel:
            return self.router(x)
        weight = _bundled._SummedGradient.apply(self.router.weight, None, self.reduce)
        return _bundled.F.linear(x, weight, self.router.bias)
