"""pccl's exception hierarchy.

The classes are created once in the Rust extension (so Rust code raises them directly)
and re-exported here; ``pccl.PCCLError`` is the base of all of them::

    try:
        await comm.all_reduce(x)
    except pccl.PeerConnectionError:
        await comm.update_topology()   # drop the dead peer, then retry
"""

from __future__ import annotations

import enum
from typing import TypeAlias

# ``X as X``: re-exported (``__all__`` below is computed from ErrorKind).
from pccl._core import (
    AuthenticationError as AuthenticationError,
)
from pccl._core import (
    CollectiveAbortedError as CollectiveAbortedError,
)
from pccl._core import (
    IdentityError as IdentityError,
)
from pccl._core import (
    InvalidArgumentError as InvalidArgumentError,
)
from pccl._core import (
    InvalidUsageError as InvalidUsageError,
)
from pccl._core import (
    MasterConnectionError as MasterConnectionError,
)
from pccl._core import (
    NoSharedStateAvailableError as NoSharedStateAvailableError,
)
from pccl._core import (
    PCCLError as PCCLError,
)
from pccl._core import (
    PeerConnectionError as PeerConnectionError,
)
from pccl._core import (
    PendingAsyncOpsError as PendingAsyncOpsError,
)
from pccl._core import (
    ProtocolError as ProtocolError,
)
from pccl._core import (
    RevisionIncrementViolationError as RevisionIncrementViolationError,
)
from pccl._core import (
    TooFewPeersError as TooFewPeersError,
)
from pccl._core import (
    TopologyOptimizationFailedError as TopologyOptimizationFailedError,
)
from pccl._core import (
    UpdateTopologyFailedError as UpdateTopologyFailedError,
)


class OperationTimeoutError(CollectiveAbortedError, TimeoutError):
    """The other peers did not make the same collective call within its deadline
    (``Communicator(collective_timeout=...)`` or the call's ``timeout=``). The master
    called the operation off for every peer that made it; nothing was written. Retry; if
    it keeps happening, some peer is not running the same sequence of collective calls
    (or is stuck outside pccl)."""


# Inside ErrorKind's body ``PCCLError`` names the member: its annotations use this.
_PCCLErrorClass: TypeAlias = PCCLError


class ErrorKind(enum.StrEnum):
    """Every pccl error, by name: the one list. Control-plane messages carry an error as
    its kind (``kind`` fields; ``NONE`` where nothing failed), decoding refuses any
    other value, and :meth:`exception` gives the class to raise. The classes themselves
    are created in the Rust extension (so Rust raises them directly);
    ``tests/unit/test_peer_state.py`` checks that this list and the extension's agree."""

    NONE = ""
    PCCLError = "PCCLError"
    AuthenticationError = "AuthenticationError"
    CollectiveAbortedError = "CollectiveAbortedError"
    IdentityError = "IdentityError"
    InvalidArgumentError = "InvalidArgumentError"
    InvalidUsageError = "InvalidUsageError"
    MasterConnectionError = "MasterConnectionError"
    NoSharedStateAvailableError = "NoSharedStateAvailableError"
    OperationTimeoutError = "OperationTimeoutError"
    PeerConnectionError = "PeerConnectionError"
    PendingAsyncOpsError = "PendingAsyncOpsError"
    ProtocolError = "ProtocolError"
    RevisionIncrementViolationError = "RevisionIncrementViolationError"
    TooFewPeersError = "TooFewPeersError"
    TopologyOptimizationFailedError = "TopologyOptimizationFailedError"
    UpdateTopologyFailedError = "UpdateTopologyFailedError"

    @classmethod
    def parse(cls, value: str, default: ErrorKind | None = None) -> ErrorKind:
        """The kind named ``value``; ``default`` (else ``PCCLError``) for an empty or
        unknown name."""
        try:
            kind = cls(value)
        except ValueError:
            kind = cls.NONE
        return kind if kind is not cls.NONE else (default or cls.PCCLError)

    @classmethod
    def of(cls, error: BaseException) -> ErrorKind:
        """The kind of ``error``: its own class, else the nearest pccl base class."""
        for c in type(error).__mro__:
            if c.__name__ in cls.__members__ and c.__name__ != "NONE":
                return cls[c.__name__]
        return cls.PCCLError

    def exception(self) -> type[_PCCLErrorClass]:
        """The class to raise for this kind (``PCCLError`` for ``NONE``)."""
        return ERROR_KINDS.get(self.value, PCCLError)

    def error(self, message: str) -> _PCCLErrorClass:
        """An exception of this kind."""
        return self.exception()(message)


#: The one list of pccl's errors: ``pccl``, ``pccl.blocking`` and ``pccl.__all__`` take
#: their error names from here, the Rust extension creates these classes (a test checks
#: that it creates exactly these), and :class:`ErrorKind` names the same set (checked
#: below, at import).
__all__ = [
    "AuthenticationError",
    "CollectiveAbortedError",
    "ErrorKind",
    "IdentityError",
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
if {k.value for k in ErrorKind if k is not ErrorKind.NONE} != set(__all__) - {"ErrorKind"}:
    raise ImportError("pccl.errors: ErrorKind and __all__ name different errors")

#: Error classes by name (the values of :class:`ErrorKind`).
ERROR_KINDS: dict[str, type[PCCLError]] = {
    k.value: globals()[k.value] for k in ErrorKind if k is not ErrorKind.NONE}
