"""The sync-over-async runtime under :mod:`pccl.blocking`: one asyncio event loop on a
daemon thread (``pccl-blocking-loop``), started for the first open resource (a connected
communicator, a running master) and stopped when the last one is closed. Blocking calls
run coroutines on it and wait with the GIL released; Ctrl-C cancels what they wait for.

Process hooks: at interpreter exit, resources that keep the process alive (a serving
master) are waited for until Ctrl-C / SIGTERM, then everything still open is closed and
the loop thread joined; a child process after ``fork()`` starts with a fresh runtime.

The runtime knows nothing of communicators or masters: a resource is anything with
``aclose()``. Its only pccl-specific parts are the errors it raises
(:class:`InvalidUsageError` for misuse, :class:`MasterConnectionError` for a call whose
resource was closed under it); PCCL's ``result`` codes are the callers' business.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import concurrent.futures.thread  # noqa: F401  (its exit hook must be registered before ours)
import contextlib
import logging
import os
import signal
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from pccl.errors import InvalidUsageError, MasterConnectionError

log = logging.getLogger("pccl.blocking")

T = TypeVar("T")

_CANCEL_GRACE = 10.0  # seconds a cancelled call gets to unwind on the loop
_CLOSE_GRACE = 10.0  # seconds each object gets to close at interpreter exit
_LIVENESS_POLL = 1.0  # how often a waiting caller checks that the loop thread lives


class _Loop:
    """One event loop and the daemon thread running it."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        started = threading.Event()
        self.thread = threading.Thread(target=self._main, args=(started,),
                                       name="pccl-blocking-loop", daemon=True)
        self.thread.start()
        if not started.wait(30.0):
            raise RuntimeError("the pccl.blocking event loop thread did not start")

    def _main(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.call_soon(started.set)
        try:
            self.loop.run_forever()
        finally:
            self.loop.close()

    async def _drain(self) -> None:
        """Cancels what is left on the loop, joins the executor, stops the loop."""
        me = asyncio.current_task()
        left = [t for t in asyncio.all_tasks() if t is not me]
        for t in left:
            t.cancel()
        if left:
            finished, _ = await asyncio.wait(left, timeout=_CANCEL_GRACE)
            for t in finished:  # nobody is left to report these to
                if not t.cancelled() and t.exception() is not None:
                    log.debug("task %s ended with %r at shutdown", t.get_name(), t.exception())
        await self.loop.shutdown_asyncgens()
        await self.loop.shutdown_default_executor()
        self.loop.stop()

    def stop(self) -> None:
        """Stops the loop; joins its thread unless called from it."""
        drain = self._drain()
        try:
            asyncio.run_coroutine_threadsafe(drain, self.loop)
        except RuntimeError:  # already closed
            drain.close()
            return
        if threading.current_thread() is not self.thread:
            self.thread.join(_CANCEL_GRACE + 5.0)
            if self.thread.is_alive():
                log.warning("the pccl.blocking event loop did not stop in time")

    def call(self, make: Callable[[], Awaitable[T]]) -> T:
        """Runs the coroutine ``make()`` on the loop; blocks (GIL released) until it
        finishes and returns its result or raises its error."""
        task, done = self.start(make)
        return self.wait(done, task)

    def start(self, make: Callable[[], Awaitable[T]]
              ) -> tuple[list[asyncio.Future[T]], concurrent.futures.Future[T]]:
        """Starts ``make()`` as a task on the loop. Returns a one-slot list that will hold
        the task (for cancellation) and a future that settles when the task is done."""
        if _running_loop() is self.loop:
            raise InvalidUsageError(
                "blocking pccl.blocking calls cannot run on the pccl event loop thread "
                "(they would wait for themselves); use the async pccl API there")
        done: concurrent.futures.Future[T] = concurrent.futures.Future()
        slot: list[asyncio.Future[T]] = []

        def begin() -> None:
            if not done.set_running_or_notify_cancel():
                return
            try:
                task = asyncio.ensure_future(make())
            except BaseException as e:
                done.set_exception(e)
                return
            slot.append(task)
            task.add_done_callback(lambda t: _settle(t, done))

        try:
            self.loop.call_soon_threadsafe(begin)
        except RuntimeError:
            raise InvalidUsageError("the pccl.blocking event loop was shut down "
                                    "(the object was closed)") from None
        return slot, done

    def wait(self, done: concurrent.futures.Future[T],
             slot: list[asyncio.Future[T]] | None = None) -> T:
        """Waits for ``done``; Ctrl-C (or any exception here) cancels the task."""
        try:
            while True:
                finished, _ = concurrent.futures.wait([done], timeout=_LIVENESS_POLL)
                if finished:
                    break
                if not self.thread.is_alive():
                    raise InvalidUsageError("the pccl.blocking event loop thread is gone")
        except BaseException:
            if slot is not None and not done.done():
                def cancel() -> None:
                    if slot:
                        slot[0].cancel()
                    elif not done.done():
                        done.cancel()
                with contextlib.suppress(RuntimeError):
                    self.loop.call_soon_threadsafe(cancel)
                concurrent.futures.wait([done], timeout=_CANCEL_GRACE)
            raise
        try:
            return done.result()
        except concurrent.futures.CancelledError:
            raise MasterConnectionError(
                "the call was cancelled: its communicator or master was closed") from None


def _settle(task: asyncio.Future[T], done: concurrent.futures.Future[T]) -> None:
    if done.done():
        return
    if task.cancelled():
        # ``done`` may be running already, and a running future cannot be cancelled.
        done.set_exception(concurrent.futures.CancelledError())
    elif (exc := task.exception()) is not None:
        done.set_exception(exc)
    else:
        done.set_result(task.result())


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


class _Resource:
    """Something on the loop that must be closed (a connected peer, a running master)."""

    #: a running master keeps the process alive at exit until it is interrupted
    keeps_process_alive = False

    async def aclose(self) -> None:
        raise NotImplementedError

    def describe(self) -> str:
        return type(self).__name__


class _Runtime:
    """The module's one event loop, started for the first open resource and stopped
    when the last one closes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._current: _Loop | None = None
        self._open: set[_Resource] = set()
        self._background: set[asyncio.Task[None]] = set()
        self.pid = os.getpid()

    def acquire(self, resource: _Resource) -> _Loop:
        if os.getpid() != self.pid:
            raise InvalidUsageError("pccl.blocking objects do not survive fork()")
        with self._lock:
            if self._current is None:
                self._current = _Loop()
            self._open.add(resource)
            return self._current

    def release(self, resource: _Resource) -> None:
        with self._lock:
            if resource not in self._open:
                return
            self._open.discard(resource)
            if self._open or self._current is None:
                return
            current, self._current = self._current, None
        current.stop()

    def open_resources(self) -> list[_Resource]:
        with self._lock:
            return list(self._open)

    @property
    def running(self) -> bool:
        """Whether the loop thread runs (for tests and diagnostics)."""
        with self._lock:
            return self._current is not None and self._current.thread.is_alive()

    def close_soon(self, loop: _Loop, resource: _Resource) -> None:
        """Closes ``resource`` in the background (from a finalizer: never blocks)."""
        async def close_then_release() -> None:
            try:
                await resource.aclose()
            except Exception as e:  # a finalizer has nobody to report to
                log.debug("closing %s in the background failed: %s", resource.describe(), e)
            finally:
                self.release(resource)

        def begin() -> None:
            task = loop.loop.create_task(close_then_release())
            self._background.add(task)
            task.add_done_callback(self._background.discard)

        with contextlib.suppress(RuntimeError):
            loop.loop.call_soon_threadsafe(begin)

    def wait_for_serving_masters(self) -> None:
        """At interpreter exit: a master that still runs keeps the process alive until
        it is interrupted (PCCL's master scripts end with ``master.run()``)."""
        if os.getpid() != self.pid:
            return
        serving = [r for r in self.open_resources() if r.keeps_process_alive]
        if serving:
            _wait_for_interrupt(serving)

    def shutdown(self) -> None:
        """At interpreter exit: closes whatever is still open, stops the loop."""
        if os.getpid() != self.pid:
            return
        for resource in self.open_resources():
            with self._lock:
                current = self._current
            if current is None:
                break
            try:
                _, done = current.start(resource.aclose)
                concurrent.futures.wait([done], timeout=_CLOSE_GRACE)
            except Exception as e:
                log.debug("closing %s at exit failed: %s", resource.describe(), e)
            self.release(resource)
        with self._lock:
            current, self._current = self._current, None
            self._open.clear()
        if current is not None:
            current.stop()


def _wait_for_interrupt(serving: list[_Resource]) -> None:
    names = ", ".join(r.describe() for r in serving)
    log.warning("%s keeps serving until interrupted (Ctrl-C or SIGTERM)", names)
    previous = None
    if threading.current_thread() is threading.main_thread():
        def on_sigterm(signum: int, frame: Any) -> None:
            raise KeyboardInterrupt

        previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        for resource in serving:
            stopped = getattr(resource, "stopped", None)
            while stopped is not None and not stopped.wait(_LIVENESS_POLL):
                pass
    except KeyboardInterrupt:
        log.info("interrupted: stopping %s", names)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


_runtime = _Runtime()


def current() -> _Runtime:
    """The process's runtime (a child process after ``fork()`` gets a new, empty one)."""
    return _runtime


def close(resource: _Resource | None, loop: _Loop | None) -> None:
    """Closes ``resource`` on ``loop`` (if it was ever opened there) and releases it: the
    loop stops with the last open resource."""
    if resource is None or loop is None:
        return
    try:
        loop.call(resource.aclose)
    finally:
        current().release(resource)


def _reset_after_fork() -> None:
    global _runtime
    _runtime = _Runtime()


def _wait_for_serving_masters_at_exit() -> None:
    _runtime.wait_for_serving_masters()


def _shutdown_at_exit() -> None:
    if not hasattr(threading, "_register_atexit"):
        _runtime.wait_for_serving_masters()
    _runtime.shutdown()


os.register_at_fork(after_in_child=_reset_after_fork)
# Masters are waited for in threading's exit hook, which runs before the non-daemon
# threads are joined and before concurrent.futures stops accepting work (imported above,
# so its hook runs after ours): a serving master still solves rings in worker threads.
# Everything else is closed by the atexit hook, after the program's threads finished.
if hasattr(threading, "_register_atexit"):
    threading._register_atexit(_wait_for_serving_masters_at_exit)
atexit.register(_shutdown_at_exit)


def loop_thread_running() -> bool:
    """Whether :mod:`pccl.blocking`'s event loop thread is running (it stops when the last
    communicator or master is closed)."""
    return _runtime.running
