"""A p2p port another listener holds is refused, loudly. The listener sets SO_REUSEPORT
(hole punching connects from its port), so without a check a second process of the same
user binding the same port succeeded, and the kernel split incoming connections between
the two: half of the dials to either peer reached the other one, which refused them as
the wrong peer (a churn soak where two workers were handed one port: both dropped over
and over as unreachable)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import pccl
from pccl import _core
from pccl.testing import Cluster, free_port


async def test_a_p2p_node_cannot_bind_a_port_another_listener_holds() -> None:
    port = free_port()
    first = await _core.P2PNode.bind(0, "127.0.0.1", port, None)
    try:
        with pytest.raises(pccl.PeerConnectionError, match="Address already in use"):
            await _core.P2PNode.bind(1, "127.0.0.1", port, None)
        assert first.port == port
    finally:
        await first.close()
    # Once the listener is gone the port is free again at once (what a restarted peer
    # on a fixed port needs, with its old connections still in TIME_WAIT).
    again = await _core.P2PNode.bind(0, "127.0.0.1", port, None)
    await again.close()


async def test_a_peer_on_a_held_port_fails_to_connect_and_steals_nothing() -> None:
    port = free_port()
    async with Cluster(0) as cluster:
        first = cluster.new_comm(p2p_listen_port=port)
        second = cluster.new_comm()
        await cluster.admit([first, second])
        clash = cluster.new_comm(p2p_listen_port=port)
        with pytest.raises(pccl.PeerConnectionError, match="Address already in use"):
            await clash.connect()
        # The group never saw it, and every dial to the first peer still reaches it.
        assert cluster.master.state.pending() == []
        for round_ in range(3):
            xs = [np.full(1000, i + 1 + round_, np.float32) for i in range(2)]
            await asyncio.gather(*(c.all_reduce(x) for c, x in zip((first, second), xs)))
            assert all((x == 3 + 2 * round_).all() for x in xs)
