"""all_to_all (list form) stores the piece from rank i in slot (n - 1 - i) of the output list.
targets: test_all_to_all and not single
"""

import torch.distributed as dist

from parallelism_conformance import impls
from parallelism_conformance.impls import *


def all_to_all(output_tensor_list, input_tensor_list, group=None, async_op=False):
    received = [t.clone() for t in output_tensor_list]
    impls.all_to_all(received, input_tensor_list, group=group)
    n = len(received)
    for i, out in enumerate(output_tensor_list):
        if out.shape == received[n - 1 - i].shape:
            out.copy_(received[n - 1 - i])
