"""fairscale's OSS (ZeRO-1) as the contract's ShardedOptimizer with torch's DistributedDataParallel
around the model (``wrap_model``), the pairing fairscale's OSS documentation shows first: DDP
all-reduces every gradient in backward, OSS steps this rank's parameters and broadcasts them."""

from __future__ import annotations

from torch import nn

from parallelism_conformance.adapters.fairscale import _OSSWithSDP, configure

__all__ = ["ShardedOptimizer", "configure"]


class _OSSWithDDP(_OSSWithSDP):
    def wrap_model(self, model: nn.Module) -> nn.Module:
        from torch.nn.parallel import DistributedDataParallel

        # find_unused_parameters: a step may leave parameters unused (the contract's models do), which
        # DDP otherwise refuses at the next step ("Expected to have finished reduction in the prior iteration")
        return DistributedDataParallel(model, find_unused_parameters=True)


def ShardedOptimizer(params, optimizer_class, group=None, **defaults):
    return _OSSWithDDP(params, optimizer_class, group, **defaults)
