"""Device meshes: n = dp x tp ranks laid out as a grid, the tensor-parallel axis innermost, so rank
r = d tp + t sits at data-parallel index d and tensor-parallel index t (Megatron-LM's order: the
lecture's rule that the most frequent communication, TP's, stays among neighbouring ranks, which
share the fastest links). Each row {d tp + t : t} is a tensor-parallel group holding one model
replica in tp shards; each column {d tp + t : d} is a data-parallel group of the ranks holding the
same shard, which average (or sum) its gradient.

With a loss summed over the global batch X = [X_0; ...; X_{dp-1}] (replica d gets rows X_d), the
gradient of a shard is the shard of the dense gradient: dL/dW = sum_d dL_d/dW, so after TP's own
communication and a sum over the data-parallel group every rank holds its shard of the gradient
one process computes on the whole batch (reference.tensor_parallel gives that gradient and its
tolerance). Never imports torch.distributed.
"""
from __future__ import annotations


def coordinates(rank: int, dp: int, tp: int) -> tuple[int, int]:
    """(d, t) of ``rank`` on a dp x tp mesh."""
    if not 0 <= rank < dp * tp:
        raise ValueError(f"rank {rank} is not on a {dp} x {tp} mesh")
    return divmod(rank, tp)


def tensor_parallel_groups(dp: int, tp: int) -> list[list[int]]:
    """The rows of the mesh: [[d tp + t for t in range(tp)] for d in range(dp)]."""
    return [[d * tp + t for t in range(tp)] for d in range(dp)]


def data_parallel_groups(dp: int, tp: int) -> list[list[int]]:
    """The columns of the mesh: [[d tp + t for d in range(dp)] for t in range(tp)]."""
    return [[d * tp + t for d in range(dp)] for t in range(tp)]


def pipeline_mesh(pp: int, dp: int) -> tuple[list[list[int]], list[list[int]]]:
    """A pp x dp mesh for data parallelism over pipelines, the pipeline axis outermost (it crosses
    the slowest links: one activation per microbatch and boundary; the lecture's rule): rank
    s dp + d holds stage s of replica d. Returns (pipeline groups, one per replica d:
    [s dp + d for s in range(pp)], in stage order; data-parallel groups, one per stage s:
    [s dp + d for d in range(dp)]). A pipeline group's members are not consecutive ranks when dp > 1,
    so a stage placed by global rank instead of group rank shows."""
    return ([[s * dp + d for s in range(pp)] for d in range(dp)], [[s * dp + d for d in range(dp)] for s in range(pp)])
