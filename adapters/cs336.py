"""A CS336 assignment 2 ("systems") submission, graded through the suite's contract.

The assignment's entry points are the functions of the submission's ``tests/adapters.py``; this
module maps them onto the contract's names, so that course staff run the suite on a student's
repository as it was handed in:

    CS336_SUBMISSION=/abs/path/to/student-repo scripts/conformance --impl parallelism_conformance.adapters.cs336 --scope cs336 \\
        --capability data_parallel,sharded_optimizer,audit --hypothesis-profile=grading --report-dir out

``CS336_SUBMISSION`` is the folder holding ``tests/adapters.py`` (and the ``cs336_systems`` package
it imports), or the path of that file. It is read inside each rank, where this module is imported;
the grading process imports neither this module nor the submission.

| contract (CONTRACT.md) | the handout's functions (either generation) |
|---|---|
| ``DataParallel(module, None)`` | ``get_ddp_individual_parameters(module)``, or ``get_ddp(module)`` |
| ``DataParallel(module, bucket_size_mb)`` | ``get_ddp_bucketed(module, bucket_size_mb)``; without it, ``get_ddp(module)`` (one parameter per reduction keeps any cap) |
| ``.on_train_batch_start(optimizer)`` | ``ddp_bucketed_on_train_batch_start(ddp_model, optimizer)`` where the handout has it |
| ``.finish_gradient_synchronization()`` | ``ddp_*_on_after_backward(ddp_model, optimizer)`` |
| ``ShardedOptimizer(params, optimizer_class, **defaults)`` | ``get_sharded_optimizer(params, optimizer_class, **defaults)``, after averaging gradients |
| ``fully_shard(unit)``, then ``fully_shard(root, compute_dtype=d)`` | ``get_fsdp(root, compute_dtype=d)`` (the 2026 handout; the keyword only when given), the model rebuilt first from the submission's layers, where its own tests/test_fsdp.py imports them (``adapters/cs336_layers.py``) |
| after each ``loss.backward()`` | ``fsdp_on_after_backward(fsdp_model, optimizer)`` (queued by the backward itself) |
| ``full_parameters(module)`` | ``fsdp_gather_full_params(fsdp_model)``, under the suite's names |

What differs from the handout's own tests, so that a failure here is read right:

* The handout's sharded optimizer is tested with the same batch on every rank, so it is never asked
  to average gradients (torch's ZeroRedundancyOptimizer is not either: it runs after DDP). Here
  every rank has its own slice; ``step`` therefore averages each gradient over the world first (an
  all-reduce), then calls the submission's ``step``, and ``zero_grad`` clears every parameter's
  gradient before calling the submission's. Its audit is reported and skipped, as torch's is.
* The contract's data-parallel loop also draws gradient accumulation (1-3 backward passes per step,
  the hook after each), ``zero_grad(set_to_none=False)``, parameters unused in a step and buffers
  that differ between ranks; the handout's tests have none of these. ``--scope cs336`` keeps to the
  handout's loop (those tests skipped, the coverage line says so); without it the submission is
  held to the whole contract. ``on_train_batch_start`` runs once per step, before ``zero_grad``.
* ``.module`` is the submission's ``ddp_model.module`` (the handout's tests read it too), or the
  module it was given when the wrapper has none.
* The contract's FSDP loop has no hook after backward: the adapter queues the handout's
  ``fsdp_on_after_backward`` at the end of every backward of the loss the model returned, as the
  handout's tests call it after each ``backward()``. Its ``optimizer`` is the loop's, which the
  adapter never sees (the loop builds it from the model's parameters): a hook that reads it fails
  with a message saying so. ``fully_shard`` of a unit is a no-op: the handout's FSDP wraps the
  whole model once, at the root.
* The suite's models take ``(inputs, targets)`` and return the loss; the handout's tests call
  ``ddp_model(x)`` and compute the loss outside, so a DDP whose ``forward`` takes one input is right.
  For one, the module's own ``forward`` is given the targets for the length of the call.
"""

from __future__ import annotations

import importlib.util
import inspect
import itertools
import os
import sys

import torch
import torch.distributed as dist

from parallelism_conformance.adapters import cs336_layers, cs336_metadata

SUBMISSION_VARIABLE = "CS336_SUBMISSION"


def _load_submission():
    """(The submission's tests/adapters.py, its root): imported with the submission's folder on
    sys.path (so that ``import cs336_systems`` finds the student's package)."""
    where = os.environ.get(SUBMISSION_VARIABLE)
    if not where:
        raise ImportError(
            f"parallelism_conformance.adapters.cs336 grades a CS336 submission: set {SUBMISSION_VARIABLE} to the folder "
            "that holds its tests/adapters.py"
        )
    where = os.path.abspath(where)
    path = where if os.path.isfile(where) else os.path.join(where, "tests", "adapters.py")
    if not os.path.isfile(path):
        raise ImportError(f"{SUBMISSION_VARIABLE}={where}: no {path}")
    root = os.path.dirname(os.path.dirname(path))
    # the 2026 template vendors the course's cs336_basics in cs336-basics/ (installed, not on the path)
    cs336_metadata.declare(root)  # its packages' versions, as the template reads them at import
    vendored = os.path.join(root, "cs336-basics")
    for folder in ([vendored] if os.path.isdir(vendored) else []) + [root, os.path.dirname(path)]:
        if folder not in sys.path:
            sys.path.insert(0, folder)
    spec = importlib.util.spec_from_file_location("cs336_submission_adapters", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
    except SyntaxError as error:
        raise ImportError(
            f"the submission's code does not parse under Python {sys.version.split()[0]}: {error}{cs336_metadata.python_mismatch(root)}"
        ) from error
    return module, root


submission, SUBMISSION_ROOT = _load_submission()
# where the FSDP models' layers come from: the module the submission's own tests import them from
LAYERS = cs336_layers.layers_module(SUBMISSION_ROOT)[0]


def _entry(*names: str):
    """The first of the handout's functions ``names`` that the submission implements, or None.
    Unfilled entry points raise NotImplementedError; that is found when they are called."""
    for name in names:
        function = getattr(submission, name, None)
        if callable(function):
            return function
    return None


def _not_implemented(*names: str) -> NotImplementedError:
    return NotImplementedError(f"the CS336 submission's tests/adapters.py has none of {', '.join(names)}")


class _DataParallel:
    """The submission's DDP wrapper with the contract's names; the handout's hooks get the
    optimizer the loop passed to ``on_train_batch_start``."""

    def __init__(self, ddp_model, module, after_backward, train_batch_start):
        self.ddp_model = ddp_model
        self.module = getattr(ddp_model, "module", module)
        self._given = module
        self._after_backward = after_backward
        self._train_batch_start = train_batch_start
        self._optimizer = None

    def __call__(self, inputs, targets):
        return _called_with_targets(self.ddp_model, self._given, inputs, targets)

    def on_train_batch_start(self, optimizer) -> None:
        self._optimizer = optimizer
        if self._train_batch_start is not None:
            self._train_batch_start(self.ddp_model, optimizer)

    def finish_gradient_synchronization(self) -> None:
        self._after_backward(self.ddp_model, self._optimizer)


def _called_with_targets(wrapper, module, inputs, targets):
    """The submission's wrapper of ``module`` on a batch, returning the loss: given both when its
    ``forward`` takes two inputs; else as the handout's tests call it, ``wrapper(x)``, with
    ``module``'s own ``forward`` given the targets for the length of the call."""
    if _takes_two_inputs(wrapper.forward):
        return wrapper(inputs, targets)
    module_forward = module.forward
    module.forward = lambda x, *args, **kwargs: module_forward(x, targets, *args, **kwargs)
    try:
        return wrapper(inputs)
    finally:
        del module.forward  # the class's forward again


def _takes_two_inputs(forward) -> bool:
    """Whether a bound ``forward`` accepts two positional inputs."""
    try:
        parameters = inspect.signature(forward).parameters.values()
    except (TypeError, ValueError):
        return True
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 2 or any(p.kind == p.VAR_POSITIONAL for p in parameters)


def DataParallel(module, bucket_size_mb=None):
    """The handout's bucketed DDP when a bucket size is given and the submission has one; its
    per-parameter DDP otherwise (valid for any cap: each reduction is one parameter)."""
    bucketed = _entry("get_ddp_bucketed")
    if bucket_size_mb is not None and bucketed is not None:
        return _DataParallel(
            bucketed(module, bucket_size_mb), module, _entry("ddp_bucketed_on_after_backward"), _entry("ddp_bucketed_on_train_batch_start")
        )
    individual = _entry("get_ddp_individual_parameters")
    if individual is not None:
        return _DataParallel(individual(module), module, _entry("ddp_individual_parameters_on_after_backward"), None)
    newer = _entry("get_ddp")
    if newer is not None:
        return _DataParallel(newer(module), module, _entry("ddp_on_after_backward"), None)
    raise _not_implemented("get_ddp_individual_parameters", "get_ddp_bucketed", "get_ddp")


class _ChainedState:
    """``state.items()`` over several optimizers' state dicts, each dict once (a wrapper that shares
    its inner optimizer's ``state`` dict holds it once), each parameter's state as often as it is
    held (state kept in two dicts on one rank counts twice). An optimizer without a ``state`` dict (a
    subclass of torch.optim.Optimizer that never called its ``__init__``, which the handout allows)
    holds none."""

    def __init__(self, optimizers):
        states = (getattr(o, "state", None) for o in optimizers)
        self._states = list({id(state): state for state in states if isinstance(state, dict)}.values())

    def items(self):
        return itertools.chain.from_iterable(state.items() for state in self._states)


class _HeldState:
    """What the contract's ``.optim`` is read for: the optimizer state this rank holds, over every
    torch.optim.Optimizer the submission's object holds (itself, its attributes, and lists, tuples
    and dicts in them), since the handout leaves the local optimizer's name to the student."""

    def __init__(self, sharded):
        found: dict[int, torch.optim.Optimizer] = {}
        if isinstance(sharded, torch.optim.Optimizer):
            found[id(sharded)] = sharded
        for value in vars(sharded).values():
            for item in _members(value):
                if isinstance(item, torch.optim.Optimizer):
                    found.setdefault(id(item), item)
        self.optimizers = list(found.values())
        self.state = _ChainedState(self.optimizers)


def _members(value):
    if isinstance(value, dict):
        return list(value.values())
    if isinstance(value, (list, tuple)):
        return list(value)
    return [value]


class ShardedOptimizer:
    """The submission's sharded optimizer over the world, its gradients averaged first (see the
    module's docstring)."""

    def __init__(self, params, optimizer_class, group=None, **defaults):
        if group is not None:
            raise ValueError("the handout's get_sharded_optimizer shards over the whole world; no group")
        make = _entry("get_sharded_optimizer")
        if make is None:
            raise _not_implemented("get_sharded_optimizer")
        self._params = list(params)
        self.sharded = make(self._params, optimizer_class, **defaults)
        self.optim = _HeldState(self.sharded)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Every parameter's gradient cleared (the averaging in ``step`` is the adapter's, so the
        gradients it averages are too: a submission that clears only the parameters it owns is right
        under the handout's equal batches, where nothing reads the others), then the submission's."""
        for parameter in self._params:
            if parameter.grad is not None:
                if set_to_none:
                    parameter.grad = None
                else:
                    parameter.grad.zero_()
        zero_grad = self.sharded.zero_grad
        if "set_to_none" in inspect.signature(zero_grad).parameters:
            zero_grad(set_to_none=set_to_none)
        else:
            zero_grad()

    def step(self, closure=None):
        for parameter in self._params:
            if parameter.requires_grad and parameter.grad is not None:
                dist.all_reduce(parameter.grad)  # SUM, then divide: AVG is not on every backend
                parameter.grad.div_(dist.get_world_size())
        return self.sharded.step() if closure is None else self.sharded.step(closure)


class _OptimizerOfTheLoop:
    """What ``fsdp_on_after_backward`` gets as its optimizer: the contract's loop builds its own from
    the model's parameters, after ``fully_shard``, so the adapter cannot hand it over."""

    def __getattr__(self, name):
        raise AttributeError(
            f"parallelism_conformance.adapters.cs336: the submission's fsdp_on_after_backward read optimizer.{name}; the "
            "suite's loop builds its optimizer from the model's parameters after fully_shard and "
            "never gives it to the adapter, so a hook that uses it cannot be graded here"
        )


class _FullyShardedModel:
    """The root's ``fully_shard``: ``get_fsdp`` runs at first use (the loop's ``parameters()`` for its
    optimizer), on the model rebuilt from the submission's layers. Called as the suite's models are,
    ``(inputs, targets)`` -> loss, with the handout's after-backward hook queued on that loss."""

    def __init__(self, module, compute_dtype=None):
        self.module, self.compute_dtype = module, compute_dtype
        self._fsdp = None
        self._renamed = None
        self._after_backward_hook = None

    def fsdp_model(self):
        if self._fsdp is None:
            make = _entry("get_fsdp")
            if make is None:
                raise _not_implemented("get_fsdp")
            self._after_backward_hook = _entry("fsdp_on_after_backward")
            if self._after_backward_hook is None:
                raise _not_implemented("fsdp_on_after_backward")
            self._renamed = cs336_layers.convert(self.module, LAYERS)
            # the keyword only when set: a 2025-style get_fsdp(module) still grades without one
            options = {} if self.compute_dtype is None else {"compute_dtype": self.compute_dtype}
            self._fsdp = make(self.module, **options)
        return self._fsdp

    def parameters(self, recurse: bool = True):
        return self.fsdp_model().parameters(recurse)

    def named_buffers(self, *args, **kwargs):
        return self.module.named_buffers(*args, **kwargs)

    def __call__(self, inputs, targets):
        loss = _called_with_targets(self.fsdp_model(), self.module, inputs, targets)
        if loss.requires_grad:
            loss.register_hook(self._queue_after_backward)
        return loss

    def _queue_after_backward(self, grad):
        torch.autograd.Variable._execution_engine.queue_callback(self._after_backward)
        return grad

    def _after_backward(self):
        self._after_backward_hook(self._fsdp, _OptimizerOfTheLoop())

    def full_parameters(self) -> dict:
        gather = _entry("fsdp_gather_full_params")
        if gather is None:
            raise _not_implemented("fsdp_gather_full_params")
        return self._renamed.full(gather(self.fsdp_model()))


def fully_shard(module, group=None, compute_dtype=None):
    """Its module's FSDP, built at first use: the loop uses only the root's (the last call), so a
    unit's is never built and the handout's FSDP wraps the whole model once, with ``get_fsdp``'s
    ``compute_dtype``."""
    if group is not None:
        raise ValueError("the handout's get_fsdp shards over the whole world; no group")
    return _FullyShardedModel(module, compute_dtype)


def full_parameters(module) -> dict:
    if not isinstance(module, _FullyShardedModel):
        raise TypeError("full_parameters: pass the model fully_shard returned")
    return module.full_parameters()
