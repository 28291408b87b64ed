"""Under sequence parallelism the router, replicated over the tensor-parallel group, keeps the gradient of this member's sequence shard only: nothing all-reduces it, so after the first optimizer step the members' routers differ (torchtitan#2387: MoE router weights diverged across TP ranks; #4054: TP without EP skipped an all-reduce, "loss curves look normal").
targets: test_a_router_replicated_over_a_sequence_parallel_group_gets_the_whole_gradient
"""

import parallelism_conformance.impls.expert_parallel as _bundled
from parallelism_conformance.impls import *


class ExpertParallelMoE(_bundled.ExpertParallelMoE):
    def _logits(self, x):
        return self.router(x)
