"""The asyncio server around the master's state machine.

It owns the sockets, the handshake (with the optional HMAC challenge), heartbeats and
timeouts; everything else is decided by :class:`pccl.master.state.MasterState`.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import errno
import hmac
import logging
import os
import resource
import secrets as _secrets
import socket
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

from pccl import _core, config
from pccl import identity as ident
from pccl.errors import (
    AuthenticationError,
    ErrorKind,
    IdentityError,
    InvalidArgumentError,
    InvalidUsageError,
    PCCLError,
    PeerConnectionError,
    ProtocolError,
)
from pccl.master import admin, status
from pccl.master import state as st
from pccl.master.admission import MAX_KEPT_ID, Budget, Registration, admit, source_key
from pccl.protocol import MIN_PROTOCOL_VERSION, PROTOCOL_VERSION
from pccl.protocol import messages as m
from pccl.protocol.auth import (
    DEFAULT_PORT,
    is_loopback_host,
    join_host_port,
    master_mac,
    peer_mac,
    split_host_port,
)
from pccl.protocol.codec import PRE_HELLO_MAX_FRAME, FrameCache
from pccl.protocol.transport import (
    REACH_PROLOGUE,
    ConnectionClosed,
    FramedConnection,
    accept,
)

if TYPE_CHECKING:
    from pccl.master.status_server import StatusServer

#: First bytes of the master's reachability check on a peer's p2p port, and of a
#: relayed stream on the master's port (``rust/net/node/``).
REACH_MAGIC = b"PCCLRCH\x01"
RELAY_MAGIC = b"PCCLRLY\x01"
_PATHS = {
    "lan": "dialed on their LAN (both ends are behind the same NAT; over their public "
           "addresses if that fails)",
    "reverse": "dialed in reverse (the receiver is behind NAT and dials the sender)",
    "relay": "relayed through this master (both ends are behind NAT)",
    "punch": "hole-punched (both ends are behind NAT; through this master's relay if "
             "that fails and both allow it)",
}

log = logging.getLogger(__name__)

# Echo round trips a ``pccl doctor`` connection may ask for, and the largest echo.
DOCTOR_ECHOES = 32
DOCTOR_MAX_ECHO = 8 << 20
# A peer that does not read its control messages is dropped past this much backlog.
MAX_WRITE_BACKLOG = 64 * 1024 * 1024
#: Largest frame from a registered peer (a tiny all-reduce's bytes are at most 1 MiB,
#: a shared state's description ~100 bytes a tensor).
PEER_MAX_FRAME = 4 << 20
#: Relay streams whose other end has not come yet, per route token (a link's pool has
#: at most 64 streams).
RELAY_WAITING_PER_TOKEN = 64


def _positive(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not 0.0 < float(value) < float("inf"):
        raise InvalidArgumentError(f"MasterNode({name}=...) must be a positive number of "
                                   f"seconds, got {value!r}")
    return float(value)


async def _listen(host: str, port: int) -> list[socket.socket]:
    """Listening sockets for ``host:port`` (one per address family it resolves to, as
    asyncio.start_server makes them), non-blocking, with a backlog for hundreds of peers
    connecting at once (the default of 100 drops SYNs)."""
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    socks: list[socket.socket] = []
    try:
        for family, kind, proto, _, addr in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            socks.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(addr)
            sock.listen(4096)
            sock.setblocking(False)
    except BaseException:
        for sock in socks:
            sock.close()
        raise
    return socks


@config.register
class MasterNode:
    """The run's coordinator. Holds no tensor data; peers only exchange votes with it.

    Example::

        async with pccl.MasterNode(listen="127.0.0.1:0") as master:
            print(master.address)      # give this to the peers
            await master.serve_forever()
    """

    def __init__(
        self,
        listen: str = f"0.0.0.0:{DEFAULT_PORT}",
        secret: ident.SecretSource = None,
        *,
        heartbeat_interval: float = 1.0,
        heartbeat_timeout: float = 5.0,
        handshake_timeout: float = 5.0,
        max_frame: int = PEER_MAX_FRAME,
        max_establish_attempts: int = 3,
        recovery_grace: float = 5.0,
        establish_timeout: float = 60.0,
        repair_rings: bool = True,
        insecure: bool = False,
        dial_back_timeout: float = 2.0,
        max_relayed_streams: int = 256,
        max_connections: int | None = None,
        mesh_max_bytes: int = -1,
        quorum: bool | None = None,
        standby: bool = False,
        status_listen: str | None = None,
        status_token: str | None = None,
        key_file: str | None = None,
        cert_file: str | None = None,
        trust: str | None = None,
        denylist: str | None = None,
        allow_anonymous: bool = False,
        run_id: str | None = None,
        state_dir: str | None = None,
        secret_grace: float = ident.ROTATION_GRACE,
        admin_socket: str | None = None,
    ) -> None:
        for name, value in (("heartbeat_interval", heartbeat_interval),
                            ("heartbeat_timeout", heartbeat_timeout),
                            ("handshake_timeout", handshake_timeout),
                            ("recovery_grace", recovery_grace),
                            ("establish_timeout", establish_timeout),
                            ("dial_back_timeout", dial_back_timeout)):
            _positive(name, value)
        if heartbeat_timeout <= heartbeat_interval:
            raise InvalidArgumentError(
                f"MasterNode(heartbeat_timeout={heartbeat_timeout}) must exceed "
                f"heartbeat_interval={heartbeat_interval}")
        if isinstance(max_establish_attempts, bool) or not isinstance(
                max_establish_attempts, int) or max_establish_attempts < 1:
            raise InvalidArgumentError(
                f"MasterNode(max_establish_attempts=...) must be an integer >= 1, got "
                f"{max_establish_attempts!r}")
        split_host_port(listen)  # a malformed address fails here, not at start()
        if run_id is not None and (why := m.run_id_problem(run_id)) is not None:
            raise InvalidArgumentError(f"MasterNode(run_id=...) {why}")
        # The run this master serves: a peer must say the same one (both unset is a
        # match too), or it is refused before it can join a group.
        self.run_id = run_id
        # Where the master keeps what should outlive it (the timeline, as JSONL); None:
        # nothing is kept.
        if state_dir is not None and (not isinstance(state_dir, str) or not state_dir):
            raise InvalidArgumentError(
                f"MasterNode(state_dir=...) must be a directory path, got {state_dir!r}")
        self.state_dir = state_dir
        # The local admin channel (pccl.master.admin): a Unix socket path, or None.
        if admin_socket is not None and (not isinstance(admin_socket, str)
                                         or not admin_socket):
            raise InvalidArgumentError(
                f"MasterNode(admin_socket=...) must be a file path, got {admin_socket!r}")
        self.admin_socket = admin_socket
        self._admin: admin.AdminServer | None = None
        # Keys the operator removed (the admin socket's `remove`), refused at
        # registration; kept in state_dir when there is one.
        self.bans = admin.BanList()
        self.listen = listen
        _positive("secret_grace", secret_grace)
        # The secret, and older ones still accepted after a rotation (a file given as
        # the secret is re-read when it changes: _check_secret_file).
        self.secrets = ident.Secrets(secret, grace=secret_grace)
        self.secret = self.secrets.current
        # This master's static key and certificate, and the run keys whose certificates
        # it asks of every peer (pccl.identity); without trust, a fresh key.
        self.identity = ident.load(key_file, cert_file, trust, denylist)
        # A signed denylist file, watched: a new version is handed to every peer and
        # the nodes it names are dropped (see _check_denylist_file).
        self.denylist = denylist
        if not isinstance(allow_anonymous, bool):
            raise InvalidArgumentError(
                f"MasterNode(allow_anonymous=...) must be a bool, got {allow_anonymous!r}")
        self.allow_anonymous = allow_anonymous
        host = split_host_port(listen)[0]
        if self.anonymous and not allow_anonymous and not is_loopback_host(host):
            raise InvalidUsageError(
                f"MasterNode(listen={listen!r}) is reachable from other machines, and "
                "nothing would authenticate who joins (no secret, no trusted run key): "
                "anyone could join the run, and anyone on the path could sit in the "
                "middle. Give every node a secret (`pccl secret new`, then --secret-file "
                "/ PCCL_SECRET_FILE) or node certificates (`pccl ca new`, docs/security.md), "
                "listen on 127.0.0.1, or opt out with allow_anonymous=True "
                "(--allow-anonymous)")
        # False: every control connection is encrypted (a clear-text peer is refused
        # with AuthenticationError); True: clear-text peers are accepted too.
        self.insecure = bool(insecure)
        self.heartbeat_interval = heartbeat_interval
        self.heartbeat_timeout = heartbeat_timeout
        self.handshake_timeout = handshake_timeout
        self.max_frame = max_frame
        # After a restart: how long to wait for the rest of an old group once one of its
        # peers has come back, before admitting whoever is there.
        self.recovery_grace = recovery_grace
        # A round of update_topology() whose members have not all reported their p2p
        # links by then treats the silent ones as unreachable.
        self.establish_timeout = establish_timeout
        # Each registering peer's advertised p2p address is dialed back (a reachability
        # check) for at most this long; a peer that cannot be dialed is "behind NAT" and
        # its ring links are made by routes that do not dial it (see routes.route in
        # pccl/master/state/).
        self.dial_back_timeout = dial_back_timeout
        # Ring-link streams the relay carries at once (each is two sockets here).
        if isinstance(max_relayed_streams, bool) or not isinstance(max_relayed_streams, int) \
                or max_relayed_streams < 0:
            raise InvalidArgumentError(
                f"MasterNode(max_relayed_streams=...) must be an integer >= 0 (0: no relay), "
                f"got {max_relayed_streams!r}")
        self.max_relayed_streams = max_relayed_streams
        # All-reduces up to this size run on the mesh (recursive doubling) instead of the
        # ring: -1 lets the cost model choose per group from k and the measured links
        # (pccl.algorithms.mesh_max_bytes), 0 turns the mesh off.
        if isinstance(mesh_max_bytes, bool) or not isinstance(mesh_max_bytes, int) \
                or mesh_max_bytes < -1:
            raise InvalidArgumentError(
                f"MasterNode(mesh_max_bytes=...) must be an integer >= -1 (-1: chosen by the "
                f"cost model, 0: no mesh), got {mesh_max_bytes!r}")
        # Split-brain protection (several masters): a new ring needs a strict majority of
        # the group's previous one. None: on once a peer says it has several masters.
        if quorum is not None and not isinstance(quorum, bool):
            raise InvalidArgumentError(
                f"MasterNode(quorum=...) must be True, False or None, got {quorum!r}")
        if not isinstance(standby, bool):
            raise InvalidArgumentError(f"MasterNode(standby=...) must be a bool, got {standby!r}")
        if standby and quorum is False:
            raise InvalidArgumentError("MasterNode(standby=True) counts quorums: it cannot "
                                       "have quorum=False")
        # The read-only status page, /api/status and /metrics (pccl/master/status.py): off
        # (None) unless given "host:port"; a non-loopback host needs status_token.
        if status_listen is not None:
            status.check_listen(status_listen, status_token)
        self.status_listen = status_listen
        self.status_token = status_token
        self._relay_waiting: dict[bytes, tuple[FramedConnection, asyncio.Future[Any]]] = {}
        # Relay streams (waiting or carried) per peer at either end: one peer, even one
        # holding valid tokens, cannot take the whole relay.
        self.max_relayed_per_peer = max(8, max_relayed_streams // 4)
        self._relay_held = Budget(1 << 30, self.max_relayed_per_peer)
        self.relayed_streams = 0  # carried now
        self.relayed_bytes = 0  # carried so far, both directions
        self._timed_epoch = -1
        self._round_timer_task: asyncio.Task[Any] | None = None
        # True (PCCL's behaviour): a ring that lost a peer is rebuilt by the master on its
        # own and collectives called meanwhile run on the new ring; False: they fail until
        # the peers call update_topology().
        self.state = st.MasterState(max_establish_attempts=max_establish_attempts,
                                    repair_rings=repair_rings,
                                    relay=max_relayed_streams > 0,
                                    mesh_max_bytes=mesh_max_bytes, quorum=quorum,
                                    standby=standby)
        self._deadlines: dict[int, asyncio.TimerHandle] = {}
        # The listening sockets while started (None: stopped), and their accept loops.
        self._server: list[socket.socket] | None = None
        self._accepting: list[asyncio.Task[None]] = []
        # Connections accepted and not yet closed, of every kind. At the cap the master
        # stops accepting: newcomers wait in the kernel's backlog (no descriptor here)
        # until one closes. None: the soft RLIMIT_NOFILE less 128 for the master's own
        # dials, files and the status server.
        if max_connections is not None and (isinstance(max_connections, bool) or not
                                            isinstance(max_connections, int)
                                            or max_connections < 1):
            raise InvalidArgumentError(f"MasterNode(max_connections=...) must be an integer "
                                       f">= 1 or None, got {max_connections!r}")
        self.max_connections = max_connections
        self._open = 0
        self._slot_free = asyncio.Event()
        self._conns: dict[int, FramedConnection] = {}
        self._handlers: set[asyncio.Task[None]] = set()
        self._heartbeat: asyncio.Task[None] | None = None
        self._denylist_stamp: int | None = None
        self._next_peer_id = 1
        # Ids handed to registrations still in their dial-back: nobody else gets them.
        self._claimed: set[int] = set()
        # What strangers can make the master hold before they register (see
        # pccl.master.admission): connections in the handshake, in all and per source
        # address, and pccl doctor sessions (each may ask for 8 MiB echoes). Attributes,
        # so that an operator (or a test) may change them before start().
        self.max_pending = 256
        self.max_pending_per_source = 32
        self.max_doctors = 4
        self._pending = Budget(self.max_pending, self.max_pending_per_source)
        self._doctors = Budget(self.max_doctors, 1)
        # When each kind of refusal was last warned about (_warn_rarely).
        self._warned: dict[str, float] = {}
        # Handshakes this master refused, by reason (pccl_handshakes_refused_total).
        self.refused_handshakes: collections.Counter[str] = collections.Counter()
        self._quorum_warned = False
        self._changed = asyncio.Event()
        self._address = ""
        self._stopped = asyncio.Event()
        # What the status page shows and the metrics count (it also logs the state's
        # notes at INFO, whether or not a status server runs).
        self.monitor = status.RunMonitor(self)
        self._status: StatusServer | None = None
        self.solver_budget = 1.0  # seconds the ring solver may take per group
        self.improve_steps = 100  # background improvement: steps of ~50 ms after solving

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> MasterNode:
        """A MasterNode configured from environment variables, keyword arguments winning.

        ``env`` is a ``Mapping[str, str]`` (default: ``os.environ``). Every parameter of
        the constructor has a variable: ``PCCL_MASTER_LISTEN``, ``PCCL_SECRET`` or
        ``PCCL_SECRET_FILE``, ``PCCL_STATUS_LISTEN``, ``PCCL_STATUS_TOKEN`` or
        ``PCCL_STATUS_TOKEN_FILE``, ``PCCL_HEARTBEAT_TIMEOUT``, ... (:mod:`pccl.config`
        has the rules and the table). ``pccl-master`` reads the same variables. A value
        that cannot be read raises :class:`InvalidArgumentError` naming the variable; an
        unknown keyword raises ``TypeError``, as the constructor does.

        Example::

            master = pccl.MasterNode.from_env({"PCCL_MASTER_LISTEN": "0.0.0.0:48148",
                                               "PCCL_REPAIR_RINGS": "off"},
                                              listen="127.0.0.1:0")
            assert (master.listen, master.state.repair_rings) == ("127.0.0.1:0", False)
        """
        return config.from_env(cls, env, **overrides)

    # --- lifecycle ------------------------------------------------------------------

    @property
    def anonymous(self) -> bool:
        """Whether nothing authenticates the peers (no secret, no trusted run key)."""
        return self.secret is None and not self.identity.checks_certs

    async def start(self) -> None:
        """Starts listening; returns once the socket is bound."""
        if self._server is not None:
            return
        host, port = split_host_port(self.listen)
        self._pending = Budget(self.max_pending, self.max_pending_per_source)
        self._doctors = Budget(self.max_doctors, 1)
        self._relay_held = Budget(1 << 30, self.max_relayed_per_peer)
        if self.state_dir is not None:
            # (Before listening: a removed key must not slip in while they load.)
            bans = Path(self.state_dir) / admin.BANS_FILE
            try:
                self.bans = admin.BanList.load(bans) if bans.exists() else self.bans
            except (OSError, ValueError) as e:
                raise InvalidUsageError(
                    f"MasterNode(state_dir={self.state_dir!r}): the ban list {str(bans)!r} "
                    f"cannot be read ({e}); mend it, or remove it to lift every ban") from None
        if self.max_connections is None:
            soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
            self.max_connections = max(64, (soft if soft > 0 else 1024) - 128)
        try:
            self._server = await _listen(host, port)
        except socket.gaierror as e:
            raise InvalidArgumentError(
                f"MasterNode cannot listen on {self.listen!r}: unknown host {host!r} "
                f"({e.strerror}); give a local address, e.g. 0.0.0.0:{DEFAULT_PORT}") from None
        except OSError as e:
            hint = {errno.EADDRINUSE: " (another master, or another program, uses that port)",
                    errno.EACCES: " (ports below 1024 need privileges)",
                    errno.EADDRNOTAVAIL: " (that address is not one of this machine's)"}
            why = os.strerror(e.errno) if e.errno else str(e)
            raise OSError(e.errno, f"MasterNode cannot listen on {self.listen!r}: "
                                   f"{why}{hint.get(e.errno or 0, '')}") from None
        self._accepting = [asyncio.create_task(self._accept_loop(s), name="pccl-master-accept")
                           for s in self._server]
        sock = self._server[0].getsockname()
        shown = sock[0] if host not in ("", "0.0.0.0", "::") else host or "0.0.0.0"
        self._address = join_host_port(shown, sock[1])
        self._heartbeat = asyncio.create_task(self._heartbeat_loop(), name="pccl-master-heartbeat")
        log.info("master listening on %s", self._address)
        if self.state_dir is not None:
            try:
                self.monitor.keep_in(Path(self.state_dir))
            except OSError as e:
                await self.stop()
                raise InvalidUsageError(
                    f"MasterNode(state_dir={self.state_dir!r}) cannot be used: {e}") from None
        self.monitor.started()
        if self.status_listen is not None:
            from pccl.master.status_server import StatusServer  # aiohttp: only now

            self._status = StatusServer(self.monitor, self.status_listen, self.status_token)
            try:
                await self._status.start()
            except BaseException:
                self._status = None
                await self.stop()
                raise
        if self.admin_socket is not None:
            self._admin = admin.AdminServer(self, self.admin_socket)
            try:
                await self._admin.start()
            except BaseException as e:
                self._admin = None
                await self.stop()
                if isinstance(e, InvalidUsageError):
                    raise InvalidUsageError(f"MasterNode(admin_socket={self.admin_socket!r})"
                                            f": {e}") from None
                raise
        if self.anonymous and not is_loopback_host(host):
            log.warning(
                "master listening on %s WITHOUT AUTHENTICATION (allow_anonymous=True): "
                "anyone who can reach this address can join the run, and anyone on the "
                "path can sit in the middle of every connection", self._address)

    @property
    def status_address(self) -> str | None:
        """The status server's "host:port" (the real port when given port 0), or None
        when it does not run."""
        return self._status.address if self._status is not None else None

    @property
    def address(self) -> str:
        """The "host:port" actually bound (the real port when listening on port 0)."""
        if not self._address:
            raise RuntimeError("the master has not been started")
        return self._address

    async def stop(self, *, end_run: bool = False,
                   reason: str = "the master was stopped") -> None:
        """Tells every registered peer that the master stops on purpose (a ``shutdown``
        message: a peer then says so instead of blaming a crash), closes every
        connection and stops listening. Idempotent. ``end_run``: the run is over, and
        peers stop waiting for a master at once (their calls fail with
        :class:`MasterConnectionError`); otherwise they register again for up to their
        ``reconnect_timeout`` (a restart, an upgrade)."""
        if self._server is None:
            return
        await self._say_shutdown(m.Shutdown(reason=reason, final=end_run))
        listeners, self._server = self._server, None
        for task in self._accepting:
            task.cancel()
        await asyncio.gather(*self._accepting, return_exceptions=True)
        self._accepting = []
        for sock in listeners:
            sock.close()
        if self._status is not None:
            status_server, self._status = self._status, None
            await status_server.stop()
        if self._admin is not None:
            admin_server, self._admin = self._admin, None
            await admin_server.stop()
        if self._heartbeat is not None:
            self._heartbeat.cancel()
        for conn in list(self._conns.values()):
            conn.abort()
        for handle in self._deadlines.values():
            handle.cancel()
        self._deadlines.clear()
        for task in list(self._handlers):
            task.cancel()
        await asyncio.gather(*self._handlers, return_exceptions=True)
        if self._heartbeat is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._heartbeat
        self._conns.clear()
        self.monitor.close()
        self._stopped.set()
        log.info("master stopped")

    async def _say_shutdown(self, msg: m.Shutdown) -> None:
        """Sends ``msg`` to every registered peer, waiting at most a heartbeat interval
        (a peer that does not read it in time learns of the stop from the closed
        connection)."""
        conns = list(self._conns.values())
        for conn in conns:
            with contextlib.suppress(ConnectionClosed, OSError, RuntimeError):
                conn.send_nowait(msg)

        async def drained(conn: FramedConnection) -> None:
            with contextlib.suppress(ConnectionClosed, OSError, RuntimeError):
                await conn.writer.drain()

        if conns:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(self.heartbeat_interval, 1.0)):
                    await asyncio.gather(*(drained(c) for c in conns))

    async def serve_forever(self) -> None:
        """Runs until :meth:`stop` is called (e.g. from a signal handler)."""
        await self.start()
        await self._stopped.wait()

    async def __aenter__(self) -> MasterNode:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    async def wait_for(
        self, predicate: Callable[[st.MasterState], bool], timeout: float = 30.0
    ) -> None:
        """Waits until ``predicate(self.state)`` holds, re-checked after every event.

        For tests and orchestration, e.g.
        ``await master.wait_for(lambda s: len(s.pending()) == 3)``.
        """
        async with asyncio.timeout(timeout):
            while not predicate(self.state):
                self._changed.clear()
                await self._changed.wait()

    @property
    def serving(self) -> bool:
        """Whether the master listens (between start() and stop())."""
        return self._server is not None

    @property
    def open_connections(self) -> int:
        """Connections accepted on the control port and not closed yet (every kind)."""
        return self._open

    # --- connections ----------------------------------------------------------------

    async def _accept_loop(self, listener: socket.socket) -> None:
        """Accepts while under ``max_connections``; each connection is handled in a task
        of its own that gives its slot back when it ends."""
        while True:
            while self._open >= (self.max_connections or 1):
                self._slot_free.clear()
                await self._slot_free.wait()
            try:
                sock = await accept(listener)
            except OSError as e:
                # (EMFILE and the like: the process is out of descriptors; wait a little
                # for some to close instead of spinning)
                log.warning("accepting a connection failed: %s", e)
                await asyncio.sleep(0.1)  # a back-off, not a synchronisation
                continue
            self._open += 1
            self._own(self._serve(sock), "pccl-master-connection")
            self._changed.set()  # (wait_for predicates may look at open_connections)

    async def _serve(self, sock: socket.socket) -> None:
        try:
            try:
                reader, writer = await asyncio.open_connection(sock=sock)
            except OSError:
                sock.close()
                return
            try:
                await self._handle(reader, writer)
            finally:
                # The slot is free once the socket is (_handle aborted it: it closes on
                # the loop's next turn), so that descriptors never outnumber the cap.
                with contextlib.suppress(Exception):
                    await writer.wait_closed()
        finally:
            self._open -= 1
            self._slot_free.set()


    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # Until it registers, a connection may send only small frames.
        conn = FramedConnection(reader, writer, max_frame=min(self.max_frame,
                                                              PRE_HELLO_MAX_FRAME))
        source = source_key(conn.peername[0])
        peer_id: int | None = None
        pending = self._pending.take(source)
        try:
            if not pending:
                self._log_refusal(f"connection from {source} refused: "
                                  f"{len(self._pending)} connections are in the handshake "
                                  f"({self.max_pending} at most, "
                                  f"{self.max_pending_per_source} per address)")
                return
            first = await self._first_frame(conn)
            if first is None:
                return
            if len(first) == len(RELAY_MAGIC) + 18 and first.startswith(RELAY_MAGIC):
                self._pending.release(source)
                pending = False
                await self._relay(conn, first[len(RELAY_MAGIC):])
                return
            peer_id = await self._handshake(conn, first)
            if peer_id is None:
                return
            self._pending.release(source)
            pending = False
            await self._read_loop(peer_id, conn)
        except asyncio.CancelledError:
            pass
        finally:
            if pending:
                self._pending.release(source)
            if peer_id is not None:
                self._conns.pop(peer_id, None)
            conn.abort()

    def _warn_rarely(self, kind: str, text: str, counts: Callable[[], str]) -> None:
        """A warning about ``kind`` at most every 10 s, with ``counts()`` (a flood is
        hundreds or thousands); the others at DEBUG."""
        now = time.monotonic()
        if now - self._warned.get(kind, -10.0) >= 10.0:
            self._warned[kind] = now
            log.warning("%s (%s)", text, counts())
        else:
            log.debug("%s", text)

    def _log_refusal(self, text: str) -> None:
        """A newcomer refused for a full budget."""
        self._warn_rarely("budget", text, lambda: (
            f"refused so far: {self._pending.refused} connections, "
            f"{self._doctors.refused} doctors, {self._relay_held.refused} relay streams"))

    def _refuse_handshake(self, reason: str, text: str) -> None:
        """A handshake refused or dropped (strangers and scanners make these by the
        thousand): counted by ``reason``."""
        self.refused_handshakes[reason] += 1
        self._warn_rarely("handshake", text, lambda: "handshakes refused so far: " + ", ".join(
            f"{n} {r}" for r, n in sorted(self.refused_handshakes.items()))
            + "; the next 10 s only at DEBUG")

    async def _first_frame(self, conn: FramedConnection) -> bytes | None:
        remote = "{}:{}".format(*conn.peername)
        try:
            async with asyncio.timeout(self.handshake_timeout):
                return await conn.handshake_frame()
        except TimeoutError:
            self._refuse_handshake("timeout", f"connection from {remote} dropped: no "
                                              f"handshake within {self.handshake_timeout}s")
        except ProtocolError as e:
            self._refuse_handshake("garbage", f"connection from {remote} dropped: {e}")
        except ConnectionClosed:
            pass
        return None

    async def _handshake(self, conn: FramedConnection, first: bytes) -> int | None:
        remote = "{}:{}".format(*conn.peername)
        nonce = _secrets.token_bytes(16)
        try:
            async with asyncio.timeout(self.handshake_timeout):
                await conn.accept(self.secret, allow_clear=self.insecure, first=first,
                                  also=self.secrets.also(),
                                  identity=self.identity, group="peer")
                await conn.send(m.Challenge(version=PROTOCOL_VERSION, nonce=nonce,
                                            auth=self.secret is not None,
                                            groups=self.state.held_groups(),
                                            standby=self.state.standby,
                                            max_frame=self.max_frame,
                                            min_version=MIN_PROTOCOL_VERSION))
                hello = await conn.recv()
        except IdentityError as e:
            self._refuse_handshake("identity", f"connection from {remote} refused: {e}")
            return None
        except AuthenticationError as e:
            self._refuse_handshake("secret", f"connection from {remote} refused: {e}")
            return None
        except PeerConnectionError as e:
            self._refuse_handshake("garbage", f"connection from {remote} dropped: {e}")
            return None
        except TimeoutError:
            self._refuse_handshake("timeout", f"connection from {remote} dropped: no "
                                              f"handshake within {self.handshake_timeout}s")
            return None
        except ProtocolError as e:
            self._refuse_handshake("garbage", f"connection from {remote} dropped: {e}")
            return None
        except ConnectionClosed:
            return None
        if isinstance(hello, m.DoctorHello):
            await self._doctor(conn, hello, nonce, remote)
            return None
        if not isinstance(hello, m.Hello):
            log.warning("connection from %s dropped: expected hello, got %s", remote, hello.TYPE)
            return None
        server_mac = await self._check_hello(conn, hello, nonce, f"peer at {remote}")
        if server_mac is None or await self._refused_as_removed(conn, remote):
            return None
        reg = admit(hello, self.run_id)  # (every field checked there, none here)
        if not isinstance(reg, Registration):
            kind, problem = reg
            if kind is ErrorKind.ProtocolError:
                log.warning("peer at %s rejected: %s", remote, problem)
            else:
                self._log_refusal(f"peer at {remote} rejected: {problem}")
            await self._reject(conn, kind, problem)
            return None
        # Claimed before the first await below: two registrations never share an id.
        peer_id = self._claim_id(reg.resume.peer_id if reg.resume is not None else 0)
        try:
            host = reg.p2p_host or conn.peername[0]
            p2p_addr = join_host_port(host, reg.p2p_port)
            reachable = await self._dial_back(host, reg.p2p_port,
                                              conn.remote[0] if conn.remote else None)
            if conn.writer.is_closing() or self._server is None:
                return None
            if await self._refused_as_removed(conn, remote):  # (removed meanwhile)
                return None
            self._register(peer_id, conn, reg, server_mac, remote, p2p_addr, reachable,
                           host)
        finally:
            self._claimed.discard(peer_id)
        return peer_id

    async def _refused_as_removed(self, conn: FramedConnection, remote: str) -> bool:
        """Whether the key ``conn`` proved is one the operator removed (the dialer has
        been told so, as an IdentityError: retrying cannot help)."""
        ban = self.bans.get(conn.remote[1]) if conn.remote is not None else None
        if ban is None:
            return False
        why = f" ({ban.reason})" if ban.reason else ""
        self._refuse_handshake("identity", f"peer at {remote} refused: its key "
                                          f"{ban.fingerprint} was removed by the operator{why}")
        await self._reject(conn, ErrorKind.IdentityError,
                           f"this peer's key {ban.fingerprint} was removed from the run by "
                           f"the operator{why}; the master refuses it until the operator "
                           f"lifts the ban")
        return True

    def _claim_id(self, wanted: int) -> int:
        """The id of a registration: the one it had before (``wanted``) when nobody
        holds or claims it (ring order and tie-breaks follow ids), else a new one."""
        taken = (self._conns.keys(), self.state.peers.keys(), self._claimed)
        if 0 < wanted < MAX_KEPT_ID and not any(wanted in t for t in taken):
            peer_id = wanted
        else:
            peer_id = self._next_peer_id
            while any(peer_id in t for t in taken):  # (ids above _next_peer_id: resumed)
                peer_id += 1
        self._next_peer_id = max(self._next_peer_id, peer_id + 1)
        self._claimed.add(peer_id)
        return peer_id

    def _register(self, peer_id: int, conn: FramedConnection, reg: Registration,
                  server_mac: bytes, remote: str, p2p_addr: str, reachable: bool,
                  host: str) -> None:
        """Welcomes a peer whose hello passed every check (no await: atomic)."""
        conn.max_frame = self.max_frame
        self._conns[peer_id] = conn
        conn.send_nowait(m.Welcome(peer_id=peer_id, mac=server_mac,
                                   heartbeat_interval=self.heartbeat_interval,
                                   heartbeat_timeout=self.heartbeat_timeout,
                                   reachable=reachable, p2p_address=p2p_addr))
        resume = reg.resume
        how = ("registered" if resume is None else
               f"re-registered (was peer {resume.peer_id}, revision {resume.revision})")
        name = reg.name
        cert_name = conn.remote[2] if conn.remote is not None else None
        if cert_name is not None:
            name = cert_name  # (the certificate's, not what the peer says)
        named = f" {name!r}" if name else ""
        joined = (f"peer {peer_id}{named} {how} from {remote} (group {reg.peer_group}, p2p "
                  f"{p2p_addr}{'' if reachable else ': not reachable from here, behind NAT?'}"
                  f", {'encrypted' if conn.encrypted else 'clear text'})")
        log.info("%s", joined)
        self.monitor.connected(peer_id, remote, conn.encrypted, joined, name or None,
                               version=reg.version)
        if reg.masters > 1 and not self.state.quorum_on and not self._quorum_warned:
            self._quorum_warned = True
            log.warning("peer %d fails over between %d masters, but this master counts no "
                        "quorums: two masters could each run its group. Start every master "
                        "of a run with several with --quorum (MasterNode(quorum=True)); a "
                        "standby always counts them", peer_id, reg.masters)
        key = conn.remote[0] if conn.remote is not None else b""
        if conn.remote is not None:
            _, fp, cert_name, _, not_after = conn.remote
            self.monitor.identified(peer_id, fp, cert_name, not_after)
        denylist = self.identity.denylist
        if denylist is not None:
            conn.send_nowait(m.Denylist(data=denylist))
        self._feed(st.PeerRegistered(peer_id, reg.peer_group, p2p_addr, resume,
                                     reachable=reachable, allow_relay=reg.allow_relay,
                                     punch_addrs=reg.punch_addrs(host),
                                     masters=reg.masters, key=key,
                                     public_host=source_key(conn.peername[0])
                                     if conn.peername[0] != "?" else "",
                                     lan_addrs=reg.lan_addrs()))

    async def _doctor(self, conn: FramedConnection, hello: m.DoctorHello, nonce: bytes,
                      remote: str) -> None:
        """Answers ``pccl doctor`` (registers nothing): checks its secret, dials its
        p2p port back, reports what it saw, then echoes a few times (bounded)."""
        mac = await self._check_hello(conn, hello, nonce, f"doctor at {remote}")
        if mac is None:
            return
        host = conn.peername[0]
        source = source_key(host)
        # An echo may be 8 MiB, held until the client reads it: a few sessions at a
        # time, one per address, each send with a deadline.
        if not self._doctors.take(source):
            self._log_refusal(f"doctor from {remote} refused: {len(self._doctors)} doctor "
                              f"sessions run ({self.max_doctors} at most, one per address)")
            await self._reject(conn, ErrorKind.PeerConnectionError,
                               "the master is answering other pccl doctor sessions; "
                               "try again in a minute")
            return
        # Its upload measurement sends one echo-sized frame at a time.
        conn.max_frame = DOCTOR_MAX_ECHO + 1024
        try:
            reachable = 0 < hello.p2p_port < 65536 and await self._dial_back(
                host, hello.p2p_port, conn.remote[0] if conn.remote else None)
            log.info("doctor from %s: p2p port %d %s", remote, hello.p2p_port,
                     "reachable" if reachable else "not reachable")
            try:
                async with asyncio.timeout(self.handshake_timeout):
                    await conn.send(m.DoctorReport(observed=remote, reachable=reachable,
                                                   mac=mac, master_time=time.time()))
                for _ in range(DOCTOR_ECHOES):
                    async with asyncio.timeout(self.heartbeat_timeout * 4):
                        req = await conn.recv()
                    if not isinstance(req, m.DoctorEcho):
                        return
                    size = max(0, min(req.reply_bytes, DOCTOR_MAX_ECHO))
                    # A client that does not read its echo is dropped, not waited for.
                    async with asyncio.timeout(self.heartbeat_timeout * 4):
                        await conn.send(m.DoctorEcho(payload=bytes(size), reply_bytes=0,
                                                     master_time=time.time()))
            except TimeoutError:
                conn.reset()  # (the echo it did not read is dropped here and in the kernel)
            except (ConnectionClosed, ProtocolError):
                pass
        finally:
            self._doctors.release(source)

    async def _check_hello(self, conn: FramedConnection, hello: m.Hello | m.DoctorHello,
                           nonce: bytes, who: str) -> bytes | None:
        """The protocol version and the secret's MAC of a ``hello`` (or a doctor's):
        the master's own MAC to answer with, or None once the dialer was rejected."""
        # A newer peer decided from the challenge that it can speak this master's
        # version; an older one must be at least this master's minimum.
        if hello.version < MIN_PROTOCOL_VERSION:
            await self._reject(conn, ErrorKind.ProtocolError,
                               f"protocol version {hello.version} is too old for this master "
                               f"(it speaks {PROTOCOL_VERSION}, and works with peers of "
                               f"{MIN_PROTOCOL_VERSION} or newer): upgrade pccl on this peer")
            log.warning("%s rejected: protocol version %d (this master works with %d to %d)",
                        who, hello.version, MIN_PROTOCOL_VERSION, PROTOCOL_VERSION)
            return None
        if self.secret is None or conn.encrypted:
            # Encrypted, the handshake proved the secret (and the key); the MACs are for
            # clear-text (insecure) registrations only.
            return b""
        if not hmac.compare_digest(hello.mac, peer_mac(self.secret, nonce, hello.nonce)):
            log.warning("%s rejected: wrong or missing shared secret", who)
            await self._reject(conn, ErrorKind.AuthenticationError,
                               "the master rejected this peer's shared secret")
            return None
        return master_mac(self.secret, nonce, hello.nonce)

    async def _dial_back(self, host: str, port: int, key: bytes | None) -> bool:
        """Whether a pccl p2p listener answers at host:port (the reachability check:
        it must echo a fresh token). A loopback address cannot be behind NAT: a listener
        there that is only slow to answer (a loaded machine) gets a longer second try
        instead of being taken for NAT."""
        answered = await self._echo_token(host, port, self.dial_back_timeout, key)
        if answered is None and is_loopback_host(host):
            log.info("dial-back of %s:%d timed out on loopback; trying again", host, port)
            answered = await self._echo_token(host, port, 4 * self.dial_back_timeout, key)
        return bool(answered)

    async def _echo_token(self, host: str, port: int, timeout: float,
                          key: bytes | None) -> bool | None:
        """One dial-back: True when the listener echoed the token, False when it failed
        (refused, closed, a wrong answer), None when it timed out. ``key``: the static
        key the peer proved on its control connection; the listener must prove the same
        key in a secure handshake (as this master, for the group ``master``) and echo
        the token inside it, so only that peer's own listener passes. None (a clear-text
        peer): the token is echoed in clear."""
        token = _secrets.token_bytes(16)
        conn: FramedConnection | None = None
        try:
            async with asyncio.timeout(timeout):
                conn = FramedConnection(*await asyncio.open_connection(host, port))
                conn.send_handshake_frame(REACH_MAGIC + token)
                if key is None:
                    return await conn.handshake_frame() == token
                await conn.dial(self.secret, identity=self.identity, group="peer",
                                expect=key, prologue=REACH_PROLOGUE, also=self.secrets.also())
                return await conn.recv_exact(len(token)) == token
        except TimeoutError:
            return None
        except (OSError, ConnectionClosed, PCCLError) as e:
            log.debug("dial-back of %s:%d failed: %s", host, port, e)
            return False
        finally:
            if conn is not None:
                await conn.close()

    async def _relay(self, conn: FramedConnection, hello: bytes) -> None:
        """One end of a relayed ring-link stream (``hello``: token | stream u16). The
        first end waits (bounded) for the other; the second splices them. The bytes are
        the peers' encrypted stream: the relay sees ciphertext only.

        Budgets: ``max_relayed_streams`` streams waiting or carried in all, at most
        ``max_relayed_per_peer`` of them naming one peer at either end, and at most
        :data:`RELAY_WAITING_PER_TOKEN` waiting per token; a waiting end is let go when
        its token expires (a new round) and after ``establish_timeout``."""
        remote = "{}:{}".format(*conn.peername)
        token = hello[:16]
        transfer = self.state.transfer_tokens.get(token)
        pair = self.state.relay_tokens.get(token) or transfer
        if pair is None:
            self._log_refusal(f"relay connection from {remote} refused: unknown or "
                              "expired token")
            return
        waiting = self._relay_waiting.pop(hello, None)
        if waiting is not None:
            other, paired = waiting
            if not paired.done():  # (else that end is being let go)
                finished: asyncio.Future[None] = asyncio.get_running_loop().create_future()
                paired.set_result(finished)
                if transfer is None:
                    self._feed(st.Relayed(token))  # a punched link that fell back, perhaps
                try:
                    await self._splice(other, conn, pair)
                finally:
                    if not finished.done():
                        finished.set_result(None)
                return
        same_token = sum(1 for h in self._relay_waiting if h[:16] == token)
        ends = (pair[0],) if pair[0] == pair[1] else pair
        if same_token >= RELAY_WAITING_PER_TOKEN or not self._take_relay(ends):
            self._log_refusal(
                f"relay connection from {remote} refused: {self.relayed_streams} streams "
                f"relayed and {len(self._relay_waiting)} waiting for their other end "
                f"(max_relayed_streams={self.max_relayed_streams}, at most "
                f"{self.max_relayed_per_peer} per peer and {RELAY_WAITING_PER_TOKEN} "
                f"waiting per token; peers {pair[0]} and {pair[1]} hold "
                f"{self._relay_held.held(pair[0])} and {self._relay_held.held(pair[1])})")
            return
        try:
            holder = self._conns.get(transfer[1]) if transfer is not None else None
            if holder is not None:
                # A fetcher's stream to a holder behind NAT: ask the holder for its end.
                holder.send_nowait(m.RelayOpen(token=token,
                                               stream=int.from_bytes(hello[16:], "big")))
            paired_here: asyncio.Future[asyncio.Future[None] | None] = \
                asyncio.get_running_loop().create_future()
            self._relay_waiting[hello] = (conn, paired_here)
            try:
                async with asyncio.timeout(self.establish_timeout):
                    ended = await paired_here
            except TimeoutError:
                log.info("relay connection from %s dropped: the other end never came", remote)
                return
            finally:
                if self._relay_waiting.get(hello, (None,))[0] is conn:
                    del self._relay_waiting[hello]
            if ended is None:
                log.info("relay connection from %s dropped: its token expired", remote)
                return
            await ended
        finally:
            for p in ends:
                self._relay_held.release(p)

    def _take_relay(self, ends: tuple[int, ...]) -> bool:
        """A relay slot for a stream between ``ends`` (both, or none)."""
        if self.relayed_streams + len(self._relay_waiting) >= self.max_relayed_streams:
            self._relay_held.refused += 1
            return False
        taken: list[int] = []
        for p in ends:
            if not self._relay_held.take(p):
                for q in taken:
                    self._relay_held.release(q)
                return False
            taken.append(p)
        return True

    def _expire_relay_waits(self) -> None:
        """Lets go of waiting relay ends whose token the state no longer knows."""
        for hello, (_conn, paired) in list(self._relay_waiting.items()):
            token = hello[:16]
            if token not in self.state.relay_tokens and token not in \
                    self.state.transfer_tokens and not paired.done():
                paired.set_result(None)

    async def _splice(self, a: FramedConnection, b: FramedConnection,
                      pair: tuple[int, int]) -> None:
        log.info("relaying a stream from peer %d to peer %d", *pair)
        self.relayed_streams += 1

        async def pump(src: FramedConnection, dst: FramedConnection) -> None:
            while data := await src.reader.read(1 << 16):
                dst.writer.write(data)
                self.relayed_bytes += len(data)
                await dst.writer.drain()
            if dst.writer.can_write_eof():
                dst.writer.write_eof()

        pumps = [asyncio.create_task(pump(a, b)), asyncio.create_task(pump(b, a))]
        try:
            for done in asyncio.as_completed(pumps):
                try:
                    await done
                except (ConnectionError, OSError):
                    break  # one end failed: end both
        finally:
            self.relayed_streams -= 1
            for t in pumps:
                t.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)
            a.abort()
            b.abort()

    async def _reject(self, conn: FramedConnection, kind: ErrorKind, message: str) -> None:
        with contextlib.suppress(ConnectionClosed, OSError):
            await conn.send(m.Reject(kind=kind, message=message))
        await conn.close()

    async def _read_loop(self, peer_id: int, conn: FramedConnection) -> None:
        while peer_id in self._conns:
            try:
                async with asyncio.timeout(self.heartbeat_timeout):
                    msg = await conn.recv()
            except TimeoutError:
                log.warning("peer %d dropped: silent for %.1fs (heartbeat timeout)",
                            peer_id, self.heartbeat_timeout)
                self._feed(st.PeerLost(peer_id, "heartbeat timeout"))
                return
            except ProtocolError as e:
                log.warning("peer %d dropped: %s", peer_id, e)
                self._feed(st.PeerLost(peer_id, f"protocol error: {e}"))
                return
            except ConnectionClosed as e:
                if peer_id in self._conns:
                    # The detail; the state's "dropped" note is the INFO line.
                    log.debug("peer %d dropped: connection closed (%s)", peer_id, e)
                self._feed(st.PeerLost(peer_id, "connection closed"))
                return
            self.monitor.seen(peer_id)
            if isinstance(msg, m.Pong):
                self.monitor.heartbeat(peer_id, msg.tx_bytes, msg.rx_bytes,
                                       msg.sync_rx_bytes, msg.sync_rx_total)
            elif isinstance(msg, (m.CollectiveInit, m.CollectiveDone)):
                # (Before the state sees it: the notes it makes then close the record.)
                self.monitor.collective_message(peer_id, msg)
            self._feed(st.Received(peer_id, msg))

    def _log_route(self, peer_id: int, msg: m.EstablishP2P) -> None:
        """Logs how a ring link of a round is made, unless plainly dialed."""
        path = msg.route
        if msg.epoch == self.state.epoch:  # (the state's paths are of its newest round)
            path = self.state.paths.get((peer_id, msg.next_id), path)
        if path != "direct":
            log.info("round %d: the ring link from peer %d to peer %d is %s", msg.epoch,
                     peer_id, msg.next_id, _PATHS.get(path, path))

    def _feed(self, event: st.Event) -> None:
        commands = self.state.handle(event)
        notes = self.state.take_notes()
        if notes:
            self.monitor.notes(notes)
        frames = FrameCache()  # (a round's world goes to every member: encoded once)
        for cmd in commands:
            if isinstance(cmd, st.Send):
                conn = self._conns.get(cmd.peer_id)
                if conn is None:
                    continue
                conn.send_nowait(cmd.msg, frames.frame(cmd.msg))
                if isinstance(cmd.msg, m.EstablishP2P):
                    self._log_route(cmd.peer_id, cmd.msg)
                if conn.buffered_bytes() > MAX_WRITE_BACKLOG:
                    log.warning("peer %d dropped: not reading its control messages", cmd.peer_id)
                    conn.reset()
            elif isinstance(cmd, st.Solve):
                self._own(self._solve(cmd), "pccl-master-solve")
            elif isinstance(cmd, st.ArmRecoveryTimer):
                self._own(self._recovery_timer(cmd.recovery_id), "pccl-master-recovery")
            elif isinstance(cmd, st.ArmDeadline):
                self._deadlines[cmd.deadline_id] = asyncio.get_running_loop().call_later(
                    cmd.seconds, self._deadline_expired, cmd.deadline_id)
            elif isinstance(cmd, st.CheckReach):
                self._own(self._check_reach(cmd), "pccl-master-check-reach")
            else:
                conn = self._conns.pop(cmd.peer_id, None)
                if conn is not None:
                    # (the state's "dropped" note logs it at INFO)
                    log.debug("peer %d disconnected: %s", cmd.peer_id, cmd.reason)
                    if cmd.tell:
                        conn.send_nowait(m.Reject(kind=ErrorKind.PeerConnectionError,
                                                  message=cmd.reason,
                                                  elsewhere=cmd.elsewhere))
                    # close() flushes what is queued (e.g. a final error) before closing.
                    conn.writer.close()
        if self._relay_waiting:
            self._expire_relay_waits()
        # Operations that ended took their deadlines with them: drop those timers.
        for did in [d for d in self._deadlines if d not in self.state.deadlines]:
            self._deadlines.pop(did).cancel()
        rnd = self.state.round
        if rnd is None or rnd.epoch != self._timed_epoch:
            if self._round_timer_task is not None:
                self._round_timer_task.cancel()  # that round is over
                self._round_timer_task = None
            if rnd is not None:
                self._timed_epoch = rnd.epoch
                self._round_timer_task = self._own(self._round_timer(rnd.epoch),
                                                   "pccl-master-round-timer")
        self._changed.set()

    async def _check_reach(self, cmd: st.CheckReach) -> None:
        host, port = split_host_port(cmd.addr)
        record = self.state.peers.get(cmd.peer_id)
        key = record.key if record is not None and record.key else None
        ok = await self._dial_back(host, port, key)
        log.info("round %d: peer %d's p2p port %s %s from here", cmd.epoch, cmd.peer_id,
                 cmd.addr, "answers" if ok else "does not answer")
        if self._server is not None:
            self._feed(st.ReachChecked(cmd.epoch, cmd.peer_id, ok))

    def _deadline_expired(self, deadline_id: int) -> None:
        if self._deadlines.pop(deadline_id, None) is not None and self._server is not None:
            log.warning("deadline %d expired: %s", deadline_id,
                        self.state.deadlines.get(deadline_id))
            self._feed(st.DeadlineExpired(deadline_id))

    def _own(self, coro: Any, name: str) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro, name=name)
        self._handlers.add(task)
        task.add_done_callback(self._handlers.discard)
        return task

    async def _round_timer(self, epoch: int) -> None:
        await asyncio.sleep(self.establish_timeout)  # a deadline, not a synchronisation
        rnd = self.state.round
        if rnd is not None and rnd.epoch == epoch:
            silent = sorted(set(rnd.members) - rnd.reported)
            log.warning("round %d: peers %s did not report their p2p links within %.1fs; "
                        "treating them as unreachable", epoch, silent, self.establish_timeout)
            self._feed(st.RoundTimeout(epoch))

    async def _recovery_timer(self, recovery_id: int) -> None:
        log.info("waiting up to %.1fs for the rest of the old group to come back",
                 self.recovery_grace)
        await asyncio.sleep(self.recovery_grace)  # a deadline, not a synchronisation
        if self.state.recovery_awaiting and self.state.recovery_id == recovery_id:
            log.warning("admitting without peers %s: they did not come back within %.1fs",
                        sorted(self.state.recovery_awaiting), self.recovery_grace)
        self._feed(st.RecoveryTimeout(recovery_id))

    async def _solve(self, cmd: st.Solve) -> None:
        """Runs the ring solver off the event loop and feeds its answer back."""
        try:
            import numpy as np
        except ImportError:
            # The solver is numpy's; without it the run goes on with the ring it has.
            log.warning("optimize_topology(): the master has no numpy (pip install numpy), "
                        "so group %d keeps its ring order %s", cmd.group, cmd.members)
            self._feed(st.Solved(cmd.round_id, cmd.group, list(cmd.members)))
            return

        from pccl.topology import RingImprover, solve

        bw = np.array(cmd.bw, dtype=np.float64)
        lat = None if cmd.latency is None else np.array(cmd.latency, dtype=np.float64)
        rng = np.random.default_rng(cmd.round_id)
        order = await asyncio.to_thread(solve, bw, time_budget=self.solver_budget, rng=rng,
                                        latency=lat)
        ring = [cmd.members[i] for i in order]
        log.info("optimized ring of group %d: %s", cmd.group, ring)
        self._feed(st.Solved(cmd.round_id, cmd.group, ring))
        if len(order) <= 12:
            return  # solved exactly: nothing left to improve
        # Keep improving in the background for a bounded time; a better ring is
        # adopted at the next update_topology().
        improver = RingImprover(bw, list(order), rng=rng, latency=lat)
        for _ in range(self.improve_steps):
            if self.state.opt_round != cmd.round_id:
                return  # a newer optimization superseded this one
            if await asyncio.to_thread(improver.step, 0.05):
                better = [cmd.members[i] for i in improver.ring]
                log.info("better ring for group %d found in the background: %s",
                         cmd.group, better)
                self._feed(st.BetterRing(cmd.round_id, cmd.group, better))

    # --- the operator's admin channel (pccl.master.admin) -------------------------------

    def admin_peers(self) -> list[admin.PeerEntry]:
        """The registered peers as the operator names them: id, name, key fingerprint."""
        out = []
        for peer_id, rec in sorted(self.state.peers.items()):
            view = self.monitor.peers.get(peer_id)
            out.append(admin.PeerEntry(
                peer_id, view.name if view is not None else None,
                _core.key_fingerprint(rec.key) if rec.key else None, rec.peer_group,
                rec.status.name.lower()))
        return out

    def remove_peer(self, target: str, *, reason: str = "") -> str:
        """Removes a contributor: drops the peer ``target`` names (its id, its name, or
        a prefix of its key's fingerprint of at least 12 hex digits) from the run, as a
        loss (its ring is repaired), and refuses its key at registration from then on
        (until :meth:`unban`; across restarts with ``state_dir``). A whole fingerprint
        bans that key even when no peer holds it now. Returns what was done, in words;
        InvalidArgumentError when ``target`` names no peer or several.

        A contributor who holds the shared secret can come back with a fresh key: with
        secrets alone, rotate the secret too (docs/operations.md).

        Example::

            master.remove_peer("alice", reason="sends garbage gradients")
        """
        peers = self.admin_peers()
        try:
            peer: admin.PeerEntry | None = admin.find_peer(target, peers)
        except InvalidArgumentError:
            if not admin.is_fingerprint(target.strip()):
                raise
            peer = None  # a key nobody holds now: banned all the same
        fp = peer.fingerprint if peer is not None else target.strip().lower()
        text = admin.removed_text(peer, fp, reason)
        if fp is not None:
            self.bans.add(admin.Ban(fp, peer.name if peer is not None else None, reason,
                                    time.time()))
        unsaved = self._save_bans()
        log.warning("%s", text)
        self.monitor.add("removed", text, (peer.peer_id,) if peer is not None else ())
        # Every connection of that key goes (one key, one peer; but be sure).
        for peer_id in [p.peer_id for p in peers if p == peer or
                        (fp is not None and p.fingerprint == fp)]:
            self._drop(peer_id, f"removed by the operator{': ' + reason if reason else ''}")
        if fp is None:
            text += ("; it has no key (clear text), so nothing stops it from registering "
                     "again")
        elif peer is None:
            text += " (no peer holds that key now; it is refused from now on)"
        else:
            text += "; its key is refused from now on"
        return text + unsaved

    def unban(self, target: str) -> str:
        """Lifts the ban on a key :meth:`remove_peer` removed (``target``: the name it
        was removed under, or a fingerprint prefix of at least 12 hex digits). Returns
        what was done, in words; InvalidArgumentError when ``target`` names no ban or
        several."""
        ban = self.bans.find(target)
        self.bans.remove(ban)
        unsaved = self._save_bans()
        text = f"the ban on {ban.describe()} was lifted by the operator"
        log.warning("%s", text)
        self.monitor.add("unbanned", text)
        return text + unsaved

    def _save_bans(self) -> str:
        """Keeps the ban list in ``state_dir``, if any: "" when kept (or nothing to keep
        it in), else what went wrong (to append to the operator's answer)."""
        if self.state_dir is None:
            return ""
        path = Path(self.state_dir) / admin.BANS_FILE
        try:
            self.bans.save(path)
        except OSError as e:
            log.error("the ban list could not be saved to %s (%s): it holds until this "
                      "master stops", path, e)
            return (f" (NOT saved to {path}: {e}; it holds until this master stops)")
        return ""

    def _drop(self, peer_id: int, reason: str) -> None:
        """Drops a registered peer as a loss (the state repairs its ring) and tells it
        why before its connection closes."""
        conn = self._conns.get(peer_id)
        if conn is not None:
            conn.send_nowait(m.Reject(kind=ErrorKind.PeerConnectionError,
                                      message=f"{reason[:300]}"))
        self._feed(st.PeerLost(peer_id, reason))
        conn = self._conns.pop(peer_id, None)
        if conn is not None:  # (the state had no record of it: close it here)
            conn.writer.close()

    def revoke(self, denylist: bytes) -> bool:
        """Installs a denylist signed by a run key this master trusts (``pccl ca
        revoke`` writes one), if newer than the one held: hands it to every peer, which
        refuses the keys it names from then on, and drops the connected peers it names
        (they cannot register again). True if installed, False if not newer.
        IdentityError for a bad signature or an untrusted signer."""
        if not self.identity.install_denylist(denylist):
            return False
        log.warning("denylist version %d installed", self.identity.denylist_version)
        self.monitor.add("revoked", f"denylist version {self.identity.denylist_version} "
                                    "installed", ())
        for conn in list(self._conns.values()):
            conn.send_nowait(m.Denylist(data=denylist))
        for peer_id, conn in list(self._conns.items()):
            if conn.remote is not None and self.identity.is_denied(conn.remote[0]):
                log.warning("peer %d (key %s) dropped: its key is revoked", peer_id,
                            conn.remote[1])
                conn.abort()  # (its read loop reports the loss)
        return True

    def rotate_secret(self, secret: bytes | str) -> None:
        """Makes ``secret`` the run's secret from now on: peers that register (or
        connect) with it are accepted, and so are those with the previous one for
        ``secret_grace`` seconds, so the peers can be given the new secret one at a time
        (docs/security.md, "Rotating the secret"). A master started with a secret file
        does this by itself when the file changes."""
        if self.secrets.rotate(secret):
            self._rotated()

    def _rotated(self) -> None:
        self.secret = self.secrets.current
        source = f" ({self.secrets.path})" if self.secrets.path else ""
        text = (f"the shared secret was rotated{source}: new connections must use the new "
                f"one; the previous one is still accepted for {self.secrets.grace:.0f}s")
        log.warning("%s", text)
        self.monitor.add("secret", text)

    def _check_secret_file(self) -> None:
        """Picks up a new secret from the secret file (a rotation), if it changed."""
        try:
            if self.secrets.reread():
                self._rotated()
        except InvalidArgumentError as e:
            log.error("the secret file was changed, but the master keeps its secret: %s", e)

    def _check_denylist_file(self) -> None:
        """Picks up a new version of the denylist file (``denylist``), if any."""
        if self.denylist is None:
            return
        try:
            stamp = os.stat(self.denylist).st_mtime_ns
        except OSError:
            return
        if stamp == self._denylist_stamp:
            return
        self._denylist_stamp = stamp
        try:
            self.revoke(ident.load_denylist(self.denylist))
        except (InvalidArgumentError, AuthenticationError) as e:
            log.error("denylist file %s not installed: %s", self.denylist, e)

    async def _heartbeat_loop(self) -> None:
        seq = 0
        while True:
            await asyncio.sleep(self.heartbeat_interval)
            self._check_denylist_file()
            self._check_secret_file()
            seq += 1
            for conn in list(self._conns.values()):
                conn.send_nowait(m.Ping(seq=seq))
