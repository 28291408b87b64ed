"""Bounds on what the driver builds from a rank's reply, checked on the reply's bytes before anything
is built (harness/rank/wire.py: decode_untrusted; harness/driver/task_result.py for the audit's records).

Why a reply's length is not enough. The driver caps a reply's length (wire.reply_limit: 64 MiB per
rank of a world of 4 in a 1.5 GiB container), but a short pickle can stand for many objects: one
byte (``]``) is a new empty list, 64 bytes once built and held, so a reply of 8 MiB of them is half a
GiB of lists and one of 64 MiB is 4 GiB. The unpickler builds all of it before wire's walk, which
counts the values, ever sees it: the driver (pytest itself) is OOM-killed and reports nothing. The
same holds for the audit's records, JSON text inside the reply (``[],`` is 3 bytes for a 64-byte list).

So the driver reads the pickle's opcodes first, without building anything: linear in the reply's
length, keeping one byte per value on the pickle's stack and one per memo entry (at most 2 MiB at the
default bounds; a tensor's bytes are skipped, never read). The reply is refused, naming the bound, the
amount and where, unless it keeps within ``Bounds``; only then does the C unpickler build it. What
it may then build is small in the reply's terms: a value is at most ~80 bytes beyond its payload
(an empty dict and the pointers to it), text at most 4 bytes per byte of UTF-8 (counted so), bytes
one for one. Only the opcodes the pickler writes for plain data are read; anything else (globals,
sets, bytearrays, out-of-band buffers, persistent ids, POP and DUP) is refused here, so the walk's
guarantees and this count are about the same objects.

A JSON text is checked by counting its separators (four ``str.count``, in C): every value but a
container's first and the text's top one follows a ``,`` or a ``:``, so that count plus the ``[``
and ``{`` bounds the values json.loads builds; those characters inside strings only make it
stricter. Its depth needs no count: json.loads raises RecursionError past Python's recursion limit,
and every level is a value counted above.
"""

from __future__ import annotations

import pickle
import struct
from dataclasses import dataclass


class ReplyRefused(ValueError):
    """A rank's reply is too large, too deep or not plain data."""


@dataclass(frozen=True)
class Bounds:
    """What the driver builds from one reply at most. ``values``: objects the pickle pushes (each
    reference to an earlier one counts too); ``depth``: containers inside containers, as wire's walk
    counts them (a tensor is one value); ``text_bytes``: all the reply's strings together, once
    decoded (4 bytes per byte of UTF-8 where any is not ASCII); ``int_bytes``: one integer's
    two's complement (255: what the pickler writes with LONG1; its decimal form, 614 digits, stays
    under Python's 4300-digit limit on converting integers to text)."""

    # measured at 1 Mi empty dicts (a 1 MiB reply): 74 MiB held, 144 MiB at the peak (wire's walk copies
    # the tree); 4 ranks' worth stays within reply_limit's share at 1.5 GiB. Legitimate replies hold thousands
    values: int = 1 << 20
    depth: int = 16  # rank programs return at most 5 levels
    text_bytes: int = 16 << 20  # tracebacks and the audit's records (~150 bytes per call) are far below
    int_bytes: int = 255


_CHUNK = 1 << 20  # the most text copied at once to test it (bytes.isascii, ~50 times faster than a regex)
_U4 = struct.Struct("<I").unpack_from
_U8 = struct.Struct("<Q").unpack_from
_U2 = struct.Struct("<H").unpack_from


def _code(op: bytes) -> int:
    return op[0]


# a scalar or an empty container, pushed: the bytes of argument after the opcode
_PUSH = {
    _code(pickle.NONE): 0,
    _code(pickle.NEWTRUE): 0,
    _code(pickle.NEWFALSE): 0,
    _code(pickle.EMPTY_LIST): 0,
    _code(pickle.EMPTY_DICT): 0,
    _code(pickle.EMPTY_TUPLE): 0,
    _code(pickle.BININT1): 1,
    _code(pickle.BININT2): 2,
    _code(pickle.BININT): 4,
    _code(pickle.BINFLOAT): 8,
}
_TEXT, _BYTES, _INT = 0, 1, 2
# a value whose size comes first: (the size's own length, what it is)
_SIZED = {
    _code(pickle.SHORT_BINUNICODE): (1, _TEXT),
    _code(pickle.BINUNICODE): (4, _TEXT),
    _code(pickle.BINUNICODE8): (8, _TEXT),
    _code(pickle.SHORT_BINBYTES): (1, _BYTES),
    _code(pickle.BINBYTES): (4, _BYTES),
    _code(pickle.BINBYTES8): (8, _BYTES),
    _code(pickle.LONG1): (1, _INT),
    _code(pickle.LONG4): (4, _INT),
}
_TUPLE_N = {_code(pickle.TUPLE1): 1, _code(pickle.TUPLE2): 2, _code(pickle.TUPLE3): 3}
_MARK, _STOP, _PROTO, _FRAME = (_code(op) for op in (pickle.MARK, pickle.STOP, pickle.PROTO, pickle.FRAME))
_APPEND, _SETITEM, _APPENDS, _SETITEMS = (_code(op) for op in (pickle.APPEND, pickle.SETITEM, pickle.APPENDS, pickle.SETITEMS))
_TUPLE, _MEMOIZE, _BINPUT, _LONG_BINPUT = (_code(op) for op in (pickle.TUPLE, pickle.MEMOIZE, pickle.BINPUT, pickle.LONG_BINPUT))
_BINGET, _LONG_BINGET = _code(pickle.BINGET), _code(pickle.LONG_BINGET)


def _opcode_name(code: int) -> str:
    import pickletools  # only to name what is refused

    info = pickletools.code2op.get(chr(code))
    return info.name if info is not None else f"0x{code:02x}"


def check_pickle(data: bytes, bounds: Bounds) -> None:
    """Raise ReplyRefused unless unpickling ``data`` builds plain data within ``bounds``.

    Nesting is followed exactly for the values as the pickle builds them; a list filled through a
    memo reference after it was placed elsewhere can grow deeper than counted here, within the
    values bound (so within memory), and wire's walk refuses it. A tensor (a tuple holding its
    shape's tuple) is counted 2 levels deep here, so the limit here is ``depth + 2``: what the walk
    accepts, this accepts."""
    end, most = len(data), bounds.depth + 2
    heights = bytearray()  # per value on the pickle's stack: how many levels of containers it holds
    memo = bytearray()  # per memo entry: its value's height when memoized
    marks: list[int] = []  # the stack's length at each open MARK
    values = text = 0
    i = 0
    pushed, push, most_values = _PUSH.get, heights.append, bounds.values  # locals: the loop runs once per value
    try:
        while i < end:
            op = data[i]
            i += 1
            size = pushed(op)
            if size is not None:
                i += size
                push(0)
            elif op in _SIZED:
                width, kind = _SIZED[op]
                length = data[i] if width == 1 else _U4(data, i)[0] if width == 4 else _U8(data, i)[0]
                start = i + width
                i = start + length
                if i > end:
                    raise ReplyRefused(f"a reply cut short: a value of {length} bytes at byte {start} of {end}")
                if kind == _TEXT:
                    text += length if _ascii(data, start, i) else 4 * length
                    if text > bounds.text_bytes:
                        raise ReplyRefused(
                            f"a reply with more than {bounds.text_bytes} bytes of text (the limit): its strings "
                            f"reach {text} bytes, decoded, at byte {start} of {end}"
                        )
                elif kind == _INT and length > bounds.int_bytes:
                    raise ReplyRefused(f"an integer of {length} bytes in a reply (the limit: {bounds.int_bytes}), at byte {start}")
                heights.append(0)
            elif op == _MEMOIZE or op == _BINPUT or op == _LONG_BINPUT:
                if op != _MEMOIZE:
                    index = data[i] if op == _BINPUT else _U4(data, i)[0]
                    i += 1 if op == _BINPUT else 4
                    if index != len(memo):  # the pickler numbers them in order; a far one makes the memo that long
                        raise ReplyRefused(f"a reply's memo index {index} out of order (expected {len(memo)}), at byte {i}")
                if len(memo) >= values:  # the pickler memoizes a value once, after building it
                    raise ReplyRefused(f"a reply that memoizes more than the {values} values it built, at byte {i}")
                memo.append(heights[-1])
                continue
            elif op == _BINGET or op == _LONG_BINGET:
                index = data[i] if op == _BINGET else _U4(data, i)[0]
                i += 1 if op == _BINGET else 4
                if index >= len(memo):
                    raise ReplyRefused(f"a reply refers to memo entry {index} of {len(memo)}, at byte {i}")
                heights.append(memo[index])
            elif op == _APPEND or op == _SETITEM:
                taken = 1 if op == _APPEND else 2
                if len(heights) <= taken:
                    raise ReplyRefused(f"a malformed reply: {_opcode_name(op)} with nothing to add to, at byte {i - 1}")
                _into(heights, len(heights) - taken, most, i)
                continue
            elif op == _APPENDS or op == _SETITEMS:
                if not marks or marks[-1] == 0:
                    raise ReplyRefused(f"a malformed reply: {_opcode_name(op)} with nothing to add to, at byte {i - 1}")
                _into(heights, marks.pop(), most, i)
                continue
            elif op == _MARK:
                marks.append(len(heights))
                if len(marks) > bounds.depth + 1:  # one open per container being filled, and a tensor's
                    raise ReplyRefused(f"a reply nested more than {bounds.depth} levels deep: {len(marks)} open at byte {i - 1}")
                continue
            elif op in _TUPLE_N or op == _TUPLE:
                start = len(heights) - _TUPLE_N[op] if op != _TUPLE else marks.pop() if marks else -1
                if start < 0:
                    raise ReplyRefused(f"a malformed reply: {_opcode_name(op)} with too few values, at byte {i - 1}")
                height = max(heights[start:], default=-1) + 1
                del heights[start:]
                heights.append(height)
                if height > most:
                    raise ReplyRefused(f"a reply nested more than {bounds.depth} levels deep ({height} at byte {i - 1}, a tensor counting 2)")
            elif op == _FRAME:
                length = _U8(data, i)[0]
                i += 8
                if i + length > end:
                    raise ReplyRefused(f"a reply cut short: a frame of {length} bytes at byte {i} of {end}")
                continue
            elif op == _PROTO:
                i += 1
                continue
            elif op == _STOP:
                return
            else:
                raise ReplyRefused(f"a reply holding {_opcode_name(op)} at byte {i - 1}: a rank sends plain data only (harness/rank/wire.py)")
            values += 1
            if values > most_values:
                raise ReplyRefused(f"a reply of more than {bounds.values} values (the limit), counted to byte {i} of {end}")
    except (IndexError, struct.error):
        raise ReplyRefused(f"a reply cut short or malformed at byte {i} of {end}") from None
    raise ReplyRefused(f"a reply cut short: no STOP in its {end} bytes")


def _ascii(data: bytes, start: int, stop: int) -> bool:
    if stop - start <= _CHUNK:
        return data[start:stop].isascii()
    return all(data[j : min(j + _CHUNK, stop)].isascii() for j in range(start, stop, _CHUNK))


def _into(heights: bytearray, start: int, most: int, at: int) -> None:
    """The values from ``start`` on go into the container just below them (APPEND(S), SETITEM(S))."""
    if start < len(heights):
        height = max(heights[start:]) + 1
        del heights[start:]
        if height > heights[-1]:
            if height > most:
                raise ReplyRefused(f"a reply nested more than {most - 2} levels deep ({height} at byte {at - 1}, a tensor counting 2)")
            heights[-1] = height


def check_json(text: str, bounds: Bounds) -> None:
    """Raise ReplyRefused unless json.loads(text) builds at most ``bounds.values`` values (see the
    module's docstring for why the count of separators bounds them)."""
    if len(text) > bounds.text_bytes:
        raise ReplyRefused(f"a JSON text of {len(text)} characters in a reply (the limit: {bounds.text_bytes})")
    most = text.count(",") + text.count(":") + text.count("[") + text.count("{") + 1
    if most > bounds.values:
        raise ReplyRefused(f"a JSON text of up to {most} values in a reply (the limit: {bounds.values})")
