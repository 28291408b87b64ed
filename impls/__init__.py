"""The bundled implementations, built only on torch.distributed point-to-point.

Everything here moves data with ``dist.send``/``recv``/``isend``/``irecv``
and nothing else: no torch.distributed collective is called.  This package
starts with the eleven collectives (:mod:`impls.collectives`); later modules
(``data_parallel``, ``tensor_parallel``, ``pipeline_parallel``) will be added
here.  ``impls`` never imports the ``reference`` package.
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
from .tensor_parallel import ColumnParallelLinear, RowParallelLinear, TensorParallelMLP
from .pipeline_parallel import generate_schedule, pipeline_step

__all__ = [
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
]
