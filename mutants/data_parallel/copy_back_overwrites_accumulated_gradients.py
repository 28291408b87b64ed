"""The averaged gradient is copied over .grad instead of added: under gradient accumulation only the last micro-batch survives.
targets: test_gradient_accumulation_and_both_zero_grad_modes

A pattern of bucketed student DDPs (issue 14): a hook packs each incoming gradient into a buffer,
finish_gradient_synchronization all-reduces the buffer and writes it back with ``grad.copy_``.
Right when every step has one backward (.grad held exactly that gradient); with several backward
passes per optimizer step, each copy-back replaces what the earlier micro-batches accumulated.
"""

import torch
import torch.distributed as dist

from parallelism_conformance.impls import *
from parallelism_conformance.impls.collectives import all_reduce, broadcast


class CopyBackDataParallel(torch.nn.Module):
    def __init__(self, module):
        super().__init__()
        self.module = module
        with torch.no_grad():
            for tensor in [*module.parameters(), *module.buffers()]:
                broadcast(tensor.detach(), src=0)
        self._incoming = []
        for param in module.parameters():
            if param.requires_grad:
                param.register_hook(lambda grad, param=param: self._incoming.append((param, grad.detach().clone())))

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def finish_gradient_synchronization(self):
        for param, grad in self._incoming:
            all_reduce(grad, op=dist.ReduceOp.AVG)
            param.grad.copy_(grad)  # the bug: replaces the accumulated gradient
        self._incoming.clear()


def DataParallel(module, bucket_size_mb=None):
    return CopyBackDataParallel(module)
