"""Device tensors (CUDA) through pinned host memory: the pipelined all-reduce and the
content hash.

The Rust core reads and writes host memory only. A tensor on a device is cut into
pieces (:data:`PIECE_BYTES`, element-aligned); each piece is copied to a pinned host
buffer, all-reduced there by its own collective, and copied back. Three things overlap:
the device-to-host copy of the next pieces, the collectives of up to :data:`DEPTH`
pieces, and the host-to-device copies of finished ones. Copies run on side streams of
their own (one per direction), ordered after the work the caller had queued on the
tensor's device when the call started.

All or nothing, as for host tensors:

- In place, finished pieces land in a device scratch buffer, and the tensor is written
  once, by one device-to-device copy, after every piece succeeded and every peer said its
  copies did (a one-byte vote, the call's last collective). A failed call leaves the
  tensor as it was. Out of place, pieces land in ``out`` directly (on failure it holds
  unspecified bytes, as on the host path); the input is never written.
- Every peer sees the same outcome for each piece (the master decides it), and a peer
  starts piece ``i`` only once the outcome of piece ``i - DEPTH`` is known: so every
  peer starts the same pieces, stops at the same one after a failure, and raises the
  same error class (the failed piece of lowest index's). The pieces of a call that ran
  on different worlds (a peer was lost between two pieces) fail the call alike
  (:class:`PeerConnectionError`): a result mixing worlds is no sum of anything.
- A local device fault (a copy that raised) does not stop this peer's part: it joins
  every piece as planned (with whatever bytes its buffers hold) and votes no, so every
  peer fails the call (``CollectiveAbortedError`` on the others, the device's own error
  here) and nobody waits for a piece this peer never starts.
- Before the call returns, every piece's collective has ended and every copy it queued
  has completed: nothing writes the caller's tensors afterwards.

Each piece runs under an internal tag derived from the caller's (:func:`piece_tag`), in
a range user tags may not use (:data:`STAGED_TAG_BASE` and above). :data:`PIECE_BYTES`
and :data:`DEPTH` must be the same on every peer (they decide the pieces and which are
started; peers that differ fail with ``InvalidUsageError``).

A device is whatever implements :class:`Device`: :class:`TorchCuda` for torch CUDA
tensors (streams, events and pinned memory from torch; no CUDA toolkit needed to build
pccl), :class:`pccl.testing.fake_device.FakeDevice` for tests without a GPU. An object
carrying a ``_pccl_staging_device`` attribute (a :class:`Device`) is staged through it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

from pccl.enums import DataType
from pccl.errors import (
    CollectiveAbortedError,
    InvalidArgumentError,
    PeerConnectionError,
)
from pccl.peer.options import ReduceInfo
from pccl.tensors import ELEMENT_SIZE, _is_torch, byte_buffer, torch_dtype
from pccl.tensors import content_hash as _host_content_hash

__all__ = ["DEPTH", "PIECE_BYTES", "STAGED_TAG_BASE", "Device", "DeviceTensor", "HostBuffer",
           "TorchCuda", "check_user_tag", "device_of", "piece_tag", "staged_all_reduce",
           "staged_content_hash"]

log = logging.getLogger(__name__)

#: Bytes of one piece (the last may be shorter). The same on every peer.
PIECE_BYTES = 16 << 20
#: Pieces whose collectives run at once, at most. The same on every peer.
DEPTH = 3

#: Tags from here on are the pieces' of staged calls; user tags stay below.
STAGED_TAG_BASE = 1 << 63
#: Internal tags per user tag: one per piece, the last for the vote.
_TAGS_PER_CALL = 1 << 20
_VOTE = _TAGS_PER_CALL - 1
#: The largest user tag a staged call can derive piece tags from (they must fit in
#: the 64 unsigned bits the wire carries).
MAX_STAGED_TAG = ((1 << 64) - STAGED_TAG_BASE) // _TAGS_PER_CALL - 1


def check_user_tag(tag: Any) -> int:
    """``tag`` if a caller may use it (a non-negative int below :data:`STAGED_TAG_BASE`)."""
    if isinstance(tag, bool) or not isinstance(tag, int) or tag < 0:
        raise InvalidArgumentError("tag must be a non-negative integer")
    if tag >= STAGED_TAG_BASE:
        raise InvalidArgumentError(
            f"tag {tag} is in the range pccl keeps for the pieces of device tensors "
            f"(2**63 and above); use a smaller tag")
    return tag


def piece_tag(tag: int, index: int) -> int:
    """The internal tag of piece ``index`` (or the vote, ``index=-1``) of a staged call
    under user tag ``tag``: the same on every peer."""
    if tag > MAX_STAGED_TAG:
        raise InvalidArgumentError(
            f"tag {tag} is too large for a device tensor (at most {MAX_STAGED_TAG}): its "
            f"pieces need tags of their own")
    slot = _VOTE if index < 0 else index
    if index >= _VOTE:
        raise InvalidArgumentError(
            f"a device tensor of more than {_VOTE} pieces; raise pccl.staging.PIECE_BYTES")
    return STAGED_TAG_BASE + tag * _TAGS_PER_CALL + slot


# --- devices ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DeviceTensor:
    """A tensor in device memory as flat bytes: what the stager needs of it."""

    data: Any  # a flat uint8 view of the device memory (the device's own type)
    dtype: DataType
    count: int
    nbytes: int
    shape: tuple[int, ...]
    owner: Any  # the caller's object (kept alive)


@dataclasses.dataclass(frozen=True)
class HostBuffer:
    """A pinned host buffer: ``handle`` for the device's copies, ``data`` (a flat uint8
    numpy array or memoryview of the same memory) for the collective."""

    handle: Any
    data: Any


class Device(Protocol):
    """What the stager needs of a device. Copies are asynchronous: each returns an event
    (the device's own type) that :meth:`wait` awaits; copies of one direction run in the
    order they were queued."""

    name: str

    def tensor(self, obj: Any, what: str) -> DeviceTensor:
        """``obj``'s memory, or InvalidArgumentError (not contiguous, unsupported dtype)."""
        ...

    def host_buffer(self, nbytes: int) -> HostBuffer: ...

    def scratch(self, nbytes: int) -> Any:
        """Device memory of ``nbytes`` bytes (flat uint8, like ``DeviceTensor.data``)."""
        ...

    def begin(self) -> None:
        """Orders the copies queued from now on after the caller's queued work."""
        ...

    def to_host(self, src: Any, offset: int, nbytes: int, host: HostBuffer,
                after: Sequence[Any]) -> Any:
        """Copies ``src[offset:offset + nbytes]`` to ``host``, once ``after`` completed."""
        ...

    def to_device(self, host: HostBuffer, dst: Any, offset: int, nbytes: int) -> Any:
        """Copies ``nbytes`` bytes of ``host`` to ``dst[offset:offset + nbytes]``."""
        ...

    def copy(self, dst: Any, src: Any) -> Any:
        """Copies all of ``src`` to ``dst`` (device to device, after the host-to-device
        copies queued before)."""
        ...

    async def wait(self, event: Any) -> None:
        """Until ``event``'s copy completed, without blocking the event loop; raises the
        copy's error."""
        ...

    def synchronize(self, event: Any) -> None:
        """:meth:`wait`, blocking (for synchronous callers)."""
        ...


class TorchCuda:
    """One CUDA device through torch: a side stream per copy direction, torch events,
    pinned host buffers from torch's caching host allocator. One per call."""

    def __init__(self, device: Any) -> None:
        import torch

        self._torch: Any = torch  # (untyped here: torch's stubs call much untyped)
        self.device = device
        self.name = f"torch {device}"
        self._d2h = self._torch.cuda.Stream(device=device)
        self._h2d = self._torch.cuda.Stream(device=device)

    def tensor(self, obj: Any, what: str) -> DeviceTensor:
        if not obj.is_contiguous():
            raise InvalidArgumentError(f"{what} is not contiguous; call .contiguous() first")
        dtype = torch_dtype(obj, what)
        flat = obj.detach().reshape(-1)
        data = flat.view(self._torch.uint8)
        return DeviceTensor(data=data, dtype=dtype, count=int(flat.numel()),
                            nbytes=int(data.numel()), shape=tuple(int(d) for d in obj.shape),
                            owner=obj)

    def host_buffer(self, nbytes: int) -> HostBuffer:
        torch = self._torch
        t = torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=True)
        return HostBuffer(handle=t, data=t.numpy())

    def scratch(self, nbytes: int) -> Any:
        torch = self._torch
        t = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        t.record_stream(self._h2d)  # written there: not reused before that work is done
        return t

    def begin(self) -> None:
        torch = self._torch
        queued = torch.cuda.current_stream(self.device)
        self._d2h.wait_stream(queued)
        self._h2d.wait_stream(queued)

    def _event(self, stream: Any) -> Any:
        ev = self._torch.cuda.Event()
        ev.record(stream)
        return ev

    def to_host(self, src: Any, offset: int, nbytes: int, host: HostBuffer,
                after: Sequence[Any]) -> Any:
        with self._torch.cuda.stream(self._d2h):
            for ev in after:
                self._d2h.wait_event(ev)
            host.handle[:nbytes].copy_(src[offset:offset + nbytes], non_blocking=True)
            return self._event(self._d2h)

    def to_device(self, host: HostBuffer, dst: Any, offset: int, nbytes: int) -> Any:
        with self._torch.cuda.stream(self._h2d):
            dst[offset:offset + nbytes].copy_(host.handle[:nbytes], non_blocking=True)
            return self._event(self._h2d)

    def copy(self, dst: Any, src: Any) -> Any:
        with self._torch.cuda.stream(self._h2d):
            dst.copy_(src, non_blocking=True)
            return self._event(self._h2d)

    async def wait(self, event: Any) -> None:
        if not event.query():
            # (A thread of the loop's executor waits: synchronize() releases the GIL.)
            await asyncio.to_thread(event.synchronize)

    def synchronize(self, event: Any) -> None:
        event.synchronize()


def device_of(obj: Any) -> Device | None:
    """The device ``obj`` lives on when it must be staged (a torch CUDA tensor, or an
    object naming its :class:`Device`); None for host memory."""
    dev = getattr(obj, "_pccl_staging_device", None)
    if dev is not None:
        return dev  # type: ignore[no-any-return]
    if type(obj).__module__.split(".")[0] == "torch":
        device = getattr(obj, "device", None)
        if device is not None and device.type == "cuda":
            return TorchCuda(device)
        if device is not None and device.type not in ("cpu", "cuda"):
            raise InvalidArgumentError(
                f"tensor is on {device}; pccl takes CPU and CUDA tensors")
    return None


# --- the all-reduce --------------------------------------------------------------------

#: ``reduce(index, data, dtype, count, vote=..., late=...)``: all-reduces ``count``
#: elements of ``dtype`` in the host bytes ``data`` in place, as piece ``index`` of the
#: call (``vote``: the call's vote, a MAX of one byte); ``late``: started after an outcome
#: the whole group shares (the other peers are near).
ReducePiece = Callable[..., Awaitable[ReduceInfo]]


def _geometry(nbytes: int, element: int, piece_bytes: int) -> list[tuple[int, int]]:
    """(offset, length) of each piece: element-aligned, at least one (maybe empty)."""
    step = max(element, piece_bytes - piece_bytes % element)
    return [(off, min(step, nbytes - off)) for off in range(0, nbytes, step)] or [(0, 0)]


class _StagedRun:
    """One staged all-reduce: the state of its pieces (see the module docstring)."""

    def __init__(self, device: Device, src: DeviceTensor, out: DeviceTensor | None,
                 reduce: ReducePiece, piece_bytes: int, depth: int) -> None:
        if depth < 1:
            raise InvalidArgumentError(f"depth must be at least 1, got {depth}")
        self.device, self.src, self.out, self.reduce, self.depth = device, src, out, reduce, depth
        self.element = ELEMENT_SIZE[src.dtype]
        self.pieces = _geometry(src.nbytes, self.element, piece_bytes)
        self.n_slots = min(depth + 1, len(self.pieces))
        self.slots: list[HostBuffer] = []
        self.target: Any = None  # where finished pieces land: out, or a scratch
        self.d2h: dict[int, Any] = {}
        self.h2d: dict[int, Any] = {}
        self.events: list[Any] = []  # every copy queued, for the drain
        self.tasks: dict[int, asyncio.Task[ReduceInfo]] = {}
        self.infos: dict[int, ReduceInfo] = {}
        self.failure: BaseException | None = None  # the lowest failed piece's error
        self.fault: BaseException | None = None  # this peer's first device fault

    def _device_call(self, what: str, call: Callable[[], Any]) -> Any:
        """A device operation; a fault is recorded (the first one), not raised: this
        peer keeps its part in the group's pieces and votes no."""
        if self.fault is not None:
            return None  # (a faulted device is not touched again)
        try:
            ev = call()
        except Exception as e:  # the device's own errors (torch raises RuntimeError)
            self._faulted(what, e)
            return None
        if ev is not None:
            self.events.append(ev)
        return ev

    def _faulted(self, what: str, e: BaseException) -> None:
        if self.fault is None:
            log.warning("staged all-reduce on %s: %s failed: %s", self.device.name, what, e)
            self.fault = e

    def _host_buffer(self, nbytes: int) -> HostBuffer:
        """A pinned buffer; after a fault, plain memory: this peer still joins every
        piece (its bytes do not matter then: it votes no)."""
        if self.fault is None:
            try:
                return self.device.host_buffer(nbytes)
            except Exception as e:  # the device's own errors (out of pinned memory)
                self._faulted("pinned host allocation", e)
        data = byte_buffer(nbytes)
        return HostBuffer(handle=data, data=data)

    def _scratch(self) -> Any:
        try:
            return self.device.scratch(self.src.nbytes)
        except Exception as e:  # the device's own errors (out of memory)
            self._faulted("scratch allocation", e)
            return None

    def _to_host(self, j: int) -> None:
        off, n = self.pieces[j]
        slot = self.slots[j % self.n_slots]
        after = [self.h2d[j - self.n_slots]] if j - self.n_slots in self.h2d else []
        self.d2h[j] = self._device_call(f"copy of piece {j} to the host", lambda: (
            self.device.to_host(self.src.data, off, n, slot, after)))

    async def _wait(self, what: str, ev: Any) -> None:
        if ev is None:
            return
        try:
            await self.device.wait(ev)
        except Exception as e:  # the device's own errors
            self._faulted(what, e)

    def _start(self, i: int) -> None:
        off, n = self.pieces[i]
        data = self.slots[i % self.n_slots].data[:n]
        self.tasks[i] = asyncio.ensure_future(self.reduce(
            i, data, self.src.dtype, n // self.element, vote=False, late=i >= self.depth))

    async def _retire(self, j: int) -> None:
        """Piece ``j``'s outcome; on success its copy to the device, and the next piece
        that uses its host buffer is copied in once that copy is done."""
        try:
            self.infos[j] = await self.tasks[j]
        except Exception as e:  # (CancelledError is not one: the call was cancelled)
            if self.failure is None:
                self.failure = e
        if self.failure is not None:
            return
        off, n = self.pieces[j]
        slot, target = self.slots[j % self.n_slots], self.target
        if n:
            self.h2d[j] = self._device_call(f"copy of piece {j} to the device", lambda: (
                self.device.to_device(slot, target, off, n)))
        if j + self.n_slots < len(self.pieces):
            self._to_host(j + self.n_slots)

    async def run(self) -> ReduceInfo:
        dev, pieces = self.device, self.pieces
        size = max(n for _, n in pieces)
        self.slots = [self._host_buffer(size) for _ in range(self.n_slots)]
        self.target = self.out.data if self.out is not None else self._scratch()
        self._device_call("ordering after the queued work", dev.begin)
        for j in range(self.n_slots):
            if pieces[j][1]:
                self._to_host(j)
        retired = 0
        for i in range(len(pieces)):
            if i >= self.depth:
                await self._retire(i - self.depth)
                retired += 1
                if self.failure is not None:
                    break  # (every peer stops here: the same outcomes)
            await self._wait(f"copy of piece {i} to the host", self.d2h.get(i))
            self._start(i)
        for j in range(retired, len(self.tasks)):
            await self._retire(j)
        for ev in self.events:
            await self._wait("a copy", ev)
        if self.failure is not None:
            if self.fault is not None:
                raise self.fault
            raise self.failure
        worlds = sorted({info.world_size for info in self.infos.values()})
        if len(worlds) > 1:
            raise PeerConnectionError(
                f"the group changed while the pieces of a device tensor were reduced (they "
                f"ran on {' and '.join(map(str, worlds))} peers); nothing was written: "
                f"retry")
        return await self._vote_and_commit(worlds[0])

    async def _vote_and_commit(self, world: int) -> ReduceInfo:
        flag = byte_buffer(1)
        flag[0] = 0 if self.fault is None else 1
        info = await self.reduce(-1, flag, DataType.UINT8, 1, vote=True, late=True)
        if info.world_size != world:
            raise PeerConnectionError(
                f"the group changed after the pieces of a device tensor were reduced "
                f"({world} peers, then {info.world_size}); nothing was written: retry")
        if self.fault is not None:
            raise self.fault
        if flag[0]:
            raise CollectiveAbortedError(
                "another peer of the group could not stage its device tensor (a device "
                "copy failed there); nothing was written")
        if self.out is None and self.src.nbytes:
            ev = self._device_call("commit copy", lambda: self.device.copy(self.src.data,
                                                                            self.target))
            await self._wait("commit copy", ev)
            if self.fault is not None:
                raise self.fault
        infos = [*self.infos.values(), info]
        return ReduceInfo(tx_bytes=sum(i.tx_bytes for i in infos),
                          rx_bytes=sum(i.rx_bytes for i in infos), world_size=world,
                          algorithm="staged")

    async def drain(self) -> None:
        """After a cancellation: withdraws the pieces still running, then waits for them
        and for every copy queued (nothing writes the caller's memory afterwards)."""
        for t in self.tasks.values():
            t.cancel()
        if self.tasks:
            await asyncio.wait(self.tasks.values())
        for t in self.tasks.values():
            if not t.cancelled():
                t.exception()  # (seen: no "never retrieved" warning)
        for ev in self.events:
            if ev is not None:
                with contextlib.suppress(Exception):
                    await self.device.wait(ev)


async def staged_all_reduce(device: Device, src: DeviceTensor, out: DeviceTensor | None,
                            reduce: ReducePiece, *, piece_bytes: int | None = None,
                            depth: int | None = None) -> ReduceInfo:
    """All-reduces the device tensor ``src`` (into ``out`` when given) through pinned
    host buffers, piece by piece with ``reduce`` (see the module docstring)."""
    run = _StagedRun(device, src, out, reduce, PIECE_BYTES if piece_bytes is None else
                     piece_bytes, DEPTH if depth is None else depth)
    try:
        return await run.run()
    except asyncio.CancelledError:
        # The drain is bounded (a withdrawn piece waits for the master's word at most the
        # Communicator's timeout; copies complete) and ends before the call does, however
        # often the caller cancels again.
        drain = asyncio.ensure_future(run.drain())
        while not drain.done():
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.shield(drain)
        raise


# --- the content hash ------------------------------------------------------------------


def staged_content_hash(device: Device, t: DeviceTensor, piece_bytes: int | None = None
                        ) -> bytes:
    """The content hash of a device tensor's bytes (equal to the host hash of the same
    bytes), staged through two pinned buffers of whole hash leaves: the copy of one
    piece overlaps the hashing of the one before. Blocks until done."""
    from pccl import _core

    if t.nbytes == 0:
        return _core.content_hash(b"")
    leaf = _core.HASH_LEAF_BYTES
    step = max(leaf, (PIECE_BYTES if piece_bytes is None else piece_bytes) // leaf * leaf)
    pieces = _geometry(t.nbytes, 1, step)
    slots = [device.host_buffer(step) for _ in range(min(2, len(pieces)))]
    device.begin()
    events = [device.to_host(t.data, *pieces[0], slots[0], [])]
    digests: list[bytes] = []
    for i, (off, n) in enumerate(pieces):
        if i + 1 < len(pieces):  # (its slot's previous piece, i - 1, is hashed already)
            events.append(device.to_host(t.data, *pieces[i + 1], slots[(i + 1) % 2], []))
        device.synchronize(events[i])
        digests.append(_core.leaf_digests(slots[i % 2].data[:n], off // leaf))
    return _core.hash_root(b"".join(digests), t.nbytes)


def content_hash(tensor: Any) -> str:
    """The bit-exact content hash of ``tensor`` as 32 lowercase hex digits: the hash
    :meth:`Communicator.sync_shared_state` compares across peers (it hashes each
    tensor's bytes the same way), so equal hex means equal bytes, bit for bit.

    ``tensor`` is a numpy array, a torch tensor, or any object with DLPack or the buffer
    protocol. Only the elements' bytes count (in memory order of a C-contiguous copy),
    not the shape or the dtype: a non-contiguous view hashes like
    ``np.ascontiguousarray(view)`` (copied first), and a numpy array and a torch tensor
    with the same bytes give the same hex. A CUDA tensor is staged through pinned host
    buffers piece by piece (:mod:`pccl.staging`; no whole copy in host memory), after
    the work queued on its device; the hex equals that of the same bytes on the host.
    torch is imported only for torch tensors. Raises :class:`InvalidArgumentError` for anything else
    (Python objects in an ``object`` array have no bytes to hash)::

        assert pccl.content_hash(model.weight) == pccl.content_hash(reference_weight)
    """
    device = device_of(tensor)
    if device is None:
        return _host_content_hash(tensor)
    if _is_torch(tensor):
        tensor = tensor.detach().resolve_conj().resolve_neg().contiguous()
    return staged_content_hash(device, device.tensor(tensor, "tensor")).hex()
