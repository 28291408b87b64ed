"""The pipeline sends every activation upcast to float64 ("no precision lost between stages") and casts it back on arrival: right values, twice the bytes of a float32 activation on the links between stages.
targets: test_mesh_traffic_on_hosts

The round trip float32 -> float64 -> float32 is exact, so no value test can see it; on a mesh laid
over hosts the pipeline's messages are the ones that cross the slow links.
"""

import torch

from parallelism_conformance.impls import *
from parallelism_conformance.impls import pipeline_parallel as _bundled
from parallelism_conformance.impls.pipeline_parallel import *


def _send_activation(self, y, stage, microbatch):
    header = torch.zeros(2 + _bundled._MAX_DIMS, dtype=torch.int64)
    header[0], header[1] = _bundled._DTYPES.index(y.dtype), y.dim()
    header[2 : 2 + y.dim()] = torch.tensor(y.shape, dtype=torch.int64)
    self.send(header.to(y.device), stage + 1, self.tag(stage, microbatch, False, header=True))
    self.send(y.to(torch.float64), stage + 1, self.tag(stage, microbatch, False))


def _recv_activation(self, stage, microbatch, device):
    header = self.recv(
        torch.empty(2 + _bundled._MAX_DIMS, dtype=torch.int64, device=device), stage - 1, self.tag(stage - 1, microbatch, False, header=True)
    ).cpu()
    shape = tuple(int(d) for d in header[2 : 2 + int(header[1])])
    wide = self.recv(torch.empty(shape, dtype=torch.float64, device=device), stage - 1, self.tag(stage - 1, microbatch, False))
    return wide.to(_bundled._DTYPES[int(header[0])])


_bundled._Peers.send_activation = _send_activation
_bundled._Peers.recv_activation = _recv_activation
