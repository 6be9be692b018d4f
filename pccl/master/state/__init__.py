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
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import math
import os
from collections import Counter, deque
from collections.abc import Callable, Collection, Container, Iterable
from collections.abc import Set as AbstractSet
from typing import Any

from pccl import _core, algorithms
from pccl.enums import DTYPES, DataType, QuantizationAlgorithm, ReduceOp
from pccl.errors import ErrorKind, PCCLError
from pccl.master.state.events import (  # re-exported: see __all__
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
from pccl.protocol import messages as m


@dataclasses.dataclass(frozen=True)
class Claim:
    """What a peer back from another master knows of its group's rings there: the
    newest ring proposed to it, and the newest ring it knows was installed."""

    epoch: int
    ring: frozenset[int]
    base_epoch: int
    base: frozenset[int]
    more: tuple[tuple[int, frozenset[int]], ...] = ()


@dataclasses.dataclass
class PeerRecord:
    peer_id: int
    peer_group: int
    p2p_addr: str
    status: PeerStatus = PeerStatus.REGISTERED
    reachable: bool = True
    allow_relay: bool = True
    punch_addrs: tuple[str, ...] = ()
    # A peer back from another master (or a restarted one) until it is accepted: the
    # newest ring it saw proposed, (epoch, members), and its id in that ring. See
    # MasterState._quorum_filter.
    claim: Claim | None = None
    was: int = 0
    # Peers dropped because this one reported its ring link to them failed (see
    # MasterState._settle_disputes): after one, its own link is taken to be at fault.
    dropped_on_its_word: int = 0
    # The static key it proved in its handshake (b"" in clear text).
    key: bytes = b""
    # PeerRegistered.public_host and lan_addrs.
    public_host: str = ""
    lan_addrs: tuple[str, ...] = ()


def _rotation_of(a: list[int], b: list[int]) -> bool:
    """Whether ``a`` is ``b`` started elsewhere (the same cycle)."""
    if len(a) != len(b) or not a:
        return a == b
    try:
        s = b.index(a[0])
    except ValueError:
        return False
    return b[s:] + b[:s] == a


def _covers(calls: Collection[int], members: Collection[int]) -> bool:
    """Whether every one of ``members`` is among ``calls``: O(1) while some are missing
    (the counts are compared first), which is the common case on every message."""
    return len(calls) >= len(members) and all(p in calls for p in members)


class _Roster:
    """Who is registered and who accepted (per group), in registration order: a
    snapshot of ``MasterState.peers``, taken when first asked after a change."""

    def __init__(self, peers: dict[int, PeerRecord]) -> None:
        self.accepted: list[int] = []
        self.pending: list[int] = []
        self.groups: dict[int, list[int]] = {}
        for p, r in peers.items():
            if r.status is PeerStatus.ACCEPTED:
                self.accepted.append(p)
                self.groups.setdefault(r.peer_group, []).append(p)
            elif r.status is PeerStatus.REGISTERED:
                self.pending.append(p)
        self._sets: dict[int, frozenset[int]] = {}
        self._rings: dict[int, tuple[list[int], int, bool]] = {}

    def __eq__(self, other: object) -> bool:  # a snapshot equals one of the same peers
        return isinstance(other, _Roster) and (self.accepted, self.pending, self.groups) \
            == (other.accepted, other.pending, other.groups)

    def __hash__(self) -> int:  # (mutable: a snapshot is compared, never hashed)
        raise TypeError("a roster snapshot is not hashable")

    def group_set(self, group: int) -> frozenset[int]:
        got = self._sets.get(group)
        if got is None:
            got = self._sets[group] = frozenset(self.groups.get(group, ()))
        return got

    def is_ring_of(self, group: int, ring: list[int]) -> bool:
        """Whether ``ring`` holds exactly the group's accepted members (remembered for
        this ring object while it keeps its length)."""
        seen = self._rings.get(group)
        if seen is not None and seen[0] is ring and seen[1] == len(ring):
            return seen[2]
        same = len(ring) == len(self.groups.get(group, ())) and \
            sorted(ring) == sorted(self.groups.get(group, ()))
        self._rings[group] = (ring, len(ring), same)
        return same


@dataclasses.dataclass
class Round:
    """One attempt at establishing the rings of every peer group."""

    epoch: int
    members: list[int]
    reported: set[int] = dataclasses.field(default_factory=set)
    unreachable: set[int] = dataclasses.field(default_factory=set)
    # Why a member is unreachable when the master knew before anyone dialed (no path).
    reasons: dict[int, str] = dataclasses.field(default_factory=dict)
    # (sender, receiver) -> who to drop if that link fails (hole punching without a
    # relay to fall back on: the refuser or the newcomer, not the reporter's neighbour).
    blame: dict[tuple[int, int], int] = dataclasses.field(default_factory=dict)
    # A repair: the master rebuilds the rings of groups that lost a peer or whose links
    # failed, on its own (no votes, nobody admitted); only those groups take part.
    repair: bool = False
    groups: set[int] = dataclasses.field(default_factory=set)
    # Groups whose members were sent mesh links, until one reports a mesh pool failed.
    mesh_ok: set[int] = dataclasses.field(default_factory=set)
    # Per group: how long the members' pool dials took (the latency measurement).
    dials: dict[int, list[float]] = dataclasses.field(default_factory=dict)
    # Per group: the mesh's rank order (peer ids) sent with this round's links.
    mesh_orders: dict[int, list[int]] = dataclasses.field(default_factory=dict)
    # Per group: the ring whose links this round establishes (installed if it succeeds).
    rings: dict[int, list[int]] = dataclasses.field(default_factory=dict)
    # Per member: the peer its ring link dials, and its mesh partners: all that its
    # p2p report may speak of.
    next_of: dict[int, int] = dataclasses.field(default_factory=dict)
    partners_of: dict[int, frozenset[int]] = dataclasses.field(default_factory=dict)
    # Ring links reported failed: reporter -> the peer it could not reach.
    accused: dict[int, int] = dataclasses.field(default_factory=dict)
    # Ring links dialed on a LAN that failed (see MasterState.lan_failed): the round is
    # tried again with them over their public addresses, nobody dropped for them.
    lan_failed: set[tuple[int, int]] = dataclasses.field(default_factory=set)
    # This master's own dial-back of accused peers: None while it runs.
    reach: dict[int, bool | None] = dataclasses.field(default_factory=dict)
    # A better ring order came in while this round ran (BetterRing): the next
    # update_topology() rebuilds in it (this round installs the links it made).
    reorder_pending: bool = False
    member_set: frozenset[int] = dataclasses.field(init=False)  # for membership tests

    def __post_init__(self) -> None:
        self.member_set = frozenset(self.members)


@dataclasses.dataclass
class Collective:
    """One collective (per peer group and tag) from the first init to the outcome."""

    group: int
    tag: int
    inits: dict[int, m.CollectiveInit] = dataclasses.field(default_factory=dict)
    op_id: int = -1  # assigned when every member agreed and the ring runs
    participants: list[int] = dataclasses.field(default_factory=list)
    participant_set: frozenset[int] = frozenset()  # the same, for membership tests
    reported: set[int] = dataclasses.field(default_factory=set)
    error: tuple[ErrorKind, str] | None = None  # (error class name, message)
    deadline: int = 0  # id of the deadline on the wait for every member's init
    epoch: int = -1  # ring epoch it was performed on
    # Early start (see pccl.peer.state): the op id members already run, those members,
    # what they reported before every member had called, and whether it was voided (its
    # members then run it again under a new op id once performed).
    early: int = -1
    early_peers: set[int] = dataclasses.field(default_factory=set)
    early_done: dict[int, m.CollectiveDone] = dataclasses.field(default_factory=dict)
    early_void: bool = False


def _describe(init: m.CollectiveInit) -> tuple[object, ...]:
    return (init.kind, init.dtype, init.count, init.op, init.quant_algorithm, init.quant_dtype)


def _name(enum_type: type[enum.IntEnum], code: int) -> str:
    try:
        return enum_type(code).name
    except ValueError:
        return f"unknown ({code})"


def _explain(init: m.CollectiveInit) -> str:
    """A collective's description in the words of the API (enum names, the shape)."""
    shape = "x".join(map(str, init.shape)) if init.shape else "?"
    quant = _name(QuantizationAlgorithm, init.quant_algorithm)
    if init.quant_algorithm:
        quant += f" to {_name(DataType, init.quant_dtype)}"
    return (f"{init.count} x {_name(DataType, init.dtype)} (shape {shape}), op "
            f"{_name(ReduceOp, init.op)}, quantization {quant}")


# Bytes per element of each pccl.DataType (a collective's size on the status page).
_ELEMENT_BYTES = {int(t): info.size for t, info in DTYPES.items()}

# Collectives reduced by the master: at most this many bytes of tensors in all (above,
# the ring runs even when every member sent its tensor).
VIA_MASTER_MAX_TOTAL = 64 << 20

# Values of pccl.SharedStateSyncStrategy (kept numeric on the wire).
ENFORCE_POPULAR, RECEIVE_ONLY, SEND_ONLY = 0, 1, 2


@dataclasses.dataclass
class Sync:
    """One shared-state sync of a peer group, from the first init to the outcome."""

    group: int
    inits: dict[int, m.SyncInit] = dataclasses.field(default_factory=dict)
    planned: bool = False
    revision: int = 0
    participants: list[int] = dataclasses.field(default_factory=list)
    participant_set: frozenset[int] = frozenset()  # the same, for membership tests
    reported: set[int] = dataclasses.field(default_factory=set)
    error: tuple[ErrorKind, str] | None = None
    deadline: int = 0  # id of the deadline on the wait for every member's init


class MasterState:
    """The master's whole state. Feed it events with :meth:`handle`."""

    def __init__(self, *, max_establish_attempts: int = 3, repair_rings: bool = True,
                 token_key: bytes | None = None, relay: bool = True,
                 mesh_max_bytes: int = -1, quorum: bool | None = None,
                 standby: bool = False) -> None:
        self.max_establish_attempts = max_establish_attempts
        # Split-brain protection for runs with several masters: a round may install a
        # group's new ring only if it holds a strict majority of the newest ring known
        # for that group (this master's, or one a peer back from another master saw).
        # None: on for a standby, else off. Only the master's own configuration turns
        # it on: a peer's hello saying it has several masters once did, so that any
        # registered peer could make a single-master run wait for quorums of masters
        # that do not exist.
        self.quorum = quorum
        # A standby never starts a group: it only takes one over from peers that come
        # from another master (with their rings), so that a peer that reaches only the
        # standby cannot start a second run of its group there. Implies quorums.
        self.standby = standby
        # Per group: (epoch, members) of the last ring installed here, less the peers
        # that left it gracefully since (they never vote elsewhere): what a quorum counts.
        self.lineage: dict[int, tuple[int, frozenset[int]]] = {}
        # All-reduces up to this size run on the mesh: -1 chosen per group by the cost
        # model (pccl.algorithms), 0 no mesh (no mesh links are made either).
        self.mesh_max_bytes = mesh_max_bytes
        # Per group: the mesh limit of its current ring epoch (sent with TopologyUpdated).
        self.mesh_limits: dict[int, int] = {}
        # Per group: the mesh's rank order (peer ids) of its current ring epoch, and the
        # orders computed for rings (cleared when a latency is measured).
        self.mesh_orders: dict[int, list[int]] = {}
        self.mesh_order_memo: dict[tuple[int, ...], list[int]] = {}
        # Per group: what the cost model was given for it (one-way latency s, bytes/s).
        self.mesh_inputs: dict[int, tuple[float, float]] = {}
        # Relay tokens of mesh links (not ring links: their fallback says nothing of a
        # ring link's hole punching).
        self.mesh_tokens: set[bytes] = set()
        # How each mesh link of the current round is made: (sender, receiver) -> route.
        self.mesh_paths: dict[tuple[int, int], str] = {}
        # Route tokens (ring links that are not direct, relayed transfers) are keyed
        # hashes under this key (see _token).
        self._token_key = token_key if token_key is not None else os.urandom(32)
        # Whether the master relays ring links that no direct connection can make.
        self.relay = relay
        # The current round's links that may go through the relay (routed "relay", or
        # "punch" with the relay to fall back on): token -> (sender, receiver). The relay
        # splices only connections that present one of these.
        self.relay_tokens: dict[bytes, tuple[int, int]] = {}
        # How each ring link of the current round is made: (sender, receiver) -> "direct",
        # "lan", "reverse", "punch" or "relay" (for status pages and logs).
        self.paths: dict[tuple[int, int], str] = {}
        # The address a link of the current round routed "lan" (ring or mesh) dials:
        # the receiver's listener on the LAN the two share (others dial p2p_addr).
        self.lan_dials: dict[tuple[int, int], str] = {}
        # Ring links whose hole punching failed (symmetric NAT): the next rounds relay
        # them at once instead of trying for PUNCH_TIMEOUT again. Forgotten with a peer.
        self.punch_failed: set[tuple[int, int]] = set()
        # Links whose dial on the LAN failed (two networks behind one public address, as
        # with carrier-grade NAT, or a firewall between them): the next rounds take
        # them over the public addresses (punch, relay). Forgotten with a peer.
        self.lan_failed: set[tuple[int, int]] = set()
        # Shared-state transfers through the relay: token -> (fetcher, holder). Kept
        # until the next sync plan of either (bounded by the peers' count squared).
        self.transfer_tokens: dict[bytes, tuple[int, int]] = {}
        # False: a ring that lost a peer stays broken until update_topology() (collectives
        # there fail at once); True: the master rebuilds it on its own (see _maybe_repair).
        self.repair_rings = repair_rings
        self.peers: dict[int, PeerRecord] = {}  # insertion order is join order
        self.phase = Phase.IDLE
        self.votes: set[int] = set()
        self.epoch = 0
        # The first epoch this master built (None: none yet). A peer resuming from an
        # epoch at or after it was dropped by this master, not left by a restart.
        self.first_own_epoch: int | None = None
        self.round: Round | None = None
        self.attempts = 0
        # True when the accepted set changed (a peer left) since the rings were built.
        self.rings_stale = False
        self.rings: dict[int, list[int]] = {}
        self.ring_epochs: dict[int, int] = {}  # per group: the epoch its ring was built in
        # Collective are_peers_pending(): voter -> request id, answered all at once.
        self.pending_votes: dict[int, int] = {}
        # Members of the last voted round (joiners and voters alike) that have not called
        # a collective, a sync or are_peers_pending() since: the only askers others may be
        # parked waiting for (see _maybe_answer_pending).
        self.fresh: set[int] = set()
        # Deadlines of waits for other peers: id -> what waits ("collective", group, tag),
        # ("sync", group), ("vote",), ("optimize",), ("pending",). See ArmDeadline.
        self.deadlines: dict[int, Deadline] = {}
        self.next_deadline = 1
        self.vote_deadline = 0
        self.opt_deadline = 0
        self.pending_deadline = 0
        # Groups whose repair round failed: no new repair until a voted round succeeds
        # (collectives there fail fast meanwhile instead of waiting for a repair).
        self.repair_failed: set[int] = set()
        self.collectives: dict[tuple[int, int], Collective] = {}
        # Groups whose ring links failed in a collective: unusable until the next round.
        self.broken_groups: set[int] = set()
        self.syncs: dict[int, Sync] = {}
        # Topology optimization: measured bandwidths (bytes/s) with the optimization
        # round they were measured in, the preferred ring order per group, and the
        # state of the round in progress.
        self.bandwidth: dict[tuple[int, int], tuple[float, int]] = {}
        # One-way latency (seconds) per ordered pair, from the probes' dials, with the
        # round it was measured in (as bandwidth).
        self.latency: dict[tuple[int, int], tuple[float, int]] = {}
        self.ring_order: dict[int, list[int]] = {}
        self.opt_round = 0
        self.opt_votes: set[int] = set()
        self.opt_probers: set[int] = set()
        self.opt_solving: set[int] = set()
        self.max_bandwidth_age = 4  # rounds after which a measurement is taken again
        # Revision each peer reached in its last successful sync.
        self.last_revision: dict[int, int] = {}
        self.next_op_id = 1
        # (group, tag) -> (ring epoch, successful collectives of the tag on that ring):
        # what the op id of an early start derives from (see m.early_op_id).
        self.early_counts: dict[tuple[int, int], tuple[int, int]] = {}
        # Who is registered and accepted, per group, derived from ``peers`` and cached
        # until a peer registers, is accepted or leaves (``_roster_changed``): the
        # per-message paths ask these on every collective, at thousands of peers.
        self._roster: _Roster | None = None
        # How collectives ran: early starts that stood (one master round trip), early
        # starts voided (run again), reduced here (tiny ones: one round trip, no ring).
        self.collective_paths = {"early": 0, "voided": 0, "via_master": 0}
        # Recovery after a master restart: peers named by resuming peers that have not
        # registered yet; admission waits for them (bounded by the recovery timer).
        self.recovery_awaiting: set[int] = set()
        self.recovery_id = 0
        # What happened since the server last took them (take_notes); bounded, since a
        # state driven without a server (tests, the simulator) never takes them.
        self.notes: deque[Note] = deque(maxlen=4096)

    # --- queries (used by the server and by tests) --------------------------------

    def _roster_now(self) -> _Roster:
        if self._roster is None:
            self._roster = _Roster(self.peers)
        return self._roster

    def _roster_changed(self) -> None:
        self._roster = None

    def accepted(self) -> list[int]:
        return list(self._roster_now().accepted)

    def pending(self) -> list[int]:
        return list(self._roster_now().pending)

    @property
    def ring_epoch(self) -> int:
        """The newest epoch any group's ring was built in."""
        return max(self.ring_epochs.values(), default=0)

    def group_sizes(self) -> dict[int, int]:
        return {g: len(ms) for g, ms in self._roster_now().groups.items()}

    def take_notes(self) -> list[Note]:
        """The notes made since the last call, oldest first."""
        notes = list(self.notes)
        self.notes.clear()
        return notes

    def _note(self, kind: str, text: str, peers: Collection[int] = (), group: int = -1,
              value: int = 0, nbytes: int = 0, tag: int = -1) -> None:
        assert kind in TIMELINE_NOTES or kind in COUNTED_NOTES, kind
        self.notes.append(Note(kind, text, tuple(peers), group, value, nbytes, tag))

    # --- the one entry point ------------------------------------------------------

    def handle(self, event: Event) -> list[Command]:
        out: list[Command] = []
        if isinstance(event, PeerRegistered):
            self._on_registered(event, out)
        elif isinstance(event, PeerLost):
            if event.peer_id in self.peers:
                self._remove(event.peer_id, out, event.reason or "connection lost")
        elif isinstance(event, Received):
            if event.peer_id in self.peers:
                self._on_message(event.peer_id, event.msg, out)
        elif isinstance(event, Solved):
            self._on_solved(event, out)
        elif isinstance(event, BetterRing):
            members = set(self._groups().get(event.group, []))
            if event.round_id == self.opt_round and set(event.ring) == members:
                self.ring_order[event.group] = list(event.ring)
                self.rings_stale = True  # the next update_topology() rebuilds in it
                if self.round is not None:
                    self.round.reorder_pending = True
        elif isinstance(event, Relayed):
            pair = self.relay_tokens.get(event.token)
            if pair is not None and self.paths.get(pair) == "punch" \
                    and event.token not in self.mesh_tokens:
                self.punch_failed.add(pair)
        elif isinstance(event, ReachChecked):
            rnd = self.round
            if rnd is not None and rnd.epoch == event.epoch and event.peer_id in rnd.reach \
                    and rnd.reach[event.peer_id] is None:
                rnd.reach[event.peer_id] = event.ok
                self._maybe_finish_round(out)
        elif isinstance(event, RoundTimeout):
            rnd = self.round
            if rnd is not None and rnd.epoch == event.epoch:
                silent = [p for p in rnd.members if p not in rnd.reported]
                # A silent peer whose link waits for a silent receiver (to dial it back,
                # or to punch a hole) is not to blame: the receiver is, unless that would
                # leave nobody to blame.
                links = [*self.paths.items(), *self.mesh_paths.items()]
                waiting = {a for (a, b), path in links
                           if path in ("reverse", "punch") and a in silent and b in silent}
                blamed = [p for p in silent if p not in waiting] or silent
                rnd.unreachable.update(blamed)
                rnd.reported.update(silent)
                self._maybe_finish_round(out)
        elif isinstance(event, RecoveryTimeout):
            if event.recovery_id == self.recovery_id and self.recovery_awaiting:
                self.recovery_awaiting.clear()
                self._admit_if_nobody_accepted(out)
        elif isinstance(event, DeadlineExpired):
            self._on_deadline(event.deadline_id, out)
        else:  # pragma: no cover - the type union is closed
            raise TypeError(event)
        self._maybe_repair(out)
        return out

    # --- transitions ----------------------------------------------------------------

    def _on_registered(self, ev: PeerRegistered, out: list[Command]) -> None:
        if ev.peer_id in self.peers:
            raise ValueError(f"peer id {ev.peer_id} registered twice")
        res = ev.resume
        self.peers[ev.peer_id] = PeerRecord(ev.peer_id, ev.peer_group, ev.p2p_addr,
                                            reachable=ev.reachable,
                                            allow_relay=ev.allow_relay,
                                            punch_addrs=ev.punch_addrs,
                                            key=ev.key, public_host=ev.public_host,
                                            lan_addrs=ev.lan_addrs,
                                            claim=Claim(res.epoch, frozenset(res.peers),
                                                        res.base_epoch, frozenset(res.base),
                                                        tuple((e, frozenset(r))
                                                              for e, r in res.more))
                                            if res is not None else None,
                                            was=(res.peer_id or ev.peer_id)
                                            if res is not None else 0)
        self._roster_changed()
        self.recovery_awaiting.discard(ev.peer_id)
        if res is not None:
            # Epochs must keep increasing across the restart: peers still hold links
            # keyed by their old epochs.
            self.epoch = max(self.epoch, res.epoch)
            own = self.first_own_epoch is not None and res.epoch >= self.first_own_epoch
            how = ("registered again after this master dropped it" if own
                   else "came back after a master restart")
            self._note("rejoin" if own else "resume", f"peer {ev.peer_id} {how} "
                       f"(its ring epoch {res.epoch}, shared-state revision {res.revision}, "
                       f"old ring {list(res.peers)})", (ev.peer_id,), ev.peer_group,
                       res.epoch)
            if res.revision >= 0:
                self.last_revision[ev.peer_id] = res.revision
            if self.phase is Phase.IDLE and not self.accepted():
                missing = set(res.peers).union(res.base, *(r for _, r in res.more)) \
                    - set(self.peers)
                if missing:
                    if not self.recovery_awaiting:
                        self.recovery_id += 1
                        out.append(ArmRecoveryTimer(self.recovery_id))
                    self.recovery_awaiting |= missing
        self._admit_if_nobody_accepted(out)

    def _on_message(self, peer: int, msg: m.Message, out: list[Command]) -> None:
        rec = self.peers[peer]
        if isinstance(msg, m.UpdateTopology):
            if rec.status is not PeerStatus.ACCEPTED:
                out.append(Send(peer, m.ErrorReply(
                    kind=ErrorKind.InvalidUsageError,
                    message="update_topology() before this peer was accepted")))
            elif peer in self.votes or self.phase is Phase.OPTIMIZE_TOPOLOGY or (
                    self.phase is Phase.ESTABLISH_P2P and not self._repairing()):
                out.append(Send(peer, m.ErrorReply(
                    kind=ErrorKind.InvalidUsageError,
                    message="update_topology() is already in progress for this peer")))
            else:
                if not self.votes:
                    self.vote_deadline = self._arm(VoteDeadline(), msg.timeout, out)
                self.votes.add(peer)
                # Peers of this group that wait in a collective would wait forever for
                # this voter, and it for them: call their collectives off.
                self._call_off_waiting_ops(peer, rec.peer_group, "update_topology()", out)
                if self.phase is Phase.ESTABLISH_P2P:
                    self._maybe_answer_pending(out)
                    return  # a repair is running: the vote is counted when it ends
                self.phase = Phase.VOTE_ACCEPT_NEW_PEERS
                self._maybe_finish_vote(out)
                self._maybe_answer_pending(out)
        elif isinstance(msg, m.P2PReport):
            rnd = self.round
            if rnd is not None and msg.epoch == rnd.epoch and peer in rnd.member_set \
                    and peer not in rnd.reported:
                self._on_p2p_report(peer, msg, rnd)
                self._maybe_finish_round(out)
        elif isinstance(msg, m.CollectiveInit):
            self._on_collective_init(peer, msg, out)
        elif isinstance(msg, m.CollectiveDone):
            self._on_collective_done(peer, msg, out)
        elif isinstance(msg, m.OptimizeTopology):
            self._on_optimize_vote(peer, rec, msg, out)
        elif isinstance(msg, m.ProbeReport):
            self._on_probe_report(peer, msg, out)
        elif isinstance(msg, m.SyncInit):
            self._on_sync_init(peer, msg, out)
        elif isinstance(msg, m.SyncDone):
            self._on_sync_done(peer, msg, out)
        elif isinstance(msg, m.SyncWithdraw):
            self._on_sync_withdraw(peer, out)
        elif isinstance(msg, m.PendingQuery):
            self._on_pending_query(peer, rec, msg, out)
        elif isinstance(msg, m.Leave):
            # It will not vote for this ring anywhere else: quorums no longer count it.
            lin = self.lineage.get(rec.peer_group)
            if lin is not None and peer in lin[1]:
                self.lineage[rec.peer_group] = (lin[0], lin[1] - {peer})
            self._remove(peer, out, reason="left gracefully")
        elif isinstance(msg, m.Pong):
            pass  # liveness is the server's business
        else:
            out.append(Send(peer, m.ErrorReply(
                kind=ErrorKind.ProtocolError,
                message=f"unexpected message {msg.TYPE!r} at the master")))

    def _on_p2p_report(self, peer: int, msg: m.P2PReport, rnd: Round) -> None:
        """A member's outcome of its links. A peer speaks only for the links it dialed
        itself: its ring link to ``next_of[peer]`` (``failed``) and its mesh partners
        (``mesh_failed``). A report that blames anyone else is a lie (honest peers
        never send one): the reporter is dropped, its blame ignored. Who is dropped for
        a failed ring link is decided once every member reported (_settle_disputes)."""
        rnd.reported.add(peer)
        group = self.peers[peer].peer_group
        own = rnd.next_of.get(peer, -1)
        partners = rnd.partners_of.get(peer, frozenset())
        lies = sorted({p for p in msg.failed if p != own}
                      | {p for p in msg.mesh_failed if p not in partners})
        if lies:
            rnd.unreachable.add(peer)
            rnd.reasons[peer] = (f"its p2p report of round {rnd.epoch} blamed peers it has "
                                 f"no link to ({lies[:8]}); a peer reports only its own links")
            return
        rnd.dials.setdefault(group, []).extend(
            float(d) for d in msg.dial_seconds[:64] if 0 <= d < 3600)
        if msg.mesh_failed:
            rnd.mesh_ok.discard(group)
            # (A mesh link on a LAN that failed goes through the relay from now on.)
            self.lan_failed.update((peer, q) for q in msg.mesh_failed
                                   if self.mesh_paths.get((peer, q)) == "lan")
        if own in msg.failed:
            rnd.accused[peer] = own

    def _settle_disputes(self, rnd: Round, out: list[Command]) -> bool:
        """Whom to drop for the ring links that failed, every member having reported;
        False while this master's own checks of them still run.

        A failed link r -> t has honest explanations (t cannot be reached, r cannot dial
        out, the path between them) and dishonest ones (r lies, t refuses r): one report
        convicts nobody, so the master looks for itself. Where it knew in advance (two
        peers behind NAT, no relay: ``rnd.blame``) its choice holds. A newcomer goes
        before a member: a joiner cannot evict the group. Between equals, when r dials t
        directly, the master dials t's listener itself (:class:`CheckReach`): t goes if
        it does not answer, r if it does (then r's side is what fails, or r lies). A
        link the master cannot check (t behind NAT) drops t, unless a peer was already
        dropped on r's word since r registered: then r goes."""
        for r, t in rnd.accused.items():
            if self.paths.get((r, t)) == "lan":
                # A dial on the LAN proves nothing against either peer (another network
                # behind the same public address, a firewall between them, or a lie of
                # either one): nobody goes for it; the round is tried again with the
                # link over the public addresses, as if the LAN had never been there.
                rnd.lan_failed.add((r, t))
                self.lan_failed.add((r, t))
        checks = [t for r, t in rnd.accused.items() if self._checkable(rnd, r, t)]
        for t in checks:
            if t not in rnd.reach:
                rnd.reach[t] = None
                out.append(CheckReach(rnd.epoch, t, self.peers[t].p2p_addr))
        if any(rnd.reach[t] is None for t in checks):
            return False
        for r, t in sorted(rnd.accused.items()):
            if r in rnd.unreachable or t in rnd.unreachable or (r, t) in rnd.lan_failed:
                continue  # decided already (a liar, no path, a LAN dial)
            if (r, t) in rnd.blame:
                rnd.unreachable.add(rnd.blame[(r, t)])
                continue
            newcomers = [x for x in (r, t) if self.peers[x].status is not PeerStatus.ACCEPTED]
            if len(newcomers) == 1:
                rnd.unreachable.add(newcomers[0])
            elif t in rnd.reach:
                if rnd.reach[t]:
                    rnd.unreachable.add(r)
                    rnd.reasons.setdefault(r, (
                        f"it reported its ring link to peer {t} failed, but this master "
                        f"reaches peer {t}'s p2p port: this peer's outgoing connections "
                        "fail (a firewall?)"))
                else:
                    rnd.unreachable.add(t)
            elif self.peers[r].dropped_on_its_word:
                rnd.unreachable.add(r)
                rnd.reasons.setdefault(r, (
                    f"it reported its ring link to peer {t} failed after a peer was "
                    "already dropped on its word: its own link is taken to be what fails"))
            else:
                self.peers[r].dropped_on_its_word += 1
                rnd.unreachable.add(t)
        return True

    def _checkable(self, rnd: Round, r: int, t: int) -> bool:
        """Whether the master settles the failed link r -> t by dialing t itself: a
        direct link between two peers of the same standing, t reachable from here."""
        if r in rnd.unreachable or t in rnd.unreachable or (r, t) in rnd.blame:
            return False
        if (self.peers[r].status is PeerStatus.ACCEPTED) != (
                self.peers[t].status is PeerStatus.ACCEPTED):
            return False
        return self.paths.get((r, t)) == "direct" and self.peers[t].reachable

    # --- are_peers_pending() and deadlines -------------------------------------------

    def _on_pending_query(self, peer: int, rec: PeerRecord, msg: m.PendingQuery,
                          out: list[Command]) -> None:
        if not msg.collective or rec.status is not PeerStatus.ACCEPTED:
            n = len(self._roster_now().pending)
            out.append(Send(peer, m.PendingAnswer(req=msg.req, pending=n > 0, count=n)))
            return
        if peer in self.pending_votes:
            # Its earlier question was given up (a cancelled caller): this one replaces it.
            self.pending_votes[peer] = msg.req
            self._maybe_answer_pending(out)
            return
        if not self.pending_votes:
            self.pending_deadline = self._arm(PendingDeadline(), msg.timeout, out)
        self.pending_votes[peer] = msg.req
        self._maybe_answer_pending(out)

    def _maybe_answer_pending(self, out: list[Command]) -> None:
        """Answers the collective are_peers_pending() once every accepted peer asked, or
        waits in another operation that waits for the askers: a topology vote (then the
        askers hear True, "call update_topology()", and join it), or a collective or sync
        that waits only for askers fresh out of the last topology round (members or
        joiners that have made no other call since). That is how loops meet after a
        round: a joiner's first question (or a voter's, whose loop went back to the
        question after an update_topology() of its own error handling) comes while the
        others, past update_topology(), already wait for it in a reduce or a sync. A
        peer parked in a collective that waits for a peer that has made calls since
        the round is not taken for an answer: that peer may be asking from one thread
        while its collective comes from another (PCCL's cross-step reduce), and
        answering early would pair this question with the parked peer's next one.
        Every asker gets the same answer."""
        if not self.pending_votes:
            return
        askers = set(self.pending_votes)
        busy = askers | self.votes | self.opt_votes
        joiners = askers & self.fresh
        if joiners:
            waiting: list[tuple[int, Collection[int]]] = [
                (col.group, col.inits) for col in self.collectives.values() if col.op_id < 0]
            waiting += [(sync.group, sync.inits) for sync in self.syncs.values()
                        if not sync.planned]
            for group, inits in waiting:
                missing = set(self._members(group)) - set(inits)
                if missing and missing <= joiners:
                    busy |= set(inits)
        roster = self._roster_now()
        if not _covers(busy, roster.accepted):
            return
        n = len(roster.pending)
        pending = n > 0 or bool(self.votes)
        voters, self.pending_votes = self.pending_votes, {}
        self.fresh -= set(voters)
        self._disarm(self.pending_deadline)
        for p, req in sorted(voters.items()):
            out.append(Send(p, m.PendingAnswer(req=req, pending=pending, count=n)))

    def _arm(self, what: Deadline, timeout: float, out: list[Command]) -> int:
        """Starts the deadline of a wait for other peers (0 = none asked for)."""
        if not 0.0 < timeout <= MAX_DEADLINE:  # also refuses NaN
            return 0
        did = self.next_deadline
        self.next_deadline += 1
        self.deadlines[did] = what
        out.append(ArmDeadline(did, float(timeout)))
        return did

    def _disarm(self, did: int) -> None:
        self.deadlines.pop(did, None)

    def _missing(self, members: list[int], present: Container[int]) -> list[int]:
        return [p for p in members if p not in present]

    def _on_deadline(self, did: int, out: list[Command]) -> None:
        what = self.deadlines.pop(did, None)
        if what is None:
            return
        advice = ("nothing was changed; retry (a peer that never makes the same call "
                  "holds everyone up: check that every peer runs the same sequence of "
                  "collective calls)")
        if isinstance(what, CollectiveDeadline):
            col = self.collectives.get((what.group, what.tag))
            if col is not None and col.deadline == did and col.op_id < 0:
                late = self._missing(self._members(col.group), col.inits)
                self._fail_unperformed(col, ErrorKind.OperationTimeoutError, (
                    f"collective tag {col.tag}: peers {late} did not join it in time; "
                    f"{advice}"), out)
        elif isinstance(what, SyncDeadline):
            sync = self.syncs.get(what.group)
            if sync is not None and sync.deadline == did and not sync.planned:
                late = self._missing(self._members(sync.group), sync.inits)
                self._fail_sync(sync, ErrorKind.OperationTimeoutError, (
                    f"sync_shared_state(): peers {late} did not join it in time; {advice}"),
                    out)
        elif isinstance(what, VoteDeadline):
            if did == self.vote_deadline and self.votes and (
                    self.phase is Phase.VOTE_ACCEPT_NEW_PEERS or self._repairing()):
                late = self._missing(self.accepted(), self.votes)
                voters = sorted(self.votes)
                self.votes.clear()
                if self.phase is Phase.VOTE_ACCEPT_NEW_PEERS:
                    self.phase = Phase.IDLE
                for p in voters:
                    out.append(Send(p, m.TopologyUpdateFailed(
                        kind=ErrorKind.OperationTimeoutError,
                        message=f"update_topology(): peers {late} did not vote in time; "
                                f"{advice}")))
        elif isinstance(what, OptimizeDeadline):
            if did == self.opt_deadline and self.opt_votes and not self.opt_probers \
                    and not self.opt_solving:
                late = self._missing(self.accepted(), self.opt_votes)
                self._fail_optimize(f"optimize_topology(): peers {late} did not vote in "
                                    f"time; {advice}", out)
        elif isinstance(what, PendingDeadline) and did == self.pending_deadline:
            late = self._missing(self.accepted(), self.pending_votes)
            askers, self.pending_votes = self.pending_votes, {}
            for p, req in sorted(askers.items()):
                out.append(Send(p, m.PendingAnswer(
                    req=req, pending=False, ok=False, kind=ErrorKind.OperationTimeoutError,
                    message=f"are_peers_pending(): peers {late} did not ask in time; "
                            f"{advice}")))

    # --- ring repair --------------------------------------------------------------------

    def _repairing(self) -> bool:
        return self.round is not None and self.round.repair

    def _broken(self) -> list[int]:
        """Groups whose ring cannot carry collectives until it is rebuilt."""
        return sorted(g for g, ms in self._groups().items()
                      if g not in self.repair_failed and self._ring_broken(g))

    def _maybe_repair(self, out: list[Command]) -> None:
        """PCCL drops a dead peer without anyone calling update_topology(): once no ring
        operation runs in a group whose ring lost a peer (or whose links failed), and no
        topology operation is under way, rebuild that group's ring from the peers left.
        Collectives called meanwhile wait for it and then run on the new ring."""
        if not self.repair_rings or self.phase is not Phase.IDLE or self.votes \
                or self.opt_votes or self.recovery_awaiting:
            return
        running = {c.group for c in self.collectives.values() if c.op_id >= 0}
        groups = [g for g in self._broken() if g not in running]
        if not groups:
            return
        for col in self.collectives.values():
            if col.group in groups:
                # Their members' early ring ops end with the links being replaced.
                self._void_early(col, "the ring is being rebuilt", out)
        members = [p for p in self.accepted() if self.peers[p].peer_group in groups]
        self.attempts = 0
        self._start_round(members, out, repair=True)

    def _forget(self, peer: int, reason: str, out: list[Command], *,
                tell: bool = False, elsewhere: bool = False) -> PeerRecord:
        """Drops ``peer`` everywhere except the round/vote bookkeeping of the caller."""
        rec = self.peers.pop(peer)
        self._roster_changed()
        out.append(Disconnect(peer, reason, tell, elsewhere))
        self._note("dropped", f"peer {peer} ({rec.status.name.lower()}, group "
                   f"{rec.peer_group}) dropped: {reason}", (peer,), rec.peer_group)
        self.punch_failed = {pair for pair in self.punch_failed if peer not in pair}
        self.lan_failed = {pair for pair in self.lan_failed if peer not in pair}
        self.votes.discard(peer)
        self.pending_votes.pop(peer, None)
        self.fresh.discard(peer)
        if rec.status is PeerStatus.ACCEPTED:
            # The links of its group's ring are broken until the next round. The ring
            # itself is kept as built: it describes the links peers actually hold.
            self._mark_broken(rec.peer_group)
            self._collectives_lose(peer, rec.peer_group, out)
            self._sync_lose(peer, rec.peer_group, out)
        self.last_revision.pop(peer, None)
        return rec

    def _remove(self, peer: int, out: list[Command], reason: str = "connection lost") -> None:
        rec = self._forget(peer, reason, out)
        if self.phase is Phase.OPTIMIZE_TOPOLOGY and rec.status is PeerStatus.ACCEPTED:
            self._fail_optimize(f"peer {peer} was lost during optimize_topology(); the "
                                "previous rings stay (call update_topology())", out)
        rnd = self.round
        if rnd is not None and peer in rnd.member_set:
            # The ring that was being built contains a dead peer: build it again.
            remaining = [p for p in rnd.members if p != peer]
            self._start_round(remaining, out, repair=rnd.repair)
        elif self.phase is Phase.VOTE_ACCEPT_NEW_PEERS:
            self._maybe_finish_vote(out)
        if rec.status is PeerStatus.ACCEPTED and (self.phase is not Phase.ESTABLISH_P2P
                                                  or self._repairing()):
            # (A repair rebuilds only some groups: the others must hear of the loss now.)
            self._broadcast_world(self.accepted(), out)
        self._admit_if_nobody_accepted(out)
        self._maybe_answer_pending(out)

    def _admit_if_nobody_accepted(self, out: list[Command]) -> None:
        if self.recovery_awaiting:
            return  # a restarted master waits for the rest of the old group
        if self.phase is Phase.IDLE and not self.accepted() and self.pending():
            self.attempts = 0
            self._start_round(self.pending(), out)

    def _maybe_finish_vote(self, out: list[Command]) -> None:
        roster = self._roster_now()
        if not roster.accepted:
            self.votes.clear()
            self.phase = Phase.IDLE
            return
        if not _covers(self.votes, roster.accepted):
            return
        accepted = list(roster.accepted)
        self._disarm(self.vote_deadline)
        pending = self.pending()
        if not pending and not self.rings_stale:
            # Nothing changed: the rings in place are still right.
            voters = sorted(self.votes)
            self.votes.clear()
            self.phase = Phase.IDLE
            self.fresh |= set(voters)
            for p in voters:
                g = self.peers[p].peer_group
                out.append(Send(p, m.TopologyUpdated(
                    epoch=self.ring_epochs.get(g, self.epoch),
                    mesh_max_bytes=self.mesh_limits.get(g, 0),
                    mesh_order=self._mesh_order_sent(g))))
            return
        self.attempts = 0
        self._start_round(accepted + pending, out)

    @property
    def quorum_on(self) -> bool:
        """Whether rounds need a quorum of each group's previous ring (see __init__)."""
        if self.standby:
            return True
        return bool(self.quorum)

    def held_groups(self) -> list[int]:
        """The groups this master holds: accepted peers, or peers back from another
        master that it is gathering (what a challenge tells a peer with several
        masters, which registers where its group is held)."""
        roster = self._roster_now()
        held = set(roster.groups)
        held.update(self.peers[p].peer_group for p in roster.pending
                    if self.peers[p].claim is not None)
        return sorted(held)

    def _quorum_filter(self, members: list[int], out: list[Command]
                       ) -> tuple[list[int], dict[int, list[tuple[int, list[int]]]]]:
        """The members a round may go on with when quorums count, and per group the
        rings the round is counted against, (epoch, members) with the installed one
        first (``(0, [])`` if none is known): sent to the members with the proposal
        (EstablishP2P.quorum_*), which they report to any master they go to next.

        Per group, the members must hold a strict majority of (a) the newest ring known
        to have been installed: this master's last, or one a member brings back from
        another master (the base it reports), and (b) every ring proposed after that
        one that a member saw: each may have been installed without the member hearing
        of it. If they do not, the group cannot move on here safely (a master elsewhere
        may hold that majority): when this master's own ring is what lacks a majority,
        the group's members go to their other masters; else the members that brought
        the newer rings go (they join again once this master's epochs have passed
        theirs, which registering them has ensured), and the rest are counted again.
        A standby starts no group: a group with no installed ring known (here or brought
        by a member) is sent away.

        tests/test_failover.py checks on a model of two masters and peers moving between
        them at random that installed rings form one chain, each holding a majority of
        the one before."""
        keep: list[int] = []
        counted: dict[int, list[tuple[int, list[int]]]] = {}
        by_group: dict[int, list[int]] = {}
        for p in members:
            by_group.setdefault(self.peers[p].peer_group, []).append(p)
        for g, ms in by_group.items():
            while ms:
                own = self.lineage.get(g)
                claims = {p: c for p in ms if (c := self.peers[p].claim) is not None}
                # Rings to count, each with whether its ids are this master's.
                base: tuple[int, frozenset[int], bool] | None = (
                    (own[0], own[1], True) if own is not None else None)
                for c in claims.values():
                    if c.base and (base is None or c.base_epoch > base[0]):
                        base = (c.base_epoch, c.base, False)
                if self.standby and base is None:
                    # (Peers that saw only a first ring proposed know of nothing
                    # installed: the master that proposed it may have started over.)
                    self._send_away(g, ms, "this master is a standby and knows of no "
                                    f"ring of peer group {g}: it only takes a group over "
                                    "from the peers of a lost master", out)
                    ms = []
                    break
                rings = [base] if base is not None else []
                floor = base[0] if base is not None else -1
                for c in claims.values():
                    for epoch, ring in ((c.epoch, c.ring), *c.more):
                        if ring and epoch > floor and (epoch, ring, False) not in rings:
                            rings.append((epoch, ring, False))
                # This master's ring counts by the ids here (not those of peers back from
                # elsewhere: theirs are another master's); the others by the ids the
                # claimants had where those rings were proposed.
                ids_here = {p for p in ms if p not in claims}
                ids_there = {self.peers[p].was for p in claims}
                short = None
                for epoch, ring, here in rings:
                    present = len(ring & (ids_here if here else ids_there))
                    if 2 * present <= len(ring):
                        short = (epoch, ring, here, present)
                        break
                if short is None:
                    counted[g] = ([] if base is not None else [(0, [])]) + [
                        (e, sorted(r)) for e, r, _ in rings]
                    break
                epoch, ring, here, present = short
                own_epoch = own[0] if own is not None else -1
                newer = [p for p, c in claims.items() if max(c.epoch, c.base_epoch) > own_epoch]
                away = list(ms) if here or not newer else newer
                self._send_away(g, away, (
                    f"no quorum here for peer group {g}: {present} of the {len(ring)} peers "
                    f"of its ring of epoch {epoch} ({sorted(ring)})"), out, epoch)
                ms = [p for p in ms if p not in away]
            keep.extend(ms)
        return sorted(keep), counted

    def _send_away(self, group: int, peers: list[int], why: str, out: list[Command],
                   epoch: int = 0) -> None:
        """Drops ``peers`` telling them to try their other masters first."""
        self._note("no_quorum", f"{why}; sending {sorted(peers)} to their other masters",
                   sorted(peers), group, epoch)
        for p in peers:
            self._forget(p, why, out, tell=True, elsewhere=True)

    def _start_round(self, members: list[int], out: list[Command], *,
                     repair: bool = False) -> None:
        # (Without quorums peers learn installed rings from topology_updated alone.)
        counted: dict[int, list[tuple[int, list[int]]]] = {}
        if self.quorum_on:
            members, counted = self._quorum_filter(members, out)
        if not members:
            self.round = None
            self.phase = Phase.IDLE
            if not repair:
                self.votes.clear()
            # Peers that registered meanwhile have nobody left to vote them in.
            self._admit_if_nobody_accepted(out)
            self._after_repair(out)
            return
        self.epoch += 1
        if self.first_own_epoch is None:
            self.first_own_epoch = self.epoch
        self.phase = Phase.ESTABLISH_P2P
        members = sorted(members)  # join order: peer ids are handed out increasingly
        rnd = self.round = Round(self.epoch, members, repair=repair,
                                 groups={self.peers[p].peer_group for p in members})
        self.relay_tokens.clear()
        self.mesh_tokens.clear()
        self.mesh_paths.clear()
        self.paths.clear()
        self.lan_dials.clear()
        rnd.rings = self._rings_of(members)
        for group, ring in rnd.rings.items():
            n = len(ring)
            routes = {}
            for i, p in enumerate(ring):
                if n > 1:
                    routes[p] = self._route(p, ring[(i + 1) % n], rnd)
            order = rnd.mesh_orders[group] = self._mesh_order(ring)
            rank = {p: r for r, p in enumerate(order)}
            mesh = self._mesh_routes(order)
            if mesh is not None:
                rnd.mesh_ok.add(group)
            for i, p in enumerate(ring):
                nxt = ring[(i + 1) % n] if n > 1 else -1
                prv = ring[(i - 1) % n] if n > 1 else -1
                route, token = routes.get(p, ("direct", b""))
                prev_route, prev_token = routes.get(prv, ("direct", b""))
                partners = ([order[r] for r in algorithms.mesh_partners(rank[p], n)]
                            if mesh is not None else [])
                rnd.next_of[p] = nxt
                rnd.partners_of[p] = frozenset(partners)
                out_routes = [mesh[(p, q)] for q in partners] if mesh is not None else []
                in_routes = [mesh[(q, p)] for q in partners] if mesh is not None else []
                out.append(Send(p, m.EstablishP2P(
                    epoch=self.epoch,
                    # Peers take their ring from ``world``; a proposal's members matter
                    # only to quorums (several masters): k ids to each of k peers.
                    ring=list(ring) if self.quorum_on else [],
                    next_id=nxt,
                    next_addr=self._dial_addr(p, nxt) if nxt >= 0 else "",
                    route=route, token=token, prev_id=prv,
                    prev_addr=self._inbound_addr(prv, prev_route),
                    prev_route=prev_route, prev_token=prev_token,
                    mesh_ids=partners,
                    mesh_addrs=[self._dial_addr(p, q) for q in partners],
                    mesh_routes=[r for r, _ in out_routes],
                    mesh_tokens=[t for _, t in out_routes],
                    mesh_in_addrs=[self.peers[q].p2p_addr for q in partners],
                    mesh_in_routes=[r for r, _ in in_routes],
                    mesh_in_tokens=[t for _, t in in_routes],
                    quorum_epochs=[e for e, _ in counted.get(group, [])],
                    quorum_rings=[list(r) for _, r in counted.get(group, [])],
                    **self._keys([nxt, prv, *partners]),
                )))

    def _keys(self, ids: Iterable[int]) -> dict[str, Any]:
        """The ``key_ids``/``keys`` fields naming the static keys of ``ids``."""
        known = sorted({i for i in ids if i in self.peers and self.peers[i].key})
        return {"key_ids": known, "keys": [self.peers[i].key for i in known]}

    def _mesh_routes(self, order: list[int]) -> dict[tuple[int, int], tuple[str, bytes]] | None:
        """How each directed mesh link over the ranks ``order`` is made: (sender,
        receiver) -> (route, token), dialed when the receiver is reachable, dialed back
        when only the sender is, else through the relay. None: no mesh for this ring
        (the mesh is off, the ring is too small, or two partners behind NAT cannot use
        the relay); its collectives then all take the ring, and nobody is dropped for
        it."""
        n = len(order)
        if self.mesh_max_bytes == 0 or n < 2:
            return None
        routes: dict[tuple[int, int], tuple[str, bytes]] = {}
        lan: dict[tuple[int, int], str] = {}
        for i, p in enumerate(order):
            for r in algorithms.mesh_partners(i, n):
                q = order[r]
                a, b = self.peers[p], self.peers[q]
                token = self._token(f"{self.epoch}:{p}:{q}:mesh")
                if b.reachable:
                    routes[(p, q)] = ("direct", b"")
                elif a.reachable:
                    routes[(p, q)] = ("reverse", token)
                elif lan_addr := self._lan_addr(p, q):
                    # (A failed one turns the mesh off for the epoch, as any failed mesh
                    # pool does, and the pair is relayed from the next round on.)
                    routes[(p, q)] = ("direct", b"")
                    lan[(p, q)] = lan_addr
                elif self.relay and a.allow_relay and b.allow_relay:
                    routes[(p, q)] = ("relay", token)
                else:
                    return None
        self.lan_dials.update(lan)
        for pair, (route, token) in routes.items():
            self.mesh_paths[pair] = "lan" if pair in lan else route
            if route == "relay":  # the relay splices only what presents a known token
                self.relay_tokens[token] = pair
                self.mesh_tokens.add(token)
        return routes

    def _mesh_limit(self, group: int, ring: list[int], rnd: Round) -> int:
        """The mesh limit of ``group``'s new ring (see pccl.algorithms): 0 without mesh
        links, the master's fixed value if it has one, else the cost model's, from the
        dials measured in this round and the group's measured bandwidths."""
        if group not in rnd.mesh_ok or len(ring) < 2:
            return 0
        if self.mesh_max_bytes > 0:
            return self.mesh_max_bytes
        members = set(ring)
        rates = sorted(r for (a, b), (r, _) in self.bandwidth.items()
                       if a in members and b in members and r > 0)
        bandwidth = rates[len(rates) // 2] if rates else algorithms.DEFAULT_BANDWIDTH
        one_way = algorithms.one_way_latency(rnd.dials.get(group, []))
        self.mesh_inputs[group] = (one_way, bandwidth)
        # Pairs the probes measured have their own latency (regions); the others are
        # taken at this round's dials. Only when the probes measured pairs of the group.
        per_pair = any((ring[i - 1], ring[i]) in self.latency for i in range(len(ring)))
        order = rnd.mesh_orders.get(group, ring)
        return algorithms.mesh_max_bytes(
            len(ring), one_way, bandwidth,
            latency=self._ring_latency(ring, one_way) if per_pair else None,
            mesh_latency=self._ring_latency(order, one_way) if per_pair else None)

    def _token(self, label: str) -> bytes:
        """A route token: unguessable without the master's key, the same for the same
        label (so a deterministic state stays deterministic under a fixed key)."""
        return hashlib.blake2b(label.encode(), key=self._token_key, digest_size=16).digest()

    def _inbound_addr(self, prv: int, route: str) -> str:
        """Where the receiver of ``prv``'s ring link meets it: its punch port of this
        epoch for a punched link, else its p2p address."""
        if prv < 0:
            return ""
        rec = self.peers[prv]
        if route == "punch" and rec.punch_addrs:
            return rec.punch_addrs[self.epoch % len(rec.punch_addrs)]
        return rec.p2p_addr

    def _route(self, p: int, nxt: int, rnd: Round) -> tuple[str, bytes]:
        """How ``p`` gets its streams to ``nxt``: dial it when it is reachable; else be
        dialed by it when ``p`` is reachable; else, both behind the same NAT, dial it on
        their LAN ("lan": a direct route to its private address); else (or once that
        failed) punch a hole between the two, with the relay to fall back on if both
        allow it (if not, a failed punch drops one of them, with the reason)."""
        a, b = self.peers[p], self.peers[nxt]
        token = self._token(f"{self.epoch}:{p}:{nxt}")
        if b.reachable:
            route = ("direct", b"")
        elif a.reachable:
            route = ("reverse", token)
        elif lan_addr := self._lan_addr(p, nxt):
            # The peers' own direct dial (a pool, no hole, no relay), to the address the
            # receiver gave (Hello.local_addrs) and pinned to the key it proved like
            # any dial: a peer that lies about its address only fails its own link. A
            # failure drops nobody: the round is tried again over the public addresses
            # (_settle_disputes, lan_failed).
            self.lan_dials[(p, nxt)] = lan_addr
            self.paths[(p, nxt)] = "lan"
            return ("direct", b"")
        else:
            # Both behind NAT: punch a hole (simultaneous open to each other's public
            # address as seen here); if that fails, the relay, where allowed (at once
            # when punching between these two failed before).
            relay_ok = self.relay and a.allow_relay and b.allow_relay
            route = ("relay" if relay_ok and (p, nxt) in self.punch_failed else "punch",
                     token)
            if relay_ok:
                self.relay_tokens[token] = (p, nxt)
            else:
                refusers = [x for x in (p, nxt) if not self.peers[x].allow_relay]
                why = (f"peer {refusers[0]} refuses relaying (allow_relay=False)"
                       if refusers else "the master does not relay (max_relayed_streams=0)")
                # Drop a refuser rather than a peer that would have accepted the relay,
                # and a newcomer rather than a member of the group.
                blame = sorted(refusers or [p, nxt], key=lambda x: (
                    self.peers[x].status is PeerStatus.ACCEPTED, x != nxt))[0]
                rnd.blame[(p, nxt)] = blame
                rnd.reasons[blame] = (
                    f"peers {p} and {nxt} are both unreachable from outside (behind NAT or a "
                    f"firewall), hole punching between them failed (a NAT that maps each "
                    f"connection to a new port?), and {why}; forward a port to one of them "
                    "(p2p_listen_port and p2p_advertise_address) or allow relaying")
        self.paths[(p, nxt)] = route[0]
        return route

    def _lan_addr(self, p: int, q: int) -> str:
        """Where ``p`` dials ``q`` on a LAN the two share ("" if they do not seem to):
        both came from the same public host (the master saw their control connections
        from one address: one NAT), ``q`` said where it listens on its private network,
        and no dial there from ``p`` failed yet. Only asked for two peers that cannot be
        dialed from outside."""
        a, b = self.peers[p], self.peers[q]
        if not a.public_host or a.public_host != b.public_host or not b.lan_addrs \
                or (p, q) in self.lan_failed:
            return ""
        return b.lan_addrs[0]

    def _dial_addr(self, p: int, q: int) -> str:
        """The address ``p`` dials for its link to ``q`` in this round: the LAN one of a
        "lan" link, else ``q``'s p2p address."""
        return self.lan_dials.get((p, q)) or self.peers[q].p2p_addr

    def links_now(self) -> dict[tuple[int, int], str]:
        """How each ring link of the current rings runs, as an operator should see it:
        the route the master chose (``paths``), except that a "punch" link whose hole
        punching failed runs through the relay (``Relayed``), and says so."""
        return {pair: "relay" if path == "punch" and pair in self.punch_failed else path
                for pair, path in self.paths.items()}

    def _rings_of(self, members: list[int]) -> dict[int, list[int]]:
        """Rings per group: the optimized order where there is one, join order else;
        started where the mesh's ranks start when the mesh's order is a rotation of the
        ring (the same cycle: nothing more to send than the ring)."""
        rings: dict[int, list[int]] = {}
        for p in members:
            rings.setdefault(self.peers[p].peer_group, []).append(p)
        for g, ring in rings.items():
            order = {p: i for i, p in enumerate(self.ring_order.get(g, []))}
            ring.sort(key=lambda p: (0, order[p]) if p in order else (1, p))
            mesh = self._mesh_order(ring)
            if _rotation_of(mesh, ring):
                rings[g] = mesh
        return rings

    def _maybe_finish_round(self, out: list[Command]) -> None:
        rnd = self.round
        assert rnd is not None
        if not _covers(rnd.reported, rnd.member_set):
            return
        if not self._settle_disputes(rnd, out):
            return  # (ReachChecked comes back here)
        if rnd.unreachable:
            self.attempts += 1
            dropped_accepted = False
            for p in sorted(rnd.unreachable):
                reason = rnd.reasons.get(p)
                rec = self._forget(p, reason or "unreachable by its ring neighbour over p2p",
                                   out, tell=reason is not None)
                dropped_accepted |= rec.status is PeerStatus.ACCEPTED
            remaining = [p for p in rnd.members if p not in rnd.unreachable]
            self._note("round_failed", f"round {rnd.epoch} ({'repair' if rnd.repair else 'vote'},"
                       f" attempt {self.attempts} of {self.max_establish_attempts}): "
                       f"unreachable {sorted(rnd.unreachable)}"
                       + ("; trying again without them"
                          if self.attempts < self.max_establish_attempts else "; giving up"),
                       sorted(rnd.unreachable), value=rnd.epoch)
            if self.attempts < self.max_establish_attempts:
                self._start_round(remaining, out, repair=rnd.repair)
                return
            self.round = None
            self.phase = Phase.IDLE
            if rnd.repair:
                # Stop repairing these groups until a voted round succeeds, and fail what
                # waited for the repair instead of holding it.
                self.repair_failed |= rnd.groups
                if dropped_accepted:
                    self._broadcast_world(self.accepted(), out)
                for col in list(self.collectives.values()):
                    if col.group in rnd.groups and col.op_id < 0:
                        self._fail_unperformed(col, ErrorKind.PeerConnectionError, (
                            f"the ring of peer group {col.group} could not be rebuilt after "
                            f"a peer was lost ({self.attempts} attempts); call "
                            "update_topology() and retry"), out)
                self._after_repair(out)
                return
            voters = sorted(self.votes)
            self.votes.clear()
            self.rings_stale = True
            if dropped_accepted:
                # The accepted set shrank: tell the rest, as any other loss does.
                self._broadcast_world(self.accepted(), out)
            for p in voters:
                out.append(Send(p, m.TopologyUpdateFailed(
                    message=f"p2p rings could not be formed after {self.attempts} attempts")))
            self._admit_if_nobody_accepted(out)
            return
        if rnd.lan_failed:
            # Not an attempt that counts: every retry takes at least one more pair off
            # the LAN for good (lan_failed), so they end.
            self._note("round_failed", f"round {rnd.epoch} ({'repair' if rnd.repair else 'vote'}"
                       f"): ring links dialed on a LAN failed ("
                       + ", ".join(f"{r} -> {t}" for r, t in sorted(rnd.lan_failed))
                       + "); trying again over the public addresses",
                       sorted({x for pair in rnd.lan_failed for x in pair}), value=rnd.epoch)
            self._start_round(rnd.members, out, repair=rnd.repair)
            return
        if rnd.repair:
            rings = rnd.rings
            for g in rnd.groups:
                if g in rings:
                    self.rings[g] = rings[g]
                    self.ring_epochs[g] = rnd.epoch
                    self.lineage[g] = (rnd.epoch, frozenset(rings[g]))
                    self.mesh_limits[g] = self._mesh_limit(g, rings[g], rnd)
                    self.mesh_orders[g] = rnd.mesh_orders.get(g, rings[g])
                else:
                    self.rings.pop(g, None)
                    self.ring_epochs.pop(g, None)
                    self.mesh_limits.pop(g, None)
                    self.mesh_orders.pop(g, None)
                self.broken_groups.discard(g)
            self._note("repair", f"ring epoch {rnd.epoch}: rebuilt without the lost peers: "
                       + self._describe_rings(rnd.groups), rnd.members, value=rnd.epoch)
            self.round = None
            self.phase = Phase.IDLE
            self._broadcast_world(rnd.members, out)
            for p in rnd.members:
                g = self.peers[p].peer_group
                out.append(Send(p, m.TopologyUpdated(
                    epoch=rnd.epoch, repair=True, mesh_max_bytes=self.mesh_limits.get(g, 0),
                    mesh_order=self._mesh_order_sent(g))))
            self._after_repair(out)
            return
        joined = [p for p in rnd.members if self.peers[p].status is PeerStatus.REGISTERED]
        for p in rnd.members:
            self.peers[p].status = PeerStatus.ACCEPTED
            self.peers[p].claim = None  # part of this master's lineage from now on
        self._roster_changed()
        if joined:
            self._note("admitted", f"admitted peer{'s' if len(joined) > 1 else ''} "
                       + ", ".join(f"{p} (group {self.peers[p].peer_group})" for p in joined),
                       joined, value=rnd.epoch)
        # Every member has just come out of update_topology() (or was admitted by it).
        self.fresh |= set(rnd.members)
        self.rings = rnd.rings
        self.ring_epochs = dict.fromkeys(self.rings, rnd.epoch)
        for g, ring in self.rings.items():
            self.lineage[g] = (rnd.epoch, frozenset(ring))
        self.mesh_limits = {g: self._mesh_limit(g, ring, rnd) for g, ring in self.rings.items()}
        self.mesh_orders = {g: rnd.mesh_orders.get(g, ring) for g, ring in self.rings.items()}
        self.rings_stale = rnd.reorder_pending
        self.broken_groups.clear()
        self.repair_failed.clear()
        self.round = None
        self.phase = Phase.IDLE
        self.votes.clear()
        self._note("ring", f"ring epoch {rnd.epoch}: " + self._describe_rings(self.rings),
                   rnd.members, value=rnd.epoch)
        self._broadcast_world(rnd.members, out)
        for p in rnd.members:
            g = self.peers[p].peer_group
            out.append(Send(p, m.TopologyUpdated(
                epoch=rnd.epoch, mesh_max_bytes=self.mesh_limits.get(g, 0),
                mesh_order=self._mesh_order_sent(g))))

    def _describe_rings(self, groups: Collection[int]) -> str:
        def mesh(g: int) -> str:
            order = self._mesh_order_sent(g)
            return f" (mesh ranks {' '.join(map(str, order))})" if order else ""

        return "; ".join(
            f"group {g}: " + (" -> ".join(map(str, self.rings[g])) + mesh(g)
                              if len(self.rings[g]) > 1 else f"{self.rings[g][0]} alone")
            for g in sorted(groups) if self.rings.get(g)) or "no rings"

    def _after_repair(self, out: list[Command]) -> None:
        """A repair ended: count the votes cast meanwhile, run what waited for it."""
        if self.votes:
            self.phase = Phase.VOTE_ACCEPT_NEW_PEERS
            self._maybe_finish_vote(out)
            self._maybe_answer_pending(out)
            return
        for col in list(self.collectives.values()):
            if col.op_id < 0 and (col.group, col.tag) in self.collectives:
                self._maybe_perform(col, out)
        # A repair that dropped a peer may leave every remaining member asking
        # are_peers_pending(): answer them now (found by the population test: nothing
        # else would, and the run hung with joiners waiting).
        self._maybe_answer_pending(out)

    def _broadcast_world(self, targets: list[int], out: list[Command]) -> None:
        sizes = self.group_sizes()
        total = sum(sizes.values())
        largest = max(sizes.values(), default=0)
        # One message per group, the same object for each of its members: the server
        # encodes it once (codec.FrameCache). Messages are not modified once made.
        worlds: dict[int, m.WorldInfo] = {}
        for p in targets:
            group = self.peers[p].peer_group
            world = worlds.get(group)
            if world is None:
                left_epoch, left = self._left(group)
                world = worlds[group] = m.WorldInfo(
                    epoch=self.epoch,
                    ring=[q for q in self.rings.get(group, []) if q in self.peers],
                    global_world_size=total,
                    peer_group_world_size=sizes.get(group, 0),
                    num_peer_groups=len(sizes),
                    largest_peer_group_world_size=largest,
                    left=left, left_epoch=left_epoch,
                )
            out.append(Send(p, world))

    def _left(self, group: int) -> tuple[int, list[int]]:
        """(epoch, peers): who left ``group``'s installed ring gracefully since it was
        installed (its lineage lost them on their ``Leave``); (-1, []) when none did."""
        lin = self.lineage.get(group)
        ring = self.rings.get(group)
        if lin is None or ring is None or lin[0] != self.ring_epochs.get(group):
            return -1, []
        left = sorted(set(ring) - lin[1])
        return (lin[0], left) if left else (-1, [])

    # --- collectives ------------------------------------------------------------------

    def _members(self, group: int) -> list[int]:
        return list(self._roster_now().groups.get(group, ()))

    def _member_set(self, group: int) -> frozenset[int]:
        return self._roster_now().group_set(group)

    def _all_joined(self, group: int, calls: Collection[int]) -> bool:
        """Whether every accepted member of ``group`` is among ``calls``."""
        return _covers(calls, self._member_set(group))

    def _group_in_vote(self, group: int) -> bool:
        """Whether a member of ``group`` is in update_topology() or optimize_topology()."""
        return any(r.peer_group == group and r.status is PeerStatus.ACCEPTED
                   for votes in (self.votes, self.opt_votes) for p in votes
                   if (r := self.peers.get(p)) is not None)

    def _on_collective_init(self, peer: int, msg: m.CollectiveInit, out: list[Command]) -> None:
        rec = self.peers[peer]

        def refuse(kind: ErrorKind, why: str) -> None:
            out.append(Send(peer, m.CollectiveOutcome(tag=msg.tag, op_id=-1, ok=False,
                                                      kind=kind, message=why)))
            if msg.early_op >= 0 and rec.status is PeerStatus.ACCEPTED:
                # Its early ring op may have left pieces on the group's links.
                self._mark_broken(rec.peer_group)

        if rec.status is not PeerStatus.ACCEPTED:
            refuse(ErrorKind.InvalidUsageError,
                   "collectives need an accepted peer; call connect() first")
            return
        key = (rec.peer_group, msg.tag)
        col = self.collectives.get(key)
        if col is not None and (peer in col.inits or col.op_id >= 0):
            refuse(ErrorKind.InvalidUsageError,
                   f"tag {msg.tag} is already in flight on this peer group")
            return
        if col is None:
            col = self.collectives[key] = Collective(rec.peer_group, msg.tag)
            col.deadline = self._arm(CollectiveDeadline(col.group, col.tag), msg.timeout, out)
        col.inits[peer] = msg
        self.fresh.discard(peer)
        if msg.early_op >= 0:
            self._on_early_start(peer, col, msg, out)
        if self._group_in_vote(rec.peer_group):
            self._fail_unperformed(col, ErrorKind.CollectiveAbortedError, (
                "other peers of the group are in update_topology(); call update_topology() "
                "and retry"), out)
            return
        if (rec.peer_group in self.repair_failed or not self.repair_rings) \
                and self._ring_broken(rec.peer_group):
            # Fail fast: no repair is coming, waiting could wait forever.
            self._fail_unperformed(col, ErrorKind.PeerConnectionError, (
                f"the ring of peer group {col.group} is broken and could not be rebuilt; "
                "call update_topology() and retry"), out)
            return
        self._maybe_perform(col, out)
        self._maybe_answer_pending(out)

    def _early_op(self, group: int, tag: int) -> int:
        """The op id an early start of ``tag`` must carry now (see m.early_op_id)."""
        epoch = self.ring_epochs.get(group, 0)
        counted, n = self.early_counts.get((group, tag), (epoch, 0))
        return m.early_op_id(epoch, tag, n if counted == epoch else 0)

    def _on_early_start(self, peer: int, col: Collective, msg: m.CollectiveInit,
                        out: list[Command]) -> None:
        """A member started the ring as op ``msg.early_op`` when it called. It stands if
        it is the op the ring's members agree on now; otherwise the attempt is void."""
        rnd = self.round
        why = ""
        if col.early_void:
            why = "an earlier member's early start failed"
        elif msg.epoch != self.ring_epochs.get(col.group, 0) or self._ring_broken(col.group) \
                or (rnd is not None and rnd.repair and col.group in rnd.groups):
            why = f"the ring of epoch {msg.epoch} is no longer current"
        elif msg.early_op != self._early_op(col.group, col.tag) \
                or col.early not in (-1, msg.early_op):
            why = "the members derived different op ids"
        col.early_peers.add(peer)
        if not why:
            col.early = msg.early_op
        else:
            # Its ring op cannot complete; tell it now (it waits for a perform then).
            out.append(Send(peer, m.CollectiveAbort(tag=col.tag, op_id=msg.early_op,
                                                    message=f"early start void: {why}")))
            col.early = col.early if col.early >= 0 else msg.early_op
            self._void_early(col, why, out)

    def _void_early(self, col: Collective, why: str, out: list[Command]) -> None:
        """Calls off the early start of a collective not yet performed: its members stop
        their ring op (and run the collective again once performed), and the ring is
        rebuilt first (its links may hold pieces of the void op)."""
        if col.early < 0 or col.op_id >= 0:
            return
        if not col.early_void:
            col.early_void = True
            self.collective_paths["voided"] += 1
            for p in sorted(col.early_peers):
                if p not in col.early_done:
                    out.append(Send(p, m.CollectiveAbort(tag=col.tag, op_id=col.early,
                                                         message=f"early start void: {why}")))
        self._mark_broken(col.group)

    def _maybe_perform(self, col: Collective, out: list[Command]) -> None:
        if not self._all_joined(col.group, col.inits):
            return
        members = self._members(col.group)
        rnd = self.round
        if self._ring_broken(col.group) or (rnd is not None and rnd.repair
                                            and col.group in rnd.groups):
            self._void_early(col, "the ring is being rebuilt", out)
            return  # held until the master repaired the ring (see _maybe_repair)
        self._disarm(col.deadline)
        first = col.inits[members[0]]
        # Shapes are compared where both peers know theirs (a raw buffer has none).
        ref = next((tuple(col.inits[p].shape) for p in members if col.inits[p].shape), ())
        odd = [p for p in members if _describe(col.inits[p]) != _describe(first)
               or col.inits[p].shape and tuple(col.inits[p].shape) != ref]
        if odd:
            detail = "; ".join(f"peer {p}: {_explain(col.inits[p])}"
                               for p in [members[0], *odd])
            self._fail_unperformed(col, ErrorKind.InvalidUsageError, (
                f"peers disagree on collective tag {col.tag}: {detail}"), out)
            return
        if col.early < 0 and all(col.inits[p].data for p in members) \
                and len(members) * len(first.data) <= VIA_MASTER_MAX_TOTAL:
            self._reduce_here(col, first, out)
            return
        ring = self.rings.get(col.group, [])
        col.epoch = self.ring_epochs.get(col.group, 0)
        if col.early >= 0 and not col.early_void:
            # Every member called and agrees: the early start stands. The perform arms the
            # early members' stall timers and starts the others' ring op under that id.
            col.op_id = col.early
            col.reported = {p for p in col.early_done if p in ring}
            self.collective_paths["early"] += 1
        else:
            col.op_id = self.next_op_id
            self.next_op_id += 1
        col.participants = list(ring)
        col.participant_set = frozenset(ring)
        self._note("collective_started", "", ring, col.group, col.op_id,
                   first.count * _ELEMENT_BYTES.get(first.dtype, 0), col.tag)
        for rank, p in enumerate(ring):
            out.append(Send(p, m.CollectivePerform(tag=col.tag, op_id=col.op_id,
                                                   epoch=col.epoch, rank=rank,
                                                   world=len(ring))))
        if col.reported:
            self._maybe_finish_collective(col, out)

    def _reduce_here(self, col: Collective, first: m.CollectiveInit,
                     out: list[Command]) -> None:
        """Every member sent its tensor with its init (a tiny collective): reduce them
        here, in the ring's order (the bytes the ring would produce), and answer everyone
        with the result: one round trip, no ring."""
        ring = self.rings.get(col.group, [])
        size = first.count * _ELEMENT_BYTES.get(first.dtype, 0)
        bad = [p for p in ring if len(col.inits[p].data) != size]
        if bad or first.quant_algorithm:
            self._fail_unperformed(col, ErrorKind.InvalidUsageError, (
                f"collective tag {col.tag}: peers {bad} sent tensors that are not "
                f"{first.count} x {_name(DataType, first.dtype)} ({size} bytes)"
                if bad else "quantized collectives are not reduced by the master"), out)
            return
        try:
            result = _core.star_all_reduce([col.inits[p].data for p in ring], first.dtype,
                                           first.op)
        except PCCLError as e:
            self._fail_unperformed(col, ErrorKind.of(e), str(e), out)
            return
        del self.collectives[(col.group, col.tag)]
        self._disarm(col.deadline)
        col.op_id = self.next_op_id
        self.next_op_id += 1
        self.collective_paths["via_master"] += 1
        self._note("collective_started", "", ring, col.group, col.op_id, size, col.tag)
        self._note("collective_done", "", ring, col.group, col.op_id, tag=col.tag)
        for p in ring:
            out.append(Send(p, m.CollectiveOutcome(tag=col.tag, op_id=col.op_id, ok=True,
                                                   kind=ErrorKind.NONE, message="",
                                                   data=result, world=len(ring))))

    def _mark_broken(self, group: int) -> None:
        """The links of ``group``'s ring cannot carry collectives until a round rebuilds
        them (the repair starts once nothing runs there; see _maybe_repair)."""
        self.rings_stale = True
        self.broken_groups.add(group)

    def _ring_broken(self, group: int) -> bool:
        """Whether collectives in ``group`` cannot succeed before update_topology()."""
        ring = self.rings.get(group, [])
        return group in self.broken_groups or not self._roster_now().is_ring_of(group, ring)

    def _fail_unperformed(self, col: Collective, kind: ErrorKind, why: str, out: list[Command],
                          skip: int | None = None) -> None:
        del self.collectives[(col.group, col.tag)]
        self._disarm(col.deadline)
        if col.early >= 0:
            # Early members ran the ring: its links may hold pieces of the op.
            self._mark_broken(col.group)
        self._note("collective_failed", f"collective tag {col.tag} of group {col.group} "
                   f"called off before it ran: {why}", sorted(col.inits), col.group, -1,
                   tag=col.tag)
        for p in col.inits:
            if p == skip:
                continue
            out.append(Send(p, m.CollectiveOutcome(tag=col.tag, op_id=-1, ok=False,
                                                   kind=kind, message=why)))

    def _on_collective_done(self, peer: int, msg: m.CollectiveDone, out: list[Command]) -> None:
        col = self.collectives.get((self.peers[peer].peer_group, msg.tag))
        if col is not None and col.op_id < 0 and msg.op_id >= 0 and msg.op_id == col.early \
                and peer in col.early_peers:
            # An early ring op ended before every member had called.
            if col.early_void:
                return  # it runs again once performed
            col.early_done[peer] = msg
            if not msg.ok:
                self._void_early(col, f"peer {peer}: {msg.message}", out)
            return
        if col is not None and msg.op_id < 0 and col.op_id < 0 and peer in col.inits:
            # The peer gave up before the collective ran: call it off for everyone.
            # The withdrawing peer hears nothing (it may already reuse the tag), unless
            # it sent its tensor to be reduced here: it waits to hear which came first.
            self._fail_unperformed(col, ErrorKind.CollectiveAbortedError,
                                   f"peer {peer} withdrew from collective tag {msg.tag}", out,
                                   skip=None if col.inits[peer].data else peer)
            return
        if col is not None and msg.op_id < 0 and peer in col.participant_set:
            # It gave up while our perform was on its way: it will not run the ring.
            msg = dataclasses.replace(msg, op_id=col.op_id, ok=False)
        if col is None or col.op_id != msg.op_id or peer not in col.participant_set:
            return  # stale: the collective already ended
        col.reported.add(peer)
        if not msg.ok:
            self._collective_failed(col, msg.kind or ErrorKind.PeerConnectionError,
                                    f"peer {peer}: {msg.message}", out)
        self._maybe_finish_collective(col, out)

    def _collective_failed(self, col: Collective, kind: ErrorKind, why: str,
                           out: list[Command]) -> None:
        if col.error is not None:
            return
        col.error = (kind, why)
        for p in col.participants:
            if p not in col.reported:
                out.append(Send(p, m.CollectiveAbort(tag=col.tag, op_id=col.op_id, message=why)))

    def _maybe_finish_collective(self, col: Collective, out: list[Command]) -> None:
        if not _covers(col.reported, col.participant_set):
            return
        del self.collectives[(col.group, col.tag)]
        kind, why = col.error or (ErrorKind.NONE, "")
        if col.error is None:
            self._note("collective_done", "", col.participants, col.group, col.op_id,
                       tag=col.tag)
            if col.epoch == self.ring_epochs.get(col.group, 0):
                counted, n = self.early_counts.get((col.group, col.tag), (col.epoch, 0))
                self.early_counts[(col.group, col.tag)] = (
                    col.epoch, n + 1 if counted == col.epoch else 1)
        else:
            self._note("collective_failed", f"collective op {col.op_id} (tag {col.tag}) of "
                       f"group {col.group} aborted: {kind}: {why}", col.participants,
                       col.group, col.op_id, tag=col.tag)
        if col.error is not None:
            # Links may hold half-sent pieces: the rings must be rebuilt before reuse.
            self._mark_broken(col.group)
        for p in col.participants:
            out.append(Send(p, m.CollectiveOutcome(tag=col.tag, op_id=col.op_id,
                                                   ok=col.error is None, kind=kind, message=why)))

    def _collectives_lose(self, peer: int, group: int, out: list[Command]) -> None:
        for col in list(self.collectives.values()):
            if col.group != group:
                continue
            if col.op_id < 0 and not self.repair_rings:
                col.inits.pop(peer, None)
                self._fail_unperformed(col, ErrorKind.PeerConnectionError, (
                    f"peer {peer} left the group; call update_topology() and retry"), out)
            elif col.op_id < 0:
                # As in PCCL, the others go on without it: the collective runs once the
                # master repaired the ring (or at once, if the rest already joined).
                col.inits.pop(peer, None)
                col.early_peers.discard(peer)
                col.early_done.pop(peer, None)
                self._void_early(col, f"peer {peer} left the group", out)
                if not col.inits:
                    del self.collectives[(col.group, col.tag)]
                    self._disarm(col.deadline)
            elif peer in col.participant_set:
                col.participants.remove(peer)
                col.participant_set = col.participant_set - {peer}
                col.reported.discard(peer)
                self._collective_failed(col, ErrorKind.PeerConnectionError,
                                        f"peer {peer} was lost during the collective", out)
                self._maybe_finish_collective(col, out)

    # --- shared state -------------------------------------------------------------------

    def _on_sync_init(self, peer: int, msg: m.SyncInit, out: list[Command]) -> None:
        rec = self.peers[peer]

        def refuse(kind: ErrorKind, why: str) -> None:
            out.append(Send(peer, m.SyncOutcome(ok=False, kind=kind, message=why, revision=0)))

        if rec.status is not PeerStatus.ACCEPTED:
            refuse(ErrorKind.InvalidUsageError, "sync_shared_state() needs an accepted peer")
            return
        n = len(msg.keys)
        if not (len(msg.dtypes) == len(msg.counts) == len(msg.hashes) == len(msg.unequal) == n
                and len(set(msg.keys)) == n and msg.strategy in (0, 1, 2)):
            refuse(ErrorKind.ProtocolError, "malformed shared-state description")
            return
        sync = self.syncs.get(rec.peer_group)
        if sync is None:
            sync = self.syncs[rec.peer_group] = Sync(rec.peer_group)
            sync.deadline = self._arm(SyncDeadline(sync.group), msg.timeout, out)
        if sync.planned or peer in sync.inits:
            refuse(ErrorKind.InvalidUsageError,
                   "a shared-state sync is already running in this group")
            return
        sync.inits[peer] = msg
        self.fresh.discard(peer)
        if self._group_in_vote(rec.peer_group):
            self._fail_sync(sync, ErrorKind.CollectiveAbortedError, (
                "other peers of the group are in update_topology(); call update_topology() "
                "and retry"), out)
            return
        self._maybe_plan_sync(sync, out)
        self._maybe_answer_pending(out)

    def _fail_sync(self, sync: Sync, kind: ErrorKind, why: str, out: list[Command]) -> None:
        del self.syncs[sync.group]
        self._disarm(sync.deadline)
        self._note("sync_failed", f"shared-state sync of group {sync.group} failed: {why}",
                   sorted(sync.participants if sync.planned else sync.inits), sync.group,
                   sync.revision)
        # Once planned, peers refused at the plan already have their outcome.
        for p in sorted(sync.participants if sync.planned else sync.inits):
            if p in self.peers:
                out.append(Send(p, m.SyncOutcome(ok=False, kind=kind, message=why, revision=0)))

    def _maybe_plan_sync(self, sync: Sync, out: list[Command]) -> None:
        if not self._all_joined(sync.group, sync.inits):
            return
        members = self._members(sync.group)
        self._disarm(sync.deadline)
        inits = {p: sync.inits[p] for p in members}
        excluded: dict[int, tuple[ErrorKind, str]] = {}
        # 1. Revisions must advance by exactly one (fresh peers and receivers excepted).
        for p, i in inits.items():
            last = self.last_revision.get(p)
            if i.strategy != RECEIVE_ONLY and last is not None and i.revision != last + 1:
                excluded[p] = (ErrorKind.RevisionIncrementViolationError, (
                    f"revision {i.revision} does not follow this peer's last synced revision "
                    f"{last}; increment state.revision by exactly one per sync"))
        voters = [p for p in members if p not in excluded and inits[p].strategy != RECEIVE_ONLY]
        # Peers that never completed a sync in this run (fresh joiners) do not vote while
        # a peer that did is present: they would outvote the running state with their
        # step-0 tensors and roll it back. They receive the running state instead.
        veterans = [p for p in voters if p in self.last_revision]
        fresh = {p for p in voters if p not in self.last_revision} if veterans else set()
        voters = veterans or voters
        if not voters:
            for p in members:
                excluded.setdefault(p, (ErrorKind.NoSharedStateAvailableError, (
                    "no peer of the group offers shared state (all are RECEIVE_ONLY or "
                    "were refused)")))
            self._finish_plan(sync, members, excluded, {}, 0, out)
            return
        # 2. Popular revision (ties: the higher one).
        revs = Counter(inits[p].revision for p in voters)
        revision = max(revs, key=lambda r: (revs[r], r))
        # 3. Popular schema: the key set with dtypes and counts most voters share
        #    (ties: the schema of the earliest-joined voter).
        def schema(p: int) -> tuple[tuple[str, int, int], ...]:
            i = inits[p]
            return tuple(sorted(zip(i.keys, i.dtypes, i.counts)))

        schemas = Counter(schema(p) for p in voters)
        best = max(schemas.values())
        popular_schema = next(schema(p) for p in voters if schemas[schema(p)] == best)
        shape = {k: (d, c) for k, d, c in popular_schema}
        for p in members:
            if p in excluded:
                continue
            mine = {k: (d, c) for k, d, c in schema(p)}
            if mine != shape:
                missing = sorted(set(shape) - set(mine))
                extra = sorted(set(mine) - set(shape))
                differ = sorted(k for k in set(mine) & set(shape) if mine[k] != shape[k])
                key = (missing or extra or differ)[0]
                hint = (" (optimizer state that torch creates at the first step() is a "
                        "common cause: see 'Optimizer state' in docs/training.md)"
                        if missing or extra else "")
                excluded[p] = (ErrorKind.InvalidUsageError, (
                    f"shared state key {key!r} does not match the group's: missing {missing}, "
                    f"unexpected {extra}, different dtype/size {differ}{hint}"))
        voters = [p for p in voters if p not in excluded]
        # 4. Popular content per key (ties: the content of the earliest-joined holder).
        holders: dict[str, dict[bytes, list[int]]] = {}
        for p in voters:
            i = inits[p]
            for k, h in zip(i.keys, i.hashes):
                holders.setdefault(k, {}).setdefault(h, []).append(p)
        popular: dict[str, bytes] = {}
        for k, by_hash in holders.items():
            popular[k] = max(by_hash, key=lambda h: (len(by_hash[h]), -min(by_hash[h])))
        self._finish_plan(sync, members, excluded, popular, revision, out,
                          holders=holders, inits=inits, fresh=fresh)

    def _finish_plan(self, sync: Sync, members: list[int],
                     excluded: dict[int, tuple[ErrorKind, str]],
                     popular: dict[str, bytes], revision: int, out: list[Command], *,
                     holders: dict[str, dict[bytes, list[int]]] | None = None,
                     inits: dict[int, m.SyncInit] | None = None,
                     fresh: AbstractSet[int] = frozenset()) -> None:
        for p, (kind, why) in excluded.items():
            out.append(Send(p, m.SyncOutcome(ok=False, kind=kind, message=why, revision=0)))
        participants = [p for p in members if p not in excluded]
        if not participants:
            del self.syncs[sync.group]
            return
        assert holders is not None and inits is not None
        sync.planned = True
        sync.revision = revision
        sync.participants = participants
        sync.participant_set = frozenset(participants)
        self._note("sync_planned", f"shared-state sync of group {sync.group} to revision "
                   f"{revision}: {len(participants)} peers", participants, sync.group, revision)
        stale = set(participants)
        self.transfer_tokens = {t: fh for t, fh in self.transfer_tokens.items()
                                if fh[0] not in stale and fh[0] in self.peers}
        for n, p in enumerate(participants):
            i = inits[p]
            mine = dict(zip(i.keys, i.hashes))
            unequal = dict(zip(i.keys, i.unequal))
            keys: list[str] = []
            hashes: list[bytes] = []
            sources: list[list[int]] = []
            if i.strategy != SEND_ONLY:
                for k in sorted(popular):
                    if mine[k] == popular[k]:
                        continue
                    if unequal[k] and i.strategy != RECEIVE_ONLY and p not in fresh:
                        continue  # allowed to differ; only fresh receivers take it
                    srcs = holders[k][popular[k]]
                    # Rotate per fetcher and per key so the load spreads over sources;
                    # holders the fetcher can dial come first (the rest need the relay).
                    r = (n + len(keys)) % len(srcs)
                    srcs = srcs[r:] + srcs[:r]
                    srcs.sort(key=lambda s: not self.peers[s].reachable)
                    keys.append(k)
                    hashes.append(popular[k])
                    sources.append(srcs)
            ids = sorted({s for srcs in sources for s in srcs})
            relays = []
            for s in ids:
                token = b""
                if not self.peers[s].reachable and self.relay:
                    token = self._token(f"sync:{self.epoch}:{revision}:{p}:{s}")
                    self.transfer_tokens[token] = (p, s)
                relays.append(token)
            out.append(Send(p, m.SyncPlan(
                revision=revision, fetch_keys=keys, fetch_hashes=hashes, fetch_sources=sources,
                source_ids=ids, source_addrs=[self.peers[s].p2p_addr for s in ids],
                source_relays=relays, **self._keys(ids))))

    def _on_sync_done(self, peer: int, msg: m.SyncDone, out: list[Command]) -> None:
        sync = self.syncs.get(self.peers[peer].peer_group)
        if sync is None or not sync.planned or peer not in sync.participant_set:
            return
        sync.reported.add(peer)
        if not msg.ok and sync.error is None:
            sync.error = (msg.kind or ErrorKind.PeerConnectionError, f"peer {peer}: {msg.message}")
        self._maybe_finish_sync(sync, out)

    def _on_sync_withdraw(self, peer: int, out: list[Command]) -> None:
        """The peer's caller cancelled: no one may commit what it will not. Failing the
        sync at once (not after the others report) also sends the withdrawing peer the
        one outcome it waits for; a sync already decided has its outcome on the way."""
        sync = self.syncs.get(self.peers[peer].peer_group)
        if sync is None or peer not in (sync.participant_set if sync.planned else sync.inits):
            return
        self._fail_sync(sync, ErrorKind.CollectiveAbortedError, (
            f"peer {peer} cancelled its sync_shared_state(); nothing was committed, retry"),
            out)

    def _maybe_finish_sync(self, sync: Sync, out: list[Command]) -> None:
        if not _covers(sync.reported, sync.participant_set):
            return
        del self.syncs[sync.group]
        kind, why = sync.error or (ErrorKind.NONE, "")
        if sync.error is None:
            self._note("sync_done", f"shared-state sync of group {sync.group} committed "
                       f"revision {sync.revision}", sync.participants, sync.group,
                       sync.revision)
        else:
            self._note("sync_failed", f"shared-state sync of group {sync.group} to revision "
                       f"{sync.revision} failed: {kind}: {why}", sync.participants,
                       sync.group, sync.revision)
        for p in sync.participants:
            if sync.error is None:
                self.last_revision[p] = sync.revision
            out.append(Send(p, m.SyncOutcome(ok=sync.error is None, kind=kind, message=why,
                                             revision=sync.revision)))

    def _sync_lose(self, peer: int, group: int, out: list[Command]) -> None:
        sync = self.syncs.get(group)
        if sync is None:
            return
        sync.inits.pop(peer, None)
        if not sync.planned:
            if not sync.inits:
                del self.syncs[group]
                self._disarm(sync.deadline)
            else:
                self._maybe_plan_sync(sync, out)
        elif peer in sync.participant_set:
            # The plan stands: a fetcher whose source it was moves on to the next holder
            # of the same content (or reports the failure), and the others commit only
            # if every remaining participant succeeds.
            sync.participants.remove(peer)
            sync.participant_set = sync.participant_set - {peer}
            sync.reported.discard(peer)
            self._maybe_finish_sync(sync, out)


    # --- topology optimization ------------------------------------------------------

    def _on_optimize_vote(self, peer: int, rec: PeerRecord, msg: m.OptimizeTopology,
                          out: list[Command]) -> None:
        if rec.status is not PeerStatus.ACCEPTED:
            out.append(Send(peer, m.OptimizeFailed(
                message="optimize_topology() before this peer was accepted")))
            return
        if self.phase not in (Phase.IDLE, Phase.OPTIMIZE_TOPOLOGY) or peer in self.opt_votes \
                or self.opt_probers or self.opt_solving:
            out.append(Send(peer, m.OptimizeFailed(
                message="another topology operation is in progress; retry after it")))
            return
        self.phase = Phase.OPTIMIZE_TOPOLOGY
        if not self.opt_votes:
            self.opt_deadline = self._arm(OptimizeDeadline(), msg.timeout, out)
        self.opt_votes.add(peer)
        self._call_off_waiting_ops(peer, rec.peer_group, "optimize_topology()", out)
        if not _covers(self.opt_votes, self._roster_now().accepted):
            self._maybe_answer_pending(out)
            return
        self._disarm(self.opt_deadline)
        self.opt_round += 1
        # Forget the pairs of peers that are gone (ids are never reused): in a long run
        # with churn they would pile up, k per departed peer.
        self.bandwidth = {pair: v for pair, v in self.bandwidth.items()
                          if pair[0] in self.peers and pair[1] in self.peers}
        self.latency = {pair: v for pair, v in self.latency.items()
                        if pair[0] in self.peers and pair[1] in self.peers}
        self.mesh_order_memo.clear()
        # Measure every ordered pair inside a group that is unknown or too old.
        plan: dict[int, list[int]] = {}
        for members in self._groups().values():
            if len(members) < 3:
                continue  # one ring only: nothing to choose
            for i in members:
                for j in members:
                    if i == j or not self.peers[j].reachable:
                        continue  # a peer behind NAT cannot be dialed: estimated instead
                    seen = self.bandwidth.get((i, j))
                    if seen is None or self.opt_round - seen[1] > self.max_bandwidth_age:
                        plan.setdefault(i, []).append(j)
        self.opt_probers = set(plan)
        for i, targets in sorted(plan.items()):
            out.append(Send(i, m.ProbeRequest(
                target_ids=targets, target_addrs=[self.peers[t].p2p_addr for t in targets],
                seconds=self.probe_seconds, **self._keys(targets))))
        if not plan:
            self._solve_all(out)

    probe_seconds = 0.25

    def _groups(self) -> dict[int, list[int]]:
        return {g: list(ms) for g, ms in self._roster_now().groups.items()}

    def _on_probe_report(self, peer: int, msg: m.ProbeReport, out: list[Command]) -> None:
        if peer not in self.opt_probers or len(msg.target_ids) != len(msg.rates):
            return
        self.opt_probers.discard(peer)
        dials = msg.dial_seconds if len(msg.dial_seconds) == len(msg.target_ids) else []
        for t, rate in zip(msg.target_ids, msg.rates):
            if t in self.peers:
                self.bandwidth[(peer, t)] = (max(float(rate), 0.0), self.opt_round)
        for t, dial in zip(msg.target_ids, dials):
            if t in self.peers and math.isfinite(dial) and dial >= 0:
                self.latency[(peer, t)] = (algorithms.one_way_latency([dial]), self.opt_round)
                self.mesh_order_memo.clear()
        if not self.opt_probers:
            self._solve_all(out)

    #: What the solver assumes of a link between two peers behind NAT, against a direct
    #: one: it is hole-punched (one stream instead of a pool) or, if that fails, relayed
    #: through the master (every byte twice through one process). A guess, not a
    #: measurement (the probes cannot reach such a pair); it makes the solver place NAT'd
    #: peers between dialable ones where the group allows.
    nat_pair_factor = 0.25

    def _edge_bandwidth(self, i: int, j: int, typical: float) -> float:
        """The solver's bytes/s for ring link i -> j: measured when j can be dialed; a
        link into a peer behind NAT is made by a connection it opens (reverse), as good
        as a ``typical`` measured link, or punched / relayed when i is behind NAT too."""
        if self.peers[j].reachable:
            return self.bandwidth.get((i, j), (0.0, 0))[0]
        if self.peers[i].reachable or self._lan_addr(i, j):
            return typical  # (dialed the other way, or on a LAN the two share)
        return typical * self.nat_pair_factor

    def _solve_all(self, out: list[Command]) -> None:
        groups = {g: ms for g, ms in self._groups().items() if len(ms) >= 3}
        self.opt_solving = set(groups)
        for g, members in sorted(groups.items()):
            inside = set(members)  # (a list's `in` made this k^3)
            measured = sorted(r for (a, b), (r, _) in self.bandwidth.items()
                              if a in inside and b in inside and r > 0)
            typical = measured[len(measured) // 2] if measured else 1.0
            bw = [[0.0 if i == j else self._edge_bandwidth(i, j, typical)
                   for j in members] for i in members]
            out.append(Solve(self.opt_round, g, list(members), bw, self._latencies(members)))
        if not groups:
            self._finish_optimize(out)

    #: The largest group :meth:`_mesh_order` orders (beyond it the mesh takes the ring's
    #: order; up to pccl.algorithms.MESH_ORDER_MAX_WORLD it is built to the mesh's shape,
    #: above only the ring's best start is chosen: 8 starts, each k log k lookups).
    mesh_order_max_peers = 4096

    def _mesh_order(self, ring: list[int]) -> list[int]:
        """The mesh's rank order over ``ring`` (peer ids): pccl.algorithms.mesh_order
        from the latencies the probes measured (with regions: split along a rank bit,
        so that few of the mesh's steps cross between them). The ring's own order
        without measured latencies or without a mesh."""
        k = len(ring)
        if k < 3 or k > self.mesh_order_max_peers or self.mesh_max_bytes == 0 \
                or not self.latency:
            return ring
        key = tuple(ring)
        got = self.mesh_order_memo.get(key)
        if got is not None:
            return got
        known = sorted(self.latency[(ring[i - 1], ring[i])][0] for i in range(k)
                       if (ring[i - 1], ring[i]) in self.latency)
        if not known:
            return ring
        order = [ring[i] for i in algorithms.mesh_order(
            k, self._ring_latency(ring, known[len(known) // 2]))]
        if len(self.mesh_order_memo) >= 64:
            self.mesh_order_memo.clear()
        self.mesh_order_memo[key] = order
        if _rotation_of(order, ring):  # (the ring is then started there: _rings_of)
            self.mesh_order_memo[tuple(order)] = order
        return order

    def _mesh_order_sent(self, group: int) -> list[int]:
        """What TopologyUpdated carries of ``group``'s mesh order: empty where it is the
        ring's own."""
        order = self.mesh_orders.get(group, [])
        return [] if order == self.rings.get(group, []) else list(order)

    def _ring_latency(self, ring: list[int], fallback: float) -> Callable[[int, int], float]:
        """One-way latency from ring position ``i`` to ``j``, as the probes measured the
        pair, else ``fallback`` (pccl.algorithms' ``latency`` arguments)."""
        pairs = self.latency
        return lambda i, j: pairs.get((ring[i], ring[j]), (fallback, 0))[0]

    def _latencies(self, members: list[int]) -> list[list[float]] | None:
        """The solver's latency matrix over ``members``: measured pairs as measured, a
        pair no probe could measure (into a peer behind NAT) at the group's median, as
        its bandwidth is; None when no pair of the group was measured."""
        inside = set(members)
        known = sorted(v for (a, b), (v, _) in self.latency.items()
                       if a in inside and b in inside and a != b)
        if not known:
            return None
        typical = known[len(known) // 2]
        return [[0.0 if i == j else self.latency.get((i, j), (typical, 0))[0]
                 for j in members] for i in members]

    def _on_solved(self, ev: Solved, out: list[Command]) -> None:
        if ev.round_id != self.opt_round or ev.group not in self.opt_solving:
            return
        self.opt_solving.discard(ev.group)
        if sorted(ev.ring) == sorted(p for p in ev.ring if p in self.peers):
            self.ring_order[ev.group] = list(ev.ring)
        if not self.opt_solving:
            self._finish_optimize(out)

    def _finish_optimize(self, out: list[Command]) -> None:
        """Rebuild the rings in the new order; voters return at the round's end."""
        voters = self.opt_votes
        self.opt_votes = set()
        self._note("optimized", f"optimize_topology() round {self.opt_round}: ring order "
                   + "; ".join(f"group {g}: {order}" for g, order in sorted(self.ring_order.items())
                               if g in self._groups()), sorted(voters), value=self.opt_round)
        self.phase = Phase.IDLE
        self.votes = set(voters)
        self.phase = Phase.VOTE_ACCEPT_NEW_PEERS
        self.rings_stale = True  # force a round, even with nothing pending
        self.attempts = 0
        self._start_round(self.accepted(), out)

    def _fail_optimize(self, why: str, out: list[Command]) -> None:
        self._note("optimize_failed", f"optimize_topology() round {self.opt_round} failed: "
                   f"{why}", sorted(self.opt_votes), value=self.opt_round)
        for p in sorted(self.opt_votes):
            if p in self.peers:
                out.append(Send(p, m.OptimizeFailed(message=why)))
        self.opt_votes = set()
        self.opt_probers = set()
        self.opt_solving = set()
        self._disarm(self.opt_deadline)
        self.phase = Phase.IDLE

    def _call_off_waiting_ops(self, peer: int, group: int, what: str,
                              out: list[Command]) -> None:
        """A voter will not join the group's waiting collectives or sync, and the peers
        waiting in them will not vote: call those off (retryable) instead of waiting."""
        sync = self.syncs.get(group)
        if sync is not None and not sync.planned:
            self._fail_sync(sync, ErrorKind.CollectiveAbortedError, (
                f"peer {peer} called {what} while this peer called sync_shared_state(); "
                f"call {what} and retry"), out)
        for col in list(self.collectives.values()):
            if col.group == group and col.op_id < 0:
                self._fail_unperformed(col, ErrorKind.CollectiveAbortedError, (
                    f"peer {peer} called {what} while this peer called a collective "
                    f"(tag {col.tag}); call {what} and retry"), out)

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
]
