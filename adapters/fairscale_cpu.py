"""What fairscale's FullyShardedDataParallel needs to run on CPU ranks, standing in for its CUDA
stream lines only (docs/libraries.md lists each with the line it replaces). CPU kernels run in
program order on one stream, so ordering side streams has nothing to do there; nothing here
touches what is computed or sent.

* ``torch.cuda.current_stream()``, ``torch.cuda.stream(s)``, ``torch.cuda.Stream()`` inside
  fairscale's FSDP module (its own ``torch`` name, so nothing else in the process sees it): a
  stream that waits for nothing and a context that does nothing; and ``torch.cuda.synchronize()``
  (``summon_full_params`` calls it unguarded), which has nothing to wait for;
* ``self._streams[...]``: FSDP fills it only where ``torch.cuda.is_available()``, and its backward
  hooks index it unconditionally; each FSDP instance's dict gives the stand-in stream instead;
* ``tensor.record_stream(stream)`` for a CPU tensor and the stand-in stream (fairscale keeps the
  CUDA caching allocator from reusing a freed full parameter before a side stream is done; CPU
  memory has no such allocator): nothing; any other call is torch's own."""

from __future__ import annotations

import contextlib
import types

import torch


class CpuStream:
    """The stand-in for a CUDA stream on CPU ranks."""

    def wait_stream(self, stream) -> None:
        return None

    def synchronize(self) -> None:
        return None


_STREAM = CpuStream()


class _Streams(dict):
    def __missing__(self, name):
        return _STREAM


def _cuda_on_cpu():
    cuda = types.SimpleNamespace(**{name: getattr(torch.cuda, name) for name in dir(torch.cuda) if not name.startswith("__")})
    cuda.current_stream = lambda device=None: _STREAM
    cuda.stream = lambda stream=None: contextlib.nullcontext()
    cuda.Stream = CpuStream
    cuda.synchronize = lambda device=None: None
    return cuda


def install() -> None:
    """Once per process: the shims above, on fairscale's FSDP module and on torch.Tensor.record_stream."""
    from fairscale.nn.data_parallel import fully_sharded_data_parallel as fsdp

    if getattr(fsdp, "_conformance_cpu", False) or torch.cuda.is_available():
        return
    namespace = types.SimpleNamespace(**{name: getattr(torch, name) for name in dir(torch) if not name.startswith("__")})
    namespace.cuda = _cuda_on_cpu()
    fsdp.torch = namespace
    original_init = fsdp.FullyShardedDataParallel.__init__

    def init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        self._streams = _Streams()

    fsdp.FullyShardedDataParallel.__init__ = init
    record_stream = torch.Tensor.record_stream

    def record_stream_on_cpu(tensor, stream):
        if isinstance(stream, CpuStream) and tensor.device.type == "cpu":
            return None
        return record_stream(tensor, stream)

    torch.Tensor.record_stream = record_stream_on_cpu
    fsdp._conformance_cpu = True
