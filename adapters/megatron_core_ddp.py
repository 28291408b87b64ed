"""``DataParallel`` on megatron.core.distributed.DistributedDataParallel, as Megatron's training loop
drives it (megatron/training/training.py: ``zero_grad_buffer`` at the start of a step, the
backward hooks launching each bucket's reduction, ``finish_grad_sync`` before the optimizer, the
optimizer reading ``param.main_grad``); adapters/megatron_core.py re-exports it.

* Built on every rank of the world: ``parallel_state.initialize_model_parallel()`` (tensor and
  pipeline size 1: the data-parallel group is the world) once, then
  ``DistributedDataParallel(config, DistributedDataParallelConfig(overlap_grad_reduce=True,
  bucket_size=...), module)`` and ``broadcast_params()`` (Megatron's ``get_model`` does it where
  ranks may start apart). ``bucket_size_mb`` becomes Megatron's ``bucket_size``, a count of
  elements: MiB * 2^20 / the parameters' itemsize; None keeps Megatron's default (40 M elements).
* Gradients go to ``param.main_grad`` (one contiguous buffer per dtype, split into buckets in
  reverse registration order); each bucket's all-reduce of grad / n starts from the hook of the
  bucket's last gradient (from the second step on: on the first Megatron records the order in which
  gradients arrive and reduces every bucket in ``finish_grad_sync``).
* ``finish_gradient_synchronization()``: ``finish_grad_sync()``, then ``param.grad = param.main_grad``
  (Megatron's FP32Optimizer.prepare_grads), then the bucket groups' readiness counts are reset
  (``bucket_group.reset()``, the half of ``zero_grad_buffer`` that keeps the gradients) so that the
  next backward of the same step launches its buckets again: Megatron itself syncs only the last
  micro-batch of a step (``no_sync`` around the others); the contract synchronises after every
  backward, and averaging what is already the same on every rank leaves it unchanged.
* ``forward`` hands ``.grad`` back (None) before the next backward: Megatron's hooks add
  ``param.grad`` into ``main_grad``, so a ``.grad`` that is ``main_grad`` would be added to itself.
"""

from __future__ import annotations

import torch


def _ddp_class():
    from megatron.core.distributed import DistributedDataParallel

    class _MegatronDataParallel(DistributedDataParallel):
        def on_train_batch_start(self, optimizer) -> None:
            self.zero_grad_buffer()

        def forward(self, *args, **kwargs):
            for p in self.params_with_grad:
                if p.grad is not None and p.grad.data_ptr() == p.main_grad.data_ptr():
                    p.grad = None
            return super().forward(*args, **kwargs)

        def finish_gradient_synchronization(self) -> None:
            self.finish_grad_sync()
            for p in self.params_with_grad:
                p.grad = p.main_grad
            for group in self.bucket_groups + self.expert_parallel_bucket_groups:
                group.reset()

    return _MegatronDataParallel


# The keys the driver drew for this task (``configure``; {} = the adapter's own: overlap_grad_reduce on),
# each "DistributedDataParallelConfig.<field>".
_drawn: dict = {}


def configure(configuration: dict) -> None:
    """The contract's hook for a library's configuration (harness/driver/libraries/table.py's
    megatron-core settings): fields of DistributedDataParallelConfig over the adapter's own. A field
    this version lacks is refused by name."""
    from dataclasses import fields

    from megatron.core.distributed import DistributedDataParallelConfig

    known = {f.name for f in fields(DistributedDataParallelConfig)}
    for key in configuration:
        if key.partition(".")[2] not in known:
            raise NotImplementedError(
                f"megatron-core cannot take the configuration key {key!r}: this version's DistributedDataParallelConfig has no such field"
            )
    _drawn.clear()
    _drawn.update(configuration)


def DataParallel(module, bucket_size_mb=None, gradient_divide_factor=None, compute_dtype=None):
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.transformer import TransformerConfig

    from parallelism_conformance.adapters import megatron_core_refusals as refusals

    if gradient_divide_factor is not None:
        raise NotImplementedError(refusals.DIVIDE_FACTOR)
    if compute_dtype is not None:
        raise NotImplementedError(refusals.COMPUTE_DTYPE)
    if not parallel_state.model_parallel_is_initialized():
        # it makes the global memory buffer itself and refuses one that the layers made before it
        parallel_state._GLOBAL_MEMORY_BUFFER = None
        parallel_state.initialize_model_parallel()
    parameters = [p for p in module.parameters() if p.requires_grad]
    itemsize = parameters[0].element_size() if parameters else 4
    bucket = None if bucket_size_mb is None else max(1, int(bucket_size_mb * 2**20 / itemsize))
    drawn = {key.partition(".")[2]: value for key, value in _drawn.items()}
    if drawn.get("average_in_collective") and torch.distributed.get_backend() == "gloo":
        raise NotImplementedError("megatron-core cannot average in the collective on gloo: gloo has no ReduceOp.AVG (average_in_collective)")
    ddp_config = DistributedDataParallelConfig(**{"overlap_grad_reduce": True, "bucket_size": bucket, **drawn})
    # the model's config as DDP reads it (calculate_per_token_loss and the like); the sizes are unused here
    config = TransformerConfig(
        num_layers=1,
        hidden_size=1,
        num_attention_heads=1,
        use_cpu_initialization=True,
        perform_initialization=False,
        params_dtype=parameters[0].dtype if parameters else torch.float32,
    )
    wrapped = _ddp_class()(config, ddp_config, module)
    wrapped.broadcast_params()  # parameters only: Megatron's DDP broadcasts no buffers
    return wrapped
