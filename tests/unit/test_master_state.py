"""The master's sans-IO state machine, driven by hand: events in, exact commands out.

No sockets, no event loop: every test builds a fresh ``MasterState``, feeds it
``PeerRegistered`` / ``PeerLost`` / ``Received`` events and compares the returned
``Send`` / ``Disconnect`` commands with what the protocol says must happen. The last part
is a hypothesis state machine that plays a population of well-behaved peers against the
master and checks its bookkeeping after every step.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as hs
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from pccl import algorithms
from pccl.enums import DataType
from pccl.errors import ErrorKind
from pccl.master.state import (
    ArmDeadline,
    ArmRecoveryTimer,
    CheckReach,
    Command,
    DeadlineExpired,
    Disconnect,
    Event,
    MasterState,
    PeerLost,
    PeerRegistered,
    PeerStatus,
    Phase,
    ReachChecked,
    Received,
    RecoveryTimeout,
    Relayed,
    Resume,
    RoundTimeout,
    Send,
)
from pccl.protocol import messages as m

# --- helpers --------------------------------------------------------------------------


class _AnyText:
    """Compares equal to any non-empty string.

    Error texts and disconnect reasons are meant for humans; the ``kind`` and the shape of
    the commands are the contract, so expected commands use ``TEXT`` in those fields.
    """

    def __eq__(self, other: object) -> bool:
        return isinstance(other, str) and bool(other)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return "<any text>"


TEXT = _AnyText()


def addr(pid: int) -> str:
    return f"10.1.0.{pid}:{7000 + pid}"


def join(st: MasterState, pid: int, group: int = 0) -> list[Command]:
    return st.handle(PeerRegistered(pid, group, addr(pid)))


def tell(st: MasterState, pid: int, msg: m.Message) -> list[Command]:
    return st.handle(Received(pid, msg))


def lose(st: MasterState, pid: int) -> list[Command]:
    return st.handle(PeerLost(pid, "heartbeat timeout"))


def vote(st: MasterState, pid: int) -> list[Command]:
    return tell(st, pid, m.UpdateTopology())


def report(st: MasterState, pid: int, epoch: int, failed: Sequence[int] = (),
           reach: bool = False) -> list[Command]:
    """``pid``'s p2p report; the master's own checks of failed links (CheckReach) are
    answered at once with ``reach`` (False: the accused peer does not answer either)."""
    return answer_checks(st, tell(st, pid, m.P2PReport(epoch=epoch, failed=list(failed))),
                         reach)


def answer_checks(st: MasterState, out: list[Command], reach: bool = False) -> list[Command]:
    done: list[Command] = []
    while out:
        c = out.pop(0)
        if isinstance(c, CheckReach):
            out += st.handle(ReachChecked(c.epoch, c.peer_id, reach))
        else:
            done.append(c)
    return done


def establish(epoch: int, ring: list[int]) -> list[Command]:
    """The EstablishP2P commands for one group's ring, in ring order (a single master
    sends no members: peers take the ring from world;
    tests/integration/test_failover.py has the quorum rounds, which do)."""
    out: list[Command] = []
    for i, p in enumerate(ring):
        nxt = ring[(i + 1) % len(ring)] if len(ring) > 1 else -1
        prv = ring[(i - 1) % len(ring)] if len(ring) > 1 else -1
        out.append(Send(p, m.EstablishP2P(epoch=epoch, ring=[], next_id=nxt,
                                          next_addr=addr(nxt) if nxt >= 0 else "",
                                          prev_id=prv,
                                          prev_addr=addr(prv) if prv >= 0 else "")))
    return out


def world(epoch: int, ring: list[int], total: int, group_size: int, groups: int,
          largest: int, left: tuple[int, list[int]] = (-1, [])) -> m.WorldInfo:
    return m.WorldInfo(epoch=epoch, ring=list(ring), global_world_size=total,
                       peer_group_world_size=group_size, num_peer_groups=groups,
                       largest_peer_group_world_size=largest, left_epoch=left[0],
                       left=left[1])


def coll_init(tag: int = 0, *, dtype: int = 1, count: int = 16, op: int = 0,
              quant_algorithm: int = 0, quant_dtype: int = 0) -> m.CollectiveInit:
    return m.CollectiveInit(tag=tag, kind="all_reduce", dtype=dtype, count=count, op=op,
                            quant_algorithm=quant_algorithm, quant_dtype=quant_dtype)


def done(tag: int, op_id: int, ok: bool = True, kind: str = "",
         message: str = "") -> m.CollectiveDone:
    return m.CollectiveDone(tag=tag, op_id=op_id, ok=ok, kind=kind, message=message)


def outcome(tag: int, op_id: int, ok: bool = True, kind: str = "",
            message: object = "") -> m.CollectiveOutcome:
    return m.CollectiveOutcome(tag=tag, op_id=op_id, ok=ok, kind=kind,
                               message=message)  # type: ignore[arg-type]


def refused(tag: int, kind: str) -> m.CollectiveOutcome:
    return outcome(tag, -1, ok=False, kind=kind, message=TEXT)


def error(kind: str) -> m.ErrorReply:
    return m.ErrorReply(kind=kind, message=TEXT)  # type: ignore[arg-type]


def report_all(st: MasterState) -> list[Command]:
    """Every member of the current round reports its pool up, lowest id first."""
    rnd = st.round
    assert rnd is not None
    out: list[Command] = []
    for p in list(rnd.members):
        out += report(st, p, rnd.epoch)
    return out


def run_with(groups: Sequence[int], **kwargs: int | bool) -> MasterState:
    """A run where peers 1..n (peer i in ``groups[i-1]``) are all accepted.

    Peer 1 is admitted alone (epoch 1), the rest join and are admitted by one vote of
    peer 1 (epoch 2).
    """
    st = MasterState(**{"mesh_max_bytes": 0, **kwargs})  # type: ignore[arg-type]
    join(st, 1, groups[0])
    report_all(st)
    for pid, g in enumerate(groups[1:], start=2):
        join(st, pid, g)
    if len(groups) > 1:
        vote(st, 1)
        report_all(st)
    assert st.accepted() == list(range(1, len(groups) + 1))
    assert st.phase is Phase.IDLE and not st.rings_stale
    return st


def performed3(tag: int = 0, repair_rings: bool = True) -> MasterState:
    """Three accepted peers in one group, collective ``tag`` performed as op 1."""
    st = run_with([0, 0, 0], repair_rings=repair_rings)
    tell(st, 1, coll_init(tag))
    tell(st, 2, coll_init(tag))
    cmds = tell(st, 3, coll_init(tag))
    assert [c.msg.op_id for c in cmds if isinstance(c, Send)] == [1, 1, 1]
    return st


# --- admission ------------------------------------------------------------------------


def test_first_peer_is_admitted_alone_without_a_vote() -> None:
    st = MasterState(mesh_max_bytes=0)
    assert join(st, 1) == establish(1, [1])
    assert establish(1, [1]) == [Send(1, m.EstablishP2P(epoch=1, ring=[], next_id=-1,
                                                         next_addr=""))]
    assert st.phase is Phase.ESTABLISH_P2P
    assert st.round is not None and st.round.members == [1] and st.round.epoch == 1
    assert st.peers[1].status is PeerStatus.REGISTERED

    assert report(st, 1, 1) == [
        Send(1, world(1, [1], 1, 1, 1, 1)),
        Send(1, m.TopologyUpdated(epoch=1)),
    ]
    assert st.peers[1].status is PeerStatus.ACCEPTED
    assert st.phase is Phase.IDLE and st.round is None
    assert st.rings == {0: [1]} and st.ring_epoch == 1 and st.epoch == 1
    assert not st.rings_stale


def resume(st: MasterState, pid: int, epoch: int, revision: int,
           peers: Sequence[int]) -> list[Command]:
    return st.handle(PeerRegistered(pid, 0, addr(pid), Resume(epoch, revision, tuple(peers))))


def test_restarted_master_waits_for_the_old_group_and_admits_it_at_once() -> None:
    st = MasterState(mesh_max_bytes=0)
    # Peer 3 of an old group of {2, 3, 5} comes back first: the master waits for 2 and 5.
    assert resume(st, 3, 9, 4, [2, 3, 5]) == [ArmRecoveryTimer(1)]
    assert st.recovery_awaiting == {2, 5} and st.phase is Phase.IDLE
    # A fresh joiner meanwhile is not admitted alone ahead of the old group.
    assert join(st, 7) == []
    assert resume(st, 2, 9, 4, [2, 3, 5]) == []
    # The last one completes the group: everyone in one round, after the old epochs.
    assert resume(st, 5, 8, 3, [2, 3, 5]) == establish(10, [2, 3, 5, 7])
    assert st.last_revision == {3: 4, 2: 4, 5: 3}
    report_all(st)
    assert st.accepted() == [3, 7, 2, 5]


def test_recovery_timer_admits_whoever_came_back() -> None:
    st = MasterState(mesh_max_bytes=0)
    assert resume(st, 2, 4, -1, [1, 2]) == [ArmRecoveryTimer(1)]
    assert st.handle(RecoveryTimeout(0)) == []  # a stale timer changes nothing
    assert st.handle(RecoveryTimeout(1)) == establish(5, [2])
    assert st.last_revision == {}


def test_resuming_peer_at_a_running_master_is_a_plain_joiner() -> None:
    st = run_with([0, 0])
    assert resume(st, 4, 1, 2, [1, 2, 4]) == []
    assert st.pending() == [4] and not st.recovery_awaiting
    assert st.last_revision == {4: 2}


def test_round_timeout_drops_members_that_never_reported() -> None:
    st = run_with([0, 0])
    join(st, 3)
    vote(st, 1)
    vote(st, 2)
    assert st.round is not None and st.round.epoch == 3
    report(st, 1, 3)
    report(st, 2, 3)
    assert st.handle(RoundTimeout(2)) == []  # a stale timer changes nothing
    out = st.handle(RoundTimeout(3))
    assert Disconnect(3, TEXT) in out
    assert establish(4, [1, 2]) == [c for c in out if isinstance(c, Send)
                                    and isinstance(c.msg, m.EstablishP2P)]
    report_all(st)
    assert st.accepted() == [1, 2] and 3 not in st.peers


def test_second_peer_waits_for_a_vote_of_the_accepted_peer() -> None:
    st = run_with([0])
    assert join(st, 2) == []
    assert st.peers[2].status is PeerStatus.REGISTERED
    assert st.pending() == [2] and st.accepted() == [1]
    assert st.phase is Phase.IDLE

    assert tell(st, 1, m.PendingQuery(req=7)) == [
        Send(1, m.PendingAnswer(req=7, pending=True, count=1))]

    assert vote(st, 1) == [
        *establish(2, [1, 2]),
    ]
    assert st.phase is Phase.ESTABLISH_P2P
    assert report(st, 2, 2) == []
    assert st.peers[2].status is PeerStatus.REGISTERED  # not before everyone reported
    assert report(st, 1, 2) == [
        Send(1, world(2, [1, 2], 2, 2, 1, 2)),
        Send(2, world(2, [1, 2], 2, 2, 1, 2)),
        Send(1, m.TopologyUpdated(epoch=2)),
        Send(2, m.TopologyUpdated(epoch=2)),
    ]
    assert st.accepted() == [1, 2] and st.pending() == []
    assert st.rings == {0: [1, 2]} and st.ring_epoch == 2
    # A collective query: answered once every accepted peer asked, to all at once.
    assert tell(st, 2, m.PendingQuery(req=8)) == []
    assert tell(st, 1, m.PendingQuery(req=9)) == [Send(1, m.PendingAnswer(req=9, pending=False)),
                                                  Send(2, m.PendingAnswer(req=8, pending=False))]


def test_ring_follows_join_order() -> None:
    st = run_with([0])
    for pid in (2, 3, 4):
        join(st, pid)
    cmds = vote(st, 1)
    assert cmds == establish(2, [1, 2, 3, 4])
    # 1 -> 2 -> 3 -> 4 -> 1, each told where to dial its successor.
    assert {c.peer_id: (c.msg.next_id, c.msg.next_addr) for c in cmds} == {  # type: ignore
        1: (2, addr(2)), 2: (3, addr(3)), 3: (4, addr(4)), 4: (1, addr(1))}


def test_pending_query_without_joiners_is_false() -> None:
    st = run_with([0])
    assert tell(st, 1, m.PendingQuery(req=1)) == [Send(1, m.PendingAnswer(req=1, pending=False))]


def test_vote_with_nothing_to_do_answers_at_once_with_the_same_epoch() -> None:
    st = run_with([0, 0])
    assert vote(st, 1) == []
    assert st.phase is Phase.VOTE_ACCEPT_NEW_PEERS and st.votes == {1}
    assert vote(st, 2) == [
        Send(1, m.TopologyUpdated(epoch=2)),
        Send(2, m.TopologyUpdated(epoch=2)),
    ]
    assert st.epoch == 2 and st.round is None
    assert st.phase is Phase.IDLE and st.votes == set()


def test_single_peer_vote_with_nothing_to_do() -> None:
    st = run_with([0])
    assert vote(st, 1) == [Send(1, m.TopologyUpdated(epoch=1))]
    assert st.phase is Phase.IDLE and st.epoch == 1


def test_vote_from_a_registered_peer_is_invalid_usage() -> None:
    st = run_with([0])
    join(st, 2)
    assert vote(st, 2) == [Send(2, error("InvalidUsageError"))]
    assert st.phase is Phase.IDLE and st.votes == set()


def test_duplicate_vote_is_invalid_usage() -> None:
    st = run_with([0, 0])
    assert vote(st, 1) == []
    assert vote(st, 1) == [Send(1, error("InvalidUsageError"))]
    assert st.votes == {1} and st.phase is Phase.VOTE_ACCEPT_NEW_PEERS
    # The vote still completes normally.
    assert vote(st, 2) == [Send(1, m.TopologyUpdated(epoch=2)), Send(2, m.TopologyUpdated(epoch=2))]


def test_vote_while_the_rings_are_being_built_is_invalid_usage() -> None:
    st = run_with([0])
    join(st, 2)
    vote(st, 1)
    assert st.phase is Phase.ESTABLISH_P2P
    assert vote(st, 1) == [Send(1, error("InvalidUsageError"))]
    assert st.round is not None and st.round.epoch == 2


def test_joiner_during_a_round_waits_for_the_next_vote() -> None:
    st = run_with([0])
    join(st, 2)
    vote(st, 1)
    assert join(st, 3) == []
    assert st.round is not None and st.round.members == [1, 2]
    report_all(st)
    assert st.accepted() == [1, 2] and st.pending() == [3]


# --- peer groups ----------------------------------------------------------------------


def test_each_peer_group_gets_its_own_ring_and_sizes() -> None:
    st = run_with([0])
    for pid, g in [(2, 1), (3, 0), (4, 0), (5, 2)]:
        join(st, pid, g)
    assert vote(st, 1) == establish(2, [1, 3, 4]) + establish(2, [2]) + establish(2, [5])
    assert report_all(st) == [
        Send(1, world(2, [1, 3, 4], 5, 3, 3, 3)),
        Send(2, world(2, [2], 5, 1, 3, 3)),
        Send(3, world(2, [1, 3, 4], 5, 3, 3, 3)),
        Send(4, world(2, [1, 3, 4], 5, 3, 3, 3)),
        Send(5, world(2, [5], 5, 1, 3, 3)),
    ] + [Send(p, m.TopologyUpdated(epoch=2)) for p in (1, 2, 3, 4, 5)]
    assert st.rings == {0: [1, 3, 4], 1: [2], 2: [5]}
    assert st.group_sizes() == {0: 3, 1: 1, 2: 1}


def test_two_even_groups_ring_separately() -> None:
    st = run_with([0])
    for pid, g in [(2, 1), (3, 0), (4, 1)]:
        join(st, pid, g)
    assert vote(st, 1) == establish(2, [1, 3]) + establish(2, [2, 4])
    cmds = report_all(st)
    assert cmds[:4] == [
        Send(1, world(2, [1, 3], 4, 2, 2, 2)),
        Send(2, world(2, [2, 4], 4, 2, 2, 2)),
        Send(3, world(2, [1, 3], 4, 2, 2, 2)),
        Send(4, world(2, [2, 4], 4, 2, 2, 2)),
    ]


# --- p2p failures -----------------------------------------------------------------------


def test_unreachable_peer_is_dropped_and_a_new_round_starts() -> None:
    st = run_with([0])
    join(st, 2)
    join(st, 3)
    assert vote(st, 1) == establish(2, [1, 2, 3])
    assert report(st, 2, 2) == []
    assert report(st, 3, 2) == []
    assert report(st, 1, 2, failed=[2]) == [Disconnect(2, TEXT)] + establish(3, [1, 3])
    assert 2 not in st.peers
    assert st.round is not None and st.round.epoch == 3 and st.epoch == 3
    assert st.attempts == 1

    # A late report of the old round changes nothing.
    assert report(st, 3, 2) == []
    assert st.round.reported == set()

    assert report(st, 3, 3) == []
    assert report(st, 1, 3) == [
        Send(1, world(3, [1, 3], 2, 2, 1, 2)),
        Send(3, world(3, [1, 3], 2, 2, 1, 2)),
        Send(1, m.TopologyUpdated(epoch=3)),
        Send(3, m.TopologyUpdated(epoch=3)),
    ]
    assert st.accepted() == [1, 3]


def test_establish_gives_up_after_max_attempts() -> None:
    st = run_with([0], max_establish_attempts=2)
    for pid in (2, 3, 4):
        join(st, pid)
    assert vote(st, 1) == establish(2, [1, 2, 3, 4])
    for pid in (2, 3, 4):
        assert report(st, pid, 2) == []
    assert report(st, 1, 2, failed=[2]) == [Disconnect(2, TEXT)] + establish(3, [1, 3, 4])

    assert report(st, 1, 3) == []
    assert report(st, 4, 3) == []
    assert report(st, 3, 3, failed=[4]) == [
        Disconnect(4, TEXT),
        Send(1, m.TopologyUpdateFailed(message=TEXT)),  # type: ignore[arg-type]
    ]
    assert st.phase is Phase.IDLE and st.round is None and st.votes == set()
    assert st.rings_stale
    assert st.accepted() == [1] and st.pending() == [3]
    assert st.epoch == 3 and st.ring_epoch == 1

    # The next vote starts over with a fresh attempt budget.
    assert vote(st, 1) == establish(4, [1, 3])
    assert st.attempts == 0
    report_all(st)
    assert st.accepted() == [1, 3] and not st.rings_stale


def test_a_report_blaming_a_peer_it_has_no_link_to_drops_the_reporter() -> None:
    # Issue 36 (1): a report may speak only of the reporter's own link (to its ring next);
    # an honest peer never names another, so the reporter is dropped, its blame ignored.
    st = run_with([0])
    join(st, 2)
    vote(st, 1)
    assert report(st, 2, 2, failed=[99]) == []
    cmds = report(st, 1, 2)
    assert Disconnect(2, TEXT, tell=True) in cmds
    assert "no link to" in st.take_notes()[-2].text or 2 not in st.peers
    assert Send(1, m.TopologyUpdated(epoch=3)) in report(st, 1, 3)
    assert st.accepted() == [1]


def test_stale_and_foreign_p2p_reports_are_ignored() -> None:
    st = run_with([0])
    join(st, 2)
    join(st, 3)
    vote(st, 1)
    join(st, 4)  # not part of the round
    before = copy.deepcopy(vars(st))
    assert report(st, 1, 1) == []  # old epoch
    assert report(st, 1, 7) == []  # future epoch
    assert report(st, 4, 2) == []  # not a member
    assert vars(st) == before


# --- losing peers -----------------------------------------------------------------------


def test_peer_lost_during_the_vote_does_not_block_it() -> None:
    st = run_with([0, 0, 0])
    assert vote(st, 1) == []
    assert vote(st, 2) == []
    # 3 never votes: losing it completes the vote, and the changed set needs new rings.
    assert lose(st, 3) == [Disconnect(3, TEXT)] + establish(3, [1, 2])
    assert report_all(st) == [
        Send(1, world(3, [1, 2], 2, 2, 1, 2)),
        Send(2, world(3, [1, 2], 2, 2, 1, 2)),
        Send(1, m.TopologyUpdated(epoch=3)),
        Send(2, m.TopologyUpdated(epoch=3)),
    ]


def test_lost_voter_is_forgotten_and_the_rest_still_must_vote() -> None:
    st = run_with([0, 0])
    vote(st, 1)
    assert lose(st, 1) == [Disconnect(1, TEXT), Send(2, world(2, [2], 1, 1, 1, 1))]
    assert st.votes == set()
    assert vote(st, 2) == establish(3, [2])
    assert report_all(st) == [Send(2, world(3, [2], 1, 1, 1, 1)),
                              Send(2, m.TopologyUpdated(epoch=3))]


def test_pending_peer_lost_during_establish_restarts_the_round_without_it() -> None:
    st = run_with([0])
    join(st, 2)
    join(st, 3)
    vote(st, 1)
    assert report(st, 2, 2) == []
    assert lose(st, 3) == [Disconnect(3, TEXT)] + establish(3, [1, 2])
    assert report(st, 1, 2) == []  # the superseded round
    assert report(st, 1, 3) == []
    assert report(st, 2, 3)[-2:] == [Send(1, m.TopologyUpdated(epoch=3)),
                                     Send(2, m.TopologyUpdated(epoch=3))]
    assert st.accepted() == [1, 2]


def test_accepted_peer_lost_during_establish_restarts_the_round_without_it() -> None:
    st = run_with([0, 0])
    join(st, 3)
    vote(st, 1)
    assert vote(st, 2) == establish(3, [1, 2, 3])
    # No WorldInfo while a round runs: the round's outcome carries it.
    assert lose(st, 1) == [Disconnect(1, TEXT)] + establish(4, [2, 3])
    assert st.votes == {2}
    cmds = report_all(st)
    assert cmds == [
        Send(2, world(4, [2, 3], 2, 2, 1, 2)),
        Send(3, world(4, [2, 3], 2, 2, 1, 2)),
        Send(2, m.TopologyUpdated(epoch=4)),
        Send(3, m.TopologyUpdated(epoch=4)),
    ]


def test_lost_pending_peer_is_simply_removed() -> None:
    st = run_with([0])
    join(st, 2)
    assert lose(st, 2) == [Disconnect(2, TEXT)]
    assert 2 not in st.peers and st.pending() == []
    assert tell(st, 1, m.PendingQuery(req=3)) == [Send(1, m.PendingAnswer(req=3, pending=False))]
    assert not st.rings_stale
    assert vote(st, 1) == [Send(1, m.TopologyUpdated(epoch=1))]


@pytest.mark.parametrize("how", ["leave", "lost"])
def test_when_everyone_leaves_pending_peers_are_admitted(how: str) -> None:
    st = run_with([0])
    join(st, 2)
    join(st, 3)
    cmds = tell(st, 1, m.Leave()) if how == "leave" else lose(st, 1)
    assert cmds == [Disconnect(1, TEXT)] + establish(2, [2, 3])
    assert report_all(st) == [
        Send(2, world(2, [2, 3], 2, 2, 1, 2)),
        Send(3, world(2, [2, 3], 2, 2, 1, 2)),
        Send(2, m.TopologyUpdated(epoch=2)),
        Send(3, m.TopologyUpdated(epoch=2)),
    ]


def test_everyone_lost_during_a_vote_admits_the_pending_peer() -> None:
    st = run_with([0, 0])
    join(st, 3)
    vote(st, 1)
    assert lose(st, 1) == [Disconnect(1, TEXT), Send(2, world(2, [2], 1, 1, 1, 1))]
    assert lose(st, 2) == [Disconnect(2, TEXT)] + establish(3, [3])
    assert st.votes == set()
    report_all(st)
    assert st.accepted() == [3]


def test_last_peer_lost_leaves_an_empty_idle_master() -> None:
    st = run_with([0])
    assert lose(st, 1) == [Disconnect(1, TEXT)]
    assert st.peers == {} and st.phase is Phase.IDLE and st.round is None
    # A newcomer starts a run again, on a new epoch.
    assert join(st, 2) == establish(2, [2])


def test_only_member_of_the_first_round_lost() -> None:
    st = MasterState(mesh_max_bytes=0)
    join(st, 1)
    assert join(st, 2) == []  # waits: the round for peer 1 is running
    assert lose(st, 1) == [Disconnect(1, TEXT)] + establish(2, [2])


# --- leaving ----------------------------------------------------------------------------


def test_leave_disconnects_and_tells_the_rest() -> None:
    st = run_with([0, 0, 0], repair_rings=False)
    # The rest learn who left the ring installed at epoch 2 (quorums then count
    # without it, at any master taking the group over).
    assert tell(st, 2, m.Leave()) == [
        Disconnect(2, TEXT),
        Send(1, world(2, [1, 3], 2, 2, 1, 2, left=(2, [2]))),
        Send(3, world(2, [1, 3], 2, 2, 1, 2, left=(2, [2]))),
    ]
    # The ring stays as built (it is what the links are); the group is marked broken.
    assert st.rings == {0: [1, 2, 3]} and st.rings_stale and st.broken_groups == {0}
    # Nothing pending, but the ring changed: the vote runs a round.
    assert vote(st, 1) == []
    assert vote(st, 3) == establish(3, [1, 3])


def test_leave_with_groups_updates_each_view() -> None:
    st = run_with([0, 1, 0], repair_rings=False)
    assert tell(st, 3, m.Leave()) == [
        Disconnect(3, TEXT),
        Send(1, world(2, [1], 2, 1, 2, 1, left=(2, [3]))),
        Send(2, world(2, [2], 2, 1, 2, 1)),
    ]


def test_last_member_of_a_group_leaving_drops_the_group() -> None:
    st = run_with([0, 1])
    assert tell(st, 2, m.Leave()) == [Disconnect(2, TEXT), Send(1, world(2, [1], 1, 1, 1, 1))]


def test_pending_peer_leaving_tells_nobody() -> None:
    st = run_with([0])
    join(st, 2)
    assert tell(st, 2, m.Leave()) == [Disconnect(2, TEXT)]


# --- collectives ------------------------------------------------------------------------


def test_collective_runs_when_every_member_asked_for_it() -> None:
    st = run_with([0, 0, 0])
    assert tell(st, 2, coll_init(4)) == []
    assert tell(st, 1, coll_init(4)) == []
    assert tell(st, 3, coll_init(4)) == [
        Send(1, m.CollectivePerform(tag=4, op_id=1, epoch=2, rank=0, world=3)),
        Send(2, m.CollectivePerform(tag=4, op_id=1, epoch=2, rank=1, world=3)),
        Send(3, m.CollectivePerform(tag=4, op_id=1, epoch=2, rank=2, world=3)),
    ]
    assert tell(st, 3, done(4, 1)) == []
    assert tell(st, 1, done(4, 1)) == []
    assert tell(st, 2, done(4, 1)) == [Send(p, outcome(4, 1)) for p in (1, 2, 3)]
    assert st.collectives == {} and not st.rings_stale
    # The next one gets the next id; the tag is free again.
    for p in (1, 2):
        tell(st, p, coll_init(4))
    assert [c.msg.op_id for c in tell(st, 3, coll_init(4))] == [2, 2, 2]  # type: ignore[union-attr]


def test_collective_of_a_single_peer_runs_at_once() -> None:
    st = run_with([0])
    assert tell(st, 1, coll_init(0)) == [
        Send(1, m.CollectivePerform(tag=0, op_id=1, epoch=1, rank=0, world=1))]
    assert tell(st, 1, done(0, 1)) == [Send(1, outcome(0, 1))]


@pytest.mark.parametrize("field", ["count", "dtype", "op", "quant_algorithm", "quant_dtype"])
def test_mismatched_descriptors_are_refused_to_everyone(field: str) -> None:
    st = run_with([0, 0, 0])
    assert tell(st, 1, coll_init(2)) == []
    assert tell(st, 2, coll_init(2)) == []
    odd = dataclasses.replace(coll_init(2), **{field: 9})
    assert tell(st, 3, odd) == [Send(p, refused(2, "InvalidUsageError")) for p in (1, 2, 3)]
    assert st.collectives == {}
    # The group is still usable with the same tag.
    tell(st, 1, coll_init(2))
    tell(st, 2, coll_init(2))
    assert len(tell(st, 3, coll_init(2))) == 3


def test_mismatch_is_only_judged_once_everyone_asked() -> None:
    st = run_with([0, 0, 0])
    assert tell(st, 1, coll_init(0, count=1)) == []
    assert tell(st, 2, coll_init(0, count=2)) == []
    assert tell(st, 3, coll_init(0, count=1)) == [
        Send(p, refused(0, "InvalidUsageError")) for p in (1, 2, 3)]


def test_duplicate_tag_from_the_same_peer_is_refused() -> None:
    st = run_with([0, 0])
    assert tell(st, 1, coll_init(5)) == []
    assert tell(st, 1, coll_init(5)) == [Send(1, refused(5, "InvalidUsageError"))]
    # The first request is still alive.
    assert tell(st, 2, coll_init(5)) == [
        Send(1, m.CollectivePerform(tag=5, op_id=1, epoch=2, rank=0, world=2)),
        Send(2, m.CollectivePerform(tag=5, op_id=1, epoch=2, rank=1, world=2)),
    ]
    # While it runs, the tag stays taken.
    assert tell(st, 2, coll_init(5)) == [Send(2, refused(5, "InvalidUsageError"))]
    assert st.collectives[(0, 5)].op_id == 1


def test_an_unknown_kind_or_a_quantized_all_gather_is_refused_to_the_asker() -> None:
    """An insider asking for a collective the master does not run is refused alone;
    the others' collective of that tag is not disturbed."""
    st = run_with([0, 0])
    assert tell(st, 2, coll_init(3)) == []
    for odd in (dataclasses.replace(coll_init(3), kind="all_scatter"),
                dataclasses.replace(coll_init(3), kind="x" * 32),
                dataclasses.replace(coll_init(3), kind="all_gather", quant_algorithm=1)):
        assert tell(st, 1, odd) == [Send(1, refused(3, "InvalidUsageError"))]
    assert len(tell(st, 1, coll_init(3))) == 2  # performed for both


def test_an_all_gather_outcome_names_its_slots_and_the_master_joins_tiny_ones() -> None:
    st = run_with([0, 0, 0])
    gather = dataclasses.replace(coll_init(1, count=2, dtype=int(DataType.UINT8)),
                                 kind="all_gather")
    ring = st.rings[0]
    for p in (3, 1, 2):
        tell(st, p, gather)
    sends: list[Command] = []
    for p in (1, 2, 3):
        sends = tell(st, p, done(1, 1))
    assert [(c.msg.ok, c.msg.peers) for c in sends] == [(True, ring)] * 3  # type: ignore[union-attr]
    # Via the master: every member sent its bytes; the result is them in ring order.
    for p in ring:
        sends = tell(st, p, dataclasses.replace(gather, tag=2, data=bytes([p, p])))
    assert len(sends) == 3
    for cmd in sends:
        msg = cmd.msg  # type: ignore[union-attr]
        assert msg.ok and msg.peers == ring and msg.world == 3
        # Each member gets the others' bytes in ring order (it has its own).
        assert msg.data == b"".join(bytes([p, p]) for p in ring if p != cmd.peer_id)  # type: ignore[union-attr]
    # An all-reduce's outcome names no slots.
    for p in ring:
        sends = tell(st, p, coll_init(3))
    for p in ring:
        sends = tell(st, p, done(3, 3))  # (op 2 went through the master)
    assert [c.msg.peers for c in sends] == [[]] * 3  # type: ignore[union-attr]


def test_a_lying_member_of_a_gather_via_the_master_fails_it_for_all() -> None:
    """A member sends bytes of another length than its descriptor says: nothing is
    joined, everyone gets InvalidUsageError (the group goes on). A gather whose result
    would pass the master's cap runs on the ring even when every member sent bytes."""
    from pccl.master.state.collectives import VIA_MASTER_MAX_GATHER

    st = run_with([0, 0, 0])
    ring = st.rings[0]
    gather = dataclasses.replace(coll_init(4, count=2, dtype=int(DataType.UINT8)),
                                 kind="all_gather")
    sends: list[Command] = []
    for p in ring:
        sends = tell(st, p, dataclasses.replace(gather, data=b"xxx" if p == ring[1] else b"ok"))
    assert sends == [Send(p, refused(4, "InvalidUsageError")) for p in ring]
    assert st.collectives == {}
    big = VIA_MASTER_MAX_GATHER // 3 + 1
    huge = dataclasses.replace(gather, count=big, data=bytes(big))
    for p in ring:
        sends = tell(st, p, huge)
    assert [type(c.msg) for c in sends] == [m.CollectivePerform] * 3  # type: ignore[union-attr]


def test_collective_from_a_registered_peer_is_refused() -> None:
    st = run_with([0])
    join(st, 2)
    assert tell(st, 2, coll_init(0)) == [Send(2, refused(0, "InvalidUsageError"))]
    assert st.collectives == {}


def test_failed_collective_aborts_the_rest_and_marks_the_rings_stale() -> None:
    st = performed3(repair_rings=False)
    assert tell(st, 2, done(0, 1, ok=False, kind="PeerConnectionError", message="link reset")) == [
        Send(1, m.CollectiveAbort(tag=0, op_id=1, message=TEXT)),  # type: ignore[arg-type]
        Send(3, m.CollectiveAbort(tag=0, op_id=1, message=TEXT)),  # type: ignore[arg-type]
    ]
    assert tell(st, 3, done(0, 1, ok=False, kind="CollectiveAbortedError", message="aborted")) == []
    cmds = tell(st, 1, done(0, 1, ok=False, kind="CollectiveAbortedError", message="aborted"))
    assert cmds == [Send(p, outcome(0, 1, ok=False, kind="PeerConnectionError", message=TEXT))
                    for p in (1, 2, 3)]
    assert "link reset" in cmds[0].msg.message  # type: ignore[union-attr]
    assert st.collectives == {} and st.rings_stale
    # Nothing is pending, yet the vote rebuilds the rings.
    assert vote(st, 1) == []
    assert vote(st, 2) == []
    assert vote(st, 3) == establish(3, [1, 2, 3])


def test_failed_collective_breaks_only_its_group_until_the_next_round() -> None:
    st = run_with([0, 1, 0, 1], repair_rings=False)
    tell(st, 1, coll_init(0))
    tell(st, 3, coll_init(0))  # op 1 on group 0
    tell(st, 1, done(0, 1, ok=False, kind="PeerConnectionError", message="reset"))
    assert tell(st, 3, done(0, 1, ok=False, kind="CollectiveAbortedError", message="x")) == [
        Send(p, outcome(0, 1, ok=False, kind="PeerConnectionError", message=TEXT)) for p in (1, 3)]
    # Group 0's links may hold half-sent pieces: any tag is refused at once, per caller.
    assert tell(st, 1, coll_init(1)) == [Send(1, refused(1, "PeerConnectionError"))]
    assert tell(st, 3, coll_init(1)) == [Send(3, refused(1, "PeerConnectionError"))]
    assert st.collectives == {}
    # Group 1 is not affected.
    assert tell(st, 2, coll_init(1)) == []
    assert [c.msg.op_id for c in tell(st, 4, coll_init(1))] == [2, 2]  # type: ignore[union-attr]
    for p in (2, 4):
        tell(st, p, done(1, 2))
    # After a round everything works again.
    for p in (1, 2, 3):
        assert vote(st, p) == []
    assert vote(st, 4) == establish(3, [1, 3]) + establish(3, [2, 4])
    report_all(st)
    tell(st, 1, coll_init(0))
    assert tell(st, 3, coll_init(0)) == [
        Send(1, m.CollectivePerform(tag=0, op_id=3, epoch=3, rank=0, world=2)),
        Send(3, m.CollectivePerform(tag=0, op_id=3, epoch=3, rank=1, world=2)),
    ]


def test_failure_without_a_kind_counts_as_a_connection_error() -> None:
    st = performed3(repair_rings=False)
    tell(st, 1, done(0, 1, ok=False))
    tell(st, 2, done(0, 1, ok=False))
    assert tell(st, 3, done(0, 1, ok=False)) == [
        Send(p, outcome(0, 1, ok=False, kind="PeerConnectionError", message=TEXT))
        for p in (1, 2, 3)]


def test_failure_after_others_finished_aborts_only_the_unreported() -> None:
    st = performed3(repair_rings=False)
    assert tell(st, 1, done(0, 1)) == []
    assert tell(st, 3, done(0, 1, ok=False, kind="PeerConnectionError", message="x")) == [
        Send(2, m.CollectiveAbort(tag=0, op_id=1, message=TEXT))]  # type: ignore[arg-type]
    # A second failure does not abort again.
    assert tell(st, 2, done(0, 1, ok=False, kind="CollectiveAbortedError", message="y")) == [
        Send(p, outcome(0, 1, ok=False, kind="PeerConnectionError", message=TEXT))
        for p in (1, 2, 3)]


def test_withdrawal_after_reporting_success_fails_the_collective_for_all() -> None:
    """A caller cancelled after its peer reported success: the others must not apply
    what it drops. Once the outcome went out, a withdrawal is stale."""
    st = performed3(repair_rings=False)
    tell(st, 1, done(0, 1))
    cancelled = done(0, 1, ok=False, kind="CollectiveAbortedError",
                     message="cancelled by the caller")
    assert tell(st, 1, cancelled) == [
        Send(p, m.CollectiveAbort(tag=0, op_id=1, message=TEXT))  # type: ignore[arg-type]
        for p in (2, 3)]
    tell(st, 2, done(0, 1, ok=False, kind="CollectiveAbortedError", message="x"))
    assert tell(st, 3, done(0, 1)) == [
        Send(p, outcome(0, 1, ok=False, kind="CollectiveAbortedError", message=TEXT))
        for p in (1, 2, 3)]
    st = performed3()
    for p in (1, 2, 3):
        tell(st, p, done(0, 1))
    assert tell(st, 1, cancelled) == []


def test_peer_lost_mid_collective_aborts_and_fails_it_for_the_rest() -> None:
    st = performed3(repair_rings=False)
    assert tell(st, 1, done(0, 1)) == []
    assert lose(st, 2) == [
        Disconnect(2, TEXT),
        Send(3, m.CollectiveAbort(tag=0, op_id=1, message=TEXT)),  # type: ignore[arg-type]
        Send(1, world(2, [1, 3], 2, 2, 1, 2)),
        Send(3, world(2, [1, 3], 2, 2, 1, 2)),
    ]
    assert tell(st, 3, done(0, 1, ok=False, kind="CollectiveAbortedError", message="x")) == [
        Send(p, outcome(0, 1, ok=False, kind="PeerConnectionError", message=TEXT)) for p in (1, 3)]
    assert st.collectives == {} and st.rings_stale


def test_peer_lost_after_everyone_else_reported_finishes_the_collective() -> None:
    st = performed3(repair_rings=False)
    tell(st, 1, done(0, 1))
    tell(st, 3, done(0, 1))
    assert lose(st, 2) == [
        Disconnect(2, TEXT),
        Send(1, outcome(0, 1, ok=False, kind="PeerConnectionError", message=TEXT)),
        Send(3, outcome(0, 1, ok=False, kind="PeerConnectionError", message=TEXT)),
        Send(1, world(2, [1, 3], 2, 2, 1, 2)),
        Send(3, world(2, [1, 3], 2, 2, 1, 2)),
    ]


def test_peer_lost_before_the_collective_ran_fails_it_for_the_askers() -> None:
    st = run_with([0, 0, 0], repair_rings=False)
    tell(st, 1, coll_init(0))
    tell(st, 2, coll_init(0))
    assert lose(st, 3) == [
        Disconnect(3, TEXT),
        Send(1, refused(0, "PeerConnectionError")),
        Send(2, refused(0, "PeerConnectionError")),
        Send(1, world(2, [1, 2], 2, 2, 1, 2)),
        Send(2, world(2, [1, 2], 2, 2, 1, 2)),
    ]
    assert st.collectives == {}


def test_asker_lost_before_the_collective_ran_fails_it_for_the_other_askers() -> None:
    st = run_with([0, 0, 0], repair_rings=False)
    tell(st, 1, coll_init(0))
    tell(st, 3, coll_init(0))
    cmds = tell(st, 3, m.Leave())
    assert cmds[:2] == [Disconnect(3, TEXT), Send(1, refused(0, "PeerConnectionError"))]
    assert not any(isinstance(c, Send) and isinstance(c.msg, m.CollectiveOutcome)
                   and c.peer_id != 1 for c in cmds)


def test_loss_in_another_group_leaves_collectives_alone() -> None:
    st = run_with([0, 1, 0])
    tell(st, 1, coll_init(0))
    assert lose(st, 2) == [Disconnect(2, TEXT), Send(1, world(2, [1, 3], 2, 2, 1, 2)),
                           Send(3, world(2, [1, 3], 2, 2, 1, 2))]
    assert (0, 0) in st.collectives


def test_vote_calls_off_a_waiting_collective_of_the_same_group() -> None:
    st = run_with([0, 0, 0])
    assert tell(st, 1, coll_init(0)) == []
    assert vote(st, 2) == [Send(1, refused(0, "CollectiveAbortedError"))]
    assert st.collectives == {} and st.votes == {2}
    # The caller then votes too and the vote completes.
    assert vote(st, 1) == []
    assert vote(st, 3) == [Send(p, m.TopologyUpdated(epoch=2)) for p in (1, 2, 3)]


def test_collective_asked_for_while_a_group_member_votes_is_called_off() -> None:
    st = run_with([0, 0])
    vote(st, 2)
    assert tell(st, 1, coll_init(3)) == [Send(1, refused(3, "CollectiveAbortedError"))]
    assert st.collectives == {}


def test_vote_in_another_group_leaves_a_waiting_collective_alone() -> None:
    st = run_with([0, 1, 0, 1])
    assert tell(st, 2, coll_init(0)) == []
    assert vote(st, 1) == []
    assert (1, 0) in st.collectives
    # The other group can still finish its collective while the vote waits for it.
    assert tell(st, 4, coll_init(0)) == [
        Send(2, m.CollectivePerform(tag=0, op_id=1, epoch=2, rank=0, world=2)),
        Send(4, m.CollectivePerform(tag=0, op_id=1, epoch=2, rank=1, world=2)),
    ]


def test_withdrawal_before_perform_calls_it_off_for_the_others_only() -> None:
    st = run_with([0, 0, 0])
    tell(st, 1, coll_init(0))
    tell(st, 2, coll_init(0))
    assert tell(st, 1, done(0, -1, ok=False, kind="CollectiveAbortedError",
                            message="cancelled")) == [
        Send(2, refused(0, "CollectiveAbortedError"))]
    assert st.collectives == {}
    # The withdrawn peer may reuse the tag at once.
    assert tell(st, 1, coll_init(0)) == []
    assert st.collectives[(0, 0)].inits.keys() == {1}


def test_withdrawal_by_a_peer_that_never_asked_is_ignored() -> None:
    st = run_with([0, 0, 0])
    tell(st, 1, coll_init(0))
    assert tell(st, 2, done(0, -1, ok=False, kind="CollectiveAbortedError", message="x")) == []
    assert st.collectives[(0, 0)].inits.keys() == {1}


def test_withdrawal_after_perform_counts_as_that_peer_failing() -> None:
    st = performed3(repair_rings=False)
    assert tell(st, 1, done(0, -1, ok=False, kind="CollectiveAbortedError",
                            message="cancelled")) == [
        Send(2, m.CollectiveAbort(tag=0, op_id=1, message=TEXT)),  # type: ignore[arg-type]
        Send(3, m.CollectiveAbort(tag=0, op_id=1, message=TEXT)),  # type: ignore[arg-type]
    ]
    assert st.collectives[(0, 0)].reported == {1}
    tell(st, 2, done(0, 1, ok=False, kind="CollectiveAbortedError", message="x"))
    assert tell(st, 3, done(0, 1, ok=False, kind="CollectiveAbortedError", message="x")) == [
        Send(p, outcome(0, 1, ok=False, kind="CollectiveAbortedError", message=TEXT))
        for p in (1, 2, 3)]
    assert st.rings_stale


def test_late_or_foreign_done_messages_are_ignored() -> None:
    st = performed3()
    before = copy.deepcopy(vars(st))
    assert tell(st, 1, done(0, 7)) == []  # wrong op id
    assert tell(st, 1, done(1, 1)) == []  # unknown tag
    assert vars(st) == before
    for p in (1, 2, 3):
        tell(st, p, done(0, 1))
    assert tell(st, 1, done(0, 1)) == []  # after the outcome
    assert st.collectives == {}


def test_collectives_in_different_groups_and_tags_are_independent() -> None:
    st = run_with([0, 1, 0, 1])
    assert tell(st, 1, coll_init(0)) == []
    assert tell(st, 3, coll_init(0)) == [
        Send(1, m.CollectivePerform(tag=0, op_id=1, epoch=2, rank=0, world=2)),
        Send(3, m.CollectivePerform(tag=0, op_id=1, epoch=2, rank=1, world=2)),
    ]
    assert tell(st, 1, coll_init(1, count=3)) == []
    assert tell(st, 3, coll_init(1, count=3)) == [
        Send(1, m.CollectivePerform(tag=1, op_id=2, epoch=2, rank=0, world=2)),
        Send(3, m.CollectivePerform(tag=1, op_id=2, epoch=2, rank=1, world=2)),
    ]
    # Group 1 uses the same tag with another size: it only has to agree with itself.
    assert tell(st, 2, coll_init(0, count=99)) == []
    assert tell(st, 4, coll_init(0, count=99)) == [
        Send(2, m.CollectivePerform(tag=0, op_id=3, epoch=2, rank=0, world=2)),
        Send(4, m.CollectivePerform(tag=0, op_id=3, epoch=2, rank=1, world=2)),
    ]
    assert set(st.collectives) == {(0, 0), (0, 1), (1, 0)}

    assert tell(st, 2, done(0, 3, ok=False, kind="PeerConnectionError", message="x")) == [
        Send(4, m.CollectiveAbort(tag=0, op_id=3, message=TEXT))]  # type: ignore[arg-type]
    tell(st, 1, done(0, 1))
    assert tell(st, 3, done(0, 1)) == [Send(1, outcome(0, 1)), Send(3, outcome(0, 1))]
    tell(st, 3, done(1, 2))
    assert tell(st, 1, done(1, 2)) == [Send(1, outcome(1, 2)), Send(3, outcome(1, 2))]
    assert set(st.collectives) == {(1, 0)}


# --- misuse and robustness ---------------------------------------------------------------

# One sample of every message a peer must never send to the master.
STRAY: dict[str, m.Message] = {
    "challenge": m.Challenge(version=1, nonce=b"n", auth=False),
    "hello": m.Hello(version=1, peer_group=0, p2p_port=1, p2p_host="", nonce=b"n", mac=b""),
    "welcome": m.Welcome(peer_id=1, mac=b"", heartbeat_interval=1.0, heartbeat_timeout=5.0),
    "reject": m.Reject(kind="ProtocolError", message="no"),
    "shutdown": m.Shutdown(reason="a peer cannot stop the master"),
    "ping": m.Ping(seq=1),
    "establish_p2p": m.EstablishP2P(epoch=1, ring=[1], next_id=-1, next_addr=""),
    "world": world(1, [1], 1, 1, 1, 1),
    "topology_updated": m.TopologyUpdated(epoch=1),
    "topology_update_failed": m.TopologyUpdateFailed(message="x"),
    "pending_answer": m.PendingAnswer(req=1, pending=False),
    "error": m.ErrorReply(kind="ProtocolError", message="x"),
    "coll_perform": m.CollectivePerform(tag=0, op_id=1, epoch=1, rank=0, world=1),
    "coll_abort": m.CollectiveAbort(tag=0, op_id=1, message="x"),
    "coll_outcome": m.CollectiveOutcome(tag=0, op_id=1, ok=True, kind="", message=""),
    "sync_plan": m.SyncPlan(revision=0, fetch_keys=[], fetch_hashes=[], fetch_sources=[],
                            source_ids=[], source_addrs=[]),
    "sync_outcome": m.SyncOutcome(ok=True, kind="", message="", revision=0),
    "probe_request": m.ProbeRequest(target_ids=[], target_addrs=[], seconds=0.1),
    "optimize_failed": m.OptimizeFailed(message="x"),
    "relay_open": m.RelayOpen(token=b"t" * 16, stream=0),
    "doctor_hello": m.DoctorHello(version=1, nonce=b"n", mac=b"", p2p_port=1),
    "doctor_report": m.DoctorReport(observed="1.2.3.4:5", reachable=False, mac=b"",
                                    master_time=0.0),
    "doctor_echo": m.DoctorEcho(payload=b"", reply_bytes=0),
    "denylist": m.Denylist(data=b"only the master hands these out"),
}
# What the master does act on (or, for pong, deliberately ignores).
HANDLED = {"update_topology", "p2p_report", "coll_init", "coll_done", "pending_query", "leave",
           "pong", "sync_init", "sync_done", "sync_withdraw", "optimize_topology",
           "probe_report"}


def test_every_message_type_is_either_handled_or_refused() -> None:
    assert set(STRAY) | HANDLED == set(m.REGISTRY)
    assert not set(STRAY) & HANDLED


@pytest.mark.parametrize("status", ["registered", "accepted"])
@pytest.mark.parametrize("kind", sorted(STRAY) + ["bare"])
def test_unexpected_message_is_a_protocol_error(kind: str, status: str) -> None:
    st = run_with([0])
    join(st, 2)
    pid = 2 if status == "registered" else 1
    msg = STRAY[kind] if kind != "bare" else m.Message()
    before = copy.deepcopy(vars(st))
    assert tell(st, pid, msg) == [Send(pid, error("ProtocolError"))]
    assert vars(st) == before


def test_pong_is_silently_accepted() -> None:
    st = run_with([0])
    assert tell(st, 1, m.Pong(seq=3)) == []


@pytest.mark.parametrize("event", [
    PeerLost(42, "gone"),
    Received(42, m.UpdateTopology()),
    Received(42, m.Leave()),
    Received(42, m.P2PReport(epoch=2, failed=[1])),
    Received(42, coll_init(0)),
    Received(42, done(0, 1)),
    Received(42, m.PendingQuery(req=1)),
    Received(42, m.Ping(seq=1)),
], ids=lambda e: type(e).__name__ + ("" if isinstance(e, PeerLost) else ":" + e.msg.TYPE))
def test_events_for_unknown_peers_are_ignored(event: Event) -> None:
    st = run_with([0, 0])
    join(st, 3)
    vote(st, 1)
    tell(st, 2, coll_init(0))
    before = copy.deepcopy(vars(st))
    assert st.handle(event) == []
    assert vars(st) == before


def test_events_for_a_peer_that_is_gone_are_ignored() -> None:
    st = run_with([0, 0])
    tell(st, 2, m.Leave())
    before = copy.deepcopy(vars(st))
    assert lose(st, 2) == []
    assert vote(st, 2) == []
    assert vars(st) == before


@pytest.mark.parametrize("status", ["registered", "accepted"])
def test_registering_a_known_peer_id_again_raises(status: str) -> None:
    st = run_with([0])
    join(st, 2)
    pid = 2 if status == "registered" else 1
    with pytest.raises(ValueError):
        join(st, pid)


# --- determinism ------------------------------------------------------------------------

SCRIPT: list[Event] = [
    PeerRegistered(1, 0, addr(1)),
    Received(1, m.P2PReport(epoch=1, failed=[])),
    PeerRegistered(2, 1, addr(2)),
    PeerRegistered(3, 0, addr(3)),
    PeerRegistered(4, 1, addr(4)),
    PeerRegistered(5, 0, addr(5)),
    Received(1, m.PendingQuery(req=1)),
    Received(1, m.UpdateTopology()),
    Received(2, m.P2PReport(epoch=2, failed=[4])),
    Received(3, m.P2PReport(epoch=2, failed=[])),
    Received(4, m.P2PReport(epoch=2, failed=[])),
    Received(5, m.P2PReport(epoch=2, failed=[])),
    Received(1, m.P2PReport(epoch=2, failed=[])),
    ReachChecked(2, 4, False),  # the master's own dial-back of 4: no answer either
    Received(3, m.P2PReport(epoch=3, failed=[])),
    PeerLost(5, "heartbeat timeout"),
    Received(1, m.P2PReport(epoch=4, failed=[])),
    Received(2, m.P2PReport(epoch=4, failed=[])),
    Received(3, m.P2PReport(epoch=4, failed=[])),
    Received(1, coll_init(0)),
    Received(3, coll_init(0)),
    Received(2, coll_init(0)),
    Received(3, done(0, 1, ok=False, kind="PeerConnectionError", message="x")),
    Received(1, done(0, 1, ok=False, kind="CollectiveAbortedError", message="aborted")),
    Received(1, coll_init(1)),
    Received(3, m.UpdateTopology()),
    PeerRegistered(6, 1, addr(6)),
    Received(1, m.UpdateTopology()),
    Received(2, m.UpdateTopology()),
    Received(2, m.Leave()),
    Received(1, m.P2PReport(epoch=5, failed=[])),
    Received(3, m.P2PReport(epoch=5, failed=[1])),
    Received(6, m.P2PReport(epoch=5, failed=[])),
    ReachChecked(5, 1, False),  # the master's own dial-back of 1: no answer either
    Received(9, m.Leave()),
    Received(3, m.Hello(version=1, peer_group=0, p2p_port=1, p2p_host="", nonce=b"", mac=b"")),
    Received(6, m.P2PReport(epoch=6, failed=[])),
    Received(3, m.P2PReport(epoch=6, failed=[])),
    Received(1, m.P2PReport(epoch=6, failed=[])),
]


@pytest.mark.parametrize("repair_rings", [False, True])
def test_same_events_give_the_same_commands(repair_rings: bool) -> None:
    a = MasterState(repair_rings=repair_rings, token_key=bytes(32))
    b = MasterState(repair_rings=repair_rings, token_key=bytes(32))
    out_a = [a.handle(e) for e in SCRIPT]
    out_b = [b.handle(e) for e in SCRIPT]
    assert out_a == out_b
    assert vars(a) == vars(b)
    if repair_rings:
        return  # the script's epochs are written for explicit update_topology() rounds
    assert a.accepted() == [1, 3, 6] and a.phase is Phase.IDLE
    # The script does exercise the interesting paths.
    flat = [c for cmds in out_a for c in cmds]
    kinds = {type(c.msg) if isinstance(c, Send) else Disconnect for c in flat}
    assert {m.EstablishP2P, m.WorldInfo, m.TopologyUpdated, m.CollectivePerform,
            m.CollectiveAbort, m.CollectiveOutcome, m.PendingAnswer, m.ErrorReply,
            Disconnect} <= kinds


# --- regressions (bugs found by these tests, fixed in state.py) ------------------------


def test_joiner_is_admitted_after_every_member_of_the_round_was_unreachable() -> None:
    st = run_with([0])
    join(st, 2)
    join(st, 3)
    # Everyone accepted leaves: 2 and 3 are admitted without a vote.
    assert tell(st, 1, m.Leave()) == [Disconnect(1, TEXT)] + establish(2, [2, 3])
    assert join(st, 4) == []  # joins while that round runs
    assert report(st, 2, 2, failed=[3]) == []
    # 2 and 3 cannot reach each other, and the master reaches neither: 3 (whom 2 could
    # not reach) is dropped; 3's report no longer counts, and 2 goes on.
    assert report(st, 3, 2, failed=[2]) == [Disconnect(3, TEXT)] + establish(3, [2])


def test_ring_forgets_an_accepted_peer_dropped_as_unreachable() -> None:
    st = run_with([0, 0, 0], max_establish_attempts=1, repair_rings=False)
    join(st, 4)
    for p in (1, 2, 3):
        vote(st, p)
    for p in (2, 3, 4):
        assert report(st, p, 3) == []
    assert report(st, 1, 3, failed=[2]) == [
        Disconnect(2, TEXT),
        Send(1, world(3, [1, 3], 2, 2, 1, 2)),
        Send(3, world(3, [1, 3], 2, 2, 1, 2)),
        Send(1, m.TopologyUpdateFailed(message=TEXT)),  # type: ignore[arg-type]
        Send(3, m.TopologyUpdateFailed(message=TEXT)),  # type: ignore[arg-type]
    ]
    # 2 is gone for good; when 3 leaves, 1 must not be told that 2 is still in its ring.
    assert tell(st, 3, m.Leave()) == [Disconnect(3, TEXT),
                                      Send(1, world(3, [1], 1, 1, 1, 1, left=(2, [3])))]


def test_collective_fails_when_a_participant_is_dropped_as_unreachable() -> None:
    st = run_with([0, 0])
    join(st, 3)
    tell(st, 1, coll_init(0))
    tell(st, 2, coll_init(0))  # performed as op 1 on ring [1, 2]
    vote(st, 1)
    assert vote(st, 2) == establish(3, [1, 2, 3])
    report(st, 2, 3)
    report(st, 3, 3)
    assert report(st, 1, 3, failed=[2]) == [
        Disconnect(2, TEXT),
        Send(1, m.CollectiveAbort(tag=0, op_id=1, message=TEXT)),  # type: ignore[arg-type]
    ] + establish(4, [1, 3])
    # 2 will never report: 1's report must settle the collective.
    assert tell(st, 1, done(0, 1)) == [
        Send(1, outcome(0, 1, ok=False, kind="PeerConnectionError", message=TEXT))]


def test_collective_on_a_ring_that_lost_a_peer_is_refused_until_the_next_vote() -> None:
    st = run_with([0, 0, 0], repair_rings=False)
    lose(st, 3)
    assert st.rings_stale
    # Refused at once, each caller on its own: waiting for the rest could wait forever.
    assert tell(st, 1, coll_init(0)) == [Send(1, refused(0, "PeerConnectionError"))]
    assert tell(st, 2, coll_init(0)) == [Send(2, refused(0, "PeerConnectionError"))]


def test_round_that_gives_up_after_dropping_accepted_peers_updates_the_world() -> None:
    st = run_with([0, 0, 0], max_establish_attempts=1)
    join(st, 4)
    for p in (1, 2, 3):
        vote(st, p)
    for p in (2, 3, 4):
        report(st, p, 3)
    cmds = report(st, 1, 3, failed=[2])
    assert Disconnect(2, TEXT) in cmds
    assert [c for c in cmds if isinstance(c, Send) and isinstance(c.msg, m.WorldInfo)] == [
        Send(1, world(3, [1, 3], 2, 2, 1, 2)),
        Send(3, world(3, [1, 3], 2, 2, 1, 2)),
    ]


# --- a population of peers against the master (hypothesis) ---------------------------------


@dataclasses.dataclass
class _Call:
    """One collective as the calling peer sees it."""

    count: int
    stage: str  # "waiting" (init sent), "running" (perform received), "reported" (done sent)
    op_id: int = -1
    aborted: bool = False


@dataclasses.dataclass
class _Peer:
    """What a well-behaved client knows and has outstanding."""

    pid: int
    group: int
    accepted: bool = False
    voting: bool = False
    asking: int = 0  # request id of its collective are_peers_pending() (0: none)
    unanswered: dict[int, int] = dataclasses.field(default_factory=dict)  # epoch -> next_id
    calls: dict[int, _Call] = dataclasses.field(default_factory=dict)  # tag -> call
    world: m.WorldInfo | None = None


PICK = hs.integers(min_value=0, max_value=1 << 10)


def _pick(items: Sequence, i: int):  # type: ignore[no-untyped-def]
    return items[i % len(items)]


class MasterPopulation(RuleBasedStateMachine):
    """Peers join, vote, build rings, run collectives, fail and leave, each following the
    rules the real client follows (no vote with collectives in flight, one outstanding
    request per tag, reports for every EstablishP2P received). A twin master fed the same
    events checks determinism along the way."""

    MAX_PEERS = 7
    REPAIR = False  # the subclass below plays the same rules with ring repair on

    def __init__(self) -> None:
        super().__init__()
        self.st = MasterState(repair_rings=self.REPAIR, token_key=bytes(32))
        self.twin = MasterState(repair_rings=self.REPAIR, token_key=bytes(32))
        self.model: dict[int, _Peer] = {}
        self.next_pid = 1
        self.next_req = 1
        self.disconnected: set[int] = set()
        self.high_epoch = 0
        self.high_establish = 0
        self.high_op = 0
        self.op_keys: dict[int, tuple[int, int]] = {}
        self.mismatch_possible = False
        # (group, tag) whose waiting calls disagreed: a collective held for a repair is
        # checked (and refused) only when the repair ends, in a later event.
        self.mismatched: set[tuple[int, int]] = set()
        self.protocol_error_expected = False

    # --- plumbing ------------------------------------------------------------------------

    def feed(self, event: Event) -> list[Command]:
        before = set(self.st.peers)
        cmds = self.st.handle(event)
        assert self.twin.handle(event) == cmds, "the same events gave different commands"
        # The master's own look at a failed link: the accused does not answer either.
        for c in [c for c in cmds if isinstance(c, CheckReach)]:
            more = self.st.handle(ReachChecked(c.epoch, c.peer_id, False))
            assert self.twin.handle(ReachChecked(c.epoch, c.peer_id, False)) == more
            cmds = [*cmds, *more]
        cmds = [c for c in cmds if not isinstance(c, CheckReach)]
        after = set(self.st.peers)
        for cmd in cmds:
            if isinstance(cmd, Disconnect):
                assert cmd.peer_id in before and cmd.peer_id not in after, cmd
                assert cmd.peer_id not in self.disconnected, f"second {cmd}"
                self.disconnected.add(cmd.peer_id)
                del self.model[cmd.peer_id]
            else:
                assert cmd.peer_id in after, f"{cmd} targets a peer the master does not know"
                self.deliver(self.model[cmd.peer_id], cmd.msg)
        assert set(self.model) == after, "a peer vanished without a Disconnect"
        # A collective are_peers_pending() answers everyone at once, with one value.
        answers = {c.msg.pending for c in cmds
                   if isinstance(c, Send) and isinstance(c.msg, m.PendingAnswer)}
        assert len(answers) <= 1, cmds
        self.mismatch_possible = False
        self.protocol_error_expected = False
        return cmds

    def deliver(self, peer: _Peer, msg: m.Message) -> None:
        st = self.st
        if isinstance(msg, m.EstablishP2P):
            rnd = st.round
            assert rnd is not None and rnd.epoch == msg.epoch and peer.pid in rnd.members
            assert msg.epoch >= self.high_establish
            self.high_establish = msg.epoch
            ring = [p for p in rnd.members if st.peers[p].peer_group == peer.group]
            assert msg.ring == [] and ring == sorted(ring)
            i = ring.index(peer.pid)
            nxt = ring[(i + 1) % len(ring)] if len(ring) > 1 else -1
            assert msg.next_id == nxt
            assert msg.next_addr == (addr(nxt) if nxt >= 0 else "")
            assert msg.epoch not in peer.unanswered
            peer.unanswered[msg.epoch] = nxt
        elif isinstance(msg, m.WorldInfo):
            assert st.peers[peer.pid].status is PeerStatus.ACCEPTED
            sizes = st.group_sizes()
            # With repairs, the same event may also have started the next round.
            assert msg.epoch == st.epoch or self.REPAIR and msg.epoch < st.epoch
            # Exactly the group's accepted peers, in join order (the ring as built, minus
            # those gone since: nobody joins a ring without a round).
            group_now = [q for q in st.accepted() if st.peers[q].peer_group == peer.group]
            assert msg.ring == group_now
            assert msg.ring == [q for q in st.rings.get(peer.group, []) if q in st.peers]
            assert msg.global_world_size == len(st.accepted()) == sum(sizes.values())
            assert msg.peer_group_world_size == sizes[peer.group]
            assert msg.num_peer_groups == len(sizes)
            assert msg.largest_peer_group_world_size == max(sizes.values())
            peer.world = msg
        elif isinstance(msg, m.TopologyUpdated):
            assert st.peers[peer.pid].status is PeerStatus.ACCEPTED
            assert msg.epoch == st.ring_epochs[peer.group]
            assert msg.epoch == st.epoch or self.REPAIR and msg.epoch < st.epoch
            assert msg.epoch not in peer.unanswered, "round ended before this peer reported"
            if msg.repair:
                assert self.REPAIR and peer.accepted
            elif peer.accepted:
                assert peer.voting, "TopologyUpdated for a vote never cast"
                peer.voting = False
            else:
                assert not peer.voting
                peer.accepted = True
        elif isinstance(msg, m.TopologyUpdateFailed):
            assert peer.voting, "TopologyUpdateFailed for a vote never cast"
            peer.voting = False
        elif isinstance(msg, m.PendingAnswer):
            assert peer.asking == msg.req and msg.ok, msg
            peer.asking = 0
            assert msg.count == len(st.pending())
            assert msg.pending == (msg.count > 0 or bool(st.votes))
        elif isinstance(msg, m.ErrorReply):
            assert self.protocol_error_expected and msg.kind == "ProtocolError", (
                f"a well-behaved peer was refused: {msg}")
        elif isinstance(msg, m.CollectivePerform):
            call = peer.calls.get(msg.tag)
            assert call is not None and call.stage == "waiting", msg
            assert msg.op_id >= self.high_op
            self.high_op = msg.op_id
            key = (peer.group, msg.tag)
            assert self.op_keys.setdefault(msg.op_id, key) == key, "op id handed out twice"
            ring = st.rings[peer.group]
            assert msg.epoch == st.ring_epochs[peer.group]
            assert msg.world == len(ring) and ring[msg.rank] == peer.pid
            call.stage, call.op_id = "running", msg.op_id
        elif isinstance(msg, m.CollectiveAbort):
            call = peer.calls.get(msg.tag)
            assert call is not None and call.stage == "running" and call.op_id == msg.op_id
            call.aborted = True
        elif isinstance(msg, m.CollectiveOutcome):
            call = peer.calls.pop(msg.tag, None)
            assert call is not None, f"outcome for a collective peer {peer.pid} did not run"
            if msg.op_id < 0:
                assert call.stage == "waiting" and not msg.ok
                assert msg.kind in ("CollectiveAbortedError", "PeerConnectionError") or (
                    msg.kind == "InvalidUsageError" and (
                        self.mismatch_possible or (peer.group, msg.tag) in self.mismatched)), msg
            else:
                assert call.stage == "reported" and call.op_id == msg.op_id, (call, msg)
                assert not (msg.ok and call.aborted)
        else:
            raise AssertionError(f"unexpected message to a peer: {msg}")

    def calls_in(self, *stages: str) -> list[tuple[int, int]]:
        return sorted((p.pid, tag) for p in self.model.values()
                      for tag, c in p.calls.items() if c.stage in stages)

    def voters(self) -> list[int]:
        return sorted(p.pid for p in self.model.values()
                      if p.accepted and not p.voting and not p.calls and not p.asking)

    def callers(self) -> list[tuple[int, int]]:
        return sorted((p.pid, tag) for p in self.model.values() if p.accepted and not p.voting
                      for tag in range(3) if tag not in p.calls)

    def unanswered(self) -> list[tuple[int, int]]:
        return sorted((p.pid, ep) for p in self.model.values() for ep in p.unanswered)

    def current_unanswered(self) -> list[tuple[int, int]]:
        rnd = self.st.round
        return [(p, ep) for p, ep in self.unanswered() if rnd is not None and ep == rnd.epoch]

    # --- rules ---------------------------------------------------------------------------

    @precondition(lambda self: len(self.model) < self.MAX_PEERS)
    @rule(group=hs.integers(min_value=0, max_value=2))
    def register(self, group: int) -> None:
        pid = self.next_pid
        self.next_pid += 1
        self.model[pid] = _Peer(pid, group)
        self.feed(PeerRegistered(pid, group, addr(pid)))

    @initialize(groups=hs.lists(hs.integers(min_value=0, max_value=2), max_size=5),
                attempts=hs.integers(min_value=1, max_value=3))
    def bootstrap(self, groups: list[int], attempts: int) -> None:
        """Most runs start from an established population, so the rules below spend
        their steps on the interesting parts rather than on getting there."""
        assert not self.st.peers
        self.st = MasterState(max_establish_attempts=attempts, repair_rings=self.REPAIR,
                              token_key=bytes(32))
        self.twin = MasterState(max_establish_attempts=attempts, repair_rings=self.REPAIR,
                                token_key=bytes(32))
        for g in groups:
            self.register(g)
        self.settle()

    @precondition(lambda self: self.model)
    @rule(pick=PICK, graceful=hs.booleans())
    def depart(self, pick: int, graceful: bool) -> None:
        """A peer leaves (Leave message) or dies (the server reports it lost)."""
        pid = _pick(sorted(self.model), pick)
        was_accepted = self.model[pid].accepted
        event = Received(pid, m.Leave()) if graceful else PeerLost(pid, "heartbeat timeout")
        cmds = self.feed(event)
        assert cmds[0] == Disconnect(pid, TEXT)
        if was_accepted and self.st.phase is not Phase.ESTABLISH_P2P:
            # The others learn the new world at once (a round would tell them later).
            told = [c.peer_id for c in cmds if isinstance(c, Send)
                    and isinstance(c.msg, m.WorldInfo)]
            assert told == self.st.accepted()

    @precondition(lambda self: self.voters())
    @rule(pick=PICK)
    def vote(self, pick: int) -> None:
        pid = _pick(self.voters(), pick)
        self.model[pid].voting = True
        self.feed(Received(pid, m.UpdateTopology()))

    @precondition(lambda self: self.unanswered())
    @rule(pick=PICK, fail=hs.sampled_from([False, False, True]))
    def report_p2p(self, pick: int, fail: bool) -> None:
        pid, epoch = _pick(self.unanswered(), pick)
        nxt = self.model[pid].unanswered.pop(epoch)
        failed = []
        if fail and nxt >= 0:
            failed = [nxt]
        self.feed(Received(pid, m.P2PReport(epoch=epoch, failed=failed)))

    @precondition(lambda self: self.callers())
    @rule(pick=PICK, tag=hs.sampled_from([0, 0, 0, 1, 2]), count=hs.sampled_from([8, 8, 8, 9]))
    def init_collective(self, pick: int, tag: int, count: int) -> None:
        # Mostly tag 0, so that group mates often meet on the same collective.
        pairs = [pt for pt in self.callers() if pt[1] == tag] or self.callers()
        self._init(*_pick(pairs, pick), count)

    def _init(self, pid: int, tag: int, count: int) -> None:
        if pid not in self.model or tag in self.model[pid].calls:
            return  # gone or busy since the caller looked
        group = self.model[pid].group
        counts = {count} | {q.calls[tag].count for q in self.model.values()
                            if q.group == group and tag in q.calls
                            and q.calls[tag].stage == "waiting"}
        self.mismatch_possible = len(counts) > 1
        if self.mismatch_possible:
            self.mismatched.add((group, tag))
        self.model[pid].calls[tag] = _Call(count, "waiting")
        self.feed(Received(pid, coll_init(tag, count=count)))

    # The three rules below move many peers at once, the way a training loop does (every
    # peer calls update_topology() or all_reduce() in the same iteration); the single-peer
    # rules around them provide the races.

    @precondition(lambda self: self.voters())
    @rule()
    def everyone_votes(self) -> None:
        for pid in self.voters():
            if pid in self.voters():  # an earlier vote may have settled things already
                self.vote(self.voters().index(pid))

    @precondition(lambda self: self.current_unanswered())
    @rule(failing=hs.sampled_from([None, None, 0, 1, 2]))
    def everyone_reports(self, failing: int | None) -> None:
        """Every member of the running round reports; member ``failing`` (if any) could
        not reach its successor."""
        for i, (pid, epoch) in enumerate(self.current_unanswered()):
            if (pid, epoch) in self.unanswered():
                self.report_p2p(self.unanswered().index((pid, epoch)), i == failing)

    @precondition(lambda self: self.callers())
    @rule(pick=PICK, tag=hs.sampled_from([0, 0, 1, 2]), odd=hs.sampled_from([False, False, True]))
    def group_reduces(self, pick: int, tag: int, odd: bool) -> None:
        """Every free peer of one group asks for collective ``tag``; with ``odd`` the last
        one disagrees on the size."""
        group = self.model[_pick(self.callers(), pick)[0]].group
        pids = [pid for pid, t in self.callers() if t == tag and self.model[pid].group == group]
        for i, pid in enumerate(pids):
            self._init(pid, tag, 9 if odd and i == len(pids) - 1 else 8)

    @precondition(lambda self: self.calls_in("running"))
    @rule(pick=PICK, ok=hs.sampled_from([True, True, True, False]))
    def finish_collective(self, pick: int, ok: bool) -> None:
        pid, tag = _pick(self.calls_in("running"), pick)
        call = self.model[pid].calls[tag]
        ok = ok and not call.aborted
        call.stage = "reported"
        self.feed(Received(pid, done(tag, call.op_id, ok=ok,
                                     kind="" if ok else "PeerConnectionError",
                                     message="" if ok else "link broke")))

    @precondition(lambda self: self.calls_in("waiting"))
    @rule(pick=PICK)
    def withdraw_collective(self, pick: int) -> None:
        pid, tag = _pick(self.calls_in("waiting"), pick)
        del self.model[pid].calls[tag]  # the withdrawing peer hears nothing back
        self.feed(Received(pid, done(tag, -1, ok=False, kind="CollectiveAbortedError",
                                     message="cancelled")))

    @precondition(lambda self: self.calls_in("running"))
    @rule(pick=PICK)
    def cancel_running_collective(self, pick: int) -> None:
        """Cancelled while the perform was on its way: the client still says op -1."""
        pid, tag = _pick(self.calls_in("running"), pick)
        self.model[pid].calls[tag].stage = "reported"
        self.feed(Received(pid, done(tag, -1, ok=False, kind="CollectiveAbortedError",
                                     message="cancelled")))

    @precondition(lambda self: any(p.accepted for p in self.model.values()))
    @rule(pick=PICK)
    def ask_pending(self, pick: int) -> None:
        askers = sorted(p.pid for p in self.model.values()
                        if p.accepted and not p.voting and not p.asking)
        if not askers:
            return
        pid = _pick(askers, pick)
        req = self.next_req
        self.next_req += 1
        self.model[pid].asking = req
        self.feed(Received(pid, m.PendingQuery(req=req)))

    @precondition(lambda self: self.model)
    @rule(pick=PICK, pong=hs.booleans())
    def stray_message(self, pick: int, pong: bool) -> None:
        pid = _pick(sorted(self.model), pick)
        if pong:
            assert self.feed(Received(pid, m.Pong(seq=pick))) == []
        else:
            self.protocol_error_expected = True
            assert self.feed(Received(pid, m.Ping(seq=pick))) == [
                Send(pid, error("ProtocolError"))]

    # --- invariants ----------------------------------------------------------------------

    @invariant()
    def membership_matches_the_peers_view(self) -> None:
        st = self.st
        assert set(st.peers) == set(self.model)
        for pid, rec in st.peers.items():
            assert rec.status in (PeerStatus.REGISTERED, PeerStatus.ACCEPTED)
            assert (rec.status is PeerStatus.ACCEPTED) == self.model[pid].accepted
            assert rec.peer_group == self.model[pid].group
        assert not set(st.peers) & self.disconnected

    @invariant()
    def phase_is_consistent(self) -> None:
        st = self.st
        assert (st.phase is Phase.ESTABLISH_P2P) == (st.round is not None)
        if st.phase is Phase.IDLE:
            assert not st.votes
        assert st.votes <= set(st.accepted())
        assert st.votes == {p.pid for p in self.model.values() if p.voting}
        assert {p: r for p, r in st.pending_votes.items()} == {
            p.pid: p.asking for p in self.model.values() if p.asking}
        if st.round is not None:
            assert st.round.epoch == st.epoch
            assert set(st.round.members) <= set(st.peers)
            if not st.round.repair:
                assert set(st.accepted()) <= set(st.round.members)
            assert st.round.reported <= set(st.round.members)
            assert st.round.member_set == set(st.round.members)
        for sync in st.syncs.values():
            assert sync.participant_set == set(sync.participants)

    @invariant()
    def settled_rings_hold_every_accepted_peer(self) -> None:
        st = self.st
        if st.phase is Phase.IDLE and not st.rings_stale:
            for g in st.group_sizes():
                members = [p for p in st.accepted() if st.peers[p].peer_group == g]
                # Exactly the group's accepted peers, in join order.
                assert st.rings.get(g) == members, (g, members, st.rings)

    @invariant()
    def epochs_never_decrease(self) -> None:
        st = self.st
        assert st.epoch >= self.high_epoch
        self.high_epoch = st.epoch
        assert st.ring_epoch <= st.epoch

    @invariant()
    def collectives_match_the_callers(self) -> None:
        st = self.st
        for (g, tag), col in st.collectives.items():
            assert (col.group, col.tag) == (g, tag)
            members = {p for p in st.accepted() if st.peers[p].peer_group == g}
            assert col.participant_set == set(col.participants)  # the cached set
            if col.op_id < 0:
                assert col.inits and set(col.inits) <= members and not col.participants
            else:
                assert set(col.participants) <= members
                assert col.reported <= set(col.participants)
        voting_groups = {st.peers[v].peer_group for v in st.votes}
        for p in self.model.values():
            for tag, call in p.calls.items():
                # Nobody waits for a group mate that is busy voting: that would never end.
                assert call.stage != "waiting" or p.group not in voting_groups, (p.pid, tag)
                col = st.collectives.get((p.group, tag))
                assert col is not None, (p.pid, tag, call)
                if call.stage == "waiting":
                    assert col.op_id < 0 and p.pid in col.inits
                else:
                    assert col.op_id == call.op_id and p.pid in col.participants
                    assert (p.pid in col.reported) == (call.stage == "reported")

    # --- settling: every peer finishes what it started --------------------------------------

    def settle(self) -> None:
        """Cancels waiting collectives, finishes running ones, answers every EstablishP2P
        and votes until joiners are in and the rings are fresh (or nothing is left to do)."""
        st = self.st
        for _ in range(300):
            if self.calls_in("waiting"):
                # Calls that wait for group mates who will never join in are cancelled.
                self.withdraw_collective(0)
            elif self.calls_in("running"):
                self.finish_collective(0, True)
            elif self.unanswered():
                self.report_p2p(0, False)
            elif any(p.asking for p in self.model.values()) and any(
                    p.accepted and not p.asking and not p.voting for p in self.model.values()):
                # Everyone else asks too, as a training loop's are_peers_pending() does.
                self.ask_pending(0)
            elif (st.pending() or st.rings_stale or st.phase is Phase.VOTE_ACCEPT_NEW_PEERS) \
                    and st.phase is not Phase.ESTABLISH_P2P and self.voters():
                self.vote(0)
            else:
                return
            self.membership_matches_the_peers_view()
            self.phase_is_consistent()
            self.settled_rings_hold_every_accepted_peer()
            self.epochs_never_decrease()
            self.collectives_match_the_callers()
        raise AssertionError("the population did not settle")

    def teardown(self) -> None:
        st = self.st
        self.settle()
        assert st.phase is Phase.IDLE and st.round is None and not st.votes
        assert not st.pending(), "joiners left waiting with nobody to vote them in"
        assert not st.collectives and not self.calls_in("waiting", "running", "reported")
        if not st.peers:
            return
        assert not st.rings_stale
        by_group: dict[int, list[int]] = {}
        for p in st.accepted():
            by_group.setdefault(st.peers[p].peer_group, []).append(p)
        assert st.rings == by_group
        sizes = st.group_sizes()
        for p in self.model.values():
            # A repair tells only the repaired groups (with the epoch of its round).
            epoch = p.world.epoch if self.REPAIR and p.world is not None else st.epoch
            assert p.world == world(epoch, by_group[p.group], len(st.peers), sizes[p.group],
                                    len(sizes), max(sizes.values()))


TestMasterPopulation = MasterPopulation.TestCase
TestMasterPopulation.settings = settings(max_examples=150, stateful_step_count=40,
                                         deadline=None)


class RepairingPopulation(MasterPopulation):
    REPAIR = True


TestRepairingPopulation = RepairingPopulation.TestCase
TestRepairingPopulation.settings = settings(max_examples=150, stateful_step_count=40,
                                            deadline=None)


# --- shared-state sync ----------------------------------------------------------------


def sync_init(revision: int, hash_: bytes, strategy: int = 0) -> m.SyncInit:
    return m.SyncInit(revision=revision, strategy=strategy, keys=["w"], dtypes=[1],
                      counts=[4], hashes=[hash_], unequal=[False])


def sync_outcomes(cmds: list[Command]) -> list[Command]:
    return [c for c in cmds if isinstance(c, Send) and isinstance(c.msg, m.SyncOutcome)]


def planned3() -> MasterState:
    """Peers 1 and 2 hold content A of key "w", peer 3 is a RECEIVE_ONLY joiner told to
    fetch it from 1, then 2."""
    st = run_with([0, 0, 0])
    tell(st, 1, sync_init(1, b"A" * 16))
    tell(st, 2, sync_init(1, b"A" * 16))
    cmds = tell(st, 3, sync_init(0, b"", strategy=1))
    plans = {c.peer_id: c.msg for c in cmds if isinstance(c, Send)}
    assert plans[3].fetch_keys == ["w"] and sorted(plans[3].fetch_sources[0]) == [1, 2]
    assert plans[1].fetch_keys == [] and plans[2].fetch_keys == []
    return st


def test_source_lost_mid_sync_lets_the_rest_finish_from_another_source() -> None:
    st = planned3()
    # No outcome yet: peer 3 may still fetch from peer 2.
    assert not sync_outcomes(lose(st, 1))
    tell(st, 2, m.SyncDone(ok=True, kind="", message=""))
    cmds = tell(st, 3, m.SyncDone(ok=True, kind="", message=""))
    assert cmds == [Send(p, m.SyncOutcome(ok=True, kind="", message="", revision=1))
                    for p in (2, 3)]
    assert st.last_revision[2] == st.last_revision[3] == 1 and not st.syncs


def test_fetcher_failing_after_its_source_was_lost_fails_the_sync_for_all() -> None:
    st = planned3()
    lose(st, 1)
    tell(st, 3, m.SyncDone(ok=False, kind="PeerConnectionError", message="no source"))
    cmds = tell(st, 2, m.SyncDone(ok=True, kind="", message=""))
    assert cmds == [Send(p, m.SyncOutcome(ok=False, kind="PeerConnectionError",
                                          message=TEXT, revision=1)) for p in (2, 3)]
    assert 3 not in st.last_revision or st.last_revision[3] != 1


def test_last_pending_report_lost_finishes_the_sync() -> None:
    st = planned3()
    tell(st, 1, m.SyncDone(ok=True, kind="", message=""))
    tell(st, 2, m.SyncDone(ok=True, kind="", message=""))
    cmds = sync_outcomes(lose(st, 3))  # the fetcher itself dies: the sources are done
    assert cmds == [Send(p, m.SyncOutcome(ok=True, kind="", message="", revision=1))
                    for p in (1, 2)]


WITHDRAWN = "peer {} cancelled its sync_shared_state(); nothing was committed, retry"


def test_withdrawal_before_the_plan_calls_the_sync_off_for_those_waiting() -> None:
    st = run_with([0, 0, 0])
    tell(st, 1, sync_init(1, b"A" * 16))
    tell(st, 2, sync_init(1, b"A" * 16))
    cmds = tell(st, 2, m.SyncWithdraw())
    assert cmds == [Send(p, m.SyncOutcome(ok=False, kind="CollectiveAbortedError",
                                          message=WITHDRAWN.format(2), revision=0))
                    for p in (1, 2)]
    assert not st.syncs
    # Peer 3 was not in it; the next sync starts afresh.
    assert not tell(st, 3, m.SyncWithdraw())
    tell(st, 1, sync_init(1, b"A" * 16))
    tell(st, 2, sync_init(1, b"A" * 16))
    assert len(sync_plans(tell(st, 3, sync_init(1, b"A" * 16)))) == 3


def sync_plans(cmds: list[Command]) -> list[Command]:
    return [c for c in cmds if isinstance(c, Send) and isinstance(c.msg, m.SyncPlan)]


def test_withdrawal_after_reporting_fails_the_sync_at_once_for_every_participant() -> None:
    st = run_with([0, 0, 0, 0])
    tell(st, 1, sync_init(1, b"A" * 16))
    tell(st, 2, sync_init(1, b"A" * 16))
    tell(st, 3, sync_init(0, b"", strategy=1))
    other_size = dataclasses.replace(sync_init(1, b"B" * 16), counts=[8])
    cmds = tell(st, 4, other_size)  # refused at the plan: not a participant
    assert [c.peer_id for c in sync_outcomes(cmds)] == [4]
    tell(st, 1, m.SyncDone(ok=True, kind="", message=""))
    # Peer 1 reported success, then its caller cancelled; peer 3 is still fetching.
    cmds = tell(st, 1, m.SyncWithdraw())
    assert cmds == [Send(p, m.SyncOutcome(ok=False, kind="CollectiveAbortedError",
                                          message=WITHDRAWN.format(1), revision=0))
                    for p in (1, 2, 3)]
    assert not st.syncs and 1 not in st.last_revision
    # The late report of the fetcher is stale.
    assert not tell(st, 3, m.SyncDone(ok=True, kind="", message=""))


def test_withdrawal_after_the_outcome_is_stale() -> None:
    st = planned3()
    for p in (1, 2, 3):
        cmds = tell(st, p, m.SyncDone(ok=True, kind="", message=""))
    assert len(sync_outcomes(cmds)) == 3
    # Its success outcome is already on the way: the peer commits it.
    assert not tell(st, 3, m.SyncWithdraw())
    assert st.last_revision[3] == 1


# --- liveness (issue 16): collective are_peers_pending(), ring repair, deadlines, joiners --


def sends(cmds: list[Command], kind: type[m.Message]) -> list[tuple[int, m.Message]]:
    return [(c.peer_id, c.msg) for c in cmds if isinstance(c, Send) and isinstance(c.msg, kind)]


def test_are_peers_pending_is_answered_to_every_asker_at_once_with_one_value() -> None:
    """Regression for issue 16, item 1: B asked before C knocked, A after; with a per-peer
    answer B heard False and A True, and they branched apart for good."""
    st = run_with([0, 0])
    assert tell(st, 2, m.PendingQuery(req=5)) == []  # B asks first: it waits for A
    join(st, 3)  # C knocks meanwhile
    assert tell(st, 1, m.PendingQuery(req=9)) == [
        Send(1, m.PendingAnswer(req=9, pending=True, count=1)),
        Send(2, m.PendingAnswer(req=5, pending=True, count=1))]
    # Both now take the same branch: update_topology() admits C.
    vote(st, 1)
    vote(st, 2)
    report_all(st)
    assert st.accepted() == [1, 2, 3]


def test_pending_hint_is_answered_at_once_and_a_lost_peer_completes_the_question() -> None:
    st = run_with([0, 0, 0])
    assert tell(st, 1, m.PendingQuery(req=1, collective=False)) == [
        Send(1, m.PendingAnswer(req=1, pending=False, count=0))]
    assert tell(st, 1, m.PendingQuery(req=2)) == []
    assert tell(st, 2, m.PendingQuery(req=3)) == []
    out = lose(st, 3)  # the one that never asked dies: the others hear at once
    assert sends(out, m.PendingAnswer) == [(1, m.PendingAnswer(req=2, pending=False)),
                                          (2, m.PendingAnswer(req=3, pending=False))]


def test_askers_hear_true_while_others_vote_for_a_topology_update() -> None:
    st = run_with([0, 0, 0])
    join(st, 4)
    assert tell(st, 1, m.PendingQuery(req=1)) == []
    assert vote(st, 2) == []  # B already decided to update: A must not wait for B's question
    out = tell(st, 3, m.PendingQuery(req=2))
    assert sends(out, m.PendingAnswer) == [(1, m.PendingAnswer(req=1, pending=True, count=1)),
                                          (3, m.PendingAnswer(req=2, pending=True, count=1))]
    vote(st, 1)
    assert sends(vote(st, 3), m.EstablishP2P)  # everybody voted: the round starts


def test_a_lost_peer_is_dropped_from_the_ring_without_a_vote() -> None:
    """Regression for issue 16, item 2: survivors relaunch a failed reduce without calling
    update_topology(); the master rebuilds the ring and runs the relaunch on it."""
    st = performed3()
    out = lose(st, 3)
    # The running collective fails for the survivors...
    assert sends(out, m.CollectiveAbort) == [(1, m.CollectiveAbort(tag=0, op_id=1, message=TEXT)),
                                            (2, m.CollectiveAbort(tag=0, op_id=1, message=TEXT))]
    assert not sends(out, m.EstablishP2P)  # ...and the ring is not touched while it runs
    tell(st, 1, done(0, 1, ok=False, kind="PeerConnectionError", message="x"))
    out = tell(st, 2, done(0, 1, ok=False, kind="PeerConnectionError", message="x"))
    assert [p for p, msg in sends(out, m.CollectiveOutcome)] == [1, 2]
    # Once nothing runs on the ring, the master rebuilds it from the survivors.
    assert sends(out, m.EstablishP2P) == [(c.peer_id, c.msg) for c in establish(3, [1, 2])
                                          if isinstance(c, Send)]
    assert st.round is not None and st.round.repair
    # A relaunch called while the repair runs waits for it, then runs on the new ring.
    assert tell(st, 1, coll_init(0)) == []
    assert tell(st, 2, coll_init(0)) == []
    report(st, 1, 3)
    out = report(st, 2, 3)
    assert sends(out, m.TopologyUpdated) == [(1, m.TopologyUpdated(epoch=3, repair=True)),
                                            (2, m.TopologyUpdated(epoch=3, repair=True))]
    assert sends(out, m.CollectivePerform) == [
        (1, m.CollectivePerform(tag=0, op_id=2, epoch=3, rank=0, world=2)),
        (2, m.CollectivePerform(tag=0, op_id=2, epoch=3, rank=1, world=2))]
    assert st.accepted() == [1, 2] and st.rings == {0: [1, 2]}


def test_a_collective_waiting_for_a_peer_that_dies_runs_without_it() -> None:
    st = run_with([0, 0, 0])
    tell(st, 1, coll_init(4))
    tell(st, 2, coll_init(4))
    out = lose(st, 3)
    assert not sends(out, m.CollectiveOutcome)  # not failed: held for the repair
    out = report_all(st)
    assert [p for p, _ in sends(out, m.CollectivePerform)] == [1, 2]
    assert st.collectives[(0, 4)].op_id == 1 and st.collectives[(0, 4)].participants == [1, 2]


def test_votes_cast_during_a_repair_are_counted_when_it_ends() -> None:
    st = run_with([0, 0, 0])
    join(st, 4)
    lose(st, 3)
    assert st.round is not None and st.round.repair
    assert vote(st, 1) == []
    assert vote(st, 2) == []
    out = report_all(st)  # the repair ends; the vote is complete: a full round admits 4
    assert sends(out, m.TopologyUpdated) == [(1, m.TopologyUpdated(epoch=3, repair=True)),
                                            (2, m.TopologyUpdated(epoch=3, repair=True))]
    assert [p for p, _ in sends(out, m.EstablishP2P)] == [1, 2, 4]
    out = report_all(st)
    assert [p for p, _ in sends(out, m.TopologyUpdated)] == [1, 2, 4]
    assert st.accepted() == [1, 2, 4] and not st.votes


def test_failed_repair_fails_what_waited_and_later_calls_fast() -> None:
    st = run_with([0, 0, 0, 0], max_establish_attempts=1)
    lose(st, 4)
    tell(st, 1, coll_init(0))
    tell(st, 2, coll_init(0))
    tell(st, 3, coll_init(0))
    out = report(st, 1, 3, failed=[2]) + report(st, 2, 3) + report(st, 3, 3)
    assert sorted((p, msg.kind) for p, msg in sends(out, m.CollectiveOutcome)) == [
        (1, "PeerConnectionError"), (3, "PeerConnectionError")]
    assert st.repair_failed == {0} and st.round is None
    assert sends(tell(st, 1, coll_init(1)), m.CollectiveOutcome)[0][1].kind == \
        "PeerConnectionError"  # fails fast until update_topology() succeeds
    vote(st, 1)
    vote(st, 3)
    report_all(st)
    assert st.repair_failed == set() and st.rings == {0: [1, 3]}


def test_collective_deadline_calls_it_off_for_everyone_who_joined() -> None:
    """A live peer that never calls the collective must not hang the others."""
    st = run_with([0, 0, 0])
    out = tell(st, 1, m.CollectiveInit(tag=2, kind="all_reduce", dtype=1, count=4, op=0,
                                       quant_algorithm=0, quant_dtype=0, timeout=30.0))
    [arm] = [c for c in out if isinstance(c, ArmDeadline)]
    assert arm.seconds == 30.0 and arm.deadline_id in st.deadlines
    tell(st, 2, coll_init(2))
    out = st.handle(DeadlineExpired(arm.deadline_id))
    assert [(p, msg.kind) for p, msg in sends(out, m.CollectiveOutcome)] == [
        (1, "OperationTimeoutError"), (2, "OperationTimeoutError")]
    assert "[3]" in sends(out, m.CollectiveOutcome)[0][1].message  # names the late peer
    assert st.collectives == {} and st.deadlines == {}
    # A retry works: everybody calls it this time.
    for p in (1, 2):
        tell(st, p, coll_init(2))
    assert len(sends(tell(st, 3, coll_init(2)), m.CollectivePerform)) == 3


def test_deadline_of_a_collective_that_ran_is_dropped() -> None:
    st = run_with([0, 0])
    out = tell(st, 1, dataclasses.replace(coll_init(0), timeout=5.0))
    [arm] = [c for c in out if isinstance(c, ArmDeadline)]
    tell(st, 2, coll_init(0))
    assert arm.deadline_id not in st.deadlines
    assert st.handle(DeadlineExpired(arm.deadline_id)) == []  # stale: nothing happens


@pytest.mark.parametrize("what", ["sync", "vote", "pending", "optimize"])
def test_every_wait_for_other_peers_has_a_deadline(what: str) -> None:
    st = run_with([0, 0, 0])
    msg: m.Message = {
        "sync": dataclasses.replace(sync_init(1, b"h"), timeout=9.0),
        "vote": m.UpdateTopology(timeout=9.0),
        "pending": m.PendingQuery(req=1, timeout=9.0),
        "optimize": m.OptimizeTopology(timeout=9.0),
    }[what]
    out = tell(st, 1, msg) + tell(st, 2, msg if what != "pending" else
                                  m.PendingQuery(req=2, timeout=9.0))
    [arm] = [c for c in out if isinstance(c, ArmDeadline)]
    out = st.handle(DeadlineExpired(arm.deadline_id))
    told = {c.peer_id: c.msg for c in out if isinstance(c, Send)}
    assert sorted(told) == [1, 2]
    for reply in told.values():
        if isinstance(reply, m.OptimizeFailed):
            assert "[3]" in reply.message
        else:
            assert reply.kind == "OperationTimeoutError", reply  # type: ignore[attr-defined]
            assert "[3]" in reply.message  # type: ignore[attr-defined]
    assert st.phase is Phase.IDLE and not st.votes and not st.pending_votes
    assert not st.syncs and not st.opt_votes


def test_fresh_joiners_do_not_outvote_a_peer_that_synced() -> None:
    """Regression for issue 16, item 4: A trained alone to revision 20; B and C join with
    their step-0 state and all sync with ENFORCE_POPULAR. A must not be rolled back."""
    st = run_with([0])
    for rev in range(1, 21):
        tell(st, 1, sync_init(rev, b"a%d" % rev))
        tell(st, 1, m.SyncDone(ok=True, kind="", message=""))
    assert st.last_revision == {1: 20}
    for p in (2, 3):
        join(st, p)
    vote(st, 1)
    report_all(st)
    tell(st, 1, sync_init(21, b"a21"))
    tell(st, 2, sync_init(0, b"fresh"))
    out = tell(st, 3, sync_init(0, b"fresh"))
    plans = dict(sends(out, m.SyncPlan))
    assert plans[1].fetch_keys == [] and plans[1].revision == 21  # type: ignore[attr-defined]
    for p in (2, 3):
        assert plans[p].fetch_keys == ["w"]  # type: ignore[attr-defined]
        assert plans[p].fetch_hashes == [b"a21"]  # type: ignore[attr-defined]
        assert plans[p].fetch_sources == [[1]]  # type: ignore[attr-defined]


def test_cold_start_keeps_the_popularity_rule() -> None:
    st = run_with([0, 0, 0])
    tell(st, 1, sync_init(0, b"x"))
    tell(st, 2, sync_init(0, b"y"))
    plans = dict(sends(tell(st, 3, sync_init(0, b"y")), m.SyncPlan))
    assert plans[1].fetch_hashes == [b"y"]  # type: ignore[attr-defined]


def admitted_joiner() -> MasterState:
    """Peers 1 and 2 ask are_peers_pending(), hear True and admit joiner 3."""
    st = run_with([0, 0])
    join(st, 3)
    for p in (1, 2):
        tell(st, p, m.PendingQuery(req=p))
    vote(st, 1)
    vote(st, 2)
    report_all(st)
    assert st.accepted() == [1, 2, 3]
    return st


def test_a_question_meets_peers_that_already_wait_for_the_asker_in_a_collective() -> None:
    """A loop that starts with are_peers_pending(): a joiner's first question comes while
    the members, past their update_topology(), already wait for it in a reduce (or a
    sync). The question is answered (the members never ask it this iteration) and the
    joiner goes on to meet them."""
    for second in (coll_init(0), sync_init(1, b"h")):
        st = admitted_joiner()
        first = coll_init(0) if isinstance(second, m.CollectiveInit) else sync_init(1, b"h")
        tell(st, 1, first)
        assert tell(st, 3, m.PendingQuery(req=7)) == []  # 2 has not said what it does yet
        out = tell(st, 2, second)  # 2 waits for the joiner too: everyone else is parked
        assert sends(out, m.PendingAnswer) == [(3, m.PendingAnswer(req=7, pending=False))]


def test_a_question_waits_for_a_member_parked_in_a_collective_of_an_older_asker() -> None:
    """PCCL's cross-step loop: each peer asks are_peers_pending() from its main thread
    while its reduce thread still runs the previous step. A member parked in a collective
    that waits for an asker that is not a fresh joiner is not an answer: the asker's
    other thread will join that collective, and the parked member asks next. Answering
    early would pair its question with the asker's next one, and their loops would part
    (one in a sync, the other in a reduce, waiting for each other)."""
    st = run_with([0, 0])
    reduce_once(st, [1, 2])  # both have been training: neither is a fresh joiner
    assert tell(st, 1, m.PendingQuery(req=1)) == []
    assert tell(st, 2, coll_init(8)) == []  # 2's reduce thread waits for 1's tag 8
    join(st, 3)  # somebody knocks meanwhile
    assert sends(tell(st, 1, coll_init(8)), m.PendingAnswer) == []  # 1's thread delivers
    assert sends(tell(st, 2, m.PendingQuery(req=2)), m.PendingAnswer) == [
        (1, m.PendingAnswer(req=1, pending=True, count=1)),
        (2, m.PendingAnswer(req=2, pending=True, count=1))]


def reduce_once(st: MasterState, peers: list[int], tag: int = 99) -> None:
    """One successful collective of ``peers`` (the whole group)."""
    out: list[Command] = []
    for p in peers:
        out += tell(st, p, coll_init(tag))
    (op_id,) = {msg.op_id for _, msg in sends(out, m.CollectivePerform)}
    for p in peers:
        tell(st, p, done(tag, op_id))
    assert not st.collectives


def test_a_voter_back_at_the_question_meets_a_member_parked_in_a_reduce() -> None:
    """A single-threaded loop whose step failed on one peer only (its sync lost a
    source): that peer calls update_topology() from its error handling, the other
    joins it through are_peers_pending() and goes on to the reduce, and the first goes
    back to the top of its loop, the question. Both are fresh out of the round: the
    question is answered (the parked peer never asks it) and the loops meet again."""
    st = run_with([0, 0])
    reduce_once(st, [1, 2])
    vote(st, 1)  # 1's error handling
    assert sends(tell(st, 2, m.PendingQuery(req=5)), m.PendingAnswer) == [
        (2, m.PendingAnswer(req=5, pending=True))]
    vote(st, 2)  # nothing changed: no round, both hear TopologyUpdated at once
    tell(st, 2, coll_init(0))  # 2 goes on to the step's reduce
    assert sends(tell(st, 1, m.PendingQuery(req=6)), m.PendingAnswer) == [
        (1, m.PendingAnswer(req=6, pending=False))]


def test_a_joiner_is_fresh_only_until_its_first_operation() -> None:
    """Once the joiner made a call of its own, a question of it is an ordinary one."""
    st = admitted_joiner()
    for p in (1, 2, 3):
        tell(st, p, sync_init(1 if p != 3 else 0, b"h"))
    assert 3 not in st.fresh
    tell(st, 1, coll_init(0))
    tell(st, 2, coll_init(0))
    assert tell(st, 3, m.PendingQuery(req=7)) == []  # 1 and 2 wait for it: no answer


def test_a_question_asked_again_replaces_the_abandoned_one() -> None:
    st = run_with([0, 0])
    assert tell(st, 1, m.PendingQuery(req=1)) == []  # its caller gives up (cancelled)
    assert tell(st, 1, m.PendingQuery(req=2)) == []
    assert sends(tell(st, 2, m.PendingQuery(req=3)), m.PendingAnswer) == [
        (1, m.PendingAnswer(req=2, pending=False)), (2, m.PendingAnswer(req=3, pending=False))]


def test_askers_are_answered_when_a_failed_repair_drops_the_last_one_missing() -> None:
    # Regression (found by RepairingPopulation): every remaining member asked
    # are_peers_pending() while a repair ran; the repair failed and dropped the one
    # member that had not asked, and nothing answered the askers: the run hung with a
    # joiner waiting.
    st = run_with([0, 0, 0, 0], repair_rings=True, max_establish_attempts=1)
    lose(st, 3)
    rnd = st.round
    assert rnd is not None and rnd.repair and rnd.members == [1, 2, 4]
    join(st, 5)
    assert tell(st, 2, m.PendingQuery(req=1)) == []
    assert tell(st, 4, m.PendingQuery(req=2)) == []
    report(st, 1, rnd.epoch)
    report(st, 2, rnd.epoch)
    out = report(st, 4, rnd.epoch, failed=[1])  # 1 unreachable: dropped, repair fails
    assert st.accepted() == [2, 4] and st.phase is Phase.IDLE
    assert [c for c in out if isinstance(c, Send) and isinstance(c.msg, m.PendingAnswer)] == [
        Send(2, m.PendingAnswer(req=1, pending=True, count=1)),
        Send(4, m.PendingAnswer(req=2, pending=True, count=1))]


def test_a_pair_whose_hole_punching_failed_is_relayed_at_once_next_time() -> None:
    st = MasterState(mesh_max_bytes=0, token_key=bytes(32))
    st.handle(PeerRegistered(1, 0, addr(1), reachable=False))
    report_all(st)  # admitted alone
    st.handle(PeerRegistered(2, 0, addr(2), reachable=False))
    vote(st, 1)
    assert st.paths == {(1, 2): "punch", (2, 1): "punch"}
    token_12 = next(t for t, pair in st.relay_tokens.items() if pair == (1, 2))
    assert st.handle(Relayed(token_12)) == []  # the server saw 1 -> 2 fall back
    assert st.punch_failed == {(1, 2)}
    # What the status page and /api/status show: the link runs through the relay now.
    assert st.links_now() == {(1, 2): "relay", (2, 1): "punch"}
    report_all(st)
    st.handle(PeerRegistered(3, 0, addr(3)))  # dialable: the next round rebuilds
    out = vote(st, 1) + vote(st, 2)
    sent = {c.peer_id: c.msg for c in out
            if isinstance(c, Send) and isinstance(c.msg, m.EstablishP2P)}
    assert sent[1].route == "relay" and sent[2].prev_route == "relay"  # no second punch
    assert sent[2].route == "direct" and sent[3].route == "reverse"
    lose(st, 2)
    assert st.punch_failed == set()


# --- peers behind the same NAT ------------------------------------------------------------


def lan_addr(pid: int) -> str:
    return f"192.168.1.{pid}:{7000 + pid}"


def behind_nat(st: MasterState, pid: int, public: str = "203.0.113.7", lan: bool = True,
               allow_relay: bool = True) -> list[Command]:
    """``pid`` registers from behind a NAT whose public address is ``public``, saying
    where it listens on its LAN (``lan``)."""
    return st.handle(PeerRegistered(pid, 0, addr(pid), reachable=False,
                                    allow_relay=allow_relay, public_host=public,
                                    lan_addrs=(lan_addr(pid),) if lan else ()))


def nat_pair(public2: str = "203.0.113.7", lan: bool = True, allow_relay: bool = True,
             **kwargs: object) -> tuple[MasterState, dict[int, m.EstablishP2P]]:
    """Peer 1 (admitted alone) and peer 2 behind NAT, 1 voted: the round's messages."""
    st = MasterState(**{"mesh_max_bytes": 0, "token_key": bytes(32), **kwargs})  # type: ignore[arg-type]
    behind_nat(st, 1, allow_relay=allow_relay)
    report_all(st)
    behind_nat(st, 2, public2, lan=lan, allow_relay=allow_relay)
    return st, establishes(vote(st, 1))


def test_two_peers_behind_one_nat_dial_each_other_on_their_lan() -> None:
    st, sent = nat_pair()
    assert st.paths == {(1, 2): "lan", (2, 1): "lan"}
    assert st.links_now() == {(1, 2): "lan", (2, 1): "lan"}
    # On the wire a plain direct route, to the receiver's private address.
    assert (sent[1].route, sent[1].next_addr, sent[1].token) == ("direct", lan_addr(2), b"")
    assert (sent[2].route, sent[2].next_addr, sent[2].token) == ("direct", lan_addr(1), b"")
    assert (sent[1].prev_route, sent[2].prev_route) == ("direct", "direct")
    assert st.relay_tokens == {}  # nothing to splice
    report_all(st)
    assert st.accepted() == [1, 2] and st.rings == {0: [1, 2]}


def test_peers_behind_different_nats_punch_as_before() -> None:
    st, sent = nat_pair(public2="198.51.100.9")
    assert st.paths == {(1, 2): "punch", (2, 1): "punch"}
    assert (sent[1].route, sent[1].next_addr) == ("punch", addr(2))
    # The same public host but no LAN address said (an older peer): punch too.
    st, sent = nat_pair(lan=False)
    assert st.paths == {(1, 2): "punch", (2, 1): "lan"}
    assert (sent[1].route, sent[2].route) == ("punch", "direct")


def test_a_failed_lan_dial_drops_nobody_and_the_round_punches_then_relays() -> None:
    st, sent = nat_pair()
    epoch = st.round.epoch
    report(st, 1, epoch, failed=[2])  # 1 could not dial 2 on the LAN
    out = report(st, 2, epoch)
    assert not [c for c in out if isinstance(c, Disconnect)]
    assert st.lan_failed == {(1, 2)}
    # Tried again at once, not counted as an attempt, 1 -> 2 over the public addresses.
    rnd = st.round
    assert rnd is not None and rnd.epoch == epoch + 1 and rnd.members == [1, 2]
    assert st.attempts == 0
    assert st.paths == {(1, 2): "punch", (2, 1): "lan"}
    again = establishes(out)
    assert (again[1].route, again[1].next_addr) == ("punch", addr(2))
    assert again[2].prev_route == "punch"
    # The punch fails too: the relay takes over (the server sees it), as before.
    token_12 = next(t for t, pair in st.relay_tokens.items() if pair == (1, 2))
    st.handle(Relayed(token_12))
    assert st.links_now() == {(1, 2): "relay", (2, 1): "lan"}
    report_all(st)
    assert st.accepted() == [1, 2] and st.phase is Phase.IDLE
    # A later round goes straight to the relay; the LAN link the other way stays.
    st.handle(PeerRegistered(3, 0, addr(3)))
    out = vote(st, 1) + vote(st, 2)
    assert st.paths[(1, 2)] == "relay" and st.paths[(2, 3)] == "direct"
    lose(st, 2)
    assert st.lan_failed == set() and st.punch_failed == set()


def test_a_failed_lan_dial_without_a_relay_costs_only_what_a_failed_punch_would() -> None:
    # max_establish_attempts=1: the LAN's retry does not use up the round's one attempt.
    st, sent = nat_pair(allow_relay=False, max_establish_attempts=1)
    epoch = st.round.epoch
    out = report(st, 1, epoch, failed=[2]) + report(st, 2, epoch, failed=[1])
    assert not [c for c in out if isinstance(c, Disconnect)]
    assert st.lan_failed == {(1, 2), (2, 1)}
    assert st.paths == {(1, 2): "punch", (2, 1): "punch"}
    assert st.round.blame == {(1, 2): 2, (2, 1): 2}  # (the newcomer, as for any punch)
    # Only when the punch fails as well does the newcomer go, with the punch's reason.
    out = report(st, 1, epoch + 1, failed=[2]) + report(st, 2, epoch + 1)
    assert [(c.peer_id, c.tell) for c in out if isinstance(c, Disconnect)] == [(2, True)]
    assert st.accepted() == [1]


def test_a_mesh_link_on_the_lan_that_failed_is_relayed_next_time() -> None:
    st = MasterState(token_key=bytes(32), mesh_max_bytes=8192)
    behind_nat(st, 1)
    report_all(st)
    behind_nat(st, 2)
    behind_nat(st, 3, public="198.51.100.9")  # another home
    sent = establishes(vote(st, 1))
    routes = {(p, q): (r, a) for p, msg in sent.items()
              for q, r, a in zip(msg.mesh_ids, msg.mesh_routes, msg.mesh_addrs)}
    assert routes[(1, 2)] == ("direct", lan_addr(2)) and routes[(2, 1)] == ("direct", lan_addr(1))
    assert st.mesh_paths[(1, 2)] == "lan" and st.mesh_paths[(2, 1)] == "lan"
    assert routes[(1, 3)][0] == "relay"
    epoch = st.round.epoch
    tell(st, 1, m.P2PReport(epoch=epoch, failed=[], mesh_failed=[2]))
    report(st, 2, epoch)
    out = report(st, 3, epoch)
    assert not [c for c in out if isinstance(c, Disconnect)]
    assert mesh_limits(out) == dict.fromkeys([1, 2, 3], 0)  # no mesh this epoch
    assert st.lan_failed == {(1, 2)}
    st.handle(PeerRegistered(4, 0, addr(4)))
    for p in (1, 2, 3):
        vote(st, p)
    assert 2 in algorithms.mesh_partners(0, 4)  # (ring 1 2 3 4: 1 and 2 are partners)
    assert st.mesh_paths[(1, 2)] == "relay" and st.mesh_paths[(2, 1)] == "lan"


# --- early start ------------------------------------------------------------------------


def early(tag: int = 0, epoch: int = 2, n: int = 0, **kw: int) -> m.CollectiveInit:
    return dataclasses.replace(coll_init(tag, **kw), early_op=m.early_op_id(epoch, tag, n),
                               epoch=epoch)


def aborts(out: list[Command]) -> list[tuple[int, int]]:
    return [(c.peer_id, c.msg.op_id) for c in out
            if isinstance(c, Send) and isinstance(c.msg, m.CollectiveAbort)]


def test_early_starts_that_agree_run_under_their_own_op_id() -> None:
    st = run_with([0, 0, 0])
    s0 = m.early_op_id(2, 4, 0)
    assert tell(st, 1, early(4)) == []
    # A member's ring part may end before the master heard every member call.
    assert tell(st, 1, done(4, s0)) == []
    assert tell(st, 2, early(4)) == []
    # The last one waits for the perform (early or not): everyone gets it, the early
    # members as the go-ahead for their stall timers.
    assert tell(st, 3, coll_init(4)) == [
        Send(p, m.CollectivePerform(tag=4, op_id=s0, epoch=2, rank=p - 1, world=3))
        for p in (1, 2, 3)]
    assert tell(st, 2, done(4, s0)) == []
    assert tell(st, 3, done(4, s0)) == [Send(p, outcome(4, s0)) for p in (1, 2, 3)]
    assert not st.rings_stale
    # Counted: the next early start of the tag carries the next id.
    for p in (1, 2):
        assert tell(st, p, early(4, n=1)) == []
    assert [c.msg.op_id for c in tell(st, 3, early(4, n=1))] == [  # type: ignore[union-attr]
        m.early_op_id(2, 4, 1)] * 3


def test_an_early_start_on_a_stale_ring_is_void_and_the_ring_rebuilt() -> None:
    st = run_with([0, 0, 0])
    assert tell(st, 1, early(0)) == []
    out = tell(st, 2, early(0, epoch=1))  # an epoch this ring is past
    assert (2, m.early_op_id(1, 0, 0)) in aborts(out)
    assert (1, m.early_op_id(2, 0, 0)) in aborts(out)
    assert 0 in st.broken_groups
    # The last member's call starts the repair; the collective runs on the new ring
    # under a fresh id, performed to everyone.
    tell(st, 3, coll_init(0))
    assert st.round is not None and st.round.repair
    performs = [c for c in report_all(st)
                if isinstance(c, Send) and isinstance(c.msg, m.CollectivePerform)]
    assert sorted(c.peer_id for c in performs) == [1, 2, 3]
    assert {c.msg.op_id for c in performs} == {1}  # type: ignore[union-attr]


def test_a_failed_early_ring_before_everyone_called_is_void_not_a_failure() -> None:
    st = run_with([0, 0, 0])
    s0 = m.early_op_id(2, 0, 0)
    tell(st, 1, early(0))
    tell(st, 2, early(0))
    out = tell(st, 1, done(0, s0, ok=False, kind="PeerConnectionError", message="reset"))
    assert aborts(out) == [(2, s0)]
    assert st.round is not None and st.round.repair  # the links may hold its pieces
    assert tell(st, 2, done(0, s0, ok=False, kind="CollectiveAbortedError")) == []
    out = tell(st, 3, early(0))  # too late: its ring op is stopped too
    assert aborts(out) == [(3, s0)]
    assert not any(isinstance(c, Send) and isinstance(c.msg, m.CollectiveOutcome)
                   for c in out)
    performs = [c for c in report_all(st)
                if isinstance(c, Send) and isinstance(c.msg, m.CollectivePerform)]
    assert len(performs) == 3 and all(c.msg.op_id == 1 for c in performs)  # type: ignore[union-attr]


def test_a_failed_early_ring_after_everyone_called_fails_for_everyone() -> None:
    st = run_with([0, 0, 0])
    s0 = m.early_op_id(2, 0, 0)
    for p in (1, 2, 3):
        tell(st, p, early(0))
    assert tell(st, 2, done(0, s0, ok=False, kind="PeerConnectionError")) == [
        Send(p, m.CollectiveAbort(tag=0, op_id=s0, message=TEXT)) for p in (1, 3)]
    tell(st, 1, done(0, s0, ok=False, kind="CollectiveAbortedError"))
    out = tell(st, 3, done(0, s0, ok=False, kind="CollectiveAbortedError"))
    assert [(c.peer_id, c.msg.ok) for c in out if isinstance(c, Send)
            and isinstance(c.msg, m.CollectiveOutcome)] == [(1, False), (2, False), (3, False)]
    assert st.round is not None and st.round.repair  # the failed ring is rebuilt at once


def test_early_starts_that_disagree_are_refused_and_the_ring_rebuilt() -> None:
    st = run_with([0, 0, 0])
    tell(st, 1, early(0))
    tell(st, 2, early(0))
    out = tell(st, 3, early(0, count=99))
    assert out[:3] == [Send(p, refused(0, "InvalidUsageError")) for p in (1, 2, 3)]
    assert st.round is not None and st.round.repair and st.collectives == {}


def test_a_member_lost_before_calling_voids_the_early_start() -> None:
    st = run_with([0, 0, 0])
    s0 = m.early_op_id(2, 0, 0)
    tell(st, 1, early(0))
    tell(st, 2, early(0))
    out = lose(st, 3)
    assert Send(1, m.CollectiveAbort(tag=0, op_id=s0, message=TEXT)) in out
    assert Send(2, m.CollectiveAbort(tag=0, op_id=s0, message=TEXT)) in out
    performs = [c for c in report_all(st)
                if isinstance(c, Send) and isinstance(c.msg, m.CollectivePerform)]
    assert sorted(c.peer_id for c in performs) == [1, 2]
    assert all(c.msg.world == 2 and c.msg.op_id < (1 << 63) for c in performs)  # type: ignore[union-attr]


# --- reduced by the master --------------------------------------------------------------


def with_data(tag: int, values: list[int], **kw: int) -> m.CollectiveInit:
    raw = np.array(values, dtype=np.int32).tobytes()
    return dataclasses.replace(coll_init(tag, dtype=int(DataType.INT32), count=len(values),
                                         **kw), data=raw)


def test_tiny_collectives_with_every_tensor_are_answered_with_the_result() -> None:
    st = run_with([0, 0, 0])
    assert tell(st, 2, with_data(1, [1, 2])) == []
    assert tell(st, 1, with_data(1, [10, 20])) == []
    out = tell(st, 3, with_data(1, [100, 200]))
    want = np.array([111, 222], dtype=np.int32).tobytes()
    assert out == [Send(p, m.CollectiveOutcome(tag=1, op_id=1, ok=True, kind=ErrorKind.NONE,
                                               message="", data=want, world=3))
                   for p in (1, 2, 3)]
    assert st.collectives == {} and st.collective_paths["via_master"] == 1


def test_one_member_without_its_tensor_makes_the_master_perform_the_ring() -> None:
    st = run_with([0, 0])
    tell(st, 1, with_data(0, [1]))
    out = tell(st, 2, coll_init(0, dtype=int(DataType.INT32), count=1))
    assert [type(c.msg) for c in out if isinstance(c, Send)] == [m.CollectivePerform] * 2


def test_a_tensor_of_the_wrong_length_is_invalid_usage_for_everyone() -> None:
    st = run_with([0, 0])
    tell(st, 1, with_data(0, [1, 2]))
    bad = dataclasses.replace(with_data(0, [1, 2]), data=b"\0" * 3)
    assert tell(st, 2, bad) == [Send(p, refused(0, "InvalidUsageError")) for p in (1, 2)]


def test_a_withdrawal_of_a_tensor_sent_to_the_master_is_answered() -> None:
    """The withdrawing peer sent its tensor: it waits to hear whether the master decided
    first, so it hears the call-off too."""
    st = run_with([0, 0])
    tell(st, 1, with_data(0, [1]))
    out = tell(st, 1, done(0, -1, ok=False, kind="CollectiveAbortedError"))
    assert out == [Send(1, refused(0, "CollectiveAbortedError"))]


# --- the mesh (recursive doubling between the peers) ------------------------------------


def establishes(out: list[Command]) -> dict[int, m.EstablishP2P]:
    return {c.peer_id: c.msg for c in out
            if isinstance(c, Send) and isinstance(c.msg, m.EstablishP2P)}


def mesh_limits(out: list[Command]) -> dict[int, int]:
    return {c.peer_id: c.msg.mesh_max_bytes for c in out
            if isinstance(c, Send) and isinstance(c.msg, m.TopologyUpdated)}


def five_peers(st: MasterState, reachable: Sequence[bool] = (True,) * 5,
               allow_relay: bool = True) -> list[Command]:
    """Peers 1..5 joined; 1 voted: the EstablishP2P of the round (epoch 2)."""
    st.handle(PeerRegistered(1, 0, addr(1), reachable=reachable[0], allow_relay=allow_relay))
    report_all(st)
    for pid in range(2, 6):
        st.handle(PeerRegistered(pid, 0, addr(pid), reachable=reachable[pid - 1],
                                 allow_relay=allow_relay))
    return vote(st, 1)


def test_every_member_gets_pools_to_its_mesh_partners_both_ways() -> None:
    st = MasterState(token_key=bytes(32), mesh_max_bytes=8192)
    sent = establishes(five_peers(st))
    ring = [1, 2, 3, 4, 5]
    for rank, p in enumerate(ring):
        msg = sent[p]
        partners = [ring[r] for r in algorithms.mesh_partners(rank, 5)]
        assert msg.mesh_ids == partners
        assert msg.mesh_addrs == msg.mesh_in_addrs == [addr(q) for q in partners]
        assert msg.mesh_routes == msg.mesh_in_routes == ["direct"] * len(partners)
        for q in partners:  # symmetric: q is told of p too
            assert p in sent[q].mesh_ids
    out = report_all(st)
    assert mesh_limits(out) == dict.fromkeys(ring, 8192)
    assert st.mesh_limits == {0: 8192}


def test_mesh_links_to_a_peer_behind_nat_are_dialed_back_or_relayed() -> None:
    # 2 and 3 are behind NAT; they are not mesh partners of each other in a ring of
    # five (ranks 1 and 2), so every link has one dialable end.
    assert 2 not in algorithms.mesh_partners(1, 5)
    st = MasterState(token_key=bytes(32), mesh_max_bytes=8192)
    sent = establishes(five_peers(st, reachable=(True, False, False, True, True)))
    routes = {(p, q): r for p, msg in sent.items()
              for q, r in zip(msg.mesh_ids, msg.mesh_routes)}
    for (p, q), r in routes.items():
        assert r == ("direct" if q not in (2, 3) else "reverse"), (p, q)
    # The receiving end of a reverse link dials the sender back with the same token.
    for p, msg in sent.items():
        for q, r, t in zip(msg.mesh_ids, msg.mesh_in_routes, msg.mesh_in_tokens):
            sender = sent[q]
            i = sender.mesh_ids.index(p)
            assert (r, t) == (sender.mesh_routes[i], sender.mesh_tokens[i])
    assert mesh_limits(report_all(st)) == dict.fromkeys(range(1, 6), 8192)


def test_partners_both_behind_nat_go_through_the_relay_or_do_without_a_mesh() -> None:
    st = MasterState(token_key=bytes(32), mesh_max_bytes=8192)
    sent = establishes(five_peers(st, reachable=(False,) * 5))
    assert all(set(msg.mesh_routes) == {"relay"} for msg in sent.values())
    relayed = {t for msg in sent.values() for t in msg.mesh_tokens}
    assert relayed <= set(st.relay_tokens) and relayed == st.mesh_tokens
    # A relayed mesh link says nothing of a ring link's hole punching.
    assert all(st.handle(Relayed(t)) == [] for t in relayed) and st.punch_failed == set()
    report_all(st)
    # Without the relay: no mesh links, nobody dropped for it, the ring as before.
    st = MasterState(token_key=bytes(32), mesh_max_bytes=8192)
    sent = establishes(five_peers(st, reachable=(False,) * 5, allow_relay=False))
    assert all(msg.mesh_ids == [] for msg in sent.values())


def test_a_failed_mesh_pool_turns_the_mesh_off_for_the_epoch_and_drops_nobody() -> None:
    st = MasterState(token_key=bytes(32), mesh_max_bytes=8192)
    five_peers(st)
    epoch = st.round.epoch
    out = []
    for p in range(1, 6):
        out += tell(st, p, m.P2PReport(epoch=epoch, failed=[],
                                       mesh_failed=[2] if p == 1 else []))
    assert mesh_limits(out) == dict.fromkeys(range(1, 6), 0)
    assert st.accepted() == [1, 2, 3, 4, 5]


def test_the_cost_model_limit_comes_from_the_dials_the_members_measured() -> None:
    st = MasterState(token_key=bytes(32))  # mesh_max_bytes=-1: the cost model
    five_peers(st)
    epoch = st.round.epoch
    out = []
    for p in range(1, 6):
        out += tell(st, p, m.P2PReport(epoch=epoch, failed=[],
                                       dial_seconds=[0.01 * p, -1.0]))
    one_way = algorithms.one_way_latency([0.01 * p for p in range(1, 6)])
    want = algorithms.mesh_max_bytes(5, one_way, algorithms.DEFAULT_BANDWIDTH)
    assert 0 < want and mesh_limits(out) == dict.fromkeys(range(1, 6), want)
    assert st.mesh_inputs[0] == (one_way, algorithms.DEFAULT_BANDWIDTH)


@pytest.mark.parametrize(("n", "first_region", "own_order"), [
    # 2 regions of 3 (peers 1-3, 4-6): no start of the ring serves the mesh (its extras
    # fold across the regions), so the mesh gets an order of its own, sent to all.
    (6, [1, 2, 3], True),
    # 2 regions of 4 that the ring visits 7 8 1 2 | 3 4 5 6: started at a region's edge
    # the ring itself serves the mesh; the master starts it there and sends no order.
    (8, [7, 8, 1, 2], False),
])
def test_the_mesh_order_goes_with_the_ring_or_starts_it(n, first_region, own_order) -> None:
    st = run_with([0] * n, mesh_max_bytes=-1, token_key=bytes(32))  # type: ignore[arg-type]

    def region(p: int) -> int:
        return int(p in first_region)
    for a in range(1, n + 1):
        for b in range(1, n + 1):
            if a != b:
                st.latency[(a, b)] = (0.001 if region(a) == region(b) else 0.010, 0)
    st.rings_stale = True  # the next vote rebuilds the rings
    out: list[Command] = []
    for p in range(1, n + 1):
        out += vote(st, p)
    establish_cmds = [c for c in out if isinstance(c, Send)
                      and isinstance(c.msg, m.EstablishP2P)]
    assert len(establish_cmds) == n
    out = report_all(st)
    updates = [c.msg for c in out if isinstance(c, Send)
               and isinstance(c.msg, m.TopologyUpdated)]
    assert len(updates) == n and len({tuple(u.mesh_order) for u in updates}) == 1
    ring = st.rings[0]
    assert sorted(ring) == list(range(1, n + 1))
    # The same cycle as before (the ring's edges did not change) ...
    s = ring.index(1)
    assert ring[s:] + ring[:s] == list(range(1, n + 1))
    mesh = updates[0].mesh_order or ring
    assert bool(updates[0].mesh_order) == own_order
    assert st.mesh_orders[0] == mesh and sorted(mesh) == sorted(ring)
    # ... and the mesh's steps cross between the regions once.
    crossings = sum(any(region(mesh[a]) != region(mesh[b]) for a, b in step)
                    for step in algorithms.mesh_steps(n))
    assert crossings == 1, (mesh, ring)
    # Each peer's mesh partners follow that order.
    rank = {p: r for r, p in enumerate(mesh)}
    for c in establish_cmds:
        assert isinstance(c, Send) and isinstance(c.msg, m.EstablishP2P)
        assert c.msg.mesh_ids == [mesh[r] for r in algorithms.mesh_partners(rank[c.peer_id], n)]
    assert st.mesh_limits[0] > 0


def test_a_peer_this_master_dropped_registering_again_is_no_master_restart() -> None:
    """Resuming from a ring this master built is a rejoin (a heartbeat drop, a pause);
    resuming from an older one, after a restart, is a resume (the master-restart count)."""
    st = run_with([0, 0, 0])
    epoch = st.epoch
    lose(st, 3)
    st.take_notes()
    st.handle(PeerRegistered(3, 0, addr(3), Resume(epoch, 0, (1, 2, 3))))
    kinds = [n.kind for n in st.take_notes()]
    assert "rejoin" in kinds and "resume" not in kinds
    # A fresh master (restarted) that never built a ring: the same resume is a restart.
    fresh = MasterState(mesh_max_bytes=0)
    fresh.handle(PeerRegistered(3, 0, addr(3), Resume(epoch, 0, (1, 2, 3))))
    kinds = [n.kind for n in fresh.take_notes()]
    assert "resume" in kinds and "rejoin" not in kinds
