"""A peer whose process was paused past the master's heartbeat timeout (laptop sleep,
swap, SIGSTOP) says that it was paused instead of blaming the master.

- A Communicator whose event loop is blocked past the heartbeat timeout: its error and
  its log say this process was paused.
- :class:`pccl.peer.pause.PauseWatch` on its own.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

import pccl
from pccl.peer.pause import PauseWatch, describe

ROOT = Path(__file__).resolve().parent.parent
PEER = ROOT / "examples" / "peer.py"
HEARTBEAT = ["--heartbeat-interval", "0.25", "--heartbeat-timeout", "2"]
PAUSE = 8.0  # seconds a peer is stopped: four heartbeat timeouts
REVISION = re.compile(r"^revision (\d+): (\d+) peers, weights ([0-9a-f]{8})$")


class Script:
    """A child process whose output (stdout and stderr together) is kept as lines."""

    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        self.args = args
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.lines: list[str] = []
        self.proc: asyncio.subprocess.Process | None = None
        self._reader: asyncio.Task[None] | None = None
        self._new = asyncio.Event()

    async def start(self) -> Script:
        self.proc = await asyncio.create_subprocess_exec(
            *self.args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
            env=self.env, cwd=ROOT)
        self._reader = asyncio.create_task(self._read())
        return self

    async def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        while line := await self.proc.stdout.readline():
            self.lines.append(line.decode(errors="replace").rstrip("\n"))
            self._new.set()
        await self.proc.wait()
        self._new.set()

    async def wait_for(self, what: Callable[[list[str]], object], timeout: float,
                       doing: str) -> object:
        """Polls ``what(self.lines)`` at each new line until it is true; fails after
        ``timeout`` seconds or when the process ends without it."""
        deadline = time.monotonic() + timeout
        while True:
            self._new.clear()
            got = what(self.lines)
            if got:
                return got
            if self.exited():
                raise AssertionError(f"{doing}: the process exited first\n{self.output()}")
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"{doing}: not within {timeout}s\n{self.output()}")
            try:
                async with asyncio.timeout(left):
                    await self._new.wait()
            except TimeoutError:
                pass

    def exited(self) -> bool:
        return self._reader is not None and self._reader.done()

    async def wait_exit(self, timeout: float) -> int:
        await self.wait_for(lambda _: self.exited(), timeout, "exit")
        assert self.proc is not None and self.proc.returncode is not None
        return self.proc.returncode

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def output(self) -> str:
        return "\n".join(self.lines[-60:])

    def revisions(self) -> list[tuple[int, int, str]]:
        """(revision, peers, hash) of every step line so far."""
        return [(int(m[1]), int(m[2]), m[3]) for m in map(REVISION.match, self.lines) if m]

    async def close(self) -> None:
        if self.proc is None:
            return
        if self.proc.returncode is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
        await self.proc.wait()
        if self._reader is not None:
            await asyncio.gather(self._reader, return_exceptions=True)
        transport = getattr(self.proc, "_transport", None)
        if transport is not None:
            transport.close()


async def start_master(*flags: str) -> tuple[Script, str]:
    master = await Script(sys.executable, "-m", "pccl", "master", "--listen", "127.0.0.1:0",
                          "--status", "off", *flags).start()
    got = await master.wait_for(
        lambda lines: next((m[1] for m in map(
            re.compile(r"^pccl master listening on (\S+)$").match, lines) if m), None),
        30, "the master's address")
    return master, str(got)


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
async def test_a_blocked_event_loop_is_reported_as_a_pause_not_a_lost_master(
        caplog: pytest.LogCaptureFixture) -> None:
    master, address = await start_master("--heartbeat-interval", "0.2",
                                         "--heartbeat-timeout", "1")
    try:
        async with pccl.Communicator(master=address, p2p_listen_host="127.0.0.1") as comm:
            caplog.set_level(logging.WARNING, logger="pccl.communicator")
            time.sleep(2.5)  # noqa: ASYNC251 (the scenario: this loop blocked past the timeout)
            with pytest.raises(pccl.MasterConnectionError,
                               match=r"this process was paused for 2\.\d+s .*longer than "
                                     r"the master's heartbeat timeout \(1s\): the master "
                                     "dropped it"):
                await comm.are_peers_pending()
            assert await comm.are_peers_pending() is False  # waits for the re-registration
            assert comm.reconnects == 1
        said = [r.getMessage() for r in caplog.records if "registering again" in r.getMessage()]
        assert len(said) == 1 and "this process was paused for" in said[0], said
        assert not any("lost the master" in r.getMessage() for r in caplog.records)
        await master.wait_for(lambda lines: any("(heartbeat timeout)" in x for x in lines),
                              10, "the master's drop")
    finally:
        await master.close()


def test_pause_watch() -> None:
    w = PauseWatch(interval=0.5, last=100.0)
    w.tick(100.5)
    w.tick(101.05)  # a little late: not a pause
    assert w.paused_for(101.1, within=5.0) == 0.0
    w.tick(109.55)  # 8 s late
    assert w.paused_for(109.6, within=5.0) == pytest.approx(8.0)
    assert w.paused_for(113.0, within=5.0) == pytest.approx(8.0)  # still recent
    for i in range(1, 11):
        w.tick(109.55 + 0.5 * i)  # on time again
    assert w.paused_for(115.0, within=5.0) == 0.0  # long over
    # No tick since the pause began: the caller is the first to run after it.
    fresh = PauseWatch(interval=0.5, last=200.0)
    assert fresh.paused_for(200.4, within=5.0) == 0.0
    assert fresh.paused_for(207.5, within=5.0) == pytest.approx(7.0)


def test_describe_says_what_happened() -> None:
    assert describe(8.04, 5.0) == (
        "this process was paused for 8.0s (SIGSTOP, laptop sleep, swap, or an event loop "
        "blocked by a long call), longer than the master's heartbeat timeout (5s): the "
        "master dropped it")
    assert "did not survive" in describe(3.0, 5.0)
