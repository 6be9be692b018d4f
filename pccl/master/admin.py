"""The master's admin socket: a local, authenticated channel for day-two operations on a
run that may have no certificates: remove a contributor (and refuse its key from then
on), lift such a ban, end the run, and a short status.

It is a Unix domain socket (``MasterNode(admin_socket=PATH)``, ``pccl-master
--admin-socket PATH``, ``PCCL_ADMIN_SOCKET``), reachable from this machine only:

- the file is 0600, in a directory the master's user owns and nobody else may write to;
  a path that exists and is not a stale socket (nobody answers on it) is refused;
- every client's credentials come from the kernel (``SO_PEERCRED``): only root and the
  master's own uid are served, whatever the file's mode;
- one request per connection, a JSON object on one line of at most
  :data:`MAX_REQUEST` bytes, read within :data:`DEADLINE` seconds; at most
  :data:`MAX_CLIENTS` connections at once (past it a client is told the master is busy).

A request is ``{"command": "remove", "target": "alice", "reason": "..."}`` (``remove``,
``unban``, ``end-run``, ``status``); the reply one JSON line, ``{"ok": true, ...}`` or
``{"ok": false, "error": "..."}``. ``pccl admin`` is the client.

The ban list is the master's memory of the keys the operator removed: bounded
(:data:`MAX_BANS`), and kept in ``state_dir/bans.json`` when the master has a state
directory (so that it outlives a restart).

Example::

    import asyncio, os, tempfile
    import pccl
    from pccl.master import admin

    async def main() -> None:
        path = os.path.join(tempfile.mkdtemp(), "admin.sock")
        async with pccl.MasterNode(listen="127.0.0.1:0", admin_socket=path):
            reply = await asyncio.to_thread(admin.request, path, {"command": "status"})
            assert reply["ok"] and reply["peers"] == []

    asyncio.run(main())
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import json
import logging
import os
import re
import socket
import stat
import struct
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

from pccl.errors import InvalidArgumentError, InvalidUsageError, PCCLError
from pccl.protocol.transport import accept

log = logging.getLogger(__name__)

#: Largest request, in bytes (one JSON line, its newline not counted).
MAX_REQUEST = 4096
#: Largest reply the client reads (a status of thousands of peers fits).
MAX_REPLY = 4 << 20
#: Seconds a client has to send its request, and the master to write its reply.
DEADLINE = 5.0
#: Admin connections served at once.
MAX_CLIENTS = 4
#: Keys the ban list holds at most.
MAX_BANS = 1024
#: The ban list's file in a master's ``state_dir``.
BANS_FILE = "bans.json"
#: Hex digits a fingerprint prefix needs (a full fingerprint has 32).
MIN_PREFIX = 12
FINGERPRINT_DIGITS = 32
#: Characters of a target or a reason kept.
MAX_TEXT = 200
COMMANDS = ("remove", "unban", "end-run", "status")

_HEX = re.compile(r"[0-9a-f]+")


class AdminError(Exception):
    """A request the admin channel could not carry out (the text says why)."""


def _text(value: object, what: str) -> str:
    if not isinstance(value, str):
        raise AdminError(f"{what} must be a string, got {type(value).__name__}")
    if len(value) > MAX_TEXT:
        raise AdminError(f"{what} is longer than {MAX_TEXT} characters")
    return "".join(c for c in value if c.isprintable()).strip()


@dataclasses.dataclass(frozen=True)
class Request:
    """One admin request, checked."""

    command: str
    target: str = ""
    reason: str = ""


def parse_request(raw: bytes) -> Request:
    """A request line (without its newline) as a :class:`Request`; AdminError for
    anything else."""
    if len(raw) > MAX_REQUEST:
        raise AdminError(f"a request is one JSON line of at most {MAX_REQUEST} bytes")
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise AdminError("a request is one JSON object on one line") from None
    if not isinstance(doc, dict) or not set(doc) <= {"command", "target", "reason"}:
        raise AdminError('a request is a JSON object with "command" and, for some '
                         'commands, "target" and "reason"')
    command = doc.get("command")
    if command not in COMMANDS:
        raise AdminError(f"unknown command {str(command)[:40]!r}: one of "
                         f"{', '.join(COMMANDS)}")
    target = _text(doc.get("target", ""), "target")
    if command in ("remove", "unban") and not target:
        raise AdminError(f"{command} needs a target: a peer's id, name or key fingerprint")
    return Request(command, target, _text(doc.get("reason", ""), "reason"))


# --- who is meant ----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PeerEntry:
    """A registered peer as the operator sees it."""

    peer_id: int
    name: str | None
    fingerprint: str | None  # None: clear text, no key
    group: int
    status: str

    def describe(self) -> str:
        named = f" {self.name!r}" if self.name else ""
        key = f" (key {self.fingerprint})" if self.fingerprint else " (no key: clear text)"
        return f"peer {self.peer_id}{named}{key}"


def is_fingerprint(target: str) -> bool:
    """Whether ``target`` is a whole key fingerprint (32 hex digits)."""
    t = target.lower()
    return len(t) == FINGERPRINT_DIGITS and _HEX.fullmatch(t) is not None


def _listing(peers: Sequence[PeerEntry], most: int = 8) -> str:
    shown = "; ".join(p.describe() for p in peers[:most])
    more = f"; and {len(peers) - most} more" if len(peers) > most else ""
    return (shown + more) if peers else "none"


def find_peer(target: str, peers: Sequence[PeerEntry]) -> PeerEntry:
    """The one peer ``target`` names: by id, by name, or by a prefix of its key's
    fingerprint (at least :data:`MIN_PREFIX` hex digits). InvalidArgumentError when it
    names none or several."""
    t = target.strip()
    if not t:
        raise InvalidArgumentError("say which peer: its id, its name or its key fingerprint")
    low = t.lower()
    hexish = _HEX.fullmatch(low) is not None
    found: dict[int, PeerEntry] = {}
    for p in peers:
        if (t.isdecimal() and len(t) < 20 and p.peer_id == int(t)) or p.name == t or (
                hexish and len(low) >= MIN_PREFIX and p.fingerprint is not None
                and p.fingerprint.startswith(low)):
            found[p.peer_id] = p
    if len(found) == 1:
        return next(iter(found.values()))
    if found:
        raise InvalidArgumentError(
            f"{t!r} names {len(found)} peers ({_listing(list(found.values()))}): give the "
            f"peer's id or a longer fingerprint prefix")
    if hexish and not t.isdecimal() and len(low) < MIN_PREFIX:
        raise InvalidArgumentError(
            f"no peer has the id or name {t!r}, and a fingerprint prefix needs at least "
            f"{MIN_PREFIX} hex digits")
    raise InvalidArgumentError(f"no registered peer has the id, name or key fingerprint "
                               f"{t!r} (the peers: {_listing(peers)})")


# --- the ban list ----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Ban:
    """A key the operator removed."""

    fingerprint: str
    name: str | None
    reason: str
    time: float

    def describe(self) -> str:
        said = ([repr(self.name)] if self.name else []) + (
            [f"removed for {self.reason!r}"] if self.reason else [])
        return f"key {self.fingerprint}" + (f" ({', '.join(said)})" if said else "")


class BanList:
    """The keys refused at registration, by fingerprint (at most :data:`MAX_BANS`)."""

    def __init__(self, bans: Iterable[Ban] = ()) -> None:
        self._bans: dict[str, Ban] = {b.fingerprint: b for b in bans}

    def __len__(self) -> int:
        return len(self._bans)

    def __iter__(self) -> Iterator[Ban]:
        return iter(list(self._bans.values()))

    def get(self, fingerprint: str) -> Ban | None:
        return self._bans.get(fingerprint.lower())

    def add(self, ban: Ban) -> None:
        """Adds (or renews) ``ban``; InvalidUsageError when the list is full (a ban is
        never dropped to make room: that would let a removed key back in silently)."""
        if ban.fingerprint not in self._bans and len(self._bans) >= MAX_BANS:
            raise InvalidUsageError(
                f"the ban list is full ({MAX_BANS} keys): lift some bans (`pccl admin "
                f"unban`), or rotate the run's secret")
        self._bans[ban.fingerprint] = ban

    def find(self, target: str) -> Ban:
        """The one ban ``target`` names: by the name it was recorded with, or by a
        fingerprint prefix of at least :data:`MIN_PREFIX` hex digits."""
        t = target.strip()
        low = t.lower()
        hexish = _HEX.fullmatch(low) is not None and len(low) >= MIN_PREFIX
        found = [b for b in self._bans.values()
                 if b.name == t or (hexish and b.fingerprint.startswith(low))]
        if len(found) == 1:
            return found[0]
        if found:
            raise InvalidArgumentError(
                f"{t!r} names {len(found)} bans ({'; '.join(b.describe() for b in found[:8])}"
                f"): give a longer fingerprint prefix")
        held = "; ".join(b.describe() for b in list(self._bans.values())[:8]) or "none"
        raise InvalidArgumentError(f"no ban has the name or key fingerprint {t!r} (the "
                                   f"bans: {held})")

    def remove(self, ban: Ban) -> None:
        self._bans.pop(ban.fingerprint, None)

    def to_json(self) -> list[dict[str, Any]]:
        return [dataclasses.asdict(b) for b in self._bans.values()]

    # The file is the master's own (0600 in its 0700 state directory), not input from
    # the network; it is still read with limits, and one that does not parse stops the
    # master (starting without it would let every removed key back in).

    @classmethod
    def load(cls, path: Path) -> BanList:
        """The ban list kept in ``path`` (empty when there is none). ValueError when it
        is not one."""
        try:
            with path.open("rb") as f:
                raw = f.read(MAX_BANS * 1024 + 1)
        except FileNotFoundError:
            return cls()
        if len(raw) > MAX_BANS * 1024:
            raise ValueError("it is too large to be a ban list")
        doc = json.loads(raw)
        if not isinstance(doc, dict) or doc.get("version") != 1 or not isinstance(
                doc.get("bans"), list) or len(doc["bans"]) > MAX_BANS:
            raise ValueError("it is not a version 1 ban list")
        bans = []
        for e in doc["bans"]:
            if not (isinstance(e, dict) and isinstance(e.get("fingerprint"), str)
                    and is_fingerprint(e["fingerprint"])
                    and isinstance(e.get("name"), (str, type(None)))
                    and isinstance(e.get("reason"), str)
                    and isinstance(e.get("time"), (int, float))):
                raise ValueError(f"an entry is not a ban: {str(e)[:100]}")
            name = e["name"][:MAX_TEXT] if e["name"] is not None else None
            bans.append(Ban(e["fingerprint"].lower(), name, e["reason"][:MAX_TEXT],
                            float(e["time"])))
        return cls(bans)

    def save(self, path: Path) -> None:
        """Writes the list to ``path`` (0600), replacing it at once (a crash leaves the
        old list or the new one)."""
        tmp = path.with_name(path.name + ".new")
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with open(fd, "w", encoding="utf-8") as f:
            json.dump({"version": 1, "bans": self.to_json()}, f, indent=1)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)


# --- the socket ------------------------------------------------------------------------


def _prepare(path: Path) -> None:
    """Makes ``path`` ready to bind: its directory exists, belongs to this process's
    user and nobody else may write to it; a stale socket there is removed. Raises
    InvalidUsageError for anything else there."""
    parent = path.parent
    parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = parent.stat()
    if st.st_uid != os.geteuid():
        raise InvalidUsageError(
            f"its directory {str(parent)!r} belongs to uid {st.st_uid}, not to this "
            f"master's uid {os.geteuid()}: put it in a directory the master owns (its "
            f"state directory, or /run/pccl)")
    if st.st_mode & 0o022:
        raise InvalidUsageError(
            f"its directory {str(parent)!r} may be written by others (mode "
            f"{stat.S_IMODE(st.st_mode):o}): anyone could replace the socket; put it in "
            f"a directory only the master may write to")
    try:
        st = path.lstat()
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise InvalidUsageError(f"{str(path)!r} exists and is not a socket: remove it or "
                                f"give another path")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(str(path))
    except ConnectionRefusedError:
        path.unlink()  # stale: left by a master that did not stop cleanly
        log.info("admin socket: removed the stale socket %s", path)
        return
    except OSError as e:
        raise InvalidUsageError(f"{str(path)!r} exists and cannot be checked ({e})") from None
    finally:
        probe.close()
    raise InvalidUsageError(f"another program (another master?) listens on {str(path)!r}")


def peer_uid(sock: socket.socket) -> int:
    """The uid of the process at the other end of a connected Unix socket, as the
    kernel saw it when it connected."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return int(struct.unpack("3i", creds)[1])


def _reply(doc: dict[str, Any]) -> bytes:
    return json.dumps(doc, separators=(",", ":")).encode() + b"\n"


class Master(Protocol):
    """What the admin channel asks of the master (it depends on no server class)."""

    @property
    def address(self) -> str: ...
    @property
    def run_id(self) -> str | None: ...
    @property
    def bans(self) -> BanList: ...

    def admin_peers(self) -> list[PeerEntry]: ...
    def remove_peer(self, target: str, *, reason: str = "") -> str: ...
    def unban(self, target: str) -> str: ...
    async def stop(self, *, end_run: bool = False, reason: str = "") -> None: ...


class AdminServer:
    """The admin socket of ``master`` at ``path``: it owns the listening socket, the
    file and the connections' tasks."""

    def __init__(self, master: Master, path: str) -> None:
        self.master = master
        self.path = Path(path).absolute()
        self._sock: socket.socket | None = None
        self._inode: tuple[int, int] | None = None
        self._accepting: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.refused = 0  # connections refused (credentials, busy, bad requests)

    async def start(self) -> None:
        """Binds the socket (0600). InvalidUsageError when it cannot be used."""
        if not hasattr(socket, "SO_PEERCRED"):
            raise InvalidUsageError("the admin socket needs SO_PEERCRED (Linux) to know "
                                    "who connects; this platform has none")
        try:
            _prepare(self.path)
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        except OSError as e:
            raise InvalidUsageError(f"{str(self.path)!r} cannot be used: {e}") from None
        try:
            sock.bind(str(self.path))
            # (The mode is the first gate; SO_PEERCRED, checked on every connection,
            # is the one that counts.)
            os.chmod(self.path, 0o600)
            sock.listen(16)
            sock.setblocking(False)
            st = self.path.stat()
        except OSError as e:
            sock.close()
            raise InvalidUsageError(f"{str(self.path)!r} cannot be used: {e}") from None
        self._sock = sock
        self._inode = (st.st_dev, st.st_ino)
        self._accepting = asyncio.create_task(self._accept_loop(), name="pccl-master-admin")
        log.info("admin socket on %s (root and uid %d only)", self.path, os.geteuid())

    async def stop(self) -> None:
        """Closes the socket and removes its file (if it is still this one's), and ends
        the connections being served, except the calling one (an ``end-run`` request
        stops the master from its own connection and still answers)."""
        if self._accepting is not None:
            self._accepting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._accepting
            self._accepting = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None
            with contextlib.suppress(OSError):
                st = self.path.lstat()
                if (st.st_dev, st.st_ino) == self._inode:
                    self.path.unlink()
        me = asyncio.current_task()
        others = [t for t in self._tasks if t is not me]
        for t in others:
            t.cancel()
        await asyncio.gather(*others, return_exceptions=True)

    async def _accept_loop(self) -> None:
        assert self._sock is not None
        while True:
            try:
                conn = await accept(self._sock)
            except OSError as e:
                log.warning("admin socket: accepting a connection failed: %s", e)
                await asyncio.sleep(0.1)  # a back-off, not a synchronisation
                continue
            task = asyncio.create_task(self._serve(conn), name="pccl-master-admin-client")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _serve(self, sock: socket.socket) -> None:
        try:
            reader, writer = await asyncio.open_unix_connection(sock=sock,
                                                                limit=MAX_REQUEST + 1)
        except OSError:
            sock.close()
            return
        try:
            doc = await self._answer(sock, reader)
            with contextlib.suppress(OSError, TimeoutError):
                async with asyncio.timeout(DEADLINE):
                    writer.write(_reply(doc))
                    await writer.drain()
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()

    async def _answer(self, sock: socket.socket, reader: asyncio.StreamReader
                      ) -> dict[str, Any]:
        try:
            uid = peer_uid(sock)
        except OSError as e:
            return self._refuse(f"admin socket: a connection refused: its credentials "
                                f"cannot be read ({e})", "who connects cannot be known")
        if uid not in (0, os.geteuid()):
            return self._refuse(
                f"admin socket: a connection from uid {uid} refused (root and uid "
                f"{os.geteuid()} only)",
                f"uid {uid} may not use this master's admin socket (root and uid "
                f"{os.geteuid()}, the master's, only)")
        if len(self._tasks) > MAX_CLIENTS:
            return self._refuse(
                f"admin socket: a connection from uid {uid} refused: {MAX_CLIENTS} are "
                f"being served", "the master is answering other admin requests; try again")
        try:
            async with asyncio.timeout(DEADLINE):
                line = await reader.readuntil(b"\n")
        except asyncio.IncompleteReadError as e:
            line = e.partial  # (a request that ends at EOF, without a newline)
        except asyncio.LimitOverrunError:
            return self._refuse(f"admin socket: a request from uid {uid} refused: over "
                                f"{MAX_REQUEST} bytes",
                                f"a request is one JSON line of at most {MAX_REQUEST} bytes")
        except TimeoutError:
            return self._refuse(f"admin socket: uid {uid} sent no request within "
                                f"{DEADLINE}s", f"no request within {DEADLINE}s")
        except OSError as e:
            return self._refuse(f"admin socket: reading a request failed: {e}", str(e))
        try:
            req = parse_request(line.rstrip(b"\n"))
        except AdminError as e:
            return self._refuse(f"admin socket: a request from uid {uid} refused: {e}",
                                str(e))
        log.info("admin socket: %s %s from uid %d", req.command, req.target or "", uid)
        try:
            return await self._run(req)
        except (PCCLError, AdminError) as e:
            log.warning("admin socket: %s %s failed: %s", req.command, req.target, e)
            return {"ok": False, "error": str(e)}

    def _refuse(self, logged: str, told: str) -> dict[str, Any]:
        self.refused += 1
        log.warning("%s", logged)
        return {"ok": False, "error": told}

    async def _run(self, req: Request) -> dict[str, Any]:
        master = self.master
        if req.command == "remove":
            return {"ok": True, "text": master.remove_peer(req.target, reason=req.reason)}
        if req.command == "unban":
            return {"ok": True, "text": master.unban(req.target)}
        if req.command == "end-run":
            told = len(master.admin_peers())
            reason = req.reason or "the operator ended the run"
            log.warning("admin socket: ending the run (%s)", reason)
            await master.stop(end_run=True, reason=reason)
            return {"ok": True, "text": f"the run is over ({reason}): {told} peers were told, "
                                        f"the master stopped"}
        return {"ok": True, "address": master.address, "run_id": master.run_id,
                "peers": [dataclasses.asdict(p) for p in master.admin_peers()],
                "bans": master.bans.to_json()}


# --- the client ------------------------------------------------------------------------


def request(path: str, doc: dict[str, Any], timeout: float = 30.0) -> dict[str, Any]:
    """Sends one request to the admin socket at ``path`` and returns the reply (whether
    ``ok`` or not). AdminError when there is no answer to be had."""
    line = json.dumps(doc).encode()
    if len(line) > MAX_REQUEST:
        raise AdminError(f"the request is over {MAX_REQUEST} bytes")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.settimeout(timeout)
        try:
            s.connect(path)
        except FileNotFoundError:
            raise AdminError(f"no admin socket at {path!r}: is the master running with "
                             f"--admin-socket {path}?") from None
        except PermissionError:
            raise AdminError(f"no permission to use {path!r}: run this as the master's "
                             f"user or as root") from None
        except ConnectionRefusedError:
            raise AdminError(f"nothing answers on {path!r} (a master that stopped without "
                             f"removing it?)") from None
        except OSError as e:
            raise AdminError(f"cannot reach the admin socket {path!r}: {e}") from None
        buf = bytearray()
        # (A master that refuses a client answers at once and closes, maybe before the
        # request is sent: what it said is still there to read.)
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            s.sendall(line + b"\n")
        try:
            while b"\n" not in buf and len(buf) <= MAX_REPLY:
                chunk = s.recv(1 << 16)
                if not chunk:
                    break
                buf += chunk
        except TimeoutError:
            raise AdminError(f"the master did not answer within {timeout}s") from None
        except OSError as e:
            if e.errno not in (errno.ECONNRESET, errno.EPIPE) or not buf:
                raise AdminError(f"the admin connection failed: {e}") from None
    finally:
        s.close()
    try:
        reply = json.loads(bytes(buf).split(b"\n", 1)[0])
    except ValueError:
        raise AdminError("the master's answer is not JSON (is that a pccl admin "
                         "socket?)") from None
    if not isinstance(reply, dict):
        raise AdminError("the master's answer is not a JSON object")
    return reply


def removed_text(peer: PeerEntry | None, fingerprint: str | None, reason: str) -> str:
    """What the operator and the timeline are told of a removal."""
    who = peer.describe() if peer is not None else f"key {fingerprint}"
    why = f": {reason}" if reason else ""
    return f"{who} removed from the run by the operator{why}"
