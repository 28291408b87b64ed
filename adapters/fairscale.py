"""fairscale through the suite's sharded contracts, as fairscale's users train with it
(CONTRACT.md, "Libraries that train through their own object", names the hooks):

* ``ShardedOptimizer``: ``fairscale.optim.OSS`` (ZeRO-1: each rank owns whole parameters, steps
  them, and broadcasts them) with ``fairscale.nn.ShardedDataParallel`` around the model
  (``wrap_model``), its documented pairing: SDP reduces each gradient to the rank whose OSS shard
  owns it, during backward. adapters/fairscale_oss.py pairs OSS with torch's DDP instead, the
  other documented way.
* ``fully_shard`` / ``full_parameters``: ``fairscale.nn.FullyShardedDataParallel``, nested as its
  users nest it: ``fully_shard(unit)`` marks a unit, and the root's ``fully_shard`` wraps each
  marked unit in its own FSDP inside its parent (what ``fairscale.nn.wrap`` does), then the root;
  ``reshard_after_forward`` is FSDP's own keyword (ZeRO-2's traffic when False),
  ``compute_device`` the parameters' device (FSDP defaults to CUDA), ``flatten_parameters`` its
  default. ``full_parameters`` reads them inside ``summon_full_params()`` under the names before
  sharding (fairscale's ``_clean_path``, which its ``named_parameters`` applies there); buffers
  too are named as before wrapping.

fairscale's FSDP was written for CUDA: with ``compute_device=cpu`` it still orders its side
streams with ``torch.cuda.current_stream()``, ``torch.cuda.stream(...)`` and
``tensor.record_stream(...)``, which a CPU torch refuses. adapters/fairscale_cpu.py stands each of
those lines in with a no-op on CPU (CPU kernels run in program order on one stream, so there is
nothing to order; the shims are listed in docs/libraries.md with the line each replaces); none
touches what is computed or sent. Its NCCL-only ``_all_gather_base``/``_reduce_scatter_base`` are
switched off by the library's own ``ENABLE_NCCL_BASE_COLLECTIVES=0`` (set for the ranks by
scripts/libraries; the adapter sets it too, before fairscale is imported).

What it cannot run (NotImplementedError on every rank, before anything is built): a
``compute_dtype`` (fairscale's ``mixed_precision`` is FP16 compute with FP32 masters, set by its
own keyword, not the contract's) and a ``gradient_divide_factor`` (fairscale's
``gradient_predivide_factor`` divides before and after a world-size average).
"""

from __future__ import annotations

import os

import torch
from torch import nn

os.environ.setdefault("ENABLE_NCCL_BASE_COLLECTIVES", "0")  # read once, when fairscale's FSDP is imported


# The keys the driver drew for this task (``configure``; {} = fairscale's defaults), each "Class.keyword"
# of the object the adapter builds, or "zero_grad": which object's zero_grad the loop's call reaches.
_drawn: dict = {}


def configure(configuration: dict) -> None:
    """The contract's hook for a library's configuration (harness/driver/libraries/table.py's
    fairscale settings): keywords of ShardedDataParallel and FullyShardedDataParallel, and which
    object the loop zeroes through."""
    _drawn.clear()
    _drawn.update(configuration)


def _keywords(cls: str) -> dict:
    return {key.partition(".")[2]: value for key, value in _drawn.items() if key.startswith(f"{cls}.")}


def _refuse_keywords(**given) -> None:
    named = [name for name, value in given.items() if value is not None]
    if named:
        raise NotImplementedError(
            f"fairscale cannot take the contract's {', '.join(named)}: its mixed precision is "
            "FSDP's mixed_precision (FP16 compute) and its division gradient_predivide_factor "
            "around the world-size average"
        )


class _OSSWithSDP:
    """OSS over the parameters; ``wrap_model`` puts the model in ShardedDataParallel with it."""

    def __init__(self, params, optimizer_class, group=None, **defaults):
        from fairscale.optim import OSS

        self._oss = OSS(list(params), optim=optimizer_class, group=group, **defaults)

    def wrap_model(self, model: nn.Module) -> nn.Module:
        from fairscale.nn import ShardedDataParallel

        self._model = ShardedDataParallel(model, self._oss, **_keywords("ShardedDataParallel"))
        return self._model

    @property
    def optim(self):
        return self._oss.optim

    def zero_grad(self, set_to_none: bool = True) -> None:
        # fairscale's users zero through either object (ShardedDataParallel.zero_grad exists for it)
        owner = getattr(self, "_model", None) if _drawn.get("zero_grad") == "model" else None
        (owner or self._oss).zero_grad(set_to_none=set_to_none)

    def step(self, closure=None):
        return self._oss.step(closure)


def ShardedOptimizer(params, optimizer_class, group=None, **defaults):
    return _OSSWithSDP(params, optimizer_class, group, **defaults)


def _fsdp_class():
    from fairscale.nn import FullyShardedDataParallel
    from fairscale.nn.data_parallel.fully_sharded_data_parallel import _clean_path

    from parallelism_conformance.adapters import fairscale_cpu

    fairscale_cpu.install()

    class Sharded(FullyShardedDataParallel):
        def named_buffers(self, *args, **kwargs):
            for name, buffer in super().named_buffers(*args, **kwargs):
                yield _clean_path(name), buffer

    return Sharded


def fully_shard(
    module: nn.Module, group=None, reshard_after_forward: bool = True, compute_dtype=None, gradient_divide_factor=None
) -> nn.Module:
    """A module with units marked inside it is a root: each unit is wrapped in its parent, then the
    module; any other is a unit, marked and returned as it is (the contract shards the units
    first, then the root; a model with no unit to shard is not in the suite's models)."""
    _refuse_keywords(compute_dtype=compute_dtype, gradient_divide_factor=gradient_divide_factor)
    options = {"process_group": group, "reshard_after_forward": reshard_after_forward, **_keywords("FullyShardedDataParallel")}
    units = [
        (owner, name, child) for owner in module.modules() for name, child in owner.named_children() if "_fairscale_unit" in child.__dict__
    ]
    if not units:
        module.__dict__["_fairscale_unit"] = options  # wrapped when its root is
        return module
    _refuse_what_fsdp_refuses(module, [child for _, _, child in units])
    sharded = _fsdp_class()
    device = next((p.device for p in module.parameters()), torch.device("cpu"))
    for owner, name, child in units:
        setattr(owner, name, sharded(child, compute_device=device, **child.__dict__.pop("_fairscale_unit")))
    return sharded(module, compute_device=device, **options)


def _refuse_what_fsdp_refuses(root: nn.Module, units: list) -> None:
    """fairscale's FSDP asserts, on every rank, what these raise first with its own words."""
    if any(p.dtype != torch.float32 for p in root.parameters()):
        raise NotImplementedError(
            "fairscale's FullyShardedDataParallel cannot shard parameters other than float32 "
            "without its mixed precision: 'Expecting FP16 param type in FP32 & MP modes.'"
        )
    inside = {id(p) for unit in units for p in unit.parameters()}
    for owner, parameters in [*((u, list(u.parameters())) for u in units), (root, [p for p in root.parameters() if id(p) not in inside])]:
        if len({p.requires_grad for p in parameters}) > 1:
            raise NotImplementedError(
                "fairscale's FullyShardedDataParallel cannot flatten frozen and trainable "
                "parameters into one FlatParameter: 'expects all parameters to have same "
                f"requires_grad' ({type(owner).__name__})"
            )


def full_parameters(module: nn.Module) -> dict:
    from fairscale.nn.data_parallel.fully_sharded_data_parallel import _clean_path

    with module.summon_full_params():
        return {_clean_path(name): p.detach().clone() for name, p in module.named_parameters()}
