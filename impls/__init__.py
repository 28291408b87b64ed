"""The bundled implementations, built only on torch.distributed point-to-point.

Everything here moves data with ``dist.send``/``recv``/``isend``/``irecv``
and nothing else: no torch.distributed collective is called.  This package
holds the eleven collectives (:mod:`impls.collectives`) and the strategies
built on them (:mod:`impls.data_parallel`, :mod:`impls.sharded_optimizer`,
:mod:`impls.tensor_parallel`, :mod:`impls.pipeline_parallel`, :mod:`impls.expert_parallel`).  ``impls`` never imports the ``reference`` package.
"""

from . import collectives
from .checkpointing import load_checkpoint, save_checkpoint
from .collectives import *  # noqa: F403 - the eleven, named once: collectives.__all__
from .context_parallel import context_parallel_attention
from .data_parallel import BucketedDataParallel, DataParallel, NaiveDataParallel, OverlappedDataParallel
from .data_sampling import DistributedSampler
from .expert_parallel import ExpertParallelMoE
from .fully_sharded import full_parameters, fully_shard
from .grad_clipping import clip_grad_norm_
from .pipeline_parallel import generate_schedule, pipeline_step, split_stages
from .sharded_init import init_sharded
from .sharded_optimizer import ShardedOptimizer
from .tensor_parallel import ColumnParallelLinear, RowParallelLinear, TensorParallelMLP
from .tied_weights import sync_tied_gradients
from .token_loss import global_token_count
from .transformer_layers import TensorParallelAttention, TensorParallelSwiGLU
from .vocab_parallel import VocabParallelEmbedding, vocab_parallel_cross_entropy

__all__ = [
    *collectives.__all__,  # the eleven, in torch.distributed's order
    # data parallelism
    "DataParallel",
    "NaiveDataParallel",
    "OverlappedDataParallel",
    "BucketedDataParallel",
    "ShardedOptimizer",
    "DistributedSampler",
    "global_token_count",
    # expert parallelism
    "ExpertParallelMoE",
    # fully sharded data parallelism
    "fully_shard",
    "init_sharded",
    "full_parameters",
    # checkpoints that reshard
    "save_checkpoint",
    "load_checkpoint",
    # gradient clipping by the global norm
    "clip_grad_norm_",
    # context parallelism
    "context_parallel_attention",
    # tensor parallelism
    "ColumnParallelLinear",
    "RowParallelLinear",
    "TensorParallelMLP",
    "TensorParallelAttention",
    "TensorParallelSwiGLU",
    "VocabParallelEmbedding",
    "vocab_parallel_cross_entropy",
    # pipeline parallelism
    "pipeline_step",
    "generate_schedule",
    "split_stages",
    "sync_tied_gradients",
]
