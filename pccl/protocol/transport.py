"""A framed control-plane connection over asyncio streams."""

from __future__ import annotations

import asyncio

from pccl.errors import ProtocolError
from pccl.protocol.codec import MAX_FRAME, decode, frame, parse_length
from pccl.protocol.messages import Message


class ConnectionClosed(Exception):
    """The remote end closed the connection (cleanly or not)."""


class FramedConnection:
    """Reads and writes whole messages. One reader at a time; writes never interleave
    because each message is written with a single ``write`` call."""

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

    @property
    def peername(self) -> tuple[str, int]:
        name = self.writer.get_extra_info("peername")
        return (str(name[0]), int(name[1])) if name else ("?", 0)

    async def recv(self) -> Message:
        """Next message. ``ConnectionClosed`` on EOF/reset, ``ProtocolError`` on garbage."""
        try:
            prefix = await self.reader.readexactly(4)
            body = await self.reader.readexactly(parse_length(prefix, self.max_frame))
        except (asyncio.IncompleteReadError, ConnectionError) as e:
            raise ConnectionClosed(str(e) or "connection closed") from None
        return decode(body)

    def send_nowait(self, msg: Message) -> None:
        """Queues ``msg`` on the transport (no flow control: control messages are small)."""
        if self.writer.is_closing():
            return
        self.writer.write(frame(msg))

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

    async def close(self) -> None:
        """Closes the connection and waits until the socket is released."""
        self.writer.close()
        try:
            await self.writer.wait_closed()
        except (ConnectionError, OSError):
            pass


__all__ = ["ConnectionClosed", "FramedConnection", "ProtocolError"]


