"""A gradient hook (Tensor.register_hook, which runs before autograd accumulates into .grad) sets p.grad to the averaged gradient and returns the local one: autograd then adds the local gradient to it, so .grad = mean + local (twice the gradient on one rank); seen in a CS336 assignment-2 submission.
targets: test_gradients_are_the_mean_over_ranks
"""

from torch import nn

from parallelism_conformance.impls import *
from parallelism_conformance.impls.data_parallel import _reduce_


class HookAssignsGrad(nn.Module):
    def __init__(self, module):
        super().__init__()
        self.module = module
        for tensor in [*module.parameters(), *module.buffers()]:
            broadcast(tensor.data, src=0)  # noqa: F405 - the implementation's own broadcast
        seen = set()
        for p in module.parameters():
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                p.register_hook(self._hook_for(p))

    @staticmethod
    def _hook_for(p):
        def hook(grad):
            averaged = grad.detach().clone()
            _reduce_(averaged, None, None)
            p.grad = averaged  # what the optimizer should see ...
            return grad  # ... but autograd now accumulates grad into it as well

        return hook

    def forward(self, *a):
        return self.module(*a)

    def finish_gradient_synchronization(self):
        pass


def DataParallel(module, bucket_size_mb=None):
    return HookAssignsGrad(module)
