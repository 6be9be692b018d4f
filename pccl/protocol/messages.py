"""Control-plane messages: frozen dataclasses, one per message type.

A message's wire form is a msgpack map of its fields plus ``"t"`` (its ``TYPE``). Field
types are checked on decode, so a peer can never hand the master a ``str`` where an
``int`` belongs. Direction is noted as P->M (peer to master) or M->P.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Annotated, ClassVar

from pccl.errors import ErrorKind


@dataclasses.dataclass(frozen=True)
class Bound:
    """A decode-time limit of a field (``Annotated[list[int], Bound(64)]``): at most
    ``n`` items, or ``n`` characters of text. A longer value refuses the frame, or with
    ``clip`` (free text: error messages) is cut to ``n`` characters instead."""

    n: int
    clip: bool = False


#: Free text a peer sends (its side of an error): clipped to this many characters on
#: decode, before it reaches an exception, a log line or the status page of anyone else.
PEER_TEXT = 256
PeerText = Annotated[str, Bound(PEER_TEXT, clip=True)]
#: Free text the master sends (which may quote several peers): clipped on decode.
MasterText = Annotated[str, Bound(16384, clip=True)]

#: Characters a run id may have (``run_id=``, ``PCCL_RUN_ID``).
RUN_ID_CHARS = 64


def run_id_problem(run_id: object) -> str | None:
    """Why ``run_id`` is not a run id (None: it is one): 1 to 64 printable characters."""
    if not isinstance(run_id, str) or not 0 < len(run_id) <= RUN_ID_CHARS \
            or not run_id.isprintable():
        return f"must be 1 to {RUN_ID_CHARS} printable characters, got {run_id!r}"
    return None


#: The control-plane protocol this release speaks: bumped on every change of the
#: messages or of what they mean.
PROTOCOL_VERSION = 15
#: The oldest version this release still works with (a rolling upgrade: see
#: docs/operations.md, "Upgrading"). A master and a peer work together when each one's
#: version is at least the other's minimum; they speak the older of the two versions
#: (the newer side sends nothing the older one does not know). Frames of a newer
#: version may carry fields this one skips; an older one's may lack fields that have a
#: default (:func:`pccl.protocol.codec.decode`). 14 is the first version with this
#: window: 13 and older must be upgraded all at once.
MIN_PROTOCOL_VERSION = 14
#: The first version whose master runs ``coll_init(kind="all_gather")`` (15); a peer
#: never asks an older master for one.
GATHER_PROTOCOL = 15


def compatible(mine: tuple[int, int], theirs: tuple[int, int]) -> bool:
    """Whether two ends of (version, minimum version) work together."""
    return mine[0] >= theirs[1] and theirs[0] >= mine[1]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Message:
    TYPE: ClassVar[str] = ""


REGISTRY: dict[str, type[Message]] = {}


def message(cls: type[Message]) -> type[Message]:
    """Registers a message class under its TYPE."""
    assert cls.TYPE and cls.TYPE not in REGISTRY, cls
    REGISTRY[cls.TYPE] = cls
    return cls


# --- handshake ----------------------------------------------------------------------


@message
@dataclasses.dataclass(frozen=True, kw_only=True)
class Challenge(Message):
    """M->P, first frame on every connection."""

    TYPE: ClassVar[str] = "challenge"
    version: int
    nonce: bytes
    auth: bool
    # The peer groups this master holds now: accepted peers, or peers back from another
    # master that it is gathering into a group. A peer configured with several masters
    # registers with the first one that holds its group (protocol 9).
    groups: list[int] = dataclasses.field(default_factory=list)
    # A standby starts no group: a peer whose group no master holds registers with the
    # first master that is not one.
    standby: bool = False
    # The largest frame the master reads from a registered peer (0: not said): a peer
    # refuses to send more, with a typed error, instead of being dropped (protocol 12).
    max_frame: int = 0
    # The oldest peer version this master works with (protocol 14; 0 from an older
    # master, which required its own version exactly).
    min_version: int = 0


@message
@dataclasses.dataclass(frozen=True, kw_only=True)
class Hello(Message):
    """P->M. ``mac`` is HMAC(secret, "pccl-peer" | master nonce | peer nonce) or empty."""

    TYPE: ClassVar[str] = "hello"
    version: int
    peer_group: int
    p2p_port: int
    p2p_host: str  # "" = the address the master sees the connection from
    nonce: bytes
    mac: bytes
    # A peer that lost its master and is registering again (e.g. with a restarted
    # master) says what it held: its previous peer id (0 = a fresh peer), the last ring
    # epoch it used, the shared-state revision of its last successful sync (-1 = none)
    # and the members of its last ring, so that a fresh master can re-form the group.
    resume_peer_id: int = 0
    resume_epoch: int = 0
    resume_revision: int = -1
    resume_peers: list[int] = dataclasses.field(default_factory=list)
    # False: rather fail than have a ring link of this peer relayed (slow).
    allow_relay: bool = True
    # The ports this peer's hole-punched ring links are sent from: a link of epoch e
    # from ``p2p_punch_ports[e % len]`` (empty: none).
    p2p_punch_ports: list[int] = dataclasses.field(default_factory=list)
    # How many master addresses this peer fails over between (protocol 9). Above 1 the
    # master requires a quorum of the previous ring for every new ring (split brain).
    masters: int = 1
    # The newest ring it knows was installed, and the later rings that may have been
    # (its newest proposal among them), as parallel lists.
    resume_base_epoch: int = 0
    resume_base_peers: list[int] = dataclasses.field(default_factory=list)
    resume_more_epochs: list[int] = dataclasses.field(default_factory=list)
    resume_more_peers: list[list[int]] = dataclasses.field(default_factory=list)
    # What the operator calls this peer (Communicator(name=), PCCL_PEER_NAME): shown on
    # the status page and in the master's log; a certificate's name takes precedence.
    name: Annotated[str, Bound(64, clip=True)] = ""
    # The run this peer is for (Communicator(run_id=), PCCL_RUN_ID; protocol 14): a
    # master of another run refuses it, instead of mixing two jobs into one group.
    run_id: Annotated[str, Bound(RUN_ID_CHARS)] = ""
    # Where a neighbour behind the same NAT can dial this peer's p2p listener: IP
    # literals of private networks (pccl.protocol.auth.is_lan_address; the master
    # refuses a hello with any other), at most MAX_LOCAL_ADDRS, the port being
    # ``p2p_port``. Two peers that cannot be dialed from outside and that the master
    # sees come from the same public address try this before hole punching (protocol 14).
    local_addrs: Annotated[list[Annotated[str, Bound(45)]], Bound(8)] = dataclasses.field(
        default_factory=list)


#: Most addresses a ``hello`` may list in ``local_addrs`` (a longer list refuses it).
MAX_LOCAL_ADDRS = 8


@message
@dataclasses.dataclass(frozen=True, kw_only=True)
class DoctorHello(Message):
    """P->M instead of ``hello``, from ``pccl doctor``: check me, do not register me.
    ``mac`` as in ``hello``; ``p2p_port``: a port the master should try to dial back."""

    TYPE: ClassVar[str] = "doctor_hello"
    version: int
    nonce: bytes
    mac: bytes
    p2p_port: int


@message
@dataclasses.dataclass(frozen=True, kw_only=True)
class DoctorReport(Message):
    """M->P: the address the master sees the doctor's connection from, whether it
    could dial ``p2p_port`` back on that host, and its proof of the secret (as in
    ``welcome``)."""

    TYPE: ClassVar[str] = "doctor_report"
    observed: str
    reachable: bool
    mac: bytes
    master_time: float


@message
@dataclasses.dataclass(frozen=True, kw_only=True)
class DoctorEcho(Message):
    """P->M after a doctor report (at most ``DOCTOR_ECHOES`` times): the master answers
    with ``reply_bytes`` zero bytes (at most 8 MiB) and its wall clock."""

    TYPE: ClassVar[str] = "doctor_echo"
    payload: bytes
    reply_bytes: int
    master_time: float = 0.0


@message
@dataclasses.dataclass(frozen=True, kw_only=True)
class Welcome(Message):
    """M->P. ``mac`` is HMAC(secret, "pccl-master" | peer nonce | master nonce) or empty."""

    TYPE: ClassVar[str] = "welcome"
    peer_id: int
    mac: bytes
    heartbeat_interval: float
    heartbeat_timeout: float
    # Whether the master could dial this peer's p2p address back (protocol 14): False,
    # its ring links come by reverse connections, a hole punch, its LAN or the relay.
    reachable: bool = True
    # The p2p address the master gives the others for it ("host:port").
    p2p_address: str = ""


@message
@dataclasses.dataclass(frozen=True, kw_only=True)
class Denylist(Message):
    """M->P: the run's newest denylist (signed by the operator's run key; protocol 13).
    A peer installs it if a run key it trusts signed it and it is newer than its own;
    from then on it refuses the keys it names in every handshake."""

    TYPE: ClassVar[str] = "denylist"
    data: bytes


@message
@dataclasses.dataclass(frozen=True, kw_only=True)
class Reject(Message):
    """M->P, then the master closes the connection. ``kind`` names a pccl error class
    (:class:`ErrorKind`)."""

    TYPE: ClassVar[str] = "reject"
    kind: ErrorKind
    message: MasterText
    # This master cannot take the peer's group on (no quorum of its previous ring
    # here): a peer with several masters tries the others first (protocol 9).
    elsewhere: bool = False


@message
@dataclasses.dataclass(frozen=True, kw_only=True)
class Shutdown(Message):
    """M->P, then the master closes the connection: it stops on purpose (protocol 14),
    not a crash. ``final``: the run is over, so peers stop waiting for a master at once
    (their calls fail with :class:`MasterConnectionError` saying so); otherwise it is
    expected back (a restart, an upgrade) and peers register again for up to their
    ``reconnect_timeout``."""

    TYPE: ClassVar[str] = "shutdown"
    reason: MasterText
    final: bool = False


# --- liveness -----------------------------------------------------------------------


@message
@dataclasses.dataclass(frozen=True, kw_only=True)
class Ping(Message):
    TYPE: ClassVar[str] = "ping"
    seq: int


@message
@dataclasses.dataclass(frozen=True, kw_only=True)
class Pong(Message):
    """P->M, the answer to a ping, with what the master's status page shows of this peer:
    the p2p bytes it sent and received so far (ring links and shared-state transfers),
    and the running sync's fetched and total bytes (0 and 0: none running)."""

    TYPE: ClassVar[str] = "pong"
    seq: int
    tx_bytes: int = 0
    rx_bytes: int = 0
    sync_rx_bytes: int = 0
    sync_rx_total: int = 0


# --- membership ---------------------------------------------------------------------


@message
@dataclasses.dataclass(frozen=True, kw_only=True)
class UpdateTopology(Message):
    """P->M: this accepted peer votes to admit joiners and re-form the rings.
    ``timeout``: seconds the master waits for the other peers' votes (0 = no limit)."""

    TYPE: ClassVar[str] = "update_topology"
    timeout: float = 0.0


@message
@dataclasses.dataclass(frozen=True, kw_only=True)
class EstablishP2P(Message):
    """M->P: connect your pool to ``next_id`` at ``next_addr`` for ``epoch``.

    ``ring`` is the peer group's ring in order; a ring of one has ``next_id == -1``.
    """

    TYPE: ClassVar[str] = "establish_p2p"
    epoch: int
    ring: list[int]
    next_id: int
    next_addr: str
    # How to get the streams to ``next_id``: "direct" (dial ``next_addr``: its p2p
    # address, or its local address when both are behind one NAT), "reverse"
    # (it is behind NAT: it dials us, presenting ``token``), "punch" (both behind NAT:
    # one simultaneous-open connection to ``next_addr`` from our listening port, else
    # the master's relay with ``token``) or "relay" (the relay only).
    route: str = "direct"
    token: bytes = b""
    # The link from ``prev_id`` to us when it is not direct: "reverse" (dial back the
    # sender at ``prev_addr``), "punch" or "relay", with ``prev_token``.
    prev_id: int = -1
    prev_addr: str = ""
    prev_route: str = "direct"
    prev_token: bytes = b""
    # The mesh (small collectives by recursive doubling): a pool of one stream to each
    # partner (parallel lists; routes and tokens as for ``next_id``), and how each
    # partner's pool to us is opened when it cannot simply dial us.
    mesh_ids: list[int] = dataclasses.field(default_factory=list)
    mesh_addrs: list[str] = dataclasses.field(default_factory=list)
    mesh_routes: list[str] = dataclasses.field(default_factory=list)
    mesh_tokens: list[bytes] = dataclasses.field(default_factory=list)
    mesh_in_addrs: list[str] = dataclasses.field(default_factory=list)
    mesh_in_routes: list[str] = dataclasses.field(default_factory=list)
    mesh_in_tokens: list[bytes] = dataclasses.field(default_factory=list)
    # The rings this ring's quorum was counted against (protocol 9, parallel lists):
    # first the newest known installed (epoch 0 and [] if none), then later ones that
    # may have been. A peer reports them when it registers with another master
    # (Hello.resume_base_*, resume_more_*), see docs/semantics.md.
    quorum_epochs: list[int] = dataclasses.field(default_factory=list)
    quorum_rings: list[list[int]] = dataclasses.field(default_factory=list)
    # The static keys of the peers this message names (parallel lists; protocol 13):
    # a stream to or from one of them must prove it holds that key (the roster).
    key_ids: list[int] = dataclasses.field(default_factory=list)
    keys: list[bytes] = dataclasses.field(default_factory=list)


@message
@dataclasses.dataclass(frozen=True, kw_only=True)
class P2PReport(Message):
    """P->M: outcome of EstablishP2P; ``failed`` lists peers that could not be reached."""

    TYPE: ClassVar[str] = "p2p_report"
    epoch: int
    failed: Annotated[list[int], Bound(64)]
    # Mesh partners whose pool did not come up (the epoch then runs without a mesh;
    # nobody is dropped for it).
    mesh_failed: Annotated[list[int], Bound(256)] = dataclasses.field(default_factory=list)
    # Seconds each pool this peer dialed took to open (TCP connect, transport and p2p
    # handshakes): the master's latency measurement for the algorithm choice.
    dial_seconds: list[float] = dataclasses.field(default_factory=list)


@message
@dataclasses.dataclass(frozen=True, kw_only=True)
class WorldInfo(Message):
    """M->P: the peer's view of the run (sent on every membership change)."""

    TYPE: ClassVar[str] = "world"
    epoch: int
    ring: list[int]
    global_world_size: int
    peer_group_world_size: int
    num_peer_groups: int
    largest_peer_group_world_size: int
    # Peers that left gracefully (``Leave``) the group's ring installed at ``left_epoch``:
    # they vote for no later ring anywhere, so a master taking the group over counts
    # its quorum without them (protocol 12; see pccl.peer.state.known_rings).
    left: list[int] = dataclasses.field(default_factory=list)
    left_epoch: int = -1


@message
@dataclasses.dataclass(frozen=True, kw_only=True)
class TopologyUpdated(Message):
    """M->P: the vote is done; the peer is accepted and its pools are up. ``repair``:
    the master rebuilt the rings on its own after a peer was lost or a collective failed
    (nobody voted; no call waits for this)."""

    TYPE: ClassVar[str] = "topology_updated"
    epoch: int
    repair: bool = False
    # All-reduces of up to this many bytes (unquantized) run on the mesh of ``epoch``
    # instead of the ring; 0: no mesh. The same for every member of a group.
    mesh_max_bytes: int = 0
    # The mesh's ranks (peer ids, a permutation of the ring) where they are not the
    # ring's order (pccl.algorithms.mesh_order); empty: the ring's order.
    mesh_order: list[int] = dataclasses.field(default_factory=list)


@message
@dataclasses.dataclass(frozen=True, kw_only=True)
class TopologyUpdateFailed(Message):
    TYPE: ClassVar[str] = "topology_update_failed"
    message: MasterText
    kind: ErrorKind = ErrorKind.UpdateTopologyFailedError


@message
@dataclasses.dataclass(frozen=True, kw_only=True)
class PendingQuery(Message):
    """P->M. ``collective``: a vote of every accepted peer, answered to all of them at
    once with the same value; else answered at once (a hint). ``timeout`` as in
    :class:`UpdateTopology`."""

    TYPE: ClassVar[str] = "pending_query"
    req: int
    collective: bool = True
    timeout: float = 0.0


@message
@dataclasses.dataclass(frozen=True, kw_only=True)
class PendingAnswer(Message):
    """M->P. ``count``: peers waiting to be admitted; ``ok=False``: the query failed
    (``kind`` names the error class)."""

    TYPE: ClassVar[str] = "pending_answer"
    req: int
    pending: bool
    count: int = 0
    ok: bool = True
    kind: ErrorKind = ErrorKind.NONE
    message: MasterText = ""


@message
@dataclasses.dataclass(frozen=True, kw_only=True)
class Leave(Message):
    """P->M: graceful leave; the master drops the peer and closes the connection."""

    TYPE: ClassVar[str] = "leave"


@message
@dataclasses.dataclass(frozen=True, kw_only=True)
class ErrorReply(Message):
    """M->P: a request was refused. ``kind`` names a pccl error class (:class:`ErrorKind`)."""

    TYPE: ClassVar[str] = "error"
    kind: ErrorKind
    message: MasterText


# --- collectives --------------------------------------------------------------------


@message
@dataclasses.dataclass(frozen=True, kw_only=True)
class CollectiveInit(Message):
    """P->M: this peer wants to run collective ``tag`` with this description."""

    TYPE: ClassVar[str] = "coll_init"
    tag: int
    kind: Annotated[str, Bound(32)]  # "all_reduce"
    dtype: int
    count: int
    op: int
    quant_algorithm: int
    quant_dtype: int
    timeout: float = 0.0  # seconds the master waits for the others to join (0: no limit)
    # The caller's tensor shape where it has one (empty: unknown, e.g. a raw buffer):
    # peers whose shapes both are known must agree, not only on the element count.
    shape: Annotated[list[int], Bound(64)] = dataclasses.field(default_factory=list)
    # Early start: the peer already runs the ring as op ``early_op`` on the links of ring
    # epoch ``epoch`` (see :func:`early_op_id`); -1: it waits for CollectivePerform.
    early_op: int = -1
    epoch: int = -1
    # Via the master: the caller's tensor bytes (a tiny collective). When every member
    # sends them, the master reduces them in the ring's order and answers everyone with
    # the result in the outcome; no ring runs. Empty: the ring runs.
    data: bytes = b""


def early_op_id(epoch: int, tag: int, n: int) -> int:
    """The op id every member of a ring derives, without asking the master, for the
    ``n``-th successful collective of ``tag`` on the ring of ``epoch`` (0-based). The top
    bit keeps these ids apart from the master's own counter."""
    digest = hashlib.blake2b(f"{epoch}:{tag}:{n}".encode(), digest_size=8).digest()
    return (1 << 63) | (int.from_bytes(digest, "big") >> 1)


@message
@dataclasses.dataclass(frozen=True, kw_only=True)
class CollectivePerform(Message):
    """M->P: every peer agreed; run the ring as ``rank`` of ``world`` with id ``op_id``."""

    TYPE: ClassVar[str] = "coll_perform"
    tag: int
    op_id: int
    epoch: int
    rank: int
    world: int


@message
@dataclasses.dataclass(frozen=True, kw_only=True)
class CollectiveDone(Message):
    """P->M: the local part ended (``ok``) or failed (``kind``/``message``)."""

    TYPE: ClassVar[str] = "coll_done"
    tag: int
    op_id: int
    ok: bool
    kind: ErrorKind
    message: PeerText


@message
@dataclasses.dataclass(frozen=True, kw_only=True)
class CollectiveAbort(Message):
    """M->P: another peer failed; stop now and report."""

    TYPE: ClassVar[str] = "coll_abort"
    tag: int
    op_id: int
    message: MasterText


@message
@dataclasses.dataclass(frozen=True, kw_only=True)
class CollectiveOutcome(Message):
    """M->P: the one outcome every peer applies (write back on ``ok`` only)."""

    TYPE: ClassVar[str] = "coll_outcome"
    tag: int
    op_id: int
    ok: bool
    kind: ErrorKind
    message: MasterText
    # Reduced by the master (every member sent its data): the result, and the world.
    data: bytes = b""
    world: int = 0
    # The peers that took part, in rank order (the slots of an all-gather's result);
    # empty from a master that predates it.
    peers: list[int] = dataclasses.field(default_factory=list)


# --- shared state -------------------------------------------------------------------


@message
@dataclasses.dataclass(frozen=True, kw_only=True)
class SyncInit(Message):
    """P->M: this peer's shared state; one entry per tensor, in parallel lists."""

    TYPE: ClassVar[str] = "sync_init"
    revision: int
    strategy: int
    keys: list[str]
    dtypes: list[int]
    counts: list[int]
    hashes: list[bytes]
    unequal: list[bool]
    timeout: float = 0.0  # seconds the master waits for the others to join (0: no limit)


@message
@dataclasses.dataclass(frozen=True, kw_only=True)
class SyncPlan(Message):
    """M->P: what to fetch (``fetch_keys[i]`` from any of ``fetch_sources[i]``, to hash
    ``fetch_hashes[i]``), where the sources listen, and the revision everyone ends at."""

    TYPE: ClassVar[str] = "sync_plan"
    revision: int
    fetch_keys: list[str]
    fetch_hashes: list[bytes]
    fetch_sources: list[list[int]]
    source_ids: list[int]
    source_addrs: list[str]
    # Per source (aligned with ``source_ids``): b"" to dial it, or a relay token when it
    # is behind NAT (fetch through the master's relay; the master asks the holder to
    # open its end of each stream with RelayOpen).
    source_relays: list[bytes] = dataclasses.field(default_factory=list)
    # The static keys of the peers this message names (parallel lists; protocol 13):
    # a stream to or from one of them must prove it holds that key (the roster).
    key_ids: list[int] = dataclasses.field(default_factory=list)
    keys: list[bytes] = dataclasses.field(default_factory=list)


@message
@dataclasses.dataclass(frozen=True, kw_only=True)
class RelayOpen(Message):
    """M->P: a peer is fetching shared state from you through the relay: open your end
    of its stream ``stream`` (dial the master's port with ``token`` and serve it)."""

    TYPE: ClassVar[str] = "relay_open"
    token: bytes
    stream: int


@message
@dataclasses.dataclass(frozen=True, kw_only=True)
class SyncDone(Message):
    TYPE: ClassVar[str] = "sync_done"
    ok: bool
    kind: ErrorKind
    message: PeerText


@message
@dataclasses.dataclass(frozen=True, kw_only=True)
class SyncWithdraw(Message):
    """P->M: the caller cancelled its sync_shared_state(). The master calls the sync off
    for the whole group unless its outcome was already decided; either way the peer
    gets exactly one ``SyncOutcome`` for that sync (commit it if ``ok``)."""

    TYPE: ClassVar[str] = "sync_withdraw"


@message
@dataclasses.dataclass(frozen=True, kw_only=True)
class SyncOutcome(Message):
    """M->P: commit the fetched tensors (``ok``) or discard them; also refusals."""

    TYPE: ClassVar[str] = "sync_outcome"
    ok: bool
    kind: ErrorKind
    message: MasterText
    revision: int


# --- topology optimization ----------------------------------------------------------


@message
@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimizeTopology(Message):
    """P->M: this accepted peer votes to measure links and re-order the rings."""

    TYPE: ClassVar[str] = "optimize_topology"
    timeout: float = 0.0  # as in UpdateTopology


@message
@dataclasses.dataclass(frozen=True, kw_only=True)
class ProbeRequest(Message):
    """M->P: measure your bandwidth to each target (one after the other)."""

    TYPE: ClassVar[str] = "probe_request"
    target_ids: list[int]
    target_addrs: list[str]
    seconds: float
    # The static keys of the peers this message names (parallel lists; protocol 13):
    # a stream to or from one of them must prove it holds that key (the roster).
    key_ids: list[int] = dataclasses.field(default_factory=list)
    keys: list[bytes] = dataclasses.field(default_factory=list)


@message
@dataclasses.dataclass(frozen=True, kw_only=True)
class ProbeReport(Message):
    """P->M: bytes/s to each target (0 = could not measure), and how long the quickest
    of the probe's dials to it took (seconds; -1 = not measured): a pair's latency."""

    TYPE: ClassVar[str] = "probe_report"
    target_ids: list[int]
    rates: list[float]
    dial_seconds: list[float] = dataclasses.field(default_factory=list)


@message
@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimizeFailed(Message):
    """M->P: optimize_topology() failed; the previous rings stay."""

    TYPE: ClassVar[str] = "optimize_failed"
    message: MasterText


def version_mismatch(challenge: Challenge) -> str:
    """Why this release and the master of ``challenge`` cannot work together."""
    theirs = challenge.version
    newest = (f"(it works with peers of protocol {challenge.min_version} to {theirs})"
              if challenge.min_version else "(it requires exactly its own version)")
    if theirs < MIN_PROTOCOL_VERSION or not challenge.min_version:
        return (f"the master speaks protocol {theirs} {newest}, this peer {PROTOCOL_VERSION} "
                f"(it works with masters of {MIN_PROTOCOL_VERSION} or newer): upgrade the "
                f"master, or run a pccl release of the master's protocol here")
    return (f"the master speaks protocol {theirs} {newest}, this peer only "
            f"{PROTOCOL_VERSION}: upgrade pccl on this peer")
