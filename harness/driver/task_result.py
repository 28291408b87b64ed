"""What a task brings back from the ranks, driver side: one rank's reply read and decoded, with the
limit on its size (harness/rank/wire.py: reply_limit), and the world's result, every rank's reply
together (harness/driver/world.py, World.run)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from parallelism_conformance.harness.driver import refused_calls
from parallelism_conformance.harness.driver.rank_handle import RankHandle
from parallelism_conformance.harness.rank import reply_bounds, wire


@dataclass
class TaskResult:
    outputs: list  # per rank, what the rank program returned
    logs: list[str]  # per rank, what it printed during the task: its head and tail (harness/driver/rank_output.py)
    records: list = field(default_factory=list)  # per rank, its communication calls (harness/rank/recording.py); [] unless audited
    # per rank, the bytes the kernel saw it write during the task (/proc/<pid>/io wchar: write, writev,
    # not send or splice), less its reply and its captured output's growth; None where not measured
    # (attached ranks, worlds that do not record). It cannot lower it, but can dodge it (docs/grading.md)
    bytes_written: list = field(default_factory=list)
    # per rank, why its count is missing where it should have been measured (a local rank of an
    # audited world), else "": the audit fails on evidence withheld instead of skipping it
    bytes_unread: list = field(default_factory=list)
    late: list = field(default_factory=list)  # per rank, the calls --perturb-timing delayed (Perturbation.report)
    relayed: object = None  # in a relay world, what the driver's relay carried (harness/driver/relay.py: Relayed)


def collect(rank: RankHandle, task_id: int, reply_limit: int, world_size: int) -> tuple[str, object]:
    """One rank's reply to task ``task_id`` once its connection or process is ready: ("ok", (its
    output, its communication records, the calls perturbation delayed)), or the failure's status
    ("exited", "broken", "raised", "missing", "unloadable") and what to say of it, with the system
    calls its allow list refused meanwhile (harness/driver/refused_calls.py)."""
    status, said = _collect(rank, task_id, reply_limit, world_size)
    refused = refused_calls.since_last(rank)  # read after every task: a task's refusals are its own
    return (status, said + refused) if refused and status != "ok" else (status, said)


def _collect(rank: RankHandle, task_id: int, reply_limit: int, world_size: int) -> tuple[str, object]:
    if rank.conn.poll():
        try:  # a reply over the limit is refused by its length header, before the driver holds any of it
            raw = rank.conn.recv_bytes(maxlength=reply_limit)
            rank.reply_bytes = len(raw) + (4 if len(raw) < 0x7FFFFFFF else 12)  # Connection's length header
            message = wire.decode_untrusted(raw)
        except (EOFError, OSError) as error:
            if "bad message length" in str(error):  # the connection is out of step: the world is rebuilt
                return "broken", (
                    f"the rank sent a reply over the driver's limit of {reply_limit} bytes "
                    f"(harness/rank/wire.py: reply_limit, for {world_size} ranks in this memory)"
                )
            return "exited", rank.describe_exit()
        except Exception as error:  # noqa: BLE001 - refused by the restricted unpickler
            return "raised", f"the rank sent a result the driver refuses to decode: {error}"
        if not isinstance(message, tuple) or len(message) < 3:  # a reply of another shape: the rank's, not the driver's, error
            return "raised", f"the rank sent a reply that is not a task's result: {type(message).__name__}"
        if message[0] == "done" and message[1] == task_id:
            text = message[3] if len(message) > 3 else ""
            try:  # the audit's records travel as one JSON string: a tenth of the cost of plain-data pickling
                if text:  # its values counted before json.loads builds them (harness/rank/reply_bounds.py)
                    reply_bounds.check_json(text, reply_bounds.Bounds())
                records = json.loads(text) if text else []
            except (TypeError, ValueError, RecursionError) as error:
                return "raised", f"the rank sent communication records the driver cannot read: {error}"
            return "ok", (message[2], records, message[4] if len(message) > 4 and isinstance(message[4], list) else [])
        if message[0] == "error" and len(message) > 3:
            return (message[3] if message[3] in ("missing", "unloadable", "broken") else "raised"), str(message[2])
        return "raised", f"unexpected message from rank: {message[:2]!r}"
    return "exited", rank.describe_exit()
