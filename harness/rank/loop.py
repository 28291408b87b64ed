"""The rank side: one process of a world. It joins the process group once, then runs tasks sent by
the driver until told to exit.

A rank is started by harness.driver.world (forkserver) or, for ranks on other hosts, by any launcher
(torchrun) that runs ``python -m parallelism_conformance.harness.rank`` with the driver's address in the environment; both
end in ``serve(RankConfig)``. The rank never sees expected values: a task names a rank program
(``harness.rank.programs.<module>:<function>``) and carries this rank's inputs only.
"""

from __future__ import annotations

import ctypes
import faulthandler
import importlib
import json
import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass, replace
from datetime import timedelta
from multiprocessing.connection import Client

from parallelism_conformance.harness.rank import containment, flight_recorder, library_loop, syscall_allowlist, syscall_filter, wire
from parallelism_conformance.harness.rank.context import MissingFunction, RankContext
from parallelism_conformance.harness.rank.loader import MissingDependency, load_implementation

STACK_DUMP_SIGNAL = signal.SIGUSR1
PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class RankConfig:
    rank: int
    world_size: int
    backend: str
    control_address: tuple[str, int]
    authkey: bytes
    store_host: str
    store_port: int
    store_prefix: str = ""  # the driver's "join" message names it (a world rebuilt gets a new one)
    driver_pid: int | None = None  # local ranks die with the driver; None for remote ranks
    log_path: str | None = None
    init_timeout_s: float = 60.0
    # how long a rank keeps dialling a driver that refuses the connection: 0 for local ranks (their
    # driver listens before it starts them); an attached rank's launcher may start it first, on
    # another host (CONFORMANCE_DIAL_TIMEOUT, default DIAL_TIMEOUT_S)
    dial_timeout_s: float = 0.0
    collective_timeout_s: float = 300.0
    local_rank: int | None = None  # rank on this host (torchrun's LOCAL_RANK) for the GPU; None: rank
    threads: int | None = None  # torch intra-op threads; None keeps torch's default (remote ranks)
    record_communication: bool = False  # the communication audit: see harness/rank/recording.py
    sandbox: containment.Sandbox | None = None  # run as this user, in its directory (harness/rank/containment.py)
    flight_recorder: bool = True  # keep the last calls in a ring the driver reads (harness/rank/flight_recorder.py)
    # the driver's environment, for a local rank: the forkserver it is forked from may serve several
    # drivers (harness/driver/warm_pytest.py), and a rank sees its own driver's variables, as a
    # child process would. None (attached ranks): the launcher's.
    environment: dict[str, str] | None = None


def _first_for_the_oom_killer() -> None:
    """A rank is what the kernel kills first when the memory runs out (oom_score_adj 1000, the most):
    the driver that reports the death lives, and the rank's test fails naming the OOM kill
    (harness/driver/memory_cgroup.py). Raising one's own score needs no privilege. A rank without
    CAP_SYS_RESOURCE can lower it again to 0, no lower, so a driver and a rank of equal score are
    chosen between by size (docs/grading.md)."""
    try:
        with open("/proc/self/oom_score_adj", "w") as adjust:
            adjust.write("1000")
    except OSError:  # no procfs (not Linux): nothing to volunteer for
        pass


def serve(config: RankConfig) -> None:
    """Entry point of a rank process."""
    if config.sandbox is not None:
        containment.close_inherited()  # the forkserver's and the resource tracker's pipes are root's
    if config.environment is not None:
        os.environ.clear()
        os.environ.update(config.environment)
    # A rank never writes bytecode: the kernel's count of the bytes it writes is the audit's evidence,
    # and a module first imported during a task (a rank program, the implementation) wrote its .pyc
    # there, counted as communication around the recorder. It still reads the bytecode there is.
    sys.dont_write_bytecode = True
    if config.threads is not None:
        # OMP_NUM_THREADS alone is read when OpenMP loads, which the forkserver's preload of torch
        # has already done: without set_num_threads every rank ran cores-many threads (4 ranks x 2
        # threads on 2 cores here): the bundled ring all-reduce measured 0.65-0.78x gloo instead of ~1x.
        import torch

        os.environ["OMP_NUM_THREADS"] = str(config.threads)  # for whatever the rank starts later
        torch.set_num_threads(config.threads)
    if config.log_path:
        _capture_output(config.log_path)
    flight = _flight_recorder(config)  # opened before containment: the driver owns the file
    faulthandler.enable(all_threads=True)  # segfault/abort: C-level crash prints every Python stack
    _dump_stacks_then_die_on(STACK_DUMP_SIGNAL)  # the driver asks on a hang
    start_directory = os.getcwd()  # where relative --impl paths point
    _first_for_the_oom_killer()
    # names the calls its allow list will refuse, where the rank cannot rewrite them: made while root
    refusals = syscall_allowlist.reporter_for(config.log_path) if config.sandbox is not None else None
    if config.sandbox is not None:
        containment.enter(config.sandbox)  # before anything of the implementation's runs
    if config.driver_pid is not None:
        _die_with_driver(config.driver_pid)  # after enter: changing credentials clears PDEATHSIG
    conn = _dial(config)
    conn.send_bytes(wire.encode_untrusted(("hello", config.rank, os.getpid(), config.world_size)))
    message = wire.decode_trusted(conn.recv_bytes())
    if message[0] != "join":
        os._exit(0)  # the driver turned this rank away (it says why on its side)
    _, store_prefix, backend, record_communication, perturb, relay = (*message, False, None)[:6]
    config = replace(config, store_prefix=store_prefix, backend=backend, record_communication=record_communication)
    context = _join_world(config, relay)
    store_socket, unfiltered = (
        syscall_filter.counted_channels(config.store_port, config.backend, refusals) if config.sandbox is not None else (None, "")
    )
    conn.send_bytes(wire.encode_untrusted(("ready", config.rank, store_socket, unfiltered)))
    implementations: dict[str, object] = {}
    recorder = _recorder(config)
    late = _perturbation(config.rank, config.backend) if perturb else None  # before the flight recorder: it records calls as made
    if flight is not None:
        flight_recorder.install(flight, classes=[dist_process_group(), *([recorder.RecordingProcessGroup] if recorder else [])])
    settings = _GlobalSettings.read()
    while True:
        try:
            message = wire.decode_trusted(conn.recv_bytes())
        except EOFError:
            break
        if message[0] == "exit":
            break
        _, task_id, program, kwargs, impl_spec, record_flight, schedule = (*message, None)[:7]
        if flight is not None:
            if record_flight:
                flight.begin_task(task_id)
            else:  # the harness's own probes are not the implementation's calls: the last task's stay readable
                flight.pause(task_id)
        raised = ""
        try:
            impl = implementations.get(impl_spec)
            if impl is None:
                impl = implementations[impl_spec] = load_implementation(impl_spec, start_directory)
            if recorder:
                recorder.start()
            if late is not None:
                late.begin(schedule)
            if "library_configuration" in kwargs:  # a library adapter's drawn configuration, set before anything is built
                library_loop.configure(impl, kwargs.pop("library_configuration"))
            result = _resolve(program)(context, impl, **kwargs)
            reply = ("done", task_id, result, json.dumps(recorder.stop()) if recorder else "", late.report() if late is not None else [])
            payload = wire.encode_untrusted(reply)  # the result as the program left it, before end() below
        except BaseException as error:  # noqa: BLE001 - everything a rank raises goes to the driver
            status = (
                "unloadable"
                if isinstance(error, MissingDependency)
                else "missing"
                if isinstance(error, (MissingFunction, ImportError, NotImplementedError))
                else "raised"
            )
            raised = traceback.format_exc()
            payload = wire.encode_untrusted(("error", task_id, raised, status))
        if late is not None:
            try:
                late.end()
            except Exception:  # noqa: BLE001 - the harness's own bug: said in the rank's output, the rank goes on
                traceback.print_exc()
        settings.restore()  # one test's torch.set_default_dtype & co. never leak into the next
        damage = _world_damage(context)
        if damage:  # this world cannot run another task: say why, then leave; the driver rebuilds it
            payload = wire.encode_untrusted(("error", task_id, raised + damage, "broken"))
        sys.stdout.flush()
        sys.stderr.flush()
        conn.send_bytes(payload)
        if damage:
            break
    os._exit(0)  # skip interpreter teardown: process-group destructors can block on dead peers


@dataclass(frozen=True)
class _GlobalSettings:
    """Process-wide torch settings an implementation may change and forget to put back. A rank
    runs many tests; each starts from the settings the rank joined with."""

    default_dtype: object
    grad_enabled: bool
    threads: int

    @classmethod
    def read(cls) -> _GlobalSettings:
        import torch

        return cls(torch.get_default_dtype(), torch.is_grad_enabled(), torch.get_num_threads())

    def restore(self) -> None:
        import torch

        torch.set_default_dtype(self.default_dtype)
        torch.set_grad_enabled(self.grad_enabled)
        if torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)


def _world_damage(context: RankContext) -> str:
    """Why this rank's process group can no longer run tasks ('' when it can)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return (
            "the implementation under test destroyed the default process group during this task "
            "(torch.distributed.is_initialized() is False afterwards); the world is rebuilt for the next test"
        )
    if (dist.get_rank(), dist.get_world_size()) != (context.rank, context.world_size):
        return (
            f"the implementation under test replaced the default process group during this task (now rank "
            f"{dist.get_rank()} of {dist.get_world_size()}, was {context.rank} of {context.world_size}); "
            "the world is rebuilt for the next test"
        )
    return ""


def _join_world(config: RankConfig, relay: tuple | None = None) -> RankContext:
    """Join the world's process group. In a relay world (``relay``: the driver's relay's host, port
    and this rank's token) the group's only transport is a connection to the relay, made here,
    before the implementation loads (harness/rank/relay_transport.py)."""
    import torch
    import torch.distributed as dist

    device = torch.device("cpu")
    if config.backend == "nccl":
        local = config.rank if config.local_rank is None else config.local_rank  # this host's n-th rank
        device = torch.device("cuda", local % torch.cuda.device_count())
        torch.cuda.set_device(device)
    store = dist.TCPStore(
        config.store_host,
        config.store_port,
        is_master=False,
        timeout=timedelta(seconds=config.init_timeout_s),
    )
    if config.backend == "relay":
        from parallelism_conformance.harness.rank import recording, relay_transport

        host, port, token = relay
        backend = recording.register("relay", relay_transport.Connection((host, port), token))
    else:
        backend = _recorder(config).register(config.backend) if config.record_communication else config.backend
    dist.init_process_group(
        backend,
        store=dist.PrefixStore(config.store_prefix, store),
        rank=config.rank,
        world_size=config.world_size,
        timeout=timedelta(seconds=config.collective_timeout_s),
        device_id=device if config.backend == "nccl" and not config.record_communication else None,
    )
    return RankContext(rank=config.rank, world_size=config.world_size, backend=config.backend, device=device)


def _flight_recorder(config: RankConfig):
    """This rank's flight recorder (harness/rank/flight_recorder.py), in a file next to its log; None for
    ranks without a log (attached ranks: their files are on another host)."""
    if not config.log_path or not config.flight_recorder:
        return None
    return flight_recorder.Recorder(ring_path(config.log_path), config.rank)


def _dump_stacks_then_die_on(signum: int) -> None:
    """On ``signum``, write every thread's Python stack to stderr (the rank's log), then die of the
    signal: faulthandler's chain re-raises it under its default action once the dump is written.
    The driver sends it only to a rank it has given up on (a hang), and the rank's exit is how the
    driver knows the stacks are complete, instead of sleeping and hoping they are
    (harness/driver/world.py, World._dump_stacks)."""
    signal.signal(signum, signal.SIG_DFL)  # what the chain falls to: terminate, whatever was set before
    faulthandler.register(signum, all_threads=True, chain=True)


def ring_path(log_path: str) -> str:
    return log_path.removesuffix(".log") + ".ring"


def fifo_path(log_path: str) -> str:
    """The FIFO a local rank's output goes through; the driver drains it into ``log_path``
    (harness/driver/output_pipe.py)."""
    return log_path.removesuffix(".log") + ".pipe"


def dist_process_group():
    import torch.distributed as dist

    return dist.ProcessGroup


def _perturbation(rank: int, backend: str):
    """This rank's perturbed completion (harness/rank/perturbation.py), installed on torch's ProcessGroup."""
    from parallelism_conformance.harness.rank import perturbation

    late = perturbation.Perturbation(rank, match_tags=backend == "gloo")
    perturbation.install(late)
    return late


def _recorder(config: RankConfig):
    """harness.rank.recording when this rank records its communication, else None."""
    if not config.record_communication:
        return None
    from parallelism_conformance.harness.rank import recording

    return recording


def _resolve(program: str):
    module_name, _, function_name = program.partition(":")
    if not module_name.startswith("parallelism_conformance.harness.rank.programs."):
        raise ValueError(f"rank programs live in parallelism_conformance.harness.rank.programs, not {program!r}")
    return getattr(importlib.import_module(module_name), function_name)


def _capture_output(path: str) -> None:
    """Send this process's fd 1 and 2 (Python and C++ output alike) into the FIFO the driver drains
    into its log file at ``path``."""
    fd = os.open(fifo_path(path), os.O_WRONLY)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
    sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)


def _die_with_driver(driver_pid: int) -> None:
    """No orphans, even when the driver is killed with SIGKILL: the kernel kills this rank when its
    parent (the forkserver, which exits with the driver that started it) dies, and a watchdog
    thread polls the driver's pid: the only line where the forkserver outlives the driver (one
    shared by many pytest runs: harness/driver/warm_pytest.py)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass

    def watch():
        while True:
            try:
                os.kill(driver_pid, 0)
            except ProcessLookupError:
                os._exit(1)
            except PermissionError:
                pass
            time.sleep(0.5)

    threading.Thread(target=watch, name="driver-watchdog", daemon=True).start()


DIAL_TIMEOUT_S = 300.0


def _dial(config: RankConfig):
    """The driver's control connection; a refused one is dialled again until ``dial_timeout_s``."""
    deadline = time.monotonic() + config.dial_timeout_s
    while True:
        try:
            return Client(config.control_address, authkey=config.authkey)
        except ConnectionRefusedError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.5)


def _config_from_environment() -> RankConfig:
    """For ranks started by a launcher, on this host or others: torchrun sets RANK and WORLD_SIZE;
    CONFORMANCE_DRIVER (host:port of the driver's attach listener, which also serves the store on
    port+1) and CONFORMANCE_AUTHKEY (hex) come from the command the driver prints. The driver
    sends the backend and the store prefix when the rank connects."""
    host, port = os.environ["CONFORMANCE_DRIVER"].rsplit(":", 1)
    return RankConfig(
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
        local_rank=int(os.environ.get("LOCAL_RANK", os.environ["RANK"])),
        backend="",  # from the driver's "join"
        control_address=(host, int(port)),
        authkey=bytes.fromhex(os.environ["CONFORMANCE_AUTHKEY"]),
        store_host=host,
        store_port=int(port) + 1,
        threads=int(os.environ["OMP_NUM_THREADS"]) if os.environ.get("OMP_NUM_THREADS", "").isdigit() else None,
        dial_timeout_s=float(os.environ.get("CONFORMANCE_DIAL_TIMEOUT", DIAL_TIMEOUT_S)),
    )


if __name__ == "__main__":
    serve(_config_from_environment())
