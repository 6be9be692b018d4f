"""A device for tests without a GPU: its memory is numpy arrays, its copies complete
later, on a worker thread per direction (like CUDA streams), after a set delay, and can
be told to fail. Every copy's start and end go to :attr:`FakeDevice.trace`, so tests
can check what overlapped with what.

Example::

    with FakeDevice(delay=0.001) as dev:
        x = dev.put(np.arange(8, dtype=np.float32))
        await comm.all_reduce(x)          # staged through host buffers, piece by piece
        result = x.numpy()
"""

from __future__ import annotations

import asyncio
import dataclasses
import queue
import threading
import time
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any

import numpy as np

from pccl.staging import DeviceTensor, HostBuffer
from pccl.tensors import _NUMPY_DTYPES

__all__ = ["FakeDevice", "FakeDeviceError", "FakeTensor"]

#: The longest a copy waits for the copies it was ordered after (a test's bound).
_DEPENDENCY_WAIT = 30.0


class FakeDeviceError(RuntimeError):
    """A copy the test told to fail."""


class FakeEvent:
    """A queued copy: done once it ran (or failed)."""

    def __init__(self, label: tuple[str, int]) -> None:
        self.label = label
        self.done = threading.Event()
        self.error: BaseException | None = None


class FakeTensor:
    """A tensor in the fake device's memory. Read it with :meth:`numpy` only while no
    call uses it."""

    def __init__(self, device: FakeDevice, array: np.ndarray) -> None:
        self._pccl_staging_device = device
        self.array = array

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.array.shape)

    def numpy(self) -> np.ndarray:
        """A host copy of the contents."""
        return self.array.copy()


@dataclasses.dataclass
class _Stream:
    jobs: queue.Queue[tuple[FakeEvent, Sequence[FakeEvent], Callable[[], None]] | None]
    thread: threading.Thread


class FakeDevice:
    """See the module docstring. ``delay``: seconds each copy takes. ``fail``: copies to
    fail, as (direction, offset) pairs: direction ``"d2h"``, ``"h2d"`` or ``"d2d"``,
    offset the first byte of the copy in device memory. Close it (``with``) to stop its
    threads."""

    def __init__(self, delay: float = 0.0, fail: Sequence[tuple[str, int]] = ()) -> None:
        self.name = "fake device"
        self.delay = delay
        self.fail = set(fail)
        self.trace: list[tuple[str, str, int]] = []  # (what, "start" | "end", offset)
        self._lock = threading.Lock()
        self._streams: dict[str, _Stream] = {}
        self.pinned = 0  # host buffers handed out

    # --- tests' side ---

    def put(self, array: Any) -> FakeTensor:
        """A copy of ``array`` (numpy) in the device's memory."""
        return FakeTensor(self, np.ascontiguousarray(array).copy())

    def note(self, what: str, phase: str, key: int) -> None:
        """Adds a line to :attr:`trace` (the tests' own events, e.g. a collective's)."""
        with self._lock:
            self.trace.append((what, phase, key))

    def close(self) -> None:
        for s in self._streams.values():
            s.jobs.put(None)
        for s in self._streams.values():
            s.thread.join(timeout=_DEPENDENCY_WAIT)
        self._streams.clear()

    def __enter__(self) -> FakeDevice:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    # --- the stager's side (pccl.staging.Device) ---

    def tensor(self, t: Any, what: str) -> DeviceTensor:
        from pccl.errors import InvalidArgumentError

        if not isinstance(t, FakeTensor) or t._pccl_staging_device is not self:
            raise InvalidArgumentError(f"{what} is not in this fake device's memory")
        dtype = _NUMPY_DTYPES.get(t.array.dtype.name)
        if dtype is None:
            raise InvalidArgumentError(f"{what} has unsupported dtype {t.array.dtype}")
        data = t.array.reshape(-1).view(np.uint8)
        return DeviceTensor(data=data, dtype=dtype, count=int(t.array.size),
                            nbytes=int(data.nbytes), shape=t.shape, owner=t)

    def host_buffer(self, nbytes: int) -> HostBuffer:
        self.pinned += 1
        data = np.empty(nbytes, dtype=np.uint8)
        return HostBuffer(handle=data, data=data)

    def scratch(self, nbytes: int) -> Any:
        return np.empty(nbytes, dtype=np.uint8)

    def begin(self) -> None:
        pass  # (nothing is queued on a fake device but the stager's copies)

    def to_host(self, src: Any, offset: int, nbytes: int, host: HostBuffer,
                after: Sequence[Any]) -> FakeEvent:
        def run() -> None:
            host.handle[:nbytes] = src[offset:offset + nbytes]
        return self._queue("d2h", offset, after, run)

    def to_device(self, host: HostBuffer, dst: Any, offset: int, nbytes: int) -> FakeEvent:
        def run() -> None:
            dst[offset:offset + nbytes] = host.handle[:nbytes]
        return self._queue("h2d", offset, (), run)

    def copy(self, dst: Any, src: Any) -> FakeEvent:
        def run() -> None:
            dst[:] = src
        # (On the host-to-device stream, after the copies queued there, as TorchCuda.)
        return self._queue("h2d", 0, (), run, what="d2d")

    async def wait(self, event: FakeEvent) -> None:
        if not event.done.is_set():
            await asyncio.to_thread(event.done.wait, _DEPENDENCY_WAIT)
        self._check(event)

    def synchronize(self, event: FakeEvent) -> None:
        event.done.wait(_DEPENDENCY_WAIT)
        self._check(event)

    @staticmethod
    def _check(event: FakeEvent) -> None:
        if not event.done.is_set():
            raise FakeDeviceError(f"{event.label} did not complete in {_DEPENDENCY_WAIT}s")
        if event.error is not None:
            raise event.error

    def _queue(self, stream: str, offset: int, after: Sequence[FakeEvent],
               run: Callable[[], None], what: str | None = None) -> FakeEvent:
        what = what or stream
        ev = FakeEvent((what, offset))
        s = self._streams.get(stream)
        if s is None:
            jobs: queue.Queue[Any] = queue.Queue()
            s = self._streams[stream] = _Stream(jobs, threading.Thread(
                target=self._serve, args=(jobs,), name=f"fake-device-{stream}", daemon=True))
            s.thread.start()
        s.jobs.put((ev, after, run))
        return ev

    def _serve(self, jobs: queue.Queue[Any]) -> None:
        while (job := jobs.get()) is not None:
            ev, after, run = job
            what, offset = ev.label
            try:
                for dep in after:
                    if not dep.done.wait(_DEPENDENCY_WAIT):
                        raise FakeDeviceError(f"{dep.label} never completed")
                self.note(what, "start", offset)
                if self.delay:
                    time.sleep(self.delay)  # (the copy's duration: a simulation)
                if (what, offset) in self.fail:
                    raise FakeDeviceError(f"fake {what} copy at byte {offset} failed")
                run()
            except BaseException as e:
                ev.error = e
            finally:
                self.note(what, "end", offset)
                ev.done.set()
