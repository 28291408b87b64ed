"""After backward the layer itself all-reduces its experts' gradients over the world, where only the expert-parallel group's tokens belong to them: with data parallelism around it, the trainer's reduction over the replicas counts every token again, dp times too large (pytorch#160285: expert gradients 2x at EP = 2 with identical loss curves).
targets: expert_parallel_inside
"""

from parallelism_conformance.impls import *
from parallelism_conformance.impls import collectives, expert_parallel


class ExpertParallelMoE(expert_parallel.ExpertParallelMoE):
    def forward(self, x):
        y = super().forward(x)
        for expert in self.experts:
            for parameter in expert.parameters():
                parameter.register_hook(_summed_over_the_world)
        return y


def _summed_over_the_world(grad):
    total = grad.detach().clone().contiguous()
    collectives.all_reduce(total)
    return total
