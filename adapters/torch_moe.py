"""ExpertParallelMoE on torch.distributed's own all_to_all_single.

torch has no mixture-of-experts layer of its own; this adapter is the bundled layer
(impls/expert_parallel.py: top-1 routing, sort by expert, counts exchange, two token all-to-alls
with unequal splits, backward through the same exchanges transposed) with every exchange made by
the backend's all_to_all_single (and the load-balancing counts by its all_reduce) instead of the bundled
point-to-point ones, so the backend's
collective is what is exercised with unequal and empty splits.
"""

from __future__ import annotations

import torch.distributed as dist

from parallelism_conformance.impls.expert_parallel import ExpertParallelMoE as _Bundled


class ExpertParallelMoE(_Bundled):
    exchange = staticmethod(dist.all_to_all_single)
    reduce = staticmethod(dist.all_reduce)
