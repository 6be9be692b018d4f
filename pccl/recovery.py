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

import asyncio
import enum
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar

from pccl.errors import (
    CollectiveAbortedError,
    InvalidArgumentError,
    InvalidUsageError,
    OperationTimeoutError,
    PeerConnectionError,
    TopologyOptimizationFailedError,
    UpdateTopologyFailedError,
)
from pccl.peer.metrics import PeerMetrics
from pccl.peer.options import QuantizationOptions, ReduceDescriptor, ReduceInfo

__all__ = ["RETRYABLE", "Action", "Voter", "all_reduce_with_retry", "decide", "retryable",
           "with_retry"]

log = logging.getLogger("pccl.communicator")


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


T = TypeVar("T")


class Voter(Protocol):
    """What a retry needs of a communicator: the vote (recovery depends on no class)."""

    async def update_topology(self) -> None: ...


async def with_retry(call: Callable[[], Awaitable[T]], comm: Voter | None, *, attempts: int,
                     what: str = "the call",
                     before_retry: Callable[[Action], Awaitable[None]] | None = None,
                     on_failure: Callable[[BaseException, int], None] | None = None) -> T:
    """``await call()``, made again while it fails with an error a retry may fix, doing
    what :func:`decide` says before each new attempt: nothing (``RETRY``), or
    ``comm.update_topology()`` (``UPDATE_TOPOLOGY``; ``comm=None`` when ``call`` is the
    vote itself, or holds one), then ``before_retry(action)`` if given. At most
    ``attempts`` calls in all; the last failure, or one no retry can fix, is raised as
    it is. ``on_failure(error, failures)`` sees each failure that is retried. The one
    retry loop of every layer: every peer of a collective sees the same outcome, so all
    take the same action and stay in step."""
    if attempts < 1:
        raise InvalidArgumentError(f"attempts must be at least 1, got {attempts}")
    failures = 0
    while True:
        try:
            return await call()
        except RETRYABLE as e:
            failures += 1
            action = decide(e, failures)
            if action is Action.GIVE_UP or failures >= attempts:
                raise
            if on_failure is not None:
                on_failure(e, failures)
            log.info("%s failed (%s: %s); %s (attempt %d of %d)", what, type(e).__name__,
                     str(e), action.value, failures + 1, attempts)
            if action is Action.UPDATE_TOPOLOGY and comm is not None:
                await comm.update_topology()
            if before_retry is not None:
                await before_retry(action)


class _Reducer(Voter, Protocol):
    """What :func:`all_reduce_with_retry` needs of a communicator."""

    @property
    def peer_id(self) -> int | None: ...
    @property
    def metrics(self) -> PeerMetrics: ...

    def all_reduce_async(self, tensor: Any, out: Any = None, *, op: Any = ..., tag: int = ...,
                         quantization: QuantizationOptions | None = ...
                         ) -> Awaitable[ReduceInfo]: ...


async def all_reduce_with_retry(comm: _Reducer, descriptors: list[ReduceDescriptor],
                                max_in_flight: int, max_attempts: int) -> list[ReduceInfo]:
    """:meth:`pccl.Communicator.all_reduce_multiple_with_retry`: the policy above applied
    to a set of all-reduces, ``max_in_flight`` at a time, up to ``max_attempts`` rounds."""
    if max_in_flight < 1:
        raise InvalidArgumentError("max_in_flight must be at least 1")
    if len({d.tag for d in descriptors}) != len(descriptors):
        raise InvalidUsageError("descriptors must have distinct tags")
    results: dict[int, ReduceInfo] = {}
    todo = list(range(len(descriptors)))
    for attempt in range(max_attempts):
        failures: list[BaseException] = []
        for start in range(0, len(todo), max_in_flight):
            batch = todo[start:start + max_in_flight]
            handles = []
            for i in batch:
                d = descriptors[i]
                handles.append(comm.all_reduce_async(d.tensor, d.out, op=d.op, tag=d.tag,
                                                     quantization=d.quantization))
            outcomes = await asyncio.gather(*handles, return_exceptions=True)
            for i, res in zip(batch, outcomes):
                if isinstance(res, ReduceInfo):
                    results[i] = res
                elif decide(res, attempt + 1) is Action.GIVE_UP:
                    raise res
                else:
                    failures.append(res)
        todo = [i for i in todo if i not in results]
        if not todo:
            return [results[i] for i in range(len(descriptors))]
        vote = any(decide(f, attempt + 1) is Action.UPDATE_TOPOLOGY for f in failures)
        log.info("peer %s: %d all-reduce(s) failed (%s); retrying%s (attempt %d/%d)",
                 comm.peer_id, len(todo), failures[0],
                 " after update_topology()" if vote else "", attempt + 1, max_attempts)
        comm.metrics.retries.labels("update_topology" if vote else "retry").inc()
        if vote:
            await comm.update_topology()
    raise PeerConnectionError(
        f"{len(todo)} all-reduce(s) still failing after {max_attempts} attempts")
