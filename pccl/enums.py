"""Public enumerations."""

from __future__ import annotations

import enum


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
