"""A peer with several masters dials them all at once and keeps one connection: every
other connection it made is closed, including those it never looked at (found by the
failover churn soak: a peer leaving while it re-registered kept a socket to a master
open after close())."""

from __future__ import annotations

import asyncio

import pytest

import pccl
from pccl.protocol import messages as m
from pccl.protocol.messages import PROTOCOL_VERSION

A, B, C = "127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"


class FakeConn:
    """What the scan does with a connection: keep it, or close it."""

    def __init__(self, addr: str) -> None:
        self.addr = addr
        self.closing = False

    def start_close(self) -> None:
        self.closing = True

    async def close(self) -> None:
        self.closing = True


def challenge(groups: list[int], standby: bool = False) -> m.Challenge:
    return m.Challenge(version=PROTOCOL_VERSION, nonce=bytes(16), auth=False,
                       groups=groups, standby=standby)


def scanning(masters: list[str]) -> pccl.Communicator:
    return pccl.Communicator(masters, peer_group=0, insecure=True)


async def test_connections_answered_with_the_chosen_one_are_closed(monkeypatch) -> None:
    """Three masters answer at once and all hold the group: the first in the list is
    kept; the two answers the scan never looked at are closed too."""
    comm = scanning([A, B, C])
    made: dict[str, FakeConn] = {}

    async def reach(addr: str, timeout: float):  # type: ignore[no-untyped-def]
        made[addr] = FakeConn(addr)
        return made[addr], challenge([0])

    monkeypatch.setattr(comm, "_reach", reach)
    conn, got = await comm._dial_master(5.0)
    assert conn is made[A] and got.groups == [0]
    assert comm._master_addr == A
    assert not made[A].closing
    assert made[B].closing and made[C].closing


async def test_a_scan_cancelled_as_a_dial_ends_closes_that_connection(monkeypatch) -> None:
    """The scan is cancelled (close() during a re-registration) in the very step in
    which one master's dial completes: that connection was never looked at, and is
    closed; the dial still under way is cancelled."""
    comm = scanning([A, B])
    made: dict[str, FakeConn] = {}
    scan: asyncio.Task[object] | None = None
    hanging = asyncio.Event()
    cancelled: list[str] = []

    async def reach(addr: str, timeout: float):  # type: ignore[no-untyped-def]
        if addr == B:
            try:
                await hanging.wait()  # a master that never answers
            except asyncio.CancelledError:
                cancelled.append(addr)
                raise
        await asyncio.sleep(0)  # the scan is waiting on both dials by now
        made[addr] = FakeConn(addr)
        assert scan is not None
        scan.cancel()  # lands before the scan sees this dial's result
        return made[addr], challenge([], standby=True)

    monkeypatch.setattr(comm, "_reach", reach)
    scan = asyncio.create_task(comm._dial_master(5.0))
    with pytest.raises(asyncio.CancelledError):
        await scan
    assert made[A].closing
    assert cancelled == [B] and B not in made
