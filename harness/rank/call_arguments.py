"""The arguments of a process-group call, as the perturbation (harness/rank/perturbation.py) reads
them: the tensors they hold, whether those are plain (contiguous, dense, strided), whether inputs
and outputs share storage, the arguments with their tensors replaced, whether this rank is a
broadcast's root, and the key of what a call must not overtake."""

from __future__ import annotations

import torch


def key(group, method: str, args, match_tags: bool) -> tuple:
    """What a call must not overtake: a send to the same peer (with the same tag, where the backend
    matches by tag), a receive from it, a collective of the group."""
    if method in ("send", "recv"):
        tag = (args[2] if len(args) > 2 else 0) if match_tags else None
        return id(group), method, args[1] if len(args) > 1 else None, tag
    return id(group), "collective"


def is_root(group, args) -> bool:
    options = next((a for a in args if hasattr(a, "rootRank")), None)
    return options is not None and options.rootRank == group.rank()


def all_plain(value) -> bool:
    return all(plain(t) for t in tensors(value))


def plain(tensor: torch.Tensor) -> bool:
    return tensor.layout == torch.strided and tensor.is_contiguous() and type(tensor) in (torch.Tensor, torch.nn.Parameter)


def overlap(inputs, outputs) -> bool:
    if not inputs or not outputs:
        return False
    storages = {t.untyped_storage().data_ptr() for t in outputs}
    return any(t.untyped_storage().data_ptr() in storages for t in inputs)


def tensors(value) -> list:
    if isinstance(value, torch.Tensor):
        return [value]
    out = []
    for item in value or ():
        out.extend(tensors(item))
    return out


def mapped(value, function):
    if isinstance(value, torch.Tensor):
        return function(value)
    if isinstance(value, (list, tuple)):
        return type(value)(mapped(v, function) for v in value)
    return value
