"""torch.distributed.checkpoint (DCP) behind the suite's checkpoint contract: ``save_checkpoint`` and
``load_checkpoint`` for torch's FSDP2 (adapters/torch_fsdp.py) and ZeroRedundancyOptimizer
(adapters/torch_zero.py), at any world size.

The checkpoint is one DCP state dict: ``model`` is ``get_model_state_dict(model)`` (DTensors under
FSDP2, plain tensors otherwise; DCP writes a replicated tensor once and reshards on load) and
``optim`` is ``{name: {key: tensor}}``, the local optimizer's state keyed by parameter name (under
ZeRO-1, ``.optim``, each owner its own parameters'). Loading asks DCP for the model's state dict
(strict: a name the checkpoint lacks, or a shape it saved otherwise, is an error) and for the state
of exactly the parameters this rank's optimizer holds and the checkpoint has, then sets them.
``rng`` holds each rank's default generator state under a key of its own; a load at the saved world
size gives rank r rank r's (DCP saves no random state by itself).

Why not ``get_optimizer_state_dict``/``set_optimizer_state_dict`` for the optimizer: on an
optimizer without state, torch's ``_init_optim_state`` first runs a step with zero gradients and
lr 0, which gives every parameter a state (AdamW's step count 1). Saved from a ZeRO-1 rank whose
parameters had no gradient yet, that invents state one process never had; as a load template it
asks DCP for state the checkpoint may not hold. Keyed by name by hand, a parameter saved without
state gets none."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.optim import ZeroRedundancyOptimizer


def _local_optimizer(optimizer) -> torch.optim.Optimizer:
    return optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer


def _names(model) -> dict[int, str]:
    """{id(parameter): its name} (a tied parameter under its first name)."""
    return {id(p): name for name, p in model.named_parameters()}


def _held(model, optimizer) -> dict[str, torch.Tensor]:
    """{name: parameter} of the parameters this rank's optimizer steps."""
    names = _names(model)
    return {names[id(p)]: p for group in _local_optimizer(optimizer).param_groups for p in group["params"] if id(p) in names}


def save_checkpoint(path: str, model, optimizer) -> None:
    local = _local_optimizer(optimizer)
    optim = {name: dict(local.state[p]) for name, p in _held(model, optimizer).items() if local.state.get(p)}
    rng = {f"rank{dist.get_rank()}": torch.get_rng_state()}  # a key per rank: DCP writes each rank's own
    dcp.save({"model": get_model_state_dict(model), "optim": optim, "rng": rng}, checkpoint_id=path)


def load_checkpoint(path: str, model, optimizer) -> None:
    saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    model_state = get_model_state_dict(model)
    optim = {}
    for name, p in _held(model, optimizer).items():
        prefix = f"optim.{name}."
        keys = [key[len(prefix) :] for key in saved if key.startswith(prefix) and "." not in key[len(prefix) :]]
        if keys:
            optim[name] = {key: _like(p, saved[prefix + key]) for key in keys}
    state = {"model": model_state, "optim": optim}
    streams = [key for key in saved if key.startswith("rng.rank")]
    if len(streams) == dist.get_world_size():  # the saved world size: this rank continues its own stream
        state["rng"] = {f"rank{dist.get_rank()}": torch.empty_like(torch.get_rng_state())}
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])
    if "rng" in state:
        torch.set_rng_state(state["rng"][f"rank{dist.get_rank()}"])
    local = _local_optimizer(optimizer)
    for name, p in _held(model, optimizer).items():
        if name in optim:
            local.state[p] = optim[name]


def _like(parameter: torch.Tensor, metadata) -> torch.Tensor:
    """A tensor for DCP to load a state entry into: shaped like the parameter (a DTensor under
    FSDP2, so DCP reads this rank's shard) or, for a step count, a scalar of the saved dtype."""
    size = tuple(getattr(metadata, "size", ()))
    dtype = metadata.properties.dtype
    if size == tuple(parameter.shape) and size != ():
        return torch.zeros_like(parameter, dtype=dtype)
    return torch.zeros(size, dtype=dtype)
