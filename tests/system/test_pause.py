"""A peer whose process was paused past the master's heartbeat timeout (laptop sleep,
swap, SIGSTOP) carries on, says that it was paused instead of blaming the master, and a
peer stopped with SIGTERM leaves instead of getting lost.

- ``examples/peer.py`` and the README's training loop (its code block, run as written
  but for a smaller ``STEPS``) as processes: one peer SIGSTOPped for 8 s while a master
  with a 2 s heartbeat timeout drops it, then SIGCONTed; every peer reaches the target
  revision with the same weights hash. Then SIGTERM: the master logs a leave.
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

import numpy as np
import pytest

import pccl
from pccl.peer.pause import PauseWatch, describe
from pccl.testing.processes import kill_and_reap

ROOT = Path(__file__).resolve().parents[2]
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
        await kill_and_reap(self.proc, self._reader)
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


def peer_env(address: str) -> dict[str, str]:
    return {"PCCL_MASTER": address, "PCCL_LOG_LEVEL": "info"}


def at_revision(script: Script, revision: int) -> Callable[[list[str]], bool]:
    return lambda _: any(r >= revision for r, _, _ in script.revisions())


def peer_id(script: Script) -> int:
    ids = [int(m[1]) for m in map(re.compile(r".*peer (\d+): registered with the master")
                                  .match, script.lines) if m]
    assert ids, script.output()
    return ids[0]


async def pause_and_finish(master: Script, peers: list[Script], target: int) -> str:
    """Stops ``peers[0]`` past the heartbeat timeout once every peer trained, lets it go
    on, waits for every peer to end at ``target``; returns their common hash."""
    for p in peers:
        await p.wait_for(at_revision(p, 3), 60, "training")
    paused = peers[0]
    paused.signal(signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        ahead = [r for p in peers for r, _, _ in p.revisions() if r >= target]
        assert not ahead, "the peers finished before the pause began"
        await master.wait_for(lambda lines: any("(heartbeat timeout)" in x for x in lines),
                              30, "the master dropping the stopped peer")
        # The scenario: the process does not run for PAUSE seconds.
        await asyncio.sleep(max(0.0, stopped + PAUSE - time.monotonic()))
    finally:
        paused.signal(signal.SIGCONT)
    for p in peers:
        assert await p.wait_exit(120) == 0, p.output()
    # The same revision and weights on every peer. (Not the world size: a peer that
    # finished first may have left before another one prints its last line.)
    finals = {p.revisions()[-1][::2] for p in peers}
    assert len(finals) == 1, finals
    ((revision, digest),) = finals
    assert revision == target
    # The stopped peer says it was paused, not that the master was lost, and trained on.
    said = [i for i, x in enumerate(paused.lines) if "this process was paused for" in x]
    assert said, paused.output()
    assert "the master dropped it" in paused.lines[said[0]]
    assert not any("lost the master" in x for x in paused.lines), paused.output()
    assert any(REVISION.match(x) for x in paused.lines[said[-1]:]), paused.output()
    assert any("registered again after this master dropped it" in x for x in master.lines)
    return digest


async def leave_with_sigterm(master: Script, peer: Script) -> None:
    """SIGTERM: the peer exits 0 and the master logs a graceful leave, not a loss."""
    me = peer_id(peer)
    peer.signal(signal.SIGTERM)
    assert await peer.wait_exit(30) == 0, peer.output()
    await master.wait_for(lambda lines: any(
        f"peer {me} (accepted, group 0) dropped: left gracefully" in x for x in lines),
        30, f"the master recording peer {me}'s leave")
    assert not any(re.search(rf"peer {me}\b( dropped|.*connection lost)", x)
                   for x in master.lines), master.output()


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
async def test_example_peer_survives_a_pause_and_leaves_on_sigterm(tmp_path: Path) -> None:
    master, address = await start_master(*HEARTBEAT)
    scripts = [master]
    try:
        def peer(i: int, *args: str) -> Script:
            script = Script(sys.executable, str(PEER), "--checkpoint",
                            str(tmp_path / f"peer{i}.npz"), "--checkpoint-every", "25",
                            *args, env=peer_env(address))
            scripts.append(script)
            return script

        peers = [await peer(i, "--peers", "3", "--steps", "150").start() for i in range(3)]
        digest = await pause_and_finish(master, peers, 150)
        for i in range(3):  # the checkpoints hold the final revision and weights
            with np.load(tmp_path / f"peer{i}.npz") as f:
                assert int(f["revision"]) == 150
                assert pccl.content_hash(np.ascontiguousarray(f["weights"]))[:8] == digest

        # A fresh run resumes from the checkpoints; SIGTERM makes a peer leave.
        peers = [await peer(i, "--peers", "2", "--steps", "100000").start()
                 for i in range(3)]
        for p in peers:
            await p.wait_for(at_revision(p, 153), 60, "training from the checkpoint")
        assert all(r >= 150 for p in peers for r, _, _ in p.revisions()), \
            [p.revisions()[:1] for p in peers]
        await leave_with_sigterm(master, peers[2])
        assert any("stopped by a signal: left the run" in x for x in peers[2].lines)
        seen = len(peers[0].lines)
        await peers[0].wait_for(lambda lines: any(
            (m := REVISION.match(x)) and m[2] == "2" for x in lines[seen:]), 60,
            "training on without the peer that left")
        for p in peers[:2]:
            await leave_with_sigterm(master, p)
    finally:
        for s in reversed(scripts):
            await s.close()


def readme_loop(steps: int) -> str:
    """The README's training loop as written, with ``STEPS = steps``."""
    text = (ROOT / "README.md").read_text()
    code = text.split("## Using it\n\n```python\n", 1)[1].split("\n```\n", 1)[0]
    assert "Communicator.from_env()" in code and "signal.SIGTERM" in code
    assert "except pccl.MasterConnectionError" in code
    code, n = re.subn(r"^PEERS, STEPS = 2, \d+", f"PEERS, STEPS = 2, {steps}", code,
                      flags=re.M)
    assert n == 1, "the README loop no longer starts with PEERS, STEPS = 2, ..."
    return code


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
async def test_readme_loop_survives_a_pause_and_leaves_on_sigterm(tmp_path: Path) -> None:
    master, address = await start_master(*HEARTBEAT)
    scripts = [master]
    try:
        def peer(steps: int) -> Script:
            path = tmp_path / f"readme_{steps}.py"
            path.write_text(readme_loop(steps))
            script = Script(sys.executable, str(path), env=peer_env(address))
            scripts.append(script)
            return script

        peers = [await peer(40).start() for _ in range(2)]
        await pause_and_finish(master, peers, 40)
        assert any("carrying on" in x for x in peers[0].lines)

        peers = [await peer(100000).start() for _ in range(2)]
        for p in peers:
            await p.wait_for(at_revision(p, 2), 60, "training")
        for p in peers:
            await leave_with_sigterm(master, p)
    finally:
        for s in reversed(scripts):
            await s.close()


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
