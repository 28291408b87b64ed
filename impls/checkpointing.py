"""Checkpoints that reshard: ``save_checkpoint(path, model, optimizer)`` and
``load_checkpoint(path, model, optimizer)`` for the layouts of the contract, fully sharded
(:mod:`impls.fully_sharded`), ZeRO-1 (:mod:`impls.sharded_optimizer`), tensor parallel
(:mod:`impls.tensor_parallel`) and pipeline stages on a pp x dp mesh, at any world size.

The format does not depend on the layout that wrote it, as in torch.distributed.checkpoint (DCP):
every tensor (parameter, buffer, optimizer state) is its full tensor, and a rank writes the pieces
it holds with where they go, so the pieces of one tensor cover it once. A fully sharded parameter's
piece is a range of the flattened tensor (offset rank * ceil(numel / n), the padding left out); a
tensor-parallel shard is a block at its offset along the dimension it was cut (DCP's chunk); a
tensor held whole by several ranks is written once, each holder its own contiguous share of it
flattened (its holders: every rank under data or tensor parallelism, the replicas of a stage on a
pipeline mesh, found by one exchange of names, as DCP's planner dedups); ZeRO-1's optimizer state is
written whole by its owner. Files: ``rank<r>.pt`` per rank (torch.save of plain
data, read back with weights_only) and ``metadata.json`` from rank 0 (the world size, the rank
files, every parameter's and buffer's shape and dtype).

Loading is layout-free in the same way: every rank reads the metadata, refuses a model whose
tensors differ from it by name or shape, reads every rank file, puts each piece at its offset and
refuses unless every element of every tensor came from exactly one piece (a missing or cut file is
named, never read as zeros), then keeps what its own layout holds. Every rank reads the same files
and so refuses alike, before any collective. (DCP reads only the pieces that overlap what a rank
needs; reading all is simpler and fine at the sizes of a conformance test.)

Each rank's file also holds its default random generator's state, which a load at the same world
size gives back to the rank of the same number.

Optimizer state is keyed by parameter name, never by position: positions differ between a fully
sharded optimizer and ZeRO-1's owners, and between world sizes (databricks/flashoptim#3: optimizer
state loaded into the wrong parameters after a save/load). A parameter saved without state gets
none, so its first step starts it as one process would.

Never imports reference/.
"""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist
from torch import nn

from . import collectives
from .fully_sharded import _STATE
from .sharded_optimizer import ShardedOptimizer
from .tensor_parallel import ColumnParallelLinear, RowParallelLinear

METADATA = "metadata.json"
FORMAT = 2


class _Held:
    """What this rank holds of one named tensor (a parameter or a buffer) of full shape ``shape``,
    and so what it writes of it (and of optimizer state shaped like it) and what it keeps on load:

    * ``flat_piece`` (fully sharded): local element i is element ``offset`` + i of the flattened full
      tensor, for i < ``length`` (the rest is padding);
    * ``block`` (tensor parallel): the local tensor is ``full.narrow(dim, offset, length)``;
    * ``replicated``: the whole tensor; this rank writes elements [offset, offset + length) of it
      flattened, its contiguous share, so that the world writes it once."""

    def __init__(self, local: torch.Tensor, shape: torch.Size, kind: str, offset: int, length: int, dim=None):
        self.local, self.shape, self.kind, self.offset, self.length, self.dim = local, shape, kind, offset, length, dim

    @property
    def numel(self) -> int:
        return self.shape.numel()

    def written(self, tensor: torch.Tensor) -> tuple:
        """(dim, offset, values): what this rank writes of ``tensor`` (shaped like the local tensor)."""
        tensor = tensor.detach()
        if self.kind == "block":
            return self.dim, self.offset, tensor.clone()
        start = 0 if self.kind == "flat_piece" else self.offset
        return None, self.offset, tensor.reshape(-1)[start : start + self.length].clone()

    def keep(self, full: torch.Tensor, into: torch.Tensor) -> None:
        """Copy into ``into`` (shaped like the local tensor) what this rank keeps of ``full``."""
        if self.kind == "block":
            into.copy_(full.narrow(self.dim, self.offset, self.length))
        elif self.kind == "flat_piece":
            into.reshape(-1)[: self.length].copy_(full.reshape(-1)[self.offset : self.offset + self.length])
        else:
            into.copy_(full)


def _chunk(numel: int, n: int, rank: int) -> tuple[int, int]:
    """Rank ``rank``'s contiguous n-th of ``numel`` elements: (offset, length)."""
    size = -(-numel // n)
    offset = min(rank * size, numel)
    return offset, min(size, numel - offset)


def _split_tensors(model: nn.Module) -> dict[int, tuple]:
    """{id(local tensor): (kind, group, full shape, dim)} for the tensors a layout splits: fully
    sharded pieces and the tensor-parallel layers' shards (column: weight and bias rows; row:
    weight columns, its bias whole)."""
    split = {}
    for module in model.modules():
        unit = getattr(module, _STATE, None)
        if unit is not None:
            for piece, (_, shape, _) in zip(unit.pieces(), unit.sharded):
                split[id(piece)] = ("flat_piece", unit.group, shape, None)
        dims = {ColumnParallelLinear: {"weight": 0, "bias": 0}, RowParallelLinear: {"weight": 1}}.get(type(module), {})
        for attribute, dim in dims.items():
            tensor = getattr(module, attribute, None)
            if tensor is not None:
                n = dist.get_world_size(module.group)
                shape = list(tensor.shape)
                shape[dim] *= n
                split[id(tensor)] = ("block", module.group, torch.Size(shape), dim)
    return split


def _held(model: nn.Module) -> tuple[dict[str, _Held], dict[str, dict]]:
    """({name: what this rank holds} for every parameter (a tied one once) and buffer of ``model``,
    the world's view: {name: {"shape", "dtype", "holders"}} over every rank's model). A tensor held
    whole is written once: its holders (every rank under data or tensor parallelism, a stage's
    replicas in a pipeline) each write a contiguous share of it."""
    split = _split_tensors(model)
    local = {name: tensor for name, tensor in [*model.named_parameters(), *model.named_buffers()]}
    world = _world_view(
        {
            name: (list(_full_shape(tensor, split)), str(tensor.dtype).removeprefix("torch."), id(tensor) not in split)
            for name, tensor in local.items()
        },
        _device(model),
    )
    rank = dist.get_rank()
    held = {}
    for name, tensor in local.items():
        if id(tensor) not in split:
            holders = world[name]["holders"]
            offset, length = _chunk(tensor.numel(), len(holders), holders.index(rank))
            held[name] = _Held(tensor, tensor.shape, "replicated", offset, length)
            continue
        kind, group, shape, dim = split[id(tensor)]
        r = dist.get_rank(group)
        if kind == "block":
            held[name] = _Held(tensor, shape, kind, r * tensor.shape[dim], tensor.shape[dim], dim)
        else:
            offset = r * tensor.numel()
            held[name] = _Held(tensor, shape, kind, offset, max(0, min(tensor.numel(), shape.numel() - offset)))
    return held, world


def _full_shape(tensor: torch.Tensor, split: dict) -> torch.Size:
    return split[id(tensor)][2] if id(tensor) in split else tensor.shape


def _device(model: nn.Module) -> torch.device:
    """Where the model's tensors are: the exchanges go there (NCCL takes CUDA tensors only)."""
    return next((t.device for t in [*model.parameters(), *model.buffers()]), torch.device("cpu"))


def _world_view(mine: dict[str, tuple], device: torch.device) -> dict[str, dict]:
    """Every rank's {name: (full shape, dtype, held whole)}, exchanged (two all-gathers: the
    lengths, then the padded bytes), as {name: {"shape", "dtype", "holders": the ranks that hold it
    whole, in rank order}}."""
    data = torch.tensor(list(json.dumps(mine).encode()), dtype=torch.uint8, device=device)
    world = dist.get_world_size()
    lengths = torch.zeros(world, dtype=torch.int64, device=device)
    collectives.all_gather_into_tensor(lengths, torch.tensor([data.numel()], device=device))
    longest = int(lengths.max())
    gathered = torch.zeros(world * longest, dtype=torch.uint8, device=device)
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[: data.numel()] = data
    collectives.all_gather_into_tensor(gathered, padded)
    view: dict[str, dict] = {}
    for r in range(world):
        theirs = json.loads(bytes(gathered[r * longest : r * longest + int(lengths[r])].tolist()).decode())
        for name, (shape, dtype, whole) in theirs.items():
            entry = view.setdefault(name, {"shape": shape, "dtype": dtype, "holders": []})
            if whole:
                entry["holders"].append(r)
    return view


def _optimizer_state(optimizer) -> tuple[dict, bool]:
    """(the torch optimizer's state, keyed by parameter object; whether each entry is whole, as
    ZeRO-1's owner holds it) of the contract's optimizers."""
    if isinstance(optimizer, ShardedOptimizer):
        return optimizer.optim.state, True
    return optimizer.state, False


@torch.no_grad()
def save_checkpoint(path: str, model: nn.Module, optimizer) -> None:
    """Write this rank's pieces of ``model``'s parameters and buffers and of ``optimizer``'s state
    under ``path``; rank 0 also writes the metadata. Returns once every rank has written."""
    held, world_view = _held(model)
    states, whole = _optimizer_state(optimizer)
    pieces, scalars = [], []  # (name, state key or None, dim, offset, values); (name, key, value)
    for name, h in held.items():
        pieces.append((name, None, *h.written(h.local)))
        for key, value in states.get(h.local, {}).items():
            if torch.is_tensor(value) and value.shape == h.local.shape and value.dim() > 0:
                pieces.append((name, key, None, 0, value.detach().reshape(-1).clone()) if whole else (name, key, *h.written(value)))
            else:  # a step counter: the same on every rank that holds the parameter
                scalars.append((name, key, value.detach().clone() if torch.is_tensor(value) else value))
    os.makedirs(path, exist_ok=True)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.save({"format": FORMAT, "pieces": pieces, "scalars": scalars, "rng": torch.get_rng_state()}, os.path.join(path, f"rank{rank}.pt"))
    if rank == 0:
        tensors = {name: {"shape": entry["shape"], "dtype": entry["dtype"]} for name, entry in world_view.items()}
        with open(os.path.join(path, METADATA), "w") as file:
            json.dump({"format": FORMAT, "world_size": world, "files": [f"rank{r}.pt" for r in range(world)], "tensors": tensors}, file)
    collectives.all_reduce(torch.zeros(1, device=_device(model)), group=None)  # a barrier: whole when any rank returns


def _read(path: str, name: str, what: str):
    file = os.path.join(path, name)
    if not os.path.exists(file):
        raise FileNotFoundError(f"checkpoint {path!r} has no {name} ({what})")
    try:
        if name == METADATA:
            with open(file) as handle:
                return json.load(handle)
        return torch.load(file, weights_only=True, map_location="cpu")  # assembled on the CPU, then copied to the device
    except Exception as error:
        raise ValueError(f"checkpoint {path!r}: {name} ({what}) cannot be read: {error}") from error


def _check_architecture(metadata: dict, world_view: dict[str, dict], path: str) -> None:
    """The checkpoint's tensors against the world's model (every rank's, so that a pipeline stage
    holding a part of it is judged whole, and every rank refuses alike)."""
    saved = {name: tuple(entry["shape"]) for name, entry in metadata["tensors"].items()}
    here = {name: tuple(entry["shape"]) for name, entry in world_view.items()}
    problems = [f"{name} is not in the model" for name in saved if name not in here]
    problems += [f"the model's {name} is not in the checkpoint" for name in here if name not in saved]
    problems += [
        f"{name} was saved as {list(saved[name])}, the model's is {list(here[name])}"
        for name in saved
        if name in here and saved[name] != here[name]
    ]
    if problems:
        raise ValueError(f"checkpoint {path!r} is of another architecture: " + "; ".join(problems))


def _assemble(pieces: list, shapes: dict[tuple, torch.Size], dtypes: dict[tuple, torch.dtype], path: str):
    """({(name, key): the full tensor}, {(name, key): how many pieces wrote each element}) from
    ``pieces`` (name, state key or None, dim, offset, values): values at ``offset`` of the flattened
    tensor (dim None) or the block at ``offset`` along ``dim``."""
    full, covered = {}, {}
    for name, key, dim, offset, values in pieces:
        which = (name, key)
        if values.numel() == 0:  # a rank whose piece is all padding
            continue
        if which not in shapes:
            raise ValueError(f"checkpoint {path!r} holds {key or 'the tensor'} of {name}, which the model does not have")
        shape = shapes[which]
        if which not in full:
            full[which] = torch.zeros(shape, dtype=dtypes.get(which, values.dtype))
            covered[which] = torch.zeros(shape, dtype=torch.int32)
        if dim is None:
            fits = 0 <= offset and offset + values.numel() <= shape.numel() and values.dim() == 1
        else:
            fits = (
                0 <= dim < len(shape)
                and values.dim() == len(shape)
                and 0 <= offset
                and offset + values.shape[dim] <= shape[dim]
                and all(values.shape[d] == shape[d] for d in range(len(shape)) if d != dim)
            )
        if not fits:
            raise ValueError(
                f"checkpoint {path!r}: a piece of {name} {key or ''} of shape {list(values.shape)} at "
                f"{offset} (dim {dim}) does not fit its shape {list(shape)}"
            )
        if dim is None:
            into = [t.view(-1)[offset : offset + values.numel()] for t in (full[which], covered[which])]
        else:
            into = [t.narrow(dim, offset, values.shape[dim]) for t in (full[which], covered[which])]
        into[0].copy_(values.view(into[0].shape))
        into[1].add_(1)
    return full, covered


def _check_whole(covered: dict, shapes: dict, path: str) -> None:
    """Refuse unless every element of every parameter, buffer and saved state tensor came from
    exactly one piece: a missing or cut file is named, never read as zeros."""
    absent = [name for name, key in shapes if key is None and (name, key) not in covered and shapes[(name, key)].numel()]
    if absent:
        raise ValueError(f"checkpoint {path!r} has no element of {', '.join(absent)}: a file is missing or cut")
    for which, count in covered.items():
        if not bool((count == 1).all()):
            missing = int((count == 0).sum())
            raise ValueError(
                f"checkpoint {path!r}: {missing} elements of {which[0]} {which[1] or ''} are in no file"
                + (" and some in two" if bool((count > 1).any()) else "")
                + ": a file is missing or cut"
            )


@torch.no_grad()
def load_checkpoint(path: str, model: nn.Module, optimizer) -> None:
    """Load what ``save_checkpoint`` wrote, from any layout and world size, into ``model`` and
    ``optimizer`` under theirs. Raises (on every rank alike) on another architecture or a checkpoint
    that is not whole; the model and optimizer are changed only after every check has passed."""
    held, world_view = _held(model)
    metadata = _read(path, METADATA, "the metadata rank 0 writes")
    if metadata.get("format") != FORMAT:
        raise ValueError(f"checkpoint {path!r} is in format {metadata.get('format')!r}, not {FORMAT}")
    _check_architecture(metadata, world_view, path)
    contents = [_read(path, name, "one rank's pieces") for name in metadata["files"]]
    states, whole = _optimizer_state(optimizer)
    shapes = {(name, None): h.shape for name, h in held.items()}
    dtypes = {(name, None): h.local.dtype for name, h in held.items()}
    for content in contents:
        for name, key, _, _, values in content["pieces"]:
            if key is not None and name in held:
                shapes[(name, key)], dtypes[(name, key)] = held[name].shape, values.dtype
    # what another rank holds (another pipeline stage) is not read here; a name no rank holds is refused
    pieces = [p for content in contents for p in content["pieces"] if p[0] in held or p[0] not in world_view]
    full, covered = _assemble(pieces, shapes, dtypes, path)
    _check_whole(covered, shapes, path)
    counters = {(name, key): value for content in contents for name, key, value in content["scalars"]}
    saved: dict[str, dict] = {}  # {parameter name: {state key: full tensor or counter}}, in saved order
    for (name, key), value in [*((k, v) for k, v in full.items() if k[1] is not None), *counters.items()]:
        saved.setdefault(name, {})[key] = value
    for name, h in held.items():
        if (name, None) in full:  # (an empty tensor has no piece)
            h.keep(full[(name, None)], h.local)
    stepped = {id(p) for group in (optimizer.optim if whole else optimizer).param_groups for p in group["params"]}
    _restore_state(states, {name: h for name, h in held.items() if id(h.local) in stepped}, saved, whole)
    _restore_random_stream(metadata, contents)


def _restore_random_stream(metadata: dict, contents: list[dict]) -> None:
    """At the saved world size, rank r's default generator continues rank r's stream (each rank its
    own: Megatron-LM#6858 restored another rank's on 252 of 256 ranks). At another size there is no
    rank to take it from, and the generator is left as it is."""
    if metadata["world_size"] == dist.get_world_size():
        torch.set_rng_state(contents[dist.get_rank()]["rng"])


def _restore_state(states: dict, held: dict[str, _Held], saved: dict[str, dict], whole: bool) -> None:
    """Give each parameter this rank's optimizer steps (``held``) its saved state, by name; one
    saved without state (or another rank's, under ZeRO-1) gets none."""
    for name, h in held.items():
        if name not in saved:
            continue
        state = {}
        for key, value in saved[name].items():
            if torch.is_tensor(value) and value.dim() > 0 and value.shape == h.shape:  # shaped like the parameter
                state[key] = torch.zeros_like(h.local)
                if whole:
                    state[key].copy_(value)
                else:
                    h.keep(value, state[key])
            else:  # a step counter
                state[key] = value.clone() if torch.is_tensor(value) else value
        states[h.local] = state
