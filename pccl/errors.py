"""pccl's exception hierarchy.

The classes are created once in the Rust extension (so Rust code raises them directly)
and re-exported here; ``pccl.PCCLError`` is the base of all of them::

    try:
        await comm.all_reduce(x)
    except pccl.PeerConnectionError:
        await comm.update_topology()   # drop the dead peer, then retry
"""

from pccl._core import (
    AuthenticationError,
    CollectiveAbortedError,
    InvalidArgumentError,
    InvalidUsageError,
    MasterConnectionError,
    NoSharedStateAvailableError,
    PCCLError,
    PeerConnectionError,
    PendingAsyncOpsError,
    ProtocolError,
    RevisionIncrementViolationError,
    TooFewPeersError,
    TopologyOptimizationFailedError,
    UpdateTopologyFailedError,
)


class OperationTimeoutError(CollectiveAbortedError, TimeoutError):
    """The other peers did not make the same collective call within its deadline
    (``Communicator(collective_timeout=...)`` or the call's ``timeout=``). The master
    called the operation off for every peer that made it; nothing was written. Retry; if
    it keeps happening, some peer is not running the same sequence of collective calls
    (or is stuck outside pccl)."""


__all__ = [
    "AuthenticationError",
    "CollectiveAbortedError",
    "InvalidArgumentError",
    "InvalidUsageError",
    "MasterConnectionError",
    "NoSharedStateAvailableError",
    "OperationTimeoutError",
    "PCCLError",
    "PeerConnectionError",
    "PendingAsyncOpsError",
    "ProtocolError",
    "RevisionIncrementViolationError",
    "TooFewPeersError",
    "TopologyOptimizationFailedError",
    "UpdateTopologyFailedError",
]

#: Error kinds as they travel in control-plane messages (``ErrorReply.kind``).
ERROR_KINDS: dict[str, type[PCCLError]] = {cls.__name__: cls for cls in
                                           (globals()[n] for n in __all__)}
