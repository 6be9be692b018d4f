"""A stranger without the shared secret against every open port of a running group: the
master's control port, and each peer's p2p port (ring, shared-state transfer and probe
streams all arrive there). Scripted: every control message kind, every p2p stream kind,
in clear text and through the secure handshake (Noise XX / XXpsk3) with a wrong key or
none, up to its hello or all the way through its identity message. Each attempt is
refused, and all the stranger ever receives is at most a one-byte status, a handshake
reply (the listener's ephemeral and static public keys) and a one-byte verdict: never a
peer id, an address, a revision, a hash or a tensor byte. The group is unharmed (an
exact all-reduce afterwards)."""

from __future__ import annotations

import asyncio
import contextlib
import struct

import numpy as np
import pytest
from message_examples import EXAMPLES

import pccl
from pccl import _core
from pccl.protocol import codec
from pccl.protocol.transport import PROLOGUE
from pccl.testing import Cluster

# Shared secrets are keys of at least 128 random bits (pccl.identity.check_secret).
SECRET = b"5f0c1a9e7d3b42c8a6e1f0b97c2d4e3a"
GUESS = b"c0ffee00d15ea5e5b16b00b5a11ce0de"  # a stranger's (strong, but wrong) secret
# The handshake reply of a listener (Noise XX message 2, "e, ee, s, es"), framed: a
# status byte, which offered secret it takes, its ephemeral key, its static public key
# (encrypted, with a tag) and its
# certificate payload's tag (no certificates here). The static key is public by nature:
# an active dialer learns it in XX (the shared secret is mixed in only at message 3), and
# nothing of the group is in it.
MAX_REPLY = 4 + 1 + 1 + 32 + (32 + 16) + 16
# The listener's verdict on the dialer's identity message (message 3), framed: one
# status byte.
VERDICT = 4 + 1
# The p2p streams' handshake context (rust/net/stream.rs PROLOGUE).
P2P_PROLOGUE = b"pccl p2p v2"


async def _talk(address: str, sends: list[bytes]) -> bytes:
    """Connects, writes each of ``sends``, then reads until the other end hangs up
    (bounded). Returns everything received."""
    host, port = address.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    got = bytearray()
    try:
        for data in sends:
            writer.write(data)
        with contextlib.suppress(ConnectionError):
            await writer.drain()
        async with asyncio.timeout(15):
            while chunk := await reader.read(1 << 16):
                got += chunk
    except ConnectionError:
        pass
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()
    return bytes(got)


def _frame(body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + body


def _secure_hello(secret: bytes | None, prologue: bytes) -> bytes:
    return _frame(_core.SecureHandshake(True, secret, prologue).hello())


async def _read_frame(reader: asyncio.StreamReader) -> bytes:
    n = struct.unpack(">I", await reader.readexactly(4))[0]
    assert n <= _core.MAX_HANDSHAKE_FRAME, n
    return await reader.readexactly(n)


async def _secure_stranger(address: str, secret: bytes | None,
                           prologue: bytes) -> tuple[bytes, BaseException | None]:
    """A stranger that runs the secure handshake as far as the listener lets it: its
    hello, then (on an OK reply) its identity message with a fresh key, then the
    listener's verdict. Returns everything received (framed, as on the wire) and the
    handshake's error (None if it passed, which it must not)."""
    host, port = address.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    hs = _core.SecureHandshake(True, secret, prologue)
    got = bytearray()
    error: BaseException | None = None
    try:
        async with asyncio.timeout(15):
            writer.write(_frame(hs.hello()))
            while not hs.done:
                frame = await _read_frame(reader)
                got += _frame(frame)
                out, error = hs.on_frame(frame)
                if out is not None:
                    writer.write(_frame(out))
                if error is not None:
                    break
            # Whatever else the listener sends before it hangs up.
            while chunk := await reader.read(1 << 16):
                got += chunk
    except (ConnectionError, asyncio.IncompleteReadError) as e:
        error = error or e
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()
    return bytes(got), error


def _p2p_hello(purpose: int) -> bytes:
    """A p2p stream hello (``rust/net/handshake.rs``) claiming to be peer 1 dialing
    peer 2, with a made-up MAC."""
    body = (b"PCCLP2P\x01" + struct.pack(">HQQQHHB", 1, 1, 2, 1, 0, 0, purpose)
            + b"\x00" * 16 + b"\x00" * 32)
    return _frame(body)


def _leaks(got: bytes, cluster: Cluster) -> list[str]:
    found = []
    for c in cluster.comms:
        if str(c.p2p_port).encode() in got:
            found.append(f"p2p port of peer {c.peer_id}")
    for word in (b"127.0.0.1", b"peer", b"ring", b"revision", b"t\xa7welcome"):
        if word in got:
            found.append(repr(word))
    return found


@pytest.fixture
async def group():
    async with Cluster(3, secret=SECRET) as cluster:
        yield cluster
        # Unharmed: the group still reduces exactly.
        xs = [np.full(1024, i + 1, np.float32) for i in range(3)]
        async with asyncio.timeout(30):
            await asyncio.gather(*(c.all_reduce(x) for c, x in zip(cluster.comms, xs)))
        for x in xs:
            np.testing.assert_array_equal(x, np.full(1024, 6, np.float32))


def _master_scripts() -> dict[str, list[bytes]]:
    scripts: dict[str, list[bytes]] = {}
    for msg in EXAMPLES:  # every control message kind, in clear text, first thing
        scripts[f"clear-{msg.TYPE}"] = [codec.frame(msg)]
    scripts["clear-hello-then-register"] = [_frame(_core.CLEAR_HELLO),
                                            *(codec.frame(x) for x in EXAMPLES[:2])]
    scripts["secure-no-secret"] = [_secure_hello(None, PROLOGUE)]
    scripts["secure-wrong-secret"] = [_secure_hello(GUESS, PROLOGUE)]
    scripts["secure-p2p-prologue"] = [_secure_hello(GUESS, P2P_PROLOGUE)]
    scripts["noise"] = [bytes(range(256)) * 4]
    return scripts


MASTER_SCRIPTS = _master_scripts()


@pytest.mark.parametrize("script", sorted(MASTER_SCRIPTS))
async def test_a_stranger_at_the_master_learns_nothing(group: Cluster, script: str) -> None:
    before = (group.master.state.accepted(), group.master.state.pending())
    got = await _talk(group.master.address, MASTER_SCRIPTS[script])
    assert len(got) <= MAX_REPLY, (script, got)
    assert not _leaks(got, group), (script, _leaks(got, group))
    assert (group.master.state.accepted(), group.master.state.pending()) == before


def _p2p_scripts() -> dict[str, list[bytes]]:
    scripts: dict[str, list[bytes]] = {}
    for purpose, name in enumerate(("ring", "transfer", "probe")):
        scripts[f"clear-{name}"] = [_frame(_core.CLEAR_HELLO), _p2p_hello(purpose)]
        scripts[f"raw-{name}"] = [_p2p_hello(purpose)]
    scripts["secure-no-secret"] = [_secure_hello(None, P2P_PROLOGUE)]
    scripts["secure-wrong-secret"] = [_secure_hello(GUESS, P2P_PROLOGUE)]
    scripts["secure-control-prologue"] = [_secure_hello(GUESS, PROLOGUE)]
    scripts["control-messages"] = [codec.frame(x) for x in EXAMPLES]
    return scripts


P2P_SCRIPTS = _p2p_scripts()


@pytest.mark.parametrize("script", sorted(P2P_SCRIPTS))
async def test_a_stranger_at_a_p2p_port_learns_nothing(group: Cluster, script: str) -> None:
    target = group.comms[1]
    got = await _talk(f"127.0.0.1:{target.p2p_port}", P2P_SCRIPTS[script])
    assert len(got) <= MAX_REPLY, (script, got)
    assert not _leaks(got, group), (script, _leaks(got, group))


@pytest.mark.parametrize("where", ["master", "p2p"])
@pytest.mark.parametrize(("secret", "prologue"), [
    (GUESS, "own"), (None, "own"), (GUESS, "other"), (SECRET, "other")],
    ids=["wrong-secret", "no-secret", "wrong-secret-other-prologue",
         "right-secret-other-prologue"])
async def test_a_stranger_through_the_whole_handshake_learns_nothing(
        group: Cluster, where: str, secret: bytes | None, prologue: str) -> None:
    """The stranger answers the listener's reply with its identity message: the listener
    refuses it (a missing or wrong secret, another context) with a status byte, and
    registers or serves nothing."""
    own, other = ((PROLOGUE, P2P_PROLOGUE) if where == "master"
                  else (P2P_PROLOGUE, PROLOGUE))
    address = (group.master.address if where == "master"
               else f"127.0.0.1:{group.comms[1].p2p_port}")
    before = (group.master.state.accepted(), group.master.state.pending())
    got, error = await _secure_stranger(address, secret, own if prologue == "own" else other)
    assert isinstance(error, pccl.AuthenticationError), repr(error)
    assert len(got) <= MAX_REPLY + VERDICT, got
    # The last thing received is the refusal: a one-byte status frame, not OK.
    assert got[-5:-1] == b"\x00\x00\x00\x01" and got[-1] != 0, got
    assert not _leaks(got, group), _leaks(got, group)
    assert (group.master.state.accepted(), group.master.state.pending()) == before


async def test_a_strangers_reachability_token_is_not_echoed_in_clear(group: Cluster) -> None:
    """The master's reachability check of a p2p port is a secure handshake in which the
    listener proves its key: a stranger sending the check's first frame gets no echo
    (a listener would otherwise answer anyone whether it is a pccl peer)."""
    from pccl.master.server import REACH_MAGIC

    token = b"\x07" * 16
    reader, writer = await asyncio.open_connection("127.0.0.1", group.comms[1].p2p_port)
    got = b""
    try:
        writer.write(_frame(REACH_MAGIC + token))
        await writer.drain()
        # (The listener waits for the master's hello until its handshake timeout: a
        # few seconds of silence are enough to see that nothing is echoed.)
        with contextlib.suppress(TimeoutError, ConnectionError):
            async with asyncio.timeout(2):
                got = await reader.read(1 << 16)
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()
    assert token not in got, got


async def test_a_stranger_with_the_right_protocol_and_a_wrong_secret_is_told_so() -> None:
    """What a mistaken operator (not an attacker) sees: a typed error naming the secret,
    on the master port and on a p2p port."""
    async with Cluster(2, secret=SECRET) as cluster:
        comm = pccl.Communicator(master=cluster.master.address, secret=GUESS)
        with pytest.raises(pccl.AuthenticationError, match="shared secret"):
            await comm.connect(n_attempts=1)
        target = cluster.comms[0]
        address = f"127.0.0.1:{target.p2p_port}"
        me = _core.Identity()
        node = await _core.P2PNode.bind(9, secret=GUESS, handshake_timeout=10.0, identity=me)
        try:
            # Without the target's key (the master's roster gives it to members only),
            # nothing is even dialed.
            with pytest.raises(pccl.IdentityError, match="roster names no key for peer"):
                async with asyncio.timeout(15):
                    await node.connect_pool(address, target.peer_id, 1, 1)
            # With it (say, an operator's node started with another run's secret), the
            # handshake fails on the secret, and says so.
            node.set_peer_keys({target.peer_id: target.identity.public_key})
            with pytest.raises(pccl.AuthenticationError, match="shared secret") as info:
                async with asyncio.timeout(15):
                    await node.connect_pool(address, target.peer_id, 1, 1)
            assert not isinstance(info.value, pccl.IdentityError)
        finally:
            await node.close()


async def test_a_replayed_handshake_and_session_are_refused() -> None:
    """Everything a real peer sent to the master (its handshake and its encrypted
    registration), recorded on the wire and replayed on a new connection: the master's
    fresh ephemeral key makes the replayed identity message (Noise XX message 3) fail
    to authenticate; the master answers with a one-byte status and nobody registers."""
    from pccl.testing import LinkEmulator

    async with Cluster(1, secret=SECRET) as cluster:
        async with LinkEmulator(cluster.master.address, record=True) as link:
            late = cluster.new_comm(master=link.address)
            await cluster.admit([late])
            sent = b"".join(v for k, v in link.recorded().items() if "client->server" in k)
            assert sent[4:12] == b"PCCLSEC\x03"  # the recorded handshake's hello
            before = sorted(cluster.master.state.peers)
            got = await _talk(cluster.master.address, [sent])
            assert len(got) <= MAX_REPLY + VERDICT, got
            assert not _leaks(got, cluster), _leaks(got, cluster)
            assert sorted(cluster.master.state.peers) == before


async def test_the_secret_never_appears_in_logs_or_errors(caplog) -> None:
    import logging

    caplog.set_level(logging.DEBUG)
    secret = SECRET.decode()
    errors: list[str] = []
    async with Cluster(2, secret=secret.encode()) as cluster:
        xs = [np.ones(64, np.float32) for _ in range(2)]
        await asyncio.gather(*(c.all_reduce(x) for c, x in zip(cluster.comms, xs)))
        # Two strong but wrong secrets (refused by the master), and a weak one (refused
        # at construction): no error repeats any of them.
        for wrong in (secret + "0", secret[:-1] + "0", secret[:12]):
            try:
                comm = pccl.Communicator(master=cluster.master.address, secret=wrong)
            except pccl.InvalidArgumentError as e:
                errors.append(str(e))
                continue
            try:
                await comm.connect(n_attempts=1)
            except pccl.PCCLError as e:
                errors.append(str(e))
            finally:
                await comm.close()
    assert len(errors) == 3
    texts = [r.getMessage() for r in caplog.records] + errors
    assert not [t for t in texts if secret[:8] in t]


async def test_a_slow_loopback_listener_is_dialed_again_not_taken_for_nat() -> None:
    """The master's dial-back of a loopback p2p address that times out (a loaded
    machine: seen in a churn soak) tries once more, longer, instead of routing the peer
    as if it were behind NAT; one that refuses or answers wrongly is not retried."""
    from pccl.master.server import REACH_MAGIC
    from pccl.protocol.transport import FramedConnection

    seen: list[int] = []

    async def listener(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = FramedConnection(reader, writer)
        seen.append(len(seen))
        try:
            frame = await conn.handshake_frame()
            assert frame.startswith(REACH_MAGIC)
            if len(seen) == 1:
                # Silent on the first dial (the master gives up on it and closes).
                with contextlib.suppress(Exception):
                    await reader.read()
            else:
                conn.send_handshake_frame(frame[len(REACH_MAGIC):])
                await conn.writer.drain()
        finally:
            await conn.close()

    server = await asyncio.start_server(listener, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    master = pccl.MasterNode(listen="127.0.0.1:0", dial_back_timeout=0.2)
    try:
        # (key None: a clear-text peer's check, the token echoed in clear, as this
        # listener does; a peer's encrypted check is a secure handshake, rust/net/node/accept.rs.)
        assert await master._dial_back("127.0.0.1", port, None)
        assert len(seen) == 2
        server.close()
        await server.wait_closed()
        # Refused: no second try, and not reachable.
        assert not await master._dial_back("127.0.0.1", port, None)
    finally:
        server.close()
        await server.wait_closed()
