"""What a rank program gets besides the implementation: who it is, where its tensors live, and the
process groups it asks for (created once per world and cached, in the same order on every rank)."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch


class MissingFunction(AttributeError):
    """The implementation under test does not provide a name the capability needs."""


@dataclass
class RankContext:
    rank: int
    world_size: int
    backend: str
    device: torch.device
    _groups: dict = field(default_factory=dict)
    _meshes: dict = field(default_factory=dict)

    def group(self, members):
        """The process group of ``members`` (global ranks), or None for the whole world.

        Every rank of the world must call this with the same members in the same order (it is
        collective: torch.distributed.new_group), which holds because every rank runs the same task.
        """
        if members is None or list(members) == list(range(self.world_size)):
            return None
        key = tuple(sorted(members))
        if key not in self._groups:
            import torch.distributed as dist

            self._groups[key] = dist.new_group(list(key))
        return self._groups[key]

    def device_mesh(self, mesh: list):
        """The DeviceMesh of ``mesh`` ([[dim name, size], ...] over the whole world), made once per
        rank process: init_device_mesh makes a process group per dimension and slice, and a world
        kept alive between examples made them again for each (about 10 file descriptors a rank per
        example of a 2 x 2 mesh, never freed). Collective like ``group``: every rank asks the same."""
        key = tuple((str(name), int(size)) for name, size in mesh)
        if key not in self._meshes:
            from torch.distributed.device_mesh import init_device_mesh

            self._meshes[key] = init_device_mesh(self.device.type, tuple(s for _, s in key), mesh_dim_names=tuple(n for n, _ in key))
        return self._meshes[key]

    def is_member(self, members) -> bool:
        return members is None or self.rank in members

    def to_device(self, value):
        """Move tensors (also inside lists) to this rank's device."""
        if isinstance(value, torch.Tensor):
            return value.to(self.device)
        if isinstance(value, list):
            return [self.to_device(v) for v in value]
        return value

    def to_cpu(self, value):
        if isinstance(value, torch.Tensor):
            return value.detach().cpu()
        if isinstance(value, (list, tuple)):
            return [self.to_cpu(v) for v in value]
        if isinstance(value, dict):
            return {k: self.to_cpu(v) for k, v in value.items()}
        return value


def require(impl, name: str):
    """The implementation's ``name``, or a MissingFunction that says which name and where."""
    try:
        return getattr(impl, name)
    except AttributeError:
        origin = getattr(impl, "__file__", None) or getattr(impl, "__name__", repr(impl))
        raise MissingFunction(f"the implementation under test ({origin}) has no '{name}' (CONTRACT.md lists what it must provide)") from None


def on_members(program):
    """Turn ``program(ctx, impl, process_group, **inputs)`` into a rank program that takes
    ``group`` (global ranks, or None for the world): every rank joins in creating the group, which
    torch.distributed.new_group requires, and only members run the program (others return None)."""

    @functools.wraps(program)
    def run(ctx: RankContext, impl, group=None, **inputs):
        process_group = ctx.group(group)
        if not ctx.is_member(group):
            return None
        return program(ctx, impl, process_group, **inputs)

    return run
