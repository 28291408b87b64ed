"""The relay (harness/driver/relay.py and harness/rank/relay_transport.py): the audit's evidence is
what it carried, so it must carry gloo's semantics exactly, compute the collectives as
reference/collectives.py does, and refuse whatever is not one of its ranks' calls. Connections are
made in this process, one per simulated rank; collectives run their members on threads."""

from __future__ import annotations

import socket
import threading

import pytest
import torch
import torch.distributed as dist

from parallelism_conformance.harness.driver import relay as relay_module
from parallelism_conformance.harness.driver.relay import Relay
from parallelism_conformance.harness.rank.relay_transport import HEADER, HELLO, SEND, Connection, RelayBackend, TransportRefusal
from parallelism_conformance.reference import collectives as ref


@pytest.fixture
def world():
    relays = []

    def make(size: int):
        relay = Relay(size)
        relays.append(relay)
        backends = []
        for rank in range(size):
            host, port, token = relay.join_info(rank)
            backend = RelayBackend(Connection((host, port), token), list(range(size)))
            backend.name = lambda: "world"
            backends.append(backend)
        return relay, backends

    yield make
    for relay in relays:
        relay.close()


def on_every_rank(n: int, call) -> list:
    """call(rank) on n threads at once (a collective waits for every member); the results in order."""
    results: list = [None] * n

    def run(rank):
        try:
            results[rank] = call(rank)
        except Exception as error:  # noqa: BLE001 - returned, for the test to read
            results[rank] = error

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    return results


def _options(kind, **fields):
    options = kind()
    for name, value in fields.items():
        setattr(options, name, value)
    return options


def test_messages_between_two_ranks_with_one_tag_arrive_in_the_order_sent(world):
    relay, (zero, one) = world(2)
    first, second = torch.zeros(2), torch.zeros(3)
    waits = [one.recv([first], 0, 5), one.recv([second], 0, 5)]
    zero.send([torch.tensor([1.0, 2.0])], 1, 5)
    zero.send([torch.tensor([3.0, 4.0, 5.0])], 1, 5)
    for work in waits:
        work.wait()
    assert first.tolist() == [1.0, 2.0] and second.tolist() == [3.0, 4.0, 5.0]
    taken = relay.take()
    assert [(r["op"], r["peer"], r["bytes"]) for r in taken.records[0]] == [("send", 1, 8), ("send", 1, 12)]
    assert [(r["op"], r["peer"], r["out_bytes"]) for r in taken.records[1]] == [("recv", 0, 8), ("recv", 0, 12)]
    assert taken.strays == [] and taken.broken == []


def test_a_receive_from_any_source_names_its_sender_and_a_misfit_is_refused(world):
    relay, backends = world(3)
    got = torch.zeros(2, dtype=torch.bfloat16)
    work = backends[0].recv_anysource([got], 0)
    backends[2].send([torch.tensor([5.0, 6.0], dtype=torch.bfloat16)], 0, 0)
    work.wait()
    assert got.tolist() == [5.0, 6.0] and work._source_rank() == 2
    misfit = backends[0].recv([torch.zeros(5)], 1, 1)
    backends[1].send([torch.ones(2)], 0, 1)
    with pytest.raises(TransportRefusal, match="rank 1 sent 8 B .* expects 20 B"):
        misfit.wait()


def test_a_message_nobody_received_is_a_stray_and_is_dropped(world):
    relay, (zero, one) = world(2)
    zero.send([torch.ones(4)], 1, 3)
    assert relay.take().strays == ["rank 0 -> rank 1 (tag 3, 16 B)"]
    late = one.recv([torch.zeros(4)], 0, 3)  # the next task's receive does not get the old message
    assert relay.take().strays == [] and not late.is_completed()


@pytest.mark.parametrize("op", ["SUM", "MAX", "PRODUCT"])
def test_collectives_are_the_references_and_every_member_gets_the_same_bits(world, op):
    n = 3
    relay, backends = world(n)
    inputs = [torch.randn(7, generator=torch.Generator().manual_seed(rank)) for rank in range(n)]
    reduce = getattr(dist.ReduceOp, op)
    tensors = [t.clone() for t in inputs]
    on_every_rank(n, lambda r: backends[r].allreduce([tensors[r]], _options(dist.AllreduceOptions, reduceOp=reduce)).wait())
    want = ref.all_reduce(inputs, op)
    for rank in range(n):
        assert torch.equal(tensors[rank], tensors[0]) and torch.allclose(tensors[rank], want[rank])
    gathered = [torch.zeros(n * 7) for _ in range(n)]
    on_every_rank(n, lambda r: backends[r]._allgather_base(gathered[r], inputs[r], None).wait())
    assert all(torch.equal(g, torch.cat(inputs)) for g in gathered)
    scattered = [torch.zeros(2) for _ in range(n)]
    big = [torch.arange(6.0) * (rank + 1) for rank in range(n)]
    on_every_rank(
        n, lambda r: backends[r]._reduce_scatter_base(scattered[r], big[r], _options(dist.ReduceScatterOptions, reduceOp=reduce)).wait()
    )
    want = ref.reduce_scatter_tensor(big, op)
    assert all(torch.allclose(scattered[r], want[r]) for r in range(n))
    taken = relay.take()
    assert [r["op"] for r in taken.records[1]] == ["allreduce", "allgather_into_tensor", "reduce_scatter_tensor"]
    assert taken.records[1][0]["bytes"] == 28 and taken.records[1][1]["out_bytes"] == 84 and taken.records[1][0]["reduce_op"] == op


def test_rooted_and_uneven_collectives(world):
    n = 3
    relay, backends = world(n)
    held = [torch.full((3,), float(rank)) for rank in range(n)]
    on_every_rank(n, lambda r: backends[r].broadcast([held[r]], _options(dist.BroadcastOptions, rootRank=2)).wait())
    assert all(t.tolist() == [2.0] * 3 for t in held)
    outs = [torch.zeros(sum(s[r] for s in [[1, 0, 2], [0, 2, 1], [3, 1, 0]])) for r in range(n)]
    splits = [[1, 0, 2], [0, 2, 1], [3, 1, 0]]  # rank r sends splits[r][j] rows to rank j
    sources = [torch.arange(float(sum(splits[r]))) + 10 * r for r in range(n)]
    on_every_rank(n, lambda r: backends[r].alltoall_base(outs[r], sources[r], [splits[j][r] for j in range(n)], splits[r], None).wait())
    want = ref.all_to_all_single(sources, [splits[r] for r in range(n)])
    assert all(torch.equal(outs[r], want[r]) for r in range(n))
    assert relay.take().records[0][1]["splits"] == [4, 0, 8]


def test_members_that_disagree_are_refused_naming_them(world):
    relay, backends = world(2)
    results = on_every_rank(
        2,
        lambda r: (
            backends[r].allreduce([torch.ones(2)], dist.AllreduceOptions())
            if r
            else backends[r].broadcast([torch.ones(2)], dist.BroadcastOptions())
        ).wait(),
    )
    assert all(
        isinstance(result, TransportRefusal) and "disagree on the call's op: rank 0 broadcast, rank 1 allreduce" in str(result)
        for result in results
    )


def test_only_the_ranks_tokens_connect_each_once(world):
    relay, _ = world(1)
    relay.take()  # once the relay has read the rank's hello, every rank is in: the listener is closed
    with pytest.raises(OSError):
        socket.create_connection((relay.host, relay.port), timeout=2)
    other = Relay(2)
    try:
        stranger = socket.create_connection((other.host, other.port))
        stranger.sendall(HEADER.pack(HELLO, 0, 0, 0, 0, 32) + bytes(32))
        assert stranger.recv(1) == b""  # closed: not a token of its ranks
        host, port, token = other.join_info(0)
        Connection((host, port), token)
        twice = socket.create_connection((host, port))
        twice.sendall(HEADER.pack(HELLO, 0, 0, 0, 0, len(token)) + token)
        assert twice.recv(1) == b""  # that rank is in already
    finally:
        other.close()


def test_a_message_over_the_limit_ends_the_connection_and_says_so(world, monkeypatch):
    monkeypatch.setattr(relay_module, "MESSAGE_LIMIT", 64)
    relay, (zero, _one) = world(2)
    zero._connection._write(SEND, 1, 0, 0, bytes(65))
    taken = relay.take()
    assert taken.broken and "a message of 65 B, over the relay's limit of 64 B" in taken.broken[0]


@pytest.mark.parametrize("at_once", [False, True])
def test_what_the_relay_holds_stays_within_its_share_of_the_memory(at_once):
    """Three messages of 40 B to a rank that never receives them, against a budget of 100 B: the
    connection ends, named, whether they arrive one by one or with the hello in one read (as a
    loaded machine delivers them)."""
    relay = Relay(2, budget=100)
    try:
        Connection(relay.join_info(1)[:2], relay.join_info(1)[2])
        host, port, token = relay.join_info(0)
        messages = [HEADER.pack(SEND, 1, 0, 0, 0, 40) + bytes(40) for _ in range(3)]
        if at_once:
            raw = socket.create_connection((host, port))
            raw.sendall(HEADER.pack(HELLO, 0, 0, 0, 0, len(token)) + token + b"".join(messages))
        else:
            zero = RelayBackend(Connection((host, port), token), [0, 1])
            for _ in range(3):
                zero.send([torch.zeros(10)], 1, 0)
        taken = relay.take()
        assert len(taken.broken) == 1 and "the relay ended rank 0's connection" in taken.broken[0], taken.broken
        assert "over the relay's share of the driver's memory, 100 B" in taken.broken[0]
    finally:
        relay.close()


def test_a_collective_the_relay_cannot_carry_is_refused_by_name(world):
    _, (zero, _) = world(2)
    with pytest.raises(TransportRefusal, match="cannot carry allgather_coalesced"):
        zero.allgather_coalesced([[torch.zeros(2)]], [torch.ones(1)])
