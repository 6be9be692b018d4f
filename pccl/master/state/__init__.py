"""The master's logic as a sans-IO state machine: events in, commands out.

No sockets, no clocks, no randomness: the server turns network activity (and its own
timers, such as heartbeat deadlines) into events and carries out the commands. The same
event sequence always yields the same commands, which is what the unit tests rely on.

Membership in one picture::

    connect+auth      vote done + p2p up
    ────────────▶ REGISTERED ───────────────▶ ACCEPTED ──▶ (gone: leave / lost)

A round of ``update_topology`` runs in phases over the whole run (all peer groups)::

    IDLE ──first vote──▶ VOTE_ACCEPT_NEW_PEERS ──all accepted voted──▶ ESTABLISH_P2P
      ▲                                                                   │
      └──────────── every member reported its pool up (or gave up) ◀─────┘

While no peer is accepted at all (the first peers of a run, or everyone left), pending
peers are admitted without a vote.

Master restart: a master holds no tensor data, so a fresh master process can take over a
run whose master died. Peers that lost their master register again and say what they
held (:class:`Resume`: their old peer id, ring epoch, shared-state revision and ring
members). While nobody is accepted, the fresh master waits until every peer named in
those rings has come back (or the server's recovery grace period ends, reported as
:class:`RecoveryTimeout`) and then admits them all in one round, so the group re-forms
as a whole instead of one peer at a time behind votes.

The package holds the machine in parts, in the manner of quinn-proto's ``Connection``:
:class:`MasterState` (here) is the one entry point and dispatches each event to the
sub-machine it concerns; the sub-machines share one
:class:`~pccl.master.state.context.Context` and hear of each other only through the
reactions of :class:`~pccl.master.state.context.Part` (a peer dropped, a vote started, a
repair started, failed or ended, optimize_topology() done), which :class:`MasterState`
passes on in the order written down in its ``Hub`` methods.

=================  =====================================================================
``events``         events, commands, notes, what each deadline is for
``roster``         peer records and the per-group roster snapshot
``context``        the shared state and helpers; the round record; the ``Part`` interface
``rounds``         registration and recovery admission, the vote, rounds, repairs
``routes``         how each ring and mesh link is made (functions of a round)
``disputes``       p2p reports and whom to drop for a failed link
``quorum``         quorums of several masters (split-brain protection)
``collectives``    collectives: early start, perform, reduce here, done, fail
``syncs``          shared-state syncs: plan, done, withdraw
``optimize``       optimize_topology(): probes, solver, ring and mesh orders
``pending``        are_peers_pending()
=================  =====================================================================
"""


from __future__ import annotations

import os
from collections import deque
from collections.abc import Collection
from typing import Generic, TypeVar, cast, overload

from pccl.errors import ErrorKind
from pccl.master.state import quorum, routes
from pccl.master.state.collectives import VIA_MASTER_MAX_TOTAL, Collective, Collectives
from pccl.master.state.context import Context, Round
from pccl.master.state.events import (
    COUNTED_NOTES,
    MAX_DEADLINE,
    TIMELINE_NOTES,
    ArmDeadline,
    ArmRecoveryTimer,
    BetterRing,
    CheckReach,
    CollectiveDeadline,
    Command,
    Deadline,
    DeadlineExpired,
    Disconnect,
    Event,
    Note,
    OptimizeDeadline,
    PeerLost,
    PeerRegistered,
    PeerStatus,
    PendingDeadline,
    Phase,
    ReachChecked,
    Received,
    RecoveryTimeout,
    Relayed,
    Resume,
    RoundTimeout,
    Send,
    Solve,
    Solved,
    SyncDeadline,
    VoteDeadline,
)
from pccl.master.state.optimize import Optimize
from pccl.master.state.pending import Pending
from pccl.master.state.roster import Claim, PeerRecord, Roster
from pccl.master.state.rounds import Rounds
from pccl.master.state.syncs import ENFORCE_POPULAR, RECEIVE_ONLY, SEND_ONLY, Sync, Syncs
from pccl.protocol import messages as m

__all__ = [
    "PeerStatus",
    "Phase",
    "Resume",
    "PeerRegistered",
    "RecoveryTimeout",
    "PeerLost",
    "Received",
    "Solved",
    "BetterRing",
    "DeadlineExpired",
    "ReachChecked",
    "RoundTimeout",
    "Relayed",
    "Event",
    "Send",
    "Disconnect",
    "Solve",
    "ArmRecoveryTimer",
    "ArmDeadline",
    "CheckReach",
    "Command",
    "TIMELINE_NOTES",
    "COUNTED_NOTES",
    "Note",
    "MAX_DEADLINE",
    "CollectiveDeadline",
    "SyncDeadline",
    "VoteDeadline",
    "OptimizeDeadline",
    "PendingDeadline",
    "Deadline",
    "MasterState",
    "PeerRecord",
    "Claim",
    "Round",
    "Collective",
    "Sync",
    "VIA_MASTER_MAX_TOTAL",
    "ENFORCE_POPULAR",
    "RECEIVE_ONLY",
    "SEND_ONLY",
]

T = TypeVar("T")


class _Field(Generic[T]):
    """A field of a sub-machine (or of the context), read and written through
    :class:`MasterState` under its own name (the server, the status page and tests
    read them there)."""

    def __init__(self, where: str) -> None:
        self.where = where.split(".")
        self.name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def _holder(self, obj: object) -> object:
        for step in self.where:
            obj = getattr(obj, step)
        return obj

    @overload
    def __get__(self, obj: None, owner: type) -> _Field[T]: ...

    @overload
    def __get__(self, obj: object, owner: type) -> T: ...

    def __get__(self, obj: object | None, owner: type) -> _Field[T] | T:
        if obj is None:
            return self
        return cast(T, getattr(self._holder(obj), self.name))

    def __set__(self, obj: object, value: T) -> None:
        setattr(self._holder(obj), self.name, value)


class MasterState:
    """The master's whole state. Feed it events with :meth:`handle`.

    Each event goes to the sub-machine it concerns; their reactions to each other go
    through :class:`_Hub`, which calls the sub-machines in a fixed order."""

    def __init__(self, *, max_establish_attempts: int = 3, repair_rings: bool = True,
                 token_key: bytes | None = None, relay: bool = True,
                 mesh_max_bytes: int = -1, quorum: bool | None = None,
                 standby: bool = False) -> None:
        hub = _Hub()
        self._ctx = Context(
            hub, max_establish_attempts=max_establish_attempts, repair_rings=repair_rings,
            token_key=token_key if token_key is not None else os.urandom(32), relay=relay,
            mesh_max_bytes=mesh_max_bytes, quorum=quorum, standby=standby)
        hub.pending = self._pending = Pending(self._ctx)
        hub.collectives = self._collectives = Collectives(self._ctx)
        hub.syncs = self._syncs = Syncs(self._ctx)
        hub.optimize = self._optimize = Optimize(self._ctx)
        hub.rounds = self._rounds = Rounds(self._ctx, self._optimize)

    # The sub-machines' fields, under the names they always had here.
    max_establish_attempts = _Field[int]("_ctx")
    quorum = _Field[bool | None]("_ctx")
    standby = _Field[bool]("_ctx")
    mesh_max_bytes = _Field[int]("_ctx")
    relay = _Field[bool]("_ctx")
    repair_rings = _Field[bool]("_ctx")
    peers = _Field[dict[int, PeerRecord]]("_ctx")
    phase = _Field[Phase]("_ctx")
    votes = _Field[set[int]]("_ctx")
    epoch = _Field[int]("_ctx")
    round = _Field[Round | None]("_ctx")
    rings_stale = _Field[bool]("_ctx")
    rings = _Field[dict[int, list[int]]]("_ctx")
    ring_epochs = _Field[dict[int, int]]("_ctx")
    fresh = _Field[set[int]]("_ctx")
    deadlines = _Field[dict[int, Deadline]]("_ctx")
    next_deadline = _Field[int]("_ctx")
    repair_failed = _Field[set[int]]("_ctx")
    broken_groups = _Field[set[int]]("_ctx")
    last_revision = _Field[dict[int, int]]("_ctx")
    notes = _Field[deque[Note]]("_ctx")
    opt_votes = _Field[set[int]]("_ctx")
    relay_tokens = _Field[dict[bytes, tuple[int, int]]]("_ctx.links")
    paths = _Field[dict[tuple[int, int], str]]("_ctx.links")
    lan_dials = _Field[dict[tuple[int, int], str]]("_ctx.links")
    punch_failed = _Field[set[tuple[int, int]]]("_ctx.links")
    lan_failed = _Field[set[tuple[int, int]]]("_ctx.links")
    mesh_tokens = _Field[set[bytes]]("_ctx.links")
    mesh_paths = _Field[dict[tuple[int, int], str]]("_ctx.links")
    transfer_tokens = _Field[dict[bytes, tuple[int, int]]]("_ctx.links")
    lineage = _Field[dict[int, tuple[int, frozenset[int]]]]("_rounds")
    mesh_limits = _Field[dict[int, int]]("_rounds")
    mesh_orders = _Field[dict[int, list[int]]]("_rounds")
    first_own_epoch = _Field[int | None]("_rounds")
    attempts = _Field[int]("_rounds")
    vote_deadline = _Field[int]("_rounds")
    recovery_awaiting = _Field[set[int]]("_rounds")
    recovery_id = _Field[int]("_rounds")
    bandwidth = _Field[dict[tuple[int, int], tuple[float, int]]]("_optimize")
    latency = _Field[dict[tuple[int, int], tuple[float, int]]]("_optimize")
    ring_order = _Field[dict[int, list[int]]]("_optimize")
    opt_round = _Field[int]("_optimize")
    opt_probers = _Field[set[int]]("_optimize")
    opt_solving = _Field[set[int]]("_optimize")
    opt_deadline = _Field[int]("_optimize")
    max_bandwidth_age = _Field[int]("_optimize")
    mesh_order_memo = _Field[dict[tuple[int, ...], list[int]]]("_optimize")
    mesh_inputs = _Field[dict[int, tuple[float, float]]]("_optimize")
    probe_seconds = _Field[float]("_optimize")
    nat_pair_factor = _Field[float]("_optimize")
    mesh_order_max_peers = _Field[int]("_optimize")
    pending_votes = _Field[dict[int, int]]("_pending")
    pending_deadline = _Field[int]("_pending")
    collectives = _Field[dict[tuple[int, int], Collective]]("_collectives")
    next_op_id = _Field[int]("_collectives")
    early_counts = _Field[dict[tuple[int, int], tuple[int, int]]]("_collectives")
    collective_paths = _Field[dict[str, int]]("_collectives")
    syncs = _Field[dict[int, Sync]]("_syncs")

    # --- queries (used by the server and by tests) --------------------------------

    def _roster_now(self) -> Roster:
        return self._ctx.roster_now()

    def accepted(self) -> list[int]:
        return self._ctx.accepted()

    def pending(self) -> list[int]:
        return self._ctx.pending()

    @property
    def ring_epoch(self) -> int:
        """The newest epoch any group's ring was built in."""
        return max(self._ctx.ring_epochs.values(), default=0)

    def group_sizes(self) -> dict[int, int]:
        return self._ctx.group_sizes()

    def take_notes(self) -> list[Note]:
        """The notes made since the last call, oldest first."""
        notes = list(self._ctx.notes)
        self._ctx.notes.clear()
        return notes

    @property
    def quorum_on(self) -> bool:
        """Whether rounds need a quorum of each group's previous ring."""
        return self._ctx.quorum_on

    def held_groups(self) -> list[int]:
        """The groups this master holds: accepted peers, or peers back from another
        master that it is gathering (what a challenge tells a peer with several
        masters, which registers where its group is held)."""
        return quorum.held_groups(self._ctx)

    def links_now(self) -> dict[tuple[int, int], str]:
        """How each ring link of the current rings runs (see routes.links_now)."""
        return routes.links_now(self._ctx.links)

    def _groups(self) -> dict[int, list[int]]:
        return self._ctx.groups()

    def _members(self, group: int) -> list[int]:
        return self._ctx.members(group)

    def _member_set(self, group: int) -> frozenset[int]:
        return self._ctx.member_set(group)

    def _ring_broken(self, group: int) -> bool:
        return self._ctx.ring_broken(group)

    # --- the one entry point ------------------------------------------------------

    def handle(self, event: Event) -> list[Command]:
        out: list[Command] = []
        ctx = self._ctx
        if isinstance(event, PeerRegistered):
            self._rounds.on_registered(event, out)
        elif isinstance(event, PeerLost):
            if event.peer_id in ctx.peers:
                self._remove(event.peer_id, out, event.reason or "connection lost")
        elif isinstance(event, Received):
            if event.peer_id in ctx.peers:
                self._on_message(event.peer_id, event.msg, out)
        elif isinstance(event, Solved):
            self._optimize.on_solved(event, out)
        elif isinstance(event, BetterRing):
            self._optimize.on_better_ring(event)
        elif isinstance(event, Relayed):
            routes.on_relayed(ctx.links, event.token)
        elif isinstance(event, ReachChecked):
            self._rounds.on_reach_checked(event, out)
        elif isinstance(event, RoundTimeout):
            self._rounds.on_round_timeout(event, out)
        elif isinstance(event, RecoveryTimeout):
            self._rounds.on_recovery_timeout(event, out)
        elif isinstance(event, DeadlineExpired):
            self._on_deadline(event.deadline_id, out)
        else:  # pragma: no cover - the type union is closed
            raise TypeError(event)
        self._rounds.maybe_repair(out)
        return out

    def _on_message(self, peer: int, msg: m.Message, out: list[Command]) -> None:
        rec = self._ctx.peers[peer]
        if isinstance(msg, m.UpdateTopology):
            self._rounds.on_update_topology(peer, rec, msg, out)
        elif isinstance(msg, m.P2PReport):
            self._rounds.on_p2p_report(peer, msg, out)
        elif isinstance(msg, m.CollectiveInit):
            self._collectives.on_init(peer, msg, out)
        elif isinstance(msg, m.CollectiveDone):
            self._collectives.on_done(peer, msg, out)
        elif isinstance(msg, m.OptimizeTopology):
            self._optimize.on_vote(peer, rec, msg, out)
        elif isinstance(msg, m.ProbeReport):
            self._optimize.on_probe_report(peer, msg, out)
        elif isinstance(msg, m.SyncInit):
            self._syncs.on_init(peer, msg, out)
        elif isinstance(msg, m.SyncDone):
            self._syncs.on_done(peer, msg, out)
        elif isinstance(msg, m.SyncWithdraw):
            self._syncs.on_withdraw(peer, out)
        elif isinstance(msg, m.PendingQuery):
            self._pending.on_query(peer, rec, msg, out)
        elif isinstance(msg, m.Leave):
            self._rounds.on_leave(peer, rec)
            self._remove(peer, out, reason="left gracefully")
        elif isinstance(msg, m.Pong):
            pass  # liveness is the server's business
        else:
            out.append(Send(peer, m.ErrorReply(
                kind=ErrorKind.ProtocolError,
                message=f"unexpected message {msg.TYPE!r} at the master")))

    def _remove(self, peer: int, out: list[Command], reason: str) -> None:
        """A peer was lost or left: forget it (every sub-machine hears of it), fail an
        optimization it was in, then let the rounds go on without it."""
        rec = self._ctx.forget(peer, reason, out)
        self._optimize.on_peer_removed(peer, rec, out)
        self._rounds.on_peer_removed(peer, rec, out)

    def _on_deadline(self, did: int, out: list[Command]) -> None:
        what = self._ctx.deadlines.pop(did, None)
        if what is None:
            return
        advice = ("nothing was changed; retry (a peer that never makes the same call "
                  "holds everyone up: check that every peer runs the same sequence of "
                  "collective calls)")
        if isinstance(what, CollectiveDeadline):
            self._collectives.on_deadline(what, did, advice, out)
        elif isinstance(what, SyncDeadline):
            self._syncs.on_deadline(what, did, advice, out)
        elif isinstance(what, VoteDeadline):
            self._rounds.on_deadline(did, advice, out)
        elif isinstance(what, OptimizeDeadline):
            self._optimize.on_deadline(did, advice, out)
        elif isinstance(what, PendingDeadline):
            self._pending.on_deadline(did, advice, out)


class _Hub:
    """The sub-machines' reactions to each other (:class:`~pccl.master.state.context.Hub`):
    each method calls the sub-machines that react, in the order it lists (the order their
    commands go out in)."""

    pending: Pending
    collectives: Collectives
    syncs: Syncs
    optimize: Optimize
    rounds: Rounds

    def peer_dropped(self, peer: int, rec: PeerRecord, out: list[Command]) -> None:
        """Order: are_peers_pending, collectives, syncs."""
        for part in (self.pending, self.collectives, self.syncs):
            part.on_peer_dropped(peer, rec, out)

    def vote_started(self, peer: int, group: int, what: str, out: list[Command]) -> None:
        """Order: the group's waiting sync is called off before its collectives."""
        for part in (self.syncs, self.collectives):
            part.on_vote_started(peer, group, what, out)

    def waiting_changed(self, out: list[Command]) -> None:
        self.pending.on_waiting_changed(out)

    def repair_started(self, groups: Collection[int], out: list[Command]) -> None:
        self.collectives.on_repair_started(groups, out)

    def repair_failed(self, groups: Collection[int], attempts: int,
                      out: list[Command]) -> None:
        self.collectives.on_repair_failed(groups, attempts, out)

    def rings_ready(self, out: list[Command]) -> None:
        self.collectives.on_rings_ready(out)

    def optimized(self, voters: set[int], out: list[Command]) -> None:
        self.rounds.on_optimized(voters, out)

    def waiting(self) -> list[tuple[int, Collection[int]]]:
        """Order: collectives, then syncs."""
        return [*self.collectives.waiting(), *self.syncs.waiting()]

    def running_groups(self) -> set[int]:
        return set(self.collectives.running_groups())
