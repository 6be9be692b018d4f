"""PCCL's ``TensorInfo`` and ``SharedState``: named tensors plus a revision, over
:class:`pccl.SharedState`. :meth:`Communicator.sync_shared_state` syncs them."""

from __future__ import annotations

from typing import Any

try:
    import numpy as np
except ImportError:  # torch-only programs (see pccl.tensors)
    np = None  # type: ignore[assignment]

from pccl.blocking.compat import (
    ArgumentAssertionError,
    ArgumentValueError,
    DataType,
    DeviceType,
    _as_datatype,
    _reports_result,
)
from pccl.blocking.descriptors import _view_memory
from pccl.errors import InvalidArgumentError
from pccl.shared_state import SharedState as _AsyncSharedState
from pccl.shared_state import TensorInfo as _AsyncTensorInfo


class TensorInfo:
    """One named tensor of a :class:`SharedState` (PCCL's constructors).

    ``from_numpy`` / ``from_torch`` keep the tensor alive. The raw-pointer constructor
    views ``numel`` elements of ``dtype`` at ``data_ptr``; keep that memory alive and
    in place while the state is in use, as with PCCL. CUDA tensors are not supported.
    """

    @_reports_result
    def __init__(self, name: str, data_ptr: int, *, numel: int, dtype: DataType,
                 device_type: DeviceType, allow_content_inequality: bool) -> None:
        if not data_ptr:
            raise ArgumentValueError("Invalid data pointer: nullptr")
        self.name = name
        self.data_ptr = data_ptr
        self.numel = numel
        self.dtype = dtype
        self.device_type = device_type
        self.allow_content_inequality = allow_content_inequality
        self._tensor: Any = None

    @classmethod
    @_reports_result
    def from_torch(cls, tensor: Any, name: str, *, allow_content_inequality: bool = False
                   ) -> TensorInfo:
        if type(tensor).__name__ == "DTensor":
            raise ArgumentAssertionError("Input tensor must not be a distributed tensor")
        if not tensor.is_contiguous():
            raise ArgumentAssertionError("Input tensor must be contiguous")
        info = cls(name, tensor.data_ptr(), numel=tensor.numel(),
                   dtype=DataType.from_torch_dtype(tensor.dtype),
                   device_type=DeviceType.from_torch_device_type(tensor.device.type),
                   allow_content_inequality=allow_content_inequality)
        info._tensor = tensor
        return info

    @classmethod
    @_reports_result
    def from_numpy(cls, tensor: np.ndarray, name: str, *,
                   allow_content_inequality: bool = False) -> TensorInfo:
        if not tensor.flags["C_CONTIGUOUS"]:
            raise ArgumentAssertionError("Input tensor must be contiguous")
        info = cls(name, tensor.ctypes.data, numel=tensor.size,
                   dtype=DataType.from_numpy_dtype(tensor.dtype),
                   device_type=DeviceType.CPU,
                   allow_content_inequality=allow_content_inequality)
        info._tensor = tensor
        return info

    def _memory(self) -> Any:
        if self.device_type is not DeviceType.CPU:
            raise InvalidArgumentError(
                f"shared state {self.name!r} is on {self.device_type}; pccl syncs CPU "
                "memory only (copy it to the CPU first)")
        if self._tensor is not None:
            return self._tensor
        return _view_memory(self.data_ptr, self.numel, _as_datatype(self.dtype))


class SharedState:
    """Named tensors plus a revision that advances by exactly one between syncs.

    Example::

        state = pccl.SharedState([pccl.TensorInfo.from_torch(w, "weights")])
        state.revision += 1                  # or state.push_revision()
        info = comm.sync_shared_state(state)
    """

    @_reports_result
    def __init__(self, tensor_infos: list[TensorInfo]) -> None:
        if not tensor_infos:
            raise ArgumentAssertionError("At least one tensor info must be provided")
        for i, info in enumerate(tensor_infos):
            if not isinstance(info, TensorInfo):
                raise ArgumentValueError(
                    f"SharedState entry {i} is a {type(info).__module__}."
                    f"{type(info).__qualname__}, not a pccl.TensorInfo: name each tensor, "
                    f"e.g. pccl.TensorInfo.from_torch(tensor, 'layer1.weight')")
        self.tensor_infos = list(tensor_infos)
        self._state = _AsyncSharedState(
            [_AsyncTensorInfo(i.name, i._memory(), bool(i.allow_content_inequality))
             for i in self.tensor_infos], revision=0)

    @property
    def revision(self) -> int:
        return self._state.revision

    @revision.setter
    @_reports_result
    def revision(self, value: int) -> None:
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ArgumentValueError(f"revision must be a non-negative integer, not {value!r}")
        self._state.revision = value

    @_reports_result
    def push_revision(self) -> None:
        self._state.revision += 1
