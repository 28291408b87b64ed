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


AXES = ("pp", "dp", "tp")  # outermost first


class Mesh:
    """A pp x dp x tp mesh (Megatron-LM's order, Narayanan et al. 2021, sec. 3.3: tensor parallelism
    innermost, on the fastest links; the pipeline outermost, across the slowest): rank
    r = (s dp + d) tp + t holds tensor-parallel shard t of pipeline stage s of replica d.

    * a tensor-parallel group {(s, d, t) : t} holds one stage of one replica in tp shards;
    * a pipeline group {(s, d, t) : s} (in stage order) carries shard t of replica d's activations
      from stage to stage: each shard's pipeline runs on its own group, the tp pipelines of a replica
      side by side (every stage output is whole on every tensor-parallel rank, after g);
    * a data-parallel group {(s, d, t) : d} holds the same shard of the same stage, and averages its
      gradient (each replica's loss is a mean over its microbatches; the mean over dp replicas of
      those is the mean over the global batch's dp m microbatches).

    With tp = 1 it is ``pipeline_mesh``'s pp x dp layout; with pp = 1 the dp x tp mesh above."""

    def __init__(self, pp: int, dp: int, tp: int):
        if min(pp, dp, tp) < 1:
            raise ValueError(f"a mesh needs every dimension at least 1, got pp={pp}, dp={dp}, tp={tp}")
        self.pp, self.dp, self.tp = pp, dp, tp

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.tp

    def rank(self, s: int, d: int, t: int) -> int:
        return (s * self.dp + d) * self.tp + t

    def coordinates(self, rank: int) -> tuple[int, int, int]:
        """(s, d, t) of ``rank``."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is not on a {self}")
        rest, t = divmod(rank, self.tp)
        s, d = divmod(rest, self.dp)
        return s, d, t

    def groups(self, axis: str) -> list[list[int]]:
        """Every group along ``axis`` ("pp", "dp" or "tp"), each in the order of that coordinate."""
        if axis not in AXES:
            raise ValueError(f"no mesh axis {axis!r} (axes: {', '.join(AXES)})")
        position = AXES.index(axis)
        groups: dict[tuple[int, ...], list[int]] = {}
        for rank in range(self.world_size):  # a group: the ranks whose other two coordinates agree
            coordinates = self.coordinates(rank)
            groups.setdefault(coordinates[:position] + coordinates[position + 1 :], []).append(rank)
        return list(groups.values())

    def group_of(self, axis: str, rank: int) -> list[int]:
        return next(g for g in self.groups(axis) if rank in g)

    def __str__(self) -> str:
        return f"pp={self.pp} x dp={self.dp} x tp={self.tp} mesh"
