"""The bundled implementations, built only on torch.distributed point-to-point.

Everything here moves data with ``dist.send``/``recv``/``isend``/``irecv``
and nothing else: no torch.distributed collective is called.  This package
holds the eleven collectives (:mod:`impls.collectives`) and the strategies
built on them (:mod:`impls.data_parallel`, :mod:`impls.sharded_optimizer`,
:mod:`impls.tensor_parallel`, :mod:`impls.pipeline_parallel`, :mod:`impls.expert_parallel`).  ``impls`` never imports the ``reference`` package.
"""

from .collectives import (
    all_gather,
    all_gather_into_tensor,
    all_reduce,
    all_to_all,
    all_to_all_single,
    broadcast,
    gather,
    reduce,
    reduce_scatter,
    reduce_scatter_tensor,
    scatter,
)
from .context_parallel import context_parallel_attention
from .data_parallel import BucketedDataParallel, DataParallel, NaiveDataParallel, OverlappedDataParallel
from .expert_parallel import ExpertParallelMoE
from .fully_sharded import full_parameters, fully_shard
from .pipeline_parallel import generate_schedule, pipeline_step
from .sharded_optimizer import ShardedOptimizer
from .tensor_parallel import ColumnParallelLinear, RowParallelLinear, TensorParallelMLP

__all__ = [
    # collectives
    "broadcast",
    "reduce",
    "all_reduce",
    "scatter",
    "gather",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all",
    "all_to_all_single",
    # data parallelism
    "DataParallel",
    "NaiveDataParallel",
    "OverlappedDataParallel",
    "BucketedDataParallel",
    "ShardedOptimizer",
    # expert parallelism
    "ExpertParallelMoE",
    # fully sharded data parallelism
    "fully_shard",
    "full_parameters",
    # context parallelism
    "context_parallel_attention",
    # tensor parallelism
    "ColumnParallelLinear",
    "RowParallelLinear",
    "TensorParallelMLP",
    # pipeline parallelism
    "pipeline_step",
    "generate_schedule",
]
