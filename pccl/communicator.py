"""The peer side of a pccl run: the asyncio driver of :class:`pccl.peer.state.PeerMachine`.

The machine holds the protocol (what a master message means, which call it answers,
what to send); this module holds the I/O: the master connection and its handshake, the
reader task, registering again after losing the master, and the Rust data plane (ring
installs, ring ops, probes, shared-state fetches through :mod:`pccl.peer.fetch`). Each
network result goes back into the machine as an event; each command the machine gives
is carried out by :meth:`Communicator._do`. ``docs/architecture.md`` has the picture.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import secrets as _secrets
from collections.abc import Callable
from types import TracebackType
from typing import Any

from pccl import _core, recovery
from pccl.enums import Attribute, QuantizationAlgorithm, ReduceOp, SharedStateSyncStrategy
from pccl.errors import (
    AuthenticationError,
    ErrorKind,
    InvalidUsageError,
    MasterConnectionError,
    PCCLError,
    ProtocolError,
    TopologyOptimizationFailedError,
    UpdateTopologyFailedError,
)
from pccl.peer import state as ps
from pccl.peer.fetch import Fetcher, SyncReporter, prefault_all
from pccl.peer.options import (
    DEFAULT_TIMEOUT,
    QuantizationOptions,
    ReduceDescriptor,
    ReduceInfo,
    check_deadline,
    check_master_address,
    check_quantization,
    check_seconds,
)
from pccl.peer.state import Status as PeerState
from pccl.protocol import MAX_FRAME, PROTOCOL_VERSION
from pccl.protocol import messages as m
from pccl.protocol.auth import DEFAULT_PORT, master_mac, peer_mac, split_host_port
from pccl.protocol.transport import ConnectionClosed, FramedConnection
from pccl.shared_state import SharedState, SyncInfo, SyncProgress
from pccl.tensors import RawTensor, as_raw

__all__ = ["DEFAULT_TIMEOUT", "Communicator", "PeerState", "QuantizationOptions",
           "ReduceDescriptor", "ReduceInfo"]

log = logging.getLogger(__name__)

_CANCELLED = "cancelled by the caller"


class Communicator:
    """One peer of a pccl run.

    Example::

        async with pccl.Communicator(master="127.0.0.1:48148") as comm:
            if await comm.are_peers_pending():
                await comm.update_topology()
            await comm.all_reduce(x, op=pccl.ReduceOp.AVG)

    ``timeout`` bounds every wait on the master that does not depend on other peers
    (the handshake, queries). ``collective_timeout`` (30 minutes, like
    torch.distributed's default ``timeout=``: peers of a DiLoCo run may reach the outer
    step minutes apart; per call: ``timeout=``) bounds how long a collective call waits for the
    other peers to make the same call (``all_reduce``, ``sync_shared_state``,
    ``update_topology``, ``optimize_topology``, ``are_peers_pending``): past it the
    master calls the operation off for every peer that made it, with
    :class:`OperationTimeoutError` and nothing written, and a retry works (``None``: no
    limit; every wait stays cancellable). Dead peers end such waits sooner: the master
    drops them. ``peer_timeout`` bounds how long a ring link may go without progress
    before the collective fails with :class:`PeerConnectionError` (a stalled or dead
    neighbour).

    ``p2p_connection_pool_size`` is the number of parallel TCP streams per ring
    neighbour, and the least number of streams that a shared-state sync fetches its
    tensors of 64 MiB or more over (in ranges, spread across the holders).

    When the connection to the master is lost (the master process died, or dropped
    this peer), calls in flight fail with :class:`MasterConnectionError` and the peer
    keeps trying to register again, with back-off, for up to ``reconnect_timeout``
    seconds (0 disables this). It says what it held (its peer id, ring epoch, last
    synced revision and ring), so a restarted master re-forms the group from the peers.
    Calls made meanwhile wait for that (``all_reduce_async``, which cannot wait, raises
    :class:`MasterConnectionError`); once the time is up, every call raises it.
    """

    def __init__(
        self,
        master: str = f"127.0.0.1:{DEFAULT_PORT}",
        peer_group: int = 0,
        p2p_connection_pool_size: int = 4,
        secret: bytes | str | None = None,
        *,
        p2p_listen_host: str | None = None,
        p2p_listen_port: int = 0,
        p2p_advertise_host: str | None = None,
        p2p_advertise_address: str | None = None,
        timeout: float = 10.0,
        p2p_timeout: float = 10.0,
        peer_timeout: float = 30.0,
        piece_bytes: int = 1 << 20,
        max_frame: int = MAX_FRAME,
        reconnect_timeout: float = 60.0,
        collective_timeout: float | None = 1800.0,
    ) -> None:
        if not 1 <= p2p_connection_pool_size <= 64:
            raise _core.InvalidArgumentError("p2p_connection_pool_size must be in 1..64")
        check_master_address(master)
        self.collective_timeout = check_deadline(collective_timeout, "collective_timeout")
        for name, value in (("timeout", timeout), ("p2p_timeout", p2p_timeout),
                            ("peer_timeout", peer_timeout)):
            check_seconds(value, name)
        check_seconds(reconnect_timeout, "reconnect_timeout", zero_ok=True)
        self.master = master
        self.peer_group = peer_group
        self.p2p_connection_pool_size = p2p_connection_pool_size
        self.secret = secret.encode() if isinstance(secret, str) else secret
        self.p2p_listen_host = p2p_listen_host
        self.p2p_listen_port = p2p_listen_port  # 0: ephemeral
        self.p2p_advertise_host = p2p_advertise_host
        # "host:port" others should dial instead of our listener (NAT, or a test proxy).
        self.p2p_advertise_address = p2p_advertise_address
        self.timeout = timeout
        self.p2p_timeout = p2p_timeout
        self.peer_timeout = peer_timeout
        self.piece_bytes = piece_bytes
        self.max_frame = max_frame
        self.reconnect_timeout = reconnect_timeout

        self._m = ps.PeerMachine(reconnect=reconnect_timeout > 0)
        self._conn: FramedConnection | None = None
        self._node: _core.P2PNode | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._reader: asyncio.Task[None] | None = None
        # all_reduce_async() handles not finished yet (close() settles them).
        self._handles: set[asyncio.Task[Any]] = set()
        # The event loop connect() ran in: every call must come from it (see _check_loop).
        self._home_loop: asyncio.AbstractEventLoop | None = None
        self._heartbeat_timeout = 5.0
        # One future per waiting call (pccl.peer.state.Waiter); the machine answers them.
        self._waiters: dict[ps.Waiter, asyncio.Future[Any]] = {}
        self._rings: dict[int, Any] = {}  # tag -> the ring op running it

    # --- the machine's state, read-only -------------------------------------------------

    @property
    def state(self) -> PeerState:
        return self._m.status

    @property
    def peer_id(self) -> int | None:
        return self._m.peer_id

    @property
    def epoch(self) -> int:
        return self._m.epoch

    @property
    def ring(self) -> list[int]:
        return list(self._m.ring)

    @property
    def reconnects(self) -> int:
        """Times this peer registered again after losing the master."""
        return self._m.reconnects

    # --- lifecycle ------------------------------------------------------------------

    async def connect(self, n_attempts: int = 10) -> None:
        """Registers with the master and returns once the run has accepted this peer.

        Connection attempts back off exponentially; after ``n_attempts`` failures the
        call raises :class:`MasterConnectionError`. A wrong secret raises
        :class:`AuthenticationError` at once.
        """
        if self.state is not PeerState.NEW:
            raise InvalidUsageError(f"connect() called on a communicator that is {self.state.name}")
        if n_attempts < 1:
            raise _core.InvalidArgumentError("n_attempts must be at least 1")
        self._home_loop = asyncio.get_running_loop()
        try:
            await self._open(n_attempts)
            await self._waiters[ps.ACCEPT]
        except BaseException:
            await self.close()
            raise

    async def _open(self, n_attempts: int) -> None:
        host, port = split_host_port(self.master)
        delay = 0.05
        last: BaseException | None = None
        for attempt in range(n_attempts):
            try:
                async with asyncio.timeout(self.timeout):
                    reader, writer = await asyncio.open_connection(host, port)
                break
            except (OSError, TimeoutError) as e:
                last = e
                log.debug("connect attempt %d/%d to %s failed: %s", attempt + 1, n_attempts,
                          self.master, e)
                if attempt + 1 < n_attempts:
                    await asyncio.sleep(delay)  # back-off between attempts, not a sync point
                    delay = min(delay * 2, 2.0)
        else:
            raise MasterConnectionError(
                f"could not reach the master at {self.master} after {n_attempts} attempts "
                f"({last}); is it running and is the address right?")
        conn = FramedConnection(reader, writer, max_frame=self.max_frame)
        self._conn = conn
        local_host = writer.get_extra_info("sockname")[0]
        self._node = await _core.P2PNode.bind(
            0, self.p2p_listen_host or local_host, self.p2p_listen_port, self.secret,
            handshake_timeout=self.p2p_timeout, connect_timeout=self.p2p_timeout)
        await self._handshake(conn)

    async def _handshake(self, conn: FramedConnection) -> None:
        assert self._node is not None
        nonce = _secrets.token_bytes(16)
        try:
            async with asyncio.timeout(self.timeout):
                challenge = await conn.recv()
                if not isinstance(challenge, m.Challenge):
                    raise ProtocolError(f"expected a challenge, the master sent {challenge.TYPE}")
                if challenge.version != PROTOCOL_VERSION:
                    raise ProtocolError(f"master speaks protocol {challenge.version}, "
                                        f"this peer {PROTOCOL_VERSION}")
                if challenge.auth and self.secret is None:
                    raise AuthenticationError("the master requires a shared secret; "
                                              "pass secret= to the Communicator")
                mac = peer_mac(self.secret, challenge.nonce, nonce) if self.secret else b""
                adv_host, adv_port = self.p2p_advertise_host or "", int(self._node.port)
                if self.p2p_advertise_address:
                    adv_host, adv_port = split_host_port(self.p2p_advertise_address)
                resume_id, resume_epoch, resume_revision, resume_peers = self._m.resume()
                await conn.send(m.Hello(
                    version=PROTOCOL_VERSION, peer_group=self.peer_group,
                    p2p_port=adv_port, p2p_host=adv_host, nonce=nonce, mac=mac,
                    resume_peer_id=resume_id, resume_epoch=resume_epoch,
                    resume_revision=resume_revision, resume_peers=resume_peers))
                reply = await conn.recv()
        except TimeoutError:
            raise MasterConnectionError(
                f"the master at {self.master} did not complete the handshake in "
                f"{self.timeout}s") from None
        except ConnectionClosed as e:
            raise MasterConnectionError(f"the master closed the connection during the "
                                        f"handshake ({e})") from None
        if isinstance(reply, m.Reject):
            raise ErrorKind.parse(reply.kind, ErrorKind.MasterConnectionError).error(
                reply.message)
        if not isinstance(reply, m.Welcome):
            raise ProtocolError(f"expected welcome, the master sent {reply.TYPE}")
        if self.secret is not None and not hmac.compare_digest(
                reply.mac, master_mac(self.secret, challenge.nonce, nonce)):
            raise AuthenticationError("the master could not prove it knows the shared secret")
        self._heartbeat_timeout = reply.heartbeat_timeout
        # The p2p node learns its id now; streams are only dialed after this point.
        self._node.set_peer_id(reply.peer_id)
        self._waiters[ps.ACCEPT] = asyncio.get_running_loop().create_future()
        self._feed(ps.Welcomed(reply.peer_id))
        self._reader = asyncio.create_task(self._read_loop(conn), name=f"pccl-peer-{self.peer_id}")

    async def close(self) -> None:
        """Leaves the run gracefully (the master drops this peer at once). Idempotent."""
        if self.state is PeerState.CLOSED:
            return
        self._check_loop("close()")
        handles = list(self._handles)
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(ConnectionClosed, OSError):
                conn.send_nowait(m.Leave())
        self._feed(ps.Closed())
        tasks = [t for t in (self._reader, *self._tasks) if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks.clear()
        if conn is not None:
            await conn.close()
        if self._node is not None:
            node, self._node = self._node, None
            await node.close()
        if handles:
            # all_reduce_async() handles still pending fail with MasterConnectionError
            # ("closed"). A caller may still await them and get that; one that dropped
            # them gets no "Task exception was never retrieved" noise at exit.
            await asyncio.wait(handles, timeout=self.timeout)
            for h in handles:
                if h.done() and not h.cancelled():
                    h.exception()

    async def __aenter__(self) -> Communicator:
        await self.connect()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    # --- the machine and its commands -------------------------------------------------

    def _feed(self, ev: ps.Event) -> None:
        """Hands ``ev`` to the machine and carries out what it says."""
        try:
            commands = self._m.handle(ev)
        except ps.ProtocolViolation as e:
            raise e.kind.error(str(e)) from None
        for c in commands:
            self._do(c)

    def _future(self, w: ps.Waiter) -> asyncio.Future[Any]:
        fut = self._waiters.get(w)
        if fut is None:
            fut = self._waiters[w] = asyncio.get_running_loop().create_future()
        return fut

    def _end(self, ev: ps.Event, *waiters: ps.Waiter) -> None:
        """A call is over: tells the machine and forgets its futures."""
        for w in waiters:
            self._waiters.pop(w, None)
        self._feed(ev)

    def _do(self, c: ps.Command) -> None:
        if isinstance(c, ps.Send):
            if self._conn is not None:
                self._conn.send_nowait(c.msg)
        elif isinstance(c, (ps.Resolve, ps.Fail)):
            fut = self._future(c.waiter)
            if fut.done():
                return
            if isinstance(c, ps.Resolve):
                fut.set_result(c.value)
            else:
                fut.set_exception(c.kind.error(c.message))
                fut.exception()  # nobody may be awaiting it (e.g. after connect())
        elif isinstance(c, ps.RunRing):
            pass  # the all-reduce call awaiting the perform runs it (_run_all_reduce)
        elif isinstance(c, ps.AbortRing):
            ring = self._rings.get(c.tag)
            if ring is not None:
                ring.abort()
        elif isinstance(c, ps.InstallRing):
            self._spawn(self._install(c), f"pccl-topology-{self.peer_id}-{c.epoch}")
        elif isinstance(c, ps.Establish):
            self._spawn(self._establish(c), f"pccl-establish-{self.peer_id}-{c.msg.epoch}")
        elif isinstance(c, ps.Probe):
            self._spawn(self._probe(c), f"pccl-probe-{self.peer_id}")
        elif isinstance(c, ps.Rejoin):
            self._waiters[ps.REJOIN] = asyncio.get_running_loop().create_future()
            self._spawn(self._rejoin(), f"pccl-rejoin-{self.peer_id}")
        elif isinstance(c, ps.Log):
            if self.state is not PeerState.CLOSED:
                log.warning("%s", c.message)
        else:  # pragma: no cover - the type union is closed
            raise TypeError(c)

    def _spawn(self, coro: Any, name: str) -> None:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # --- the master connection ----------------------------------------------------------

    async def _read_loop(self, conn: FramedConnection) -> None:
        try:
            while True:
                try:
                    async with asyncio.timeout(self._heartbeat_timeout):
                        msg = await conn.recv()
                except TimeoutError:
                    raise MasterConnectionError(
                        f"no word from the master for {self._heartbeat_timeout}s") from None
                except ConnectionClosed as e:
                    raise MasterConnectionError(
                        f"lost the connection to the master ({e})") from None
                self._dispatch(msg)
                if not self._m.connected:
                    return  # the machine gave this connection up (a Reject, garbage)
        except PCCLError as e:
            self._feed(ps.MasterLost(str(e)))

    def _dispatch(self, msg: m.Message) -> None:
        """One message from the master into the machine (tests hold some back here:
        :class:`pccl.testing.HeldMessage`)."""
        self._feed(ps.FromMaster(msg))

    async def _rejoin(self) -> None:
        """Registers with the master again (a restarted one, or the same one after it
        dropped this peer) until admitted or ``reconnect_timeout`` runs out."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.reconnect_timeout
        host, port = split_host_port(self.master)
        old, self._conn = self._conn, None
        if old is not None:
            old.abort()
        delay = 0.05
        last: object = self._m.lost[1] if self._m.lost else None
        log.warning("peer %s: lost the master (%s); registering again for up to %.1fs",
                    self.peer_id, last, self.reconnect_timeout)
        while loop.time() < deadline:
            conn: FramedConnection | None = None
            try:
                async with asyncio.timeout(min(self.timeout, deadline - loop.time())):
                    reader, writer = await asyncio.open_connection(host, port)
                    conn = FramedConnection(reader, writer, max_frame=self.max_frame)
                    self._conn = conn
                    await self._handshake(conn)
                async with asyncio.timeout(max(deadline - loop.time(), 0.0)):
                    await self._waiters[ps.ACCEPT]
            except (AuthenticationError, ProtocolError) as e:
                last = e  # retrying cannot help
                break
            except (OSError, TimeoutError, PCCLError) as e:
                last = e
                if conn is not None:
                    await self._drop_conn(conn)
                await asyncio.sleep(min(delay, max(deadline - loop.time(), 0.0)))  # back-off
                delay = min(delay * 2, 2.0)
                continue
            except BaseException:
                if conn is not None:
                    await self._drop_conn(conn)
                raise
            return  # accepted: the machine answered the calls waiting for this
        if self._conn is not None:
            await self._drop_conn(self._conn)
        why = (f"could not register with the master at {self.master} again within "
               f"{self.reconnect_timeout}s ({last})")
        log.error("peer %s: %s", self.peer_id, why)
        self._feed(ps.RejoinFailed(why))

    async def _drop_conn(self, conn: FramedConnection) -> None:
        """Forgets a master connection of a failed registration attempt."""
        reader = self._reader
        if reader is not None and reader is not asyncio.current_task():
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)
        self._reader = None
        if self._conn is conn:
            self._conn = None
            self._feed(ps.MasterLost("a registration attempt failed"))
        conn.abort()

    async def _ready(self) -> None:
        """Waits out a re-registration with the master, then checks the peer is usable."""
        rejoined = self._waiters.get(ps.REJOIN)
        if self.state is PeerState.RECONNECTING and rejoined is not None:
            await asyncio.shield(rejoined)
        self._require_accepted()

    def _require_accepted(self) -> None:
        self._check_loop()
        why = self._m.usable()
        if why is not None:
            raise why[0].error(why[1])

    def _check_loop(self, what: str = "this call") -> None:
        """A Communicator lives in the event loop it connected in: its futures and
        sockets belong to that loop, and a call from another loop (another thread's
        asyncio.run) would wait forever for events that loop never sees."""
        home = self._home_loop
        if home is None:
            return
        try:
            running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is not home:
            raise InvalidUsageError(
                f"{what} came from another event loop than the one this Communicator "
                "connected in; use it only from that loop (from another thread: "
                "asyncio.run_coroutine_threadsafe(coro, loop)), or use pccl.blocking, "
                "which may be called from any thread")

    # --- the data plane's side of membership -------------------------------------------

    async def _establish(self, c: ps.Establish) -> None:
        assert self._node is not None
        msg = c.msg
        self._node.retain_from_epoch(msg.epoch)
        failed: list[int] = []
        if msg.next_id >= 0:
            try:
                await self._node.connect_pool(msg.next_addr, msg.next_id, msg.epoch,
                                              self.p2p_connection_pool_size)
            except PCCLError as e:
                log.warning("peer %s: p2p pool to peer %d at %s failed: %s",
                            self.peer_id, msg.next_id, msg.next_addr, e)
                failed.append(msg.next_id)
        self._feed(ps.PoolsEstablished(msg.epoch, c.generation, tuple(failed)))

    async def _install(self, c: ps.InstallRing) -> None:
        """Takes over the ring links of a new epoch."""
        assert self._node is not None
        error = ""
        try:
            await self._node.install_ring(c.epoch, c.next_id, c.prev_id,
                                          pool_timeout=self.p2p_timeout,
                                          io_timeout=self.peer_timeout,
                                          max_piece=max(self.piece_bytes, 1 << 16))
        except PCCLError as e:
            error = str(e) or type(e).__name__
        self._feed(ps.RingInstalled(c.epoch, c.generation, error))

    async def _probe(self, c: ps.Probe) -> None:
        assert self._node is not None
        rates = []
        for target, addr in zip(c.msg.target_ids, c.msg.target_addrs):
            try:
                rate = await self._node.probe(addr, target, seconds=c.msg.seconds,
                                              streams=self.p2p_connection_pool_size,
                                              io_timeout=self.peer_timeout)
            except PCCLError as e:
                log.warning("peer %s: probe to peer %d failed: %s", self.peer_id, target, e)
                rate = 0.0
            rates.append(float(rate))
        self._feed(ps.Probed(tuple(c.msg.target_ids), tuple(rates), c.generation))

    # --- membership -----------------------------------------------------------------

    def _wire_timeout(self, timeout: Any) -> float:
        """The deadline a collective call sends the master (0.0: none)."""
        t = self.collective_timeout if timeout is DEFAULT_TIMEOUT else check_deadline(
            timeout, "timeout")
        return 0.0 if t is None else t

    async def update_topology(self, *, timeout: Any = DEFAULT_TIMEOUT) -> None:
        """Collective over all accepted peers: admits pending joiners, drops dead peers
        and (re)builds the p2p rings. Returns when every peer's pools are up.

        ``timeout``: seconds to wait for every accepted peer to call it too (default:
        the Communicator's ``collective_timeout``; ``None``: no limit); past it the call
        fails on every peer that made it with :class:`OperationTimeoutError`."""
        await self._topology(False, timeout)

    async def optimize_topology(self, *, timeout: Any = DEFAULT_TIMEOUT) -> None:
        """Collective over all accepted peers: measure the bandwidth between peers of
        each group (over as many parallel streams as the ring uses), solve for the ring
        with the best bottleneck link, and rebuild the rings in that order.

        A peer lost meanwhile fails the call on everyone with
        :class:`TopologyOptimizationFailedError`; the previous rings stay. ``timeout`` as
        in :meth:`update_topology`.
        """
        await self._topology(True, timeout)

    async def _topology(self, optimize: bool, timeout: Any) -> None:
        wire = self._wire_timeout(timeout)
        await self._ready()
        self._feed(ps.StartTopology(wire, optimize))
        try:
            await self._future(ps.UPDATE)
        except UpdateTopologyFailedError as e:
            if optimize:
                raise TopologyOptimizationFailedError(str(e)) from None
            raise
        finally:
            self._end(ps.EndTopology(), ps.UPDATE)

    async def are_peers_pending(self, *, timeout: Any = DEFAULT_TIMEOUT) -> bool:
        """Whether peers are waiting to be admitted by :meth:`update_topology`.

        A collective over every accepted peer of the run (as in PCCL): the master
        answers once all of them asked, and every one gets the same answer, so the
        idiom ``if await comm.are_peers_pending(): await comm.update_topology()`` takes
        the same branch on every peer. (While some peers are already in
        ``update_topology()``, the askers hear ``True`` at once and join them.) Reduces
        started earlier may keep running meanwhile. ``timeout`` as in
        :meth:`update_topology`. For a quick look that waits for nobody, use
        :meth:`pending_peer_count`.

        Example::

            if await comm.are_peers_pending():
                await comm.update_topology()
        """
        answer = await self._ask_pending(True, self._wire_timeout(timeout))
        return answer.pending

    async def pending_peer_count(self) -> int:
        """How many peers wait to be admitted, as the master sees it now. Not a
        collective: peers asking a moment apart may get different numbers, so do not
        branch collective calls on it (use :meth:`are_peers_pending`)."""
        answer = await self._ask_pending(False, 0.0)
        return answer.count

    async def _ask_pending(self, collective: bool, wire: float) -> m.PendingAnswer:
        await self._ready()
        req = self._m.new_request()
        self._feed(ps.AskPending(req, collective, wire))
        fut = self._future(ps.query_of(req))
        try:
            if collective:
                # The master bounds this wait (deadline, dead peers). A caller that gives
                # up leaves the question standing there; the next one replaces it.
                answer: m.PendingAnswer = await fut
            else:
                async with asyncio.timeout(self.timeout):
                    answer = await fut
        except TimeoutError:
            raise MasterConnectionError(
                f"the master did not answer within {self.timeout}s") from None
        finally:
            self._end(ps.EndQuery(req), ps.query_of(req))
        if not answer.ok:
            raise ErrorKind.parse(answer.kind).error(answer.message)
        return answer

    def get_attribute(self, attribute: Attribute) -> int:
        """Reports the run's shape as of the last message from the master."""
        w = self._m.world
        if w is None:
            raise InvalidUsageError("attributes are known once the peer is accepted")
        return {
            Attribute.GLOBAL_WORLD_SIZE: w.global_world_size,
            Attribute.PEER_GROUP_WORLD_SIZE: w.peer_group_world_size,
            Attribute.NUM_DISTINCT_PEER_GROUPS: w.num_peer_groups,
            Attribute.LARGEST_PEER_GROUP_WORLD_SIZE: w.largest_peer_group_world_size,
        }[Attribute(attribute)]

    @property
    def rank(self) -> int:
        """This peer's rank in its peer group, ``0 .. world_size - 1``: its place in
        join order among the group's peers. ``optimize_topology()`` does not change it;
        when an earlier peer leaves, the later ranks move down by one. Use it to shard
        data, e.g. ``batches[comm.rank::comm.world_size]``. As of the last membership
        news from the master: read it right after ``update_topology()`` (or a reduce),
        when every peer holds the same view."""
        w = self._m.world
        if w is None or self.peer_id not in w.ring:
            raise InvalidUsageError("the rank is known once the peer is accepted")
        return sorted(w.ring).index(self.peer_id)

    @property
    def world_size(self) -> int:
        """How many peers the peer group has (``get_attribute(PEER_GROUP_WORLD_SIZE)``)."""
        return self.get_attribute(Attribute.PEER_GROUP_WORLD_SIZE)

    @property
    def last_synced_revision(self) -> int | None:
        """The shared-state revision of this peer's last successful
        :meth:`sync_shared_state` (``None`` before the first one)."""
        return None if self._m.last_revision < 0 else self._m.last_revision

    @property
    def p2p_port(self) -> int:
        if self._node is None:
            raise InvalidUsageError("the p2p listener is not running")
        return int(self._node.port)

    def ring_lanes(self) -> tuple[int, int]:
        """(TCP streams from the previous peer, streams to the next peer) of the ring
        links in use; (0, 0) in a ring of one."""
        if self._node is None:
            return (0, 0)
        recv, send = self._node.ring_lanes()
        return (int(recv), int(send))

    # --- all-reduce -------------------------------------------------------------------

    def all_reduce_async(
        self,
        tensor: Any,
        out: Any = None,
        *,
        op: ReduceOp = ReduceOp.SUM,
        tag: int = 0,
        quantization: QuantizationOptions | None = None,
        timeout: Any = DEFAULT_TIMEOUT,
    ) -> asyncio.Task[ReduceInfo]:
        """Starts an all-reduce now and returns an awaitable for its :class:`ReduceInfo`.

        Several may be in flight with distinct ``tag`` values. The tensors must not be
        touched until the awaitable resolves. On failure nothing is written. ``timeout``
        bounds the wait for the other peers to start the same collective (default: the
        Communicator's ``collective_timeout``): past it, it fails on every peer with
        :class:`OperationTimeoutError`. When a peer of the group is lost, the master
        rebuilds the ring from the others; a collective started meanwhile waits for that
        and runs on the new ring (``ReduceInfo.world_size`` says how many took part).

        Example::

            h1 = comm.all_reduce_async(grads, op=pccl.ReduceOp.AVG, tag=1)
            h2 = comm.all_reduce_async(stats, op=pccl.ReduceOp.SUM, tag=2)
            info1, info2 = await h1, await h2
        """
        wire = self._wire_timeout(timeout)
        self._require_accepted()
        try:
            op = ReduceOp(op)
        except ValueError:
            raise _core.InvalidArgumentError(f"unknown reduce op {op!r}") from None
        src = as_raw(tensor, writable=out is None, what="tensor")
        dst = src if out is None else as_raw(out, writable=True, what="out")
        if dst.dtype != src.dtype or dst.count != src.count:
            raise _core.InvalidArgumentError(
                f"out has {dst.count} x {dst.dtype.name}, tensor {src.count} x {src.dtype.name}")
        q = quantization or QuantizationOptions()
        if q.algorithm != QuantizationAlgorithm.NONE:
            check_quantization(q, src, op)
        if isinstance(tag, bool) or not isinstance(tag, int) or tag < 0:
            raise _core.InvalidArgumentError("tag must be a non-negative integer")
        self._feed(ps.StartCollective(m.CollectiveInit(
            tag=tag, kind="all_reduce", dtype=int(src.dtype), count=src.count, op=int(op),
            quant_algorithm=int(q.algorithm), quant_dtype=int(q.dtype), timeout=wire,
            shape=list(src.shape))))
        handle = asyncio.create_task(self._run_all_reduce(tag, q, src, dst, op),
                                     name=f"pccl-all-reduce-{self.peer_id}-{tag}")
        self._handles.add(handle)
        handle.add_done_callback(self._handles.discard)
        return handle

    async def all_reduce(
        self,
        tensor: Any,
        out: Any = None,
        *,
        op: ReduceOp = ReduceOp.SUM,
        tag: int = 0,
        quantization: QuantizationOptions | None = None,
        timeout: Any = DEFAULT_TIMEOUT,
    ) -> ReduceInfo:
        """All-reduces ``tensor`` across the peer group (in place, or into ``out``).

        Example::

            info = await comm.all_reduce(x, op=pccl.ReduceOp.AVG)
        """
        await self._ready()
        return await self.all_reduce_async(tensor, out, op=op, tag=tag,
                                           quantization=quantization, timeout=timeout)

    async def _run_all_reduce(self, tag: int, q: QuantizationOptions, src: RawTensor,
                              dst: RawTensor, op: ReduceOp) -> ReduceInfo:
        perform_w, outcome_w = ps.perform_of(tag), ps.outcome_of(tag)
        outcome_fut = self._future(outcome_w)
        try:
            try:
                perform, run = await self._future(perform_w)
            except asyncio.CancelledError:
                # Others would wait for us in the ring: call the collective off.
                self._feed(ps.CancelCollective(tag))
                raise
            tx = rx = 0
            ok = True
            ring: Any = None
            if run:
                assert self._node is not None
                try:
                    ring = self._node.start_all_reduce(
                        perform.op_id, perform.rank, perform.world, src.data, int(src.dtype),
                        int(op), piece_bytes=self.piece_bytes,
                        quant_algorithm=int(q.algorithm), quant_dtype=int(q.dtype))
                    self._rings[tag] = ring
                    col = self._m.collectives.get(tag)
                    if col is None or col.aborted:
                        ring.abort()
                    running = ring.run()
                    try:
                        # Shielded: a cancelled caller aborts the ring through its token
                        # instead of dropping it mid-frame.
                        tx, rx = await asyncio.shield(running)
                    except asyncio.CancelledError:
                        ring.abort()
                        with contextlib.suppress(Exception):
                            await running
                        self._feed(ps.CancelCollective(tag))
                        raise
                except PCCLError as e:
                    ok = False
                    self._feed(ps.RingDone(tag, False, ErrorKind.of(e), str(e)))
                else:
                    self._feed(ps.RingDone(tag, True))
            try:
                outcome = await asyncio.shield(outcome_fut)
            except asyncio.CancelledError:
                # The others must not apply a result this peer drops: call it off, and
                # apply it after all if the master had already decided (the outcome says).
                decided = await self._withdraw_collective(tag, outcome_fut)
                if decided is not None and decided.ok and ok:
                    self._apply_reduce(perform.world, ring, src, dst)
                raise
            if not outcome.ok:
                raise ErrorKind.parse(outcome.kind).error(outcome.message)
            self._apply_reduce(perform.world, ring, src, dst)
            return ReduceInfo(tx_bytes=int(tx), rx_bytes=int(rx), world_size=perform.world)
        finally:
            self._rings.pop(tag, None)
            if self._m.collectives.get(tag) is not None:
                self._end(ps.EndCollective(tag), perform_w, outcome_w)

    @staticmethod
    def _apply_reduce(world: int, ring: Any, src: RawTensor, dst: RawTensor) -> None:
        if world == 1 or ring is None:
            if dst.data is not src.data:
                _core.copy_into(dst.data, src.data)
        else:
            ring.commit(dst.data)

    async def _withdraw_collective(self, tag: int, outcome: asyncio.Future[Any]
                                   ) -> m.CollectiveOutcome | None:
        """After the caller cancelled a collective this peer reported done: fails it for
        the group unless its outcome was already decided, and waits (bounded) for that
        outcome."""
        try:
            self._feed(ps.CancelCollective(tag))
            async with asyncio.timeout(self.timeout):
                decided: m.CollectiveOutcome = await outcome
                return decided
        except (PCCLError, TimeoutError) as e:
            log.warning("peer %s: cancelled all_reduce(tag=%d); no outcome from the master "
                        "(%s): output left as it was", self.peer_id, tag, e or "timed out")
        return None

    async def all_reduce_multiple_with_retry(
        self,
        descriptors: list[ReduceDescriptor],
        max_in_flight: int = 4,
        *,
        max_attempts: int = 8,
    ) -> list[ReduceInfo]:
        """Runs every descriptor's all-reduce, at most ``max_in_flight`` at a time; when
        some fail for reasons a new topology can fix (a peer died, a link broke), runs
        ``update_topology()`` and retries those, up to ``max_attempts`` rounds.

        All peers see the same outcome per tag, so they retry the same set and make
        the same choices. A collective that failed because a peer was lost is retried
        at once: the master rebuilds the ring from the peers left and runs the retry on
        it (if the ring still fails, the next round calls ``update_topology()`` first);
        one called off because peers of the group are in ``update_topology()`` joins
        them first. Returns the infos in the order of ``descriptors``.
        """
        if max_in_flight < 1:
            raise _core.InvalidArgumentError("max_in_flight must be at least 1")
        if len({d.tag for d in descriptors}) != len(descriptors):
            raise InvalidUsageError("descriptors must have distinct tags")
        results: dict[int, ReduceInfo] = {}
        todo = list(range(len(descriptors)))
        for attempt in range(max_attempts):
            failures: list[BaseException] = []
            for start in range(0, len(todo), max_in_flight):
                batch = todo[start:start + max_in_flight]
                handles = []
                for i in batch:
                    d = descriptors[i]
                    handles.append(self.all_reduce_async(d.tensor, d.out, op=d.op, tag=d.tag,
                                                         quantization=d.quantization))
                outcomes = await asyncio.gather(*handles, return_exceptions=True)
                for i, res in zip(batch, outcomes):
                    if isinstance(res, ReduceInfo):
                        results[i] = res
                    elif recovery.decide(res, attempt + 1) is recovery.Action.GIVE_UP:
                        raise res
                    else:
                        failures.append(res)
            todo = [i for i in todo if i not in results]
            if not todo:
                return [results[i] for i in range(len(descriptors))]
            vote = any(recovery.decide(f, attempt + 1) is recovery.Action.UPDATE_TOPOLOGY
                       for f in failures)
            log.info("peer %s: %d all-reduce(s) failed (%s); retrying%s (attempt %d/%d)",
                     self.peer_id, len(todo), failures[0],
                     " after update_topology()" if vote else "", attempt + 1, max_attempts)
            if vote:
                await self.update_topology()
        raise _core.PeerConnectionError(
            f"{len(todo)} all-reduce(s) still failing after {max_attempts} attempts")

    # --- shared state -------------------------------------------------------------------

    async def sync_shared_state(
        self,
        state: SharedState,
        strategy: SharedStateSyncStrategy = SharedStateSyncStrategy.ENFORCE_POPULAR,
        *,
        in_place: bool = False,
        progress: Callable[[SyncProgress], object] | None = None,
        progress_interval: float = 1.0,
        timeout: Any = DEFAULT_TIMEOUT,
    ) -> SyncInfo:
        """Brings ``state`` to the content most peers of the group hold (collective).

        The master elects the most popular revision and, per tensor, the most popular
        content hash (ties: the content of the earliest-joined holder). Outdated peers
        fetch tensors peer to peer into scratch buffers, hashing them as they land, and
        write them into their tensors only after every peer of the group succeeded; on
        failure every tensor is left exactly as it was. ``RECEIVE_ONLY`` (a fresh joiner)
        adopts the popular revision and content; ``SEND_ONLY`` never changes local
        tensors. Do not modify the tensors while the call runs.

        ``in_place=True`` fetches straight into the tensors instead: no scratch memory
        and no commit copy (the fastest way to bring up a fresh joiner with a large
        state), but a failed call may leave fetched tensors partly written or holding
        content that did not verify. Use it only where the local values have nothing to
        lose (a fresh ``RECEIVE_ONLY`` joiner); the revision still changes only on
        success. With ``RECEIVE_ONLY`` it also skips hashing the local tensors: every
        tensor is fetched (and verified), even one that happened to be equal.

        ``progress`` (optional) is called on the event loop with a :class:`SyncProgress`
        when the master's plan arrives, every ``progress_interval`` seconds while the sync
        runs, and once more (``final=True``) when its outcome is known. Keep it quick; an
        exception it raises is logged and the callback is not called again (the sync goes
        on). Long transfers are also logged at INFO level every 10 seconds.

        Cancelling the call withdraws this peer: a sync the master has not decided yet
        fails for the whole group (``CollectiveAbortedError``) and nothing is committed;
        one it already decided to commit is committed here too before ``CancelledError``
        propagates, so the group stays in parity either way.

        Peers that never completed a sync in this run (fresh joiners) do not vote while a
        peer that did is present: they take the running state and revision, so joiners
        can never roll a running group back to their initial tensors.

        ``timeout`` bounds the wait for the other peers of the group to call it too
        (default: the Communicator's ``collective_timeout``): past it, the sync is called
        off for every peer that called it (:class:`OperationTimeoutError`, nothing
        written). Once the transfers run, ``peer_timeout`` bounds each of them instead.

        Example::

            state.revision += 1
            info = await comm.sync_shared_state(state)
        """
        wire = self._wire_timeout(timeout)
        await self._ready()
        if self._m.sync is not None:
            raise InvalidUsageError("sync_shared_state() is already running on this peer")
        strategy = SharedStateSyncStrategy(strategy)
        raws = [as_raw(i.tensor, writable=strategy != SharedStateSyncStrategy.SEND_ONLY,
                       what=f"shared state {i.name!r}") for i in state.infos]
        if in_place and strategy == SharedStateSyncStrategy.RECEIVE_ONLY:
            # Nothing to lose and everything to take: no use hashing what gets replaced
            # (an empty hash never matches, so every tensor is fetched and verified).
            hashes = [b""] * len(raws)
        else:
            hashes = await asyncio.gather(*(asyncio.to_thread(_core.content_hash, r.data)
                                            for r in raws))
        self._require_accepted()  # the hashing took a while
        node = self._node
        assert node is not None
        by_key = {i.name: r for i, r in zip(state.infos, raws)}
        loop = asyncio.get_running_loop()
        served_before = node.bytes_served()
        prefault: asyncio.Task[None] | None = None
        fetched: dict[str, Any] = {}
        reported_ok = False
        for info, raw in zip(state.infos, raws):
            node.serve(info.name, raw.data)
        try:
            self._feed(ps.StartSync(m.SyncInit(
                revision=int(state.revision), strategy=int(strategy),
                keys=[i.name for i in state.infos], dtypes=[int(r.dtype) for r in raws],
                counts=[r.count for r in raws], hashes=list(hashes),
                unequal=[bool(i.allow_content_inequality) for i in state.infos],
                timeout=wire)))
            plan_fut, outcome_fut = self._future(ps.PLAN), self._future(ps.SYNC)
            try:
                # Shielded (here and for the outcome): a cancelled caller still needs them.
                plan: m.SyncPlan = await asyncio.shield(plan_fut)
                if not in_place and plan.fetch_keys:
                    # Back the tensors the commit will write with pages while the bytes
                    # travel (contents untouched), so the commit is a plain copy.
                    prefault = loop.create_task(asyncio.to_thread(
                        prefault_all, [by_key[k].data for k in plan.fetch_keys]))
                # Per range: (bytes landed by earlier attempts, counter of the current one).
                counters: dict[tuple[str, int], tuple[int, _core.ByteCounter]] = {}
                report = SyncReporter(lambda: self._node, self.peer_id, progress,
                                      progress_interval, served_before, counters, fetched,
                                      [by_key[k].nbytes for k in plan.fetch_keys])
                async with report:
                    fetcher = Fetcher(node, self.peer_id, self.p2p_connection_pool_size,
                                      self.peer_timeout)
                    errors = await fetcher.fetch_planned(plan, by_key, in_place, counters,
                                                         fetched)
                    for r in errors:
                        if not isinstance(r, PCCLError):
                            raise r
                    if errors:
                        self._feed(ps.Fetched(False, ErrorKind.of(errors[0]), str(errors[0])))
                    else:
                        self._feed(ps.Fetched(True))
                        reported_ok = True
                    if prefault is not None:
                        await prefault
                    outcome: m.SyncOutcome = await asyncio.shield(outcome_fut)
            except asyncio.CancelledError:
                # The group must not commit what this peer will not: withdraw, and commit
                # after all if the group had already decided to (the outcome says which).
                decided = await self._withdraw_sync(plan_fut, outcome_fut)
                if decided is not None and decided.ok and reported_ok:
                    self._commit_sync(state, fetched, by_key, decided)
                raise
            if not outcome.ok:
                raise ErrorKind.parse(outcome.kind).error(outcome.message)
            self._commit_sync(state, fetched, by_key, outcome)
            rx = sum(int(a.nbytes) for a in fetched.values())
            return SyncInfo(tx_bytes=int(node.bytes_served() - served_before), rx_bytes=rx)
        finally:
            if prefault is not None and not prefault.done():
                prefault.cancel()  # the thread finishes on its own; nothing is written
            self._end(ps.EndSync(), ps.PLAN, ps.SYNC)
            if self._node is not None:
                self._node.unserve_all()
                self._node.drop_idle_transfers()

    def _commit_sync(self, state: SharedState, fetched: dict[str, Any],
                     by_key: dict[str, RawTensor], outcome: m.SyncOutcome) -> None:
        # Not awaited on purpose: the commit must not be interrupted halfway. The copy
        # releases the GIL and runs on all cores.
        for key, scratch in fetched.items():
            if scratch is not by_key[key].data:
                _core.copy_into(by_key[key].data, scratch)
        state.revision = outcome.revision
        self._m.committed(outcome.revision)

    async def _withdraw_sync(self, plan: asyncio.Future[Any],
                             outcome: asyncio.Future[Any]) -> m.SyncOutcome | None:
        """After the caller cancelled a sync whose init went out: tells the master, and
        waits (bounded) for the one outcome this peer gets for that sync. ``ok`` there
        means the group had decided to commit before the withdrawal arrived."""
        try:
            self._feed(ps.WithdrawSync())
            async with asyncio.timeout(self.timeout):
                await plan  # raises if the outcome came first (refused or called off)
                decided: m.SyncOutcome = await outcome
                return decided
        except (PCCLError, TimeoutError) as e:
            log.warning("peer %s: cancelled sync_shared_state(); no outcome from the master "
                        "(%s): nothing committed here", self.peer_id, e or "timed out")
        return None
