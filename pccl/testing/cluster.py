"""In-process clusters: a MasterNode and N Communicators sharing one event loop."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Sequence
from types import TracebackType
from typing import Any

from pccl.communicator import Communicator
from pccl.master.server import MasterNode


async def connect_all(master: MasterNode, comms: Sequence[Communicator]) -> None:
    """Connects ``comms`` to an in-process ``master`` and admits them all.

    Peers that are already accepted vote in one ``update_topology()``; if none is, the
    first connects alone (the master admits it without a vote) and then admits the rest.
    """
    accepted = [c for c in comms if c.state.name == "ACCEPTED"]
    fresh = [c for c in comms if c.state.name == "NEW"]
    if not accepted and fresh:
        await fresh[0].connect()
        accepted, fresh = [fresh[0]], fresh[1:]
    if not fresh:
        return
    before = len(master.state.pending())
    joins = [asyncio.create_task(c.connect()) for c in fresh]
    try:
        await master.wait_for(lambda s: len(s.pending()) >= before + len(fresh))
        await asyncio.gather(*(c.update_topology() for c in accepted))
        await asyncio.gather(*joins)
    except BaseException:
        for t in joins:
            t.cancel()
        await asyncio.gather(*joins, return_exceptions=True)
        raise


class Cluster:
    """A master plus ``n`` accepted peers; everything is closed on exit.

    Example::

        async with Cluster(3, pool_size=2) as cluster:
            await asyncio.gather(*(c.update_topology() for c in cluster.comms))
    """

    def __init__(
        self,
        n: int,
        *,
        groups: Sequence[int] | None = None,
        pool_size: int = 2,
        secret: bytes | None = None,
        master_kwargs: dict[str, Any] | None = None,
        comm_kwargs: dict[str, Any] | None = None,
    ) -> None:
        self.n = n
        self.groups = list(groups) if groups is not None else [0] * n
        if len(self.groups) != n:
            raise ValueError("groups must have one entry per peer")
        self.pool_size = pool_size
        self.secret = secret
        self.master_kwargs = {"heartbeat_interval": 0.25, "heartbeat_timeout": 3.0,
                              **(master_kwargs or {})}
        self.comm_kwargs = comm_kwargs or {}
        self.master = MasterNode(listen="127.0.0.1:0", secret=secret, **self.master_kwargs)
        self.comms: list[Communicator] = []

    def new_comm(self, group: int = 0, **kwargs: Any) -> Communicator:
        """A fresh (not yet connected) communicator for this cluster's master."""
        opts: dict[str, Any] = {"master": self.master.address, "peer_group": group,
                                "p2p_connection_pool_size": self.pool_size,
                                "secret": self.secret, **self.comm_kwargs, **kwargs}
        comm = Communicator(**opts)
        self.comms.append(comm)
        return comm

    async def __aenter__(self) -> Cluster:
        await self.master.start()
        try:
            for g in self.groups:
                self.new_comm(g)
            await connect_all(self.master, self.comms)
        except BaseException:
            await self.close()
            raise
        return self

    def new_comm_behind(self, emu: Any, group: int = 0, **kwargs: Any) -> Communicator:
        """A fresh communicator whose incoming p2p links cross ``emu`` (a
        :class:`pccl.testing.LinkEmulator`): others dial the emulator, which forwards to
        the communicator's listener."""
        comm = self.new_comm(group, p2p_advertise_address=emu.address, **kwargs)
        emu.target = lambda: f"127.0.0.1:{comm.p2p_port}"
        return comm

    async def admit_behind(self, emu: Any, **kwargs: Any) -> Communicator:
        """:meth:`new_comm_behind`, admitted by every accepted peer's vote."""
        comm = self.new_comm_behind(emu, **kwargs)
        await self.admit([comm])
        return comm

    async def admit_shaped(self, stack: contextlib.AsyncExitStack, n: int,
                           rate: Callable[[int, int], float | None],
                           latency: Callable[[int, int], float] | None = None, *,
                           chunk_size: int = 256 * 1024, **kwargs: Any
                           ) -> list[Communicator]:
        """Admits ``n`` new peers (in clear text), each behind its own
        :class:`pccl.testing.LinkEmulator` (entered on ``stack``), and returns them
        sorted by peer id (the join order: the ring's order before any optimization).
        The link that the i-th of them dials to the j-th carries ``rate(i, j)`` bytes/s
        each way (``None``: as fast as it goes) and, with ``latency``, ``latency(i, j)``
        seconds one way. The emulators tell dialers apart by the peer id in their
        clear-text hello, hence ``insecure=True``; ``kwargs`` go to the communicators."""
        from pccl.testing.link_emulator import LinkEmulator, p2p_dialer_id

        comms: list[Communicator] = []

        def position(peer_id: int | None) -> int | None:
            # Rank of one of ours among our peer ids (all known by the time links are
            # dialed); None for anybody else.
            ids = sorted(c.peer_id for c in comms if c.peer_id is not None)
            return ids.index(peer_id) if peer_id in ids else None

        def pair(first: bytes, receiver: Communicator) -> tuple[int, int] | None:
            i, j = position(p2p_dialer_id(first)), position(receiver.peer_id)
            return None if i is None or j is None else (i, j)

        for _ in range(n):
            holder: list[Communicator] = []

            def classify(first: bytes, holder: list[Communicator] = holder) -> float | None:
                ij = pair(first, holder[0])
                return None if ij is None else rate(*ij)

            def delay(first: bytes, holder: list[Communicator] = holder) -> float | None:
                ij = pair(first, holder[0])
                return None if ij is None or latency is None else latency(*ij)

            emu = await stack.enter_async_context(
                LinkEmulator(classify=classify, chunk_size=chunk_size,
                             classify_latency=delay if latency is not None else None))
            holder.append(self.new_comm_behind(emu, insecure=True, **kwargs))
            comms.append(holder[0])
        await self.admit(comms)
        return sorted(comms, key=lambda c: c.peer_id or 0)

    async def admit(self, comms: Sequence[Communicator]) -> None:
        """Connects new communicators while every accepted one votes them in."""
        live = [c for c in self.comms if c.state.name == "ACCEPTED"]
        await connect_all(self.master, [*live, *comms])

    async def ring_with_process(
        self, spawn: Callable[[str], Awaitable[Any]], emu: Any
    ) -> tuple[Communicator, Any, Communicator]:
        """Builds the ring A -> V -> B -> A for fault tests: A is this cluster's one
        in-process peer, V a peer process from ``spawn(master address)`` (the
        ``pccl_peer_process`` fixture), B a new in-process peer whose incoming ring link
        crosses ``emu`` (a :class:`pccl.testing.LinkEmulator`), so a slow B keeps the
        ring busy while V is killed or frozen. -> (A, V, B)"""
        (a,) = self.comms
        victim = await spawn(self.master.address)
        await self.master.wait_for(lambda s: len(s.pending()) == 1, timeout=60)
        await a.update_topology()
        await victim.wait_accepted()
        b = self.new_comm_behind(emu)
        join = asyncio.create_task(b.connect())
        await self.master.wait_for(lambda s: len(s.pending()) == 1, timeout=60)
        await asyncio.gather(a.update_topology(), victim.call("update_topology"))
        await join
        return a, victim, b

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for c in self.comms), return_exceptions=True)
        await self.master.stop()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()
