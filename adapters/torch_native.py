"""torch's own implementations, through the suite's contract: one module that passes every
capability (``--impl parallelism_conformance.adapters.torch_native``).

* the eleven collectives: torch.distributed's, as they are;
* ``DataParallel``: torch.nn.parallel.DistributedDataParallel (adapters/torch_ddp.py);
* ``global_token_count``: torch.distributed.all_reduce of the count (adapters/torch_token_loss.py);
* ``ShardedOptimizer``: torch.distributed.optim.ZeroRedundancyOptimizer (adapters/torch_zero.py);
* ``save_checkpoint``, ``load_checkpoint``: torch.distributed.checkpoint (adapters/torch_checkpoint.py);
* ``ExpertParallelMoE``: the bundled routing over torch.distributed.all_to_all_single
  (adapters/torch_moe.py; torch has no MoE layer);
* ``ColumnParallelLinear``, ``RowParallelLinear``, ``TensorParallelMLP``: DTensor's
  parallelize_module (adapters/dtensor_tp.py);
* ``pipeline_step``, ``generate_schedule``: torch.distributed.pipelining (adapters/torch_pipelining.py);
* ``context_parallel_attention``: not adapted; it raises why (adapters/torch_context_parallel.py).
"""

from torch.distributed import (  # noqa: F401 - re-exported: the contract's collectives
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

from parallelism_conformance.adapters.dtensor_block import TensorParallelAttention, TensorParallelSwiGLU  # noqa: F401 - re-exported: the contract's names
from parallelism_conformance.adapters.dtensor_tp import ColumnParallelLinear, RowParallelLinear, TensorParallelMLP  # noqa: F401 - re-exported: the contract's names
from parallelism_conformance.adapters.torch_checkpoint import load_checkpoint, save_checkpoint  # noqa: F401 - re-exported: the contract's names
from parallelism_conformance.adapters.torch_context_parallel import context_parallel_attention  # noqa: F401 - raises: not adapted, why
from parallelism_conformance.adapters.torch_ddp import DataParallel  # noqa: F401 - re-exported: the contract's names
from parallelism_conformance.adapters.torch_fsdp import full_parameters, fully_shard, init_sharded  # noqa: F401 - re-exported: the contract's names
from parallelism_conformance.adapters.torch_grad_clipping import clip_grad_norm_  # noqa: F401 - re-exported: the contract's names
from parallelism_conformance.adapters.torch_moe import ExpertParallelMoE  # noqa: F401 - re-exported: the contract's names
from parallelism_conformance.adapters.torch_pipelining import generate_schedule, pipeline_step, split_stages  # noqa: F401 - re-exported: the contract's names
from parallelism_conformance.adapters.torch_sampler import DistributedSampler  # noqa: F401 - re-exported: the contract's names
from parallelism_conformance.adapters.torch_tied_weights import sync_tied_gradients  # noqa: F401 - re-exported: the contract's names
from parallelism_conformance.adapters.torch_token_loss import global_token_count  # noqa: F401 - re-exported: the contract's names
from parallelism_conformance.adapters.torch_vocab_parallel import VocabParallelEmbedding, vocab_parallel_cross_entropy  # noqa: F401 - re-exported: the contract's names
from parallelism_conformance.adapters.torch_zero import ShardedOptimizer  # noqa: F401 - re-exported: the contract's names
