"""Tensors in, raw bytes out: numpy arrays, torch CPU tensors, DLPack and buffer-protocol
objects become a flat ``uint8`` view of the same memory (zero-copy), plus the element
type and count the Rust core needs.

numpy is optional: torch-only programs work without it. Then a torch tensor's bytes are
a ``memoryview`` over its storage instead of a numpy view, and scratch buffers are
``bytearray`` objects; numpy arrays, DLPack and buffer-protocol objects need numpy.
"""

from __future__ import annotations

import ctypes
import dataclasses
from typing import Any

try:
    import numpy as np
except ImportError:  # torch-only: see the module docstring
    np = None  # type: ignore[assignment]

from pccl.enums import DTYPES, DataType
from pccl.errors import InvalidArgumentError

# Derived from pccl.enums.DTYPES (the one dtype table): tensor element types by name.
_NUMPY_DTYPES: dict[str, DataType] = {
    info.numpy: dt for dt, info in DTYPES.items() if info.numpy is not None}
_TORCH_DTYPES: dict[str, DataType] = {
    info.torch: dt for dt, info in DTYPES.items() if info.torch is not None}

#: Bytes per element of every :class:`DataType` (from :data:`pccl.enums.DTYPES`).
ELEMENT_SIZE: dict[DataType, int] = {dt: info.size for dt, info in DTYPES.items()}


@dataclasses.dataclass(frozen=True)
class RawTensor:
    """A tensor's memory as flat bytes. ``owner`` keeps the original object alive."""

    data: Any  # 1-D uint8 view of the tensor's memory (numpy array or memoryview)
    dtype: DataType
    count: int
    owner: Any
    shape: tuple[int, ...] = ()  # the caller's shape (peers compare it); () when unknown

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)


def _is_torch(obj: Any) -> bool:
    return type(obj).__module__.split(".")[0] == "torch"


def need_numpy(what: str) -> None:
    """InvalidArgumentError naming what needs numpy when it is not installed."""
    if np is None:
        raise InvalidArgumentError(
            f"{what} needs numpy, which is not installed: pip install numpy (or "
            f"\"pccl[numpy]\"); without it pccl takes torch tensors only")


def byte_buffer(nbytes: int) -> Any:
    """A writable scratch buffer of ``nbytes`` bytes (uninitialised where numpy is)."""
    return np.empty(nbytes, dtype=np.uint8) if np is not None else memoryview(bytearray(nbytes))


def _torch_bytes(flat: Any) -> Any:
    """A writable uint8 view of a contiguous torch CPU tensor's memory. It keeps the
    tensor alive (the tensor may be a temporary copy)."""
    import torch

    if flat.numel() == 0:
        return np.zeros(0, dtype=np.uint8) if np is not None else memoryview(bytearray(0))
    raw = flat.view(torch.uint8)
    if np is not None:
        return raw.numpy()
    buf = (ctypes.c_uint8 * raw.numel()).from_address(raw.data_ptr())
    buf._pccl_owner = raw  # the memory's owner lives on
    return memoryview(buf).cast("B")


def torch_dtype(t: Any, what: str) -> DataType:
    """pccl's dtype of the torch tensor ``t`` (on any device), or InvalidArgumentError."""
    dtype = _TORCH_DTYPES.get(str(t.dtype).removeprefix("torch."))
    if dtype is None:
        raise InvalidArgumentError(f"{what} has unsupported dtype {t.dtype}")
    return dtype


def _from_torch(t: Any, what: str) -> tuple[Any, DataType]:
    if t.device.type != "cpu":
        # (all_reduce stages CUDA tensors before it gets here: pccl.staging)
        raise InvalidArgumentError(f"{what} is on {t.device}; this call takes CPU tensors")
    if not t.is_contiguous():
        raise InvalidArgumentError(f"{what} is not contiguous; call .contiguous() first")
    dtype = torch_dtype(t, what)
    return _torch_bytes(t.detach().reshape(-1)), dtype


def _as_array(obj: Any, what: str) -> Any:
    """A numpy view of a numpy array, a DLPack object or a buffer-protocol object."""
    need_numpy(f"{what} ({type(obj).__name__})")
    if isinstance(obj, np.ndarray):
        return obj
    if hasattr(obj, "__dlpack__"):
        try:
            return np.from_dlpack(obj)
        except Exception as e:
            raise InvalidArgumentError(f"{what}: DLPack import failed: {e}") from None
    try:
        return np.asarray(memoryview(obj))
    except TypeError:
        raise InvalidArgumentError(
            f"{what} must be a numpy array, a torch CPU tensor, or expose DLPack or "
            f"the buffer protocol; got {type(obj).__name__}") from None


def as_raw(obj: Any, *, writable: bool, what: str = "tensor") -> RawTensor:
    """Views ``obj``'s memory as bytes. Raises InvalidArgumentError for anything that is
    not a C-contiguous tensor of a supported dtype (or is read-only when ``writable``)."""
    if _is_torch(obj):
        data, dtype = _from_torch(obj, what)
        shape = tuple(int(d) for d in obj.shape)
        # torch tensors have no read-only flag; numpy's view of them is writable.
    else:
        arr = _as_array(obj, what)
        if not arr.flags.c_contiguous:
            raise InvalidArgumentError(f"{what} is not C-contiguous; pass np.ascontiguousarray(x)")
        found = _NUMPY_DTYPES.get(arr.dtype.name)
        if found is None:
            raise InvalidArgumentError(f"{what} has unsupported dtype {arr.dtype}")
        dtype = found
        if writable and not arr.flags.writeable:
            raise InvalidArgumentError(f"{what} is read-only")
        data = arr.reshape(-1).view(np.uint8)
        shape = tuple(int(d) for d in arr.shape)
    return RawTensor(data=data, dtype=dtype, count=data.nbytes // ELEMENT_SIZE[dtype], owner=obj,
                     shape=shape)


def content_hash(tensor: Any) -> str:
    """The content hash of ``tensor`` in host memory (see :func:`pccl.content_hash`, which
    also takes device tensors); a torch tensor on a device is copied to the CPU first."""
    from pccl import _core

    return _core.content_hash_hex(_logical_bytes(tensor))


def _logical_bytes(obj: Any) -> Any:
    """A flat uint8 array of ``obj``'s elements in C order: a view when they already lie
    that way, a contiguous copy otherwise."""
    if _is_torch(obj):
        import torch

        t = obj.detach()
        if t.layout != torch.strided:
            raise InvalidArgumentError(f"content_hash needs a dense tensor, not {t.layout}")
        if t.device.type != "cpu":
            t = t.cpu()
        # Lazily conjugated/negated views hold other bytes than they show.
        t = t.resolve_conj().resolve_neg().contiguous().reshape(-1)
        try:
            return _torch_bytes(t)
        except (RuntimeError, TypeError) as e:
            raise InvalidArgumentError(
                f"content_hash cannot read a {t.dtype} tensor: {e}") from None
    arr = _as_array(obj, "content_hash's tensor")
    if arr.dtype.hasobject:
        raise InvalidArgumentError("content_hash cannot hash an array of Python objects")
    return np.ascontiguousarray(arr).reshape(-1).view(np.uint8)
