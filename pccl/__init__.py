"""pccl: fault-tolerant collective communication for training over the internet.

A :class:`MasterNode` coordinates; each training process runs a :class:`Communicator`.
Peers join and leave at any time; collectives are all-or-nothing across the peers of a
group. See ``README.md`` and ``docs/`` for the full picture::

    import asyncio, numpy as np, pccl

    async def main():
        async with pccl.MasterNode(listen="127.0.0.1:0") as master:
            async with pccl.Communicator(master=master.address) as comm:
                print(comm.get_attribute(pccl.Attribute.GLOBAL_WORLD_SIZE))  # 1

    asyncio.run(main())
"""

from pccl import (
    _logging,  # noqa: F401  (PCCL_LOG_LEVEL, Rust records into logging: see the module)
    _shutdown,  # noqa: F401  (atexit hook: see the module)
)
from pccl import errors as _errors
from pccl._core import __version__ as _core_version
from pccl.communicator import (
    Communicator,
    GatherInfo,
    QuantizationOptions,
    ReduceDescriptor,
    ReduceInfo,
)
from pccl.enums import (
    Attribute,
    DataType,
    QuantizationAlgorithm,
    ReduceOp,
    SharedStateSyncStrategy,
)
from pccl.errors import *  # noqa: F403 (the error classes: pccl.errors.__all__, the one list)
from pccl.master import MasterNode
from pccl.shared_state import SharedState, SyncInfo, SyncProgress, TensorInfo
from pccl.staging import content_hash

__version__ = _core_version

__all__ = [
    "Attribute",
    "Communicator",
    "DataType",
    "GatherInfo",
    "MasterNode",
    "QuantizationAlgorithm",
    "QuantizationOptions",
    "ReduceDescriptor",
    "ReduceInfo",
    "ReduceOp",
    "SharedState",
    "SharedStateSyncStrategy",
    "SyncInfo",
    "SyncProgress",
    "TensorInfo",
    "__version__",
    "content_hash",
    *_errors.__all__,
]
