"""Fault injection for in-process peers."""

from __future__ import annotations

from pccl.communicator import Communicator
from pccl.master.server import MasterNode


async def crash(comm: Communicator) -> None:
    """Makes ``comm`` disappear the way a killed process does: its connection to the
    master drops without a goodbye (the master notices the loss, as for a SIGKILL, and
    repairs the ring), then its p2p listener, links and tasks are released. Ops the
    peer had in flight fail on it with :class:`pccl.MasterConnectionError`.

    For tests and demos that keep every peer in one event loop; a peer in its own
    process is better killed for real (:class:`pccl.testing.PeerProcess`)."""
    conn = comm._conn
    if conn is not None:
        conn.abort()
    await comm.close()


async def crash_master(master: MasterNode) -> None:
    """Makes ``master`` disappear the way a killed process does: every connection
    drops without the ``shutdown`` message a stop sends, so the peers see a crash (and
    register again, for up to their ``reconnect_timeout``)."""
    for conn in list(master._conns.values()):
        conn.abort()
    await master.stop()
