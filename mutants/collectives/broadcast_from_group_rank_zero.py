"""broadcast ignores src and always sends group rank 0's tensor.
targets: test_broadcast
"""

from parallelism_conformance import impls
from parallelism_conformance.impls import *


def broadcast(tensor, src=None, group=None, async_op=False, group_src=None):
    return impls.broadcast(tensor, group=group, async_op=async_op, group_src=0)
