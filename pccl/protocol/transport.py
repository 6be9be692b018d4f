"""A framed control-plane connection over asyncio streams, encrypted by default.

Before any message, the dialing side (a peer) opens the connection with one of two
handshakes, the same bytes as pccl's p2p streams (``rust/net/secure/``):

- secure (the default): a Noise handshake, ``Noise_XXpsk3_25519_AESGCM_SHA256`` with the
  shared secret's key mixed in last (``Noise_XX`` without a secret), each end proving its
  static key (``pccl.identity``): with trusted run keys configured, every end must also
  present a certificate for that key, for its role (the master ``master``, a peer
  ``peer``); after the handshake every byte travels in authenticated records;
- clear text (``insecure=True``): the frame ``CLEAR_HELLO``, answered by one status byte.

A record that fails authentication (modified, injected, replayed, cut) ends the
connection (``ConnectionClosed`` saying "integrity check failed"): what it carried never
reaches the codec."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections.abc import Sequence

from pccl import _core
from pccl.errors import (
    AuthenticationError,
    MasterConnectionError,
    PeerConnectionError,
    ProtocolError,
)
from pccl.protocol.codec import MAX_FRAME, decode, frame, parse_length
from pccl.protocol.messages import Message

#: Hashed into every control-plane handshake: a p2p handshake cannot be replayed here.
PROLOGUE = b"pccl control v1"
#: The master's reachability check of a peer's p2p listener (``rust/net/node/accept.rs``).
REACH_PROLOGUE = b"pccl reach v1"
_STATUS_OK = b"\x00"
_STATUS_TRANSPORT_MISMATCH = bytes([_core.STATUS_TRANSPORT_MISMATCH])


async def accept(listener: socket.socket) -> socket.socket:
    """The next connection on ``listener`` (made non-blocking), as ``loop.sock_accept``
    gives it, but safe to cancel. The connection is accepted here, in the awaiting
    coroutine, never in the loop's reader callback: a cancel that races a connection
    becoming ready leaves it in the backlog for the next call. (CPython 3.11's
    ``sock_accept`` accepts in the callback, and when the wait was cancelled in the same
    turn of the loop it drops the accepted socket unclosed.) ``OSError`` from
    ``accept()`` (out of descriptors, ...) goes to the caller."""
    loop = asyncio.get_running_loop()
    listener.setblocking(False)
    fd = listener.fileno()
    while True:
        try:
            conn, _ = listener.accept()
        except (BlockingIOError, InterruptedError):
            pass
        else:
            conn.setblocking(False)
            return conn
        ready: asyncio.Future[None] = loop.create_future()
        loop.add_reader(fd, _wake, ready)
        try:
            await ready
        finally:
            loop.remove_reader(fd)


def _wake(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


def _closed(e: Exception, when: str = "") -> str:
    """What a failed read means, in words: asyncio says "0 bytes read on a total of 4
    expected bytes" for a clean close."""
    where = f" {when}" if when else ""
    if isinstance(e, asyncio.IncompleteReadError):
        if not e.partial:
            return f"the other end closed the connection{where}"
        return f"the other end closed the connection{where}, in the middle of a message"
    if isinstance(e, ConnectionResetError):
        return f"the connection was reset{where}"
    return f"{e or 'the connection failed'}{where}"


class ConnectionClosed(Exception):
    """The remote end closed the connection (cleanly or not), or the connection failed
    its integrity check."""


class FramedConnection:
    """Reads and writes whole messages. One reader at a time; writes never interleave
    because each message is written with a single ``write`` call (records included)."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        *,
        max_frame: int = MAX_FRAME,
    ) -> None:
        self.reader = reader
        self.writer = writer
        self.max_frame = max_frame
        #: The record layer once a secure handshake finished; None in clear text.
        self.session: _core.SecureSession | None = None
        self._plain = bytearray()
        #: The largest frame the other side reads (0: not known), as it said.
        self.peer_max_frame = 0
        # Half-closed by linger(): nothing more is written.
        self._lingering = False
        #: Who the other end proved to be in the secure handshake: (static key,
        #: fingerprint, certificate name, groups, not_after), None in clear text.
        self.remote: tuple[bytes, str, str | None, list[str], int | None] | None = None

    @property
    def peername(self) -> tuple[str, int]:
        name = self.writer.get_extra_info("peername")
        return (str(name[0]), int(name[1])) if name else ("?", 0)

    @property
    def encrypted(self) -> bool:
        return self.session is not None

    # --- handshakes -------------------------------------------------------------------

    async def handshake_frame(self) -> bytes:
        """The next handshake frame (at most ``_core.MAX_HANDSHAKE_FRAME`` bytes):
        ``ConnectionClosed`` on EOF or reset, ``ProtocolError`` past the cap."""
        try:
            prefix = await self.reader.readexactly(4)
            return await self.reader.readexactly(
                parse_length(prefix, _core.MAX_HANDSHAKE_FRAME))
        except (asyncio.IncompleteReadError, ConnectionError) as e:
            raise ConnectionClosed(_closed(e, "during the handshake")) from None

    def send_handshake_frame(self, body: bytes) -> None:
        """Queues one handshake frame (length-prefixed, outside any record layer)."""
        if not self.writer.is_closing():
            self.writer.write(len(body).to_bytes(4, "big") + body)

    async def dial(self, secret: bytes | None, *, insecure: bool = False,
                   identity: _core.Identity | None = None, group: str = "master",
                   expect: bytes | None = None, prologue: bytes = PROLOGUE,
                   also: Sequence[bytes] = ()) -> None:
        """The peer's side: opens the connection encrypted (or in clear text when
        ``insecure``) as ``identity`` (None: a fresh key), asking the other end's
        certificate for ``group`` where ``identity`` checks certificates, and the static
        key ``expect`` where given.
        AuthenticationError when the two ends disagree on the secret or on
        ``insecure``; IdentityError when an identity is refused (either way);
        ProtocolError when the other end is not a pccl master; MasterConnectionError
        when it goes away. The caller bounds the time."""
        try:
            if insecure:
                self.send_handshake_frame(_core.CLEAR_HELLO)
                status = await self.handshake_frame()
                if status == _STATUS_TRANSPORT_MISMATCH:
                    raise AuthenticationError(
                        "the master, or something on the path, says it requires "
                        "encryption and this peer runs in clear text (insecure=True); "
                        "drop insecure=True")
                if status != _STATUS_OK:
                    raise MasterConnectionError(
                        "the remote end does not speak the pccl control protocol")
                return
            hs = _core.SecureHandshake(True, secret, prologue, identity, group, expect,
                                       list(also))
            self.send_handshake_frame(hs.hello())
            while not hs.done:
                out, err = hs.on_frame(await self.handshake_frame())
                if out is not None:
                    self.send_handshake_frame(out)
                if err is not None:
                    raise err
            self.remote = hs.remote
            self.session = hs.session()
        except ConnectionClosed as e:
            raise MasterConnectionError(
                f"the master closed the connection during the secure handshake ({e}); "
                "is it a pccl master of this version?") from None
        except PeerConnectionError as e:
            raise MasterConnectionError(f"control-plane handshake with the master: {e}") from None

    async def accept(self, secret: bytes | None, *, allow_clear: bool,
                     first: bytes | None = None, identity: _core.Identity | None = None,
                     group: str = "peer", also: Sequence[bytes] = ()) -> None:
        """The master's side of ``dial`` (``first``: the dialer's first frame, if read
        already), as ``identity``, asking a certificate for ``group``. Raises
        AuthenticationError (wrong or missing secret, clear text refused), IdentityError
        (an identity refused), PeerConnectionError / ProtocolError (garbage) or
        ConnectionClosed; the reason has been told to the dialer where it should
        know."""
        if first is None:
            first = await self.handshake_frame()
        if first == _core.CLEAR_HELLO and allow_clear:
            self.send_handshake_frame(_STATUS_OK)
            return
        hs = _core.SecureHandshake(False, secret, PROLOGUE, identity, group, None, list(also))
        frame_in = first
        while True:
            out, err = hs.on_frame(frame_in)
            if out is not None:
                self.send_handshake_frame(out)
            if err is not None:
                raise err
            if hs.done:
                break
            frame_in = await self.handshake_frame()
        self.remote = hs.remote
        self.session = hs.session()

    # --- messages ---------------------------------------------------------------------

    async def _read(self, n: int) -> bytes:
        session = self.session
        if session is None:
            return await self.reader.readexactly(n)
        while len(self._plain) < n:
            prefix = await self.reader.readexactly(4)
            length = int.from_bytes(prefix, "big")
            if not session.MIN_RECORD <= length <= session.MAX_RECORD:
                raise ConnectionClosed(
                    "secure connection: integrity check failed (bad record length)")
            self._plain += session.open(await self.reader.readexactly(length))
        out = bytes(self._plain[:n])
        del self._plain[:n]
        return out

    async def recv_exact(self, n: int) -> bytes:
        """The next ``n`` bytes of the stream, not a message (the reachability echo).
        ``ConnectionClosed`` on EOF/reset or a failed integrity check."""
        try:
            return await self._read(n)
        except (asyncio.IncompleteReadError, ConnectionError) as e:
            raise ConnectionClosed(_closed(e)) from None

    async def recv(self) -> Message:
        """Next message. ``ConnectionClosed`` on EOF/reset or a failed integrity check,
        ``ProtocolError`` on garbage."""
        try:
            prefix = await self._read(4)
            body = await self._read(parse_length(prefix, self.max_frame))
        except (asyncio.IncompleteReadError, ConnectionError) as e:
            raise ConnectionClosed(_closed(e)) from None
        except ProtocolError as e:
            if self.session is None:
                raise
            raise ConnectionClosed(str(e)) from None
        return decode(body)

    def send_nowait(self, msg: Message, framed: bytes | None = None) -> None:
        """Queues ``msg`` on the transport (no flow control: control messages are small).
        ``framed``: its frame, when the caller has it already (:class:`FrameCache`)."""
        if self.writer.is_closing() or self._lingering:
            return
        data = frame(msg) if framed is None else framed
        if self.session is not None:
            data = self.session.seal(data)
        self.writer.write(data)

    async def send(self, msg: Message) -> None:
        self.send_nowait(msg)
        try:
            await self.writer.drain()
        except ConnectionError as e:
            raise ConnectionClosed(str(e)) from None

    def buffered_bytes(self) -> int:
        transport = self.writer.transport
        return transport.get_write_buffer_size() if transport else 0

    def abort(self) -> None:
        transport = self.writer.transport
        if transport is not None:
            transport.abort()

    def reset(self) -> None:
        """Aborts with a reset: what is still unsent is thrown away, by the kernel too.
        For a party that does not read: a plain close leaves the kernel sending it the
        rest of its buffer (megabytes) from an orphaned socket."""
        sock = self.writer.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.abort()

    async def linger(self, timeout: float) -> None:
        """Closes after the other side did: half-closes (a FIN after what is queued),
        reads and discards until the other side's FIN or ``timeout``, then closes.

        For a last message the other side must read (a peer's ``Leave``). Closed at
        once, this end answers whatever the other side still writes with a reset, and
        once a write of the other side fails, asyncio drops that connection's unread
        data: the last message with it (tests/integration/test_master_scan.py)."""
        self._lingering = True
        try:
            if self.writer.can_write_eof():
                self.writer.write_eof()
            async with asyncio.timeout(timeout):
                while await self.reader.read(1 << 16):
                    pass
        except (TimeoutError, ConnectionError, OSError):
            pass
        await self.close()

    def start_close(self) -> None:
        """Starts closing the connection (a FIN once what is buffered is sent); the
        socket is released soon after without anything awaiting it."""
        self.writer.close()

    async def close(self) -> None:
        """Closes the connection and waits until the socket is released."""
        self.writer.close()
        try:
            await self.writer.wait_closed()
        except (ConnectionError, OSError):
            pass


__all__ = ["PROLOGUE", "REACH_PROLOGUE", "ConnectionClosed", "FramedConnection",
           "ProtocolError"]
