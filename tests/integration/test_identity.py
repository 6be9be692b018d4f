"""Who may join a run, proven by the handshake (docs/security.md): strong secrets only,
no anonymous run off loopback, per-node keys vouched for by the operator's run key,
revocation, and a master that can route but not impersonate.

Each test plays the attacker the feature is for: a man in the middle, a weak secret, a
node that claims another's id or holds a self-signed, expired or revoked certificate,
an evil master terminating a relayed link, and an operator who revokes a node and
rotates the run key while the others keep training."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import pccl
from pccl import _core
from pccl import identity as ident
from pccl.protocol.codec import parse_length
from pccl.protocol.messages import Hello
from pccl.protocol.transport import FramedConnection
from pccl.testing.cluster import connect_all

SECRET = "5f0c1a9e7d3b42c8a6e1f0b97c2d4e3a"
OTHER_SECRET = "c0ffee00d15ea5e5b16b00b5a11ce0de"
FAST = {"heartbeat_interval": 0.25, "heartbeat_timeout": 3.0}
P2P_PROLOGUE = b"pccl p2p v2"


class Run:
    """An operator's files in ``root``: run keys and certified nodes."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def run_key(self, name: str = "run") -> Path:
        key = self.root / f"{name}.key"
        if not key.exists():
            ident.new_run_key(self.root / name)
        return key

    def trust(self, *names: str) -> str:
        for n in names or ("run",):
            self.run_key(n)
        return ",".join(str(self.root / f"{n}.pub") for n in names or ("run",))

    def node(self, name: str, groups: tuple[str, ...] = ("peer",), by: str = "run",
             days: float = 1.0) -> dict[str, Any]:
        """Key and certificate files of node ``name`` (certified by run key ``by``), as
        Communicator / MasterNode keyword arguments (without ``trust``)."""
        if not (self.root / f"{name}.key").exists():
            ident.new_node_key(self.root / name)
        cert = self.root / f"{name}.{by}.cert"
        ident.sign_node(self.run_key(by), self.root / f"{name}.pub", name=name,
                        groups=list(groups), days=days, out=cert, force=True)
        return {"key_file": str(self.root / f"{name}.key"), "cert_file": str(cert)}

    def expired(self, name: str) -> dict[str, Any]:
        """A node whose certificate from ``run`` ran out an hour ago."""
        ident.new_node_key(self.root / name)
        raw = _core.sign_cert(ident._read(self.run_key(), ident.RUN_KEY),
                              ident._read(self.root / f"{name}.pub", ident.NODE_PUB), name,
                              ["peer"], int(time.time()) - 7200, int(time.time()) - 3600)
        cert = self.root / f"{name}.cert"
        ident._write(cert, ident.CERT, raw, private=False)
        return {"key_file": str(self.root / f"{name}.key"), "cert_file": str(cert)}

    def fingerprint(self, name: str) -> str:
        return _core.key_fingerprint(ident._read(self.root / f"{name}.pub", ident.NODE_PUB))


@pytest.fixture
def run(tmp_path: Path) -> Run:
    return Run(tmp_path)


@contextlib.asynccontextmanager
async def certified(run: Run, n: int, trust: str | None = None, *, secret: str | None = None,
                    master: str = "master", **master_kwargs: Any
                    ) -> AsyncIterator[tuple[pccl.MasterNode, list[pccl.Communicator]]]:
    """A master and ``n`` accepted peers (``p1``..), every one certified by ``run``."""
    trust = trust or run.trust()
    m = pccl.MasterNode("127.0.0.1:0", secret=secret, trust=trust,
                        **run.node(master, ("master",)), **{**FAST, **master_kwargs})
    await m.start()
    comms = [pccl.Communicator(m.address, secret=secret, trust=trust,
                               p2p_connection_pool_size=2, **run.node(f"p{i + 1}"))
             for i in range(n)]
    try:
        await connect_all(m, comms)
        yield m, comms
    finally:
        for c in comms:
            await c.close()
        await m.stop()


async def fetch(master: pccl.MasterNode, path: str) -> str:
    """``path`` of the master's status server."""
    url = f"http://{master.status_address}{path}"
    body = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=10).read())
    return body.decode()


async def reduce_exact(comms: list[pccl.Communicator], tag: int = 1) -> None:
    """One all-reduce over ``comms``, retried through the library's recovery policy (as
    a training loop does), with the exact result on every peer."""
    xs = [np.arange(4096, dtype=np.float32) * (i + 1) for i in range(len(comms))]
    want = sum(x.copy() for x in xs)
    async with asyncio.timeout(60):
        await asyncio.gather(*(c.all_reduce_multiple_with_retry(
            [pccl.ReduceDescriptor(x, op=pccl.ReduceOp.SUM, tag=tag)]) for c, x in zip(comms, xs)))
    for x in xs:
        np.testing.assert_array_equal(x, want)


# --- secrets and anonymity -------------------------------------------------------------


@pytest.mark.parametrize("weak", ["", "   ", "hunter2", b"s3cret", "a" * 64, "abab" * 16,
                                  "correct horse battery staple", b"\x00" * 32])
def test_weak_or_empty_secrets_are_refused_at_construction(weak: Any) -> None:
    with pytest.raises(pccl.InvalidArgumentError, match="128 random bits"):
        pccl.Communicator("127.0.0.1:1", secret=weak)
    with pytest.raises(pccl.InvalidArgumentError, match="128 random bits"):
        pccl.MasterNode("127.0.0.1:0", secret=weak)


def test_strong_secrets_pass_and_a_new_one_is_strong() -> None:
    for good in (SECRET, os.urandom(16), ident.new_secret(), "YWJjZGVmZ2hpamtsbW5vcHFyc3R1"):
        assert ident.check_secret(good) is not None
    assert len(ident.new_secret()) == 64


def test_nothing_authenticating_off_loopback_is_refused_unless_opted_out() -> None:
    with pytest.raises(pccl.InvalidUsageError, match="allow_anonymous"):
        pccl.MasterNode("0.0.0.0:0")
    with pytest.raises(pccl.InvalidUsageError, match="allow_anonymous"):
        pccl.MasterNode.from_env({"PCCL_MASTER_LISTEN": "10.0.0.1:0"})
    # A peer refuses before it sends a byte (198.51.100.0/24 is never routed).
    with pytest.raises(pccl.InvalidUsageError, match="stand in for it"):
        pccl.Communicator("198.51.100.7:48149")
    with pytest.raises(pccl.InvalidUsageError):
        pccl.Communicator(["127.0.0.1:1", "198.51.100.7:48149"])
    # Opting out, a secret, or loopback: fine.
    pccl.MasterNode("0.0.0.0:0", allow_anonymous=True)
    pccl.MasterNode("0.0.0.0:0", secret=SECRET)
    pccl.Communicator("198.51.100.7:48149", allow_anonymous=True)
    pccl.Communicator("198.51.100.7:48149", secret=SECRET)
    pccl.Communicator("localhost:48149")


class Proxy:
    """A man in the middle on the control connection: it terminates the peer's secure
    handshake as a master would and dials the real master as a peer would, with keys
    of its own (and ``secret``, if it stole one), and relays the decrypted messages,
    keeping their types."""

    def __init__(self, master: str, secret: str | None) -> None:
        self.master, self.secret = master, secret and secret.encode()
        self.seen: list[str] = []
        self.me = _core.Identity()
        self.tasks: set[asyncio.Task[None]] = set()

    async def __aenter__(self) -> Proxy:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.address = f"127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.server.close()
        for t in list(self.tasks):
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await self.server.wait_closed()

    def _serve(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        t = asyncio.create_task(self._relay(r, w))
        self.tasks.add(t)
        t.add_done_callback(self.tasks.discard)

    async def _relay(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        peer = FramedConnection(r, w)
        master: FramedConnection | None = None
        try:
            await peer.accept(self.secret, allow_clear=False, identity=self.me)
            host, port = self.master.rsplit(":", 1)
            master = FramedConnection(*await asyncio.open_connection(host, int(port)))
            await master.dial(self.secret, identity=self.me)

            async def pump(a: FramedConnection, b: FramedConnection) -> None:
                while True:
                    msg = await a.recv()
                    self.seen.append(msg.TYPE)
                    await b.send(msg)

            await asyncio.gather(pump(peer, master), pump(master, peer))
        except Exception:
            pass
        finally:
            await peer.close()
            if master is not None:
                await master.close()


async def test_a_man_in_the_middle_reads_an_anonymous_run_and_is_caught_otherwise(
        run: Run) -> None:
    # Anonymous (allowed on loopback only): the proxy reads every control message while
    # both ends see an encrypted connection. This is why an anonymous master or peer
    # refuses to run off loopback (test above).
    async with pccl.MasterNode("127.0.0.1:0", **FAST) as m, Proxy(m.address, None) as p:
        async with pccl.Communicator(p.address, timeout=5.0) as c:
            assert c.peer_id is not None
        assert Hello.TYPE in p.seen and "welcome" in p.seen
    # A secret the proxy lacks: the peer refuses the connection.
    async with pccl.MasterNode("127.0.0.1:0", secret=SECRET, **FAST) as m, \
            Proxy(m.address, OTHER_SECRET) as p:
        with pytest.raises(pccl.AuthenticationError):
            await pccl.Communicator(p.address, secret=SECRET, timeout=5.0).connect()
        assert p.seen == []
    # Certificates, and the proxy stole the secret: its key has no certificate, and the
    # peer's error names that key.
    trust = run.trust()
    async with pccl.MasterNode("127.0.0.1:0", secret=SECRET, trust=trust,
                               **run.node("master", ("master",)), **FAST) as m, \
            Proxy(m.address, SECRET) as p:
        with pytest.raises(pccl.IdentityError, match=p.me.fingerprint):
            await pccl.Communicator(p.address, secret=SECRET, trust=trust, timeout=5.0,
                                    **run.node("p1")).connect()
        assert p.seen == []


# --- certificates ------------------------------------------------------------------------


async def test_a_certified_run_reduces_and_shows_each_identity(run: Run) -> None:
    async with certified(run, 3, secret=SECRET, status_listen="127.0.0.1:0") as (m, comms):
        await reduce_exact(comms)
        status = json.loads(await fetch(m, "/api/status"))
        assert status["master"]["certificates"] is True
        assert status["master"]["key_fingerprint"] == run.fingerprint("master")
        by_name = {p["cert_name"]: p for p in status["peers"]}
        assert set(by_name) == {"p1", "p2", "p3"}
        for name, p in by_name.items():
            assert p["key_fingerprint"] == run.fingerprint(name)
            assert time.time() < p["cert_not_after"] <= time.time() + 86400 + 5


async def test_each_wrong_identity_is_refused_naming_its_fingerprint(run: Run) -> None:
    trust = run.trust()
    # The stranger's certificate comes from another operator's run key (self-signed, as
    # far as this run knows); it trusts both, so it is the master that refuses.
    both = run.trust("run", "other")
    async with certified(run, 1) as (m, _):
        cases = [
            (run.node("stranger", by="other"), "not trusted"),
            (run.expired("late"), "expired"),
            (run.node("boss", ("master",)), "not as a peer"),
        ]
        for files, why in cases:
            name = Path(files["key_file"]).stem
            comm = pccl.Communicator(m.address, trust=trust if name != "stranger" else both,
                                     timeout=5.0, reconnect_timeout=0, **files)
            with pytest.raises(pccl.IdentityError) as err:
                await comm.connect()
            # The master's refusal reaches the node, with the key and the reason.
            assert run.fingerprint(name) in str(err.value) and why in str(err.value)
            await comm.close()
        # A node without a certificate at all is refused too.
        bare = pccl.Communicator(m.address, timeout=5.0)
        with pytest.raises(pccl.IdentityError, match="no certificate"):
            await bare.connect()
        await bare.close()
    # A "master" whose certificate says peer: the peer refuses it, naming its key.
    async with pccl.MasterNode("127.0.0.1:0", trust=trust, **run.node("fake", ("peer",)),
                               **FAST) as fake:
        with pytest.raises(pccl.IdentityError, match=run.fingerprint("fake")):
            await pccl.Communicator(fake.address, trust=trust, timeout=5.0,
                                    **run.node("p9")).connect()


async def _node(files: dict[str, Any], trust: str, peer_id: int) -> tuple[Any, Any]:
    me = ident.load(files["key_file"], files["cert_file"], trust)
    node = await _core.P2PNode.bind(peer_id, secret=SECRET.encode(), identity=me,
                                    handshake_timeout=5.0, connect_timeout=5.0)
    return node, me


async def test_a_node_claiming_another_nodes_id_is_refused(
        run: Run, caplog: pytest.LogCaptureFixture) -> None:
    """Peer 3, a certified insider with the secret, dials peer 2 claiming to be peer 1:
    peer 2 holds the master's roster (1 -> peer 1's key) and refuses the stream, naming
    the key it really holds; peer 1's slot stays free for peer 1."""
    trust = run.trust()
    a, ia = await _node(run.node("p1"), trust, 1)
    b, ib = await _node(run.node("p2"), trust, 2)
    liar, il = await _node(run.node("p3"), trust, 1)  # says it is peer 1
    try:
        roster = {1: ia.public_key, 2: ib.public_key, 3: il.public_key}
        for n in (a, b, liar):
            n.set_peer_keys(roster)
        caplog.set_level(logging.INFO)
        with contextlib.suppress(pccl.PCCLError):  # (it learns of it by a dropped stream)
            await liar.connect_pool(f"127.0.0.1:{b.port}", 2, 1, 1)
        want = f"holds key {il.fingerprint}, not peer 1's key {ia.fingerprint}"
        for _ in range(200):
            if any(want in r.getMessage() for r in caplog.records):
                break
            await asyncio.sleep(0.02)  # (the listener logs from its own task)
        assert any(want in r.getMessage() for r in caplog.records), caplog.text
        # The real peer 1 still gets its stream through (its pool is filed as usual).
        await a.connect_pool(f"127.0.0.1:{b.port}", 2, 1, 1)
    finally:
        for n in (a, b, liar):
            await n.close()


async def test_an_evil_master_terminating_a_relayed_link_is_detected(run: Run) -> None:
    """The master relays a ring link between peers 1 and 2 but, instead of splicing the
    two TCP streams, answers peer 1's handshake itself, with everything a master has:
    the secret, its own key and its certificate signed by the run key. Peer 1 pins
    peer 2's key from the roster and refuses, naming the master's key."""
    trust = run.trust()
    master_files = run.node("master", ("master",))
    evil = ident.load(master_files["key_file"], master_files["cert_file"], trust)
    a, _ = await _node(run.node("p1"), trust, 1)
    p2 = run.node("p2")
    p2_key = ident.load(p2["key_file"], p2["cert_file"], trust).public_key
    terminated: list[bytes] = []

    async def relay(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        async def frame() -> bytes:
            return await r.readexactly(parse_length(await r.readexactly(4),
                                                    _core.MAX_HANDSHAKE_FRAME))
        try:
            terminated.append(await frame())  # RELAY_MAGIC | token | stream
            hs = _core.SecureHandshake(False, SECRET.encode(), P2P_PROLOGUE, evil, "peer")
            while not hs.done:
                out, err = hs.on_frame(await frame())
                if out is not None:
                    w.write(len(out).to_bytes(4, "big") + out)
                if err is not None:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            w.close()

    server = await asyncio.start_server(relay, "127.0.0.1", 0)
    try:
        a.set_peer_keys({2: p2_key})
        addr = f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
        with pytest.raises(pccl.IdentityError, match=evil.fingerprint):
            await a.connect_pool(addr, 2, 1, 1, route="relay", token=b"t" * 16)
        assert terminated and terminated[0].startswith(b"PCCLRLY")
    finally:
        server.close()
        await server.wait_closed()
        await a.close()


# --- day two: revocation and rotation ---------------------------------------------------


async def test_revoking_a_node_drops_it_while_the_others_keep_training(run: Run) -> None:
    deny = run.root / "deny.list"
    async with certified(run, 3, denylist=str(deny)) as (m, comms):
        await reduce_exact(comms, tag=1)
        victim = comms[2]
        fp = run.fingerprint("p3")
        version = ident.revoke(run.run_key(), [fp], deny)
        assert version == 1
        # The master reads the file within a heartbeat, drops the node, tells the rest.
        await m.wait_for(lambda s: victim.peer_id not in s.peers, timeout=20)
        await reduce_exact(comms[:2], tag=2)
        # (The master sent the list before anything of the new ring: it is in.)
        assert all(c.identity.denylist_version == 1 for c in comms[:2])
        assert all(c.identity.is_denied(victim.identity.public_key) for c in comms[:2])
        # It cannot come back: the handshake refuses its key, naming it.
        again = pccl.Communicator(m.address, trust=run.trust(), timeout=5.0,
                                  **run.node("p3"))
        with pytest.raises(pccl.IdentityError, match=f"{fp}.*revoked"):
            await again.connect()
        await again.close()
        # An older or forged list changes nothing.
        assert not m.revoke(ident.load_denylist(deny))
        forged = _core.sign_denylist(ident._read(run.run_key("other"), ident.RUN_KEY), 9,
                                     int(time.time()), [])
        with pytest.raises(pccl.IdentityError):
            m.revoke(forged)
        await reduce_exact(comms[:2], tag=3)


async def test_rotating_the_run_key_on_a_running_group(run: Run) -> None:
    """docs/security.md's rotation, end to end: (1) every node, one at a time, restarts
    trusting the old and the new run key; (2) one at a time, with a certificate from the
    new key; (3) one at a time, trusting only the new key. Two peers keep reducing
    through every restart (a peer's restart is a leave and a join; the master's, a
    re-registration)."""
    old, both, new = run.trust("run"), run.trust("run", "run2"), run.trust("run2")
    async with certified(run, 3, trust=old) as (m, comms):
        address = m.address
        masters = [m]
        for phase, trust, by in ((1, both, "run"), (2, both, "run2"), (3, new, "run2")):
            # The master restarts on its address; the peers register again.
            await masters[-1].stop()
            masters.append(pccl.MasterNode(address, trust=trust, **FAST,
                                           **run.node("master", ("master",), by=by)))
            await masters[-1].start()
            async with asyncio.timeout(30):  # (waits out the re-registration)
                assert await asyncio.gather(*(c.are_peers_pending() for c in comms)) == [
                    False] * 3
            await reduce_exact(comms, tag=10 * phase)
            for i in range(3):
                await comms[i].close()
                fresh = pccl.Communicator(address, trust=trust, p2p_connection_pool_size=2,
                                          **run.node(f"p{i + 1}", by=by))
                rest = comms[:i] + comms[i + 1:]
                await reduce_exact(rest, tag=10 * phase + i + 1)  # the others go on
                comms[i] = fresh
                await connect_all(masters[-1], [*rest, fresh])
            await reduce_exact(comms, tag=10 * phase + 9)
        # The old run key is no longer trusted by the master: its certificates are
        # refused. (A node's own certificate must be from a key it trusts, so this node
        # still trusts both.)
        with pytest.raises(pccl.IdentityError, match="not trusted"):
            await pccl.Communicator(address, trust=both, timeout=5.0,
                                    **run.node("p7", by="run")).connect()
        await masters[-1].stop()


async def test_doctor_checks_a_certified_setup(run: Run) -> None:
    from pccl.doctor import diagnose

    trust = run.trust()
    async with certified(run, 1, secret=SECRET) as (m, _):
        p = run.node("checker")
        me = ident.load(p["key_file"], p["cert_file"], trust)
        report = await diagnose(m.address, SECRET.encode(), identity=me, timeout=10.0)
        text = report.render()
        assert not report.failed, text
        assert "the shared secret matches, the certificates check out both ways" in text
        # A fresh key (no certificate): the doctor reports the refusal and its reason.
        report = await diagnose(m.address, SECRET.encode(), timeout=10.0)
        assert report.failed and "no certificate" in report.render()


async def test_a_peer_logs_its_id_and_key_when_it_registers(
        run: Run, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="pccl.communicator")
    async with certified(run, 1) as (m, comms):
        (comm,) = comms
        want = (f"peer {comm.peer_id}: registered with the master at {m.address} (group 0, "
                f"no run id, p2p 127.0.0.1:{comm.p2p_port}, reachable from the master: others "
                f"dial it; encrypted, key {run.fingerprint('p1')})")
        assert want in caplog.text


async def test_refused_handshakes_are_counted_and_their_warnings_rate_limited(
        caplog: pytest.LogCaptureFixture) -> None:
    """A stranger with the wrong secret, thirty times: thirty in the metric, one warning
    in the log (a flood would fill the disk otherwise)."""
    caplog.set_level(logging.WARNING, logger="pccl.master")
    async with pccl.MasterNode("127.0.0.1:0", secret=SECRET, status_listen="127.0.0.1:0",
                               **FAST) as m:
        host, port = m.address.rsplit(":", 1)
        for _ in range(30):
            conn = FramedConnection(*await asyncio.open_connection(host, int(port)))
            # (The master refuses the identity message and counts it before its
            # refusal can reach the dialer.)
            with pytest.raises(pccl.AuthenticationError):
                await conn.dial(OTHER_SECRET.encode())
            await conn.close()
        text = await fetch(m, "/metrics")
        assert 'pccl_handshakes_refused_total{reason="secret"} 30.0' in text, text
        refusals = [r for r in caplog.records if "refused" in r.getMessage()]
        assert len(refusals) == 1, [r.getMessage() for r in refusals]
        assert "handshakes refused so far: 1 secret" in refusals[0].getMessage()


async def test_a_peer_is_shown_by_name_and_a_certificate_name_wins(run: Run) -> None:
    def names(status: dict[str, Any]) -> dict[int, str | None]:
        return {p["id"]: p["name"] for p in status["peers"]}

    async def status_of(m: pccl.MasterNode) -> dict[str, Any]:
        return dict(json.loads(await fetch(m, "/api/status")))

    async with pccl.MasterNode("127.0.0.1:0", status_listen="127.0.0.1:0", **FAST) as m:
        a = pccl.Communicator(m.address, name="alice's laptop")
        b = pccl.Communicator(m.address)
        try:
            await connect_all(m, [a, b])
            assert names(await status_of(m)) == {a.peer_id: "alice's laptop", b.peer_id: None}
        finally:
            await a.close()
            await b.close()
    with pytest.raises(pccl.InvalidArgumentError, match="printable"):
        pccl.Communicator("127.0.0.1:1", name="bad\nname")
    # With certificates, what a peer says it is called does not matter.
    async with certified(run, 0, status_listen="127.0.0.1:0") as (m, _):
        trust = run.trust()
        async with pccl.Communicator(m.address, trust=trust, name="the master",
                                     **run.node("p1")) as c:
            assert names(await status_of(m)) == {c.peer_id: "p1"}
