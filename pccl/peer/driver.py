"""The asyncio half of a peer: everything :class:`pccl.communicator.Communicator` does
besides its public calls. It feeds the sans-IO machine (:mod:`pccl.peer.state`) and
carries out its commands; it owns the master connection (handshake, reader, registering
again), the tasks of the Rust data plane (pools, ring installs, probes, ring ops,
fetches through :mod:`pccl.peer.fetch`) and one future per waiting call.
``docs/architecture.md`` has the picture."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import math
import secrets as _secrets
import time
from collections.abc import Callable
from typing import Any

from pccl import _core, identity
from pccl.enums import ReduceOp, SharedStateSyncStrategy
from pccl.errors import (
    AuthenticationError,
    ErrorKind,
    InvalidArgumentError,
    InvalidUsageError,
    MasterConnectionError,
    PCCLError,
    ProtocolError,
    TopologyOptimizationFailedError,
    UpdateTopologyFailedError,
)
from pccl.peer import state as ps
from pccl.peer.dataplane import DATA_PLANE_COMMANDS, DataPlane, ReduceRun, SyncRun
from pccl.peer.metrics import PeerMetrics
from pccl.peer.options import (
    DEFAULT_TIMEOUT,
    GatherInfo,
    PeerOptions,
    QuantizationOptions,
    ReduceInfo,
    check_deadline,
)
from pccl.peer.pause import PauseWatch, awake_clock, describe
from pccl.peer.state import Status as PeerState
from pccl.protocol import MIN_PROTOCOL_VERSION, PROTOCOL_VERSION, compatible, version_mismatch
from pccl.protocol import messages as m
from pccl.protocol.auth import is_lan_address, master_mac, peer_mac, split_host_port
from pccl.protocol.codec import MAX_STR, encode, fit_hello
from pccl.protocol.transport import ConnectionClosed, FramedConnection
from pccl.shared_state import SharedState, SyncInfo, SyncProgress
from pccl.tensors import RawTensor, as_raw

log = logging.getLogger("pccl.communicator")

#: Seconds between the ticks that tell a pause of this process from a lost master.
PAUSE_TICK = 0.5


class Driver:
    """The machinery behind :class:`pccl.communicator.Communicator` (which sets these
    attributes up in its constructor; its settings are ``options``)."""

    options: PeerOptions
    _master_addr: str
    _elsewhere: str | None
    secret: bytes | None
    secrets: identity.Secrets
    # When the secrets were last looked at (monotonic), and how many older ones the p2p
    # node holds (see _reread_secret).
    _secrets_checked: float = 0.0
    _secrets_held: int = 0
    identity: _core.Identity
    _m: ps.PeerMachine
    _conn: FramedConnection | None
    _node: _core.P2PNode | None
    _tasks: set[asyncio.Task[Any]]
    _reader: asyncio.Task[None] | None
    _handles: set[asyncio.Task[Any]]
    _home_loop: asyncio.AbstractEventLoop | None
    _heartbeat_timeout: float
    _pauses: PauseWatch | None
    _waiters: dict[ps.Waiter, asyncio.Future[Any]]
    _plane: DataPlane
    metrics: PeerMetrics

    @property
    def state(self) -> PeerState:
        """This peer's membership status."""
        return self._m.status

    @property
    def peer_id(self) -> int | None:
        """The id the master gave this peer (None before the handshake)."""
        return self._m.peer_id

    def _where(self) -> str:
        masters = self.options.masters
        return (f"the master at {masters[0]}" if len(masters) == 1 else
                f"any of the masters {', '.join(masters)}")

    async def _reach(self, addr: str, timeout: float) -> tuple[FramedConnection, m.Challenge]:
        """A connection to the master at ``addr``, up to its challenge."""
        host, port = split_host_port(addr)
        conn: FramedConnection | None = None
        try:
            async with asyncio.timeout(timeout):
                reader, writer = await asyncio.open_connection(host, port)
                conn = FramedConnection(reader, writer, max_frame=self.options.max_frame)
                self._reread_secret()  # (a rotated secret file: registered with the new one)
                await conn.dial(self.secret, insecure=self.options.insecure,
                                identity=self.identity, group="master", also=self.secrets.also())
                challenge = await conn.recv()
        except TimeoutError:
            if conn is not None:
                conn.abort()
            raise MasterConnectionError(
                f"the master at {addr} did not answer within {timeout:.3g}s") from None
        except OSError as e:
            raise MasterConnectionError(f"could not connect to the master at {addr} ({e})"
                                        ) from None
        except ConnectionClosed as e:
            assert conn is not None
            conn.abort()
            raise MasterConnectionError(f"the master at {addr} closed the connection during "
                                        f"the handshake ({e})") from None
        except Exception:
            if conn is not None:
                await conn.close()  # (a FIN, not a reset: the other side may not be pccl)
            raise
        except BaseException:
            if conn is not None:
                conn.abort()
            raise
        if not isinstance(challenge, m.Challenge):
            await conn.close()
            raise ProtocolError(f"expected a challenge, the master sent {challenge.TYPE}")
        if not compatible((PROTOCOL_VERSION, MIN_PROTOCOL_VERSION),
                          (challenge.version, challenge.min_version or challenge.version)):
            await conn.close()
            raise ProtocolError(version_mismatch(challenge))
        if challenge.auth and self.secret is None:
            await conn.close()
            raise AuthenticationError("the master requires a shared secret; "
                                      "pass secret= to the Communicator")
        return conn, challenge

    async def _dial_master(self, timeout: float) -> tuple[FramedConnection, m.Challenge]:
        """A connection (up to its challenge) to the master to register with: the only
        one, or of several the first that holds this peer's group (its challenge says),
        else the first that answers and is not a standby (else the first that answers).
        A master that just sent this peer elsewhere (no quorum there) comes last either
        way. Raises :class:`MasterConnectionError` when none answers.

        Several masters are asked at once. A master that holds the group (and did not
        just send this peer away) is taken as soon as it answers; otherwise the scan
        waits for the others at most :meth:`_scan_grace` after the first answer (and
        never past half of ``timeout``), so a master whose host vanished (no reset: its
        dial would hang until ``timeout``) delays a failover by that grace, not by
        ``timeout``. (Asked one after the other, a vanished first master used up a
        rejoin attempt's whole ``timeout``, and the peers never reached the standby.)"""
        masters, group = self.options.masters, self.options.peer_group
        if len(masters) == 1:
            self._master_addr = masters[0]
            return await self._reach(self._master_addr, timeout)
        order = sorted(masters, key=lambda a: a == self._elsewhere)  # stable
        loop = asyncio.get_running_loop()
        started = loop.time()
        tasks = {asyncio.create_task(self._reach(a, timeout), name=f"pccl-reach-{a}"): a
                 for a in order}
        answers: dict[str, tuple[FramedConnection, m.Challenge]] = {}
        errors: list[str] = []
        # A master that is not pccl, speaks another protocol version or wants another
        # secret is skipped while another one answers; if none does, its typed error.
        refused: list[PCCLError] = []
        chosen: str | None = None
        until: float | None = None
        scanned = False
        try:
            pending = set(tasks)
            while pending and chosen is None:
                wait = None if until is None else max(0.0, until - loop.time())
                done, pending = await asyncio.wait(pending, timeout=wait,
                                                   return_when=asyncio.FIRST_COMPLETED)
                if not done:
                    break  # the grace after the first answer is over
                for t in sorted(done, key=lambda t: order.index(tasks[t])):
                    addr = tasks[t]
                    try:
                        answers[addr] = t.result()
                    except MasterConnectionError as e:
                        errors.append(str(e))
                        continue
                    except (ProtocolError, AuthenticationError) as e:
                        refused.append(type(e)(f"the master at {addr}: {e}"))
                        continue
                    if group in answers[addr][1].groups \
                            and addr != self._elsewhere:
                        chosen = addr
                        break
                    if until is None:  # (half the timeout at most: a second dial follows)
                        until = min(loop.time() + self._scan_grace(loop.time() - started),
                                    started + timeout / 2)
            scanned = True
        finally:
            for t in tasks:
                t.cancel()
            results = await asyncio.gather(*tasks, return_exceptions=True)
            # Every connection made but not kept is closed (a FIN: a master logs it and
            # moves on): those looked at, and those whose dial ended in the same wait as
            # the chosen one's or just as this scan was cancelled (never looked at).
            spare = [got[0] for addr, got in zip(tasks.values(), results, strict=True)
                     if isinstance(got, tuple) and (addr != chosen or not scanned)]
            for conn in spare:
                conn.start_close()  # all of them now, even if cancelled again below
            for conn in spare:
                await conn.close()
        if chosen is not None:
            self._master_addr = chosen
            return answers[chosen]
        if not answers:
            if refused:
                raise refused[0]
            raise MasterConnectionError("; ".join(errors) or
                                        f"none of {', '.join(order)} answered")
        # A holder of the group here is the one that just sent this peer away (another
        # was taken at once). Else not that one, then not a standby, in the list's order.
        # Dialled again: the first connection may have waited past the master's
        # handshake timeout.
        holders = [a for a in order if a in answers and group in answers[a][1].groups]
        if holders:
            self._master_addr = holders[0]
        else:
            self._master_addr = min(answers, key=lambda a: (
                a == self._elsewhere, answers[a][1].standby, order.index(a)))
            log.info("no master holds peer group %d; registering with %s", group,
                     self._master_addr)
        return await self._reach(self._master_addr, timeout)

    @staticmethod
    def _scan_grace(first_answer: float) -> float:
        """How long a scan of several masters waits for the others once one answered
        without holding this peer's group: three times that answer's time, at least
        1 s (the scan bounds it by half its timeout). A live master answers about as
        fast as the first one did; a vanished one never does."""
        return max(1.0, 3.0 * first_answer)

    async def _open(self, n_attempts: int) -> None:
        delay = 0.05
        last: BaseException | None = None
        for attempt in range(n_attempts):
            try:
                conn, challenge = await self._dial_master(self.options.timeout)
                break
            except MasterConnectionError as e:
                last = e
                log.debug("connect attempt %d/%d to %s failed: %s", attempt + 1, n_attempts,
                          self._where(), e)
                if attempt + 1 < n_attempts:
                    await asyncio.sleep(delay)  # back-off between attempts, not a sync point
                    delay = min(delay * 2, 2.0)
        else:
            raise MasterConnectionError(
                f"could not reach {self._where()} after {n_attempts} attempts "
                f"({last}); is it running and is the address right?")
        self._conn = conn
        if self._node is None:  # (a peer sent to another master keeps its listener)
            local_host = conn.writer.get_extra_info("sockname")[0]
            o = self.options
            self._node = await _core.P2PNode.bind(
                0, o.p2p_listen_host or local_host, o.p2p_listen_port, self.secret,
                handshake_timeout=o.p2p_timeout, connect_timeout=o.p2p_timeout,
                insecure=o.insecure, identity=self.identity)
            self._use_secrets()
        await self._handshake(conn, challenge)

    async def _handshake(self, conn: FramedConnection, challenge: m.Challenge) -> None:
        assert self._node is not None
        o = self.options
        conn.peer_max_frame = max(0, challenge.max_frame)
        self._master_protocol = challenge.version
        nonce = _secrets.token_bytes(16)
        try:
            async with asyncio.timeout(o.timeout):
                # (Encrypted, the handshake proved the secret: the MACs are for clear text.)
                mac = (peer_mac(self.secret, challenge.nonce, nonce)
                       if self.secret and conn.session is None else b"")
                adv_host, adv_port = o.p2p_advertise_host or "", int(self._node.port)
                if o.p2p_advertise_address:
                    adv_host, adv_port = split_host_port(o.p2p_advertise_address)
                resume_id, resume_epoch, resume_revision, resume_peers = self._m.resume()
                (base_epoch, base_peers), more = (self._m.resume_base() if resume_id
                                                  else ((0, []), []))
                await conn.send(fit_hello(m.Hello(
                    version=PROTOCOL_VERSION, peer_group=o.peer_group,
                    p2p_port=adv_port, p2p_host=adv_host, nonce=nonce, mac=mac,
                    resume_peer_id=resume_id, resume_epoch=resume_epoch,
                    resume_revision=resume_revision, resume_peers=resume_peers,
                    allow_relay=o.allow_relay,
                    p2p_punch_ports=[int(p) for p in self._node.punch_ports],
                    masters=len(o.masters), resume_base_epoch=base_epoch,
                    resume_base_peers=base_peers, resume_more_epochs=[e for e, _ in more],
                    resume_more_peers=[r for _, r in more], name=o.name or "",
                    run_id=o.run_id or "",
                    local_addrs=self._local_addrs(conn))))
                reply = await conn.recv()
        except TimeoutError:
            raise MasterConnectionError(
                f"the master at {self._master_addr} did not complete the handshake in "
                f"{o.timeout}s") from None
        except ConnectionClosed as e:
            raise MasterConnectionError(f"the master closed the connection during the "
                                        f"handshake ({e})") from None
        if isinstance(reply, m.Reject):
            raise ErrorKind.parse(reply.kind, ErrorKind.MasterConnectionError).error(
                reply.message)
        if not isinstance(reply, m.Welcome):
            raise ProtocolError(f"expected welcome, the master sent {reply.TYPE}")
        if self.secret is not None and conn.session is None and not hmac.compare_digest(
                reply.mac, master_mac(self.secret, challenge.nonce, nonce)):
            raise AuthenticationError("the master could not prove it knows the shared secret")
        self._heartbeat_timeout = reply.heartbeat_timeout
        # The p2p node learns its id now; streams are only dialed after this point.
        self._node.set_peer_id(reply.peer_id)
        where = "".join(c for c in reply.p2p_address[:80] if c.isprintable())
        log.info("peer %d%s: registered with the master at %s (group %d, %s, p2p %s, %s; "
                 "%s, key %s)", reply.peer_id, f" {o.name!r}" if o.name else "",
                 self._master_addr, o.peer_group, f"run {o.run_id!r}" if o.run_id else "no run id",
                 where or f"port {self._node.port}",
                 "reachable from the master: others dial it" if reply.reachable else
                 "NOT reachable from the master (NAT or a firewall): its ring links come by "
                 "reverse connection, hole punch, LAN or relay",
                 "encrypted" if conn.session is not None else "clear text",
                 self.identity.fingerprint)
        self._waiters[ps.ACCEPT] = asyncio.get_running_loop().create_future()
        self._feed(ps.Welcomed(reply.peer_id))
        self._reader = asyncio.create_task(self._read_loop(conn), name=f"pccl-peer-{self.peer_id}")
        if self._pauses is None:
            self._pauses = PauseWatch(PAUSE_TICK, awake_clock())
            self._spawn(self._watch_pauses(self._pauses), f"pccl-pauses-{self.peer_id}")

    async def _watch_pauses(self, watch: PauseWatch) -> None:
        """Ticks ``watch`` for the communicator's lifetime (see :mod:`pccl.peer.pause`)."""
        while True:
            await asyncio.sleep(watch.interval)
            watch.tick(awake_clock())

    def _paused(self) -> str | None:
        """What to say instead of "lost the master" when this process itself did not run
        for a good part of the master's heartbeat timeout just now; None otherwise."""
        if self._pauses is None:
            return None
        hb = self._heartbeat_timeout
        paused = self._pauses.paused_for(awake_clock(), within=max(hb, 2 * PAUSE_TICK))
        return describe(paused, hb) if paused > hb / 2 else None

    def _local_addrs(self, conn: FramedConnection) -> list[str]:
        """Where a neighbour behind the same NAT can dial this peer's listener: the
        address it listens on, or, listening on every interface, the local address of
        the connection to the master (the interface on the way out: behind NAT, the
        LAN). Only a private address (the master refuses any other): none on loopback
        or with a public address, where there is no NAT to get around."""
        host = self.options.p2p_listen_host or ""
        if host in ("", "0.0.0.0", "::"):
            host = str(conn.writer.get_extra_info("sockname")[0])
        return [host] if is_lan_address(host) else []

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

    async def _answer(self, call: ps.ReduceCall | ps.SyncCall) -> Any:
        """The machine's answer to ``call``. A caller that gives up withdraws the call
        (:class:`pccl.peer.state.Cancelled`) and waits, at most ``timeout``, until the
        machine has ended it (a success the group decided before is applied then);
        ``CancelledError`` goes on after that."""
        fut = self._future(call)
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            if not fut.done():
                self._feed(ps.Cancelled(call))
                try:
                    if not fut.done():
                        with contextlib.suppress(TimeoutError):
                            async with asyncio.timeout(self.options.timeout):
                                await asyncio.wait([fut])
                finally:
                    if not fut.done():
                        self._feed(ps.CallExpired(call))
            raise

    def _do(self, c: ps.Command) -> None:
        if isinstance(c, ps.Send):
            if self._conn is not None:
                self._conn.send_nowait(c.msg)
        elif isinstance(c, (ps.Resolve, ps.Fail)):
            fut = self._future(c.waiter)
            if fut.done():
                # Answered again (an admission per registration): the caller picks the
                # new future up.
                fut = self._waiters[c.waiter] = asyncio.get_running_loop().create_future()
            if isinstance(c, ps.Resolve):
                fut.set_result(c.value)
            else:
                fut.set_exception(c.kind.error(c.message))
                fut.exception()  # nobody may be awaiting it (e.g. after connect())
            if isinstance(c.waiter, ps.ReduceCall):
                self._plane.reduces.pop(c.waiter.tag, None)  # its last command
        elif isinstance(c, DATA_PLANE_COMMANDS):
            self._plane.execute(c)
        elif isinstance(c, ps.InstallRing):
            self._spawn(self._install(c), f"pccl-topology-{self.peer_id}-{c.epoch}")
        elif isinstance(c, ps.Establish):
            self._spawn(self._establish(c), f"pccl-establish-{self.peer_id}-{c.msg.epoch}")
        elif isinstance(c, ps.Probe):
            self._spawn(self._probe(c), f"pccl-probe-{self.peer_id}")
        elif isinstance(c, ps.OpenRelay):
            self._spawn(self._open_relay(c), f"pccl-relay-{self.peer_id}")
        elif isinstance(c, ps.Rejoin):
            self._waiters[ps.REJOIN] = asyncio.get_running_loop().create_future()
            self._spawn(self._rejoin(), f"pccl-rejoin-{self.peer_id}")
        elif isinstance(c, ps.Log):
            if self.state is not PeerState.CLOSED:
                log.log(logging.INFO if c.info else logging.WARNING, "%s", c.message)
        else:  # pragma: no cover - the type union is closed
            raise TypeError(c)

    def _spawn(self, coro: Any, name: str) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _read_loop(self, conn: FramedConnection) -> None:
        try:
            while True:
                try:
                    async with asyncio.timeout(self._heartbeat_timeout):
                        msg = await conn.recv()
                except TimeoutError:
                    raise MasterConnectionError(self._paused() or (
                        f"no word from the master for {self._heartbeat_timeout}s")) from None
                except ConnectionClosed as e:
                    raise MasterConnectionError(self._paused() or (
                        f"lost the connection to the master ({e})")) from None
                self._dispatch(msg)
                if not self._m.connected:
                    return  # the machine gave this connection up (a Reject, garbage)
                self._reread_secret()
        except PCCLError as e:
            self._feed(ps.MasterLost(str(e)))

    def _reread_secret(self) -> None:
        """Picks up a rotated secret: a secret file that changed, or older secrets whose
        grace ran out (at most once a second)."""
        now = time.monotonic()
        if now - self._secrets_checked < 1.0:
            return
        self._secrets_checked = now
        try:
            rotated = self.secrets.reread(now)
        except InvalidArgumentError as e:
            log.error("peer %s: the secret file changed, but this peer keeps its secret: %s",
                      self.peer_id, e)
            return
        if rotated:
            log.warning("peer %s: the shared secret was rotated (%s): connections use the new "
                        "one from now on; the previous one is still accepted for %.0fs",
                        self.peer_id, self.secrets.path, self.secrets.grace)
        if rotated or len(self.secrets.also(now)) != self._secrets_held:
            self._use_secrets()

    def _use_secrets(self) -> None:
        """Hands the current secret and the older ones still accepted to the p2p node."""
        self.secret = self.secrets.current
        also = self.secrets.also()
        self._secrets_held = len(also)
        if self._node is not None and self.secret is not None and not self.options.insecure:
            self._node.set_secrets(self.secret, also)

    def _dispatch(self, msg: m.Message) -> None:
        """One message from the master into the machine (tests hold some back here:
        :class:`pccl.testing.HeldMessage`)."""
        if isinstance(msg, m.Denylist):
            self._install_denylist(msg.data)
            return
        if isinstance(msg, m.Shutdown):
            reason = "".join(c for c in msg.reason if c.isprintable())[:200]
            if msg.final:
                self._feed(ps.MasterLost(f"the master ended the run ({reason})",
                                         may_rejoin=False))
            else:
                self._feed(ps.MasterLost(f"the master stopped on purpose ({reason}) and is "
                                         "expected back (a restart or an upgrade, not a "
                                         "crash)"))
            return
        if isinstance(msg, (m.EstablishP2P, m.SyncPlan, m.ProbeRequest)) and msg.key_ids:
            self._learn_keys(msg.key_ids, msg.keys)
        if isinstance(msg, m.Reject) and msg.elsewhere:
            self._elsewhere = self._master_addr  # no quorum there: try the others first
        self._feed(ps.FromMaster(msg))

    def _learn_keys(self, ids: list[int], keys: list[bytes]) -> None:
        """The roster's static keys of the peers a message names: the p2p node checks
        that every stream to or from them proves the key."""
        if self._node is None:
            return
        try:
            self._node.set_peer_keys(dict(zip(ids, keys, strict=False)))
        except PCCLError as e:
            log.warning("peer %s: the master's roster was refused: %s", self.peer_id, e)

    def _install_denylist(self, data: bytes) -> None:
        """A denylist from the master: installed if a run key this peer trusts signed
        it and it is newer than the one held (the master cannot forge one)."""
        try:
            if self.identity.install_denylist(data):
                log.warning("peer %s: denylist version %d installed; its keys are refused "
                            "from now on", self.peer_id, self.identity.denylist_version)
        except PCCLError as e:
            log.warning("peer %s: a denylist from the master was refused: %s",
                        self.peer_id, e)

    async def _rejoin(self) -> None:
        """Registers with the master again (a restarted one, or the same one after it
        dropped this peer) until admitted or ``reconnect_timeout`` runs out."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.options.reconnect_timeout
        old, self._conn = self._conn, None
        if old is not None:
            old.abort()
        delay = 0.05
        last: object = self._m.lost[1] if self._m.lost else None
        paused = self._paused()
        log.warning("peer %s: %s; registering again for up to %.1fs", self.peer_id,
                    paused or f"lost the master ({last})", self.options.reconnect_timeout)
        while loop.time() < deadline:
            conn: FramedConnection | None = None
            try:
                async with asyncio.timeout(min(self.options.timeout, deadline - loop.time())):
                    conn, challenge = await self._dial_master(self.options.timeout)
                    self._conn = conn
                    await self._handshake(conn, challenge)
                async with asyncio.timeout(max(deadline - loop.time(), 0.0)):
                    await self._waiters[ps.ACCEPT]
            except (AuthenticationError, ProtocolError, InvalidUsageError) as e:
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
            self._elsewhere = None
            return  # accepted: the machine answered the calls waiting for this
        if self._conn is not None:
            await self._drop_conn(self._conn)
        if isinstance(last, (AuthenticationError, ProtocolError, InvalidUsageError)):
            # (An answer, not silence: say what it was, as its own kind, not a timeout.)
            why = (f"{self._where()} refused this peer's registration after "
                   f"{self.options.reconnect_timeout - max(deadline - loop.time(), 0.0):.1f}s, and "
                   f"retrying cannot help: {last}")
            self._feed(ps.RejoinFailed(why, ErrorKind.of(last)))
        else:
            why = (f"could not register with {self._where()} again within "
                   f"{self.options.reconnect_timeout}s ({last})")
            self._feed(ps.RejoinFailed(why))
        log.error("peer %s: %s", self.peer_id, why)

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

    def _check_fits(self, msg: m.Message, what: str) -> None:
        """InvalidUsageError when ``msg`` is more than the master reads in one frame
        (its challenge said how much), or has a name longer than it accepts: told here,
        instead of the master dropping this peer for it."""
        conn = self._conn
        limit = conn.peer_max_frame if conn is not None else 0
        size = len(encode(msg))
        if limit and size > limit:
            raise InvalidUsageError(
                f"{what} takes {size} bytes, more than the master reads in one message "
                f"({limit}): start the master with a larger max_frame "
                "(MasterNode(max_frame=), PCCL_MAX_FRAME), or use fewer, larger tensors")
        if isinstance(msg, m.SyncInit):
            long = [k for k in msg.keys if len(k) > MAX_STR]
            if long:
                raise InvalidUsageError(
                    f"shared-state key {long[0][:60]!r}... has {len(long[0])} characters; "
                    f"the master accepts at most {MAX_STR}")

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

    async def _establish(self, c: ps.Establish) -> None:
        assert self._node is not None
        msg = c.msg
        node = self._node
        node.retain_from_epoch(msg.epoch)
        failed: list[int] = []

        mesh_failed: list[int] = []
        dials: list[float] = []

        async def outbound(to: int, to_addr: str, route: str, token: bytes, size: int,
                           mesh: bool) -> None:
            addr = self._master_addr if route == "relay" else to_addr
            started = time.perf_counter()
            try:
                await node.connect_pool(addr, to, msg.epoch, size, route=route,
                                        token=token or None, relay=self._master_addr, mesh=mesh)
            except PCCLError as e:
                log.warning("peer %s: p2p %s pool to peer %d (%s %s) failed: %s",
                            self.peer_id, "mesh" if mesh else "ring", to, route, to_addr, e)
                (mesh_failed if mesh else failed).append(to)
                return
            if route == "direct":  # (a latency measurement of the link itself)
                dials.append(time.perf_counter() - started)

        async def inbound(frm: int, frm_addr: str, route: str, token: bytes,
                          mesh: bool) -> None:
            if route == "direct":
                return  # the sender dials us
            addr = self._master_addr if route == "relay" else frm_addr
            try:
                await node.open_inbound(route, addr, token, relay=self._master_addr)
            except PCCLError as e:
                # The sender's side reports the link (as for direct links); a mesh link
                # is reported by both (either side failing turns the mesh off).
                log.warning("peer %s: p2p %s pool from peer %d (%s %s) failed: %s",
                            self.peer_id, "mesh" if mesh else "ring", frm, route, addr, e)
                if mesh:
                    mesh_failed.append(frm)

        links = []
        if msg.next_id >= 0:
            links.append(outbound(msg.next_id, msg.next_addr, msg.route, msg.token,
                                  self.options.p2p_connection_pool_size, False))
        if msg.prev_id >= 0:
            links.append(inbound(msg.prev_id, msg.prev_addr, msg.prev_route, msg.prev_token,
                                 False))
        for q, addr, route, token in zip(msg.mesh_ids, msg.mesh_addrs, msg.mesh_routes,
                                         msg.mesh_tokens, strict=False):
            links.append(outbound(q, addr, route, token, 1, True))
        for q, addr, route, token in zip(msg.mesh_ids, msg.mesh_in_addrs, msg.mesh_in_routes,
                                         msg.mesh_in_tokens, strict=False):
            links.append(inbound(q, addr, route, token, True))
        await asyncio.gather(*links)
        self._feed(ps.PoolsEstablished(msg.epoch, c.generation, tuple(failed),
                                       tuple(mesh_failed), tuple(dials)))

    async def _install(self, c: ps.InstallRing) -> None:
        """Takes over the ring links of a new epoch."""
        assert self._node is not None
        error = ""
        try:
            await self._node.install_ring(c.epoch, c.next_id, c.prev_id,
                                          pool_timeout=self.options.p2p_timeout,
                                          io_timeout=self.options.peer_timeout,
                                          max_piece=max(self.options.piece_bytes, 1 << 16),
                                          ring=list(c.mesh_order) or None,
                                          mesh_max_bytes=c.mesh_max_bytes)
        except PCCLError as e:
            error = str(e) or type(e).__name__
        self._feed(ps.RingInstalled(c.epoch, c.generation, error))

    async def _open_relay(self, c: ps.OpenRelay) -> None:
        """Serves one relayed transfer stream (a fetcher that cannot dial this peer)."""
        assert self._node is not None
        try:
            await self._node.open_inbound("relay", self._master_addr, c.token, stream=c.stream)
        except PCCLError as e:
            log.warning("peer %s: serving shared state through the relay failed: %s",
                        self.peer_id, e)

    async def _probe(self, c: ps.Probe) -> None:
        assert self._node is not None
        rates, dials = [], []
        for target, addr in zip(c.msg.target_ids, c.msg.target_addrs):
            try:
                rate, dial = await self._node.probe(addr, target, seconds=c.msg.seconds,
                                                    streams=self.options.p2p_connection_pool_size,
                                                    io_timeout=self.options.peer_timeout)
            except PCCLError as e:
                log.warning("peer %s: probe to peer %d failed: %s", self.peer_id, target, e)
                rate, dial = 0.0, -1.0
            # (the codec refuses non-finite floats: an instant probe is "not measured")
            rates.append(float(rate) if math.isfinite(rate) else 0.0)
            dials.append(float(dial) if math.isfinite(dial) else -1.0)
        self._feed(ps.Probed(tuple(c.msg.target_ids), tuple(rates), c.generation,
                             tuple(dials)))

    def _wire_timeout(self, timeout: Any) -> float:
        """The deadline a collective call sends the master (0.0: none)."""
        t = self.options.collective_timeout if timeout is DEFAULT_TIMEOUT else check_deadline(
            timeout, "timeout")
        return 0.0 if t is None else t

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
                async with asyncio.timeout(self.options.timeout):
                    answer = await fut
        except TimeoutError:
            raise MasterConnectionError(
                f"the master did not answer within {self.options.timeout}s") from None
        finally:
            self._end(ps.EndQuery(req), ps.query_of(req))
        if not answer.ok:
            raise ErrorKind.parse(answer.kind).error(answer.message)
        return answer

    def _start_all_reduce(self, init: m.CollectiveInit, early: bool, q: QuantizationOptions,
                          src: RawTensor, dst: RawTensor, op: ReduceOp, *,
                          gather: bool = False) -> ReduceRun:
        """Hands a new all-reduce (or all-gather) to the machine (its ring may start at
        once: the tensors are registered first)."""
        before = self._plane.reduces.get(init.tag)  # (a call with this tag in flight: refused)
        run = self._plane.reduces[init.tag] = ReduceRun(q, src, dst, op, gather=gather)
        try:
            self._feed(ps.StartCollective(init, early))
            # (A late answer to an earlier call of the tag, ended when its caller gave
            # up, may have left a future; this call's answer cannot have come yet.)
            self._waiters.pop(ps.reduce_of(init.tag), None)
        except BaseException:
            if before is None:
                del self._plane.reduces[init.tag]
            else:
                self._plane.reduces[init.tag] = before
            raise
        return run

    async def _run_collective(self, tag: int, run: ReduceRun) -> tuple[ps.Reduced, int, int, str]:
        """One collective started by :meth:`_start_all_reduce`, counted in :attr:`metrics`
        (outcome, time, bytes per link): ``(done, tx, rx, algorithm)``."""
        started = time.perf_counter()
        ring = list(self._m.ring)
        call = ps.reduce_of(tag)
        try:
            done: ps.Reduced = await self._answer(call)
        except BaseException:
            self.metrics.collectives.labels("failed").inc()
            raise
        finally:
            self._waiters.pop(call, None)
        self.metrics.collectives.labels("ok").inc()
        self.metrics.collective_seconds.observe(time.perf_counter() - started)
        if done.via == "master":  # the bytes went to the master and back
            rx = len(run.gathered or b"") if run.gather else run.dst.nbytes
            return done, run.src.nbytes, rx, "master"
        if done.via == "local":
            return done, 0, 0, "local"
        if run.algorithm == "ring":
            # (The master's bytes are not a ring link's; the mesh's go to its partners.)
            self.metrics.ring_traffic(list(self._m.ring) or ring, self.peer_id, run.tx, run.rx)
        return done, run.tx, run.rx, run.algorithm

    async def _run_all_reduce(self, tag: int, run: ReduceRun) -> ReduceInfo:
        done, tx, rx, algorithm = await self._run_collective(tag, run)
        return ReduceInfo(tx_bytes=int(tx), rx_bytes=int(rx), world_size=done.world,
                          algorithm=algorithm)

    async def _run_all_gather(self, tag: int, run: ReduceRun) -> GatherInfo:
        done, tx, rx, algorithm = await self._run_collective(tag, run)
        data, world, n = run.gathered, done.world, run.src.nbytes
        if done.via == "master" and data is not None and len(data) == (world - 1) * n \
                and self.peer_id in done.peers:
            # The master sends each member the others' bytes: ours go into our slot.
            at = done.peers.index(self.peer_id) * n
            data[at:at] = bytes(run.src.data)
        if data is None or len(data) != world * run.src.nbytes \
                or len(done.peers) not in (0, world):
            # (Only a master that broke the protocol gets here: its outcome had the
            # wrong length or slots, and a broken master fails every peer it answers.)
            raise ProtocolError(
                f"all-gather tag {tag}: {0 if data is None else len(data)} bytes gathered "
                f"from {len(done.peers)} peers, expected {world} x {run.src.nbytes}")
        return GatherInfo(data=data, world_size=world, tx_bytes=int(tx), rx_bytes=int(rx),
                          peers=done.peers, algorithm=algorithm)

    async def _run_sync(self, state: SharedState, strategy: SharedStateSyncStrategy,
                        in_place: bool, progress: Callable[[SyncProgress], object] | None,
                        progress_interval: float, timeout: Any) -> SyncInfo:
        """One shared-state sync, counted in :attr:`metrics`."""
        started = time.perf_counter()
        try:
            info = await self._sync_state(state, strategy, in_place, progress,
                                          progress_interval, timeout)
        except BaseException:
            self.metrics.syncs.labels("failed").inc()
            raise
        finally:
            self.metrics.sync_progress = None
        self.metrics.syncs.labels("ok").inc()
        self.metrics.sync_seconds.observe(time.perf_counter() - started)
        self.metrics.tx_bytes += info.tx_bytes
        self.metrics.rx_bytes += info.rx_bytes
        return info

    async def _sync_state(self, state: SharedState, strategy: SharedStateSyncStrategy,
                          in_place: bool, progress: Callable[[SyncProgress], object] | None,
                          progress_interval: float, timeout: Any) -> SyncInfo:
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
        init = m.SyncInit(
            revision=int(state.revision), strategy=int(strategy),
            keys=[i.name for i in state.infos], dtypes=[int(r.dtype) for r in raws],
            counts=[r.count for r in raws], hashes=list(hashes),
            unequal=[bool(i.allow_content_inequality) for i in state.infos], timeout=wire)
        self._check_fits(init, f"the shared state's description ({len(raws)} tensors)")
        self._feed(ps.StartSync(init))  # (refused while another sync runs)
        self._waiters.pop(ps.SYNC, None)  # (see _start_all_reduce)
        run = self._plane.sync_run = SyncRun(state, by_key, in_place, progress, progress_interval,
                                       node.bytes_served())
        for info, raw in zip(state.infos, raws):
            node.serve(info.name, raw.data)
        try:
            try:
                await self._answer(ps.SYNC)
            except PCCLError:
                if run.error is not None:
                    raise run.error from None  # a bug in a fetch, not the network's doing
                raise
            rx = sum(int(a.nbytes) for a in run.fetched.values())
            return SyncInfo(tx_bytes=int(node.bytes_served() - run.served_before), rx_bytes=rx)
        finally:
            self._waiters.pop(ps.SYNC, None)
            run.ended.set()
            if run.fetch is not None:
                # (Done fetching: the machine stopped a fetch before ending the call.)
                await asyncio.wait([run.fetch])
            self._plane.sync_run = None
            if self._node is not None:
                self._node.unserve_all()
                self._node.drop_idle_transfers()
