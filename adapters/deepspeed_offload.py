"""DeepSpeed's ZeRO stages 1 and 3 with ``offload_optimizer: {device: cpu}``: the optimizer state
and its step on the CPU, as the contract's ShardedOptimizer and fully_shard (adapters/deepspeed.py
says how)."""

from parallelism_conformance.adapters.deepspeed import configure, full_parameters, fully_shard_of, sharded_optimizer_of

ShardedOptimizer = sharded_optimizer_of(1, offload=True)
fully_shard = fully_shard_of(offload=True)
__all__ = ["ShardedOptimizer", "configure", "full_parameters", "fully_shard"]
