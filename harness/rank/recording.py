"""The communication audit's recorder: a process-group backend that writes down every call a rank
makes (operation, group, dtype, element count, bytes, peer or root) and then delegates the call to
a real backend (gloo, or NCCL), returning its Work.

How it sees everything. ``register(inner)`` registers a backend ``recording_<inner>`` with
torch.distributed.Backend.register_backend; its creator returns a ``RecordingProcessGroup``, a Python
subclass of torch.distributed.ProcessGroup (pybind trampoline, as torch's own
testing/_internal/distributed/multi_threaded_pg.py does). c10d then uses that object as the group
itself, so:

* Python calls (dist.all_reduce, dist.isend, ...) find the overrides below by attribute lookup;
* C++ calls (DDP's Reducer, which broadcasts parameters in its constructor and all-reduces gradient
  buckets in backward; functional collectives under DTensor) go through ProcessGroup's virtual
  methods, which the trampoline forwards to the same Python overrides;
* new_group creates subgroups with the default group's backend, so subgroups record too.

No real backend is registered on the recording group (pg._register_backend is never called), so a
C++ path that bypasses the overrides cannot run silently unrecorded: it fails with c10d's "No
backend type associated with device type". ``_get_backend`` answers Python callers that only
inspect the backend (DeviceMesh, FSDP's allocator, init_process_group(device_id=...)) with the real
one; torch.distributed makes no collective call on what it returns.

Verified on torch 2.13 with gloo (2 ranks): dist.* for every collective and send/recv/isend/irecv/
batch_isend_irecv, new_group subgroups, DistributedDataParallel (constructor broadcasts and
allgather, backward bucket all-reduces), functional collectives and DTensor (distribute_tensor's
scatter, tensor-parallel all-reduces) are all recorded. dist.monitored_barrier refuses any backend
but gloo by name. The NCCL delegate is written but untested (no GPU here); the rank joins without
device_id when recording, so that DeviceMesh makes subgroups with new_group (recorded) rather than
split_group (which would split the real NCCL backend, unrecorded).

Records are plain dicts (see ``_record``) of str/int/None/lists; the rank sends them to the driver as
one JSON string (harness/rank/loop.py, decoded in harness/driver/world.py), a tenth of the cost of walking them
with harness.rank.wire's plain-data packer. The recorder is per process (the records of every thread,
e.g. a data-parallel communication thread, go to the same list): ``start()`` before a task,
``stop()`` after; calls outside that window (joining the world) are not recorded and cost one
``is None`` test. ``mark(phase)`` labels the records that follow.
"""

from __future__ import annotations

import gc
from datetime import timedelta

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions

P2P_OPS = frozenset({"send", "recv", "recv_anysource"})  # what "built from point-to-point" may use
NEUTRAL_OPS = frozenset({"barrier", "monitored_barrier"})  # synchronisation: moves no data

_records: list | None = None  # None: not recording
_phase: str | None = None  # the label mark() set last, copied into every record
_watched: list | None = None  # storages all-gathers and receives wrote since watch() (None: not watching)
GATHERED_OPS = frozenset(
    {"recv", "recv_anysource", "allgather", "allgather_coalesced", "allgather_into_tensor", "allgather_into_tensor_coalesced"}
)


def start() -> None:
    """Record every call from now on (forgetting earlier ones)."""
    global _records, _phase
    _records, _phase = [], None


def mark(phase: str) -> None:
    """Label the calls that follow (a rank program's "setup", "forward", "backward", ...); a no-op
    unless recording, so programs may call it unconditionally."""
    global _phase
    _phase = phase


def phase() -> str | None:
    """The label mark() set last."""
    return _phase


def stop() -> list[dict]:
    """Stop recording; return what was recorded since start(), in call order."""
    global _records
    records, _records = _records or [], None
    return records


def watch() -> None:
    """From now on (while recording), keep a reference to the storage of every output an all-gather
    or a receive writes: ``still_held`` then tells which of them the code under test still holds."""
    global _watched
    _watched = [] if _records is not None else None


def still_held() -> list[dict]:
    """Stop watching. For each distinct storage watched: {"bytes": its size now, "held": whether
    anything besides the watch references it} (torch counts a storage's references: each tensor or
    view on it holds one, as does each storage object the watch keeps). A storage freed in place
    (resized to 0, as FSDP2 frees unsharded parameters) has 0 bytes."""
    global _watched
    watched, _watched = _watched or [], None
    if watched:
        gc.collect()  # garbage in reference cycles is not held, only not yet freed
    mine: dict[int, list] = {}
    for storage in watched:
        mine.setdefault(storage.data_ptr(), []).append(storage)
    held = []
    for storages in mine.values():
        references = torch._C._storage_Use_Count(storages[0]._cdata)
        held.append({"bytes": storages[0].nbytes(), "held": references > len(storages)})
    return held


def count(phase: str) -> int:
    """How many calls have been recorded under ``phase`` so far (0 unless recording)."""
    records = _records
    return sum(1 for r in records if r.get("phase") == phase) if records else 0


def recording() -> bool:
    return _records is not None


def backend_name(inner: str) -> str:
    return f"recording_{inner}"


def register(inner: str = "gloo", relay=None) -> str:
    """Register the recording backend that delegates to ``inner`` ("gloo", "nccl", or "relay": the
    driver's relay through ``relay``, a harness.rank.relay_transport.Connection); return the name to
    pass to init_process_group. Idempotent."""
    if inner not in ("gloo", "nccl", "relay"):
        raise ValueError(f"the recording backend delegates to gloo, nccl or the relay, not {inner!r}")
    name = backend_name(inner)
    if name.upper() not in dist.Backend._plugins:
        devices = ["cuda"] if inner == "nccl" else ["cpu"]
        dist.Backend.register_backend(name, _creator(inner, relay), extended_api=True, devices=devices)
    return name


def _creator(inner: str, relay=None):
    def create(options, backend_options):
        ranks = list(options.global_ranks_in_group) or list(range(options.group_size))
        timeout = options.timeout if isinstance(options.timeout, timedelta) else timedelta(seconds=300)
        if inner == "relay":
            from parallelism_conformance.harness.rank.relay_transport import RelayBackend

            real = RelayBackend(relay, ranks, phase=lambda: _phase)
        elif inner == "gloo":
            real = dist.ProcessGroupGloo(options.store, options.group_rank, options.group_size, timeout)
            real.options.global_ranks_in_group = ranks
            real.options.group_name = options.group_id
            real._set_sequence_number_for_group()
        else:  # untested here (no GPU on the development machine)
            nccl_options = backend_options if backend_options is not None else dist.ProcessGroupNCCL.Options()
            nccl_options._timeout = timeout
            nccl_options.global_ranks_in_group = ranks
            nccl_options.group_name = options.group_id
            real = dist.ProcessGroupNCCL(options.store, options.group_rank, options.group_size, nccl_options)
            real._set_sequence_number_for_group()
        group = RecordingProcessGroup(real, options.group_rank, options.group_size, ranks, inner)
        if inner == "relay":
            real.name = lambda: group.group_name  # the relay keeps groups of the same members apart
        return group

    return create


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    out = []
    for item in value or ():
        out.extend(_tensors(item))
    return out


_OP_NAMES = {kind: name for name, kind in dist.ReduceOp.RedOpType.__members__.items()}
_DTYPE_NAMES: dict = {}


def _reduce_op(opts) -> str | None:
    if opts is None:
        return None
    kind = opts.reduceOp.op
    return _OP_NAMES.get(kind) or str(kind)


def _dtype_name(dtype) -> str:
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).removeprefix("torch.")
    return name


def _unwrapped(value):
    """Tensor subclasses that stand for a functional collective still in flight
    (AsyncCollectiveTensor, e.g. a DTensor's output after its all-reduce) reach this Python backend
    as themselves: the dispatcher that waits and unwraps them on the way to a C++ backend is not on
    this path, and gloo would read the wrapper, which holds no data (measured: "writev ... Bad
    address" when torch.distributed.pipelining sent a tensor-parallel stage's output in an audited
    world). Wait for them and hand the backend the plain tensor."""
    if isinstance(value, (list, tuple)):
        return type(value)(_unwrapped(v) for v in value)
    if isinstance(value, torch.Tensor) and type(value) is not torch.Tensor and hasattr(value, "trigger_wait"):
        return value.trigger_wait()
    return value


class RecordingProcessGroup(dist.ProcessGroup):
    """A group whose every communication call is recorded, then run by ``real`` (a c10d Backend)."""

    def __init__(self, real, rank: int, size: int, ranks: list[int], inner: str):
        super().__init__(rank, size)
        self._real = real
        self._ranks = ranks
        self._inner = inner
        self._name = ""
        self._me = ranks[rank]  # this process's global rank

    # ---------------------------------------------------------------------------- bookkeeping
    def getBackendName(self):
        return backend_name(self._inner)

    def _get_backend(self, device):
        return self._real

    def _set_group_name(self, name):  # c10d names every group; functional collectives look it up
        self._name = name
        super()._set_group_name(name)

    @property
    def group_name(self):
        return self._name

    def __repr__(self):
        return f"RecordingProcessGroup({self._inner}, ranks={self._ranks}, rank={self.rank()})"

    def _record(self, op, inputs, outputs=(), *, peer=None, root=None, opts=None, splits=None, tag=None):
        """One record: ``bytes``/``numel`` are this rank's input tensors (what it contributes),
        ``out_bytes``/``out_numel`` its output tensors; ``peer``/``root`` are global ranks;
        ``splits`` (all-to-all) the bytes this rank's input holds for each group rank."""
        if _records is None:
            return
        ins, outs = _tensors(inputs), _tensors(outputs)
        if _watched is not None and op in GATHERED_OPS:
            _watched.extend(t.untyped_storage() for t in outs)
        first = (ins or outs or [None])[0]
        _records.append(
            {
                "op": op,
                "group": self._ranks,
                "rank": self._me,
                "dtype": None if first is None else _dtype_name(first.dtype),
                "itemsize": 0 if first is None else first.element_size(),
                "numel": sum(t.numel() for t in ins),
                "bytes": sum(t.numel() * t.element_size() for t in ins),
                "out_numel": sum(t.numel() for t in outs),
                "out_bytes": sum(t.numel() * t.element_size() for t in outs),
                "peer": None if peer is None else self._ranks[peer],
                "root": None if root is None else self._ranks[root],
                "reduce_op": _reduce_op(opts),
                "splits": splits,
                "tag": tag,
                "phase": _phase,
            }
        )

    # ------------------------------------------------------------------------- point-to-point
    def send(self, tensors, dstRank, tag=0):
        self._record("send", tensors, peer=dstRank, tag=tag)
        return self._real.send(_unwrapped(tensors), dstRank, tag)

    def recv(self, tensors, srcRank, tag=0):
        self._record("recv", (), tensors, peer=srcRank, tag=tag)
        return self._real.recv(tensors, srcRank, tag)

    def recv_anysource(self, tensors, tag=0):
        self._record("recv_anysource", (), tensors, tag=tag)
        return self._real.recv_anysource(tensors, tag)

    # ----------------------------------------------------------------------------- collectives
    def allreduce(self, tensors, opts=None):
        opts = opts if opts is not None else dist.AllreduceOptions()
        self._record("allreduce", tensors, tensors, opts=opts)
        return self._real.allreduce(_unwrapped(tensors), opts)

    def allreduce_coalesced(self, tensors, opts=None):
        opts = opts if opts is not None else dist.AllreduceCoalescedOptions()
        self._record("allreduce_coalesced", tensors, tensors, opts=opts)
        return self._real.allreduce_coalesced(_unwrapped(tensors), opts)

    def broadcast(self, tensors, opts=None):
        opts = opts if opts is not None else dist.BroadcastOptions()
        self._record("broadcast", tensors, tensors, root=opts.rootRank)
        return self._real.broadcast(_unwrapped(tensors), opts)

    def reduce(self, tensors, opts=None):
        opts = opts if opts is not None else dist.ReduceOptions()
        self._record("reduce", tensors, tensors, root=opts.rootRank, opts=opts)
        return self._real.reduce(_unwrapped(tensors), opts)

    def allgather(self, output_tensors, input_tensors, opts=None):
        opts = opts if opts is not None else AllgatherOptions()
        self._record("allgather", input_tensors, output_tensors)
        return self._real.allgather(output_tensors, _unwrapped(input_tensors), opts)

    def allgather_coalesced(self, output_lists, input_list, opts=None):
        opts = opts if opts is not None else AllgatherOptions()
        self._record("allgather_coalesced", input_list, output_lists)
        return self._real.allgather_coalesced(output_lists, _unwrapped(input_list), opts)

    def _allgather_base(self, output, input, opts=None):
        opts = opts if opts is not None else AllgatherOptions()
        self._record("allgather_into_tensor", input, output)
        return self._real._allgather_base(output, _unwrapped(input), opts)

    all_gather_single = _allgather_base  # the Python API's name (dist.all_gather_into_tensor)

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        self._record("allgather_into_tensor_coalesced", inputs, outputs)
        opts = opts if opts is not None else AllgatherOptions()
        return _one_work([self._real._allgather_base(o, i, opts) for o, i in zip(outputs, inputs, strict=True)])

    all_gather_single_coalesced = allgather_into_tensor_coalesced

    def reduce_scatter(self, output_tensors, input_lists, opts=None):
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        self._record("reduce_scatter", input_lists, output_tensors, opts=opts)
        return self._real.reduce_scatter(output_tensors, _unwrapped(input_lists), opts)

    def _reduce_scatter_base(self, output, input, opts=None):
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        self._record("reduce_scatter_tensor", input, output, opts=opts)
        return self._real._reduce_scatter_base(output, _unwrapped(input), opts)

    reduce_scatter_single = _reduce_scatter_base  # the Python API's name (dist.reduce_scatter_tensor)

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        self._record("reduce_scatter_tensor_coalesced", inputs, outputs, opts=opts)
        return _one_work([self._real._reduce_scatter_base(o, i, opts) for o, i in zip(outputs, inputs, strict=True)])

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    def alltoall(self, output_tensors, input_tensors, opts=None):
        opts = opts if opts is not None else dist.AllToAllOptions()
        splits = [t.numel() * t.element_size() for t in input_tensors]
        self._record("alltoall", input_tensors, output_tensors, splits=splits)
        return self._real.alltoall(output_tensors, _unwrapped(input_tensors), opts)

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        opts = opts if opts is not None else dist.AllToAllOptions()
        if _records is not None:
            n, rows = self.size(), input.shape[0] if input.dim() else input.numel()
            splits = [int(s) for s in input_split_sizes] or [rows // n] * n
            row_bytes = input.numel() * input.element_size() // rows if rows else 0
            self._record("alltoall_base", input, output, splits=[s * row_bytes for s in splits])
        return self._real.alltoall_base(output, _unwrapped(input), output_split_sizes, input_split_sizes, opts)

    all_to_all_single = alltoall_base  # the Python API's name (dist.all_to_all_single)

    def gather(self, output_lists, input_tensors, opts=None):
        opts = opts if opts is not None else dist.GatherOptions()
        self._record("gather", input_tensors, output_lists, root=opts.rootRank)
        return self._real.gather(output_lists, _unwrapped(input_tensors), opts)

    def scatter(self, output_tensors, input_lists, opts=None):
        opts = opts if opts is not None else dist.ScatterOptions()
        self._record("scatter", input_lists, output_tensors, root=opts.rootRank)
        return self._real.scatter(output_tensors, _unwrapped(input_lists), opts)

    def barrier(self, opts=None):
        opts = opts if opts is not None else dist.BarrierOptions()
        self._record("barrier", ())
        return self._real.barrier(opts)

    def monitored_barrier(self, timeout=None, wait_all_ranks=False):
        self._record("monitored_barrier", ())
        if timeout is None:
            return self._real.monitored_barrier(wait_all_ranks=wait_all_ranks)
        return self._real.monitored_barrier(timeout, wait_all_ranks)


def _one_work(works):
    """One Work for several: wait for all but the last here (as torch's threaded test group does)."""
    for work in works[:-1]:
        work.wait()
    return works[-1] if works else None
