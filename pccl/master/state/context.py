"""What the master's sub-machines share: one :class:`Context` with the configuration, the
peers (:mod:`~pccl.master.state.roster`), the installed rings, the round in progress, the
route tables (:class:`Links`), the notes and the deadlines, and the helpers every
sub-machine uses on them (``note``, ``arm``, ``forget``, ...).

A sub-machine owns its own fields and reads the others' only through this context; what
one of them does that the others must react to (a peer dropped, a vote started, a repair
started or ended, ...) it announces through :attr:`Context.hub`, which
:class:`~pccl.master.state.MasterState` implements by calling the :class:`Part` methods
of its sub-machines in a fixed order (documented there)."""

from __future__ import annotations

import dataclasses
import hashlib
from collections import deque
from collections.abc import Collection, Container, Iterable
from typing import Any, Protocol

from pccl.master.state.events import (
    COUNTED_NOTES,
    MAX_DEADLINE,
    TIMELINE_NOTES,
    ArmDeadline,
    Command,
    Deadline,
    Disconnect,
    Note,
    PeerStatus,
    Phase,
)
from pccl.master.state.roster import PeerRecord, Roster, covers


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
    # Ring links dialed on a LAN that failed (see Links.lan_failed): the round is
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
class Links:
    """How the links of the current round are made (the server reads the tokens: its
    relay splices only connections that present one), and what earlier rounds learned
    of links that failed."""

    # The current round's links that may go through the relay (routed "relay", or
    # "punch" with the relay to fall back on): token -> (sender, receiver). The relay
    # splices only connections that present one of these.
    relay_tokens: dict[bytes, tuple[int, int]] = dataclasses.field(default_factory=dict)
    # How each ring link of the current round is made: (sender, receiver) -> "direct",
    # "lan", "reverse", "punch" or "relay" (for status pages and logs).
    paths: dict[tuple[int, int], str] = dataclasses.field(default_factory=dict)
    # The address a link of the current round routed "lan" (ring or mesh) dials:
    # the receiver's listener on the LAN the two share (others dial p2p_addr).
    lan_dials: dict[tuple[int, int], str] = dataclasses.field(default_factory=dict)
    # Relay tokens of mesh links (not ring links: their fallback says nothing of a
    # ring link's hole punching).
    mesh_tokens: set[bytes] = dataclasses.field(default_factory=set)
    # How each mesh link of the current round is made: (sender, receiver) -> route.
    mesh_paths: dict[tuple[int, int], str] = dataclasses.field(default_factory=dict)
    # Ring links whose hole punching failed (symmetric NAT): the next rounds relay
    # them at once instead of trying for PUNCH_TIMEOUT again. Forgotten with a peer.
    punch_failed: set[tuple[int, int]] = dataclasses.field(default_factory=set)
    # Links whose dial on the LAN failed (two networks behind one public address, as
    # with carrier-grade NAT, or a firewall between them): the next rounds take
    # them over the public addresses (punch, relay). Forgotten with a peer.
    lan_failed: set[tuple[int, int]] = dataclasses.field(default_factory=set)
    # Shared-state transfers through the relay: token -> (fetcher, holder). Kept
    # until the next sync plan of either (bounded by the peers' count squared).
    transfer_tokens: dict[bytes, tuple[int, int]] = dataclasses.field(default_factory=dict)

    def new_round(self) -> None:
        """A round starts: its links replace the last round's."""
        self.relay_tokens.clear()
        self.mesh_tokens.clear()
        self.mesh_paths.clear()
        self.paths.clear()
        self.lan_dials.clear()


class Hub(Protocol):
    """The reactions one sub-machine sets off in the others (implemented by
    :class:`~pccl.master.state.MasterState`, which calls each sub-machine's :class:`Part`
    method of the same name in a fixed order) and the questions it asks of them."""

    def peer_dropped(self, peer: int, rec: PeerRecord, out: list[Command]) -> None: ...

    def vote_started(self, peer: int, group: int, what: str, out: list[Command]) -> None: ...

    def waiting_changed(self, out: list[Command]) -> None: ...

    def repair_started(self, groups: Collection[int], out: list[Command]) -> None: ...

    def repair_failed(self, groups: Collection[int], attempts: int,
                      out: list[Command]) -> None: ...

    def rings_ready(self, out: list[Command]) -> None: ...

    def optimized(self, voters: set[int], out: list[Command]) -> None: ...

    def waiting(self) -> list[tuple[int, Collection[int]]]: ...

    def running_groups(self) -> set[int]: ...


class Part:
    """A sub-machine: what it hears of the others (each method does nothing unless the
    sub-machine overrides it). ``out`` collects the commands, as in ``handle()``."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx

    def __eq__(self, other: object) -> bool:
        """Equal to a sub-machine in the same state (tests compare whole masters; the
        shared context is compared on its own)."""
        return type(other) is type(self) and _fields(self, "ctx") == _fields(other, "ctx")

    def on_peer_dropped(self, peer: int, rec: PeerRecord, out: list[Command]) -> None:
        """``peer`` was forgotten (lost, left, dropped by a round or sent away): it is out
        of ``ctx.peers`` already; ``rec`` is what it was."""

    def on_vote_started(self, peer: int, group: int, what: str, out: list[Command]) -> None:
        """``peer`` of ``group`` called ``what`` (update_topology() or
        optimize_topology()): it will not join the group's waiting operations."""

    def on_waiting_changed(self, out: list[Command]) -> None:
        """A peer began to wait for others (or stopped): are_peers_pending() may have its
        answer now."""

    def on_repair_started(self, groups: Collection[int], out: list[Command]) -> None:
        """The master rebuilds the rings of ``groups`` on its own."""

    def on_repair_failed(self, groups: Collection[int], attempts: int,
                         out: list[Command]) -> None:
        """A repair of ``groups`` gave up after ``attempts`` rounds."""

    def on_rings_ready(self, out: list[Command]) -> None:
        """A repair ended (or had nothing left to rebuild): what waited for it may run."""

    def on_optimized(self, voters: set[int], out: list[Command]) -> None:
        """optimize_topology() chose new ring orders: ``voters`` wait for the new rings."""

    def waiting(self) -> Iterable[tuple[int, Collection[int]]]:
        """The operations that wait for members' calls: (group, who called)."""
        return ()

    def running_groups(self) -> Iterable[int]:
        """Groups where a ring operation runs (their ring is not rebuilt under it)."""
        return ()


def _fields(obj: object, skip: str) -> dict[str, Any]:
    return {k: v for k, v in vars(obj).items() if k != skip}


class Context:
    """The state every sub-machine reads (see the module docstring)."""

    def __init__(self, hub: Hub, *, max_establish_attempts: int, repair_rings: bool,
                 token_key: bytes, relay: bool, mesh_max_bytes: int, quorum: bool | None,
                 standby: bool) -> None:
        self.hub = hub
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
        # All-reduces up to this size run on the mesh: -1 chosen per group by the cost
        # model (pccl.algorithms), 0 no mesh (no mesh links are made either).
        self.mesh_max_bytes = mesh_max_bytes
        # Route tokens (ring links that are not direct, relayed transfers) are keyed
        # hashes under this key (see token()).
        self.token_key = token_key
        # Whether the master relays ring links that no direct connection can make.
        self.relay = relay
        # False: a ring that lost a peer stays broken until update_topology() (collectives
        # there fail at once); True: the master rebuilds it on its own (see
        # Rounds.maybe_repair).
        self.repair_rings = repair_rings
        self.peers: dict[int, PeerRecord] = {}  # insertion order is join order
        # Who is registered and accepted, per group, derived from ``peers`` and cached
        # until a peer registers, is accepted or leaves (``roster_changed``): the
        # per-message paths ask these on every collective, at thousands of peers.
        self._roster: Roster | None = None
        self.phase = Phase.IDLE
        self.epoch = 0
        self.round: Round | None = None
        # Peers in update_topology() and in optimize_topology(): they will not join a
        # collective or sync of their group meanwhile.
        self.votes: set[int] = set()
        self.opt_votes: set[int] = set()
        # True when the accepted set changed (a peer left) since the rings were built.
        self.rings_stale = False
        self.rings: dict[int, list[int]] = {}
        self.ring_epochs: dict[int, int] = {}  # per group: the epoch its ring was built in
        # Groups whose ring links failed in a collective: unusable until the next round.
        self.broken_groups: set[int] = set()
        # Groups whose repair round failed: no new repair until a voted round succeeds
        # (collectives there fail fast meanwhile instead of waiting for a repair).
        self.repair_failed: set[int] = set()
        # Members of the last voted round (joiners and voters alike) that have not called
        # a collective, a sync or are_peers_pending() since: the only askers others may be
        # parked waiting for (see Pending.maybe_answer).
        self.fresh: set[int] = set()
        # Revision each peer reached in its last successful sync (or said it held when it
        # came back after a master restart).
        self.last_revision: dict[int, int] = {}
        self.links = Links()
        # Deadlines of waits for other peers: id -> what waits. See ArmDeadline.
        self.deadlines: dict[int, Deadline] = {}
        self.next_deadline = 1
        # What happened since the server last took them (take_notes); bounded, since a
        # state driven without a server (tests, the simulator) never takes them.
        self.notes: deque[Note] = deque(maxlen=4096)

    def __eq__(self, other: object) -> bool:
        """Equal to a context in the same state (the hub aside)."""
        return isinstance(other, Context) and _fields(self, "hub") == _fields(other, "hub")

    # --- the roster -------------------------------------------------------------------

    def roster_now(self) -> Roster:
        if self._roster is None:
            self._roster = Roster(self.peers)
        return self._roster

    def roster_changed(self) -> None:
        self._roster = None

    def accepted(self) -> list[int]:
        return list(self.roster_now().accepted)

    def pending(self) -> list[int]:
        return list(self.roster_now().pending)

    def group_sizes(self) -> dict[int, int]:
        return {g: len(ms) for g, ms in self.roster_now().groups.items()}

    def groups(self) -> dict[int, list[int]]:
        return {g: list(ms) for g, ms in self.roster_now().groups.items()}

    def members(self, group: int) -> list[int]:
        return list(self.roster_now().groups.get(group, ()))

    def member_set(self, group: int) -> frozenset[int]:
        return self.roster_now().group_set(group)

    def all_joined(self, group: int, calls: Collection[int]) -> bool:
        """Whether every accepted member of ``group`` is among ``calls``."""
        return covers(calls, self.member_set(group))

    @staticmethod
    def missing(members: list[int], present: Container[int]) -> list[int]:
        return [p for p in members if p not in present]

    def keys(self, ids: Iterable[int]) -> dict[str, Any]:
        """The ``key_ids``/``keys`` fields naming the static keys of ``ids``."""
        known = sorted({i for i in ids if i in self.peers and self.peers[i].key})
        return {"key_ids": known, "keys": [self.peers[i].key for i in known]}

    def forget(self, peer: int, reason: str, out: list[Command], *,
               tell: bool = False, elsewhere: bool = False) -> PeerRecord:
        """Drops ``peer`` everywhere except the round/vote bookkeeping of the caller."""
        rec = self.peers.pop(peer)
        self.roster_changed()
        out.append(Disconnect(peer, reason, tell, elsewhere))
        self.note("dropped", f"peer {peer} ({rec.status.name.lower()}, group "
                  f"{rec.peer_group}) dropped: {reason}", (peer,), rec.peer_group)
        links = self.links
        links.punch_failed = {pair for pair in links.punch_failed if peer not in pair}
        links.lan_failed = {pair for pair in links.lan_failed if peer not in pair}
        self.votes.discard(peer)
        self.fresh.discard(peer)
        if rec.status is PeerStatus.ACCEPTED:
            # The links of its group's ring are broken until the next round. The ring
            # itself is kept as built: it describes the links peers actually hold.
            self.mark_broken(rec.peer_group)
        self.hub.peer_dropped(peer, rec, out)
        self.last_revision.pop(peer, None)
        return rec

    # --- rings ------------------------------------------------------------------------

    @property
    def quorum_on(self) -> bool:
        """Whether rounds need a quorum of each group's previous ring (see __init__)."""
        if self.standby:
            return True
        return bool(self.quorum)

    def repairing(self) -> bool:
        return self.round is not None and self.round.repair

    def mark_broken(self, group: int) -> None:
        """The links of ``group``'s ring cannot carry collectives until a round rebuilds
        them (the repair starts once nothing runs there; see Rounds.maybe_repair)."""
        self.rings_stale = True
        self.broken_groups.add(group)

    def ring_broken(self, group: int) -> bool:
        """Whether collectives in ``group`` cannot succeed before update_topology()."""
        ring = self.rings.get(group, [])
        return group in self.broken_groups or not self.roster_now().is_ring_of(group, ring)

    def group_in_vote(self, group: int) -> bool:
        """Whether a member of ``group`` is in update_topology() or optimize_topology()."""
        return any(r.peer_group == group and r.status is PeerStatus.ACCEPTED
                   for votes in (self.votes, self.opt_votes) for p in votes
                   if (r := self.peers.get(p)) is not None)

    def token(self, label: str) -> bytes:
        """A route token: unguessable without the master's key, the same for the same
        label (so a deterministic state stays deterministic under a fixed key)."""
        return hashlib.blake2b(label.encode(), key=self.token_key, digest_size=16).digest()

    # --- notes and deadlines ----------------------------------------------------------

    def note(self, kind: str, text: str, peers: Collection[int] = (), group: int = -1,
             value: int = 0, nbytes: int = 0, tag: int = -1) -> None:
        assert kind in TIMELINE_NOTES or kind in COUNTED_NOTES, kind
        self.notes.append(Note(kind, text, tuple(peers), group, value, nbytes, tag))

    def arm(self, what: Deadline, timeout: float, out: list[Command]) -> int:
        """Starts the deadline of a wait for other peers (0 = none asked for)."""
        if not 0.0 < timeout <= MAX_DEADLINE:  # also refuses NaN
            return 0
        did = self.next_deadline
        self.next_deadline += 1
        self.deadlines[did] = what
        out.append(ArmDeadline(did, float(timeout)))
        return did

    def disarm(self, did: int) -> None:
        self.deadlines.pop(did, None)
