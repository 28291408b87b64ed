"""nanotron's tensor parallelism through the suite's contract, as its models build it
(``--impl parallelism_conformance.adapters.nanotron`` in a venv that has nanotron; ``scripts/libraries nanotron==0.2``:
nanotron 0.4 as served does not import, docs/libraries.md).

* ``ColumnParallelLinear``: ``nanotron.parallel.tensor_parallel.nn.TensorParallelColumnLinear`` on
  the caller's group (``pg=``), mode ``ALL_REDUCE`` (f: identity forward, all-reduce backward), the
  dense rows copied into its shard. It has no gathered output: ``gather_output=True`` is refused.
* ``RowParallelLinear``: ``TensorParallelRowLinear``, mode ``ALL_REDUCE``; nanotron keeps the bias on
  the group's rank 0 only ("No need to shard the bias term, only rank 0 would have it", nn.py) and
  adds it before the all-reduce. It has no scatter of a full input: ``input_is_parallel=False`` is
  refused.
* ``TensorParallelMLP``: column, exact GELU, row, as nanotron's GELU MLP (models/starcoder2.py's
  ``MLP``: c_fc column, c_proj row). With ``sequence_parallel=True`` both layers run in mode
  ``REDUCE_SCATTER`` on nanotron's [sequence, batch, hidden] (column: all-gather of the sequence
  shards, backward reduce-scatter; row: reduce-scatter, backward all-gather), as its llama does.

Nanotron's parameters are ``NanotronParameter``s holding this rank's shard; the suite reads them as
they are. Nothing is shimmed: the layers run on plain gloo groups.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import distributed as dist
from torch import nn

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "TensorParallelMLP", "ShardedOptimizer"]

NO_GATHER = (
    "nanotron cannot gather a column-parallel layer's output: TensorParallelColumnLinear has no gather_output "
    "(its models keep the output sharded into the row layer)"
)
NO_SCATTER = (
    "nanotron cannot take a full input into a row-parallel layer: TensorParallelRowLinear has no "
    "input_is_parallel=False (its input is always the column layer's shard)"
)


GLOO_UNEVEN = (
    "nanotron cannot run its ZeRO-1 on gloo when a parameter's elements do not split evenly over the ranks: "
    "ZeroDistributedOptimizer._all_gather_params all-gathers each rank's slice (the last ranks' one element "
    "shorter), and ProcessGroupGloo::allgather refuses tensors of unequal sizes ('invalid tensor size')"
)


def _group(group):
    return dist.group.WORLD if group is None else group


def _check_divisible(dimension: str, size: int, n: int) -> None:
    if size % n:
        raise ValueError(f"{dimension} = {size} is not divisible by the group size {n} ({size} % {n} = {size % n})")


def _set(parameter, value) -> None:
    if parameter is not None:
        with torch.no_grad():
            parameter.copy_(value)


def _mode(sequence_parallel: bool):
    from nanotron.parallel.tensor_parallel.enum import TensorParallelLinearMode

    return TensorParallelLinearMode.REDUCE_SCATTER if sequence_parallel else TensorParallelLinearMode.ALL_REDUCE


def _column(linear: nn.Linear, group, sequence_parallel: bool = False):
    from nanotron.parallel.tensor_parallel.nn import TensorParallelColumnLinear

    n, r = group.size(), group.rank()
    layer = TensorParallelColumnLinear(
        linear.in_features,
        linear.out_features,
        pg=group,
        mode=_mode(sequence_parallel),
        bias=linear.bias is not None,
        dtype=linear.weight.dtype,
    )
    rows = linear.out_features // n
    _set(layer.weight, linear.weight[r * rows : (r + 1) * rows])
    _set(layer.bias, None if linear.bias is None else linear.bias[r * rows : (r + 1) * rows])
    return layer


def _row(linear: nn.Linear, group, sequence_parallel: bool = False):
    from nanotron.parallel.tensor_parallel.nn import TensorParallelRowLinear

    n, r = group.size(), group.rank()
    layer = TensorParallelRowLinear(
        linear.in_features,
        linear.out_features,
        pg=group,
        mode=_mode(sequence_parallel),
        bias=linear.bias is not None,
        dtype=linear.weight.dtype,
    )
    columns = linear.in_features // n
    _set(layer.weight, linear.weight[:, r * columns : (r + 1) * columns])
    _set(layer.bias, linear.bias)  # None on every rank but the group's first: nanotron's choice
    return layer


class _Rows(nn.Module):
    """A nanotron layer on inputs of any leading dims, flattened to rows and restored."""

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
        y = self.layer(x.reshape(-1, x.shape[-1]))
        return y.reshape(*x.shape[:-1], y.shape[-1])


class ColumnParallelLinear:
    @staticmethod
    def from_dense(linear: nn.Linear, group=None, gather_output: bool = False) -> nn.Module:
        group = _group(group)
        _check_divisible("out_features", linear.out_features, group.size())
        if gather_output:
            raise NotImplementedError(NO_GATHER)
        return _Rows(_column(linear, group))


class RowParallelLinear:
    @staticmethod
    def from_dense(linear: nn.Linear, group=None, input_is_parallel: bool = True) -> nn.Module:
        group = _group(group)
        _check_divisible("in_features", linear.in_features, group.size())
        if not input_is_parallel:
            raise NotImplementedError(NO_SCATTER)
        return _Rows(_row(linear, group))


class TensorParallelMLP(nn.Module):
    def __init__(self, fc1: nn.Linear, fc2: nn.Linear, group, sequence_parallel: bool):
        super().__init__()
        self.group = _group(group)
        self.sequence_parallel = sequence_parallel and self.group.size() > 1
        self.fc1 = _column(fc1, self.group, self.sequence_parallel)
        self.fc2 = _row(fc2, self.group, self.sequence_parallel)

    @classmethod
    def from_dense(cls, fc1: nn.Linear, fc2: nn.Linear, group=None, sequence_parallel: bool = False, **options) -> TensorParallelMLP:
        if options:
            raise NotImplementedError(
                f"nanotron cannot take {', '.join(sorted(options))} in this adapter: its MLP blocks have no such argument"
            )
        if fc1.out_features != fc2.in_features:
            raise ValueError(f"fc1.out_features = {fc1.out_features} must equal fc2.in_features = {fc2.in_features}")
        _check_divisible("ffn width (fc1.out_features = fc2.in_features)", fc1.out_features, _group(group).size())
        return cls(fc1, fc2, group, sequence_parallel)

    def forward(self, x):
        if not self.sequence_parallel:
            rows = x.reshape(-1, x.shape[-1])
            return self.fc2(F.gelu(self.fc1(rows), approximate="none")).reshape(x.shape)
        seq, hidden = x.shape[-2:]
        sbh = x.reshape(-1, seq, hidden).transpose(0, 1).reshape(-1, hidden)  # [s * b, h]: the sequence shard leads
        y = self.fc2(F.gelu(self.fc1(sbh), approximate="none"))
        return y.reshape(seq, -1, hidden).transpose(0, 1).reshape(x.shape)


class ShardedOptimizer:
    """nanotron's ZeRO-1, ``nanotron.optim.zero.ZeroDistributedOptimizer``, as its trainer builds it:
    around a ``NamedOptimizer`` of ``optimizer_class`` (the parameters named by position), over the
    group as ``dp_pg``. It splits every parameter's flat elements across the ranks, steps this rank's
    slices and all-gathers the parameters after the step. It expects gradients already averaged over
    the group (nanotron's trainer wraps the model in torch's DistributedDataParallel), so ``step``
    first all-reduces each gradient with AVG, as adapters/torch_zero.py does for torch's ZeRO."""

    def __init__(self, params, optimizer_class, group=None, **defaults):
        from nanotron.optim.named_optimizer import NamedOptimizer
        from nanotron.optim.zero import ZeroDistributedOptimizer

        self._group = _group(group)
        self._trainable = [p for p in params if p.requires_grad]
        n = self._group.size()
        if dist.get_backend(self._group) == "gloo" and any(p.numel() % n for p in self._trainable):
            raise NotImplementedError(GLOO_UNEVEN)
        named = [(f"param{i}", p) for i, p in enumerate(self._trainable)]
        self._zero = ZeroDistributedOptimizer(
            named, lambda groups: NamedOptimizer(groups, lambda torch_groups: optimizer_class(torch_groups, **defaults)), dp_pg=self._group
        )

    @property
    def optim(self) -> torch.optim.Optimizer:
        """The torch optimizer this rank steps (its slices' state)."""
        return self._zero.optimizer.optimizer

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._zero.zero_grad()  # nanotron sets every .grad to None

    def step(self, closure=None):
        for p in self._trainable:
            if p.grad is not None:
                dist.all_reduce(p.grad, op=dist.ReduceOp.AVG, group=self._group)
        return self._zero.step(closure)
