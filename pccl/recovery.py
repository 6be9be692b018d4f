"""The one recovery policy: which failures a retry can fix, and what to do before it.

Every layer that retries (``Communicator.all_reduce_multiple_with_retry``,
:mod:`pccl.blocking`, :mod:`pccl.diloco`) asks :func:`decide` and does what it says, so
a failure means the same thing everywhere. Every peer of a collective gets the same
outcome (the master decides it once, for all), so every peer takes the same decision and
the group stays in step: nobody votes for a new topology alone, nobody gives up alone.

=========================================  ==========================================
failure                                    action
=========================================  ==========================================
:class:`PeerConnectionError`, first time   ``RETRY``: the master rebuilds the ring
                                           from the peers left and runs the retry on it
:class:`PeerConnectionError`, again        ``UPDATE_TOPOLOGY``: the rebuilt ring failed
                                           too; vote for a new topology, then retry
:class:`CollectiveAbortedError` (plain)    ``UPDATE_TOPOLOGY``: called off because peers
                                           of the group are in ``update_topology()``;
                                           join them, then retry
:class:`UpdateTopologyFailedError`,        ``UPDATE_TOPOLOGY``: the vote lost a peer
:class:`TopologyOptimizationFailedError`   midway; vote again
:class:`OperationTimeoutError`             ``GIVE_UP``: some peer did not make the call
                                           for a whole deadline; it will not make a
                                           retry either (all peers give up alike)
anything else (invalid argument or usage,  ``GIVE_UP``: a retry cannot change it
master lost, authentication, protocol,
revision violation, ...)
=========================================  ==========================================
"""

from __future__ import annotations

import enum

from pccl.errors import (
    CollectiveAbortedError,
    OperationTimeoutError,
    PeerConnectionError,
    TopologyOptimizationFailedError,
    UpdateTopologyFailedError,
)

__all__ = ["RETRYABLE", "Action", "decide", "retryable"]


class Action(enum.Enum):
    """What to do after a failure (see the module docstring)."""

    GIVE_UP = "give up"
    RETRY = "retry"
    UPDATE_TOPOLOGY = "update topology, then retry"


#: The error classes a retry may fix (:func:`decide` says how), for ``except`` clauses.
#: :class:`OperationTimeoutError` is a :class:`CollectiveAbortedError` but is not
#: retryable: check with :func:`retryable` where the difference matters.
RETRYABLE: tuple[type[BaseException], ...] = (
    PeerConnectionError, CollectiveAbortedError, UpdateTopologyFailedError,
    TopologyOptimizationFailedError)


def decide(error: BaseException, failures: int = 1) -> Action:
    """What to do after ``error``, the ``failures``-th failure in a row of one operation
    (counting this one). The caller bounds the number of attempts."""
    if isinstance(error, OperationTimeoutError) or not isinstance(error, RETRYABLE):
        return Action.GIVE_UP
    if isinstance(error, PeerConnectionError) and failures <= 1:
        return Action.RETRY
    return Action.UPDATE_TOPOLOGY


def retryable(error: BaseException) -> bool:
    """Whether a retry may fix ``error`` (:func:`decide` does not say ``GIVE_UP``)."""
    return decide(error) is not Action.GIVE_UP
