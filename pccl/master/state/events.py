"""What goes in and out of :class:`~pccl.master.state.MasterState`: the events the server
feeds it, the commands it answers with, the notes it keeps for operators, and what each
wait for other peers (a deadline) is for. Plain frozen dataclasses, no behaviour."""

from __future__ import annotations

import dataclasses
import enum

from pccl.protocol import messages as m


class PeerStatus(enum.IntEnum):
    REGISTERED = 1
    ACCEPTED = 2


class Phase(enum.IntEnum):
    IDLE = 0
    VOTE_ACCEPT_NEW_PEERS = 1
    ESTABLISH_P2P = 2
    OPTIMIZE_TOPOLOGY = 3


# --- events -------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Resume:
    """What a peer that lost its master held (see the module docstring)."""

    epoch: int
    revision: int  # -1: it never synced shared state
    peers: tuple[int, ...]
    peer_id: int = 0  # the id it had there (ids in ``peers`` are of that master)
    # The newest ring it knows was installed there (its own, or the one the ring in
    # ``peers`` was counted against): Hello.resume_base_*.
    base_epoch: int = 0
    base: tuple[int, ...] = ()
    # Later rings that may have been installed there without it hearing so (its newest
    # proposal and the rings that one was counted against): (epoch, members).
    more: tuple[tuple[int, tuple[int, ...]], ...] = ()


@dataclasses.dataclass(frozen=True)
class PeerRegistered:
    """A peer finished the handshake. ``p2p_addr`` is the "host:port" others dial."""

    peer_id: int
    peer_group: int
    p2p_addr: str
    resume: Resume | None = None
    # Whether the master could dial ``p2p_addr`` (False: behind NAT or a firewall; its
    # ring neighbours get routes that do not dial it), and whether the peer accepts a
    # relayed ring link where no direct one is possible.
    reachable: bool = True
    allow_relay: bool = True
    # Where its hole-punched links come from ("host:port" as seen here), the one of a
    # link of epoch e at [e % len].
    punch_addrs: tuple[str, ...] = ()
    # How many masters the peer fails over between; above 1, split brain is possible and
    # the master counts quorums (see MasterState.quorum).
    masters: int = 1
    # The static key the peer proved in its handshake (b"": clear text): handed to the
    # peers that connect to it (``key_ids``/``keys`` of EstablishP2P and the like).
    key: bytes = b""
    # Where its control connection comes from (admission.source_key: the address, the
    # /64 of an IPv6 one), and its p2p listener on its private network ("host:port",
    # from Hello.local_addrs): two peers behind NAT with the same public host try their
    # ring link over their LAN first (see routes.route).
    public_host: str = ""
    lan_addrs: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class RecoveryTimeout:
    """The recovery grace period armed by :class:`ArmRecoveryTimer` ended."""

    recovery_id: int


@dataclasses.dataclass(frozen=True)
class PeerLost:
    """The connection died, timed out on heartbeats, or sent garbage."""

    peer_id: int
    reason: str


@dataclasses.dataclass(frozen=True)
class Received:
    peer_id: int
    msg: m.Message


@dataclasses.dataclass(frozen=True)
class Solved:
    """The server solved the ring of ``group`` asked for by :class:`Solve`."""

    round_id: int
    group: int
    ring: list[int]


@dataclasses.dataclass(frozen=True)
class BetterRing:
    """Background search found a better ring for ``group`` than the one in use; it is
    adopted at the next ``update_topology()``."""

    round_id: int
    group: int
    ring: list[int]


@dataclasses.dataclass(frozen=True)
class DeadlineExpired:
    """The deadline armed by :class:`ArmDeadline` with this id passed."""

    deadline_id: int


@dataclasses.dataclass(frozen=True)
class ReachChecked:
    """The answer to :class:`CheckReach`: whether ``peer_id``'s p2p listener answered
    this master's dial-back during the round of ``epoch``."""

    epoch: int
    peer_id: int
    ok: bool


@dataclasses.dataclass(frozen=True)
class RoundTimeout:
    """The round of ``epoch`` has been establishing p2p links for too long (the server
    times every round). Members that have not reported by now count as unreachable: a
    peer that answers heartbeats but never reports must not stall everyone."""

    epoch: int


@dataclasses.dataclass(frozen=True)
class Relayed:
    """A relayed stream of ring link ``token`` started: for a link routed "punch", the
    hole punching between its two peers failed (the server sees the fallback)."""

    token: bytes


Event = (PeerRegistered | PeerLost | Received | Solved | BetterRing | RecoveryTimeout
         | RoundTimeout | DeadlineExpired | Relayed | ReachChecked)


# --- commands -----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Send:
    peer_id: int
    msg: m.Message


@dataclasses.dataclass(frozen=True)
class Disconnect:
    """Close this peer's connection (it is already forgotten by the state machine);
    ``tell``: send it the reason first (as a final Reject)."""

    peer_id: int
    reason: str
    tell: bool = False
    # Tell it to try its other masters first (no quorum here): Reject.elsewhere.
    elsewhere: bool = False


@dataclasses.dataclass(frozen=True)
class Solve:
    """Find the best ring over ``members`` for the bandwidth matrix ``bw`` (bytes/s,
    ``bw[i][j]`` from ``members[i]`` to ``members[j]``; 0 = unknown/unreachable). Solving
    takes time, so it is the server's job; the answer comes back as :class:`Solved`."""

    round_id: int
    group: int
    members: list[int]
    bw: list[list[float]]
    # One-way seconds per ordered pair, as bw (NaN: unknown), from the probes' dials;
    # None when nothing was measured. The solver's tie-break (pccl.topology, Latency).
    latency: list[list[float]] | None = None


@dataclasses.dataclass(frozen=True)
class ArmRecoveryTimer:
    """Feed :class:`RecoveryTimeout` with this id after the recovery grace period."""

    recovery_id: int


@dataclasses.dataclass(frozen=True)
class ArmDeadline:
    """Feed :class:`DeadlineExpired` with this id after ``seconds``, unless the id has
    left :attr:`MasterState.deadlines` by then (the operation ended: drop the timer)."""

    deadline_id: int
    seconds: float


@dataclasses.dataclass(frozen=True)
class CheckReach:
    """Dial ``addr`` (``peer_id``'s p2p listener) as at registration and feed
    :class:`ReachChecked` with the answer: the master's own look at a ring link that a
    peer reported failed (see disputes.settle)."""

    epoch: int
    peer_id: int
    addr: str


Command = Send | Disconnect | Solve | ArmRecoveryTimer | ArmDeadline | CheckReach


# --- notes --------------------------------------------------------------------------

#: Kinds of :class:`Note`. The first group is what an operator reads (the server logs
#: each at INFO, the status page's timeline shows it); the collective ones are counted.
TIMELINE_NOTES = frozenset({
    "admitted",          # peers: the peers a round admitted; group: -1
    "dropped",           # peers: (the peer,); text: why
    "ring",              # a round built the rings: value = epoch; text: each group's ring
    "repair",            # the master rebuilt rings on its own: value = epoch
    "round_failed",      # a round gave up (value = epoch) or retries without the dropped
    "resume",            # a peer came back after a master restart; value = its epoch
    "rejoin",            # a peer this master dropped registered again; value = its epoch
    "no_quorum",         # a round lacked a majority of a group's previous ring; value =
                         # that ring's epoch; peers: the peers sent to their other masters
    "optimized",         # optimize_topology() chose new ring orders (value = its round)
    "optimize_failed",
    "collective_failed",  # value = op id (-1: never ran); text: why
    "sync_failed",       # value = the revision; peers: the participants
})
COUNTED_NOTES = frozenset({"collective_started", "collective_done", "sync_planned",
                           "sync_done"})


@dataclasses.dataclass(frozen=True)
class Note:
    """Something that happened, for the people running the run: not a command (nothing
    has to be done about it), collected in :attr:`MasterState.notes` for the server to
    log and to show on its status page. ``value`` is an epoch, op id or revision (see
    :data:`TIMELINE_NOTES`); ``nbytes`` a collective's size (elements x element size);
    ``tag`` a collective's tag (-1: not about a collective)."""

    kind: str
    text: str
    peers: tuple[int, ...] = ()
    group: int = -1
    value: int = 0
    nbytes: int = 0
    tag: int = -1

# Longest deadline a peer may ask for (a garbage value must not overflow a timer).
MAX_DEADLINE = 7 * 24 * 3600.0


# --- deadlines: what a wait for other peers is for -----------------------------------


@dataclasses.dataclass(frozen=True)
class CollectiveDeadline:
    group: int
    tag: int


@dataclasses.dataclass(frozen=True)
class SyncDeadline:
    group: int


@dataclasses.dataclass(frozen=True)
class VoteDeadline:
    pass


@dataclasses.dataclass(frozen=True)
class OptimizeDeadline:
    pass


@dataclasses.dataclass(frozen=True)
class PendingDeadline:
    pass


Deadline = CollectiveDeadline | SyncDeadline | VoteDeadline | OptimizeDeadline | PendingDeadline
