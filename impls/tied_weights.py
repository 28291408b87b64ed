"""A weight tied across pipeline stages (a language model's embedding and output head on the first and
the last stage): each stage that uses it holds a copy, each copy's backward leaves only its own
use's gradient, and the gradient of the tied weight is the sum of both uses (Press and Wolf 2017;
Megatron-LM all-reduces the word embedding's gradient over the "embedding group" of the first and
last stage before the optimizer step).

``sync_tied_gradients(stages, tied, group=None)``, called by every rank of the pipeline's group
after the step's pipeline_step calls and before the optimizer's step: ``tied`` lists the copies as
(stage index, parameter name in that stage module); stage s lives on group rank s % p. Each rank
holding copies adds its distinct copies' ``.grad`` (one Parameter listed under two stages of this
rank, as when p = 1, is one copy: autograd already summed its uses), sends that partial sum to the
other holders and receives theirs, and sets every copy's ``.grad`` to the sum of all partial sums in
group-rank order, so the copies stay bitwise equal. Point-to-point only, like the other bundled
strategies.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["sync_tied_gradients"]


def _stage_modules(stages) -> list[nn.Module]:
    return list(stages) if isinstance(stages, (list, tuple)) else [stages]


def _global(group, rank: int) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)


def sync_tied_gradients(stages, tied, group=None) -> None:
    p, me = dist.get_world_size(group), dist.get_rank(group)
    modules = _stage_modules(stages)
    v = len(modules)
    holders = sorted({stage % p for stage, _ in tied})
    if me not in holders:
        return
    copies = []
    for stage, name in tied:
        if stage % p == me:
            if stage // p >= v:
                raise ValueError(f"stage {stage} is not one of this rank's {v} stage(s) (p = {p})")
            parameter = modules[stage // p].get_parameter(name)
            if all(parameter is not seen for seen in copies):
                copies.append(parameter)
    if any(c.grad is None for c in copies):
        raise RuntimeError("a copy of the tied weight has no gradient: call sync_tied_gradients after backward")
    partial = copies[0].grad.detach().clone()
    for other in copies[1:]:
        partial += other.grad
    pieces = {me: partial}
    sends = [dist.isend(partial, _global(group, r), group=group) for r in holders if r != me]
    for r in holders:
        if r != me:
            pieces[r] = torch.empty_like(partial)
            dist.recv(pieces[r], _global(group, r), group=group)
    for work in sends:
        work.wait()
    total = pieces[holders[0]].clone()
    for r in holders[1:]:
        total += pieces[r]
    for copy in copies:
        copy.grad.copy_(total)
