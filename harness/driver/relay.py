"""The relay, driver side: the only transport between the ranks of a relay world, run by a thread of
the pytest process, where no rank reaches. What it carries is the audit's evidence (issue 58, item
1): every message a rank sent, to whom, of how many bytes, and every receive it matched; a rank's
own records are attribution, never allowance. The rank's half and the wire format:
harness/rank/relay_transport.py.

Each rank connects once, while joining the world, and proves which rank it is with the token the
driver gave that rank alone on its authenticated control connection; a second connection with a used
token, or a stranger, is closed, and the listener closes once every rank has connected, before any
implementation loads.

Semantics (those of gloo's point-to-point calls, which the implementations are written against):
a message waits at the relay until its destination asks for it; a receive takes the first message
held for it from its source (or from any source) with its tag, so messages between two ranks with
one tag arrive in the order sent; a receive whose size differs from the message's is refused, naming
both. A barrier releases its group once every member has arrived. A message nobody received by the
end of a task is a stray: named, and dropped, so that no later test receives it.

Bounded by memory, as every reply to the driver is: everything the relay holds at once (messages
not yet received, collective inputs waiting for their group, answers a rank has not read, partial
messages) stays within ``budget`` bytes, its share of the container's memory (harness/driver/
world.py: a quarter, as the replies get). The message or answer that would pass it ends the
connection of the rank that sent it, or of the rank that does not read its answers, and the task
fails, saying so."""

from __future__ import annotations

import json
import queue
import secrets
import selectors
import socket
import struct
import threading
from dataclasses import dataclass, field

import torch

from parallelism_conformance.harness.driver import relay_collectives
from parallelism_conformance.harness.rank.relay_transport import (
    ANY,
    BARRIER,
    COLLECTIVE,
    DELIVER,
    DESCRIPTION_LIMIT,
    HEADER,
    HELLO,
    MARK,
    PHASE_LIMIT,
    RECV,
    REFUSED,
    RELEASED,
    SEND,
    TOKEN_BYTES,
)

MESSAGE_LIMIT = 256 << 20  # one message, whatever the budget
BUDGET = 1 << 30  # the default, where the driver's memory has no limit
SETTLE_TIMEOUT_S = 10.0


@dataclass
class Relayed:
    """What the relay carried during one task."""

    records: dict[int, list[dict]]  # rank -> its sends, receives and barriers, in the audit's record shape
    read: list[int]  # bytes the relay read from each rank (headers included)
    strays: list[str] = field(default_factory=list)  # messages sent and never received
    broken: list[str] = field(default_factory=list)  # connections the relay ended, and why


class Relay:
    def __init__(self, size: int, host: str = "127.0.0.1", budget: int = BUDGET):
        self.size = size
        self.budget = budget
        self._holding = 0  # bytes held now: messages, collective inputs, answers not yet read
        self._listener = socket.create_server((host, 0))
        self._listener.setblocking(False)
        self.host, self.port = self._listener.getsockname()[:2]
        self._tokens = [secrets.token_bytes(TOKEN_BYTES) for _ in range(size)]
        self._rank_of: dict[socket.socket, int | None] = {}  # None: connected, not yet identified
        self._socket_of: dict[int, socket.socket] = {}
        self._inbox: dict[socket.socket, bytearray] = {}
        self._outbox: dict[int, bytearray] = {}
        self._held: dict[int, list[tuple]] = {r: [] for r in range(size)}  # dst -> (src, channel, tag, payload)
        self._asks: dict[int, list[tuple]] = {r: [] for r in range(size)}  # dst -> (src, channel, tag, request, size, phase)
        self._arrived: dict[tuple, dict[int, list]] = {}  # (kind, channel, group) -> rank -> its calls, in order
        self._phase = [None] * size
        self._records: dict[int, list[dict]] = {r: [] for r in range(size)}
        self._read = [0] * size
        self._broken: list[str] = []
        self._calls: queue.Queue = queue.Queue()
        self._wake_read, self._wake_write = socket.socketpair()
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._selector.register(self._wake_read, selectors.EVENT_READ)
        self._stopped = False
        self._thread = threading.Thread(target=self._serve, name="relay", daemon=True)
        self._thread.start()

    def join_info(self, rank: int) -> tuple[str, int, bytes]:
        """What rank ``rank`` connects with (sent to it alone, on its control connection)."""
        return (self.host, self.port, self._tokens[rank])

    # --------------------------------------------------------------------- the driver's calls
    def take(self) -> Relayed:
        """What was carried since the last take: read once every rank is idle (its reply is in),
        after the relay has read all they wrote. Messages still held are strays, dropped here."""
        return self._call(self._take)

    def close(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        self._wake_write.send(b"x")
        self._thread.join(timeout=SETTLE_TIMEOUT_S)
        for sock in [*self._rank_of, self._listener, self._wake_read, self._wake_write]:
            sock.close()
        self._selector.close()

    def _call(self, function):
        answer: queue.Queue = queue.Queue(maxsize=1)
        self._calls.put((function, answer))
        self._wake_write.send(b"c")
        try:
            return answer.get(timeout=SETTLE_TIMEOUT_S)
        except queue.Empty:
            raise RuntimeError(f"the relay did not answer in {SETTLE_TIMEOUT_S:g} s") from None

    def _take(self) -> Relayed:
        while self._listener.fileno() != -1 and self._accept():  # connections the selector has not shown yet
            pass
        for sock in list(self._rank_of):  # everything a rank wrote before its reply: in the socket now
            self._readable(sock)
        strays = [
            f"rank {src} -> rank {dst} (tag {tag}, {len(payload)} B)" for dst, held in self._held.items() for src, _, tag, payload in held
        ]
        taken = Relayed({r: self._records[r] for r in range(self.size)}, list(self._read), strays, self._broken)
        self._records = {r: [] for r in range(self.size)}
        self._read = [0] * self.size
        self._broken = []
        self._held = {r: [] for r in range(self.size)}
        self._asks = {r: [] for r in range(self.size)}  # a receive left posted would take a later test's message
        self._arrived = {}
        self._holding = sum(map(len, self._outbox.values())) + sum(map(len, self._inbox.values()))
        return taken

    # ------------------------------------------------------------------------------ the thread
    def _serve(self) -> None:
        while not self._stopped:
            for key, events in self._selector.select():
                sock = key.fileobj
                if sock is self._listener:
                    self._accept()
                elif sock is self._wake_read:
                    sock.recv(4096)
                    while not self._calls.empty():
                        function, answer = self._calls.get()
                        answer.put(function())
                else:
                    if events & selectors.EVENT_READ:
                        self._readable(sock)
                    if events & selectors.EVENT_WRITE and sock in self._rank_of:
                        self._flush(self._rank_of[sock])

    def _accept(self) -> bool:
        try:
            sock, _ = self._listener.accept()
        except OSError:  # none waiting, or the listener is closed: every rank is in
            return False
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._rank_of[sock] = None
        self._inbox[sock] = bytearray()
        self._selector.register(sock, selectors.EVENT_READ)
        return True

    def _readable(self, sock: socket.socket) -> None:
        while sock in self._rank_of:
            try:
                data = sock.recv(1 << 20)
            except BlockingIOError:
                return
            except OSError as error:
                self._end(sock, f"its connection failed: {error}")
                return
            if not data:
                self._end(sock, None)
                return
            inbox = self._inbox[sock]
            inbox += data
            self._holding += len(data)
            while len(inbox) >= HEADER.size:
                kind, peer, request, channel, tag, size = HEADER.unpack_from(inbox)
                if size > MESSAGE_LIMIT:
                    self._end(sock, f"a message of {size} B, over the relay's limit of {MESSAGE_LIMIT} B")
                    return
                if len(inbox) < HEADER.size + size:
                    break
                payload = bytes(inbox[HEADER.size : HEADER.size + size])
                del inbox[: HEADER.size + size]
                self._holding -= HEADER.size + size  # what a message keeps is counted again where it is kept
                try:
                    why = self._message(sock, kind, peer, request, channel, tag, payload)
                except Exception as error:  # noqa: BLE001 - a rank's bytes never end the relay's thread: that rank's connection instead
                    why = f"a message the relay cannot read: {error}"
                if why:
                    self._end(sock, why)
                    return
                if kind != HELLO:  # what the rank sent during tasks, counted by the message (its hello may share a read)
                    self._read[self._rank_of[sock]] += HEADER.size + size
            # checked once what arrived is parsed (a message fully read is counted where it is kept): at
            # most one read of 1 MiB above the budget, whatever the messages' sizes and how they arrive
            if self._holding > self.budget:
                self._end(sock, f"{len(inbox)} B of a message in flight, and {self._holding} B held in all, over {self._over()}")
                return

    def _over(self) -> str:
        return f"the relay's share of the driver's memory, {self.budget} B ({self._holding} B held)"

    def _end(self, sock: socket.socket, why: str | None) -> None:
        rank = self._rank_of.pop(sock, None)
        self._holding -= len(self._inbox.pop(sock, b"")) + len(self._outbox.get(rank, b""))
        self._outbox.pop(rank, None)
        self._selector.unregister(sock)
        sock.close()
        if why and rank is not None:
            self._broken.append(f"the relay ended rank {rank}'s connection: {why}")
        if rank is not None:
            self._socket_of.pop(rank, None)

    # ----------------------------------------------------------------------------- messages
    def _message(self, sock, kind: int, peer: int, request: int, channel: int, tag: int, payload: bytes) -> str | None:
        """Handle one message; a reason where it breaks the protocol (the connection then ends)."""
        rank = self._rank_of[sock]
        if rank is None:
            if kind != HELLO or payload not in self._tokens or self._tokens.index(payload) in self._socket_of:
                return "a connection that did not identify itself"
            rank = self._rank_of[sock] = self._tokens.index(payload)
            self._socket_of[rank] = sock
            self._outbox[rank] = bytearray()
            if len(self._socket_of) == self.size:  # every rank is in: nobody else may connect
                self._selector.unregister(self._listener)
                self._listener.close()
            return None
        if kind == MARK:
            self._phase[rank] = payload[:PHASE_LIMIT].decode(errors="replace") or None
        elif kind == SEND:
            if not (0 <= peer < self.size) or peer == rank:
                return f"a message to rank {peer}, which is not a peer in a world of {self.size}"
            self._records[rank].append(self._record("send", rank, peer, tag, len(payload)))
            self._held[peer].append((rank, channel, tag, payload))
            self._holding += len(payload)
            self._match(peer)
        elif kind == RECV:
            if len(payload) != 8 or not (peer == ANY or (0 <= peer < self.size and peer != rank)):
                return f"a receive from rank {peer}, which is not a peer in a world of {self.size}"
            self._asks[rank].append((peer, channel, tag, request, struct.unpack("<Q", payload)[0], self._phase[rank]))
            self._match(rank)
        elif kind == BARRIER:
            if len(payload) % 4:
                return "a barrier whose group is not a list of ranks"
            group = tuple(struct.unpack(f"<{len(payload) // 4}I", payload))
            if rank not in group or any(not 0 <= r < self.size for r in group):
                return f"a barrier of group {list(group)}, which rank {rank} is not a member of"
            self._records[rank].append({**self._record("barrier", rank, None, 0, 0), "group": list(group)})
            arrived = self._arrived.setdefault((BARRIER, channel, group), {})
            arrived.setdefault(rank, []).append(request)
            if all(arrived.get(member) for member in group):
                for member in group:
                    self._reply(member, RELEASED, 0, arrived[member].pop(0), 0, b"")
        elif kind == COLLECTIVE:
            return self._collective(rank, request, channel, payload)
        else:
            return f"a message of unknown kind {kind}"
        return None

    def _record(self, op: str, rank: int, peer, tag: int, size: int) -> dict:
        """The audit's record shape (harness/rank/recording.py), made here from what was relayed."""
        return {
            "op": op,
            "group": list(range(self.size)),
            "rank": rank,
            "dtype": None,
            "itemsize": 1,
            "numel": size if op == "send" else 0,
            "bytes": size if op == "send" else 0,
            "out_numel": size if op == "recv" else 0,
            "out_bytes": size if op == "recv" else 0,
            "peer": peer,
            "root": None,
            "reduce_op": None,
            "splits": None,
            "tag": tag,
            "phase": self._phase[rank],
        }

    def _collective(self, rank: int, request: int, channel: int, payload: bytes) -> str | None:
        (length,) = struct.unpack_from("<I", payload)
        if length > DESCRIPTION_LIMIT:
            return f"a collective described in {length} B, over the relay's limit of {DESCRIPTION_LIMIT} B"
        description = json.loads(payload[4 : 4 + length])
        group = description["group"]
        if not (isinstance(group, list) and rank in group and all(isinstance(r, int) and 0 <= r < self.size for r in group)):
            return f"a collective of group {group}, which rank {rank} is not a member of"
        arrived = self._arrived.setdefault((COLLECTIVE, channel, tuple(group)), {})
        arrived.setdefault(rank, []).append((request, description, payload[4 + length :], self._phase[rank]))  # called in it
        self._holding += len(payload) - 4 - length
        if not all(arrived.get(member) for member in group):
            return None
        calls = [arrived[member].pop(0) for member in group]
        self._holding -= sum(len(data) for _, _, data, _ in calls)
        descriptions = [description for _, description, _, _ in calls]
        try:
            outputs = relay_collectives.compute(descriptions, [relay_collectives.tensors(d, data) for _, d, data, _ in calls])
            for member, d, out in zip(group, descriptions, outputs):
                if out.numel() != sum(d["outputs"]):
                    raise relay_collectives.Refused(f"rank {member}'s outputs hold {sum(d['outputs'])} elements, the result {out.numel()}")
        except (relay_collectives.Refused, RuntimeError, ValueError, TypeError, KeyError, IndexError) as refused:  # sizes torch cannot split
            for member, (asked, _, _, _) in zip(group, calls):
                self._reply(member, REFUSED, 0, asked, 0, str(refused).encode())
            return None
        made = relay_collectives.records(descriptions, [phase for _, _, _, phase in calls])
        for member, (asked, _, _, _), out, record in zip(group, calls, outputs, made):
            self._records[member].append(record)
            self._reply(member, DELIVER, 0, asked, 0, out.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        return None

    def _match(self, dst: int) -> None:
        asks, held = self._asks[dst], self._held[dst]
        for ask in list(asks):
            src, channel, tag, request, size, phase = ask
            found = next((i for i, (s, c, t, _) in enumerate(held) if c == channel and t == tag and src in (ANY, s)), None)
            if found is None:
                continue
            sender, _, _, payload = held.pop(found)
            self._holding -= len(payload)
            asks.remove(ask)
            if len(payload) != size:
                why = f"rank {sender} sent {len(payload)} B (tag {tag}), and this receive expects {size} B"
                self._reply(dst, REFUSED, sender, request, tag, why.encode())
                continue
            self._records[dst].append({**self._record("recv", dst, sender, tag, size), "phase": phase})  # posted in it
            self._reply(dst, DELIVER, sender, request, tag, payload)

    def _reply(self, rank: int, kind: int, peer: int, request: int, tag: int, payload: bytes) -> None:
        if rank not in self._socket_of or rank not in self._outbox:
            return
        if self._holding + len(payload) > self.budget:  # it does not read its answers: they would pile up here
            self._end(
                self._socket_of[rank], f"answers it has not read, {len(self._outbox[rank])} B, and {len(payload)} B more, over {self._over()}"
            )
            return
        self._outbox[rank] += HEADER.pack(kind, peer, request, 0, tag, len(payload)) + payload
        self._holding += HEADER.size + len(payload)
        self._flush(rank)

    def _flush(self, rank: int) -> None:
        sock, outbox = self._socket_of.get(rank), self._outbox.get(rank)
        if sock is None or outbox is None:
            return
        try:
            sent = sock.send(outbox)
            del outbox[:sent]
            self._holding -= sent
        except BlockingIOError:
            pass
        except OSError as error:
            self._end(sock, f"its connection failed: {error}")
            return
        self._selector.modify(sock, selectors.EVENT_READ | (selectors.EVENT_WRITE if outbox else 0))
