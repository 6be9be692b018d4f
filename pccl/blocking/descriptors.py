"""PCCL's descriptor and result classes (``ReduceOperandDescriptor``,
``QuantizationOptions``, ``ReduceDescriptor``, ``ReduceOpDescriptor``, ``ReduceInfo``,
``SharedStateSyncInfo``), and PCCL's checks of the tensors handed to a reduce, which turn
them into the async API's arguments."""

from __future__ import annotations

import ctypes
import dataclasses
import enum
import sys
from typing import Any

try:
    import numpy as np
except ImportError:  # torch-only programs (see pccl.tensors)
    np = None  # type: ignore[assignment]

from pccl.blocking.compat import (
    _CORE_DTYPE,
    ArgumentAssertionError,
    ArgumentValueError,
    DataType,
    DistributionHint,
    _as_datatype,
    _as_reduce_op,
    _reports_result,
    element_info,
)
from pccl.communicator import QuantizationOptions as _AsyncQuantizationOptions
from pccl.enums import QuantizationAlgorithm, ReduceOp
from pccl.errors import InvalidArgumentError
from pccl.shared_state import SyncInfo
from pccl.tensors import need_numpy


class ReduceOperandDescriptor:
    """The element type of a reduce's operands, plus PCCL's distribution hint (ignored)."""

    def __init__(self, datatype: DataType,
                 distribution_hint: DistributionHint = DistributionHint.NONE) -> None:
        self.datatype = datatype
        self.distribution_hint = distribution_hint


class QuantizationOptions:
    """How values travel on the wire; ``algorithm=NONE`` sends them as they are.

    The defaults are PCCL's (``UINT8`` with ``MIN_MAX``). pccl quantizes float tensors
    to UINT8, INT8, FLOAT8_E4M3 or FLOAT8_E5M2 for SUM and AVG.
    """

    def __init__(self, quantized_datatype: DataType = DataType.UINT8,
                 algorithm: QuantizationAlgorithm = QuantizationAlgorithm.MIN_MAX) -> None:
        self.quantized_datatype = quantized_datatype
        self.algorithm = algorithm

    def _to_core(self) -> _AsyncQuantizationOptions | None:
        try:
            algorithm = QuantizationAlgorithm(
                self.algorithm.value if isinstance(self.algorithm, enum.Enum)
                else self.algorithm)
        except ValueError:
            raise InvalidArgumentError(f"unknown quantization algorithm {self.algorithm!r}") \
                from None
        if algorithm is QuantizationAlgorithm.NONE:
            return None
        return _AsyncQuantizationOptions(
            algorithm=algorithm, dtype=_CORE_DTYPE[_as_datatype(self.quantized_datatype)])


class ReduceDescriptor:
    """One reduce's parameters: element count, op, tag, operand type, quantization."""

    def __init__(self, count: int, op: ReduceOp, tag: int,
                 operand_descriptor: ReduceOperandDescriptor,
                 quantization_options: QuantizationOptions) -> None:
        self.count = count
        self.op = op
        self.tag = tag
        self.operand_descriptor = operand_descriptor
        self.quantization_options = quantization_options


class ReduceOpDescriptor:
    """A reduce for :meth:`Communicator.all_reduce_multiple_with_retry`: send and
    receive buffers plus a :class:`ReduceDescriptor`.

    ``from_numpy`` / ``from_torch`` keep the tensors alive; the raw-pointer constructor
    (PCCL's) views ``count`` elements of ``operand_descriptor.datatype`` at each address,
    and the caller keeps that memory alive, as with PCCL.
    """

    def __init__(self, sendbuf_ptr: int, recvbuf_ptr: int,
                 reduce_descriptor: ReduceDescriptor) -> None:
        self.sendbuf_ptr = sendbuf_ptr
        self.recvbuf_ptr = recvbuf_ptr
        self.reduce_descriptor = reduce_descriptor
        self._send: Any = None
        self._recv: Any = None

    @staticmethod
    @_reports_result
    def from_torch(send: Any, recv: Any, reduce_descriptor: ReduceDescriptor
                   ) -> ReduceOpDescriptor:
        _check_torch_pair(send, recv)
        desc = ReduceOpDescriptor(send.data_ptr(), recv.data_ptr(), reduce_descriptor)
        desc._send, desc._recv = send, recv
        return desc

    @staticmethod
    @_reports_result
    def from_numpy(send: np.ndarray, recv: np.ndarray, reduce_descriptor: ReduceDescriptor
                   ) -> ReduceOpDescriptor:
        _check_numpy_pair(send, recv)
        desc = ReduceOpDescriptor(send.ctypes.data, recv.ctypes.data, reduce_descriptor)
        desc._send, desc._recv = send, recv
        return desc

    def _tensors(self) -> tuple[Any, Any]:
        if self._send is not None:
            return self._send, self._recv
        d = self.reduce_descriptor
        dtype = _as_datatype(d.operand_descriptor.datatype)
        send = _view_memory(self.sendbuf_ptr, d.count, dtype)
        recv = send if self.recvbuf_ptr == self.sendbuf_ptr else \
            _view_memory(self.recvbuf_ptr, d.count, dtype)
        return send, recv


@dataclasses.dataclass
class ReduceInfo:
    """What a reduce cost this peer (PCCL's field order)."""

    local_world_size: int  #: peers that took part
    tx_bytes: int  #: bytes this peer sent
    rx_bytes: int  #: bytes this peer received

    @property
    def world_size(self) -> int:
        """pccl's name for ``local_world_size``."""
        return self.local_world_size


#: PCCL's name for what a shared-state sync cost (``tx_bytes``, ``rx_bytes``).
SharedStateSyncInfo = SyncInfo


# --- tensors --------------------------------------------------------------------------


def _torch_module() -> Any:
    """torch if the program imported it (pccl never imports it for you)."""
    return sys.modules.get("torch")


def _is_torch_tensor(obj: Any) -> bool:
    torch = _torch_module()
    return torch is not None and isinstance(obj, torch.Tensor)


def _check_torch_pair(send: Any, recv: Any) -> None:
    if not send.is_contiguous():
        raise ArgumentAssertionError("Input tensor must be contiguous")
    if not recv.is_contiguous():
        raise ArgumentAssertionError("Output tensor must be contiguous")
    if send.device != recv.device:
        raise ArgumentAssertionError("Input and output tensors must be on the same device")
    if send.dtype != recv.dtype:
        raise ArgumentAssertionError("Input and output tensors must have the same dtype")
    if send.device.type not in ("cpu", "cuda"):
        raise ArgumentAssertionError("Only CPU and CUDA tensors are supported")
    if send.numel() != recv.numel():
        raise ArgumentAssertionError(
            "Input and output tensors must have the same number of elements")


def _check_numpy_pair(send: np.ndarray, recv: np.ndarray) -> None:
    if not send.flags["C_CONTIGUOUS"]:
        raise ArgumentAssertionError("Input tensor must be contiguous")
    if not recv.flags["C_CONTIGUOUS"]:
        raise ArgumentAssertionError("Output tensor must be contiguous")
    if send.dtype != recv.dtype:
        raise ArgumentAssertionError("Input and output tensors must have the same dtype")
    if send.size != recv.size:
        raise ArgumentAssertionError(
            "Input and output tensors must have the same number of elements")


def _element_type(tensor: Any) -> DataType:
    if _is_torch_tensor(tensor):
        return DataType.from_torch_dtype(tensor.dtype)
    return DataType.from_numpy_dtype(tensor.dtype)


def _flat_prefix(tensor: Any, count: int) -> Any:
    """The first ``count`` elements of a contiguous tensor, as a flat view."""
    return tensor.reshape(-1)[:count]


def _view_memory(address: int, count: int, dtype: DataType) -> Any:
    """``count`` elements of ``dtype`` at a raw address, without copying."""
    if not address:
        raise ArgumentValueError("Invalid data pointer: nullptr")
    info = element_info(dtype)
    if info.numpy is None or info.torch is None:
        raise InvalidArgumentError(f"{dtype.name} is not an element type of tensors")
    memory = (ctypes.c_uint8 * (int(count) * info.size)).from_address(int(address))
    if dtype is DataType.BFLOAT16 or np is None:
        torch = _torch_module()
        if torch is None:
            if np is None:
                need_numpy("memory given by a raw pointer (without torch)")
            raise InvalidArgumentError("raw bfloat16 memory needs torch to be imported")
        tdtype = getattr(torch, info.torch)
        return torch.frombuffer(memory, dtype=tdtype) if count else \
            torch.empty(0, dtype=tdtype)
    return np.frombuffer(memoryview(memory), dtype=info.numpy)


def _reduce_arguments(send: Any, recv: Any, op: Any,
                      operand_descriptor: ReduceOperandDescriptor | None,
                      quantization_options: QuantizationOptions | None,
                      count: int | None = None
                      ) -> tuple[Any, Any, ReduceOp, _AsyncQuantizationOptions | None]:
    """PCCL's argument checks, then the async API's arguments: (tensor, out or None for
    in place, op, quantization)."""
    if _is_torch_tensor(send) and _is_torch_tensor(recv):
        _check_torch_pair(send, recv)
    elif np is not None and isinstance(send, np.ndarray) and isinstance(recv, np.ndarray):
        _check_numpy_pair(send, recv)
    else:
        raise ArgumentValueError(
            f"Unsupported input types: {type(send)}, {type(recv)}; send and recv must "
            "either be both torch.Tensor or both np.ndarray")
    dtype = _element_type(send)
    if operand_descriptor is not None and _as_datatype(operand_descriptor.datatype) != dtype:
        raise InvalidArgumentError(
            f"operand_descriptor says {_as_datatype(operand_descriptor.datatype).name}, the "
            f"tensors hold {dtype.name}; pccl does not reinterpret tensor memory")
    in_place = send is recv
    if count is not None:
        numel = send.numel() if _is_torch_tensor(send) else send.size
        if not 0 <= count <= numel:
            raise InvalidArgumentError(
                f"the descriptor's count is {count}, the tensors hold {numel} elements")
        if count != numel:
            send, recv = _flat_prefix(send, count), _flat_prefix(recv, count)
    quantization = quantization_options._to_core() if quantization_options else None
    return send, None if in_place else recv, _as_reduce_op(op), quantization
