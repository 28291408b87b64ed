"""The relay transport, rank side: point-to-point messages that travel through the driver, so that
what the audit decides on (which bytes a rank sent, to whom, by which kind of call) is what the
driver relayed, never what the rank says it did (issue 58, item 1; the driver's half is
harness/driver/relay.py).

Why a relay. In a gloo world the rank holds the sockets to its peers, and the backend's own
collectives are one attribute away (``group._get_backend(...)``, a fresh ``ProcessGroupGloo``): a
rank may run an all-gather and then write records of sends that never happened. Here the rank holds
no connection to a peer at all. Its one channel is a TCP connection to the driver's relay, made
while joining the world, before the implementation loads. The relay carries only what a
point-to-point program needs: a message sent to one peer, a receive asking for one, and a barrier
(which carries no data). A backend collective has nothing to run on: it raises, naming the
transport. What goes around the relay (a private gloo group through the store, the store itself, a
file) is written to the kernel, and the audit compares the kernel's count of what the rank wrote
with what the relay read from it (harness/driver/relay_verdicts.py: ``accounted``).

Writes use ``writev``, which the kernel counts in /proc/<pid>/io (harness/rank/syscall_filter.py
refuses ``send`` on any socket but the store's). Receives are pulled: a receive is a request to the
relay, which answers with the first matching message it holds, so the relay also knows which
messages nobody received.

Wire format (both ways): a header ``HEADER`` (kind, peer, request id, tag, payload bytes) and the
payload. ``peer`` is a global rank (``ANY`` for a receive from any source)."""

from __future__ import annotations

import itertools
import json
import os
import socket
import struct
import threading
import zlib

import torch
import torch.distributed as dist

HEADER = struct.Struct("<B3xIIIqQ")  # kind, peer, request, channel (the group's), tag, payload bytes
HELLO, SEND, RECV, BARRIER, MARK, COLLECTIVE = 1, 2, 3, 4, 5, 6  # rank -> relay
DELIVER, RELEASED, REFUSED = 11, 12, 13  # relay -> rank
ANY = 0xFFFFFFFF
TOKEN_BYTES = 32
PHASE_LIMIT = 64  # bytes of a phase label (attribution only: the relay keeps what the rank claims)
DESCRIPTION_LIMIT = 1 << 16  # bytes of a collective's description (JSON: op, dtype, sizes, root)


class TransportRefusal(RuntimeError):
    """A call the relay transport cannot carry (a backend collective), or a receive it refused."""


def _payload(tensor: torch.Tensor) -> bytes:
    """The tensor's bytes, as the relay forwards them."""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _fill(tensors: list, payload: bytes) -> None:
    """Copy the relayed bytes into ``tensors``, in order; raises ValueError where they do not fit."""
    sizes = [t.numel() * t.element_size() for t in tensors]
    if sum(sizes) != len(payload):
        raise ValueError(f"{len(payload)} B arrived for {sum(sizes)} B of tensors")
    flat, start = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload else torch.empty(0, dtype=torch.uint8), 0
    with torch.no_grad():
        for tensor, size in zip(tensors, sizes):
            tensor.copy_(flat[start : start + size].view(tensor.dtype).reshape(tensor.shape))
            start += size


class RelayWork(dist.Work):
    """The Work of a relayed call: complete when the relay answered (a send: when it was written)."""

    def __init__(self, done: bool = False):
        super().__init__()
        self._event = threading.Event()
        self._source: int | None = None
        self._error: str | None = None
        self._tensors: list = []
        if done:
            self._event.set()

    def _finish(self, source: int | None = None, error: str | None = None) -> None:
        self._source, self._error = source, error
        self._event.set()

    def wait(self, timeout=None):
        if not self._event.wait(None if not timeout else timeout.total_seconds()):
            raise RuntimeError("a relayed receive was not answered in time")
        if self._error is not None:
            raise TransportRefusal(self._error)
        return True

    def is_completed(self):
        return self._event.is_set()

    def is_success(self):
        return self._event.is_set() and self._error is None

    def exception(self):
        return None if self._error is None else TransportRefusal(self._error)

    def _source_rank(self):
        return self._source

    def source_rank(self):
        return self._source

    def result(self):
        self.wait()
        return self._tensors

    def get_future(self):
        future = torch.futures.Future()
        self.wait()
        future.set_result(self._tensors)
        return future


class Connection:
    """This process's one connection to the relay (several groups share it: messages carry global
    ranks)."""

    def __init__(self, address: tuple[str, int], token: bytes):
        self._socket = socket.create_connection(address)
        self._socket.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._fd = self._socket.fileno()
        self._lock = threading.Lock()
        self._pending: dict[int, RelayWork] = {}
        self._ids = itertools.count(1)
        self._phase = b""
        self._broken: str | None = None
        self._write(HELLO, 0, 0, 0, token)
        threading.Thread(target=self._read_forever, name="relay-reader", daemon=True).start()

    def _write(self, kind: int, peer: int, request: int, tag: int, payload: bytes = b"", channel: int = 0) -> None:
        buffers = [HEADER.pack(kind, peer, request, channel, tag, len(payload)), payload]
        with self._lock:
            while buffers:
                written = os.writev(self._fd, buffers)
                while buffers and written >= len(buffers[0]):
                    written -= len(buffers[0])
                    buffers.pop(0)
                if buffers and written:
                    buffers[0] = buffers[0][written:]

    def _request(self, kind: int, peer: int, tag: int, payload: bytes, tensors=(), channel: int = 0) -> RelayWork:
        if self._broken is not None:
            raise TransportRefusal(self._broken)
        work = RelayWork()
        work._tensors = list(tensors)
        request = next(self._ids)
        self._pending[request] = work
        self._write(kind, peer, request, tag, payload, channel)
        return work

    def mark(self, phase: str | None) -> None:
        """Tell the relay the phase the rank says it is in (attribution of later messages only)."""
        label = (phase or "").encode()[:PHASE_LIMIT]
        if label != self._phase:
            self._phase = label
            self._write(MARK, 0, 0, 0, label)

    def send(self, tensor: torch.Tensor, peer: int, tag: int, channel: int) -> RelayWork:
        self._write(SEND, peer, 0, tag, _payload(tensor), channel)
        return RelayWork(done=True)

    def recv(self, tensor: torch.Tensor, peer: int, tag: int, channel: int) -> RelayWork:
        return self._request(RECV, peer, tag, struct.pack("<Q", tensor.numel() * tensor.element_size()), [tensor], channel)

    def barrier(self, ranks: list[int], channel: int) -> RelayWork:
        return self._request(BARRIER, 0, 0, struct.pack(f"<{len(ranks)}I", *ranks), channel=channel)

    def collective(self, description: dict, inputs: list, outputs: list, channel: int) -> RelayWork:
        """A backend collective, computed by the relay from every member's inputs (harness/driver/
        relay_collectives.py); the answer fills ``outputs`` in order."""
        text = json.dumps(description).encode()
        payload = struct.pack("<I", len(text)) + text + b"".join(_payload(t) for t in inputs)
        return self._request(COLLECTIVE, 0, 0, payload, outputs, channel)

    def _read_exactly(self, n: int) -> bytes:
        data = bytearray()
        while len(data) < n:
            chunk = self._socket.recv(min(n - len(data), 1 << 20))
            if not chunk:
                raise EOFError("the relay closed the connection")
            data += chunk
        return bytes(data)

    def _read_forever(self) -> None:
        try:
            while True:
                kind, peer, request, _channel, _tag, size = HEADER.unpack(self._read_exactly(HEADER.size))
                payload = self._read_exactly(size)
                work = self._pending.pop(request, None)
                if work is None:
                    continue
                if kind == DELIVER:
                    try:
                        _fill(work._tensors, payload)
                    except (RuntimeError, ValueError) as error:
                        work._finish(peer, f"the relayed message from rank {peer} does not fit the receive: {error}")
                        continue
                    work._finish(source=peer)
                elif kind == RELEASED:
                    work._finish()
                else:
                    work._finish(error=payload.decode(errors="replace"))
        except Exception as error:  # noqa: BLE001 - whatever ends the reader, every waiting call hears of it
            self._broken = f"the relay connection is gone: {error}"
            for work in list(self._pending.values()):
                work._finish(error=self._broken)


class RelayBackend:
    """One group's view of the relay (``ranks``: the group's global ranks, in group order): what
    harness/rank/recording.py's RecordingProcessGroup delegates to in place of gloo. Point-to-point
    calls are relayed messages; a backend collective is computed by the relay from every member's
    inputs, so that the relay sees what it is and what it moved."""

    def __init__(self, connection: Connection, ranks: list[int], phase=lambda: None):
        self._connection, self._ranks = connection, ranks
        self._phase = phase  # () -> the phase the rank's recorder is in (harness/rank/recording.py: mark)
        self.name = lambda: ""  # () -> the group's name, set once c10d names the group

    def _channel(self) -> int:
        """The group's number on the wire: groups with the same members are still apart."""
        return zlib.crc32(self.name().encode())

    def _single(self, tensors) -> torch.Tensor:
        if len(tensors) != 1:
            raise TransportRefusal(f"the relay transport carries one tensor a message, not {len(tensors)}")
        return tensors[0]

    def send(self, tensors, dst: int, tag: int = 0):
        self._connection.mark(self._phase())
        return self._connection.send(self._single(tensors), self._ranks[dst], tag, self._channel())

    def recv(self, tensors, src: int, tag: int = 0):
        self._connection.mark(self._phase())
        return self._connection.recv(self._single(tensors), self._ranks[src], tag, self._channel())

    def recv_anysource(self, tensors, tag: int = 0):
        self._connection.mark(self._phase())
        work = self._connection.recv(self._single(tensors), ANY, tag, self._channel())
        return _GroupRankWork(work, self._ranks)

    def barrier(self, opts=None):
        self._connection.mark(self._phase())
        return self._connection.barrier(self._ranks, self._channel())

    def monitored_barrier(self, timeout=None, wait_all_ranks=False):
        return self.barrier()

    # ---------------------------------------------------------------------------- collectives
    def _collective(self, op: str, inputs, outputs, *, opts=None, root=None, **sizes):
        self._connection.mark(self._phase())
        inputs, outputs = [t for t in inputs], [t for t in outputs]
        dtypes = {str(t.dtype).removeprefix("torch.") for t in [*inputs, *outputs]}
        if len(dtypes) > 1:
            raise TransportRefusal(f"{op} of tensors of several dtypes ({sorted(dtypes)}): the relay computes one dtype a call")
        description = {
            "op": op,
            "group": self._ranks,
            "dtype": dtypes.pop() if dtypes else "uint8",
            "inputs": [t.numel() for t in inputs],
            "outputs": [t.numel() for t in outputs],
            "reduce": _reduce_name(opts),
            "root": root,
            **sizes,
        }
        return self._connection.collective(description, inputs, outputs, self._channel())

    def allreduce(self, tensors, opts=None):
        return self._collective("allreduce", tensors, tensors, opts=opts)

    def allreduce_coalesced(self, tensors, opts=None):
        return self._collective("allreduce_coalesced", tensors, tensors, opts=opts)

    def broadcast(self, tensors, opts=None):
        return self._collective("broadcast", tensors, tensors, root=opts.rootRank)

    def reduce(self, tensors, opts=None):
        return self._collective("reduce", tensors, tensors, opts=opts, root=opts.rootRank)

    def allgather(self, output_tensors, input_tensors, opts=None):
        return self._collective("allgather", input_tensors, [t for ts in output_tensors for t in ts])

    def _allgather_base(self, output, input, opts=None):
        return self._collective("allgather_into_tensor", [input], [output])

    def reduce_scatter(self, output_tensors, input_lists, opts=None):
        return self._collective("reduce_scatter", [t for ts in input_lists for t in ts], output_tensors, opts=opts)

    def _reduce_scatter_base(self, output, input, opts=None):
        return self._collective("reduce_scatter_tensor", [input], [output], opts=opts)

    def alltoall(self, output_tensors, input_tensors, opts=None):
        return self._collective("alltoall", input_tensors, output_tensors)

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        return self._collective(
            "alltoall_base",
            [input],
            [output],
            in_splits=_chunks(input, input_split_sizes, len(self._ranks)),
            out_splits=_chunks(output, output_split_sizes, len(self._ranks)),
        )

    def gather(self, output_lists, input_tensors, opts=None):
        return self._collective("gather", input_tensors, [t for ts in output_lists for t in ts], root=opts.rootRank)

    def scatter(self, output_tensors, input_lists, opts=None):
        return self._collective("scatter", [t for ts in input_lists for t in ts], output_tensors, root=opts.rootRank)

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)

        def refuse(*args, **kwargs):
            raise TransportRefusal(f"the relay transport of this audited world cannot carry {name}")

        return refuse


def _reduce_name(opts) -> str | None:
    if opts is None or not hasattr(opts, "reduceOp"):
        return None
    kind = opts.reduceOp.op
    return next((name for name, value in dist.ReduceOp.RedOpType.__members__.items() if value == kind), str(kind))


def _chunks(tensor: torch.Tensor, split_sizes, n: int) -> list[int]:
    """all_to_all_single's splits (rows of dim 0; none: n equal parts) as element counts."""
    rows = tensor.shape[0] if tensor.dim() else tensor.numel()
    row = tensor.numel() // rows if rows else 0
    splits = [int(s) for s in split_sizes] or [rows // n] * n
    return [s * row for s in splits]


class _GroupRankWork(RelayWork):
    """A receive from any source: c10d asks the Work for the sender's rank in the group."""

    def __init__(self, inner: RelayWork, ranks: list[int]):
        super().__init__(done=True)
        self._inner, self._group_ranks = inner, ranks

    def wait(self, timeout=None):
        return self._inner.wait(timeout)

    def is_completed(self):
        return self._inner.is_completed()

    def _source_rank(self):
        source = self._inner._source_rank()
        return self._group_ranks.index(source) if source in self._group_ranks else -1

    source_rank = _source_rank
