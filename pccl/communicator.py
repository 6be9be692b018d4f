"""The peer side of a pccl run."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import hmac
import logging
import secrets as _secrets
import time
from collections.abc import Callable
from types import TracebackType
from typing import Any

from pccl import _core
from pccl.enums import (
    Attribute,
    DataType,
    QuantizationAlgorithm,
    ReduceOp,
    SharedStateSyncStrategy,
)
from pccl.errors import (
    ERROR_KINDS,
    AuthenticationError,
    CollectiveAbortedError,
    InvalidUsageError,
    MasterConnectionError,
    PCCLError,
    ProtocolError,
    UpdateTopologyFailedError,
)
from pccl.master.server import DEFAULT_PORT, master_mac, peer_mac, split_host_port
from pccl.protocol import MAX_FRAME, PROTOCOL_VERSION
from pccl.protocol import messages as m
from pccl.protocol.transport import ConnectionClosed, FramedConnection
from pccl.shared_state import SharedState, SyncInfo, SyncProgress
from pccl.tensors import RawTensor, as_raw, byte_buffer

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ReduceInfo:
    """What one all-reduce cost this peer."""

    tx_bytes: int  #: bytes this peer put on the wire (headers included)
    rx_bytes: int  #: bytes this peer received
    world_size: int  #: peers that took part


@dataclasses.dataclass(frozen=True)
class QuantizationOptions:
    """How values travel on the wire (``NONE``: as they are)."""

    algorithm: QuantizationAlgorithm = QuantizationAlgorithm.NONE
    dtype: DataType = DataType.UINT8


@dataclasses.dataclass
class ReduceDescriptor:
    """One all-reduce for :meth:`Communicator.all_reduce_multiple_with_retry`."""

    tensor: Any
    out: Any = None
    op: ReduceOp = ReduceOp.SUM
    tag: int = 0
    quantization: QuantizationOptions | None = None


@dataclasses.dataclass
class _Collective:
    """The peer's side of one collective in flight."""

    tag: int
    perform: asyncio.Future[m.CollectivePerform]
    outcome: asyncio.Future[m.CollectiveOutcome]
    ring_op: Any = None
    aborted: bool = False
    quantization: QuantizationOptions = dataclasses.field(
        default_factory=lambda: QuantizationOptions())


_WIRE_TYPES = (DataType.UINT8, DataType.INT8, DataType.FLOAT8_E4M3, DataType.FLOAT8_E5M2)
_FLOAT_TYPES = (DataType.FLOAT16, DataType.BFLOAT16, DataType.FLOAT32, DataType.FLOAT64)


def _check_quantization(q: QuantizationOptions, src: RawTensor, op: ReduceOp) -> None:
    try:
        algorithm, wire = QuantizationAlgorithm(q.algorithm), DataType(q.dtype)
    except ValueError:
        raise _core.InvalidArgumentError(f"invalid quantization options {q}") from None
    if wire not in _WIRE_TYPES:
        raise _core.InvalidArgumentError(
            f"{wire.name} cannot carry quantized values; use UINT8, INT8, FLOAT8_E4M3 or "
            "FLOAT8_E5M2")
    if src.dtype not in _FLOAT_TYPES:
        raise _core.InvalidArgumentError(
            f"quantization applies to float tensors, not {src.dtype.name}")
    if op not in (ReduceOp.SUM, ReduceOp.AVG):
        raise _core.InvalidArgumentError(
            f"quantized {op.name} is not exact on the wire; use SUM or AVG, or no "
            f"quantization ({algorithm.name} was asked)")


def _check_master_address(master: str) -> None:
    """A master address without a port used to mean 48148 silently; on a shared machine
    that joins somebody else's run. The port must be said."""
    if not isinstance(master, str) or not master:
        raise _core.InvalidArgumentError(f"master must be a 'host:port' string, not {master!r}")
    host, sep, port = master.rpartition(":") if not master.startswith("[") else (
        master.partition("]")[0] + "]", ":" if "]:" in master else "",
        master.partition("]:")[2])
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise _core.InvalidArgumentError(
            f"master address {master!r} has no valid port: give 'host:port' (pccl's "
            f"default port is {DEFAULT_PORT}, e.g. '{master.rstrip(':') or '127.0.0.1'}:"
            f"{DEFAULT_PORT}')")


_MAX_SECONDS = 7 * 24 * 3600.0  # a week: longer is a mistake (and past the master's cap)


def _check_deadline(value: float | None, what: str) -> float | None:
    return None if value is None else _check_seconds(value, what, none_ok=True)


def _check_seconds(value: float, what: str, zero_ok: bool = False,
                   none_ok: bool = False) -> float:
    """A number of seconds in (0, a week] ([0, a week] with ``zero_ok``), as a float."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not (0 <= value if zero_ok else 0 < value) or not value <= _MAX_SECONDS:
        raise _core.InvalidArgumentError(
            f"{what} must be a {'non-negative' if zero_ok else 'positive'} number of seconds "
            f"up to a week ({_MAX_SECONDS:.0f}){' or None' if none_ok else ''}, got {value!r}")
    return float(value)


class _Default:
    def __repr__(self) -> str:
        return "<the Communicator's collective_timeout>"


#: ``timeout=`` default of collective calls: the Communicator's ``collective_timeout``.
DEFAULT_TIMEOUT: Any = _Default()


class PeerState(enum.IntEnum):
    NEW = 0
    REGISTERED = 1  # handshake done, waiting to be admitted
    ACCEPTED = 2
    CLOSED = 3
    RECONNECTING = 4  # lost the master; registering again (see ``reconnect_timeout``)


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
        _check_master_address(master)
        self.collective_timeout = _check_deadline(collective_timeout, "collective_timeout")
        for name, value in (("timeout", timeout), ("p2p_timeout", p2p_timeout),
                            ("peer_timeout", peer_timeout)):
            _check_seconds(value, name)
        _check_seconds(reconnect_timeout, "reconnect_timeout", zero_ok=True)
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

        self.state = PeerState.NEW
        self.peer_id: int | None = None
        self.epoch = 0
        self.ring: list[int] = []
        self._world: m.WorldInfo | None = None
        self._conn: FramedConnection | None = None
        self._node: Any = None  # _core.P2PNode
        self._tasks: set[asyncio.Task[Any]] = set()
        self._reader: asyncio.Task[None] | None = None
        self._accepted: asyncio.Future[None] | None = None
        # The event loop connect() ran in: every call must come from it (see _check_loop).
        # all_reduce_async() handles not finished yet (close() settles them).
        self._handles: set[asyncio.Task[Any]] = set()
        self._home_loop: asyncio.AbstractEventLoop | None = None
        self._update: asyncio.Future[None] | None = None
        self._queries: dict[int, asyncio.Future[m.PendingAnswer]] = {}
        self._asking = False  # a collective are_peers_pending() is waiting
        self._next_req = 0
        self._lost: PCCLError | None = None
        self._heartbeat_timeout = 5.0
        self._collectives: dict[int, _Collective] = {}
        self._ring_epoch = -1
        # Ring installs under way (epoch -> task): a collective performed on a ring the
        # master just repaired waits for its install.
        self._installing: dict[int, asyncio.Task[None]] = {}
        self._optimizing = False
        self._sync_plan: asyncio.Future[m.SyncPlan] | None = None
        self._sync_outcome: asyncio.Future[m.SyncOutcome] | None = None
        self._last_revision = -1  # of the last successful sync_shared_state()
        self._rejoined: asyncio.Future[None] | None = None
        self.reconnects = 0  # times this peer registered again after losing the master

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
            assert self._accepted is not None
            await self._accepted
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
                resume = self.state is PeerState.RECONNECTING and self.peer_id is not None
                await conn.send(m.Hello(
                    version=PROTOCOL_VERSION, peer_group=self.peer_group,
                    p2p_port=adv_port, p2p_host=adv_host, nonce=nonce, mac=mac,
                    resume_peer_id=self.peer_id if resume else 0,
                    resume_epoch=max(self._ring_epoch, self.epoch, 0) if resume else 0,
                    resume_revision=self._last_revision if resume else -1,
                    resume_peers=list(self.ring) if resume else []))
                reply = await conn.recv()
        except TimeoutError:
            raise MasterConnectionError(
                f"the master at {self.master} did not complete the handshake in "
                f"{self.timeout}s") from None
        except ConnectionClosed as e:
            raise MasterConnectionError(f"the master closed the connection during the "
                                        f"handshake ({e})") from None
        if isinstance(reply, m.Reject):
            raise ERROR_KINDS.get(reply.kind, MasterConnectionError)(reply.message)
        if not isinstance(reply, m.Welcome):
            raise ProtocolError(f"expected welcome, the master sent {reply.TYPE}")
        if self.secret is not None and not hmac.compare_digest(
                reply.mac, master_mac(self.secret, challenge.nonce, nonce)):
            raise AuthenticationError("the master could not prove it knows the shared secret")
        self.peer_id = reply.peer_id
        self._heartbeat_timeout = reply.heartbeat_timeout
        # The p2p node learns its id now; streams are only dialed after this point.
        self._node.set_peer_id(reply.peer_id)
        if self.state is not PeerState.RECONNECTING:
            self.state = PeerState.REGISTERED
        self._lost = None
        loop = asyncio.get_running_loop()
        self._accepted = loop.create_future()
        self._reader = asyncio.create_task(self._read_loop(conn), name=f"pccl-peer-{self.peer_id}")

    async def close(self) -> None:
        """Leaves the run gracefully (the master drops this peer at once). Idempotent."""
        if self.state is PeerState.CLOSED:
            return
        self._check_loop("close()")
        handles = list(self._handles)
        self.state = PeerState.CLOSED
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(ConnectionClosed, OSError):
                conn.send_nowait(m.Leave())
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
        self._fail_waiters(MasterConnectionError("the communicator was closed"))
        if self._rejoined is not None and not self._rejoined.done():
            self._rejoined.set_exception(MasterConnectionError("the communicator was closed"))
            self._rejoined.exception()
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

    # --- membership -----------------------------------------------------------------

    def _wire_timeout(self, timeout: Any) -> float:
        """The deadline a collective call sends the master (0.0: none)."""
        t = self.collective_timeout if timeout is DEFAULT_TIMEOUT else _check_deadline(
            timeout, "timeout")
        return 0.0 if t is None else t

    async def update_topology(self, *, timeout: Any = DEFAULT_TIMEOUT) -> None:
        """Collective over all accepted peers: admits pending joiners, drops dead peers
        and (re)builds the p2p rings. Returns when every peer's pools are up.

        ``timeout``: seconds to wait for every accepted peer to call it too (default:
        the Communicator's ``collective_timeout``; ``None``: no limit); past it the call
        fails on every peer that made it with :class:`OperationTimeoutError`."""
        wire = self._wire_timeout(timeout)
        await self._ready()
        if self._update is not None:
            raise InvalidUsageError("update_topology() is already running on this peer")
        if self._collectives:
            raise _core.PendingAsyncOpsError(
                f"{len(self._collectives)} collective(s) still in flight (tags "
                f"{sorted(self._collectives)}); await them before update_topology()")
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._update = fut
        try:
            self._send(m.UpdateTopology(timeout=wire))
            await fut
        finally:
            self._update = None

    async def optimize_topology(self, *, timeout: Any = DEFAULT_TIMEOUT) -> None:
        """Collective over all accepted peers: measure the bandwidth between peers of
        each group (over as many parallel streams as the ring uses), solve for the ring
        with the best bottleneck link, and rebuild the rings in that order.

        A peer lost meanwhile fails the call on everyone with
        :class:`TopologyOptimizationFailedError`; the previous rings stay. ``timeout`` as
        in :meth:`update_topology`.
        """
        wire = self._wire_timeout(timeout)
        await self._ready()
        if self._update is not None:
            raise InvalidUsageError("a topology operation is already running on this peer")
        if self._collectives:
            raise _core.PendingAsyncOpsError(
                "collectives still in flight; await them before optimize_topology()")
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._update = fut
        self._optimizing = True
        try:
            self._send(m.OptimizeTopology(timeout=wire))
            await fut
        except UpdateTopologyFailedError as e:
            raise _core.TopologyOptimizationFailedError(str(e)) from None
        finally:
            self._update = None
            self._optimizing = False

    async def _probe(self, msg: m.ProbeRequest) -> None:
        rates = []
        for target, addr in zip(msg.target_ids, msg.target_addrs):
            try:
                rate = await self._node.probe(addr, target, seconds=msg.seconds,
                                              streams=self.p2p_connection_pool_size,
                                              io_timeout=self.peer_timeout)
            except PCCLError as e:
                log.warning("peer %s: probe to peer %d failed: %s", self.peer_id, target, e)
                rate = 0.0
            rates.append(float(rate))
        if self._lost is None and self._conn is not None:
            self._conn.send_nowait(m.ProbeReport(target_ids=list(msg.target_ids), rates=rates))

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
        if collective and self._asking:
            raise InvalidUsageError("are_peers_pending() is already running on this peer")
        self._next_req += 1
        req = self._next_req
        fut: asyncio.Future[m.PendingAnswer] = asyncio.get_running_loop().create_future()
        self._queries[req] = fut
        try:
            self._send(m.PendingQuery(req=req, collective=collective, timeout=wire))
            if collective:
                # The master bounds this wait (deadline, dead peers). A caller that gives
                # up leaves the question standing there; the next one replaces it.
                self._asking = True
                try:
                    answer = await fut
                finally:
                    self._asking = False
            else:
                async with asyncio.timeout(self.timeout):
                    answer = await fut
        except TimeoutError:
            raise MasterConnectionError(
                f"the master did not answer within {self.timeout}s") from None
        finally:
            self._queries.pop(req, None)
        if not answer.ok:
            raise ERROR_KINDS.get(answer.kind, PCCLError)(answer.message)
        return answer

    def get_attribute(self, attribute: Attribute) -> int:
        """Reports the run's shape as of the last message from the master."""
        w = self._world
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
        w = self._world
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
        return None if self._last_revision < 0 else self._last_revision

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

    # --- internals ------------------------------------------------------------------

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

    def _require_accepted(self) -> None:
        self._check_loop()
        if self._lost is not None:
            raise type(self._lost)(str(self._lost))
        if self.state is PeerState.RECONNECTING:
            raise MasterConnectionError("registering with the master again after losing it; "
                                        "retry once that is done")
        if self.state is not PeerState.ACCEPTED:
            raise InvalidUsageError(f"this peer is {self.state.name}, not ACCEPTED; "
                                    "call connect() first")

    def _send(self, msg: m.Message) -> None:
        if self._conn is None or self._lost is not None:
            raise self._lost or MasterConnectionError("not connected to the master")
        self._conn.send_nowait(msg)

    def _spawn(self, coro: Any, name: str) -> None:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _fail_waiters(self, err: PCCLError) -> None:
        futs: list[asyncio.Future[Any] | None] = [self._accepted, self._update,
                                                  *self._queries.values()]
        futs += [self._sync_plan, self._sync_outcome]
        for col in self._collectives.values():
            futs += [col.perform, col.outcome]
            if col.ring_op is not None:
                col.ring_op.abort()
        for fut in futs:
            if fut is not None and not fut.done():
                fut.set_exception(type(err)(str(err)))
                # Nobody may be awaiting it (e.g. the accept future after connect()).
                fut.exception()

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
        except PCCLError as e:
            if self.state is not PeerState.CLOSED:
                log.warning("peer %s: %s", self.peer_id, e)
            lost = e if isinstance(e, MasterConnectionError) else MasterConnectionError(str(e))
            self._lost = lost
            self._fail_waiters(self._lost)
            if self.state is PeerState.ACCEPTED and self.reconnect_timeout > 0:
                self.state = PeerState.RECONNECTING
                self._rejoined = asyncio.get_running_loop().create_future()
                self._spawn(self._rejoin(), f"pccl-rejoin-{self.peer_id}")

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
        last: BaseException | None = self._lost
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
                    assert self._accepted is not None
                    await self._accepted
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
            self.state = PeerState.ACCEPTED
            self.reconnects += 1
            log.warning("peer %s: registered again with the master; the run goes on",
                        self.peer_id)
            assert self._rejoined is not None
            self._rejoined.set_result(None)
            return
        if self._conn is not None:
            await self._drop_conn(self._conn)
        err = MasterConnectionError(
            f"could not register with the master at {self.master} again within "
            f"{self.reconnect_timeout}s ({last})")
        log.error("peer %s: %s", self.peer_id, err)
        self._lost = err
        assert self._rejoined is not None
        self._rejoined.set_exception(err)
        self._rejoined.exception()

    async def _drop_conn(self, conn: FramedConnection) -> None:
        """Forgets a master connection of a failed registration attempt."""
        reader = self._reader
        if reader is not None and reader is not asyncio.current_task():
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)
        self._reader = None
        if self._conn is conn:
            self._conn = None
        conn.abort()

    async def _ready(self) -> None:
        """Waits out a re-registration with the master, then checks the peer is usable."""
        rejoined = self._rejoined
        if self.state is PeerState.RECONNECTING and rejoined is not None:
            await asyncio.shield(rejoined)
        self._require_accepted()

    def _dispatch(self, msg: m.Message) -> None:
        if isinstance(msg, m.Ping):
            self._send(m.Pong(seq=msg.seq))
        elif isinstance(msg, m.EstablishP2P):
            self._spawn(self._establish(msg), f"pccl-establish-{self.peer_id}-{msg.epoch}")
        elif isinstance(msg, m.WorldInfo):
            self._world = msg
        elif isinstance(msg, m.TopologyUpdated):
            task = asyncio.create_task(self._topology_updated(msg, self._conn),
                                       name=f"pccl-topology-{self.peer_id}-{msg.epoch}")
            self._tasks.add(task)
            self._installing[msg.epoch] = task

            def done(t: asyncio.Task[None], epoch: int = msg.epoch) -> None:
                self._tasks.discard(t)
                if self._installing.get(epoch) is t:
                    del self._installing[epoch]

            task.add_done_callback(done)
        elif isinstance(msg, m.CollectivePerform):
            col = self._collectives.get(msg.tag)
            if col is not None and not col.perform.done():
                col.perform.set_result(msg)
        elif isinstance(msg, m.CollectiveAbort):
            col = self._collectives.get(msg.tag)
            if col is not None:
                col.aborted = True
                if col.ring_op is not None:
                    col.ring_op.abort()
        elif isinstance(msg, m.CollectiveOutcome):
            col = self._collectives.get(msg.tag)
            if col is None:
                log.debug("peer %s: outcome for unknown tag %d", self.peer_id, msg.tag)
            elif not col.perform.done():
                # Refused or called off before it ran.
                col.perform.set_exception(ERROR_KINDS.get(msg.kind, PCCLError)(msg.message))
            elif not col.outcome.done():
                col.outcome.set_result(msg)
        elif isinstance(msg, m.TopologyUpdateFailed):
            if self._update is not None and not self._update.done():
                self._update.set_exception(
                    ERROR_KINDS.get(msg.kind, UpdateTopologyFailedError)(msg.message))
        elif isinstance(msg, m.PendingAnswer):
            fut = self._queries.get(msg.req)
            if fut is not None and not fut.done():
                fut.set_result(msg)
        elif isinstance(msg, m.ProbeRequest):
            self._spawn(self._probe(msg), f"pccl-probe-{self.peer_id}")
        elif isinstance(msg, m.OptimizeFailed):
            if self._update is not None and not self._update.done():
                self._update.set_exception(_core.TopologyOptimizationFailedError(msg.message))
        elif isinstance(msg, m.SyncPlan):
            if self._sync_plan is not None and not self._sync_plan.done():
                self._sync_plan.set_result(msg)
        elif isinstance(msg, m.SyncOutcome):
            if self._sync_plan is not None and not self._sync_plan.done():
                self._sync_plan.set_exception(ERROR_KINDS.get(msg.kind, PCCLError)(msg.message))
            elif self._sync_outcome is not None and not self._sync_outcome.done():
                self._sync_outcome.set_result(msg)
        elif isinstance(msg, m.ErrorReply):
            err = ERROR_KINDS.get(msg.kind, PCCLError)(msg.message)
            if self._update is not None and not self._update.done():
                self._update.set_exception(err)
            else:
                log.warning("peer %s: master reported %s: %s", self.peer_id, msg.kind, msg.message)
        elif isinstance(msg, m.Reject):
            raise MasterConnectionError(f"the master dropped this peer: {msg.message}")
        else:
            raise ProtocolError(f"unexpected message {msg.TYPE!r} from the master")

    async def _establish(self, msg: m.EstablishP2P) -> None:
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
        if self._lost is None and self._conn is not None:
            self._conn.send_nowait(m.P2PReport(epoch=msg.epoch, failed=failed))

    async def _topology_updated(self, msg: m.TopologyUpdated,
                                conn: FramedConnection | None) -> None:
        """Installs the ring links of the new epoch, then releases the waiting call."""
        if conn is not self._conn:
            return  # from a master connection lost meanwhile: its round is void
        if self._world is not None:
            self.ring = list(self._world.ring)
        error: PCCLError | None = None
        if msg.epoch != self._ring_epoch and self.peer_id in self.ring:
            i = self.ring.index(self.peer_id)
            n = len(self.ring)
            nxt = self.ring[(i + 1) % n] if n > 1 else -1
            prv = self.ring[(i - 1) % n] if n > 1 else -1
            try:
                await self._node.install_ring(msg.epoch, nxt, prv, pool_timeout=self.p2p_timeout,
                                              io_timeout=self.peer_timeout,
                                              max_piece=max(self.piece_bytes, 1 << 16))
                self._ring_epoch = msg.epoch
            except PCCLError as e:
                error = UpdateTopologyFailedError(f"could not take over the ring links: {e}")
        if conn is not self._conn:
            return  # from a master connection lost meanwhile: its round is void
        self.epoch = max(self.epoch, msg.epoch)
        if msg.repair:
            if error is not None:
                log.warning("peer %s: %s", self.peer_id, error)
            return  # the master rebuilt the ring on its own: no call waits for this
        if self.state in (PeerState.REGISTERED, PeerState.RECONNECTING):
            fut = self._accepted
            if error is None and self.state is PeerState.REGISTERED:
                self.state = PeerState.ACCEPTED
        else:
            fut = self._update
        if fut is not None and not fut.done():
            if error is None:
                fut.set_result(None)
            else:
                fut.set_exception(error)

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
        if self._update is not None:
            raise InvalidUsageError("update_topology() is running on this peer")
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
            _check_quantization(q, src, op)
        if not isinstance(tag, int) or tag < 0:
            raise _core.InvalidArgumentError("tag must be a non-negative integer")
        if tag in self._collectives:
            raise InvalidUsageError(f"tag {tag} is already in flight on this peer")
        loop = asyncio.get_running_loop()
        col = _Collective(tag, loop.create_future(), loop.create_future(), quantization=q)
        self._collectives[tag] = col
        try:
            self._send(m.CollectiveInit(tag=tag, kind="all_reduce", dtype=int(src.dtype),
                                        count=src.count, op=int(op),
                                        quant_algorithm=int(q.algorithm),
                                        quant_dtype=int(q.dtype), timeout=wire,
                                        shape=list(src.shape)))
        except BaseException:
            del self._collectives[tag]
            raise
        handle = asyncio.create_task(self._run_all_reduce(col, src, dst, op),
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

    async def _run_all_reduce(self, col: _Collective, src: RawTensor, dst: RawTensor,
                              op: ReduceOp) -> ReduceInfo:
        try:
            try:
                perform = await col.perform
            except asyncio.CancelledError:
                # Others would wait for us in the ring: call the collective off.
                with contextlib.suppress(PCCLError):
                    self._send(m.CollectiveDone(tag=col.tag, op_id=-1, ok=False,
                                                kind="CollectiveAbortedError",
                                                message="cancelled by the caller"))
                raise
            tx = rx = 0
            ok, kind, why = True, "", ""
            if perform.world > 1:
                try:
                    installing = self._installing.get(perform.epoch)
                    if installing is not None and perform.epoch != self._ring_epoch:
                        # Performed on a ring the master just rebuilt: its links are
                        # being taken over right now (bounded by p2p_timeout there).
                        try:
                            await asyncio.wait([installing])
                        except asyncio.CancelledError:
                            with contextlib.suppress(PCCLError):
                                self._send(m.CollectiveDone(
                                    tag=col.tag, op_id=perform.op_id, ok=False,
                                    kind="CollectiveAbortedError",
                                    message="cancelled by the caller"))
                            raise
                    if perform.epoch != self._ring_epoch:
                        raise _core.PeerConnectionError(
                            f"ring epoch {perform.epoch} is not installed here "
                            f"({self._ring_epoch}); call update_topology()")
                    col.ring_op = self._node.start_all_reduce(
                        perform.op_id, perform.rank, perform.world, src.data, int(src.dtype),
                        int(op), piece_bytes=self.piece_bytes,
                        quant_algorithm=int(col.quantization.algorithm),
                        quant_dtype=int(col.quantization.dtype))
                    if col.aborted:
                        col.ring_op.abort()
                    run = col.ring_op.run()
                    try:
                        # Shielded: a cancelled caller aborts the ring through its token
                        # instead of dropping it mid-frame.
                        tx, rx = await asyncio.shield(run)
                    except asyncio.CancelledError:
                        col.ring_op.abort()
                        with contextlib.suppress(Exception):
                            await run
                        with contextlib.suppress(PCCLError):
                            self._send(m.CollectiveDone(tag=col.tag, op_id=perform.op_id,
                                                        ok=False, kind="CollectiveAbortedError",
                                                        message="cancelled by the caller"))
                        raise
                except PCCLError as e:
                    ok, kind, why = False, type(e).__name__, str(e)
            self._send(m.CollectiveDone(tag=col.tag, op_id=perform.op_id, ok=ok, kind=kind,
                                        message=why))
            try:
                outcome = await asyncio.shield(col.outcome)
            except asyncio.CancelledError:
                # The others must not apply a result this peer drops: call it off, and
                # apply it after all if the master had already decided (the outcome says).
                decided = await self._withdraw_collective(col, perform.op_id)
                if decided is not None and decided.ok and ok:
                    self._apply_reduce(perform.world, col, src, dst)
                raise
            if not outcome.ok:
                raise ERROR_KINDS.get(outcome.kind, PCCLError)(outcome.message)
            self._apply_reduce(perform.world, col, src, dst)
            return ReduceInfo(tx_bytes=int(tx), rx_bytes=int(rx), world_size=perform.world)
        finally:
            if self._collectives.get(col.tag) is col:
                del self._collectives[col.tag]

    @staticmethod
    def _apply_reduce(world: int, col: _Collective, src: RawTensor, dst: RawTensor) -> None:
        if world == 1:
            if dst.data is not src.data:
                _core.copy_into(dst.data, src.data)
        else:
            col.ring_op.commit(dst.data)

    async def _withdraw_collective(self, col: _Collective,
                                   op_id: int) -> m.CollectiveOutcome | None:
        """After the caller cancelled a collective this peer reported done: fails it for
        the group unless its outcome was already decided, and waits (bounded) for that
        outcome."""
        try:
            self._send(m.CollectiveDone(tag=col.tag, op_id=op_id, ok=False,
                                        kind="CollectiveAbortedError",
                                        message="cancelled by the caller"))
            async with asyncio.timeout(self.timeout):
                return await col.outcome
        except (PCCLError, TimeoutError) as e:
            log.warning("peer %s: cancelled all_reduce(tag=%d); no outcome from the master "
                        "(%s): output left as it was", self.peer_id, col.tag, e or "timed out")
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
        fatal = (_core.InvalidArgumentError, InvalidUsageError, MasterConnectionError)
        for attempt in range(max_attempts):
            failures: list[PCCLError] = []
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
                    elif isinstance(res, fatal) or not isinstance(res, PCCLError):
                        raise res
                    else:
                        failures.append(res)
            todo = [i for i in todo if i not in results]
            if not todo:
                return [results[i] for i in range(len(descriptors))]
            vote = attempt > 0 or any(type(f) is CollectiveAbortedError for f in failures)
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
        if self._sync_plan is not None:
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
        by_key = {i.name: r for i, r in zip(state.infos, raws)}
        loop = asyncio.get_running_loop()
        self._sync_plan, self._sync_outcome = loop.create_future(), loop.create_future()
        served_before = self._node.bytes_served()
        prefault: asyncio.Task[None] | None = None
        fetched: dict[str, Any] = {}
        reported_ok = False
        try:
            for info, raw in zip(state.infos, raws):
                self._node.serve(info.name, raw.data)
            self._send(m.SyncInit(
                revision=int(state.revision), strategy=int(strategy),
                keys=[i.name for i in state.infos], dtypes=[int(r.dtype) for r in raws],
                counts=[r.count for r in raws], hashes=list(hashes),
                unequal=[bool(i.allow_content_inequality) for i in state.infos],
                timeout=wire))
            try:
                # Shielded (here and for the outcome): a cancelled caller still needs them.
                plan = await asyncio.shield(self._sync_plan)
                if not in_place and plan.fetch_keys:
                    # Back the tensors the commit will write with pages while the bytes
                    # travel (contents untouched), so the commit is a plain copy.
                    prefault = loop.create_task(asyncio.to_thread(
                        _prefault_all, [by_key[k].data for k in plan.fetch_keys]))
                ok, kind, why = True, "", ""
                # Per range: (bytes landed by earlier attempts, counter of the current one).
                counters: dict[tuple[str, int], tuple[int, _core.ByteCounter]] = {}
                report = _SyncReporter(self, progress, progress_interval, served_before,
                                       counters, fetched,
                                       [by_key[k].nbytes for k in plan.fetch_keys])
                async with report:
                    errors = await self._fetch_planned(plan, by_key, in_place, counters,
                                                       fetched)
                    for r in errors:
                        if not isinstance(r, PCCLError):
                            raise r
                    if errors:
                        ok, kind, why = False, type(errors[0]).__name__, str(errors[0])
                    self._send(m.SyncDone(ok=ok, kind=kind, message=why))
                    reported_ok = ok
                    if prefault is not None:
                        await prefault
                    outcome = await asyncio.shield(self._sync_outcome)
            except asyncio.CancelledError:
                # The group must not commit what this peer will not: withdraw, and commit
                # after all if the group had already decided to (the outcome says which).
                decided = await self._withdraw_sync()
                if decided is not None and decided.ok and reported_ok:
                    self._commit_sync(state, fetched, by_key, decided)
                raise
            if not outcome.ok:
                raise ERROR_KINDS.get(outcome.kind, PCCLError)(outcome.message)
            self._commit_sync(state, fetched, by_key, outcome)
            rx = sum(int(a.nbytes) for a in fetched.values())
            return SyncInfo(tx_bytes=int(self._node.bytes_served() - served_before), rx_bytes=rx)
        finally:
            if prefault is not None and not prefault.done():
                prefault.cancel()  # the thread finishes on its own; nothing is written
            self._sync_plan = self._sync_outcome = None
            if self._node is not None:
                self._node.unserve_all()
                self._node.drop_idle_transfers()

    async def _fetch_planned(self, plan: m.SyncPlan, by_key: dict[str, RawTensor],
                             in_place: bool,
                             counters: dict[tuple[str, int], tuple[int, Any]],
                             fetched: dict[str, Any]) -> list[BaseException]:
        """Fetches what ``plan`` says into scratch buffers (or, ``in_place``, the tensors):
        large tensors in ranges, small ones in pipelined batches. What verifies goes into
        ``fetched``; returns the failures (every fetch has ended by then)."""
        addrs = dict(zip(plan.source_ids, plan.source_addrs))
        # Fetches in flight at once (a range, a tensor or a batch of small tensors, one
        # stream each, kept for the next fetch from the same holder), bounded.
        limit = asyncio.Semaphore(MAX_FETCHES_IN_FLIGHT)
        pool = self.p2p_connection_pool_size
        wanted = list(zip(plan.fetch_keys, plan.fetch_hashes, plan.fetch_sources))
        big = [w for w in wanted if by_key[w[0]].nbytes >= 2 * RANGE_BYTES]
        # Large tensors are fetched in ranges, over at least p2p_connection_pool_size
        # streams in all (one tensor alone is not stuck with one stream; many do not each
        # open that many).
        streams = -(-pool // max(1, len(big)))

        async def fetch(key: str, want: bytes, sources: list[int]) -> None:
            dst = by_key[key].data if in_place else None
            fetched[key] = await self._fetch_verified(
                key, want, sources, addrs, dst, by_key[key].nbytes, counters, limit, streams)

        async def fetch_batch(n: int, batch: list[tuple[str, bytes, list[int]]]) -> None:
            outs = [by_key[k].data if in_place else byte_buffer(by_key[k].nbytes)
                    for k, _, _ in batch]
            retry = await self._fetch_pipelined(n, batch, outs, addrs, counters, limit, fetched)
            failed = [r for r in await asyncio.gather(*(fetch(*w) for w in retry),
                                                      return_exceptions=True)
                      if isinstance(r, BaseException)]
            if failed:
                raise failed[0]

        small = [w for w in wanted if by_key[w[0]].nbytes < 2 * RANGE_BYTES]
        jobs = [fetch(*w) for w in big]
        jobs += [fetch_batch(n, b) for n, b in enumerate(_batches(small, pool))]
        results = await asyncio.gather(*jobs, return_exceptions=True)
        return [r for r in results if isinstance(r, BaseException)]

    def _commit_sync(self, state: SharedState, fetched: dict[str, Any],
                     by_key: dict[str, RawTensor], outcome: m.SyncOutcome) -> None:
        # Not awaited on purpose: the commit must not be interrupted halfway. The copy
        # releases the GIL and runs on all cores.
        for key, scratch in fetched.items():
            if scratch is not by_key[key].data:
                _core.copy_into(by_key[key].data, scratch)
        state.revision = outcome.revision
        self._last_revision = int(outcome.revision)

    async def _withdraw_sync(self) -> m.SyncOutcome | None:
        """After the caller cancelled a sync whose init went out: tells the master, and
        waits (bounded) for the one outcome this peer gets for that sync. ``ok`` there
        means the group had decided to commit before the withdrawal arrived."""
        plan, outcome = self._sync_plan, self._sync_outcome
        assert plan is not None and outcome is not None
        try:
            self._send(m.SyncWithdraw())
            async with asyncio.timeout(self.timeout):
                await plan  # raises if the outcome came first (refused or called off)
                return await outcome
        except (PCCLError, TimeoutError) as e:
            log.warning("peer %s: cancelled sync_shared_state(); no outcome from the master "
                        "(%s): nothing committed here", self.peer_id, e or "timed out")
        return None

    async def _fetch_pipelined(self, n: int, batch: list[tuple[str, bytes, list[int]]],
                               outs: list[Any], addrs: dict[int, str],
                               counters: dict[tuple[str, int], tuple[int, Any]],
                               limit: asyncio.Semaphore,
                               fetched: dict[str, Any]) -> list[tuple[str, bytes,
                                                                             list[int]]]:
        """Fetches the small tensors of ``batch`` from their first source over one
        stream into ``outs``, every request sent up front (one round trip for the batch,
        not one per tensor). What verifies goes into ``fetched``; returns the others
        (failed, refused, or not matching their hash) with their sources rotated so this
        source comes last, to be fetched one by one."""
        src = batch[0][2][0]
        counter = _core.ByteCounter()
        slot = ("", -1 - n)  # no tensor range has a negative offset
        counters[slot] = (0, counter)
        started = time.perf_counter()
        async with limit:
            try:
                results = await self._node.fetch_many_into(
                    addrs[src], src, [k for k, _, _ in batch], outs,
                    io_timeout=self.peer_timeout, counter=counter)
            except PCCLError as e:
                results = [e] * len(batch)
        retry, landed = [], 0
        for (key, want, sources), out, r in zip(batch, outs, results):
            if isinstance(r, bytes) and _core.hash_root(r, out.nbytes) == want:
                fetched[key] = out
                landed += out.nbytes
            else:
                why = r if isinstance(r, BaseException) else "content hash mismatch"
                log.info("peer %s: shared state %r from peer %s: %s; fetching it alone",
                         self.peer_id, key, src, why)
                retry.append((key, want, sources[1:] + sources[:1]))
        counters[slot] = (landed, _core.ByteCounter())  # the retries count afresh
        if landed:
            self._log_fetched(f"({len(batch) - len(retry)} tensors)", landed, started, [src])
        return retry

    async def _fetch_verified(self, key: str, want: bytes, sources: list[int],
                              addrs: dict[int, str], dst: Any | None, nbytes: int,
                              counters: dict[tuple[str, int], tuple[int, Any]],
                              limit: asyncio.Semaphore, streams: int = 1) -> Any:
        """Fetches ``key`` into a scratch buffer (or straight into ``dst``) and checks
        its content hash. A large tensor is split into ranges fetched at once (at least
        one per holder, and ``streams``); a range whose source fails continues from the
        next holder after the whole hash leaves already landed. After a content
        mismatch, whole-tensor fetches go through the holders in turn. ``counters``
        count the bytes landed."""
        scratch = byte_buffer(nbytes) if dst is None else dst
        started = time.perf_counter()
        # Every range runs to its end before a failure is raised: nothing keeps writing
        # into the buffer after this returns.
        results = await asyncio.gather(*(
            self._fetch_range(key, scratch, offset, length, nbytes,
                              sources[i % len(sources):] + sources[:i % len(sources)],
                              addrs, counters, limit)
            for i, (offset, length) in enumerate(
                _fetch_ranges(nbytes, len(sources), streams))),
            return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                raise r
        parts = [r for r in results if not isinstance(r, BaseException)]
        got = _core.hash_root(b"".join(p for p, _ in parts), nbytes)
        used = sorted({src for _, srcs in parts for src in srcs})
        if got == want:
            self._log_fetched(repr(key), nbytes, started, used)
            return scratch
        errors = [f"peers {used}: content hash mismatch (got {got.hex()[:16]}..., "
                  f"expected {want.hex()[:16]}...)"]
        for k in [k for k in counters if k[0] == key]:
            del counters[k]  # the whole-tensor attempts below count afresh
        for src in sources:
            started = time.perf_counter()
            try:
                digests, _ = await self._fetch_range(key, scratch, 0, nbytes, nbytes, [src],
                                                     addrs, counters, limit)
            except PCCLError as e:
                errors.append(str(e))
                continue
            got = _core.hash_root(digests, nbytes)
            if got == want:
                self._log_fetched(repr(key), nbytes, started, [src])
                return scratch
            errors.append(f"peer {src}: content hash mismatch (sent {got.hex()[:16]}..., "
                          f"expected {want.hex()[:16]}...)")
        raise _core.PeerConnectionError(
            f"could not fetch shared state {key!r} from any source: {'; '.join(errors)}")

    async def _fetch_range(self, key: str, scratch: Any, offset: int, length: int,
                           total: int, order: list[int], addrs: dict[int, str],
                           counters: dict[tuple[str, int], tuple[int, Any]],
                           limit: asyncio.Semaphore) -> tuple[bytes, list[int]]:
        """Fetches bytes ``offset..offset + length`` from the holders in ``order``: when
        one fails, the next continues after the whole hash leaves that already landed
        (their digests are computed from what landed; the content hash of the tensor
        still checks every byte). Returns the range's leaf digests and the holders that
        delivered parts of it."""
        errors = []
        done, head, used = 0, b"", []  # bytes of whole leaves landed so far, their digests
        for src in order:
            start = offset + done
            counter = _core.ByteCounter()
            counters[(key, offset)] = (done, counter)
            async with limit:
                try:
                    digests = await self._node.fetch_into(
                        addrs[src], src, key, scratch[start:offset + length], offset=start,
                        total=total, io_timeout=self.peer_timeout, counter=counter)
                except PCCLError as e:
                    errors.append(f"peer {src}: {e}")
                    whole = counter.value // _LEAF * _LEAF
                    if whole:
                        head += _core.leaf_digests(scratch[start:start + whole], start // _LEAF)
                        done += whole
                        used.append(src)
                    continue
            return head + bytes(digests), [*used, src]
        raise _core.PeerConnectionError(
            f"could not fetch bytes {offset}..{offset + length} of shared state {key!r}: "
            f"{'; '.join(errors)}")

    def _log_fetched(self, what: str, nbytes: int, started: float, sources: list[int]) -> None:
        elapsed = time.perf_counter() - started
        log.info("peer %s: fetched shared state %s (%.1f MiB) from peer(s) %s in %.2fs "
                 "(%.2f GB/s)", self.peer_id, what, nbytes / 2**20, sources, elapsed,
                 nbytes / max(elapsed, 1e-9) / 1e9)


def _prefault_all(buffers: list[Any]) -> None:
    """Best effort: an optimization must never fail a sync."""
    for b in buffers:
        try:
            _core.prefault(b)
        except Exception as e:  # noqa: BLE001 (nothing to recover; the commit faults pages in)
            log.debug("prefault skipped: %s", e)


#: Fetches (streams) one sync keeps in flight at once.
MAX_FETCHES_IN_FLIGHT = 16
#: Tensors of at least twice this size are fetched in ranges over several streams at once.
RANGE_BYTES = 32 << 20
_LEAF = 1 << 20  # ranges start on hash leaves (pccl._core's tree hash)


#: Small tensors fetched over one stream with their requests pipelined, at most.
BATCH_TENSORS = 64


def _batches(wanted: list[tuple[str, bytes, list[int]]],
             streams: int) -> list[list[tuple[str, bytes, list[int]]]]:
    """Groups small tensors by their first source (the master spreads those) into
    batches of at most :data:`BATCH_TENSORS`, at least ``streams`` per source while
    there are tensors for them (several streams keep a per-connection cap from limiting
    the sync)."""
    by_source: dict[int, list[tuple[str, bytes, list[int]]]] = {}
    for w in wanted:
        by_source.setdefault(w[2][0], []).append(w)
    out = []
    for ws in by_source.values():
        count = max(-(-len(ws) // BATCH_TENSORS), min(len(ws), streams))
        out += [ws[i::count] for i in range(count)]
    return out


def _fetch_ranges(nbytes: int, holders: int, streams: int = 1) -> list[tuple[int, int]]:
    """(offset, length) ranges of a tensor, fetched at once (range i from holder
    i mod ``holders``): at least ``streams`` of them, rounded up to a multiple of the
    holders so each serves as many, and no more than leaves each about
    :data:`RANGE_BYTES` or more; each starts on a hash leaf. One range for small
    tensors."""
    want = holders * -(-max(streams, 1) // holders)
    parts = max(1, min(want, nbytes // RANGE_BYTES))
    if parts == 1:
        return [(0, nbytes)]
    leaves = -(-nbytes // _LEAF)
    per = -(-leaves // parts) * _LEAF
    return [(a, min(per, nbytes - a)) for a in range(0, nbytes, per)]


class _SyncReporter:
    """Reports a running sync's progress to a callback and, for long transfers, to the
    log; an owned task from the master's plan until the outcome (``async with``)."""

    LOG_EVERY = 10.0

    def __init__(self, comm: Communicator, callback: Callable[[SyncProgress], object] | None,
                 interval: float, served_before: int,
                 counters: dict[tuple[str, int], tuple[int, Any]],
                 fetched: dict[str, Any], sizes: list[int]) -> None:
        self._comm, self._callback = comm, callback
        self._interval = max(float(interval), 0.01)
        self._served_before = served_before
        self._counters, self._fetched = counters, fetched
        self._rx_total, self._tensors = sum(sizes), len(sizes)
        self._started = time.perf_counter()
        self._task: asyncio.Task[None] | None = None

    def snapshot(self, final: bool = False) -> SyncProgress:
        node = self._comm._node
        tx = int(node.bytes_served() - self._served_before) if node is not None else 0
        return SyncProgress(
            rx_bytes=sum(base + c.value for base, c in list(self._counters.values())),
            rx_total=self._rx_total, tx_bytes=tx, tensors_done=len(self._fetched),
            tensors_total=self._tensors, seconds=time.perf_counter() - self._started,
            final=final)

    def _emit(self, final: bool = False) -> SyncProgress:
        p = self.snapshot(final)
        if self._callback is not None:
            try:
                self._callback(p)
            except Exception:
                log.exception("peer %s: the sync progress callback failed; not calling it "
                              "again", self._comm.peer_id)
                self._callback = None
        return p

    async def _run(self) -> None:
        logged = 0.0
        while True:
            await asyncio.sleep(self._interval)
            p = self._emit()
            if p.rx_total and p.seconds - logged >= self.LOG_EVERY:
                logged = p.seconds
                log.info("peer %s: shared-state sync: %.1f of %.1f MiB fetched, %d/%d "
                         "tensors, %.1fs (%.2f GB/s)", self._comm.peer_id,
                         p.rx_bytes / 2**20, p.rx_total / 2**20, p.tensors_done,
                         p.tensors_total, p.seconds, p.rx_bytes / max(p.seconds, 1e-9) / 1e9)

    async def __aenter__(self) -> _SyncReporter:
        self._emit()
        self._task = asyncio.get_running_loop().create_task(self._run())
        return self

    async def __aexit__(self, et: type[BaseException] | None, e: BaseException | None,
                        tb: TracebackType | None) -> None:
        assert self._task is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self._emit(final=True)
