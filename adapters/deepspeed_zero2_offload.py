"""DeepSpeed's ZeRO stage 2 with ``offload_optimizer: {device: cpu}`` (ZeRO-Offload) as the
contract's ShardedOptimizer (adapters/deepspeed.py says how)."""

from parallelism_conformance.adapters.deepspeed import configure, sharded_optimizer_of

ShardedOptimizer = sharded_optimizer_of(2, offload=True)
__all__ = ["ShardedOptimizer", "configure"]
