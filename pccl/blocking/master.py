"""PCCL's blocking ``MasterNode`` over :class:`pccl.MasterNode`, served on
:mod:`pccl.blocking.runtime`'s loop. A master that runs at interpreter exit keeps the
process alive until interrupted (the runtime's exit hook waits for it)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from pccl.blocking import runtime
from pccl.blocking.compat import ArgumentAssertionError, _reports_result
from pccl.blocking.runtime import _Loop, _Resource
from pccl.errors import InvalidArgumentError, InvalidUsageError
from pccl.master.server import MasterNode as _AsyncMasterNode


class _MasterCore(_Resource):
    keeps_process_alive = True

    def __init__(self, master: _AsyncMasterNode) -> None:
        self.master = master
        self.stopped = threading.Event()

    def describe(self) -> str:
        try:
            return f"pccl.blocking.MasterNode on {self.master.address}"
        except RuntimeError:
            return "pccl.blocking.MasterNode"

    async def aclose(self) -> None:
        try:
            await self.master.stop()
        finally:
            self.stopped.set()


class MasterNode:
    """The run's coordinator (PCCL's ``MasterNode``), serving on the background loop.

    ``run()`` returns once it listens; ``interrupt()`` stops it. Like PCCL's, a master
    that runs when the interpreter exits keeps the process alive until interrupted
    (Ctrl-C or SIGTERM), so ``master.run()`` may be a script's last line. Keyword
    arguments go to :class:`pccl.MasterNode` (``secret``, ``heartbeat_timeout``, ...).

    Example::

        with pccl.MasterNode(listen_address="127.0.0.1:0") as master:   # runs it
            print(master.address)
    """

    @_reports_result
    def __init__(self, listen_address: str, **options: Any) -> None:
        if not isinstance(listen_address, str) or ":" not in listen_address:
            raise ArgumentAssertionError(
                f"Invalid listen address: {listen_address}, expected format: ip:port")
        self.listen_address = listen_address
        self._master = _AsyncMasterNode(listen=listen_address, **options)
        self._lock = threading.Lock()
        self._core: _MasterCore | None = None
        self._loop: _Loop | None = None
        self._interrupted = False

    @_reports_result
    def run(self) -> None:
        """Starts serving; returns once the socket listens."""
        with self._lock:
            if self._interrupted:
                raise InvalidUsageError("the master node was interrupted; create a new one")
            if self._core is not None:
                raise InvalidArgumentError("the master node is already running")
            core = self._core = _MasterCore(self._master)
        loop = runtime.current().acquire(core)
        try:
            loop.call(self._master.start)
        except BaseException:
            with self._lock:
                self._core = None
            runtime.current().release(core)
            raise
        self._loop = loop

    @_reports_result
    def interrupt(self) -> None:
        """Stops serving and closes every peer connection. Idempotent."""
        with self._lock:
            if self._interrupted:
                return
            self._interrupted = True
            core, loop = self._core, self._loop
        runtime.close(core, loop)

    close = interrupt

    @property
    def address(self) -> str:
        """The "host:port" bound (the real port when listening on port 0)."""
        if self._core is None:
            raise InvalidUsageError("the master node is not running; call run() first")
        return self._master.address

    @_reports_result
    def wait_for(self, predicate: Callable[[Any], bool], timeout: float = 30.0) -> None:
        """Blocks until ``predicate(master_state)`` holds (see
        :meth:`pccl.MasterNode.wait_for`), e.g. ``lambda s: len(s.pending()) == 2``."""
        core, loop = self._core, self._loop
        if core is None or loop is None or self._interrupted:
            raise InvalidUsageError("the master node is not running")
        loop.call(lambda: self._master.wait_for(predicate, timeout))

    def __enter__(self) -> MasterNode:
        if self._core is None:
            self.run()
        return self

    def __exit__(self, *exc: object) -> None:
        self.interrupt()
