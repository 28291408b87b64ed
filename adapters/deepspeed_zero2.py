"""DeepSpeed's ZeRO stage 2 (optimizer state and gradients partitioned, parameters whole) as the
contract's ShardedOptimizer (adapters/deepspeed.py says how)."""

from parallelism_conformance.adapters.deepspeed import configure, sharded_optimizer_of

ShardedOptimizer = sharded_optimizer_of(2, offload=False)
__all__ = ["ShardedOptimizer", "configure"]
