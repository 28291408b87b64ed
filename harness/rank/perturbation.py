"""Perturbed completion (--perturb-timing), rank side: a call the implementation makes through a
process group completes late, by the delay the driver drew for it, so that a result read before
its ``wait()`` or a buffer changed before its send left shows at once instead of by the luck of
the scheduler.

The driver draws, per task and per rank, a schedule (harness/driver/perturbation.py): the delay of
the rank's n-th call of the task, each 0, SHORT or LONG. The rank applies it here:

* 0: the call runs as the backend runs it.
* SHORT: the call is made at once on private buffers; its outputs (an all-reduce's tensor, a
  receive's buffer, a gather's output) hold poison (harness/rank/poison.py) until the program
  waits for the work (``wait()``, an ``is_completed()`` that answers True, ``get_future()``); the
  result is then copied in. A receive's message is thus delivered late.
* LONG: the same, and the call is also launched late: at the first wait of any of the rank's works
  (or an ``is_completed()`` poll), or when the rank makes a call that must not overtake it (a send
  to the same peer, a collective of the same group), whichever comes first. A send (or a
  collective's input that is not its output) is read when it really leaves, so a buffer changed
  after ``isend`` and before ``wait`` sends the changed data, as NCCL can. A receive is launched
  at once (launching it later would show nothing its poison does not).

What keeps it deadlock-free and matched: calls the backend matches by order (a group's
collectives, the sends to one peer) are launched in the order they were made, whichever thread
made them; every wait of the rank, the one place it blocks, first launches everything deferred;
and the rank never blocks where it did not block before, since a result is copied in only where
the program waits for it. ``is_completed()`` answers False on its first SHORT-or-LONG-many polls,
then what the backend says. Delays are in calls, not seconds: the same schedule replays the same
outcome, so Hypothesis can shrink it.

Watched in every perturbed task, whatever the delays: the inputs of every send and out-of-place
collective, compared at its wait (LONG: at its launch) with a copy taken at the call (a change is
a race whatever the backend did), and every poisoned output, which must still hold its poison bit
for bit when the result is copied in (else the program wrote into it while it was in flight).

What cannot be perturbed: what the backend does inside one call, and calls torch makes from C++
(DDP's reducer, functional collectives, DTensor): they do not pass through these Python methods.
An audited world's recording group overrides the methods wrapped here, so audited worlds are not
perturbed. Tensors that are not contiguous, dense and strided pass through unperturbed (the
backend's own refusal must stay what it is).
"""

from __future__ import annotations

import os
import sys
import sysconfig
import threading

import torch
import torch.distributed as dist

from parallelism_conformance.harness.rank import call_arguments, poison

SHORT, LONG = 1, 2
NAMES = {0: "none", SHORT: "short", LONG: "long"}
# ProcessGroup method -> (index of the argument holding the outputs, of the inputs, whether they are one)
METHODS = {
    "send": (None, 0, False),
    "recv": (0, None, False),
    "allreduce": (0, 0, True),
    "allreduce_coalesced": (0, 0, True),
    "broadcast": (0, 0, True),
    "reduce": (0, 0, True),
    "allgather": (0, 1, False),
    "_allgather_base": (0, 1, False),
    "all_gather_single": (0, 1, False),
    "allgather_into_tensor_coalesced": (0, 1, False),
    "reduce_scatter": (0, 1, False),
    "_reduce_scatter_base": (0, 1, False),
    "reduce_scatter_single": (0, 1, False),
    "reduce_scatter_tensor_coalesced": (0, 1, False),
    "alltoall_base": (0, 1, False),
    "all_to_all_single": (0, 1, False),
    "alltoall": (0, 1, False),
    "gather": (0, 1, False),
    "scatter": (0, 1, False),
}
PASSED_THROUGH = ("recv_anysource", "barrier", "monitored_barrier", "allgather_coalesced")  # still launch points
# frames that are never the implementation's: torch, its decorators' helpers, the standard library
_NOT_THE_CALLER = ("torch" + os.sep, "typing_extensions", sysconfig.get_paths()["stdlib"] + os.sep)
_HARNESS = tuple(os.path.join(os.path.dirname(os.path.abspath(__file__)), name) for name in ("perturbation.py", "flight_recorder.py"))


class Perturbation:
    """One rank's perturbation: ``begin(schedule)`` before a task, ``report()`` once its result is
    taken, ``end()`` after (launches what is still deferred and forgets the task's works)."""

    def __init__(self, rank: int, match_tags: bool = True):
        self.rank = rank
        self.match_tags = match_tags  # gloo matches a peer's messages by tag; NCCL by order alone
        self._lock = threading.RLock()
        self._prefix: list[int] = []
        self._tail = 0
        self.active = False
        self._calls = 0
        self._deferred: list[LateWork] = []  # launched late, in call order
        self._late: list[LateWork] = []  # every work delayed in this task

    def begin(self, schedule) -> None:
        """``schedule``: (delays of the first calls, delay of every later call), or None (no perturbation)."""
        with self._lock:
            self.active = bool(schedule)  # all delays 0 still watches every send's buffer until its wait
            self._prefix, self._tail = (list(schedule[0]), int(schedule[1])) if self.active else ([], 0)
            self._calls, self._deferred, self._late = 0, [], []

    def delay(self, key) -> tuple[int, int]:
        """(this call's number in the task, its delay). ``key`` says what the call must not overtake:
        deferred calls with the same key (a collective of the same group, a send to the same peer)
        are launched first, so that the backend still matches calls in the order they were made."""
        with self._lock:
            index = self._calls
            self._calls += 1
            if self._deferred:
                self.launch_deferred(key)
            return index, self._prefix[index] if index < len(self._prefix) else self._tail

    def launch_deferred(self, key=None) -> None:
        """Launch the deferred calls in call order: those with ``key``, or all (a blocking point)."""
        with self._lock:
            kept = []
            for work in self._deferred:
                if key is None or work.key == key:
                    work.launch()
                else:
                    kept.append(work)
            self._deferred = kept

    def has_deferred(self) -> bool:
        return bool(self._deferred)

    def add(self, work: LateWork) -> None:
        with self._lock:
            self._late.append(work)
            if work.delay == LONG:
                self._deferred.append(work)
            else:
                work.launch()

    def report(self) -> list[dict]:
        """Plain data, for the driver: each delayed call and where it stood when the program returned."""
        with self._lock:
            return [work.describe() for work in self._late if work.delay or work.changed or work.overwritten]

    def end(self) -> None:
        with self._lock:
            self.launch_deferred()
            for work in self._late:
                work.settle()
            self._late, self.active = [], False


class LateWork(dist.Work):
    """A call that completes late: its outputs hold poison until the program waits for it."""

    def __init__(self, owner: Perturbation, index: int, op: str, delay: int, where: str, start, pairs, key):
        super().__init__()
        self.owner, self.index, self.op, self.delay, self.where, self.key = owner, index, op, delay, where, key
        self._start = start  # () -> the backend's Work, reading the inputs it was given now
        self._pairs = pairs  # (the program's output tensor, the private one the backend writes)
        self._sent: list = []  # a LONG call's inputs read at launch: (the tensor, a copy of it at the call)
        self.changed = False  # one of them changed between the call and the launch
        self.overwritten = False  # the program wrote into an output while the call was in flight
        self._real = None
        self._polls = 0
        self.state = "deferred" if delay == LONG else "in flight"
        self.how = ""

    def keep_inputs(self, inputs) -> None:
        """Watch what this call sends: a change before it left (LONG: its launch; else its completion,
        the first moment the program may reuse the buffer) is a race whatever the backend did."""
        self._sent = [(t, t.detach().reshape(-1).clone()) for t in inputs]

    def _check_sent(self) -> None:
        if self._sent:
            self.changed = self.changed or any(
                not torch.equal(t.detach().reshape(-1).view(torch.uint8), copy.view(torch.uint8)) for t, copy in self._sent
            )
            self._sent = []

    def launch(self) -> None:
        if self._real is None:
            if self.delay == LONG:
                self._check_sent()
            self._real = self._start()
            self.state = "in flight"

    def _complete(self, how: str) -> None:
        if self.state == "completed":
            return
        self.owner.launch_deferred()  # a blocking point: nothing deferred may wait behind it
        self._check_sent()
        if self._real is not None:
            self._real.wait()
        for output, private in self._pairs:
            self.overwritten = self.overwritten or not poison.intact(output, self.owner.rank, self.index)
            poison.copy_back(output, private)
        self.state, self.how = "completed", how

    def wait(self, timeout=None):  # noqa: ARG002 - the backend's own wait keeps its timeout
        self._complete("wait()")
        return True

    def is_completed(self):
        if self.state == "completed":
            return True
        self._polls += 1
        if self._polls <= self.delay:
            return False
        self.owner.launch_deferred()  # a program that polls must see progress
        if self._real is not None and self._real.is_completed():
            self._complete("is_completed()")
            return True
        return False

    def is_success(self):
        return self.state == "completed"

    def exception(self):
        return None

    def get_future(self):
        self._complete("get_future()")
        future = torch.futures.Future()
        future.set_result([output for output, _ in self._pairs])
        return future

    def synchronize(self):
        self._complete("synchronize()")

    def result(self):
        self._complete("result()")
        return [output for output, _ in self._pairs]

    def settle(self) -> None:
        """After the task: the result copied in where the backend finished (nobody waits for it now)."""
        self._check_sent()
        if self.state != "completed" and self._real is not None and self._real.is_completed():
            for output, private in self._pairs:
                poison.copy_back(output, private)

    def describe(self) -> dict:
        return {
            "rank": self.owner.rank,
            "call": self.index,
            "op": self.op,
            "delay": NAMES[self.delay],
            "where": self.where,
            "state": self.state,
            "how": self.how,
            "changed": self.changed,
            "overwritten": self.overwritten,
            "outputs": bool(self._pairs),
        }


def install(perturbation: Perturbation, cls=None) -> None:
    """Wrap ``cls``'s (torch's ProcessGroup's) communication methods; before the flight recorder's
    (harness/rank/flight_recorder.py), so that it still records each call when the program makes it."""
    cls = cls or dist.ProcessGroup
    for method, spec in METHODS.items():
        function = cls.__dict__.get(method)
        if function is not None and not getattr(function, "_perturbed", False):
            setattr(cls, method, _wrap(perturbation, method, spec, function))
    for method in PASSED_THROUGH:
        function = cls.__dict__.get(method)
        if function is not None and not getattr(function, "_perturbed", False):
            setattr(cls, method, _launch_point(perturbation, method, function))
    for method in ("wait", "is_completed"):  # the backend's own works: a wait is a blocking point too
        function = dist.Work.__dict__.get(method)
        if function is not None and not getattr(function, "_perturbed", False):
            setattr(dist.Work, method, _blocking_point(perturbation, function))


def _blocking_point(perturbation: Perturbation, function):
    def call(work, *args, **kwargs):
        if perturbation.active and perturbation.has_deferred():
            perturbation.launch_deferred()  # what this wait may depend on leaves first
        return function(work, *args, **kwargs)

    call._perturbed = True
    call.__name__ = getattr(function, "__name__", "wait")
    return call


def _launch_point(perturbation: Perturbation, method: str, function):
    def call(group, *args, **kwargs):
        if perturbation.active:
            perturbation.delay(call_arguments.key(group, method, args, perturbation.match_tags))
            if method in ("barrier", "monitored_barrier"):
                perturbation.launch_deferred()  # it blocks
        return function(group, *args, **kwargs)

    call._perturbed = True
    call.__name__ = getattr(function, "__name__", "call")
    return call


def _wrap(perturbation: Perturbation, method: str, spec, function):
    out_at, in_at, in_place = spec

    def call(group, *args, **kwargs):
        if not perturbation.active:
            return function(group, *args, **kwargs)
        key = call_arguments.key(group, method, args, perturbation.match_tags)
        index, delay = perturbation.delay(key)
        if delay == 0 and method != "send":
            return function(group, *args, **kwargs)
        if delay == 0:  # sent at once, as the backend does; its buffer is still watched until the wait
            work = LateWork(perturbation, index, method, 0, _caller(), lambda: function(group, *args, **kwargs), [], key)
            work.keep_inputs([t for t in call_arguments.tensors(args[0]) if t.numel()] if call_arguments.all_plain(args[0]) else [])
            perturbation.add(work)
            return work
        args, inplace = list(args), in_place
        outputs = call_arguments.tensors(args[out_at]) if out_at is not None and len(args) > out_at else []
        inputs = call_arguments.tensors(args[in_at]) if in_at is not None and len(args) > in_at else []
        if not all(call_arguments.plain(t) for t in (*outputs, *inputs)):
            return function(group, *args, **kwargs)
        if method == "broadcast" and call_arguments.is_root(group, args):
            outputs, inplace = [], False  # the root's tensor is only read: a send
        if inplace or call_arguments.overlap(inputs, outputs):  # the inputs are read now, before the poison
            args[in_at] = call_arguments.mapped(args[in_at], lambda t: t.detach().clone())
        privates = {id(t): torch.empty_like(t) for t in outputs}
        if inplace:
            snapshot = call_arguments.tensors(args[in_at])
            privates = {id(t): s for t, s in zip(outputs, snapshot, strict=True)}
            args[out_at] = args[in_at]
        elif out_at is not None and outputs:
            args[out_at] = call_arguments.mapped(args[out_at], lambda t: privates[id(t)])
        pairs = [(t, privates[id(t)]) for t in outputs]
        for tensor in outputs:
            poison.fill(tensor, perturbation.rank, index)
        if method == "recv" and delay == LONG:
            delay = SHORT  # a receive launched later changes nothing its poison does not already show
        work = LateWork(perturbation, index, method, delay, _caller(), lambda: function(group, *args, **kwargs), pairs, key)
        if not inplace and in_at is not None:  # read until it leaves (LONG: when it leaves): watched for changes
            work.keep_inputs([t for t in call_arguments.tensors(args[in_at]) if t.numel()])
        perturbation.add(work)
        return work

    call._perturbed = True
    call.__name__ = getattr(function, "__name__", method)
    return call


_SKIP: dict = {}  # code object -> whether its frames are never the implementation's (memo, per process)


def _caller() -> str:
    """The first frame outside torch and the harness's wrappers: the implementation's line (the
    rank program's, when the implementation is torch.distributed itself)."""
    frame = sys._getframe(2)
    while frame is not None:
        code = frame.f_code
        skip = _SKIP.get(code)
        if skip is None:
            name = code.co_filename
            skip = _SKIP[code] = any(part in name for part in _NOT_THE_CALLER) or name.startswith(_HARNESS)
        if not skip:
            return f"{_short(code.co_filename)}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


def _short(path: str) -> str:
    here = os.getcwd() + os.sep
    return path[len(here) :] if path.startswith(here) else path
