"""gather zeroes the caller's input tensor after sending it (an out-of-place collective must not).
targets: test_gather and not scatter
"""

from parallelism_conformance import impls
from parallelism_conformance.impls import *


def gather(tensor, gather_list=None, dst=None, group=None, async_op=False, group_dst=None):
    impls.gather(tensor, gather_list, dst=dst, group=group, group_dst=group_dst)
    if tensor.numel() and (gather_list is None):
        tensor.zero_()
