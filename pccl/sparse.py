"""Sparse, error-feedback compression of float32 tensors (SparseLoCo's compressor).

Per chunk of ``chunk`` elements only the ``k`` largest magnitudes travel, each as its
offset in the chunk (``ceil(log2(chunk))`` bits) and a ``bits``-bit code on one scale per
tensor; the rest stays behind in the sender's error-feedback accumulator and goes out in
a later step. The encoding is done in Rust (``rust/sparse``; the wire format is in
docs/protocol.md) and is deterministic: the same accumulator gives the same payload, and
payloads added in one agreed order (by rank) give the same sum on every peer.

Example (every peer of the group runs it)::

    codec = pccl.sparse.SparseCodec(density=1 / 64, bits=2, chunk=64)
    acc = np.zeros(n, np.float32)     # this peer's error-feedback accumulator
    acc += pseudo_gradient
    total = np.empty(n, np.float32)
    info = await pccl.sparse.all_reduce(comm, codec, acc, total)
    # total: the sum of every peer's decoded payload (the same bytes on every peer);
    # acc: what this peer did not send yet (it goes out in a later step)

``codec.compress`` / ``codec.decode_add`` are there for optimizers that move the
payloads themselves.

The accumulator is local state of one peer: it is not part of the shared state, and a
peer that joins starts with zeros (it has sent nothing yet, so it owes nothing).
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
from typing import Any

from pccl import _core
from pccl.enums import DataType
from pccl.errors import InvalidArgumentError
from pccl.tensors import as_raw


@dataclasses.dataclass(frozen=True)
class SparseCodec:
    """Chunk-wise top-k with ``bits``-bit codes. ``density`` is the share of each chunk
    that is kept (``k = max(1, round(density * chunk))``, at most 255)."""

    density: float = 1 / 64
    bits: int = 2
    chunk: int = 64

    def __post_init__(self) -> None:
        if isinstance(self.chunk, bool) or not isinstance(self.chunk, int) \
                or not 2 <= self.chunk <= 32768:
            raise InvalidArgumentError(f"chunk must be an int in 2..32768, got {self.chunk!r}")
        if self.bits not in (2, 4, 8) or isinstance(self.bits, bool):
            raise InvalidArgumentError(f"bits must be 2, 4 or 8, got {self.bits!r}")
        if isinstance(self.density, bool) or not isinstance(self.density, (int, float)) \
                or not (0.0 < self.density <= 1.0) or math.isnan(self.density):
            raise InvalidArgumentError(f"density must be in (0, 1], got {self.density!r}")
        if self.k > 255:
            raise InvalidArgumentError(
                f"density {self.density} of chunk {self.chunk} keeps {self.k} per chunk; "
                "at most 255 (use a smaller chunk)")

    @property
    def k(self) -> int:
        """Elements kept per chunk."""
        return max(1, min(self.chunk, round(self.density * self.chunk)))

    def payload_bytes(self, count: int) -> int:
        """Bytes of the payload of a tensor of ``count`` elements."""
        return _core.sparse_encoded_len(count, self.chunk, self.k, self.bits)

    def compress(self, accumulator: Any) -> bytes:
        """Encodes the float32 ``accumulator`` (numpy array, torch CPU tensor or buffer;
        C-contiguous, writable) and leaves in it the residual: what the payload does not
        carry, exactly ``accumulator - decoded``. Returns the payload."""
        raw = self._raw(accumulator, "accumulator")
        return _core.sparse_compress(raw.data, self.chunk, self.k, self.bits)

    def decode_add(self, payload: bytes, out: Any) -> None:
        """Adds what ``payload`` carries to the float32 ``out``. A payload of other
        parameters, another length, or out-of-range entries raises ``ProtocolError`` and
        leaves ``out`` as it was (it comes from another peer)."""
        if not isinstance(payload, bytes):
            raise InvalidArgumentError(f"payload must be bytes, got {type(payload).__name__}")
        raw = self._raw(out, "out")
        _core.sparse_decode_add(payload, raw.data, self.chunk, self.k, self.bits)

    @staticmethod
    def _raw(tensor: Any, what: str) -> Any:
        raw = as_raw(tensor, writable=True, what=what)
        if raw.dtype != DataType.FLOAT32:
            raise InvalidArgumentError(f"{what} must be float32, got {raw.dtype.name}")
        return raw


def _check_beta(beta: Any) -> float:
    """An error-feedback decay: a number in [0, 1]."""
    if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not 0.0 <= beta <= 1.0:
        raise InvalidArgumentError(f"beta must be in [0, 1], got {beta!r}")
    return float(beta)


@dataclasses.dataclass(frozen=True)
class SparseLoCo(SparseCodec):
    """SparseLoCo's compression of DiLoCo's pseudo-gradients, for
    ``DiLoCo(..., compression=SparseLoCo(...))``: each peer adds its pseudo-gradient to
    an error-feedback accumulator decayed by ``beta`` (``acc = beta * acc + delta``),
    sends what :class:`SparseCodec` keeps of it and owes the rest to later steps. The
    accumulator replaces most of what outer momentum does (SparseLoCo runs the outer
    step without it: pass ``outer_momentum=0``)."""

    beta: float = 0.95

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_beta(self.beta)


class ErrorFeedback:
    """One peer's error-feedback accumulator for one tensor of ``size`` float32 elements
    (needs numpy). :meth:`push` adds a pseudo-gradient (after decaying what is owed by
    ``beta``) and compresses: what is not sent now is sent later."""

    def __init__(self, codec: SparseCodec, size: int, beta: float = 1.0) -> None:
        import numpy as np

        self.codec, self.beta = codec, _check_beta(beta)
        # Local state of this peer, not shared: a joiner starts here, owing nothing.
        self.accumulator = np.zeros(int(size), np.float32)

    def push(self, pseudo_gradient: Any) -> bytes:
        """``acc = beta * acc + pseudo_gradient``; returns the payload of ``acc`` and
        keeps the residual."""
        import numpy as np

        g = np.asarray(pseudo_gradient, dtype=np.float32).reshape(-1)
        if g.shape != self.accumulator.shape:
            raise InvalidArgumentError(
                f"pseudo-gradient has {g.size} elements, the accumulator {self.accumulator.size}")
        if self.beta != 1.0:
            self.accumulator *= np.float32(self.beta)
        self.accumulator += g
        return self.codec.compress(self.accumulator)


@dataclasses.dataclass(frozen=True)
class SparseReduceInfo:
    """What :func:`all_reduce` did: peers that took part, the bytes of one payload, what
    this peer sent and received for it, how it travelled (``GatherInfo.algorithm``), and
    the seconds this peer spent encoding its payload and decoding all of them."""

    world_size: int
    payload_bytes: int
    tx_bytes: int
    rx_bytes: int
    algorithm: str = "ring"
    compress_seconds: float = 0.0
    decode_seconds: float = 0.0
    #: Every peer's ``meta`` bytes, in slot order (the order the payloads were added).
    metas: tuple[bytes, ...] = ()


# Tensors of at least this many elements are encoded and decoded on a worker thread,
# so that the event loop (heartbeats, other collectives) is not held for milliseconds.
_THREAD_MIN_COUNT = 1 << 20


async def _off_loop(count: int, fn: Any, *args: Any) -> Any:
    """``fn(*args)`` inline for small tensors, else on a worker thread; a cancelled
    caller still waits for the thread (it writes the caller's buffers) before it goes."""
    if count < _THREAD_MIN_COUNT:
        return fn(*args)
    task = asyncio.ensure_future(asyncio.to_thread(fn, *args))
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        await asyncio.wait([task])
        raise


async def all_reduce(comm: Any, codec: SparseCodec, accumulator: Any, out: Any, *,
                     tag: int = 0, timeout: Any = None, meta: bytes = b"",
                     restore: bool = True) -> SparseReduceInfo:
    """Every peer of the group contributes ``codec.compress(accumulator)`` (the
    accumulator keeps the residual); ``out`` (float32, the accumulator's size) becomes
    the sum of every peer's decoded payload, added in slot order (the ring's): the same
    bytes on every peer. All or nothing: on any failure ``accumulator`` is put back as
    it was (nothing was sent for it) and ``out`` is left as it was.

    The payloads travel in one :meth:`Communicator.all_gather` (each peer sends and
    receives ``world - 1`` payloads on the ring; tiny ones through the master), so the
    call fails, and can be retried after ``update_topology()``, exactly as an all-reduce
    does. Every peer receives the same slots, so a slot that holds no valid payload (a
    peer with another codec, or a hostile one) fails the call alike on every peer with
    :class:`CollectiveAbortedError`. ``meta`` (at most 4 KiB, the same length on every
    peer) travels with this peer's payload and comes back in ``SparseReduceInfo.metas``,
    e.g. a weight for the mean, without a collective of its own. ``restore=False``
    skips the backup copy that putting the accumulator back needs: for a caller that
    passes a scratch copy and rebuilds it for a retry (DiLoCo does); a failed call
    then leaves the accumulator holding unspecified values. Needs numpy.
    """
    import time

    import numpy as np

    from pccl.errors import CollectiveAbortedError, ProtocolError
    from pccl.peer.options import DEFAULT_TIMEOUT

    if not isinstance(meta, bytes) or len(meta) > 4096:
        raise InvalidArgumentError("meta must be bytes, at most 4096 of them")
    acc = codec._raw(accumulator, "accumulator")
    dst = codec._raw(out, "out")
    if dst.count != acc.count:
        raise InvalidArgumentError(f"out has {dst.count} elements, the accumulator {acc.count}")
    backup = np.array(acc.data, copy=True) if restore else None
    total = np.zeros(dst.count, np.float32)

    def decode(info: Any) -> None:
        for slot in range(info.world_size):  # slot order: the same sum on every peer
            codec.decode_add(bytes(info.part(slot)[len(meta):]), total)

    try:
        t0 = time.perf_counter()
        payload = await _off_loop(acc.count, codec.compress, accumulator)
        t1 = time.perf_counter()
        info = await comm.all_gather(np.frombuffer(meta + payload, np.uint8), tag=tag,
                                     timeout=DEFAULT_TIMEOUT if timeout is None else timeout)
        t2 = time.perf_counter()
        try:
            await _off_loop(acc.count, decode, info)
        except ProtocolError as e:
            raise CollectiveAbortedError(
                f"a slot of the sparse all-reduce held no valid payload ({e}): the peers "
                "disagree on the codec") from None
        t3 = time.perf_counter()
    except BaseException:
        if backup is not None:
            _core.copy_into(acc.data, backup)  # nothing was sent for it
        raise
    _core.copy_into(dst.data, total.view(np.uint8))
    metas = tuple(bytes(info.part(s)[:len(meta)]) for s in range(info.world_size))
    return SparseReduceInfo(world_size=info.world_size, payload_bytes=len(payload),
                            tx_bytes=info.tx_bytes, rx_bytes=info.rx_bytes,
                            algorithm=info.algorithm, compress_seconds=t1 - t0,
                            decode_seconds=t3 - t2, metas=metas)
