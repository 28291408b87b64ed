"""Issue 58, item 5: decoding a rank's reply is bounded by memory, not only by the reply's length. A
reply within the length limit (wire.reply_limit) whose pickle or JSON stands for a gigabyte of
objects is refused by name (which bound, how much, the limit) before the driver builds any of it
(harness/rank/reply_bounds.py), and the replies the harness really sends decode as before."""

from __future__ import annotations

import io
import pickle
import re
import resource
import struct
import time
import tracemalloc
from pathlib import Path

import pytest
import torch

from parallelism_conformance.harness.driver.failures import RankFailure
from parallelism_conformance.harness.driver.pool import WorldPool
from parallelism_conformance.harness.rank import reply_bounds, wire
from parallelism_conformance.harness.rank.reply_bounds import Bounds, ReplyRefused

FIXTURES = Path(__file__).parent / "fixtures"
CALL = "parallelism_conformance.harness.rank.programs.collectives:call"
MiB = 1 << 20


def reply(result: bytes, records: str = "") -> bytes:
    """("done", 7, <result>, records, []) in protocol 5, the result's opcodes as given: what a rank
    that wrote its own encoder could send (tests/fixtures/inflating_reply_impl.py does)."""
    text = records.encode()
    head = pickle.PROTO + b"\x05" + pickle.MARK + pickle.SHORT_BINUNICODE + b"\x04done" + pickle.BININT1 + b"\x07"
    return head + result + pickle.BINUNICODE + struct.pack("<I", len(text)) + text + pickle.EMPTY_LIST + pickle.TUPLE + pickle.STOP


def _kib(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1)) * 1024


def peak_growth(run) -> int:
    """How far this process's resident set peaked above its size before ``run()``: the kernel's
    high-water mark, reset first (/proc/self/clear_refs, 5), so that it counts what the C unpickler
    would allocate too. Where it cannot be reset, Python's allocations traced (tracemalloc: ~40
    times slower on the check's loop, which makes an integer per byte it steps)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        tracemalloc.start()
        try:
            run()
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    before = _kib("VmRSS")
    run()
    return _kib("VmHWM") - before


def refused_within(data: bytes, match: str) -> int:
    """The peak memory growth while ``data`` is refused, its message matching ``match``."""

    def refuse():
        with pytest.raises(ReplyRefused, match=match):
            wire.decode_untrusted(data)

    return peak_growth(refuse)


@pytest.mark.parametrize(
    "empty",
    [pickle.EMPTY_LIST, pickle.EMPTY_DICT, pickle.EMPTY_TUPLE, pickle.NONE],
    ids=["lists", "dicts", "tuples", "nones"],
)
def test_a_reply_of_8_mib_of_empty_containers_is_refused_before_any_is_built(empty):
    data = reply(pickle.EMPTY_LIST + pickle.MARK + empty * (8 * MiB) + pickle.APPENDS)
    assert len(data) < wire.MIN_REPLY_LIMIT  # within the length limit: only the count refuses it
    peak = refused_within(data, rf"more than {Bounds().values} values \(the limit\), counted to byte \d+ of {len(data)}")
    # unbounded, 8 Mi lists are 512 MiB (8 Mi dicts 576 MiB); refused, one byte of bookkeeping per value
    assert peak < len(data) // 4, peak


def test_references_to_one_list_count_as_values_too():
    # one list memoized, then 4 Mi references to it (2 bytes each, 8 bytes of pointer once built)
    many = pickle.EMPTY_LIST + pickle.MEMOIZE + pickle.EMPTY_LIST + pickle.MARK
    data = reply(many + (pickle.BINGET + b"\x00") * (4 * MiB) + pickle.APPENDS)
    assert refused_within(data, "more than 1048576 values") < len(data) // 4


@pytest.mark.parametrize(
    "nested, match",
    [
        (pickle.EMPTY_LIST * (MiB // 2) + pickle.APPEND * (MiB // 2 - 1), r"nested more than 16 levels deep \(19 at byte"),
        (pickle.MARK * MiB, "nested more than 16 levels deep: 18 open"),
        (pickle.EMPTY_TUPLE + pickle.TUPLE1 * MiB, r"nested more than 16 levels deep \(19 at byte"),
    ],
    ids=["lists", "marks", "tuples"],
)
def test_deep_nesting_is_refused_at_the_depth_limit(nested, match):
    data = reply(nested)
    assert refused_within(data, match) < len(data)


def test_text_integers_and_memo_indexes_are_bounded_too():
    # 8 MiB of text with one character outside the BMP: 32 MiB once decoded (4 bytes per character)
    wide = "x" * (8 * MiB) + "\U0001f600"
    refused = r"more than 16777216 bytes of text \(the limit\): its strings reach 33554452 bytes, decoded"
    assert refused_within(reply(pickle.NONE, wide), refused) < MiB
    assert wire.decode_untrusted(reply(pickle.NONE, "x" * (8 * MiB)))[3] == "x" * (8 * MiB)  # ASCII: 8 MiB
    huge_int = pickle.LONG4 + struct.pack("<I", MiB) + b"\x01" * MiB
    refused_within(reply(huge_int), r"an integer of 1048576 bytes in a reply \(the limit: 255\)")
    assert wire.decode_untrusted(reply(pickle.LONG1 + b"\xff" + b"\x01" * 254 + b"\x7f"))[2] > 0
    far = pickle.EMPTY_LIST + pickle.LONG_BINPUT + struct.pack("<I", 0xFFFFFFF0)  # the C unpickler sizes its memo to it
    refused_within(reply(far), "memo index 4294967280 out of order")
    refused_within(reply(pickle.EMPTY_LIST + pickle.MEMOIZE * 10), "memoizes more than the 3 values it built")
    refused_within(reply(pickle.EMPTY_SET), "a reply holding EMPTY_SET at byte 11: a rank sends plain data only")
    refused_within(reply(pickle.BINBYTES8 + struct.pack("<Q", 1 << 62)), "cut short: a value of 4611686018427387904 bytes")
    refused_within(reply(pickle.EMPTY_LIST)[:-1], "no STOP")


def test_the_audits_records_json_is_counted_before_it_is_parsed():
    bounds = Bounds()
    attack = "[" + "[]," * (8 * MiB // 3) + "[]]"  # 8 MiB, 180 MiB of lists once parsed

    def refuse():
        with pytest.raises(ReplyRefused, match=r"a JSON text of up to 5592407 values in a reply \(the limit: 1048576\)"):
            reply_bounds.check_json(attack, bounds)

    assert peak_growth(refuse) < MiB
    records = '[{"op": "all_reduce", "group": [0, 1], "rank": 0, "dtype": "float32", "numel": 4, "splits": null}]' * 1
    reply_bounds.check_json(records, bounds)  # a real record passes


def legacy_decode(data: bytes):
    """The decoder before the bounds on the bytes: unpickle, then walk."""
    return wire._unpack(wire._PlainDataUnpickler(io.BytesIO(data)).load(), wire._Budget(Bounds()), 0)


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return type(b) is dict and list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and (a == b or a != a and b != b)


def test_a_normal_reply_decodes_as_before_and_the_check_costs_little():
    shared = [1, 2]
    result = {
        "tensors": [torch.randn(15 * 2**18) for _ in range(4)],  # test_large_message's 15 MiB, four times
        "grads": {f"layer{i}.weight": torch.randn(64, 64, dtype=torch.bfloat16) for i in range(50)},
        "scalars": [1, -5, 300, 70000, 2**62, -(2**200), 0.5, float("nan"), None, True, False, "é😀", b"\x00raw", (), (1,), (1, 2, 3, 4)],
        "empty": torch.empty(0, 3),
        "dtype": torch.float16,
        "shared": [shared, shared],
        "deep": [[[[[[torch.ones(2, 2)]]]]]],
    }
    message = ("done", 3, result, '[{"op": "all_reduce"}]', [["all_reduce", 0.001]])
    data = wire.encode_untrusted(message)
    decoded = wire.decode_untrusted(data)
    assert same(decoded, legacy_decode(data)) and same(decoded[2]["tensors"], result["tensors"])
    assert decoded[2]["dtype"] is torch.float16 and same(decoded[2]["scalars"], result["scalars"])

    def best(run, times=5) -> float:
        timings = []
        for _ in range(times):
            started = time.perf_counter()
            run()
            timings.append(time.perf_counter() - started)
        return min(timings)

    check = best(lambda: reply_bounds.check_pickle(data, Bounds()))
    whole = best(lambda: wire.decode_untrusted(data))
    # measured: 0.2 ms of 46 ms for this 60 MiB reply; the opcodes are read, a tensor's bytes skipped
    assert check < 0.05 * whole, (check, whole)


def test_the_limits_are_where_the_walk_puts_them():
    """What the walk after unpickling accepts, the check on the bytes accepts: a tensor 16 levels
    down, and a reply of exactly ``values`` values; one more of either is refused."""
    leaf = torch.arange(3)
    for _ in range(15):
        leaf = [leaf]
    assert same(wire.decode_untrusted(wire.encode_untrusted(("done", leaf))), ("done", leaf))
    with pytest.raises(ReplyRefused, match="nested more than 16 levels deep"):
        wire.decode_untrusted(wire.encode_untrusted(("done", [leaf])))
    wide = torch.arange(3)  # the same, through containers of two (filled after a MARK each)
    for level in range(15):
        wide = {"a": wide, "b": 1} if level % 2 else [wide, 1]
    message = ("done", 7, wide, "", [])  # the rank loop's 5-tuple: the tensor 16 levels down
    assert same(wire.decode_untrusted(wire.encode_untrusted(message)), message)
    with pytest.raises(ReplyRefused, match="nested more than 16 levels deep"):
        wire.decode_untrusted(wire.encode_untrusted(("done", 7, [wide, 1], "", [])))
    small = Bounds(values=1000)
    fits = wire.encode_untrusted(list(range(1000, 1999)))  # the list and its 999 integers
    assert wire.decode_untrusted(fits, small) == list(range(1000, 1999))
    with pytest.raises(ReplyRefused, match="more than 1000 values"):
        wire.decode_untrusted(wire.encode_untrusted(list(range(1000, 2000))), small)


def test_inflating_replies_from_ranks_fail_the_task_by_name_and_the_driver_lives_on():
    """tests/fixtures/inflating_reply_impl.py: rank 0 sends 8 MiB of empty lists, rank 1 8 MiB of
    JSON records of empty lists, rank 2 lists half a million levels deep (512 MiB, 180 MiB and 32 MiB
    once built); each is refused by name and the driver's peak memory barely moves."""
    tensors = [{"function": "all_reduce", "arguments": {"tensor": torch.full((4,), r + 1.0), "op": "SUM"}, "group": None} for r in range(3)]
    with WorldPool("gloo", timeout_s=20.0) as pool:
        pool.run(3, CALL, tensors, impl="torch.distributed")  # the pool's own memory, before the attack
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        with pytest.raises(RankFailure) as failure:
            pool.run(3, CALL, tensors, impl=str(FIXTURES / "inflating_reply_impl.py"))
        grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
        message = str(failure.value)
        assert "refuses to decode: a reply of more than 1048576 values (the limit)" in message, message
        assert "communication records the driver cannot read: a JSON text of up to 5592407 values" in message, message
        assert "nested more than 16 levels deep" in message, message
        assert grown < 128 * MiB, grown  # three 8 MiB replies received; none built
        # the driver goes on (a world of 2: those 3 ranks keep the fixture's encoder, as any rank keeps what it imported)
        assert pool.run(2, CALL, tensors[:2], impl="torch.distributed").outputs[0]["tensor"].tolist() == [3.0] * 4
