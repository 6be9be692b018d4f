"""Day two (issue 38): the master's admin socket. An operator removes one contributor
(the others go on without it, and its key is refused until the ban is lifted, across
restarts with a state directory) and ends the run, over a local socket that serves only
root and the master's own uid and refuses what is not one small request."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import pccl
from pccl import identity as ident
from pccl.__main__ import main
from pccl.master import admin
from pccl.testing import Cluster
from pccl.testing.cluster import connect_all

SECRET = "5f0c1a9e7d3b42c8a6e1f0b97c2d4e3a"
FAST = {"heartbeat_interval": 0.25, "heartbeat_timeout": 3.0}


async def ask(path: Path, **doc: Any) -> dict[str, Any]:
    return await asyncio.to_thread(admin.request, str(path), doc, 20.0)


def raw_exchange(path: Path, data: bytes, *, read: bool = True) -> bytes:
    """Sends ``data`` as it is and returns everything the master answers until it
    closes the connection."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(20)
        s.connect(str(path))
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            s.sendall(data)
            s.shutdown(socket.SHUT_WR)  # (a client that says no more)
        out = b""
        # (A master that closes with part of the request unread resets the connection
        # once its answer has been read.)
        with contextlib.suppress(ConnectionResetError):
            while read and (chunk := s.recv(1 << 16)):
                out += chunk
        return out


def reply_of(raw: bytes) -> dict[str, Any]:
    lines = raw.split(b"\n")
    assert len(lines) == 2 and lines[1] == b"", raw  # one line, then the master closed
    doc: dict[str, Any] = json.loads(lines[0])
    return doc


async def reduce_exact(comms: list[pccl.Communicator], tag: int) -> None:
    xs = [np.arange(1024, dtype=np.float32) * (i + 1) for i in range(len(comms))]
    want = sum(x.copy() for x in xs)
    async with asyncio.timeout(60):
        await asyncio.gather(*(c.all_reduce_multiple_with_retry(
            [pccl.ReduceDescriptor(x, op=pccl.ReduceOp.SUM, tag=tag)])
            for c, x in zip(comms, xs)))
    for x in xs:
        np.testing.assert_array_equal(x, want)


def exists(path: Path) -> bool:
    return path.exists()


def mode(path: Path) -> int:
    return path.lstat().st_mode


def cli(*args: str) -> int:
    """``pccl admin ...`` in this process (run in a thread: the master is on the loop)."""
    try:
        main(["admin", *args])
    except SystemExit as e:
        return int(e.code or 0)
    return 0


@pytest.fixture
def sock(tmp_path: Path) -> Path:
    return tmp_path / "run" / "admin.sock"


async def test_a_removed_peer_is_dropped_and_refused_until_unbanned(
        sock: Path, tmp_path: Path) -> None:
    ident.new_node_key(tmp_path / "carol")
    carol_key = str(tmp_path / "carol.key")
    async with pccl.MasterNode(listen="127.0.0.1:0", secret=SECRET, admin_socket=str(sock),
                               **FAST) as master:
        opts = {"master": master.address, "secret": SECRET}
        comms = [pccl.Communicator(name="alice", **opts), pccl.Communicator(name="bob", **opts),
                 pccl.Communicator(name="carol", key_file=carol_key, **opts)]
        again: list[pccl.Communicator] = []
        try:
            await connect_all(master, comms)
            await reduce_exact(comms, tag=1)
            carol = comms[2]
            carol_id = carol.peer_id
            reply = await ask(sock, command="remove", target="carol", reason="sends NaNs")
            fp = carol.identity.fingerprint
            assert reply == {"ok": True, "text": f"peer {carol_id} 'carol' (key {fp}) removed "
                             "from the run by the operator: sends NaNs; its key is refused "
                             "from now on"}
            await master.wait_for(lambda s: carol_id not in s.peers, timeout=20)
            # The others go on without it (the ring repaired), exactly.
            await reduce_exact(comms[:2], tag=2)
            # It tried to register again, and was told why, as an error retrying cannot fix.
            with pytest.raises(pccl.IdentityError, match=(
                    rf"this peer's key {fp} was removed from the run by the operator "
                    r"\(sends NaNs\)")):
                await carol.all_reduce(np.ones(4, dtype=np.float32))
            # A new process with the same key is refused the same way.
            again.append(pccl.Communicator(key_file=carol_key, timeout=10, **opts))
            with pytest.raises(pccl.IdentityError, match="removed from the run by the operator"):
                await again[-1].connect()
            removed = [e for e in master.monitor.timeline if e["kind"] == "removed"]
            assert [e["text"] for e in removed] == [
                f"peer {carol_id} 'carol' (key {fp}) removed from the run by the operator: "
                "sends NaNs"]
            assert master.monitor.registry.get_sample_value(
                "pccl_peers_dropped_total", {"cause": "removed"}) == 1
            # Lifted, by the name it was removed under: the key joins again.
            reply = await ask(sock, command="unban", target="carol")
            assert reply == {"ok": True, "text": f"the ban on key {fp} ('carol', removed for "
                                                 "'sends NaNs') was lifted by the operator"}
            again.append(pccl.Communicator(key_file=carol_key, name="carol", **opts))
            await connect_all(master, [*comms[:2], again[-1]])
            await reduce_exact([*comms[:2], again[-1]], tag=3)
        finally:
            for c in comms + again:
                await c.close()


async def test_an_unknown_or_ambiguous_target_is_a_clear_error(
        sock: Path, capsys: pytest.CaptureFixture[str]) -> None:
    async with Cluster(0, master_kwargs={"admin_socket": str(sock)}) as cluster:
        comms = [cluster.new_comm(name=n) for n in ("twin", "twin", "solo")]
        await connect_all(cluster.master, comms)
        for target, error in (
                ("twin", "'twin' names 2 peers (peer 1 'twin' (key "),
                ("nobody", "no registered peer has the id, name or key fingerprint 'nobody' "
                           "(the peers: peer 1 'twin'"),
                ("abc", "no peer has the id or name 'abc', and a fingerprint prefix needs "
                        "at least 12 hex digits"),
                ("99", "no registered peer has the id, name or key fingerprint '99'")):
            reply = await ask(sock, command="remove", target=target)
            assert reply["ok"] is False and reply["error"].startswith(error), reply
        reply = await ask(sock, command="unban", target="twin")
        assert reply == {"ok": False, "error": "no ban has the name or key fingerprint 'twin' "
                                               "(the bans: none)"}
        assert len(cluster.master.state.peers) == 3  # nobody was dropped
        # The command line says the same in one line, and fails.
        capsys.readouterr()
        assert await asyncio.to_thread(cli, "--socket", str(sock), "remove", "twin") == 1
        out, err = capsys.readouterr()
        assert out == "" and err.count("\n") == 1, err
        assert err.startswith("pccl admin: error: 'twin' names 2 peers")
        # An id is unambiguous.
        solo = comms[2]
        assert await asyncio.to_thread(cli, "--socket", str(sock), "remove",
                                       str(solo.peer_id), "--reason", "a test") == 0
        out, _ = capsys.readouterr()
        assert out.startswith(f"peer {solo.peer_id} 'solo' (key {solo.identity.fingerprint}) "
                              "removed from the run by the operator: a test")
        assert await asyncio.to_thread(cli, "--socket", str(sock), "status") == 0
        out, _ = capsys.readouterr()
        lines = out.splitlines()
        assert lines[:2] == [f"master {cluster.master.address}", "peers: 2"]
        assert lines[2].split("\t") == ["  1", "twin", comms[0].identity.fingerprint, "group 0",
                                        "accepted"]
        assert lines[4:] == ["removed keys: 1",
                             f"  {solo.identity.fingerprint}\tsolo\ta test"]
        # No socket at all: one line too.
        assert await asyncio.to_thread(cli, "--socket", str(sock) + ".nope", "status") == 1
        _, err = capsys.readouterr()
        assert err == (f"pccl admin: error: no admin socket at {str(sock) + '.nope'!r}: is the "
                       f"master running with --admin-socket {sock}.nope?\n")


async def test_end_run_ends_the_peers_calls_at_once(sock: Path) -> None:
    async with Cluster(2, master_kwargs={"admin_socket": str(sock), **FAST},
                       comm_kwargs={"reconnect_timeout": 600}) as cluster:
        reply = await ask(sock, command="end-run", reason="training finished")
        assert reply == {"ok": True, "text": "the run is over (training finished): 2 peers "
                                             "were told, the master stopped"}
        assert not cluster.master.serving
        assert not exists(sock)
        for comm in cluster.comms:
            async with asyncio.timeout(10):  # not 600: the wait ends with the message
                with pytest.raises(pccl.MasterConnectionError,
                                   match=r"the master ended the run \(training finished\)"):
                    await comm.all_reduce(np.ones(4, dtype=np.float32))


_CLIENT = """
import json, socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.settimeout(20)
try:
    s.connect(sys.argv[1])
except OSError as e:
    print(json.dumps({"connect": type(e).__name__}))
    sys.exit(0)
try:
    s.sendall(b'{"command": "end-run"}\\n')
except OSError:
    pass  # (the master may answer and close before the request is sent)
print(s.recv(65536).decode().strip())
"""


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A directory under /tmp that other users can traverse (pytest's are 0700)."""
    d = Path(tempfile.mkdtemp(prefix="pccl-admin-"))
    d.chmod(0o755)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="running a client as another uid needs root")
async def test_a_client_of_another_uid_is_refused(open_dir: Path) -> None:
    python = shutil.which("python3", path="/usr/bin:/bin")
    if python is None:
        pytest.skip("no system python3 for the unprivileged client")
    path = open_dir / "admin.sock"

    def as_nobody() -> dict[str, Any]:
        run = subprocess.run([python, "-c", _CLIENT, str(path)], user=65534, group=65534,
                             extra_groups=[], capture_output=True, text=True, timeout=60,
                             check=True)
        doc: dict[str, Any] = json.loads(run.stdout)
        return doc

    async with pccl.MasterNode(listen="127.0.0.1:0", admin_socket=str(path)) as master:
        # The file's mode keeps it out...
        assert await asyncio.to_thread(as_nobody) == {"connect": "PermissionError"}
        # ... and were the file opened to everyone, its credentials still would.
        path.chmod(0o666)
        assert await asyncio.to_thread(as_nobody) == {
            "ok": False, "error": "uid 65534 may not use this master's admin socket (root "
                                  "and uid 0, the master's, only)"}
        assert master.serving
        assert (await ask(path, command="status"))["ok"] is True


async def test_oversized_or_garbage_requests_are_refused_and_harm_nothing(
        sock: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(admin, "DEADLINE", 1.0)
    monkeypatch.setattr(admin, "MAX_CLIENTS", 2)
    async with Cluster(2, master_kwargs={"admin_socket": str(sock)}) as cluster:
        server = cluster.master._admin
        assert server is not None
        for data, error in (
                (b"x" * 5000, "a request is one JSON line of at most 4096 bytes"),
                (b'{"command": "status", "target": "' + b"a" * 4100 + b'"}\n',
                 "a request is one JSON line of at most 4096 bytes"),
                (b"not json\n", "a request is one JSON object on one line"),
                (b"\xff\xfe\n", "a request is one JSON object on one line"),
                (b"[1, 2]\n", 'a request is a JSON object with "command"'),
                (b'{"command": "status", "then": "more"}\n',
                 'a request is a JSON object with "command"'),
                (b'{"command": "format-disk"}\n', "unknown command 'format-disk': one of remove"),
                (b'{"command": "remove"}\n', "remove needs a target"),
                (b'{"command": "remove", "target": 7}\n', "target must be a string"),
                (b'{"command": "remove", "target": "' + b"a" * 300 + b'"}\n',
                 "target is longer than 200 characters"),
                (b"", "a request is one JSON object on one line")):
            raw = await asyncio.to_thread(raw_exchange, sock, data)
            reply = reply_of(raw)
            assert reply["ok"] is False and reply["error"].startswith(error), reply
        # One request per connection: what follows the first is never read.
        raw = await asyncio.to_thread(raw_exchange, sock,
                                      b'{"command": "status"}\n{"command": "end-run"}\n')
        assert reply_of(raw)["ok"] is True
        # A client that says nothing is let go after the deadline.
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as idle:
            idle.connect(str(sock))
            idle.settimeout(20)
            assert reply_of(await asyncio.to_thread(idle.recv, 4096)) == {
                "ok": False, "error": "no request within 1.0s"}
        # Past MAX_CLIENTS at once, a client is told to come back.
        monkeypatch.setattr(admin, "DEADLINE", 30.0)
        idle_ones = [socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(2)]
        try:
            for s in idle_ones:
                s.connect(str(sock))
            async with asyncio.timeout(20):
                while len(server._tasks) < 2:  # noqa: ASYNC110 - polls the server's state
                    await asyncio.sleep(0.01)
            raw = await asyncio.to_thread(raw_exchange, sock, b'{"command": "status"}\n')
            assert reply_of(raw) == {"ok": False, "error": "the master is answering other "
                                                           "admin requests; try again"}
        finally:
            for s in idle_ones:
                s.close()
        async with asyncio.timeout(20):
            while server._tasks:  # noqa: ASYNC110 - the idle ones end when they close
                await asyncio.sleep(0.01)
        assert server.refused == 15  # (the idle ones closed without a request)
        # The master and its run are untouched.
        assert cluster.master.serving and len(cluster.master.state.peers) == 2
        assert not cluster.master.bans
        status = await ask(sock, command="status")
        assert [p["peer_id"] for p in status["peers"]] == [1, 2]
        await reduce_exact(cluster.comms, tag=1)


async def test_the_socket_is_private_refuses_what_is_in_its_way_and_goes_on_stop(
        sock: Path, tmp_path: Path) -> None:
    async with pccl.MasterNode(listen="127.0.0.1:0", admin_socket=str(sock)):
        assert stat.S_ISSOCK(mode(sock))
        assert stat.S_IMODE(mode(sock)) == 0o600
        assert stat.S_IMODE(mode(sock.parent)) == 0o700
        # A second master on the same path is refused: the first one answers there.
        second = pccl.MasterNode(listen="127.0.0.1:0", admin_socket=str(sock))
        with pytest.raises(pccl.InvalidUsageError, match=(
                r"admin_socket=.*another program \(another master\?\) listens on")):
            await second.start()
        assert not second.serving
    assert not exists(sock)
    # A stale socket (a master that was killed) is replaced.
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(sock))
    stale.close()
    async with pccl.MasterNode(listen="127.0.0.1:0", admin_socket=str(sock)):
        assert (await ask(sock, command="status"))["ok"] is True
    # Anything else is left alone.
    with open(sock, "w") as f:  # noqa: ASYNC230 - a test's setup
        f.write("not a socket")
    master = pccl.MasterNode(listen="127.0.0.1:0", admin_socket=str(sock))
    with pytest.raises(pccl.InvalidUsageError, match="exists and is not a socket"):
        await master.start()
    assert not stat.S_ISSOCK(mode(sock))
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    master = pccl.MasterNode(listen="127.0.0.1:0", admin_socket=str(shared / "a.sock"))
    with pytest.raises(pccl.InvalidUsageError, match=r"may be written by others \(mode 777\)"):
        await master.start()


async def test_the_ban_list_outlives_a_restart_with_a_state_dir(
        sock: Path, tmp_path: Path) -> None:
    state = tmp_path / "state"
    ident.new_node_key(tmp_path / "dave")
    key = str(tmp_path / "dave.key")
    absent = "0123456789abcdef0123456789abcdef"
    opts = {"admin_socket": str(sock), "state_dir": str(state), "secret": SECRET}
    async with pccl.MasterNode(listen="127.0.0.1:0", **opts) as master:
        async with pccl.Communicator(master.address, secret=SECRET, key_file=key) as dave:
            fp = dave.identity.fingerprint
            reply = await ask(sock, command="remove", target=fp[:12].upper())
            assert reply["ok"] is True, reply
            await master.wait_for(lambda s: not s.peers, timeout=20)
        # A whole fingerprint bans a key nobody holds now.
        reply = await ask(sock, command="remove", target=absent, reason="leaked")
        assert reply == {"ok": True, "text": f"key {absent} removed from the run by the "
                         "operator: leaked (no peer holds that key now; it is refused from "
                         "now on)"}
    kept = state / admin.BANS_FILE
    assert stat.S_IMODE(kept.stat().st_mode) == 0o600
    async with pccl.MasterNode(listen="127.0.0.1:0", **opts) as master:
        status = await ask(sock, command="status")
        assert [(b["fingerprint"], b["reason"]) for b in status["bans"]] == [
            (fp, ""), (absent, "leaked")]
        dave = pccl.Communicator(master.address, secret=SECRET, key_file=key, timeout=10)
        with pytest.raises(pccl.IdentityError, match=f"{fp} was removed from the run"):
            await dave.connect()
        await dave.close()
        reply = await ask(sock, command="unban", target=fp[:16])
        assert reply["ok"] is True, reply
        async with pccl.Communicator(master.address, secret=SECRET, key_file=key) as dave:
            assert dave.peer_id is not None
    assert [b["fingerprint"] for b in json.loads(kept.read_text())["bans"]] == [absent]
    # A ban list that cannot be read stops the master (it would let every key back).
    kept.write_text('{"version": 1, "bans": [{"fingerprint": "nope"}]}')
    master = pccl.MasterNode(listen="127.0.0.1:0", **opts)
    with pytest.raises(pccl.InvalidUsageError, match="the ban list .* cannot be read"):
        await master.start()
    assert not master.serving and not exists(sock)


async def test_pccl_master_ends_when_the_operator_ends_the_run(
        sock: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "pccl", "master", "--listen", "127.0.0.1:0", "--status", "off",
        "--admin-socket", str(sock), stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL)
    try:
        async with asyncio.timeout(30):
            line = (await proc.stdout.readline()).decode()  # type: ignore[union-attr]
        assert line.startswith("pccl master listening on 127.0.0.1:"), line
        monkeypatch.setenv("PCCL_ADMIN_SOCKET", str(sock))  # (no --socket: the variable)
        capsys.readouterr()
        assert await asyncio.to_thread(cli, "end-run", "--reason", "done") == 0
        assert capsys.readouterr().out == ("the run is over (done): 0 peers were told, the "
                                           "master stopped\n")
        async with asyncio.timeout(30):
            assert await proc.wait() == 0  # (not only a signal stops it)
        assert not exists(sock)
    finally:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
