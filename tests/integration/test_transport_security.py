"""The p2p transport is encrypted by default: what crosses the wire between two peers
never shows their tensors (and does with ``insecure=True`` on both, the control); one
peer in clear text and one encrypting fail the handshake at once, with a typed error."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

import pccl
from pccl import _core
from pccl.testing import Cluster, LinkEmulator, free_port

# Four distinct finite floats: their 16 bytes mark the sender's tensor on the wire.
PATTERN = np.array([1.5, -2.25, 3.125, 1234.5], np.float32)
N = 1 << 15
SECRET = b"5f0c1a9e7d3b42c8a6e1f0b97c2d4e3a"


async def _all_reduce_through_recorder(insecure: bool) -> bytes:
    """Two peers all-reduce; the second one's ring link to the first passes a recording
    LinkEmulator. Returns every byte that went through it (both directions)."""
    port = free_port()
    async with LinkEmulator(f"127.0.0.1:{port}", record=True) as emu:
        async with Cluster(0, comm_kwargs={"insecure": insecure},
                           master_kwargs={"insecure": insecure}) as cluster:
            first = cluster.new_comm(p2p_listen_port=port, p2p_advertise_address=emu.address)
            await cluster.admit([first])
            second = cluster.new_comm()
            await cluster.admit([second])
            if second.ring.index(second.peer_id) == 0:
                pytest.skip("unexpected ring order")  # pragma: no cover
            a = np.full(4 * N, 7.0, np.float32)
            b = np.tile(PATTERN, N)
            want = a + b
            async with asyncio.timeout(60):
                await asyncio.gather(first.all_reduce(a), second.all_reduce(b))
            np.testing.assert_array_equal(a, want)
            np.testing.assert_array_equal(b, want)
        recorded = emu.recorded()
    assert recorded, "nothing went through the emulator"
    return b"".join(recorded.values())


async def test_ring_traffic_is_encrypted_by_default() -> None:
    wire = await _all_reduce_through_recorder(insecure=False)
    # The ring link carried at least the sender's half of the tensor.
    assert len(wire) >= 2 * N * PATTERN.nbytes // 2
    assert PATTERN.tobytes() not in wire
    assert np.full(4, 7.0, np.float32).tobytes() not in wire
    assert b"PCCLP2P" not in wire  # the p2p hello travels inside the encrypted stream
    assert _core.SECURE_HELLO_MAGIC == b"PCCLSEC\x03"
    assert _core.SECURE_HELLO_MAGIC in wire  # the secure transport's hello (Noise XX)


async def test_insecure_on_both_ends_sends_clear_text() -> None:
    """The control: the same run in clear text shows the pattern (so the test above
    would see it, were it there)."""
    wire = await _all_reduce_through_recorder(insecure=True)
    assert PATTERN.tobytes() in wire
    assert b"PCCLP2P" in wire


@pytest.mark.parametrize("dialer_insecure", [True, False])
async def test_insecure_and_encrypting_peers_fail_fast_with_a_typed_error(
        dialer_insecure: bool) -> None:
    # A handshake timeout far beyond what the test allows: the mismatch must be told.
    # (Both know each other's key, as the master's roster would tell them: what fails is
    # the transport mismatch, not a missing key.)
    ia, ib = _core.Identity(), _core.Identity()
    a = await _core.P2PNode.bind(1, secret=SECRET, handshake_timeout=60.0,
                                 insecure=dialer_insecure, identity=ia)
    b = await _core.P2PNode.bind(2, secret=SECRET, handshake_timeout=60.0,
                                 insecure=not dialer_insecure, identity=ib)
    keys = {1: ia.public_key, 2: ib.public_key}
    a.set_peer_keys(keys)
    b.set_peer_keys(keys)
    # A clear-text dialer is told to drop insecure=True; an encrypting dialer is never
    # advised to, only told that the other end (or something on the path) says it runs
    # in clear text.
    want = "insecure" if dialer_insecure else "says it runs in clear text; we encrypt"
    try:
        started = time.monotonic()
        with pytest.raises(pccl.AuthenticationError, match=want) as info:
            async with asyncio.timeout(10):
                await a.connect_pool(f"127.0.0.1:{b.port}", 2, 1, 2)
        assert isinstance(info.value, pccl.PCCLError)
        if not dialer_insecure:
            assert "insecure=True" not in str(info.value)
        assert time.monotonic() - started < 10
    finally:
        await a.close()
        await b.close()


async def test_communicator_insecure_must_be_a_bool() -> None:
    with pytest.raises(pccl.InvalidArgumentError):
        pccl.Communicator(insecure="yes")  # type: ignore[arg-type]
