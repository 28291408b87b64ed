"""The flight recorder, rank side: every rank keeps its last CAPACITY communication calls in a ring
of fixed-size slots in a memory-mapped file, so the driver can read them after the rank aborts,
is killed or hangs (the pages belong to the file, not to the rank's heap). Always on.

What is recorded: every call that reaches a process group's communication methods from Python
(``ProcessGroup.send``, ``.allreduce``, ...: torch.distributed's functions all end there, so
``dist.send``, ``dist.isend``, ``dist.batch_isend_irecv`` and ``dist.all_reduce`` are seen whatever
name the implementation imported them under). :func:`install` wraps those methods on the
ProcessGroup class (and on the audit's recording group, which overrides them). Per call: the
operation, the group (a member bitmask), the peer or root as a global rank, dtype, shape, bytes,
tag, its per-pair (point-to-point) or per-group (collective) sequence number within the task, and
the implementation's source line that made the call. A call is "posted" when it starts and
"raised" if it raised; whether it completed is not followed per call (torch waits on its Work
elsewhere), so a hang is located by the calls the peers never matched. Calls torch makes from C++
(DDP's reducer, DTensor's functional collectives) are not seen.

What the rank is doing now, in the header: the task it runs (also the harness's own probes, whose
calls are not recorded) and how many of its threads are inside a communication call, which is
from entering a wrapped ProcessGroup method until it returns and from entering ``Work.wait`` until
it returns (``dist.recv``, ``dist.all_reduce`` and the others wait there; an implementation's own
``req.wait()`` too). The driver reads these two words while a task runs (harness/driver/deadlock.py):
every rank inside a call, and nothing moving, is a deadlock known at once instead of at the deadline.

Slots carry the task number, so the ring is never cleared; the driver reads the slots of the task
that failed (harness/driver/disagreement.py). Not a grading input: what a rank writes here only explains
a failure, it cannot change a verdict.
"""

from __future__ import annotations

import mmap
import os
import struct
import sys
import threading

CAPACITY = 512
MAGIC = b"CFR2"
# magic, capacity, task recorded, calls written so far (next slot = calls % capacity), then the
# rank's activity: the task it runs now (recorded or a probe's) and its threads inside a call
HEADER = struct.Struct("<4sIIQIi")
ACTIVITY = struct.Struct("<Ii")  # the header's last two words, rewritten on their own
ACTIVITY_OFFSET = HEADER.size - ACTIVITY.size
# task, index in the task, op, state, dtype, ndim, peer, root, tag, pair/group sequence, group size,
# members (bitmask), numel, bytes, dims[4], line, file (the tail of its path)
SLOT = struct.Struct("<IIBBBBhhiIHQQQ4II94s")
OPS = (
    "send",
    "recv",
    "broadcast",
    "all_reduce",
    "reduce",
    "all_gather",
    "all_gather_into_tensor",
    "gather",
    "scatter",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all",
    "all_to_all_single",
    "barrier",
)
P2P = frozenset({"send", "recv"})
STATES = ("empty", "posted", "raised")
DTYPES = (
    "",
    "float32",
    "float64",
    "float16",
    "bfloat16",
    "int64",
    "int32",
    "int16",
    "int8",
    "uint8",
    "bool",
    "complex64",
    "complex128",
    "other",
)
_OP_CODES = {name: i for i, name in enumerate(OPS)}
_POSTED = 1
_DTYPE_CODES = {name: i for i, name in enumerate(DTYPES)}
_THIS_FILE = os.path.abspath(__file__).removesuffix("c")  # .py, also when run from a .pyc


class Recorder:
    """One rank's ring. ``begin_task`` starts the numbering of a task; ``pause`` stops recording
    (the harness's own probes); ``enter``/``leave`` bracket every communication call and wait."""

    def __init__(self, path: str, rank: int, capacity: int = CAPACITY):
        self.rank = rank
        self.capacity = capacity
        size = HEADER.size + capacity * SLOT.size
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, size)
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.task = 0
        self.calls = 0
        self.paused = False
        self.running = 0  # the task the rank runs now, recorded or not
        self.waiting = 0  # threads inside a communication call or a wait on one
        self._activity = threading.Lock()  # the count and its word change together, whichever thread
        self._index = 0
        self._sequences: dict = {}
        self._groups: dict = {}
        self._masks: dict = {}
        self._write_header()

    def _write_header(self) -> None:
        with self._activity:
            HEADER.pack_into(self._map, 0, MAGIC, self.capacity, self.task, self.calls, self.running, self.waiting)

    def begin_task(self, task: int) -> None:
        self.task, self.running, self._index, self.paused = task, task, 0, False
        self._sequences.clear()
        self._write_header()

    def pause(self, task: int) -> None:
        """The harness's own probe runs as ``task``: its calls are not recorded (the last task's
        stay readable for its report), its waits are still counted."""
        self.running, self.paused = task, True
        self._write_header()

    def enter(self) -> None:
        """A thread enters a communication call or a wait on one."""
        with self._activity:
            self.waiting += 1
            ACTIVITY.pack_into(self._map, ACTIVITY_OFFSET, self.running, self.waiting)

    def leave(self) -> None:
        with self._activity:
            self.waiting -= 1
            ACTIVITY.pack_into(self._map, ACTIVITY_OFFSET, self.running, self.waiting)

    def record(self, op: str, tensors, *, members: tuple[int, ...], peer=None, root=None, tag=0) -> int:
        """Write a slot in state "posted"; return it for :meth:`finish`."""
        key = (op, peer) if op in P2P else (None, members)
        sequence = self._sequences[key] = self._sequences.get(key, 0) + 1
        if tensors:
            first = tensors[0]
            if len(tensors) == 1:
                numel = first.numel()
                nbytes = numel * first.element_size()
            else:
                numel = sum(t.numel() for t in tensors)
                nbytes = sum(t.numel() * t.element_size() for t in tensors)
            dims = (*first.shape[:4], 0, 0, 0, 0)[:4]
            ndim, dtype = min(first.dim(), 4), _dtype_code(first.dtype)
        else:
            numel = nbytes = ndim = dtype = 0
            dims = (0, 0, 0, 0)
        encoded, line = _caller()
        slot = self.calls % self.capacity
        self._index += 1
        SLOT.pack_into(
            self._map,
            HEADER.size + slot * SLOT.size,
            self.task,
            self._index,
            _OP_CODES[op],
            _POSTED,
            dtype,
            ndim,
            -1 if peer is None else peer,
            -1 if root is None else root,
            tag or 0,
            sequence,
            len(members),
            self._mask(members),
            numel,
            nbytes,
            *dims,
            line,
            encoded,
        )
        self.calls += 1
        return slot

    def _mask(self, members: tuple[int, ...]) -> int:
        mask = self._masks.get(members)
        if mask is None:
            mask = self._masks[members] = sum(1 << m for m in members if m < 64)
        return mask

    def finish(self, slot: int, state: str) -> None:
        struct.pack_into("<B", self._map, HEADER.size + slot * SLOT.size + 9, STATES.index(state))

    def members(self, group) -> tuple[int, ...]:
        """The global ranks of ``group`` (a ProcessGroup), cached."""
        members = self._groups.get(id(group))
        if members is None:
            import torch.distributed as dist

            ranks = getattr(group, "_ranks", None)  # the audit's recording group knows them itself
            members = tuple(ranks) if ranks is not None else tuple(dist.get_process_group_ranks(group))
            self._groups[id(group)] = members
        return members


_SKIP: dict = {}  # code object -> whether its frames belong to torch or this module (memo, per process)
_ENCODED: dict = {}  # filename -> the bytes a slot keeps of it


def _caller() -> tuple[bytes, int]:
    """The first frame outside torch and this module: the implementation's line (or the rank
    program's, when the implementation is torch.distributed itself), its file as slot bytes."""
    frame = sys._getframe(2)
    while frame is not None:
        code = frame.f_code
        skip = _SKIP.get(code)
        if skip is None:
            skip = _SKIP[code] = "torch" + os.sep in code.co_filename or code.co_filename == _THIS_FILE
        if not skip:
            encoded = _ENCODED.get(code.co_filename)
            if encoded is None:
                encoded = _ENCODED[code.co_filename] = code.co_filename.encode()[-94:]
            return encoded, frame.f_lineno
        frame = frame.f_back
    return b"?", 0


_DTYPE_MEMO: dict = {}


def _dtype_code(dtype) -> int:
    code = _DTYPE_MEMO.get(dtype)
    if code is None:
        code = _DTYPE_MEMO[dtype] = _DTYPE_CODES.get(str(dtype).removeprefix("torch."), len(DTYPES) - 1)
    return code


# ------------------------------------------------------------------------ the wrapped methods
# ProcessGroup method -> (recorded op, index of the positional argument holding the input tensors)
METHODS = {
    "send": ("send", 0),
    "recv": ("recv", 0),
    "recv_anysource": ("recv", 0),
    "allreduce": ("all_reduce", 0),
    "allreduce_coalesced": ("all_reduce", 0),
    "broadcast": ("broadcast", 0),
    "reduce": ("reduce", 0),
    "allgather": ("all_gather", 1),
    "allgather_coalesced": ("all_gather", 1),
    "_allgather_base": ("all_gather_into_tensor", 1),
    "all_gather_single": ("all_gather_into_tensor", 1),
    "allgather_into_tensor_coalesced": ("all_gather_into_tensor", 1),
    "gather": ("gather", 1),
    "scatter": ("scatter", 1),
    "reduce_scatter": ("reduce_scatter", 1),
    "_reduce_scatter_base": ("reduce_scatter_tensor", 1),
    "reduce_scatter_single": ("reduce_scatter_tensor", 1),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter_tensor", 1),
    "alltoall": ("all_to_all", 1),
    "alltoall_base": ("all_to_all_single", 1),
    "all_to_all_single": ("all_to_all_single", 1),
    "barrier": ("barrier", None),
    "monitored_barrier": ("barrier", None),
}


def install(recorder: Recorder, classes=None) -> None:
    """Wrap the communication methods of ``classes`` (default: torch's ProcessGroup) so that every
    call is recorded by ``recorder`` first. A class's own methods only (a subclass that overrides
    one, like harness.rank.recording.RecordingProcessGroup, is passed too). ``Work.wait`` is wrapped
    to count the threads waiting (a ProcessGroup method returns its Work at once; the wait blocks)."""
    import torch.distributed as dist

    for cls in classes or (dist.ProcessGroup,):
        for method, (op, position) in METHODS.items():
            function = cls.__dict__.get(method)
            if function is None or getattr(function, "_flight_recorded", False):
                continue
            setattr(cls, method, _wrap(recorder, op, position, function))
    wait = dist.Work.__dict__.get("wait")
    if wait is not None and not getattr(wait, "_flight_recorded", False):
        dist.Work.wait = _wrap_wait(recorder, wait)


def _tensors(value) -> list:
    if hasattr(value, "numel"):
        return [value]
    out = []
    for item in value or ():
        out.extend(_tensors(item))
    return out


def _counted(recorder: Recorder, function, group, args, kwargs):
    recorder.enter()
    try:
        return function(group, *args, **kwargs)
    finally:
        recorder.leave()


def _wrap(recorder: Recorder, op: str, position, function):
    def recorded(group, *args, **kwargs):
        if recorder.paused:
            return _counted(recorder, function, group, args, kwargs)
        try:
            members = recorder.members(group)
            tensors = _tensors(args[position]) if position is not None and len(args) > position else []
            peer = root = None
            tag = 0
            if op in P2P:
                peer = members[args[1]] if len(args) > 1 and isinstance(args[1], int) else None
                tag = args[2] if len(args) > 2 else kwargs.get("tag", 0)
            else:
                options = next((a for a in args if hasattr(a, "rootRank")), None)
                root = members[options.rootRank] if options is not None and op in ("broadcast", "reduce", "gather", "scatter") else None
            slot = recorder.record(op, tensors, members=members, peer=peer, root=root, tag=tag)
        except Exception:  # noqa: BLE001 - the recorder never changes what the call does
            return _counted(recorder, function, group, args, kwargs)
        recorder.enter()
        try:
            return function(group, *args, **kwargs)
        except BaseException:
            recorder.finish(slot, "raised")
            raise
        finally:
            recorder.leave()

    recorded._flight_recorded = True
    recorded.__name__ = getattr(function, "__name__", op)
    return recorded


def _wrap_wait(recorder: Recorder, wait):
    def waited(work, *args, **kwargs):
        recorder.enter()
        try:
            return wait(work, *args, **kwargs)
        finally:
            recorder.leave()

    waited._flight_recorded = True
    waited.__name__ = "wait"
    return waited
