"""megatron-core (NVIDIA's Megatron-LM as a library) through the suite's contract, as its users
call it: ``--impl parallelism_conformance.adapters.megatron_core`` in a venv that has megatron-core (``scripts/libraries
megatron-core``; docs/libraries.md has the verdicts and every shim).

* ``ColumnParallelLinear``, ``RowParallelLinear``: megatron.core.tensor_parallel's layers, built
  with ``ModelParallelConfig(use_cpu_initialization=True, perform_initialization=False)`` on the
  caller's group (``tp_group=``), the dense weights copied into their shards. Megatron's layers take
  [sequence, batch, hidden] and return (output, bias); the adapter reshapes to three dims and
  returns the output (``skip_bias_add=False``: the layer adds its bias).
* ``TensorParallelMLP``: megatron.core.transformer.mlp.MLP (linear_fc1 column parallel, exact GELU,
  linear_fc2 row parallel, ``skip_bias_add=True`` on fc2: its bias is returned and added by the
  caller, as Megatron's bias-dropout-add does). With ``sequence_parallel=True`` the config's
  ``sequence_parallel`` is set: fc1 all-gathers the sequence shards (backward reduce-scatter) and
  fc2 reduce-scatters (backward all-gather). Parameters that meet only a sequence shard (fc2's bias,
  the norm's weight and bias) carry Megatron's ``sequence_parallel`` attribute, and their gradients
  are summed over the group by ``finalize_model_grads``'s ``_allreduce_non_tensor_model_parallel_grads``,
  which Megatron's schedules call after every backward: the module's
  ``finish_gradient_synchronization()`` calls it (the rank program calls that hook after backward
  where a module has one).
* ``norm`` (capability tp_norm): Megatron's torch-norm spec (``WrappedTorchNorm``) is
  ``torch.nn.LayerNorm`` but refuses sequence parallelism, and its fused norms need Apex or
  Transformer Engine (CUDA). The adapter uses torch.nn.LayerNorm with the attribute Megatron's
  ``FusedLayerNorm`` sets (``sequence_parallel`` on weight and bias), so the same finalize sums them.
* ``VocabParallelEmbedding``: megatron.core.tensor_parallel.VocabParallelEmbedding on the table
  padded with zero rows to n ceil(V / n) (Megatron's padded vocabulary; it requires V divisible by n).
* ``vocab_parallel_cross_entropy``: megatron.core.tensor_parallel.vocab_parallel_cross_entropy on
  the logits with the padding columns (>= V) masked to -inf (Megatron trains its padded rows; the
  contract's loss is over the real vocabulary). It reads its group from parallel_state.
* ``DataParallel``: megatron.core.distributed.DistributedDataParallel with
  ``overlap_grad_reduce=True`` and ``bucket_size`` the contract's MiB in elements (its
  ``bucket_size`` counts parameters' elements), gradients accumulated in its ``main_grad`` buffers
  and averaged over the data-parallel group (``average_in_collective``'s default: scaled by 1/n,
  then summed). The loop's hooks: ``on_train_batch_start`` is Megatron's ``zero_grad_buffer()``
  (its training loop calls it at the start of every step), ``finish_gradient_synchronization`` is
  ``finish_grad_sync()`` followed by what Megatron's FP32 optimizer does before stepping
  (``param.grad = param.main_grad``); the wrapper's forward hands the buffer back before the next
  backward (``.grad`` None, as Megatron's hooks expect it).

Refused, on every rank, with the library's reason (megatron_core_refusals.py has the texts):
``ShardedOptimizer`` (Megatron's ZeRO-1 is its DistributedOptimizer), TP dropout (its CUDA RNG
tracker), a compute dtype (Float16Module), ``pipeline_step`` (its schedules name the device "cuda").

Shims for CPU ranks (``_cpu_shims``): ``torch.cuda.current_device()`` answers the CPU device (the
global memory buffer of sequence parallelism and the gradient buffers of DDP allocate on it);
parallel_state's global memory buffer is made as ``initialize_model_parallel`` makes it.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from parallelism_conformance.adapters import megatron_core_refusals as refusals
from parallelism_conformance.adapters.megatron_core_ddp import DataParallel, configure  # noqa: F401 - re-exported: the contract's names

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "TensorParallelMLP",
    "VocabParallelEmbedding",
    "vocab_parallel_cross_entropy",
    "DataParallel",
    "ShardedOptimizer",
    "pipeline_step",
]


def _cpu_shims() -> None:
    """What Megatron asks of a GPU that a CPU rank can answer (docs/libraries.md lists each)."""
    if not torch.cuda.is_available():
        # megatron/core/tensor_parallel/layers.py and distributed/param_and_grad_buffer.py allocate
        # with device=torch.cuda.current_device(); the CPU device is the one this rank computes on
        torch.cuda.current_device = lambda: torch.device("cpu")


_cpu_shims()


def _memory_buffer() -> None:
    """parallel_state's global memory buffer (sequence parallelism gathers into it), made as
    initialize_model_parallel makes it; the layers take their group as ``tp_group``, so nothing else of
    parallel_state is needed for them."""
    from megatron.core import parallel_state

    if parallel_state._GLOBAL_MEMORY_BUFFER is None:
        parallel_state._set_global_memory_buffer()


def _group(group):
    return dist.group.WORLD if group is None else group


def _config(dtype: torch.dtype, n: int, sequence_parallel: bool = False, **transformer):
    """Megatron's config for layers built on the CPU from given weights: no initialisation (the dense
    weights are copied in), sequence parallelism only where the group has more than one member (Megatron
    refuses it without tensor parallelism)."""
    from megatron.core import ModelParallelConfig
    from megatron.core.transformer import TransformerConfig

    common = {
        "use_cpu_initialization": True,
        "perform_initialization": False,
        "params_dtype": dtype,
        "tensor_model_parallel_size": n,
        "sequence_parallel": sequence_parallel and n > 1,
    }
    if not transformer:
        return ModelParallelConfig(**common)
    return TransformerConfig(num_layers=1, num_attention_heads=n, **common, **transformer)


def _check_divisible(dimension: str, size: int, n: int) -> None:
    if size % n:
        raise ValueError(f"{dimension} = {size} is not divisible by the group size {n} ({size} % {n} = {size % n})")


def _copy_into(parameter: torch.Tensor | None, value: torch.Tensor | None) -> None:
    if parameter is not None:
        with torch.no_grad():
            parameter.copy_(value)


class _Layer(nn.Module):
    """A Megatron linear layer on inputs of any leading dims: flattened to [rows, 1, features] (Megatron's
    [sequence, batch, hidden]), its output restored; Megatron returns (output, bias) and adds its bias
    itself here."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer

    @property
    def weight(self):
        return self.layer.weight

    @property
    def bias(self):
        return self.layer.bias

    def forward(self, x):
        y, _ = self.layer(x.reshape(-1, 1, x.shape[-1]))
        return y.reshape(*x.shape[:-1], y.shape[-1])


class ColumnParallelLinear:
    @staticmethod
    def from_dense(linear: nn.Linear, group=None, gather_output: bool = False) -> nn.Module:
        from megatron.core import tensor_parallel

        _memory_buffer()
        group = _group(group)
        n, r = group.size(), group.rank()
        _check_divisible("out_features", linear.out_features, n)
        layer = tensor_parallel.ColumnParallelLinear(
            linear.in_features,
            linear.out_features,
            config=_config(linear.weight.dtype, n),
            init_method=lambda w: None,
            bias=linear.bias is not None,
            gather_output=gather_output,
            tp_group=group,
        )
        rows = linear.out_features // n
        _copy_into(layer.weight, linear.weight[r * rows : (r + 1) * rows])
        _copy_into(layer.bias, None if linear.bias is None else linear.bias[r * rows : (r + 1) * rows])
        return _Layer(layer)


class RowParallelLinear:
    @staticmethod
    def from_dense(linear: nn.Linear, group=None, input_is_parallel: bool = True) -> nn.Module:
        from megatron.core import tensor_parallel

        group = _group(group)
        n, r = group.size(), group.rank()
        _check_divisible("in_features", linear.in_features, n)
        layer = tensor_parallel.RowParallelLinear(
            linear.in_features,
            linear.out_features,
            config=_config(linear.weight.dtype, n),
            init_method=lambda w: None,
            bias=linear.bias is not None,
            input_is_parallel=input_is_parallel,
            skip_bias_add=False,
            tp_group=group,
        )
        columns = linear.in_features // n
        _copy_into(layer.weight, linear.weight[:, r * columns : (r + 1) * columns])
        _copy_into(layer.bias, linear.bias)
        return _Layer(layer)


class TensorParallelMLP(nn.Module):
    """Megatron's MLP (the module docstring); ``.fc1``/``.fc2`` are its linear_fc1/linear_fc2."""

    def __init__(self, fc1: nn.Linear, fc2: nn.Linear, group, sequence_parallel: bool, norm: nn.LayerNorm | None):
        from megatron.core.tensor_parallel import ColumnParallelLinear as Column
        from megatron.core.tensor_parallel import RowParallelLinear as Row
        from megatron.core.transformer.mlp import MLP, MLPSubmodules

        super().__init__()
        _memory_buffer()
        self.group = _group(group)
        n, r = self.group.size(), self.group.rank()
        h, f = fc1.in_features, fc1.out_features
        self.config = _config(
            fc1.weight.dtype,
            n,
            sequence_parallel,
            hidden_size=h,
            ffn_hidden_size=f,
            activation_func=F.gelu,
            add_bias_linear=fc1.bias is not None,
            bias_activation_fusion=False,
            gradient_accumulation_fusion=False,
        )
        self.sequence_parallel = self.config.sequence_parallel
        self.mlp = MLP(self.config, MLPSubmodules(linear_fc1=Column, linear_fc2=Row), ffn_hidden_size=f, tp_group=self.group)
        width = f // n
        _copy_into(self.mlp.linear_fc1.weight, fc1.weight[r * width : (r + 1) * width])
        _copy_into(self.mlp.linear_fc1.bias, None if fc1.bias is None else fc1.bias[r * width : (r + 1) * width])
        _copy_into(self.mlp.linear_fc2.weight, fc2.weight[:, r * width : (r + 1) * width])
        _copy_into(self.mlp.linear_fc2.bias, fc2.bias)
        self.norm = None
        if norm is not None:
            self.norm = nn.LayerNorm(h, eps=norm.eps, dtype=norm.weight.dtype, device=norm.weight.device)
            _copy_into(self.norm.weight, norm.weight)
            _copy_into(self.norm.bias, norm.bias)
            for p in (self.norm.weight, self.norm.bias):  # what megatron's FusedLayerNorm sets on its own
                p.sequence_parallel = self.sequence_parallel
        self.ddp_config = None  # finalize reads model_chunk.ddp_config (set in finish_gradient_synchronization)

    @property
    def fc1(self):
        return self.mlp.linear_fc1

    @property
    def fc2(self):
        return self.mlp.linear_fc2

    @classmethod
    def from_dense(
        cls,
        fc1: nn.Linear,
        fc2: nn.Linear,
        group=None,
        sequence_parallel: bool = False,
        norm: nn.LayerNorm | None = None,
        dropout: float = 0.0,
        compute_dtype: torch.dtype | None = None,
    ) -> TensorParallelMLP:
        if compute_dtype is not None:
            raise NotImplementedError(refusals.COMPUTE_DTYPE)
        if dropout:
            raise NotImplementedError(refusals.DROPOUT)
        if fc1.out_features != fc2.in_features:
            raise ValueError(f"fc1.out_features = {fc1.out_features} must equal fc2.in_features = {fc2.in_features}")
        _check_divisible("ffn width (fc1.out_features = fc2.in_features)", fc1.out_features, _group(group).size())
        return cls(fc1, fc2, group, sequence_parallel, norm)

    def _block(self, x):
        """[s, b, h] in, [s, b, h] out: the norm, then Megatron's MLP and its returned bias added."""
        if self.norm is not None:
            x = self.norm(x)
        y, bias = self.mlp(x)
        return y if bias is None else y + bias

    def forward(self, x):
        if not self.sequence_parallel:
            y = self._block(x.reshape(-1, 1, x.shape[-1]))
            return y.reshape(x.shape)
        if x.dim() < 2:
            raise ValueError(f"sequence parallelism needs inputs of shape [..., sequence, hidden], got {tuple(x.shape)}")
        seq, hidden = x.shape[-2:]
        sbh = x.reshape(-1, seq, hidden).transpose(0, 1).contiguous()  # Megatron's [s, b, h], s this rank's shard
        y = self._block(sbh)
        return y.transpose(0, 1).reshape(x.shape)

    def finish_gradient_synchronization(self) -> None:
        """Megatron's finalize_model_grads step for sequence-parallel parameters: the gradients of what
        met only this rank's sequence shard (fc2's bias, the norm) summed over the group."""
        from megatron.core.distributed import DistributedDataParallelConfig
        from megatron.core.distributed.finalize_model_grads import _allreduce_non_tensor_model_parallel_grads

        self.ddp_config = DistributedDataParallelConfig()
        _allreduce_non_tensor_model_parallel_grads([self], self.config, self.group)


class VocabParallelEmbedding:
    @staticmethod
    def from_dense(embedding: nn.Embedding, group=None) -> nn.Module:
        from megatron.core import tensor_parallel

        group = _group(group)
        n, r = group.size(), group.rank()
        vocab, width = embedding.weight.shape
        padded = -(-vocab // n) * n
        layer = tensor_parallel.VocabParallelEmbedding(
            padded, width, init_method=lambda w: None, config=_config(embedding.weight.dtype, n), tp_group=group
        )
        table = torch.zeros(padded, width, dtype=embedding.weight.dtype, device=embedding.weight.device)
        table[:vocab] = embedding.weight.detach()
        rows = padded // n
        _copy_into(layer.weight, table[r * rows : (r + 1) * rows])
        return layer


@contextmanager
def _tensor_parallel_group(group):
    """Megatron's vocab_parallel_cross_entropy takes no group: it reads parallel_state's tensor-parallel
    group, which initialize_model_parallel sets; here it is the caller's group for the call."""
    from megatron.core import parallel_state

    before = parallel_state._TENSOR_MODEL_PARALLEL_GROUP
    parallel_state._TENSOR_MODEL_PARALLEL_GROUP = group
    try:
        yield
    finally:
        parallel_state._TENSOR_MODEL_PARALLEL_GROUP = before


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, vocab_size: int, group=None, label_smoothing: float = 0.0):
    """Megatron's smoothing alpha puts alpha / (V - 1) on each class but the target and 1 - alpha on the
    target (cross_entropy.py's docstring, after NeMo); the contract's eps, torch's, puts eps / V on
    every class: the same distribution at alpha = eps (V - 1) / V, passed so."""
    from megatron.core import tensor_parallel

    group = _group(group)
    width = logits.shape[-1]
    if label_smoothing and width * group.size() != vocab_size:
        raise NotImplementedError(
            f"megatron-core cannot smooth over a padded vocabulary ({vocab_size} real of {width * group.size()} columns): "
            "its smoothing averages the log-probabilities of every column it is given, and the padding's are -inf"
        )
    alpha = label_smoothing * (vocab_size - 1) / vocab_size
    columns = torch.arange(width, device=logits.device) + group.rank() * width
    masked = logits.masked_fill(columns >= vocab_size, float("-inf"))
    with _tensor_parallel_group(group):
        return tensor_parallel.vocab_parallel_cross_entropy(masked, targets, label_smoothing=alpha)


def ShardedOptimizer(params, optimizer_class, group=None, **defaults):
    raise NotImplementedError(refusals.DISTRIBUTED_OPTIMIZER)


def pipeline_step(stages, inputs, targets, loss_fn, num_microbatches, schedule="1f1b", group=None, **options):
    """Megatron's schedules (get_forward_backward_func) would run the contract's 1F1B and interleaved
    1F1B; on CPU ranks they cannot start (refusals.PIPELINE)."""
    raise NotImplementedError(refusals.PIPELINE)
