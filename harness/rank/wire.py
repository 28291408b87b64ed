"""Serialization between driver and ranks.

Driver -> rank messages are trusted and use pickle. Rank -> driver messages carry data produced
next to the implementation under test, so they are restricted to plain data: None, bools, numbers,
strings, bytes, lists, tuples, dicts, torch dtypes and tensors. Tensors travel as (dtype, shape,
raw bytes) and the driver unpickles with no global allowed at all, so nothing a rank sends can run
code in the driver. Student code can send wrong numbers (which the verdict catches), never code
that edits its own grade. (torch.load(weights_only=True) would be as safe but costs ~0.35 ms per
message on this machine, a tenth of a warm task at n=4.)
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch

from parallelism_conformance.harness.rank.reply_bounds import Bounds, ReplyRefused, check_pickle  # noqa: F401 - wire.ReplyRefused

_TENSOR = b"\x00tensor"
_DTYPE = b"\x00dtype"


def encode_trusted(message: Any) -> bytes:
    return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)


def decode_trusted(data: bytes) -> Any:
    return pickle.loads(data)


def encode_untrusted(message: Any) -> bytes:
    return pickle.dumps(_pack(message), protocol=pickle.HIGHEST_PROTOCOL)


MAX_REPLY_BYTES = 1 << 30  # a rank's reply; the largest legitimate one (15 MiB tensors x 4) is far below
MIN_REPLY_LIMIT = 64 << 20  # what reply_limit never goes below: over twice the largest legitimate reply


def reply_limit(memory_bytes: int | None, world_size: int) -> int:
    """The largest reply the driver accepts from one rank of a world of ``world_size``, where its
    memory limit is ``memory_bytes`` (None: none). The driver holds a task's decoded replies until
    it has all of them, and decoding one holds it about three times over (the bytes received, the
    unpickled bytes, the tensors' own copies): (world_size + 2) replies at most. A quarter of the
    memory shared that way leaves the rest to the driver and its ranks: a rank that streamed a reply
    just under a fixed 1 GiB got the driver OOM-killed in a 1.5 GiB container (0 tests reported).
    At 1.5 GiB: 64 MiB per rank of a world of 4."""
    if memory_bytes is None:
        return MAX_REPLY_BYTES
    return int(min(MAX_REPLY_BYTES, max(MIN_REPLY_LIMIT, memory_bytes // (4 * (world_size + 2)))))


class _Budget:
    """The walk's count of values reached (a shared one each time) and their depth."""

    def __init__(self, bounds: Bounds):
        self.left, self.values, self.depth = bounds.values, bounds.values, bounds.depth

    def spend(self, depth: int) -> None:
        self.left -= 1
        if self.left < 0:
            raise ReplyRefused(f"a reply of more than {self.values} values (the limit), shared ones counted each time")
        if depth > self.depth:
            raise ReplyRefused(f"a reply nested more than {self.depth} levels deep (the limit)")


def decode_untrusted(data: bytes, bounds: Bounds | None = None) -> Any:
    """Plain data only, bounded: at most MAX_REPLY_BYTES, and within ``bounds`` (reply_bounds.Bounds:
    values, nesting, text, integers), checked twice. First on the bytes, before anything is built
    (reply_bounds.check_pickle): a reply within its length limit could otherwise stand for gigabytes
    of empty containers, built by the unpickler before any walk sees them. Then on what was built:
    a pickle may reference one object many times (memo), so a short reply can stand for an
    exponentially large tree (161 bytes once took 6.9 s to walk); the walk below counts every value
    it reaches and stops at the bound."""
    bounds = bounds or Bounds()
    if len(data) > MAX_REPLY_BYTES:
        raise ReplyRefused(f"a reply of {len(data)} bytes (at most {MAX_REPLY_BYTES})")
    check_pickle(data, bounds)
    try:
        return _unpack(_PlainDataUnpickler(io.BytesIO(data)).load(), _Budget(bounds), 0)
    except RecursionError:
        raise ReplyRefused("a reply nested too deeply") from None


class _PlainDataUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"a rank may send plain data only, not {module}.{name}")


def _pack(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        tensor = value.detach().cpu().contiguous()
        raw = tensor.reshape(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b""
        return (_TENSOR, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), raw)
    if isinstance(value, torch.dtype):
        return (_DTYPE, str(value).removeprefix("torch."))
    if isinstance(value, dict):
        return {_pack(k): _pack(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        packed = [_pack(v) for v in value]
        return packed if isinstance(value, list) else tuple(packed)
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return value
    raise TypeError(f"a rank program may return tensors, numbers, strings and containers, not {type(value).__name__}")


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise pickle.UnpicklingError(f"unknown dtype {name!r}")
    return dtype


def _unpack(value: Any, budget: _Budget, depth: int) -> Any:
    budget.spend(depth)
    if isinstance(value, tuple) and value and value[0] == _TENSOR:
        _, name, shape, raw = value
        dtype = _dtype(name)
        if not raw:
            if 0 not in shape:  # a tensor with elements and no bytes: refuse rather than allocate it
                raise ReplyRefused(f"a tensor of shape {shape!r} with no data")
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape)
    if isinstance(value, tuple) and value and value[0] == _DTYPE:
        return _dtype(value[1])
    depth += 1
    if isinstance(value, dict):
        return {_unpack(k, budget, depth): _unpack(v, budget, depth) for k, v in value.items()}
    if isinstance(value, list):
        return [_unpack(v, budget, depth) for v in value]
    if isinstance(value, tuple):
        return tuple(_unpack(v, budget, depth) for v in value)
    return value
