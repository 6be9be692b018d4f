"""pccl.recovery, the one recovery policy: decide()'s table exactly, and the one retry
loop (with_retry) against a scripted call, no network."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import pytest

import pccl
from pccl.recovery import Action, decide, retryable, with_retry

A = Action


@pytest.mark.parametrize(("error", "failures", "action"), [
    (pccl.PeerConnectionError("x"), 1, A.RETRY),  # the master rebuilt the ring
    (pccl.PeerConnectionError("x"), 2, A.UPDATE_TOPOLOGY),  # the rebuilt ring failed too
    (pccl.PeerConnectionError("x"), 7, A.UPDATE_TOPOLOGY),
    (pccl.CollectiveAbortedError("x"), 1, A.UPDATE_TOPOLOGY),  # others are voting
    (pccl.UpdateTopologyFailedError("x"), 1, A.UPDATE_TOPOLOGY),
    (pccl.TopologyOptimizationFailedError("x"), 1, A.UPDATE_TOPOLOGY),
    (pccl.OperationTimeoutError("x"), 1, A.GIVE_UP),  # a CollectiveAbortedError, but final
    (pccl.MasterConnectionError("x"), 1, A.GIVE_UP),
    (pccl.AuthenticationError("x"), 1, A.GIVE_UP),
    (pccl.IdentityError("x"), 1, A.GIVE_UP),
    (pccl.ProtocolError("x"), 1, A.GIVE_UP),
    (pccl.InvalidArgumentError("x"), 1, A.GIVE_UP),
    (pccl.InvalidUsageError("x"), 1, A.GIVE_UP),
    (pccl.RevisionIncrementViolationError("x"), 1, A.GIVE_UP),
    (pccl.TooFewPeersError("x"), 1, A.GIVE_UP),
    (ValueError("not pccl's"), 1, A.GIVE_UP),
])
def test_decide_is_the_documented_table(error: BaseException, failures: int,
                                        action: Action) -> None:
    assert decide(error, failures) is action
    assert retryable(error) is (decide(error) is not A.GIVE_UP)


class Voter:
    def __init__(self) -> None:
        self.votes = 0

    async def update_topology(self) -> None:
        self.votes += 1


def scripted(*outcomes: BaseException | str) -> tuple[Callable[[], Awaitable[str]], list[int]]:
    """A call that fails or returns as scripted, and the list of its calls."""
    calls: list[int] = []

    async def call() -> str:
        calls.append(len(calls) + 1)
        out = outcomes[len(calls) - 1]
        if isinstance(out, BaseException):
            raise out
        return out

    return call, calls


async def test_a_lost_peer_is_retried_at_once_then_voted_on() -> None:
    call, calls = scripted(pccl.PeerConnectionError("a"), pccl.PeerConnectionError("b"), "ok")
    voter, seen = Voter(), []

    async def before(action: Action) -> None:
        seen.append((action, voter.votes))

    assert await with_retry(call, voter, attempts=5, before_retry=before) == "ok"
    # First failure: RETRY (no vote); second: a vote, and before_retry sees it done.
    assert (calls, voter.votes, seen) == ([1, 2, 3], 1, [(A.RETRY, 0),
                                                         (A.UPDATE_TOPOLOGY, 1)])


async def test_what_no_retry_fixes_is_raised_at_once() -> None:
    call, calls = scripted(pccl.OperationTimeoutError("nobody else called"), "never")
    voter = Voter()
    with pytest.raises(pccl.OperationTimeoutError):
        await with_retry(call, voter, attempts=5)
    assert (calls, voter.votes) == ([1], 0)


async def test_the_attempts_are_bounded_and_the_last_failure_raised() -> None:
    call, calls = scripted(*[pccl.CollectiveAbortedError(f"#{i}") for i in range(1, 4)])
    voter, failures = Voter(), []
    with pytest.raises(pccl.CollectiveAbortedError, match="#3"):
        await with_retry(call, voter, attempts=3,
                         on_failure=lambda e, n: failures.append((str(e), n)))
    assert (calls, voter.votes, failures) == ([1, 2, 3], 2, [("#1", 1), ("#2", 2)])


async def test_a_call_that_is_the_vote_is_not_voted_for_again() -> None:
    call, calls = scripted(pccl.UpdateTopologyFailedError("lost one"), "voted")
    assert await with_retry(call, None, attempts=2) == "voted"
    assert calls == [1, 2]


async def test_attempts_must_allow_a_call() -> None:
    call, _ = scripted("ok")
    with pytest.raises(pccl.InvalidArgumentError, match="attempts"):
        await with_retry(call, None, attempts=0)
