"""Tensors in, raw bytes out: numpy arrays, torch CPU tensors, DLPack and buffer-protocol
objects become a flat ``uint8`` numpy view of the same memory (zero-copy), plus the
element type and count the Rust core needs."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from pccl.enums import DataType
from pccl.errors import InvalidArgumentError

_NUMPY_DTYPES: dict[str, DataType] = {
    "float16": DataType.FLOAT16,
    "bfloat16": DataType.BFLOAT16,
    "float32": DataType.FLOAT32,
    "float64": DataType.FLOAT64,
    "int8": DataType.INT8,
    "int16": DataType.INT16,
    "int32": DataType.INT32,
    "int64": DataType.INT64,
    "uint8": DataType.UINT8,
    "uint16": DataType.UINT16,
    "uint32": DataType.UINT32,
    "uint64": DataType.UINT64,
}

ELEMENT_SIZE: dict[DataType, int] = {
    DataType.FLOAT16: 2, DataType.BFLOAT16: 2, DataType.FLOAT32: 4, DataType.FLOAT64: 8,
    DataType.INT8: 1, DataType.INT16: 2, DataType.INT32: 4, DataType.INT64: 8,
    DataType.UINT8: 1, DataType.UINT16: 2, DataType.UINT32: 4, DataType.UINT64: 8,
}


@dataclasses.dataclass(frozen=True)
class RawTensor:
    """A tensor's memory as flat bytes. ``owner`` keeps the original object alive."""

    data: np.ndarray  # 1-D uint8 view of the tensor's memory
    dtype: DataType
    count: int
    owner: Any
    shape: tuple[int, ...] = ()  # the caller's shape (peers compare it); () when unknown

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)


def _is_torch(obj: Any) -> bool:
    return type(obj).__module__.split(".")[0] == "torch"


def _from_torch(t: Any, what: str) -> tuple[np.ndarray, str]:
    if t.device.type != "cpu":
        raise InvalidArgumentError(f"{what} is on {t.device}; pass a CPU tensor")
    if not t.is_contiguous():
        raise InvalidArgumentError(f"{what} is not contiguous; call .contiguous() first")
    name = str(t.dtype).removeprefix("torch.")
    if name not in _NUMPY_DTYPES:
        raise InvalidArgumentError(f"{what} has unsupported dtype {t.dtype}")
    import torch

    flat = t.detach().reshape(-1)
    if flat.numel() == 0:
        return np.zeros(0, dtype=np.uint8), name
    return flat.view(torch.uint8).numpy(), name


def as_raw(obj: Any, *, writable: bool, what: str = "tensor") -> RawTensor:
    """Views ``obj``'s memory as bytes. Raises InvalidArgumentError for anything that is
    not a C-contiguous tensor of a supported dtype (or is read-only when ``writable``)."""
    if _is_torch(obj):
        data, name = _from_torch(obj, what)
        shape = tuple(int(d) for d in obj.shape)
        # torch tensors have no read-only flag; numpy's view of them is writable.
    else:
        if isinstance(obj, np.ndarray):
            arr = obj
        elif hasattr(obj, "__dlpack__"):
            try:
                arr = np.from_dlpack(obj)
            except Exception as e:
                raise InvalidArgumentError(f"{what}: DLPack import failed: {e}") from None
        else:
            try:
                arr = np.asarray(memoryview(obj))
            except TypeError:
                raise InvalidArgumentError(
                    f"{what} must be a numpy array, a torch CPU tensor, or expose DLPack or "
                    f"the buffer protocol; got {type(obj).__name__}") from None
        if not arr.flags.c_contiguous:
            raise InvalidArgumentError(f"{what} is not C-contiguous; pass np.ascontiguousarray(x)")
        name = arr.dtype.name
        if name not in _NUMPY_DTYPES:
            raise InvalidArgumentError(f"{what} has unsupported dtype {arr.dtype}")
        if writable and not arr.flags.writeable:
            raise InvalidArgumentError(f"{what} is read-only")
        data = arr.reshape(-1).view(np.uint8)
        shape = tuple(int(d) for d in arr.shape)
    dtype = _NUMPY_DTYPES[name]
    return RawTensor(data=data, dtype=dtype, count=data.nbytes // ELEMENT_SIZE[dtype], owner=obj,
                     shape=shape)
