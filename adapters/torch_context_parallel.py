"""torch's context parallelism behind the suite's contract: not adapted, and said so.

``torch.distributed.tensor.experimental.context_parallel`` is a context manager that shards whole
Q/K/V buffers along the sequence itself (its own load balancing) and replaces
``F.scaled_dot_product_attention`` with a ring over the CUDA flash / memory-efficient kernels. The
contract hands each rank its own rows already laid out, on any device. On CPU ranks torch's cannot
run at all; on CUDA an adapter would gather the rows, let torch shard them again and map its layout
onto the contract's, which no CUDA machine has verified here. So ``context_parallel_attention``
raises NotImplementedError naming the reason, and the conformance suite skips the project's own
adapters' tests with it (conformance/verdict.py, ``run_or_skip``): "not tested", never "pass".
"""

from __future__ import annotations


def context_parallel_attention(q, k, v, seq_len, causal=False, group=None):
    where = (
        "on CPU ranks (it dispatches the CUDA flash / memory-efficient SDPA kernels only)"
        if q.device.type != "cuda"
        else "through this adapter yet (mapping its own sharding onto the contract's layout is unverified on CUDA)"
    )
    raise NotImplementedError(f"torch.distributed.tensor.experimental.context_parallel cannot run {where}")
