"""A man in the middle on a ring link and on a peer's master connection: what it records
never shows a tensor or a control message, and what it changes (a flipped bit, injected
bytes, a replayed or dropped record) fails the connection's integrity check. The
collective then fails on every peer with a typed error, no buffer changes, and the retry
gives the exact result."""

from __future__ import annotations

import asyncio
import contextlib

import numpy as np
import pytest

import pccl
from pccl.testing import Cluster, LinkEmulator, free_port
from pccl.testing.mitm import ATTACKS, Tamper

N = 1 << 16
PATTERN = np.array([1.5, -2.25, 3.125, 1234.5], np.float32)


def _inputs(k: int) -> list[np.ndarray]:
    return [np.tile(PATTERN, N // 4) * (i + 1) for i in range(k)]


async def _reduce_or_fail(comms: list[pccl.Communicator], xs: list[np.ndarray]) -> list:
    async with asyncio.timeout(60):
        return await asyncio.gather(*(c.all_reduce(x) for c, x in zip(comms, xs)),
                                    return_exceptions=True)


async def _retry_until_exact(comms: list[pccl.Communicator]) -> None:
    """The recovery loop a user writes (through the library's policy): exact result."""
    xs = _inputs(len(comms))
    want = sum(x.copy() for x in xs)
    descriptors = [[pccl.ReduceDescriptor(x, op=pccl.ReduceOp.SUM, tag=5)] for x in xs]
    async with asyncio.timeout(90):
        await asyncio.gather(*(c.all_reduce_multiple_with_retry(d)
                               for c, d in zip(comms, descriptors)))
    for x in xs:
        np.testing.assert_array_equal(x, want)


def _check_all_or_nothing(outcomes: list, xs: list[np.ndarray], before: list[np.ndarray],
                          want: np.ndarray) -> bool:
    """Either every peer succeeded with the exact sum, or every peer got a PCCLError and
    kept its input. Returns whether it failed."""
    failed = [isinstance(o, BaseException) for o in outcomes]
    assert all(failed) or not any(failed), outcomes
    for o, x, b in zip(outcomes, xs, before):
        if isinstance(o, BaseException):
            assert isinstance(o, pccl.PCCLError), repr(o)
            np.testing.assert_array_equal(x, b)
        else:
            np.testing.assert_array_equal(x, want)
    return all(failed)


@contextlib.asynccontextmanager
async def _ring_through(mitm: Tamper | None, *, record: bool = False, insecure: bool = False):
    """Two peers; every ring stream to the first one crosses the emulator."""
    port = free_port()
    async with LinkEmulator(f"127.0.0.1:{port}", tamper=mitm, record=record) as emu:
        async with Cluster(0, comm_kwargs={"insecure": insecure, "p2p_timeout": 5.0},
                           master_kwargs={"insecure": insecure}) as cluster:
            first = cluster.new_comm(p2p_listen_port=port, p2p_advertise_address=emu.address)
            await cluster.admit([first])
            second = cluster.new_comm()
            await cluster.admit([second])
            yield emu, cluster, [first, second]


@pytest.mark.parametrize("attack", ATTACKS)
async def test_a_tampered_ring_link_fails_the_collective_cleanly(attack: str) -> None:
    mitm = Tamper()
    async with _ring_through(mitm) as (_, _, comms):
        await _retry_until_exact(comms)  # the pools are up and clean
        xs = _inputs(2)
        before = [x.copy() for x in xs]
        want = sum(x.copy() for x in xs)
        mitm.arm(attack)
        outcomes = await _reduce_or_fail(comms, xs)
        assert mitm.struck == 1
        assert _check_all_or_nothing(outcomes, xs, before, want), \
            f"{attack}: the collective succeeded over a tampered link"
        await _retry_until_exact(comms)


@pytest.mark.parametrize("attack", ATTACKS)
async def test_a_tampered_master_connection_is_dropped_and_the_run_goes_on(attack: str) -> None:
    mitm = Tamper()
    async with Cluster(1) as cluster:
        async with LinkEmulator(cluster.master.address, tamper=mitm) as emu:
            late = cluster.new_comm(master=emu.address, reconnect_timeout=30.0)
            await cluster.admit([late])
            comms = cluster.comms
            await _retry_until_exact(comms)
            # Strike the late peer's next message to the master: its collective vote.
            mitm.arm(attack, "client->server")
            xs = _inputs(2)
            before = [x.copy() for x in xs]
            want = sum(x.copy() for x in xs)
            outcomes = await _reduce_or_fail(comms, xs)
            assert mitm.struck == 1
            # The master drops the tampered connection: that peer's call fails (typed, its
            # input kept) and the other one's runs without it, or fails as well.
            assert isinstance(outcomes[1], pccl.MasterConnectionError), repr(outcomes[1])
            np.testing.assert_array_equal(xs[1], before[1])
            if isinstance(outcomes[0], BaseException):
                assert isinstance(outcomes[0], pccl.PCCLError), repr(outcomes[0])
                np.testing.assert_array_equal(xs[0], before[0])
            else:
                alone = outcomes[0].world_size == 1
                np.testing.assert_array_equal(xs[0], before[0] if alone else want)
            # The peer registers again over the same (now honest) link and the group
            # admits it back; the retry is exact.
            await cluster.master.wait_for(lambda s: len(s.pending()) == 1, timeout=30)
            async with asyncio.timeout(30):
                await comms[0].update_topology()
                # The training loop's next step: are_peers_pending() on every peer (the
                # late one's waits until it is back in the group).
                assert await asyncio.gather(*(c.are_peers_pending() for c in comms)) == \
                    [False, False]
            await _retry_until_exact(comms)


async def test_nothing_readable_crosses_the_links() -> None:
    """Recorded on a ring link and on a master connection: no tensor bytes, no control
    message field names, no peer address; the clear-text control run shows them all."""
    for insecure in (False, True):
        async with _ring_through(None, record=True, insecure=insecure) as (ring_link, cluster,
                                                                           comms):
            async with LinkEmulator(cluster.master.address, record=True) as master_link:
                late = cluster.new_comm(master=master_link.address)
                async with asyncio.timeout(30):
                    await cluster.admit([late])
                # Every peer's first ring piece is its own input, unreduced.
                xs = [np.tile(PATTERN, N // 4) for _ in range(3)]
                outcomes = await _reduce_or_fail([*comms, late], xs)
                assert not any(isinstance(o, BaseException) for o in outcomes), outcomes
                for x in xs:
                    np.testing.assert_array_equal(x, np.tile(PATTERN * 3, N // 4))
                await late.close()
                control = b"".join(master_link.recorded().values())
            ring = b"".join(ring_link.recorded().values())
        seen = {
            "tensor": PATTERN.tobytes() in ring,
            "field names": b"p2p_port" in control and b"peer_group" in control,
            "address": b"127.0.0.1" in control,
        }
        if insecure:
            assert all(seen.values()), seen
        else:
            assert not any(seen.values()), seen
            assert control.count(pccl._core.SECURE_HELLO_MAGIC) >= 1  # PCCLSEC\x03: Noise XX
