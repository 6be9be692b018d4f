"""Public enumerations, and :data:`DTYPES`: the one table of what pccl knows about each
:class:`DataType` (size, numpy and torch names, float or not). Every other dtype lookup
in pccl derives from it."""

from __future__ import annotations

import dataclasses
import enum
import types
from collections.abc import Mapping


class Attribute(enum.IntEnum):
    """What :meth:`pccl.Communicator.get_attribute` can report."""

    GLOBAL_WORLD_SIZE = 0
    PEER_GROUP_WORLD_SIZE = 1
    NUM_DISTINCT_PEER_GROUPS = 2
    LARGEST_PEER_GROUP_WORLD_SIZE = 3


class ReduceOp(enum.IntEnum):
    """Element-wise reduction of an all-reduce (values match the Rust core)."""

    SUM = 0
    AVG = 1
    PROD = 2
    MAX = 3
    MIN = 4


class DataType(enum.IntEnum):
    """Element types (values match the Rust core). The FLOAT8 kinds are wire-only."""

    FLOAT16 = 0
    BFLOAT16 = 1
    FLOAT32 = 2
    FLOAT64 = 3
    INT8 = 4
    INT16 = 5
    INT32 = 6
    INT64 = 7
    UINT8 = 8
    UINT16 = 9
    UINT32 = 10
    UINT64 = 11
    FLOAT8_E4M3 = 12
    FLOAT8_E5M2 = 13


class QuantizationAlgorithm(enum.IntEnum):
    """How an all-reduce quantizes what it sends (see docs/semantics.md): ``NONE``
    sends the dtype as is; ``MIN_MAX`` maps each piece's [min, max] onto the quantized
    type; ``ZERO_POINT_SCALE`` uses a zero point and a scale per piece."""

    NONE = 0
    MIN_MAX = 1
    ZERO_POINT_SCALE = 2


class SharedStateSyncStrategy(enum.IntEnum):
    """A peer's role in :meth:`pccl.Communicator.sync_shared_state`: ``ENFORCE_POPULAR``
    votes with its state and adopts the group's most popular one; ``RECEIVE_ONLY``
    takes the group's state without voting (a joiner); ``SEND_ONLY`` votes and serves
    its state but never changes its own tensors."""

    ENFORCE_POPULAR = 0
    RECEIVE_ONLY = 1
    SEND_ONLY = 2


@dataclasses.dataclass(frozen=True)
class DTypeInfo:
    """What pccl knows about one :class:`DataType` (a row of :data:`DTYPES`)."""

    size: int  #: bytes per element
    numpy: str | None  #: numpy dtype name (``bfloat16`` needs ml_dtypes); None: wire-only
    torch: str | None  #: ``torch.<name>`` dtype; None: wire-only (no tensor has it)
    is_float: bool  #: a floating-point type (quantization and DiLoCo take these only)

    @property
    def is_tensor_type(self) -> bool:
        """Whether tensors of this type can be reduced and synced (not wire-only)."""
        return self.numpy is not None


#: The one dtype table: every :class:`DataType` -> its :class:`DTypeInfo`.
DTYPES: Mapping[DataType, DTypeInfo] = types.MappingProxyType({
    DataType.FLOAT16: DTypeInfo(2, "float16", "float16", True),
    DataType.BFLOAT16: DTypeInfo(2, "bfloat16", "bfloat16", True),
    DataType.FLOAT32: DTypeInfo(4, "float32", "float32", True),
    DataType.FLOAT64: DTypeInfo(8, "float64", "float64", True),
    DataType.INT8: DTypeInfo(1, "int8", "int8", False),
    DataType.INT16: DTypeInfo(2, "int16", "int16", False),
    DataType.INT32: DTypeInfo(4, "int32", "int32", False),
    DataType.INT64: DTypeInfo(8, "int64", "int64", False),
    DataType.UINT8: DTypeInfo(1, "uint8", "uint8", False),
    DataType.UINT16: DTypeInfo(2, "uint16", "uint16", False),
    DataType.UINT32: DTypeInfo(4, "uint32", "uint32", False),
    DataType.UINT64: DTypeInfo(8, "uint64", "uint64", False),
    # Wire-only: what quantized values travel as; never a tensor's element type.
    DataType.FLOAT8_E4M3: DTypeInfo(1, None, None, True),
    DataType.FLOAT8_E5M2: DTypeInfo(1, None, None, True),
})
