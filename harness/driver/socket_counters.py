"""The kernel's count of the bytes a TCP socket has sent (struct tcp_info's tcpi_bytes_sent, RFC 4898
tcpEStatsPerfHCDataOctetsOut), read through sock_diag (NETLINK_SOCK_DIAG, the interface of ``ss``).

A contained rank may ``send`` on one socket only, its connection to the store
(harness/rank/syscall_filter.py): the kernel does not count ``send`` in /proc/<pid>/io, so the audit
adds what this socket sent during the task to what the rank wrote. Any process may dump the TCP
sockets of its network namespace with their statistics, so the driver reads them itself, in its own
memory, where no rank reaches; a socket is found by its inode, which the rank named before the
implementation under test loaded.
"""

from __future__ import annotations

import errno
import os
import socket
import struct

NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLM_F_REQUEST, NLM_F_DUMP = 0x1, 0x300
NLMSG_ERROR, NLMSG_DONE = 2, 3
INET_DIAG_INFO = 2
ALL_STATES = 0xFFFFFFFF
_HEADER = struct.Struct("=IHHII")  # struct nlmsghdr
_REQUEST = struct.Struct("=BBBBI48s")  # struct inet_diag_req_v2: family, protocol, ext, pad, states, socket id
_MESSAGE = struct.Struct("=BBBB48xIIIII")  # struct inet_diag_msg: ..., uid, inode
_ATTRIBUTE = struct.Struct("=HH")  # struct rtattr
BYTES_SENT_OFFSET = 200  # tcpi_bytes_sent in struct tcp_info (Linux 4.19 and later)


class Unreadable(RuntimeError):
    """The kernel's TCP statistics could not be read here."""


class TcpCounters:
    """The driver's reader of TCP sockets' counts. A socket is found once by its inode, in a dump of
    every TCP socket of the namespace (milliseconds with a few hundred sockets); after that it is
    asked for by its own id (address, ports and cookie), one socket in each answer (tens of
    microseconds), so that an audited task's two reads cost little whatever else is open."""

    def __init__(self):
        self._socket: socket.socket | None = None
        self._ids: dict[int, tuple[int, bytes]] = {}  # inode -> (family, struct inet_diag_sockid)

    def sent(self, inodes: set[int]) -> dict[int, int]:
        """{inode: bytes sent} for the TCP sockets with these inodes; an inode not found is left out
        (its socket is closed). Raises Unreadable where sock_diag refuses or its tcp_info is too short."""
        if self._socket is None:
            self._socket = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, NETLINK_SOCK_DIAG)
        found: dict[int, int] = {}
        unknown = {inode for inode in inodes if inode not in self._ids}
        if unknown:
            for family in (socket.AF_INET, socket.AF_INET6):
                self._ask(family, bytes(48), NLM_F_DUMP, unknown, found)
                if unknown <= set(found):
                    break  # the store listens on IPv4 (127.0.0.1) in every world started here
        for inode in inodes - set(found):
            if inode in self._ids:
                family, sockid = self._ids[inode]
                self._ask(family, sockid, 0, {inode}, found)
        return found

    def _ask(self, family: int, sockid: bytes, flags: int, inodes: set[int], found: dict[int, int]) -> None:
        request = _REQUEST.pack(family, socket.IPPROTO_TCP, 1 << (INET_DIAG_INFO - 1), 0, ALL_STATES, sockid)
        self._socket.send(_HEADER.pack(_HEADER.size + len(request), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST | flags, 1, 0) + request)
        while True:
            data = self._socket.recv(1 << 16)
            offset = 0
            while offset + _HEADER.size <= len(data):
                length, kind, _, _, _ = _HEADER.unpack_from(data, offset)
                if kind == NLMSG_DONE:
                    return
                if kind == NLMSG_ERROR:
                    (code,) = struct.unpack_from("=i", data, offset + _HEADER.size)
                    if flags == 0 and code in (-errno.ENOENT, -errno.ESTALE):
                        return  # asked for one socket by its id: it is gone
                    raise Unreadable(f"sock_diag refused the TCP sockets' statistics: {os.strerror(-code)}")
                body = offset + _HEADER.size
                inode = _MESSAGE.unpack_from(data, body)[-1]
                if inode in inodes:
                    self._ids[inode] = (family, data[body + 4 : body + 52])
                    found[inode] = _sent(data, body + _MESSAGE.size, offset + length)
                offset += (length + 3) & ~3
            if flags == 0:
                return  # one socket asked for: one message, no NLMSG_DONE

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close()
            self._socket = None


def _sent(data: bytes, start: int, end: int) -> int:
    while start + _ATTRIBUTE.size <= end:
        length, kind = _ATTRIBUTE.unpack_from(data, start)
        if length < _ATTRIBUTE.size:
            break
        if kind == INET_DIAG_INFO:
            if length - _ATTRIBUTE.size < BYTES_SENT_OFFSET + 8:
                raise Unreadable("this kernel's tcp_info has no tcpi_bytes_sent (Linux 4.19 or later needed)")
            return struct.unpack_from("=Q", data, start + _ATTRIBUTE.size + BYTES_SENT_OFFSET)[0]
        start += (length + 3) & ~3
    raise Unreadable("sock_diag gave a TCP socket without its tcp_info")
