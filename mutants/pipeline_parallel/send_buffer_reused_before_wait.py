"""A stage sends every activation and gradient of one shape from one buffer it reuses: the next microbatch overwrites it while the last send may still be in flight.
targets: dense_model
race: killed by --perturb-timing, naming the call; without it by values only when gloo's timing shows it (docs/measured.md)

The bundled stage sends each tensor itself and waits for every send at the end of the step. This
one copies what it sends into a buffer kept per (shape, dtype) to save allocations, and isends the
buffer; it still waits at the end of the step, but the copy of the next microbatch lands in the
buffer before that. gloo reads a send's buffer until the send completes, so it too sends the next
microbatch's data now and then (5 of 5 runs without --perturb-timing failed, on values that name
no call); --perturb-timing compares each send's buffer at its wait with what it held at the call.
"""

import torch
import torch.distributed as dist

from mutants._swap import swapped
from parallelism_conformance.impls import *  # noqa: F403
from parallelism_conformance.impls import pipeline_parallel as _bundled
from parallelism_conformance.impls.pipeline_parallel import *  # noqa: F403

_BUNDLED_SEND = _bundled._Peers.send


def _send_from_a_reused_buffer(self, tensor, to_stage, tag):
    if not tensor.is_floating_point():  # the shape headers go as the bundled stage sends them
        return _BUNDLED_SEND(self, tensor, to_stage, tag)
    buffers = self.__dict__.setdefault("reused", {})
    key = (tuple(tensor.shape), tensor.dtype, tensor.device)
    buffer = buffers.get(key)
    if buffer is None:
        buffer = buffers[key] = torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor.device)
    buffer.copy_(tensor.detach())  # the bug: the previous send from this buffer may not have left
    self.pending.append((dist.isend(buffer, self.global_rank(to_stage), group=self.group, tag=tag), buffer))


def pipeline_step(*args, **kwargs):
    with swapped(_bundled._Peers, send=_send_from_a_reused_buffer):
        return _bundled.pipeline_step(*args, **kwargs)
