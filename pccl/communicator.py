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
import logging
from collections.abc import Callable, Mapping, Sequence
from types import TracebackType
from typing import Any

from pccl import _core, config, identity, recovery, staging
from pccl.enums import (
    Attribute,
    DataType,
    QuantizationAlgorithm,
    ReduceOp,
    SharedStateSyncStrategy,
)
from pccl.errors import (
    InvalidUsageError,
    MasterConnectionError,
)
from pccl.peer import state as ps
from pccl.peer.dataplane import DataPlane
from pccl.peer.driver import Driver
from pccl.peer.metrics import PeerMetrics
from pccl.peer.options import (
    DEFAULT_TIMEOUT,
    GatherInfo,
    OptionView,
    PeerOptions,
    QuantizationOptions,
    ReduceDescriptor,
    ReduceInfo,
    check_int,
    check_quantization,
)
from pccl.peer.pause import PauseWatch
from pccl.peer.state import Status as PeerState
from pccl.protocol import MAX_FRAME, PROTOCOL_VERSION
from pccl.protocol import messages as m
from pccl.protocol.auth import DEFAULT_PORT, is_loopback_host, split_host_port
from pccl.protocol.messages import GATHER_PROTOCOL
from pccl.protocol.transport import ConnectionClosed, FramedConnection
from pccl.shared_state import SharedState, SyncInfo, SyncProgress
from pccl.tensors import RawTensor, as_raw

__all__ = ["DEFAULT_TIMEOUT", "Communicator", "PeerState", "QuantizationOptions",
           "GatherInfo", "ReduceDescriptor", "ReduceInfo"]

log = logging.getLogger(__name__)


#: How long close() waits, at most, for the master to close its end after the Leave
#: (it does once it has read it; see FramedConnection.linger).
LEAVE_LINGER = 2.0


@config.register
class Communicator(Driver):
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

    Every p2p stream (ring links, shared-state transfers, bandwidth probes) is encrypted
    and integrity-protected (Noise, AES-GCM; keyed by ``secret`` when there is one, which
    then also authenticates the peers). ``insecure=True`` sends them in clear text
    instead (trusted networks only); every peer of a run must use the same setting: a
    peer that differs from its neighbour fails the handshake with
    :class:`AuthenticationError` (its ring links are not established). The connection
    to the master is encrypted the same way; a master refuses a clear-text peer unless
    it was started with ``insecure=True``. ``secret`` may be a path
    (``pathlib.Path``, or ``PCCL_SECRET_FILE``): the file is read again when it
    changes, and its new content becomes the secret (a rotation: the previous secret is
    still accepted for an hour; see :meth:`rotate_secret`).

    Peers behind NAT need no port forwarding: the master checks whether each peer's
    p2p address can be dialed and, for a ring link to a peer that cannot, has that peer
    dial its neighbour instead; where neither end can be dialed, the link goes through
    the master's relay (slow: every byte crosses the master twice; still encrypted end
    to end). ``allow_relay=False`` refuses that: such a peer's ring links must be
    direct, or it is dropped from the round with an error that says why.

    When the connection to the master is lost (the master process died, or dropped
    this peer), calls in flight fail with :class:`MasterConnectionError` and the peer
    keeps trying to register again, with back-off, for up to ``reconnect_timeout``
    seconds (0 disables this). It says what it held (its peer id, ring epoch, last
    synced revision and ring), so a restarted master re-forms the group from the peers.
    Calls made meanwhile wait for that (``all_reduce_async``, which cannot wait, raises
    :class:`MasterConnectionError`); once the time is up, every call raises it.

    ``master`` may name several masters (a list, or one string with commas), e.g. an
    active ``pccl-master --quorum`` and a ``pccl-master --standby``: the peer registers
    with the one that holds its group and fails over to another by itself; quorums of
    the previous ring keep two masters from both running the group (docs/semantics.md,
    "Several masters").

    The settings (every parameter but ``secret``, ``key_file``, ``cert_file`` and
    ``trust``) are checked once and kept in ``comm.options``, a frozen
    :class:`pccl.peer.options.PeerOptions`; each reads as an attribute too
    (``comm.timeout``, ``comm.masters``), read-only. ``options`` itself is a plain
    attribute: ``comm.options = dataclasses.replace(comm.options, via_master_max_bytes=0)``
    changes what later calls read (the new values are checked alike); what ``connect()``
    set up from them (the p2p listener, the metrics server) stays as it was.
    """

    def __init__(
        self,
        master: str | Sequence[str] = f"127.0.0.1:{DEFAULT_PORT}",
        peer_group: int = 0,
        p2p_connection_pool_size: int = 4,
        secret: identity.SecretSource = None,
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
        reconnect_timeout: float = 600.0,
        collective_timeout: float | None = 1800.0,
        insecure: bool = False,
        allow_relay: bool = True,
        metrics_listen: str | None = None,
        metrics_token: str | None = None,
        early_start_max_bytes: int = 4 << 20,
        via_master_max_bytes: int = 64 << 10,
        key_file: str | None = None,
        cert_file: str | None = None,
        trust: str | None = None,
        allow_anonymous: bool = False,
        name: str | None = None,
        run_id: str | None = None,
    ) -> None:
        # Every setting, checked once (a plain attribute: see the class docstring).
        self.options = PeerOptions(
            master=master, peer_group=peer_group,
            p2p_connection_pool_size=p2p_connection_pool_size,
            p2p_listen_host=p2p_listen_host, p2p_listen_port=p2p_listen_port,
            p2p_advertise_host=p2p_advertise_host, p2p_advertise_address=p2p_advertise_address,
            timeout=timeout, p2p_timeout=p2p_timeout, peer_timeout=peer_timeout,
            piece_bytes=piece_bytes, max_frame=max_frame, reconnect_timeout=reconnect_timeout,
            collective_timeout=collective_timeout, insecure=insecure, allow_relay=allow_relay,
            metrics_listen=metrics_listen, metrics_token=metrics_token,
            early_start_max_bytes=early_start_max_bytes,
            via_master_max_bytes=via_master_max_bytes, allow_anonymous=allow_anonymous,
            name=name, run_id=run_id)
        masters = self.options.masters
        self._master_addr = masters[0]  # the one in use (or tried last)
        self._elsewhere: str | None = None  # the last one to send this peer elsewhere
        # (A path: the file is re-read when it changes, a rotation: identity.Secrets.)
        self.secrets = identity.Secrets(secret)
        self.secret = self.secrets.current
        # This peer's static key (and certificate), and the run keys whose certificates
        # it asks of the master and of every other peer; without them, a fresh key.
        self.identity = identity.load(key_file, cert_file, trust)
        if self.secret is None and not self.identity.checks_certs and not allow_anonymous:
            remote = [a for a in masters if not is_loopback_host(split_host_port(a)[0])]
            if remote:
                raise _core.InvalidUsageError(
                    f"Communicator(master={remote[0]!r}): a master on another machine, "
                    "and nothing to authenticate it (no secret, no trusted run key): "
                    "anyone on the path could stand in for it. Give every node the run's "
                    "secret (secret= / PCCL_SECRET_FILE) or a certificate (key_file=, "
                    "cert_file=, trust=; docs/security.md), or opt out with "
                    "allow_anonymous=True")

        self._m = ps.PeerMachine(reconnect=self.options.reconnect_timeout > 0)
        # This peer's counters (heartbeats carry them to the master; metrics_listen
        # serves them as Prometheus metrics).
        self.metrics = PeerMetrics()
        self._m.traffic = self.metrics.heartbeat
        self._metrics_server: Any = None  # a MetricsServer while metrics_listen serves
        self._conn: FramedConnection | None = None
        self._node: _core.P2PNode | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._reader: asyncio.Task[None] | None = None
        # all_reduce_async() handles not finished yet (close() settles them).
        self._handles: set[asyncio.Task[Any]] = set()
        self._staged_tags: set[int] = set()  # user tags of staged (device) all-reduces
        # The event loop connect() ran in: every call must come from it (see _check_loop).
        self._home_loop: asyncio.AbstractEventLoop | None = None
        self._heartbeat_timeout = 5.0
        # Ticked while connected: tells a pause of this process from a lost master.
        self._pauses: PauseWatch | None = None
        # One future per waiting call (pccl.peer.state.Waiter); the machine answers them.
        self._waiters: dict[ps.Waiter, asyncio.Future[Any]] = {}
        # Carries out the machine's data-plane commands on the calls' tensors.
        self._plane = DataPlane(self)
        # The control-plane protocol of the master this peer registered with last.
        self._master_protocol = PROTOCOL_VERSION

    # --- the settings, read-only (each reads ``self.options``) --------------------------

    master = OptionView(lambda o: o.master)
    masters = OptionView(lambda o: o.masters)
    peer_group = OptionView(lambda o: o.peer_group)
    p2p_connection_pool_size = OptionView(lambda o: o.p2p_connection_pool_size)
    p2p_listen_host = OptionView(lambda o: o.p2p_listen_host)
    p2p_listen_port = OptionView(lambda o: o.p2p_listen_port)
    p2p_advertise_host = OptionView(lambda o: o.p2p_advertise_host)
    p2p_advertise_address = OptionView(lambda o: o.p2p_advertise_address)
    timeout = OptionView(lambda o: o.timeout)
    p2p_timeout = OptionView(lambda o: o.p2p_timeout)
    peer_timeout = OptionView(lambda o: o.peer_timeout)
    piece_bytes = OptionView(lambda o: o.piece_bytes)
    max_frame = OptionView(lambda o: o.max_frame)
    reconnect_timeout = OptionView(lambda o: o.reconnect_timeout)
    collective_timeout = OptionView(lambda o: o.collective_timeout)
    insecure = OptionView(lambda o: o.insecure)
    allow_relay = OptionView(lambda o: o.allow_relay)
    metrics_listen = OptionView(lambda o: o.metrics_listen)
    metrics_token = OptionView(lambda o: o.metrics_token)
    early_start_max_bytes = OptionView(lambda o: o.early_start_max_bytes)
    via_master_max_bytes = OptionView(lambda o: o.via_master_max_bytes)
    allow_anonymous = OptionView(lambda o: o.allow_anonymous)
    name = OptionView(lambda o: o.name)
    run_id = OptionView(lambda o: o.run_id)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> Communicator:
        """A Communicator configured from environment variables, keyword arguments winning.

        ``env`` is a ``Mapping[str, str]`` (default: ``os.environ``). Every parameter of
        the constructor has a variable: ``PCCL_MASTER``, ``PCCL_PEER_GROUP`` (a number, or
        ``local_rank``: the launcher's local rank from ``LOCAL_RANK``, ``SLURM_LOCALID``
        or ``OMPI_COMM_WORLD_LOCAL_RANK``), ``PCCL_SECRET`` or ``PCCL_SECRET_FILE``,
        ``PCCL_P2P_PORT`` (a port, or ``BASE+local_rank``), ``PCCL_POOL_SIZE``,
        ``PCCL_TIMEOUT``, ... (:mod:`pccl.config` has the rules and the table). A value
        that cannot be read raises :class:`InvalidArgumentError` naming the variable; an
        unknown keyword raises ``TypeError``, as the constructor does.

        Example::

            comm = pccl.Communicator.from_env({"PCCL_MASTER": "10.0.0.5:48148",
                                                "PCCL_PEER_GROUP": "local_rank",
                                                "LOCAL_RANK": "1"})
            assert (comm.master, comm.peer_group) == ("10.0.0.5:48148", 1)
        """
        return config.from_env(cls, env, **overrides)

    # --- the machine's state, read-only -------------------------------------------------

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
        check_int(n_attempts, "n_attempts", 1, 1 << 20)
        self._home_loop = asyncio.get_running_loop()
        try:
            if self.options.metrics_listen is not None:
                # aiohttp is imported only by peers that serve metrics.
                from pccl.observe.server import MetricsServer

                self._metrics_server = MetricsServer(self.metrics.registry,
                                                    self.options.metrics_listen,
                                                    self.options.metrics_token)
                await self._metrics_server.start()
            delay = 0.05
            for attempt in range(n_attempts):
                await self._open(n_attempts)
                try:
                    await self._waiters[ps.ACCEPT]
                    break
                except MasterConnectionError:
                    # A master that cannot take this peer's group on (a standby before the
                    # run has a group, or no quorum there) sends it to the others: try
                    # again, that one last (``_elsewhere``), with back-off, up to
                    # n_attempts times.
                    if self._elsewhere != self._master_addr or len(self.options.masters) == 1 \
                            or attempt + 1 == n_attempts:
                        raise
                    assert self._conn is not None
                    await self._drop_conn(self._conn)
                    await asyncio.sleep(delay)  # back-off, not a synchronisation
                    delay = min(delay * 2, 2.0)
            self._elsewhere = None
        except BaseException:
            await self.close()
            raise


    def rotate_secret(self, secret: bytes | str) -> None:
        """Makes ``secret`` the run's secret for this peer from now on: it registers
        and dials with it, and still accepts (and offers) the previous one for an hour
        (``pccl.identity.ROTATION_GRACE``), so peers can change secrets one at a time:
        two nodes agree on any secret both hold. A peer given its secret as a file does
        this by itself when the file changes (docs/security.md, "Rotating the secret")."""
        if self.secrets.rotate(secret):
            self._use_secrets()

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
            # The master must read the Leave: closed at once while it still writes to
            # this peer, the connection breaks on its side and the Leave is lost with
            # it (a graceful leave then counts as a loss, which quorums feel).
            await conn.linger(min(self.options.timeout, LEAVE_LINGER))
        if self._node is not None:
            node, self._node = self._node, None
            await node.close()
        if self._metrics_server is not None:
            metrics_server, self._metrics_server = self._metrics_server, None
            await metrics_server.stop()
        if handles:
            # all_reduce_async() handles still pending fail with MasterConnectionError
            # ("closed"). A caller may still await them and get that; one that dropped
            # them gets no "Task exception was never retrieved" noise at exit.
            await asyncio.wait(handles, timeout=self.options.timeout)
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


    # --- the master connection ----------------------------------------------------------


    # --- the data plane's side of membership -------------------------------------------


    # --- membership -----------------------------------------------------------------


    async def update_topology(self, *, timeout: Any = DEFAULT_TIMEOUT) -> None:
        """Collective over all accepted peers: admits pending joiners, drops dead peers
        and (re)builds the p2p rings. Returns when every peer's pools are up.

        ``timeout``: seconds to wait for every accepted peer to call it too (default:
        the Communicator's ``collective_timeout``; ``None``: no limit); past it the call
        fails on every peer that made it with :class:`OperationTimeoutError`."""
        await self._topology(False, timeout)

    async def optimize_topology(self, *, timeout: Any = DEFAULT_TIMEOUT) -> None:
        """Collective over all accepted peers: measure the bandwidth between peers of
        each group (over as many parallel streams as the ring uses) and their latency
        (the probes' dials), solve for the ring with the best bottleneck link (within
        10%, the one with the least latency round it: peers in regions are visited
        region by region), and rebuild the rings in that order.

        A peer lost meanwhile fails the call on everyone with
        :class:`TopologyOptimizationFailedError`; the previous rings stay. ``timeout`` as
        in :meth:`update_topology`.
        """
        await self._topology(True, timeout)


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
        touched until the awaitable resolves (the ring writes results into them as it
        goes). On failure the input holds exactly what it held before (in place, its
        original bytes are put back); an ``out`` buffer holds unspecified bytes. ``timeout``
        bounds the wait for the other peers to start the same collective (default: the
        Communicator's ``collective_timeout``): past it, it fails on every peer with
        :class:`OperationTimeoutError`. When a peer of the group is lost, the master
        rebuilds the ring from the others; a collective started meanwhile waits for that
        and runs on the new ring (``ReduceInfo.world_size`` says how many took part).

        A torch CUDA tensor (with ``out`` on the same device, if any) is staged through
        pinned host buffers piece by piece, copies and collectives overlapped, with the
        same all-or-nothing outcome (:mod:`pccl.staging`; docs/semantics.md, "CUDA
        tensors"). Tags from ``2**63`` up are pccl's own.

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
        tag = self._user_tag(tag)
        q = quantization or QuantizationOptions()
        device = staging.device_of(tensor)
        if device is not None or (out is not None and staging.device_of(out) is not None):
            return self._staged_all_reduce(device, tensor, out, op, tag, q, wire)
        src = as_raw(tensor, writable=out is None, what="tensor")
        dst = src if out is None else as_raw(out, writable=True, what="out")
        if dst.dtype != src.dtype or dst.count != src.count:
            raise _core.InvalidArgumentError(
                f"out has {dst.count} x {dst.dtype.name}, tensor {src.count} x {src.dtype.name}")
        if q.algorithm != QuantizationAlgorithm.NONE:
            check_quantization(q, src, op)
        return self._launch_all_reduce(src, dst, op, tag, q, wire)

    def _user_tag(self, tag: Any) -> int:
        """``tag`` if a caller may start a collective under it now: a user tag
        (:func:`pccl.staging.check_user_tag`) no staged call of this peer holds."""
        checked = staging.check_user_tag(tag)
        if checked in self._staged_tags:
            raise InvalidUsageError(f"tag {checked} is already in flight on this peer")
        return checked

    def _launch_all_reduce(self, src: RawTensor, dst: RawTensor, op: ReduceOp, tag: int,
                           q: QuantizationOptions, wire: float) -> asyncio.Task[ReduceInfo]:
        """The all-reduce of host memory, checked: hands it to the machine now."""
        tiny = (src.nbytes <= self.options.via_master_max_bytes
                and q.algorithm == QuantizationAlgorithm.NONE)
        data = bytes(src.data) if tiny else b""
        run = self._start_all_reduce(m.CollectiveInit(
            tag=tag, kind="all_reduce", dtype=int(src.dtype), count=src.count, op=int(op),
            quant_algorithm=int(q.algorithm), quant_dtype=int(q.dtype), timeout=wire,
            shape=list(src.shape), data=data), src.nbytes <= self.options.early_start_max_bytes,
            q, src, dst, op)
        handle = asyncio.create_task(self._run_all_reduce(tag, run),
                                     name=f"pccl-all-reduce-{self.peer_id}-{tag}")
        self._handles.add(handle)
        handle.add_done_callback(self._handles.discard)
        return handle

    def _staged_all_reduce(self, device: staging.Device | None, tensor: Any, out: Any,
                           op: ReduceOp, tag: int, q: QuantizationOptions,
                           wire: float) -> asyncio.Task[ReduceInfo]:
        """An all-reduce of device memory (CUDA), staged through pinned host buffers
        piece by piece (:mod:`pccl.staging`)."""
        out_device = staging.device_of(out) if out is not None else None
        if device is None or (out is not None and out_device is None):
            raise _core.InvalidArgumentError(
                "tensor and out must both be in host memory or both on the same device; "
                f"tensor is on {device.name if device else 'the host'}, out on "
                f"{out_device.name if out_device else 'the host'}")
        if tag in self._plane.reduces:
            raise InvalidUsageError(f"tag {tag} is already in flight on this peer")
        src = device.tensor(tensor, "tensor")
        dst = None if out is None else device.tensor(out, "out")
        if dst is not None and (dst.dtype != src.dtype or dst.count != src.count):
            raise _core.InvalidArgumentError(
                f"out has {dst.count} x {dst.dtype.name}, tensor {src.count} x {src.dtype.name}")
        if dst is not None and getattr(tensor, "device", None) != getattr(out, "device", None):
            raise _core.InvalidArgumentError(
                f"tensor is on {tensor.device}, out on {out.device}; use one device")
        if q.algorithm != QuantizationAlgorithm.NONE:
            check_quantization(q, RawTensor(b"", src.dtype, src.count, tensor), op)
        staging.piece_tag(tag, 0)  # (a tag too large for piece tags fails now)
        late_timeout = self.options.peer_timeout if not wire else min(
            wire, self.options.peer_timeout)

        async def reduce(index: int, data: Any, dtype: DataType, count: int, *, vote: bool,
                         late: bool) -> ReduceInfo:
            raw = RawTensor(data=data, dtype=dtype, count=count, owner=data, shape=(count,))
            return await self._launch_all_reduce(
                raw, raw, ReduceOp.MAX if vote else op, staging.piece_tag(tag, -1 if vote
                                                                          else index),
                QuantizationOptions() if vote else q, late_timeout if late else wire)

        handle = asyncio.create_task(staging.staged_all_reduce(device, src, dst, reduce),
                                     name=f"pccl-staged-all-reduce-{self.peer_id}-{tag}")
        self._staged_tags.add(tag)
        self._handles.add(handle)
        handle.add_done_callback(self._handles.discard)
        handle.add_done_callback(lambda _: self._staged_tags.discard(tag))
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


    # --- all-gather -------------------------------------------------------------------

    def all_gather_async(self, tensor: Any, *, tag: int = 0,
                         timeout: Any = DEFAULT_TIMEOUT) -> asyncio.Task[GatherInfo]:
        """Starts an all-gather now and returns an awaitable for its :class:`GatherInfo`:
        every peer of the group contributes ``tensor`` (a C-contiguous buffer: numpy,
        torch CPU tensor, bytes, ...; the same dtype and element count on every peer) and
        receives every peer's bytes, concatenated in the order of the ring it ran on
        (``GatherInfo.peers`` names each slot's peer), the same on every peer. Tags are
        shared with :meth:`all_reduce_async` (one collective per tag at a time).

        The bytes travel on the ring (each peer sends and receives ``world - 1``
        contributions: the least any schedule moves) with everything an all-reduce has:
        all or nothing, typed errors, encryption, relayed routes, a retry after
        ``update_topology()`` when a peer died, concurrency with other tags. A gather
        whose whole result is at most ``via_master_max_bytes`` goes through the master
        instead (one round trip rather than ``world - 1`` ring steps). ``tensor`` is only
        read; do not write it until the awaitable resolves.

        Example::

            info = await comm.all_gather(np.array([comm.rank], np.int64))
            ranks = np.frombuffer(info.data, np.int64)   # one per peer, ring order
        """
        wire = self._wire_timeout(timeout)
        self._require_accepted()
        src = as_raw(tensor, writable=False, what="tensor")
        tag = self._user_tag(tag)
        if self._master_protocol < GATHER_PROTOCOL:
            raise InvalidUsageError(
                f"all_gather needs a master of protocol {GATHER_PROTOCOL} or newer; this "
                f"one speaks {self._master_protocol}: upgrade pccl on the master")
        world = max(1, len(self._m.ring))
        tiny = src.nbytes * world <= self.options.via_master_max_bytes
        run = self._start_all_reduce(m.CollectiveInit(
            tag=tag, kind="all_gather", dtype=int(src.dtype), count=src.count,
            op=int(ReduceOp.SUM), quant_algorithm=0, quant_dtype=0, timeout=wire,
            shape=list(src.shape), data=bytes(src.data) if tiny else b""),
            src.nbytes * world <= self.options.early_start_max_bytes,
            QuantizationOptions(), src, src, ReduceOp.SUM, gather=True)
        handle = asyncio.create_task(self._run_all_gather(tag, run),
                                     name=f"pccl-all-gather-{self.peer_id}-{tag}")
        self._handles.add(handle)
        handle.add_done_callback(self._handles.discard)
        return handle

    async def all_gather(self, tensor: Any, *, tag: int = 0,
                         timeout: Any = DEFAULT_TIMEOUT) -> GatherInfo:
        """Gathers every peer's ``tensor`` on every peer (see :meth:`all_gather_async`).

        Example::

            info = await comm.all_gather(payload)
            for peer_id in info.peers:      # in slot (ring) order
                handle(peer_id, info.of(peer_id))
        """
        await self._ready()
        return await self.all_gather_async(tensor, tag=tag, timeout=timeout)

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
        return await recovery.all_reduce_with_retry(self, descriptors, max_in_flight,
                                                   max_attempts)

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
        return await self._run_sync(state, strategy, in_place, progress, progress_interval,
                                    timeout)


