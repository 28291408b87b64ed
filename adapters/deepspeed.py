"""DeepSpeed through the suite's data-parallel contracts, as DeepSpeed's users train with it:
``deepspeed.initialize(model=..., optimizer=..., config=...)``, ``engine(inputs)``,
``engine.backward(loss)``, ``engine.step()`` (CONTRACT.md, "Libraries that train through their own
object", names the hooks the rank programs call for that).

* ``DataParallel``: ZeRO stage 0, DeepSpeed's plain data parallelism (every gradient all-reduced
  with the average at the end of ``engine.backward``). The engine is built by ``take_optimizer``, once the loop has its
  optimizer: DeepSpeed's ``backward`` asserts "must provide optimizer during init". Building it
  broadcasts rank 0's parameters and buffers (``_broadcast_model``).
* ``ShardedOptimizer``: ZeRO stage 1 (stage 2 in adapters/deepspeed_zero2.py) over the model
  ``wrap_model`` is given, its optimizer built from
  the contract's class and keywords; ``.optim`` is the torch optimizer ZeRO steps on this rank's
  flat fp32 partition.
* ``fully_shard`` / ``full_parameters``: ZeRO stage 3. DeepSpeed partitions a whole model at
  ``initialize`` and gathers each submodule around its forward and backward, so ``fully_shard`` on
  a unit marks nothing and the root's returns a module whose ``take_optimizer`` builds the engine;
  ``full_parameters`` gathers through ``deepspeed.zero.GatheredParameters``, the documented way to
  read ZeRO-3 parameters whole.
* With the optimizer offloaded (``offload_optimizer: {device: cpu}``): adapters/deepspeed_offload.py
  (ZeRO-1 and ZeRO-3) and adapters/deepspeed_zero2_offload.py.

The configuration keeps what the contract's loop does, nothing more: ``gradient_clipping`` 0
(DeepSpeed 0.19 clips at 1.0 by default; the loop does not clip), ``gradient_accumulation_steps``
the loop's micro-batches a step (the ``accumulate`` hook: DeepSpeed's own counter, ``engine.step()``
after every micro-batch, as its users accumulate; with 1 and several backwards a step, ZeRO-2 keeps
only the last micro-batch's gradient, allenai/open-instruct#1498; DeepSpeed divides each loss by the
count, and the driver's reference does the same for it: the table's ``averages_micro_batches``),
``zero_allow_untested_optimizer``
(the contract's optimizers are torch's SGD and AdamW), ZeRO-3's ``stage3_param_persistence_threshold``
0 (by default ZeRO-3 keeps every parameter under 100,000 elements whole on every rank, which is
every parameter of the suite's models: the contract asks for them sharded) and, with offload, ``zero_force_ds_cpu_optimizer``
off (DeepSpeed otherwise insists on its own CPU Adam, which is not the optimizer the loop asked for).
Over those, the keys its users set, drawn by the driver from the table entry (``configure``).

What it cannot run (NotImplementedError on every rank, before anything is built):
* float64 models: DeepSpeed reduces float32, float16 and bfloat16 gradients only (ZeRO stage 0:
  "attempting to reduce an unsupported grad type: torch.float64", runtime/engine.py);
* ``gradient_divide_factor``: DeepSpeed's gradient division is ``gradient_predivide_factor``
  around a world-size average; ``compute_dtype`` on ``fully_shard`` (ZeRO-3). ``DataParallel``'s
  ``compute_dtype`` is DeepSpeed's own ``bf16`` / ``fp16`` flag (adapters/deepspeed_precision.py);
* ``reshard_after_forward=False`` (capability ``zero2``): ZeRO-3 has no switch that keeps a
  module's gathered parameters from its forward to its backward (``stage3_max_reuse_distance``
  acts only once the parameter trace of a first step is recorded).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import nn

from parallelism_conformance.adapters import deepspeed_precision

REFUSED_DTYPE = (
    "DeepSpeed cannot reduce float64 gradients: its ZeRO stage 0 asserts 'attempting to reduce an "
    "unsupported grad type: torch.float64' (float32, float16 and bfloat16 only)"
)


# The keys the driver drew for this task (``configure``; {} = DeepSpeed's defaults): what a user
# writes into the config beside the keys the contract's loop fixes. Module state because the rank
# loop configures the adapter before a task builds anything (harness/rank/library_loop.py).
_drawn: dict = {}


def configure(configuration: dict) -> None:
    """The contract's hook for a library's configuration ({dotted key: value}, from the library's
    table entry, harness/driver/libraries/table.py): merged into every config built from here on.
    A key this DeepSpeed does not know is refused by name (DeepSpeed itself ignores an unknown
    top-level key and rejects an unknown ``zero_optimization`` one at initialize)."""
    import deepspeed
    from deepspeed.runtime import constants
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    known_zero = {f.alias or name for name, f in DeepSpeedZeroConfig.model_fields.items()} | set(DeepSpeedZeroConfig.model_fields)
    known_top = {v for k, v in vars(constants).items() if k.isupper() and isinstance(v, str)}
    for key in configuration:
        section, _, name = key.rpartition(".")
        if (section == "zero_optimization" and name not in known_zero) or (not section and key not in known_top):
            raise NotImplementedError(
                f"DeepSpeed {deepspeed.__version__} cannot take the configuration key {key!r}: this version has no such key"
            )
    _drawn.clear()
    _drawn.update(configuration)


def config(stage: int, offload: bool) -> dict:
    """The DeepSpeed configuration of one contract call (the module docstring says why each key),
    with the drawn keys (``configure``) over it."""
    zero = {"stage": stage}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0  # shard every parameter, small ones too (below)
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    built = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }
    for key, value in _drawn.items():
        section, _, name = key.rpartition(".")
        (built[section] if section else built)[name] = value
    return built


def _backward(engine, loss) -> None:
    """One micro-batch as DeepSpeed's users run it: ``engine.backward(loss)`` (which divides the loss
    by gradient_accumulation_steps), then, before the boundary, ``engine.step()``, which only counts
    the micro-batch (the loop's own step is the boundary's). With ``managed_gradient_accumulation``
    false the caller owns the boundary: backwards only accumulate, and the loop's step reduces."""
    managed = engine.managed_gradient_accumulation() if hasattr(engine, "managed_gradient_accumulation") else True
    boundary = engine.is_gradient_accumulation_boundary()
    engine.backward(loss)
    if managed and not boundary:
        engine.step()


def _refuse_dtypes(parameters) -> None:
    if any(p.dtype == torch.float64 for p in parameters):
        raise NotImplementedError(REFUSED_DTYPE)


def _refuse_keywords(**given) -> None:
    named = [name for name, value in given.items() if value is not None]
    if named:
        raise NotImplementedError(
            f"DeepSpeed cannot take the contract's {', '.join(named)}: its mixed precision is "
            "the fp16/bf16 optimizer with loss scaling and its gradient division a "
            "gradient_predivide_factor around the world-size average"
        )


def _initialize(model: nn.Module, optimizer, cfg: dict):
    import deepspeed

    # The suite's ranks join their gloo group before the implementation is imported; DeepSpeed adopts
    # a process group made first, and asks a launcher other than its own for LOCAL_RANK (its
    # assertion's words: "please ensure LOCAL_RANK is set prior to initializing deepspeed"). The
    # suite's CPU ranks share one host, so the local rank is the rank.
    os.environ.setdefault("LOCAL_RANK", str(dist.get_rank()))
    try:
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=cfg)
    except Exception as error:
        # its config's validation, and the sanity checks initialize asserts on key combinations
        if type(error).__name__ not in ("ValidationError", "DeepSpeedConfigError", "AssertionError") or not _drawn:
            raise
        # a configuration DeepSpeed rejects is a refusal with its message, not a failure (issue 56)
        raise NotImplementedError(
            f"DeepSpeed {deepspeed.__version__} cannot run the configuration {_drawn}, which it rejects: {error}"
        ) from error
    return engine


class EngineOptimizer:
    """What the loop steps and zeroes once the engine holds its optimizer: ``step()`` is
    ``engine.step()`` (the update, then DeepSpeed's own zero_grad), ``zero_grad`` the engine's
    optimizer's, ``.state`` the state of the torch optimizer that steps this rank's tensors."""

    def __init__(self, engine):
        self.engine = engine
        inner = engine.optimizer
        self.optim = getattr(inner, "optimizer", inner)  # ZeRO wraps the client's optimizer

    @property
    def state(self):
        return self.optim.state

    @property
    def param_groups(self):
        return self.optim.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        if hasattr(self.engine.optimizer, "zero_grad"):
            self.engine.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure=None) -> None:
        self.engine.step()


class _EngineModule(nn.Module):
    """The contract's wrapper around a model DeepSpeed will train: it shows the model's own
    parameters and buffers under their own names (no ``module.`` prefix), builds the engine in
    ``take_optimizer``, and runs forward and backward through it."""

    def __init__(self, module: nn.Module, cfg: dict):
        super().__init__()
        object.__setattr__(self, "module", module)  # not a registered child: names stay the model's
        self.config = cfg
        self.engine = None

    def named_parameters(self, *args, **kwargs):
        return self.module.named_parameters(*args, **kwargs)

    def parameters(self, recurse: bool = True):
        return self.module.parameters(recurse)

    def named_buffers(self, *args, **kwargs):
        return self.module.named_buffers(*args, **kwargs)

    def buffers(self, recurse: bool = True):
        return self.module.buffers(recurse)

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.module, name)  # the model's own attributes (logits_dtype)

    def take_optimizer(self, optimizer) -> EngineOptimizer:
        self.engine = _initialize(self.module, optimizer, self.config)
        return EngineOptimizer(self.engine)

    def forward(self, *args, **kwargs):
        if self.engine is None:
            raise RuntimeError("DeepSpeed's engine is built by take_optimizer(optimizer), before the first forward")
        return self.engine(*args, **kwargs)

    def accumulate(self, micro_batches: int) -> None:
        """The contract's hook (harness/rank/library_loop.py): k backwards a step are DeepSpeed's
        gradient_accumulation_steps k, its own counter, as its users accumulate."""
        if self.engine is not None:
            raise RuntimeError("accumulate(k) comes before take_optimizer: DeepSpeed fixes its count at initialize")
        self.config["gradient_accumulation_steps"] = micro_batches

    def backward(self, loss) -> None:
        _backward(self.engine, loss)

    def finish_gradient_synchronization(self) -> None:
        """Nothing to do: ``engine.backward`` has all-reduced every gradient (ZeRO stage 0)."""

    def masters(self) -> nn.Module:
        """The contract's hook (harness/rank/library_loop.py): under bf16, the float32 copies
        DeepSpeed's optimizer steps (adapters/deepspeed_precision.py); else the model."""
        return deepspeed_precision.masters(self.engine, self.module)


def DataParallel(module, bucket_size_mb=None, gradient_divide_factor=None, compute_dtype=None):
    _refuse_keywords(gradient_divide_factor=gradient_divide_factor)
    _refuse_dtypes(module.parameters())
    precision = deepspeed_precision.mixed_precision(compute_dtype)
    if bucket_size_mb is not None:
        raise NotImplementedError(
            "DeepSpeed cannot bucket ZeRO stage 0's gradients by a size: engine.allreduce_gradients "
            "reduces them after backward in buckets of MEMORY_OPT_ALLREDUCE_SIZE (500,000,000) "
            "elements, a constant no configuration key reaches"
        )
    return _EngineModule(module, {**config(0, offload=False), **precision})


class _ShardedOptimizer:
    """ZeRO stage 1 or 2 over the model ``wrap_model`` names; until then only the parameters."""

    def __init__(self, params, optimizer_class, stage: int, offload: bool, **defaults):
        self._parameters = list(params)
        _refuse_dtypes(self._parameters)
        self._optimizer_class, self._defaults = optimizer_class, defaults
        self._config = config(stage, offload)
        self._engine = None

    def accumulate(self, micro_batches: int) -> None:
        """As _EngineModule.accumulate: k backwards a step are DeepSpeed's gradient_accumulation_steps."""
        if self._engine is not None:
            raise RuntimeError("accumulate(k) comes before wrap_model: DeepSpeed fixes its count at initialize")
        self._config["gradient_accumulation_steps"] = micro_batches

    def wrap_model(self, model: nn.Module) -> nn.Module:
        mine = {id(p) for p in self._parameters}
        if any(id(p) not in mine for p in model.parameters()):
            raise ValueError("wrap_model(model): the model has parameters this ShardedOptimizer was not given")
        trainable = [p for p in self._parameters if p.requires_grad]
        wrapped = _EngineModule(model, self._config)
        wrapped.take_optimizer(self._optimizer_class(trainable, **self._defaults))
        self._engine = wrapped.engine
        self._stepper = EngineOptimizer(self._engine)
        return wrapped

    @property
    def optim(self):
        return self._stepper.optim

    def backward(self, loss) -> None:
        _backward(self._engine, loss)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._engine is not None:
            self._stepper.zero_grad(set_to_none)

    def step(self, closure=None) -> None:
        self._stepper.step()


def sharded_optimizer_of(stage: int, offload: bool):
    """The contract's ShardedOptimizer as ZeRO stage ``stage`` (1 or 2), optimizer offloaded to the CPU or not."""

    def ShardedOptimizer(params, optimizer_class, group=None, **defaults):
        if group is not None:
            raise NotImplementedError(
                "DeepSpeed cannot shard over a group given to the optimizer: its ZeRO shards over the engine's data-parallel group"
            )
        return _ShardedOptimizer(params, optimizer_class, stage, offload, **defaults)

    return ShardedOptimizer


def fully_shard_of(offload: bool):
    """The contract's fully_shard as ZeRO stage 3, optimizer offloaded to the CPU or not."""

    def fully_shard(
        module: nn.Module, group=None, reshard_after_forward: bool = True, compute_dtype=None, gradient_divide_factor=None
    ) -> nn.Module:
        _refuse_keywords(gradient_divide_factor=gradient_divide_factor, compute_dtype=compute_dtype)
        if not reshard_after_forward:
            raise NotImplementedError(
                "DeepSpeed's ZeRO-3 cannot keep a module's gathered parameters from its forward "
                "to its backward by a switch (stage3_max_reuse_distance acts only on a "
                "recorded parameter trace); its ZeRO-2 keeps every parameter whole"
            )
        if group is not None:
            raise NotImplementedError("DeepSpeed cannot shard over a given group: ZeRO-3 shards over the engine's data-parallel group")
        _refuse_dtypes(module.parameters())
        return _EngineModule(module, config(3, offload))

    return fully_shard


ShardedOptimizer = sharded_optimizer_of(1, offload=False)
fully_shard = fully_shard_of(offload=False)


def full_parameters(module: nn.Module) -> dict:
    import deepspeed

    parameters = list(module.parameters())
    with deepspeed.zero.GatheredParameters(parameters, modifier_rank=None):
        return {name: p.detach().clone() for name, p in module.named_parameters()}
