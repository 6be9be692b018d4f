"""Peers in real subprocesses, for tests that kill, stop or starve a process."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import socket
import sys
from collections.abc import Sequence
from types import TracebackType
from typing import Any

from pccl.errors import ERROR_KINDS, PCCLError

#: Ports :func:`free_port` returned in this process: a port handed to a child that has
#: not bound it yet still looks free, and is never handed out twice.
_handed_out: set[int] = set()


def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1 (for a listener a child
    process or a test binds next).

    It is picked at random *below* the kernel's ephemeral range: ports in that range
    are handed out to every outgoing connection and every ``bind(0)``, so one chosen
    there can be taken by any socket before the listener binds it (seen in a churn soak:
    a joiner's ``Address already in use``); below it, only another explicit bind of the
    same number can collide. A port is never returned twice by one process: handed to a
    child that has not bound it yet, it still looks free (seen in a churn soak: two
    workers on one port, which p2p listeners now refuse).
    """
    low, high = 32768, 60999
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(x) for x in f.read().split())
    except (OSError, ValueError):
        pass
    if low > 2048:
        # Under pytest-xdist each worker draws from its own slice of the range, so two
        # workers never hand out the same port.
        base = max(1024, low - 16384)
        worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
        workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")
        if worker.isdigit() and workers.isdigit() and int(worker) < int(workers):
            width = (low - base) // int(workers)
            base, low = base + int(worker) * width, base + (int(worker) + 1) * width
        rng = random.Random()
        for _ in range(64):
            port = rng.randrange(base, low)
            if port in _handed_out:
                continue
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
                _handed_out.add(port)
                return port
    with socket.socket() as s:  # no room below the range: any free port
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def master_process(port: int, *flags: str, log: Any = None
                         ) -> asyncio.subprocess.Process:
    """``pccl-master`` listening on 127.0.0.1:``port`` in a child process, without a
    status page, with ``flags`` (e.g. ``"--standby"``); its output goes to ``log`` (an
    open file) or nowhere."""
    out = asyncio.subprocess.DEVNULL if log is None else log
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "pccl", "master", "--listen", f"127.0.0.1:{port}",
        "--status", "off", *flags, stdout=out,
        stderr=asyncio.subprocess.DEVNULL if log is None else asyncio.subprocess.STDOUT)


async def kill_and_reap(proc: asyncio.subprocess.Process,
                        reader: asyncio.Task[None] | None) -> None:
    """SIGKILLs ``proc`` if it still runs (a stopped one too), reaps it, and waits out
    ``reader``, the task reading its output: EOF comes once every holder of the pipe
    is gone, so bounded (a command prefix may leave a grandchild holding it)."""
    if proc.returncode is None:
        proc.send_signal(signal.SIGCONT)
        proc.kill()
    await proc.wait()
    if reader is not None:
        await asyncio.wait({reader}, timeout=10)
        reader.cancel()
        await asyncio.gather(reader, return_exceptions=True)


async def stop_process(proc: asyncio.subprocess.Process, timeout: float = 10.0) -> None:
    """SIGTERM (a graceful stop), SIGKILL if it is still running after ``timeout``
    seconds; returns once the process is reaped."""
    if proc.returncode is None:
        proc.terminate()
        try:
            async with asyncio.timeout(timeout):
                await proc.wait()
        except TimeoutError:
            proc.kill()
    await proc.wait()


class PeerProcess:
    """A peer running ``pccl.testing.peer_worker`` in a child process.

    Example::

        async with PeerProcess(master.address) as p:
            await p.wait_accepted()
            await p.call("update_topology")
            p.kill()                     # SIGKILL
    """

    def __init__(
        self,
        master: str,
        *,
        group: int = 0,
        pool_size: int = 2,
        secret: bytes | None = None,
        extra_args: list[str] | None = None,
        reply_timeout: float = 60.0,
        command_prefix: Sequence[str] = (),
    ) -> None:
        self.master = master
        self.group = group
        self.pool_size = pool_size
        self.secret = secret
        self.extra_args = extra_args or []
        self.reply_timeout = reply_timeout
        # Prepended to the worker's command line, e.g. ``ip netns exec NAME`` (the prefix
        # must exec the worker so that signals reach it).
        self.command_prefix = list(command_prefix)
        self.proc: asyncio.subprocess.Process | None = None
        self.peer_id: int | None = None
        self._replies: dict[int, asyncio.Future[Any]] = {}
        self._events: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._reader: asyncio.Task[None] | None = None
        self._next_id = 0

    async def start(self) -> None:
        args = [*self.command_prefix, sys.executable, "-m", "pccl.testing.peer_worker",
                "--master", self.master, "--group", str(self.group),
                "--pool", str(self.pool_size), *self.extra_args]
        if self.secret:
            args += ["--secret-hex", self.secret.hex()]
        self.proc = await asyncio.create_subprocess_exec(
            *args, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self._reader = asyncio.create_task(self._read_stdout())

    async def _read_stdout(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        while line := await self.proc.stdout.readline():
            msg = json.loads(line)
            rid = msg.get("id")
            if rid is not None and rid in self._replies:
                fut = self._replies.pop(rid)
                if not fut.done():
                    fut.set_result(msg)
            else:
                self._events.put_nowait(msg)
        err = ConnectionError(f"peer process exited (code {self.proc.returncode})")
        for fut in self._replies.values():
            if not fut.done():
                fut.set_exception(err)
        self._replies.clear()
        self._events.put_nowait({"event": "exited"})

    async def wait_accepted(self, timeout: float = 60.0) -> int:
        """Waits for the worker's first event; raises its error if it failed."""
        async with asyncio.timeout(timeout):
            ev = await self._events.get()
        if ev.get("event") != "accepted":
            raise ERROR_KINDS.get(ev.get("kind", ""), PCCLError)(
                ev.get("message", f"peer process did not join: {ev}"))
        self.peer_id = int(ev["peer_id"])
        return self.peer_id

    async def call(self, cmd: str, timeout: float | None = None, **kwargs: Any) -> Any:
        """Runs ``cmd`` in the worker; returns its value or raises its pccl error."""
        assert self.proc is not None and self.proc.stdin is not None
        self._next_id += 1
        rid = self._next_id
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._replies[rid] = fut
        self.proc.stdin.write((json.dumps({"id": rid, "cmd": cmd, **kwargs}) + "\n").encode())
        await self.proc.stdin.drain()
        async with asyncio.timeout(timeout or self.reply_timeout):
            reply = await fut
        if not reply["ok"]:
            raise ERROR_KINDS.get(reply["kind"], PCCLError)(reply["message"])
        return reply["value"]

    def kill(self) -> None:
        """SIGKILL: the process dies at once, sockets are reset by the kernel."""
        if self.proc is not None and self.proc.returncode is None:
            self.proc.kill()

    def stop(self) -> None:
        """SIGSTOP: the process freezes with its sockets open (a hung peer)."""
        if self.proc is not None and self.proc.returncode is None:
            self.proc.send_signal(signal.SIGSTOP)

    def cont(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.send_signal(signal.SIGCONT)

    async def close(self) -> None:
        """Kills the process if it still runs and reaps it."""
        if self.proc is None:
            return
        await kill_and_reap(self.proc, self._reader)
        if self.proc.stdin is not None:
            self.proc.stdin.close()
            with contextlib.suppress(Exception):
                await self.proc.stdin.wait_closed()
        self._transport_close()

    def _transport_close(self) -> None:
        transport = getattr(self.proc, "_transport", None)
        if transport is not None:
            transport.close()

    async def __aenter__(self) -> PeerProcess:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()
