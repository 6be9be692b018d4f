"""Sparse, error-feedback compression of float32 tensors (SparseLoCo's compressor).

Per chunk of ``chunk`` elements only the ``k`` largest magnitudes travel, each as its
offset in the chunk (``ceil(log2(chunk))`` bits) and a ``bits``-bit code on one scale per
tensor; the rest stays behind in the sender's error-feedback accumulator and goes out in
a later step. The encoding is done in Rust (``rust/sparse``; the wire format is in
docs/protocol.md) and is deterministic: the same accumulator gives the same payload, and
payloads added in one agreed order (by rank) give the same sum on every peer.

Example::

    codec = pccl.sparse.SparseCodec(density=1 / 64, bits=2, chunk=64)
    feedback = pccl.sparse.ErrorFeedback(codec, size=n, beta=0.9)
    payload = feedback.push(pseudo_gradient)    # bytes: about n / 64 bytes for 2 bits
    total = np.zeros(n, np.float32)
    for p in payloads_in_rank_order:            # every peer's, this one's included
        codec.decode_add(p, total)

The accumulator is local state of one peer: it is not part of the shared state, and a
peer that joins starts with zeros (it has sent nothing yet, so it owes nothing).
"""

from __future__ import annotations

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


class ErrorFeedback:
    """One peer's error-feedback accumulator for one tensor of ``size`` float32 elements
    (needs numpy). :meth:`push` adds a pseudo-gradient (after decaying what is owed by
    ``beta``) and compresses: what is not sent now is sent later."""

    def __init__(self, codec: SparseCodec, size: int, beta: float = 1.0) -> None:
        import numpy as np

        if not (0.0 <= beta <= 1.0):
            raise InvalidArgumentError(f"beta must be in [0, 1], got {beta!r}")
        self.codec, self.beta = codec, float(beta)
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
