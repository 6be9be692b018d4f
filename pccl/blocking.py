"""Blocking API with the names and call shapes of PCCL's Python bindings.

Code written against PCCL (``from pccl import *`` with PrimeIntellect's bindings) runs
on pccl by changing its import only::

    import pccl.blocking as pccl            # or: from pccl.blocking import *

    master = pccl.MasterNode(listen_address="0.0.0.0:48148")
    master.run()                            # returns at once; serves in the background

    comm = pccl.Communicator("127.0.0.1:48148", 0)
    comm.connect(n_attempts=15)
    if comm.are_peers_pending():
        comm.update_topology()
    info = comm.all_reduce(grads, grads, op=pccl.ReduceOp.SUM)
    ok, status, info = comm.all_reduce_async(grads, grads, op=pccl.ReduceOp.AVG).wait()

Every call blocks the calling thread until it is done; the work runs on the async
:mod:`pccl` objects (:class:`pccl.Communicator`, :class:`pccl.MasterNode`) driven by one
asyncio event loop on a daemon thread that this module owns. The loop starts with the
first object that needs it and stops when the last one is closed (``close()``,
``interrupt()``, a ``with`` block, or at interpreter exit). Waiting releases the GIL, and
tensor bytes move in the Rust extension's threads, so other Python threads keep running
while a reduce is in flight. Blocking calls must not be made from the loop's own thread
(e.g. from a callback running on it); they raise :class:`InvalidUsageError` there.

What maps exactly and what differs (``docs/blocking.md`` has the full table):

- Names, argument names, order and defaults follow PCCL's bindings: ``Communicator(address,
  peer_group=0, p2p_connection_pool_size=0)``, ``connect(n_attempts=5)`` (one attempt per
  second), ``all_reduce(send, recv, *, op, tag=0, operand_descriptor=None,
  quantization_options=None)``, ``all_reduce_async(...).wait() -> (is_success, status,
  ReduceInfo)``, ``all_reduce_multiple_with_retry(descriptors, *, max_in_flight=4) ->
  ReduceInfo``, ``sync_shared_state(shared_state, strategy=ENFORCE_POPULAR)``,
  ``MasterNode(listen_address).run() / .interrupt()``, ``ReduceInfo(local_world_size,
  tx_bytes, rx_bytes)``, ``SharedState(tensor_infos)`` with ``revision`` and
  ``push_revision()``, ``TensorInfo.from_numpy / from_torch / (name, data_ptr, *, numel,
  dtype, device_type, allow_content_inequality)``, the descriptor classes, ``Result``.
- ``ReduceOp``, ``QuantizationAlgorithm`` and ``SharedStateSyncStrategy`` are pccl's own
  enums (same member names and values as PCCL's; they are ``IntEnum``). ``DataType``,
  ``Attribute``, ``DeviceType``, ``DistributionHint`` and ``Result`` carry PCCL's names
  and C values (``DataType.FLOAT``/``DOUBLE``, ``Attribute.LOCAL_WORLD_SIZE``); pccl's
  async enums are accepted wherever these are.
- Errors are pccl's :class:`PCCLError` hierarchy; ``PCCLError`` here *is*
  :class:`pccl.PCCLError`, so ``except pccl.PCCLError`` catches what PCCL's binding
  raised. Each raised error has PCCL's ``result`` attribute (a :class:`Result`), e.g.
  :class:`PeerConnectionError` -> ``Result.RANK_CONNECTION_LOST``. Where PCCL raises a
  builtin type for a bad argument, the error is also that type:
  :class:`ArgumentValueError` (an ``InvalidArgumentError`` and a ``ValueError``) and
  :class:`ArgumentAssertionError` (an ``InvalidArgumentError`` and an
  ``AssertionError``). ``connect()`` raises :class:`MasterConnectionError` (an
  ``Exception``) after ``n_attempts`` failed attempts.
- Like PCCL, reduces need at least two peers in the group (``TooFewPeersError``), and
  ``optimize_topology()`` at least two in the run (``InvalidUsageError``); the async API
  accepts a world of one.
- Like PCCL, a collective that failed because a peer died leaves the run ready for a plain
  relaunch: this layer waits for the communicator's other in-flight collectives, then runs
  ``update_topology()`` itself before the failure is reported (every surviving peer sees
  the same failure and does the same). pccl's rings only change in ``update_topology()``;
  PCCL drops dead peers without it. Pass ``auto_update_topology=False`` to the
  Communicator to call ``update_topology()`` yourself instead. Scripts that call it after
  a failure anyway keep working (one more, cheap, topology round).
- A ``MasterNode`` that was ``run()`` and never ``interrupt()``-ed keeps the process
  alive at interpreter exit until it is interrupted (Ctrl-C / SIGTERM), as PCCL's master
  scripts expect (``master.run()`` is the last line of them).
- Not mapped: CUDA tensors (pccl reduces and syncs CPU memory; ``cuda.is_available()`` is
  False), ``DistributionHint`` (accepted, ignored), ``PCCLError.check`` and the ``to_c``
  helpers (there is no C ABI), quantizing to anything but 8-bit wire types (UINT8, INT8,
  and pccl's FLOAT8_E4M3 / FLOAT8_E5M2). pccl-only keyword arguments (``secret``,
  ``timeout``, ``peer_timeout``, ...) pass through to the async objects.
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import concurrent.futures
import concurrent.futures.thread  # noqa: F401  (its exit hook must be registered before ours)
import contextlib
import ctypes
import dataclasses
import enum
import functools
import logging
import os
import signal
import sys
import threading
import types
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

try:
    import numpy as np
except ImportError:  # torch-only programs (see pccl.tensors)
    np = None  # type: ignore[assignment]

from pccl import enums as _enums
from pccl.communicator import Communicator as _AsyncCommunicator
from pccl.communicator import QuantizationOptions as _AsyncQuantizationOptions
from pccl.enums import QuantizationAlgorithm, ReduceOp, SharedStateSyncStrategy
from pccl.errors import (
    AuthenticationError,
    CollectiveAbortedError,
    InvalidArgumentError,
    InvalidUsageError,
    MasterConnectionError,
    NoSharedStateAvailableError,
    OperationTimeoutError,
    PCCLError,
    PeerConnectionError,
    PendingAsyncOpsError,
    ProtocolError,
    RevisionIncrementViolationError,
    TooFewPeersError,
    TopologyOptimizationFailedError,
    UpdateTopologyFailedError,
)
from pccl.master.server import MasterNode as _AsyncMasterNode
from pccl.shared_state import SharedState as _AsyncSharedState
from pccl.shared_state import SyncInfo, SyncProgress
from pccl.shared_state import TensorInfo as _AsyncTensorInfo
from pccl.tensors import ELEMENT_SIZE, need_numpy

log = logging.getLogger(__name__)

T = TypeVar("T")

__all__ = [
    # PCCL's names
    "AsyncReduceHandle",
    "Attribute",
    "Communicator",
    "DataType",
    "DeviceType",
    "DistributionHint",
    "MasterNode",
    "PCCLError",
    "QuantizationAlgorithm",
    "QuantizationOptions",
    "ReduceDescriptor",
    "ReduceInfo",
    "ReduceOp",
    "ReduceOpDescriptor",
    "ReduceOperandDescriptor",
    "Result",
    "SharedState",
    "SharedStateSyncInfo",
    "SharedStateSyncStrategy",
    "TensorInfo",
    "cuda",
    # pccl's error classes (all PCCLError subclasses)
    "ArgumentAssertionError",
    "ArgumentValueError",
    "AuthenticationError",
    "CollectiveAbortedError",
    "InvalidArgumentError",
    "InvalidUsageError",
    "MasterConnectionError",
    "NoSharedStateAvailableError",
    "OperationTimeoutError",
    "PeerConnectionError",
    "PendingAsyncOpsError",
    "ProtocolError",
    "RevisionIncrementViolationError",
    "TooFewPeersError",
    "TopologyOptimizationFailedError",
    "UpdateTopologyFailedError",
]


# --- errors ---------------------------------------------------------------------------


class ArgumentValueError(InvalidArgumentError, ValueError):
    """A bad argument where PCCL's bindings raise ``ValueError`` (unsupported tensor
    types or dtypes, a null data pointer)."""


class ArgumentAssertionError(InvalidArgumentError, AssertionError):
    """A bad argument where PCCL's bindings fail an ``assert`` (non-contiguous tensors,
    send/recv that differ in dtype, size or device, a malformed address)."""


class Result(enum.Enum):
    """PCCL's result codes (``pcclResult_t``), as carried by ``PCCLError.result``."""

    SUCCESS = 0
    NOT_INITIALIZED = 1
    INTERNAL_ERROR = 2
    INVALID_ARGUMENT = 3
    INVALID_USAGE = 4
    TOO_FEW_PEERS = 5
    MASTER_CONNECTION_FAILED = 6
    RANK_CONNECTION_FAILED = 7
    RANK_CONNECTION_LOST = 8
    NO_SHARED_STATE_AVAILABLE = 9
    PENDING_ASYNC_OPS = 10
    UPDATE_TOPOLOGY_FAILED = 11
    TOPOLOGY_OPTIMIZATION_FAILED = 12


# Most specific class first: lookups walk an error's MRO.
_RESULT_OF: dict[type[BaseException], Result] = {
    InvalidArgumentError: Result.INVALID_ARGUMENT,
    # PCCL reports any failed shared-state sync (a revision violation too) as invalid usage.
    RevisionIncrementViolationError: Result.INVALID_USAGE,
    InvalidUsageError: Result.INVALID_USAGE,
    TooFewPeersError: Result.TOO_FEW_PEERS,
    AuthenticationError: Result.MASTER_CONNECTION_FAILED,
    MasterConnectionError: Result.MASTER_CONNECTION_FAILED,
    PeerConnectionError: Result.RANK_CONNECTION_LOST,
    # Called off because peers voted for a new topology: retry like a lost peer.
    CollectiveAbortedError: Result.RANK_CONNECTION_LOST,
    NoSharedStateAvailableError: Result.NO_SHARED_STATE_AVAILABLE,
    PendingAsyncOpsError: Result.PENDING_ASYNC_OPS,
    UpdateTopologyFailedError: Result.UPDATE_TOPOLOGY_FAILED,
    TopologyOptimizationFailedError: Result.TOPOLOGY_OPTIMIZATION_FAILED,
    ProtocolError: Result.INTERNAL_ERROR,
}


def result_of(error: BaseException) -> Result:
    """The PCCL result code that corresponds to one of pccl's errors."""
    for cls in type(error).__mro__:
        if cls in _RESULT_OF:
            return _RESULT_OF[cls]
    return Result.INTERNAL_ERROR


def _tag_result(error: BaseException) -> BaseException:
    if isinstance(error, PCCLError) and not hasattr(error, "result"):
        with contextlib.suppress(AttributeError, TypeError):
            error.result = result_of(error)  # type: ignore[attr-defined]
    return error


def _reports_result(fn: Callable[..., T]) -> Callable[..., T]:
    """Gives pccl errors raised by a public function PCCL's ``result`` attribute."""
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> T:
        try:
            return fn(*args, **kwargs)
        except PCCLError as e:
            _tag_result(e)
            raise

    return wrapper


# Failures a new topology can fix; after them the layer updates the topology itself.
_RETRYABLE = (PeerConnectionError, CollectiveAbortedError)
_SYNC_ATTEMPTS = 4  # tries of sync_shared_state() after retryable failures
_REDUCE_ROUNDS = 16  # relaunch rounds of all_reduce_multiple_with_retry()


# --- enums ----------------------------------------------------------------------------


class DataType(enum.Enum):
    """Element types with PCCL's names and C values (``pcclDataType_t``).

    ``INT16`` exists in PCCL's C API only; ``FLOAT8_E4M3`` / ``FLOAT8_E5M2`` are pccl's
    wire-only types for quantization. ``FLOAT32`` / ``FLOAT64`` are aliases of
    ``FLOAT`` / ``DOUBLE`` (pccl's names).
    """

    UINT8 = 0
    INT8 = 1
    INT16 = 2
    UINT16 = 3
    UINT32 = 4
    INT32 = 5
    UINT64 = 6
    INT64 = 7
    FLOAT16 = 8
    BFLOAT16 = 9
    FLOAT = 10
    DOUBLE = 11
    FLOAT8_E4M3 = 12
    FLOAT8_E5M2 = 13
    FLOAT32 = 10
    FLOAT64 = 11

    @_reports_result
    def to_torch_dtype(self) -> Any:
        """The ``torch.dtype`` of this type (needs torch)."""
        import torch

        name = _ELEMENT_NAMES.get(self)
        if name is None:
            raise ArgumentValueError(f"{self.name} has no torch dtype")
        return getattr(torch, name)

    @_reports_result
    def to_numpy_dtype(self) -> Any:
        """The numpy dtype of this type (``BFLOAT16`` needs ``ml_dtypes``)."""
        need_numpy("DataType.to_numpy_dtype()")
        name = _ELEMENT_NAMES.get(self)
        if name is None:
            raise ArgumentValueError(f"{self.name} has no numpy dtype")
        if name == "bfloat16":
            try:
                import ml_dtypes
            except ImportError:
                raise ArgumentValueError(
                    "numpy has no bfloat16 without the ml_dtypes package") from None
            return np.dtype(ml_dtypes.bfloat16)
        return np.dtype(name)

    @classmethod
    @_reports_result
    def from_torch_dtype(cls, dtype: Any) -> DataType:
        """The DataType of a ``torch.dtype``; ``ValueError`` if pccl cannot reduce it."""
        found = _BY_ELEMENT_NAME.get(str(dtype).removeprefix("torch."))
        if found is None:
            raise ArgumentValueError(f"Unsupported dtype: {dtype}")
        return found

    @classmethod
    @_reports_result
    def from_numpy_dtype(cls, dtype: Any) -> DataType:
        """The DataType of a numpy dtype; fails PCCL's assertion if unsupported."""
        need_numpy("DataType.from_numpy_dtype()")
        found = _BY_ELEMENT_NAME.get(np.dtype(dtype).name)
        if found is None:
            raise ArgumentAssertionError(f"Unsupported dtype: {dtype}")
        return found


_ELEMENT_NAMES: dict[DataType, str] = {
    DataType.UINT8: "uint8", DataType.INT8: "int8", DataType.INT16: "int16",
    DataType.UINT16: "uint16", DataType.UINT32: "uint32", DataType.INT32: "int32",
    DataType.UINT64: "uint64", DataType.INT64: "int64", DataType.FLOAT16: "float16",
    DataType.BFLOAT16: "bfloat16", DataType.FLOAT: "float32", DataType.DOUBLE: "float64",
}
_BY_ELEMENT_NAME = {name: dt for dt, name in _ELEMENT_NAMES.items()}

# PCCL's DataType -> pccl's (the async API's) DataType, by meaning.
_CORE_DTYPE: dict[DataType, _enums.DataType] = {
    DataType.UINT8: _enums.DataType.UINT8, DataType.INT8: _enums.DataType.INT8,
    DataType.INT16: _enums.DataType.INT16, DataType.UINT16: _enums.DataType.UINT16,
    DataType.UINT32: _enums.DataType.UINT32, DataType.INT32: _enums.DataType.INT32,
    DataType.UINT64: _enums.DataType.UINT64, DataType.INT64: _enums.DataType.INT64,
    DataType.FLOAT16: _enums.DataType.FLOAT16, DataType.BFLOAT16: _enums.DataType.BFLOAT16,
    DataType.FLOAT: _enums.DataType.FLOAT32, DataType.DOUBLE: _enums.DataType.FLOAT64,
    DataType.FLOAT8_E4M3: _enums.DataType.FLOAT8_E4M3,
    DataType.FLOAT8_E5M2: _enums.DataType.FLOAT8_E5M2,
}
_FROM_CORE_DTYPE = {core: dt for dt, core in _CORE_DTYPE.items()}


def _as_datatype(value: Any) -> DataType:
    """Accepts this module's DataType or pccl's async one."""
    if isinstance(value, DataType):
        return value
    if isinstance(value, _enums.DataType):
        return _FROM_CORE_DTYPE[value]
    raise InvalidArgumentError(f"expected a pccl.blocking.DataType, got {value!r}")


class Attribute(enum.Enum):
    """What :meth:`Communicator.get_attribute` reports (PCCL's names and C values;
    ``PEER_GROUP_WORLD_SIZE`` is pccl's name for ``LOCAL_WORLD_SIZE``)."""

    GLOBAL_WORLD_SIZE = 1
    LOCAL_WORLD_SIZE = 2
    NUM_DISTINCT_PEER_GROUPS = 3
    LARGEST_PEER_GROUP_WORLD_SIZE = 4
    PEER_GROUP_WORLD_SIZE = 2


_CORE_ATTRIBUTE: dict[Attribute, _enums.Attribute] = {
    Attribute.GLOBAL_WORLD_SIZE: _enums.Attribute.GLOBAL_WORLD_SIZE,
    Attribute.LOCAL_WORLD_SIZE: _enums.Attribute.PEER_GROUP_WORLD_SIZE,
    Attribute.NUM_DISTINCT_PEER_GROUPS: _enums.Attribute.NUM_DISTINCT_PEER_GROUPS,
    Attribute.LARGEST_PEER_GROUP_WORLD_SIZE: _enums.Attribute.LARGEST_PEER_GROUP_WORLD_SIZE,
}


class DeviceType(enum.Enum):
    """Where a tensor lives. pccl works on CPU memory only."""

    CPU = 0
    CUDA = 1

    @classmethod
    def from_torch_device_type(cls, device_type: str) -> DeviceType | None:
        return {"cpu": cls.CPU, "cuda": cls.CUDA}.get(device_type)


class DistributionHint(enum.Enum):
    """PCCL's hint on how values are distributed; pccl accepts and ignores it."""

    NONE = 0
    NORMAL = 1
    UNIFORM = 2


def _as_reduce_op(op: Any) -> ReduceOp:
    try:
        return ReduceOp(op.value if isinstance(op, enum.Enum) else op)
    except (ValueError, TypeError):
        raise InvalidArgumentError(f"unknown reduce op {op!r}") from None


cuda = types.ModuleType(
    "pccl.blocking.cuda", "CUDA support, as in PCCL's bindings: pccl has none.")
cuda.is_cuda_available = False  # type: ignore[attr-defined]
cuda.is_available = lambda: False  # type: ignore[attr-defined]


# --- descriptors and results ----------------------------------------------------------


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
    if send.device.type != "cpu":
        raise ArgumentAssertionError("Only CPU tensors are supported")
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
    if dtype not in _ELEMENT_NAMES:
        raise InvalidArgumentError(f"{dtype.name} is not an element type of tensors")
    itemsize = ELEMENT_SIZE[_CORE_DTYPE[dtype]]
    memory = (ctypes.c_uint8 * (int(count) * itemsize)).from_address(int(address))
    if dtype is DataType.BFLOAT16 or np is None:
        torch = _torch_module()
        if torch is None:
            if np is None:
                need_numpy("memory given by a raw pointer (without torch)")
            raise InvalidArgumentError("raw bfloat16 memory needs torch to be imported")
        tdtype = getattr(torch, _ELEMENT_NAMES[dtype])
        return torch.frombuffer(memory, dtype=tdtype) if count else \
            torch.empty(0, dtype=tdtype)
    return np.frombuffer(memory, dtype=_ELEMENT_NAMES[dtype])


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


# --- the event loop thread ------------------------------------------------------------

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
            raise _tag_result(MasterConnectionError(
                "the call was cancelled: its communicator or master was closed")) from None
        except PCCLError as e:
            _tag_result(e)
            raise


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
    """Whether this module's event loop thread is running (it stops when the last
    communicator or master is closed)."""
    return _runtime.running


# --- shared state ---------------------------------------------------------------------


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


# --- communicator ---------------------------------------------------------------------


class _PeerCore(_Resource):
    """The loop side of one :class:`Communicator`: the async communicator plus the
    bookkeeping that gives PCCL's recovery semantics. Touched on the loop thread only."""

    def __init__(self, address: str, auto_update_topology: bool) -> None:
        self.address = address
        self.auto_update_topology = auto_update_topology
        self.comm: _AsyncCommunicator | None = None
        self.in_flight: set[asyncio.Future[Any]] = set()  # the async API's reduce tasks

    def describe(self) -> str:
        peer = self.comm.peer_id if self.comm is not None else None
        return f"pccl.blocking.Communicator(peer {peer}, master {self.address})"

    async def aclose(self) -> None:
        if self.comm is not None:
            await self.comm.close()

    def require(self) -> _AsyncCommunicator:
        if self.comm is None:
            raise InvalidUsageError("the communicator is not connected; call connect() first")
        return self.comm

    async def settle(self) -> _AsyncCommunicator:
        """Returns the async communicator. (Recovery after a lost peer needs nothing
        here: the master rebuilds the ring on its own, the same for every peer.)"""
        return self.require()

    def group_size(self, comm: _AsyncCommunicator) -> int:
        return comm.get_attribute(_enums.Attribute.PEER_GROUP_WORLD_SIZE)

    def require_peers(self, comm: _AsyncCommunicator) -> None:
        world = self.group_size(comm)
        if world < 2:
            raise TooFewPeersError(
                f"the peer group has {world} peer; reduces need at least 2 (as in PCCL). "
                "Wait for peers: call update_topology() when are_peers_pending()")

    def launch(self, comm: _AsyncCommunicator, send: Any, out: Any, op: ReduceOp, tag: int,
               quantization: _AsyncQuantizationOptions | None) -> asyncio.Task[Any]:
        """Starts one reduce through the async API (argument errors raise here)."""
        raw = comm.all_reduce_async(send, out, op=op, tag=tag, quantization=quantization)
        self.in_flight.add(raw)
        raw.add_done_callback(self.in_flight.discard)
        return raw


class AsyncReduceHandle:
    """A reduce in flight, from :meth:`Communicator.all_reduce_async`."""

    def __init__(self, loop: _Loop, slot: list[asyncio.Future[Any]],
                 done: concurrent.futures.Future[Any]) -> None:
        self._loop = loop
        self._slot = slot
        self._done = done
        self._info: tuple[bool, int, ReduceInfo] | None = None
        self._error: PCCLError | None = None

    def wait(self) -> tuple[bool, int, ReduceInfo]:
        """Blocks (GIL released) until the reduce finished. Returns ``(is_success,
        status, info)`` like PCCL: a failure is reported, not raised; ``status`` is the
        :class:`Result` value and :attr:`error` holds pccl's error."""
        if self._info is not None:
            return self._info
        try:
            info = self._loop.wait(self._done, self._slot)
        except PCCLError as e:
            self._error = e
            self._info = (False, result_of(e).value, ReduceInfo(0, 0, 0))
        else:
            self._info = (True, Result.SUCCESS.value,
                          ReduceInfo(info.world_size, info.tx_bytes, info.rx_bytes))
        return self._info

    def done(self) -> bool:
        """Whether the reduce finished (``wait()`` would not block)."""
        return self._done.done()

    @property
    def error(self) -> PCCLError | None:
        """pccl's error after a failed ``wait()`` (its message says what happened)."""
        return self._error


class Communicator:
    """One peer of a run (PCCL's ``Communicator``), blocking.

    ``p2p_connection_pool_size=0`` means one stream per neighbour, as in PCCL. Keyword
    arguments beyond PCCL's go to :class:`pccl.Communicator` (``secret``, ``timeout``,
    ``peer_timeout``, ``collective_timeout``, ...). (``auto_update_topology`` is
    accepted and ignored: the master now rebuilds a ring that lost a peer on its own,
    as PCCL does, so nothing runs ``update_topology()`` behind the caller's back.)

    Example::

        comm = pccl.Communicator("127.0.0.1:48148", 0)
        comm.connect(n_attempts=15)
        comm.all_reduce(x, x, op=pccl.ReduceOp.SUM)
        comm.close()

    ``with Communicator(...) as comm:`` closes it at the end (it does not connect).
    """

    @_reports_result
    def __init__(self, address: str, peer_group: int = 0, p2p_connection_pool_size: int = 0,
                 **options: Any) -> None:
        if not isinstance(address, str) or ":" not in address:
            raise ArgumentAssertionError(
                f"Invalid address: {address}, expected format: ip:port")
        self.address = address
        self.peer_group = peer_group
        self.p2p_connection_pool_size = p2p_connection_pool_size or 1
        self._auto_update_topology = bool(options.pop("auto_update_topology", True))
        self._options = options
        self._make_async()  # checks the arguments now, as PCCL's constructor does
        self._lock = threading.Lock()
        self._core: _PeerCore | None = None
        self._loop: _Loop | None = None
        self._closed = False

    def _make_async(self) -> _AsyncCommunicator:
        return _AsyncCommunicator(master=self.address, peer_group=self.peer_group,
                                  p2p_connection_pool_size=self.p2p_connection_pool_size,
                                  **self._options)

    # --- lifecycle --------------------------------------------------------------------

    @_reports_result
    def connect(self, n_attempts: int = 5) -> None:
        """Joins the run; returns once the existing peers accepted this one (they do
        in ``update_topology()``). Tries ``n_attempts`` times, a second apart; then
        raises :class:`MasterConnectionError`."""
        if n_attempts < 1:
            raise InvalidArgumentError("n_attempts must be at least 1")
        with self._lock:
            if self._closed:
                raise InvalidUsageError("the communicator was closed")
            if self._core is not None:
                raise InvalidUsageError("connect() was already called on this communicator")
            core = self._core = _PeerCore(self.address, self._auto_update_topology)
        loop = _runtime.acquire(core)
        try:
            loop.call(lambda: self._connect(core, n_attempts))
        except BaseException:
            with self._lock:
                self._core = None
            _runtime.release(core)
            raise
        self._loop = loop

    async def _connect(self, core: _PeerCore, n_attempts: int) -> None:
        last: PCCLError | None = None
        for attempt in range(1, n_attempts + 1):
            comm = self._make_async()
            try:
                await comm.connect(n_attempts=1)
            except (AuthenticationError, ProtocolError, InvalidArgumentError):
                raise  # another attempt cannot help
            except PCCLError as e:
                last = e
                log.warning("connecting to the master at %s failed (attempt %d/%d): %s",
                            self.address, attempt, n_attempts, e)
                if attempt < n_attempts:
                    await asyncio.sleep(1.0)  # PCCL waits a second between attempts
                continue
            core.comm = comm
            return
        raise MasterConnectionError(
            f"Failed to connect to the master node at {self.address} after {n_attempts} "
            f"attempt(s): {last}")

    @_reports_result
    def close(self) -> None:
        """Leaves the run gracefully. Idempotent. The loop thread stops when the last
        communicator and master are closed."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            core, loop = self._core, self._loop
        if core is None or loop is None:
            return
        try:
            loop.call(core.aclose)
        finally:
            _runtime.release(core)

    def __enter__(self) -> Communicator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        # PCCL destroys the communicator with its Python object; do the same without
        # blocking (a finalizer may run on any thread, the loop's included).
        try:
            if not self._closed and self._core is not None and self._loop is not None:
                self._closed = True
                _runtime.close_soon(self._loop, self._core)
        except Exception:  # interpreter teardown
            pass

    def _run(self, make: Callable[[_PeerCore], Awaitable[T]]) -> T:
        core, loop = self._core, self._loop
        if self._closed:
            raise InvalidUsageError("the communicator was closed")
        if core is None or loop is None:
            raise InvalidUsageError("the communicator is not connected; call connect() first")
        return loop.call(lambda: make(core))

    # --- membership -------------------------------------------------------------------

    @_reports_result
    def get_attribute(self, attribute: Attribute) -> int:
        """The run's shape: ``GLOBAL_WORLD_SIZE``, ``LOCAL_WORLD_SIZE`` (the peer
        group's), ``NUM_DISTINCT_PEER_GROUPS``, ``LARGEST_PEER_GROUP_WORLD_SIZE``."""
        if isinstance(attribute, Attribute):
            core_attribute = _CORE_ATTRIBUTE[attribute]
        elif isinstance(attribute, _enums.Attribute):
            core_attribute = attribute
        else:
            raise InvalidArgumentError(f"unknown attribute {attribute!r}")

        async def get(core: _PeerCore) -> int:
            return (await core.settle()).get_attribute(core_attribute)

        return self._run(get)

    @property
    def rank(self) -> int:
        """This peer's rank in its peer group (``0 .. world_size - 1``, join order; see
        :attr:`pccl.Communicator.rank`). A pccl extension: PCCL has no ranks."""
        async def get(core: _PeerCore) -> int:
            return (await core.settle()).rank

        return self._run(get)

    @property
    def world_size(self) -> int:
        """How many peers the peer group has (``get_attribute(LOCAL_WORLD_SIZE)``)."""
        async def get(core: _PeerCore) -> int:
            return (await core.settle()).world_size

        return self._run(get)

    @property
    def last_synced_revision(self) -> int | None:
        """The shared-state revision of the last successful ``sync_shared_state()``
        (``None`` before the first one)."""
        async def get(core: _PeerCore) -> int | None:
            return (await core.settle()).last_synced_revision

        return self._run(get)

    @_reports_result
    def update_topology(self) -> None:
        """Collective over all accepted peers: admits pending peers, drops dead ones,
        rebuilds the rings. ``PendingAsyncOpsError`` while reduces are in flight."""
        async def update(core: _PeerCore) -> None:
            await (await core.settle()).update_topology()

        self._run(update)

    @_reports_result
    def are_peers_pending(self) -> bool:
        """Whether peers wait for ``update_topology()`` to admit them. A collective, as
        in PCCL: returns once every accepted peer asked, the same answer on all."""
        async def pending(core: _PeerCore) -> bool:
            return await (await core.settle()).are_peers_pending()

        return self._run(pending)

    @_reports_result
    def pending_peer_count(self) -> int:
        """How many peers wait to be admitted, as the master sees it now (an extension;
        not a collective: do not branch collective calls on it)."""
        async def count(core: _PeerCore) -> int:
            return await (await core.settle()).pending_peer_count()

        return self._run(count)

    @_reports_result
    def optimize_topology(self) -> None:
        """Measures bandwidths and re-orders the ring (collective). As in PCCL, needs at
        least two peers in the run (``InvalidUsageError``)."""
        async def optimize(core: _PeerCore) -> None:
            comm = await core.settle()
            world = comm.get_attribute(_enums.Attribute.GLOBAL_WORLD_SIZE)
            if world < 2:
                raise InvalidUsageError(
                    f"optimize_topology() needs at least 2 peers in the run, there are {world}")
            await comm.optimize_topology()

        self._run(optimize)

    # --- shared state -----------------------------------------------------------------

    @_reports_result
    def sync_shared_state(self, shared_state: SharedState,
                          strategy: SharedStateSyncStrategy =
                          SharedStateSyncStrategy.ENFORCE_POPULAR, *,
                          progress: Callable[[SyncProgress], object] | None = None,
                          progress_interval: float = 1.0) -> SyncInfo:
        """Brings ``shared_state`` to the content most peers of the group hold and sets
        its revision (collective). Returns ``tx_bytes`` / ``rx_bytes``. ``progress``
        (an extension) gets :class:`pccl.SyncProgress` reports as in the asyncio API; it
        is called on the background event-loop thread."""
        if not isinstance(shared_state, SharedState):
            raise InvalidArgumentError("shared_state must be a pccl.blocking.SharedState")
        try:
            strategy = SharedStateSyncStrategy(
                strategy.value if isinstance(strategy, enum.Enum) else strategy)
        except ValueError:
            raise InvalidArgumentError(f"unknown sync strategy {strategy!r}") from None

        async def sync(core: _PeerCore) -> SyncInfo:
            comm = await core.settle()
            if core.in_flight:
                raise PendingAsyncOpsError(
                    f"{len(core.in_flight)} reduce(s) in flight; wait() for them before "
                    "sync_shared_state()")
            # PCCL's sync does not fail because a holder died or peers were still in a
            # topology vote, and its programs do not catch that: retry here. Every peer
            # of the sync saw the same outcome, so all retry alike.
            for attempt in range(_SYNC_ATTEMPTS):
                try:
                    return await comm.sync_shared_state(shared_state._state, strategy,
                                                        progress=progress,
                                                        progress_interval=progress_interval)
                except _RETRYABLE as e:
                    if attempt + 1 == _SYNC_ATTEMPTS or isinstance(e, OperationTimeoutError):
                        raise
                    log.info("peer %s: sync_shared_state() failed (%s); retrying",
                             comm.peer_id, e)
                    if type(e) is CollectiveAbortedError:
                        await comm.update_topology()  # the others wait for us there
            raise AssertionError("unreachable")

        return self._run(sync)

    # --- all-reduce -------------------------------------------------------------------

    def _start(self, send: Any, recv: Any, op: Any, tag: int,
               operand_descriptor: ReduceOperandDescriptor | None,
               quantization_options: QuantizationOptions | None
               ) -> tuple[_Loop, list[asyncio.Future[Any]], concurrent.futures.Future[Any]]:
        """Launches one reduce; returns what a caller needs to wait for it."""
        tensor, out, core_op, quantization = _reduce_arguments(
            send, recv, op, operand_descriptor, quantization_options)
        ready: concurrent.futures.Future[Any] = concurrent.futures.Future()
        ready.set_running_or_notify_cancel()
        launched: list[asyncio.Task[Any]] = []

        async def start(core: _PeerCore) -> asyncio.Task[Any]:
            comm = await core.settle()
            core.require_peers(comm)
            task = core.launch(comm, tensor, out, core_op, tag, quantization)
            launched.append(task)
            task.add_done_callback(lambda t: _settle(t, ready))
            return task

        try:
            task = self._run(start)
        except BaseException:
            loop = self._loop
            if launched and loop is not None:
                # Interrupted (Ctrl-C) after the reduce started: nobody will wait for it,
                # so call it off before returning, as a cancelled wait() does.
                with contextlib.suppress(RuntimeError):
                    loop.loop.call_soon_threadsafe(launched[0].cancel)
                concurrent.futures.wait([ready], timeout=_CANCEL_GRACE)
            raise
        assert self._loop is not None
        return self._loop, [task], ready

    @_reports_result
    def all_reduce(self, send: Any, recv: Any, *, op: ReduceOp, tag: int = 0,
                   operand_descriptor: ReduceOperandDescriptor | None = None,
                   quantization_options: QuantizationOptions | None = None) -> ReduceInfo:
        """All-reduces ``send`` into ``recv`` (the same tensor: in place) across the
        peer group; blocks until done. Both numpy arrays or both torch CPU tensors.
        On failure raises and leaves both tensors as they were.

        Example::

            info = comm.all_reduce(grads, grads, op=pccl.ReduceOp.AVG)
        """
        loop, slot, ready = self._start(send, recv, op, tag, operand_descriptor,
                                        quantization_options)
        info = loop.wait(ready, slot)
        return ReduceInfo(info.world_size, info.tx_bytes, info.rx_bytes)

    @_reports_result
    def all_reduce_async(self, send: Any, recv: Any, *, op: ReduceOp, tag: int = 0,
                         operand_descriptor: ReduceOperandDescriptor | None = None,
                         quantization_options: QuantizationOptions | None = None
                         ) -> AsyncReduceHandle:
        """Starts an all-reduce and returns a handle; ``handle.wait()`` returns
        ``(is_success, status, ReduceInfo)``. Several may be in flight (distinct tags);
        do not touch the tensors until ``wait()`` returned."""
        loop, slot, ready = self._start(send, recv, op, tag, operand_descriptor,
                                        quantization_options)
        return AsyncReduceHandle(loop, slot, ready)

    @_reports_result
    def all_reduce_multiple_with_retry(self, descriptors: list[ReduceOpDescriptor], *,
                                       max_in_flight: int = 4) -> ReduceInfo:
        """Runs every descriptor's reduce, at most ``max_in_flight`` at a time, and
        retries the ones that failed (a peer died) on the smaller world until all
        succeeded. Returns the summed bytes and the world size at the end. Raises
        ``TooFewPeersError`` when fewer than two peers are left, as PCCL does."""
        if not descriptors:
            raise InvalidArgumentError("descriptors must not be empty")
        if max_in_flight < 1:
            raise InvalidArgumentError("max_in_flight must be at least 1")
        prepared = []
        for d in descriptors:
            send, recv = d._tensors()
            rd = d.reduce_descriptor
            prepared.append((*_reduce_arguments(
                send, recv, rd.op, rd.operand_descriptor, rd.quantization_options,
                count=rd.count), rd.tag))
        if len({p[4] for p in prepared}) != len(prepared):
            raise InvalidUsageError("descriptors must have distinct tags")

        async def run(core: _PeerCore) -> ReduceInfo:
            comm = await core.settle()
            core.require_peers(comm)
            return await _reduce_all_with_retry(core, comm, prepared, max_in_flight)

        return self._run(run)


async def _reduce_all_with_retry(core: _PeerCore, comm: _AsyncCommunicator,
                                 prepared: list[tuple[Any, ...]],
                                 max_in_flight: int) -> ReduceInfo:
    """PCCL's retry loop: keep up to ``max_in_flight`` reduces going, awaited in order;
    after a failure let the others finish, move to the new topology, and relaunch what
    did not succeed. Every peer sees the same outcome per tag, so all relaunch alike."""
    tx = rx = rounds = 0
    todo = collections.deque(range(len(prepared)))
    running: dict[int, asyncio.Task[Any]] = {}
    try:
        while todo or running:
            while todo and len(running) < max_in_flight:
                i = todo.popleft()
                send, out, op, quantization, tag = prepared[i]
                running[i] = core.launch(comm, send, out, op, tag, quantization)
            i, task = next(iter(running.items()))
            try:
                info = await task
            except _RETRYABLE as e:
                log.info("peer %s: reduce with tag %d failed (%s); retrying the failed "
                         "reduces on the new topology", comm.peer_id, prepared[i][4], e)
                del running[i]
                failed = [i]
                for j, other in list(running.items()):
                    del running[j]
                    try:
                        done = await other
                    except _RETRYABLE:
                        failed.append(j)
                    else:
                        tx, rx = tx + done.tx_bytes, rx + done.rx_bytes
                todo = collections.deque(sorted([*failed, *todo]))
                rounds += 1
                if rounds > _REDUCE_ROUNDS:
                    raise
                # A lost peer needs nothing from us: the master rebuilds the ring and runs
                # the relaunched reduces on it. Peers in update_topology() (the reduce was
                # called off for them), or a ring that failed again, need our vote.
                if type(e) is CollectiveAbortedError or rounds > 1:
                    await comm.update_topology()
                comm = await core.settle()
                # Down to this peer alone: the relaunch is a reduce over a world of one
                # (the input, unchanged), and the info says world 1, as PCCL's loop
                # expects ("all peers have left except this peer"); no TooFewPeersError.
                continue
            del running[i]
            tx, rx = tx + info.tx_bytes, rx + info.rx_bytes
    except BaseException as e:
        # Report the error once the rest finished (or, when the caller gave up, was
        # called off): nothing may write the tensors after this returns.
        if isinstance(e, asyncio.CancelledError):
            for t in running.values():
                t.cancel()
        await asyncio.gather(*running.values(), return_exceptions=True)
        raise
    return ReduceInfo(core.group_size(comm), tx, rx)


# --- master ---------------------------------------------------------------------------


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
        loop = _runtime.acquire(core)
        try:
            loop.call(self._master.start)
        except BaseException:
            with self._lock:
                self._core = None
            _runtime.release(core)
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
        if core is None or loop is None:
            return
        try:
            loop.call(core.aclose)
        finally:
            _runtime.release(core)

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
