"""PCCL-compatible names: PCCL's enums (with PCCL's C values, mapped onto pccl's by
explicit tables), its ``Result`` codes, :func:`result_of` and the ``result`` attribute
on raised errors, and the builtin-typed argument errors. Nothing here runs anything."""

from __future__ import annotations

import contextlib
import enum
import functools
import importlib
import types
from collections.abc import Callable
from typing import Any, TypeVar

try:
    import numpy as np
except ImportError:  # torch-only programs (see pccl.tensors)
    np = None  # type: ignore[assignment]

from pccl import enums as _enums
from pccl.enums import DTYPES, DTypeInfo, ReduceOp
from pccl.errors import ErrorKind, InvalidArgumentError, PCCLError
from pccl.tensors import need_numpy

T = TypeVar("T")


# --- errors and result codes ----------------------------------------------------------


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
_RESULT_OF: dict[ErrorKind, Result] = {
    ErrorKind.InvalidArgumentError: Result.INVALID_ARGUMENT,
    # PCCL reports any failed shared-state sync (a revision violation too) as invalid usage.
    ErrorKind.RevisionIncrementViolationError: Result.INVALID_USAGE,
    ErrorKind.InvalidUsageError: Result.INVALID_USAGE,
    ErrorKind.TooFewPeersError: Result.TOO_FEW_PEERS,
    ErrorKind.AuthenticationError: Result.MASTER_CONNECTION_FAILED,
    ErrorKind.MasterConnectionError: Result.MASTER_CONNECTION_FAILED,
    ErrorKind.PeerConnectionError: Result.RANK_CONNECTION_LOST,
    # Called off because peers voted for a new topology: retry like a lost peer.
    ErrorKind.CollectiveAbortedError: Result.RANK_CONNECTION_LOST,
    ErrorKind.NoSharedStateAvailableError: Result.NO_SHARED_STATE_AVAILABLE,
    ErrorKind.PendingAsyncOpsError: Result.PENDING_ASYNC_OPS,
    ErrorKind.UpdateTopologyFailedError: Result.UPDATE_TOPOLOGY_FAILED,
    ErrorKind.TopologyOptimizationFailedError: Result.TOPOLOGY_OPTIMIZATION_FAILED,
    ErrorKind.ProtocolError: Result.INTERNAL_ERROR,
}


def result_of(error: BaseException) -> Result:
    """The PCCL result code that corresponds to one of pccl's errors."""
    for cls in type(error).__mro__:
        kind = ErrorKind.__members__.get(cls.__name__)
        if kind in _RESULT_OF:
            return _RESULT_OF[kind]
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
        name = element_info(self).torch
        if name is None:
            raise ArgumentValueError(f"{self.name} has no torch dtype")
        try:
            torch = importlib.import_module("torch")
        except ImportError:
            raise ArgumentValueError(
                "DataType.to_torch_dtype() needs torch, which is not installed: "
                "pip install \"pccl[torch]\"") from None
        return getattr(torch, name)

    @_reports_result
    def to_numpy_dtype(self) -> Any:
        """The numpy dtype of this type (``BFLOAT16`` needs ``ml_dtypes``)."""
        need_numpy("DataType.to_numpy_dtype()")
        name = element_info(self).numpy
        if name is None:
            raise ArgumentValueError(f"{self.name} has no numpy dtype")
        if name == "bfloat16":
            try:
                ml_dtypes = importlib.import_module("ml_dtypes")  # untyped, optional
            except ImportError:
                raise ArgumentValueError(
                    "numpy has no bfloat16 without the ml_dtypes package") from None
            return np.dtype(ml_dtypes.bfloat16)
        return np.dtype(name)

    @classmethod
    @_reports_result
    def from_torch_dtype(cls, dtype: Any) -> DataType:
        """The DataType of a ``torch.dtype``; ``ValueError`` if pccl cannot reduce it."""
        found = _BY_TORCH_NAME.get(str(dtype).removeprefix("torch."))
        if found is None:
            raise ArgumentValueError(f"Unsupported dtype: {dtype}")
        return found

    @classmethod
    @_reports_result
    def from_numpy_dtype(cls, dtype: Any) -> DataType:
        """The DataType of a numpy dtype; fails PCCL's assertion if unsupported."""
        need_numpy("DataType.from_numpy_dtype()")
        found = _BY_NUMPY_NAME.get(np.dtype(dtype).name)
        if found is None:
            raise ArgumentAssertionError(f"Unsupported dtype: {dtype}")
        return found


#: PCCL's DataType -> pccl's, member by member (values and some names differ; nothing
#: relies on either). Sizes and numpy / torch names come from pccl's one dtype table,
#: :data:`pccl.enums.DTYPES`, through this map.
_CORE_DTYPE: dict[DataType, _enums.DataType] = {
    DataType.UINT8: _enums.DataType.UINT8,
    DataType.INT8: _enums.DataType.INT8,
    DataType.INT16: _enums.DataType.INT16,
    DataType.UINT16: _enums.DataType.UINT16,
    DataType.UINT32: _enums.DataType.UINT32,
    DataType.INT32: _enums.DataType.INT32,
    DataType.UINT64: _enums.DataType.UINT64,
    DataType.INT64: _enums.DataType.INT64,
    DataType.FLOAT16: _enums.DataType.FLOAT16,
    DataType.BFLOAT16: _enums.DataType.BFLOAT16,
    DataType.FLOAT: _enums.DataType.FLOAT32,
    DataType.DOUBLE: _enums.DataType.FLOAT64,
    DataType.FLOAT8_E4M3: _enums.DataType.FLOAT8_E4M3,
    DataType.FLOAT8_E5M2: _enums.DataType.FLOAT8_E5M2,
}
_FROM_CORE_DTYPE = {core: dt for dt, core in _CORE_DTYPE.items()}
if set(_CORE_DTYPE) != set(DataType) or set(_FROM_CORE_DTYPE) != set(_enums.DataType):
    raise ImportError("pccl.blocking.DataType does not map one to one onto pccl.DataType")
# Tensor element types by numpy / torch name (wire-only types have none).
_BY_NUMPY_NAME: dict[str, DataType] = {
    info.numpy: _FROM_CORE_DTYPE[core] for core, info in DTYPES.items()
    if info.numpy is not None}
_BY_TORCH_NAME: dict[str, DataType] = {
    info.torch: _FROM_CORE_DTYPE[core] for core, info in DTYPES.items()
    if info.torch is not None}


def element_info(dtype: DataType) -> DTypeInfo:
    """The :data:`pccl.enums.DTYPES` row (size, numpy / torch name, ...) of PCCL's
    ``dtype``."""
    return DTYPES[_CORE_DTYPE[dtype]]


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
    """Where a tensor lives. CUDA tensors are staged through pinned host memory."""

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


class _Cuda(types.ModuleType):
    """``pccl.blocking.cuda``: whether CUDA tensors can be passed, as in PCCL's bindings.
    pccl stages them through pinned host memory (:mod:`pccl.staging`) with torch's CUDA
    streams, so the answer is torch's: true where torch is installed and sees a GPU."""

    @property
    def is_cuda_available(self) -> bool:
        return self.is_available()

    @staticmethod
    def is_available() -> bool:
        try:
            import torch
        except ImportError:
            return False
        return bool(torch.cuda.is_available())


cuda = _Cuda("pccl.blocking.cuda", _Cuda.__doc__)
