"""A man in the middle for tests: plugged into a ``LinkEmulator``, it changes the bytes
that cross the link on demand, to show that pccl's encrypted transport detects it.

    mitm = Tamper()
    async with LinkEmulator(target, tamper=mitm, record=True) as link:
        ...                               # traffic passes untouched
        mitm.arm("flip")                  # the next read in either direction gets a bit flipped
        ...                               # the connection fails its integrity check
        assert mitm.struck == 1

Attacks, each striking one read (a chunk of whatever the sender wrote) once:
- ``"flip"``: flips the lowest bit of the chunk's last byte (inside a record's tag or
  ciphertext, where a clear-text stream would carry a value);
- ``"inject"``: appends bytes of the attacker's choosing after the chunk;
- ``"replay"``: sends the chunk twice (a replayed record);
- ``"drop"``: swallows the chunk (a record missing from the stream).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

ATTACKS = ("flip", "inject", "replay", "drop")


class Tamper:
    """The ``tamper`` hook of a LinkEmulator, with attacks armed one at a time."""

    def __init__(self) -> None:
        self._armed: tuple[str, str | None, bytes, Callable[[int, str], bool] | None] | None = None
        #: Attacks carried out so far.
        self.struck = 0
        #: (connection id, direction, offset) of each strike.
        self.strikes: list[tuple[int, str, int]] = []
        self._event = asyncio.Event()

    def arm(self, attack: str, direction: str | None = None, *, payload: bytes = b"\x00" * 21,
            when: Callable[[int, str], bool] | None = None) -> None:
        """Strikes the next read in ``direction`` ("client->server", "server->client", or
        None for either), of a connection for which ``when(conn_id, direction)`` holds
        (any when None). ``payload``: what "inject" appends."""
        if attack not in ATTACKS:
            raise ValueError(f"unknown attack {attack!r}; one of {ATTACKS}")
        self._armed = (attack, direction, payload, when)
        self._event.clear()

    @property
    def armed(self) -> bool:
        return self._armed is not None

    async def wait_struck(self) -> None:
        """Until the armed attack has been carried out."""
        await self._event.wait()

    def __call__(self, conn_id: int, direction: str, offset: int, data: bytes) -> bytes:
        if self._armed is None or not data:
            return data
        attack, want_dir, payload, when = self._armed
        if want_dir is not None and direction != want_dir:
            return data
        if when is not None and not when(conn_id, direction):
            return data
        self._armed = None
        self.struck += 1
        self.strikes.append((conn_id, direction, offset))
        self._event.set()
        if attack == "flip":
            return data[:-1] + bytes([data[-1] ^ 1])
        if attack == "inject":
            return data + payload
        if attack == "replay":
            return data + data
        return b""


__all__ = ["ATTACKS", "Tamper"]
