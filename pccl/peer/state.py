"""The peer's side of the protocol as a sans-IO state machine: events in, commands out.

The same discipline as :mod:`pccl.master.state`: no sockets, no clocks, no tasks. The
asyncio driver (:class:`pccl.communicator.Communicator`) turns master messages, results
of the Rust data plane (ring installed, ring op finished, fetch finished) and user calls
into events, and carries out the commands (send a message, install a ring, run a ring
op, resolve or fail a waiting call). The deterministic simulation
(:mod:`pccl.testing.sim`) drives the same machine with a virtual clock.

Sub-machines, one per kind of call that waits on the master:

* membership (:class:`Status`)::

      NEW ─Welcomed─▶ REGISTERED ─TopologyUpdated+ring installed─▶ ACCEPTED ─Leave─▶ CLOSED
                                                                       │  ▲
                                                    MasterLost ────────┘  │ accepted again
                                                                 RECONNECTING

* a topology call (``update_topology`` / ``optimize_topology``), one at a time:
  waiting for ``TopologyUpdated`` (then its ring install) or a failure;
* an ``are_peers_pending`` question per request id;
* one collective per tag (:class:`CollectivePhase`)::

      WAIT_PERFORM ──Perform──▶ (WAIT_INSTALL) ──▶ RUNNING ──RingDone──▶ WAIT_OUTCOME ──▶ settled
            └──────────── Outcome before Perform: refused / called off ──────────────▶ settled

  The machine owns the call's whole life; the driver carries out its data-plane commands
  on the call's tensors: :class:`RunRing` (feed :class:`RingDone`), :class:`AbortRing`,
  :class:`ArmRing`, then exactly one of :class:`Commit` / :class:`ApplyResult` (the
  group's success goes into the output) or :class:`Rollback` (the input is put back), and
  last the call's answer (:class:`Resolve` with :class:`Reduced`, or :class:`Fail`). A
  call is settled only after its ring op has ended (:meth:`PeerMachine._settle` is the
  commit rule). A caller that gives up feeds :class:`Cancelled`: before this peer
  reported, the collective fails for everyone at once; after, the call ends with the
  master's outcome (a success decided before the withdrawal is still applied), or with
  :class:`CallExpired` when the driver's bounded wait for it runs out.

  An *early start* skips the first wait: on a ring that carried this peer's last
  collectives without a failure, the call derives the op id the master would confirm
  (:func:`pccl.protocol.messages.early_op_id`) and goes straight to RUNNING, its init
  telling the master so. The master's Perform with that id then only arms the ring's
  stall timer; a Perform with another id means the master voided the early start (a
  peer died, the ring changed, the peers disagreed): the early ring op is stopped, rolled
  back, and the collective runs again as performed.

  A tiny collective's init carries its tensor (``data``); when the master reduced it
  itself, the outcome carries the result (:class:`ApplyResult`; no ring).

* one shared-state sync (:class:`SyncPhase`): WAIT_PLAN ─Plan─▶ FETCHING (:class:`Fetch`)
  ─Fetched─▶ WAIT_OUTCOME ─Outcome─▶ :class:`CommitSync` and the answer. An outcome while
  fetching stops the fetch (:class:`AbortFetch`) and settles once it ended.

A waiting call is a :data:`Waiter` (a frozen dataclass per kind of call). The machine
answers each at most once with :class:`Resolve` or :class:`Fail` (an error *kind*, not an
exception object: see :class:`pccl.errors.ErrorKind`), and only while it is in
:attr:`PeerMachine.waiting`. The deterministic simulation (:mod:`pccl.testing.sim`)
carries out the very same commands, so what it checks is what the driver runs.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable
from typing import Any

from pccl.errors import ErrorKind
from pccl.protocol import messages as m

# --- the calls that wait on the machine ---------------------------------------------
# Each user call the machine answers is one of these keys: the driver keeps one future per
# key, and the machine answers each key at most once, with :class:`Resolve` or :class:`Fail`.


@dataclasses.dataclass(frozen=True)
class Admission:
    """``connect()``: admitted to the run (or registered again, while reconnecting)."""


@dataclasses.dataclass(frozen=True)
class Reregistration:
    """Calls waiting out a re-registration after the master was lost."""


@dataclasses.dataclass(frozen=True)
class TopologyCall:
    """``update_topology()`` or ``optimize_topology()``."""


@dataclasses.dataclass(frozen=True)
class PendingCall:
    """``are_peers_pending()`` / ``pending_peer_count()``, by request id."""

    req: int


@dataclasses.dataclass(frozen=True)
class ReduceCall:
    """One all-reduce, by tag: resolved with :class:`Reduced` once its result was
    committed (or applied), failed once its input was rolled back."""

    tag: int


@dataclasses.dataclass(frozen=True)
class SyncCall:
    """``sync_shared_state()``: resolved with the master's outcome once committed."""


Waiter = Admission | Reregistration | TopologyCall | PendingCall | ReduceCall | SyncCall

ACCEPT = Admission()
REJOIN = Reregistration()
UPDATE = TopologyCall()
SYNC = SyncCall()


def query_of(req: int) -> PendingCall:
    return PendingCall(req)


def reduce_of(tag: int) -> ReduceCall:
    return ReduceCall(tag)


@dataclasses.dataclass(frozen=True)
class Reduced:
    """What a finished all-reduce resolves with: how many peers took part, and where the
    result came from: ``"ring"`` (this peer's ring op), ``"local"`` (a group of one: the
    input itself) or ``"master"`` (the master reduced the tensors it was sent)."""

    world: int
    via: str
    peers: tuple[int, ...] = ()  # the participants in rank order, as the master sent them


class Status(enum.IntEnum):
    NEW = 0
    REGISTERED = 1  # handshake done, waiting to be admitted
    ACCEPTED = 2
    CLOSED = 3
    RECONNECTING = 4  # lost the master; registering again


class CollectivePhase(enum.IntEnum):
    WAIT_PERFORM = 0
    WAIT_INSTALL = 1  # performed on a ring epoch whose links are being taken over
    RUNNING = 2  # the ring op runs in the data plane
    WAIT_OUTCOME = 3  # this peer reported; the master decides for all


class SyncPhase(enum.IntEnum):
    WAIT_PLAN = 0
    FETCHING = 1
    WAIT_OUTCOME = 2


# --- events -------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Welcomed:
    """The handshake on a new master connection succeeded."""

    peer_id: int


@dataclasses.dataclass(frozen=True)
class FromMaster:
    msg: m.Message


@dataclasses.dataclass(frozen=True)
class MasterLost:
    """The connection to the master died, went silent or sent garbage."""

    reason: str
    may_rejoin: bool = True  # False: the driver will not register again


@dataclasses.dataclass(frozen=True)
class RejoinFailed:
    """The driver gave up registering again (``reconnect_timeout`` ran out, or the
    master refused it in a way a retry cannot change: ``kind``)."""

    reason: str
    kind: ErrorKind = ErrorKind.MasterConnectionError


@dataclasses.dataclass(frozen=True)
class Closed:
    """The user closed the communicator."""


@dataclasses.dataclass(frozen=True)
class RingInstalled:
    """An :class:`InstallRing` finished (``error``: why the links could not be taken
    over; empty on success). ``generation`` as in the command."""

    epoch: int
    generation: int
    error: str = ""


@dataclasses.dataclass(frozen=True)
class PoolsEstablished:
    """An :class:`Establish` finished; ``failed``: peers whose pools did not come up."""

    epoch: int
    generation: int
    failed: tuple[int, ...] = ()
    # Mesh partners whose pool did not come up, and how long each dialed pool took (s).
    mesh_failed: tuple[int, ...] = ()
    dial_seconds: tuple[float, ...] = ()


@dataclasses.dataclass(frozen=True)
class Probed:
    """A :class:`Probe` finished: measured rates (bytes/s) per target, 0 on failure, and
    each target's quickest dial (seconds, -1 on failure)."""

    target_ids: tuple[int, ...]
    rates: tuple[float, ...]
    generation: int
    dial_seconds: tuple[float, ...] = ()


@dataclasses.dataclass(frozen=True)
class StartTopology:
    """User call: ``update_topology()`` (or ``optimize_topology()``)."""

    timeout: float
    optimize: bool = False


@dataclasses.dataclass(frozen=True)
class EndTopology:
    """The topology call returned (either way)."""


@dataclasses.dataclass(frozen=True)
class AskPending:
    """User call: ``are_peers_pending()`` (``collective``) or ``pending_peer_count()``."""

    req: int
    collective: bool
    timeout: float


@dataclasses.dataclass(frozen=True)
class EndQuery:
    req: int


@dataclasses.dataclass(frozen=True)
class StartCollective:
    """User call: an all-reduce described by ``init``; ``early``: start the ring at once
    where the ring allows it (see the module docstring)."""

    init: m.CollectiveInit
    early: bool = False


@dataclasses.dataclass(frozen=True)
class RingDone:
    """The data plane finished (or failed) this peer's part of collective ``tag``."""

    tag: int
    ok: bool
    kind: ErrorKind = ErrorKind.NONE
    message: str = ""


@dataclasses.dataclass(frozen=True)
class Cancelled:
    """The caller gave up on ``call`` (its task was cancelled): this peer withdraws. The
    others see the call fail, unless the master decided its outcome already; then a
    decided success is still applied here (the group must not differ). The machine ends
    the call once that is settled: the driver waits for it, a bounded time."""

    call: ReduceCall | SyncCall


@dataclasses.dataclass(frozen=True)
class CallExpired:
    """A cancelled call's bounded wait for its outcome ran out: it ends as it stands
    (nothing applied here)."""

    call: ReduceCall | SyncCall


@dataclasses.dataclass(frozen=True)
class StartSync:
    init: m.SyncInit


@dataclasses.dataclass(frozen=True)
class Fetched:
    """This peer's fetches of the sync plan ended."""

    ok: bool
    kind: ErrorKind = ErrorKind.NONE
    message: str = ""


Event = (Welcomed | FromMaster | MasterLost | RejoinFailed | Closed | RingInstalled
         | PoolsEstablished | Probed | StartTopology | EndTopology | AskPending | EndQuery
         | StartCollective | RingDone | StartSync | Fetched | Cancelled | CallExpired)


# --- commands -----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Send:
    msg: m.Message


@dataclasses.dataclass(frozen=True)
class Resolve:
    waiter: Waiter
    value: Any = None


@dataclasses.dataclass(frozen=True)
class Fail:
    waiter: Waiter
    kind: ErrorKind
    message: str


@dataclasses.dataclass(frozen=True)
class Establish:
    """Connect the pool to the next peer (feed :class:`PoolsEstablished`)."""

    msg: m.EstablishP2P
    generation: int


@dataclasses.dataclass(frozen=True)
class InstallRing:
    """Take over the ring links of ``epoch`` (feed :class:`RingInstalled`)."""

    epoch: int
    next_id: int  # -1: a ring of one
    prev_id: int
    generation: int
    # The mesh's ranks (peer ids: the ring's order unless the master sent another), and
    # the largest all-reduce for the mesh (0: none).
    mesh_order: tuple[int, ...] = ()
    mesh_max_bytes: int = 0


@dataclasses.dataclass(frozen=True)
class RunRing:
    """Start this peer's part of collective ``tag`` as ``perform`` says, on the call's
    tensors (feed :class:`RingDone` when it ends). ``armed``: it may time out waiting
    for the previous peer (an unconfirmed early start may not: that peer may not have
    called yet)."""

    tag: int
    perform: m.CollectivePerform
    armed: bool = True


@dataclasses.dataclass(frozen=True)
class AbortRing:
    """Stop collective ``tag``'s ring op (it ends with :class:`RingDone`, failed)."""

    tag: int


@dataclasses.dataclass(frozen=True)
class Rollback:
    """Collective ``tag``'s ring op ended and its result is not taken: put the caller's
    input back as it was (in place, the ring wrote into it) and drop the op."""

    tag: int


@dataclasses.dataclass(frozen=True)
class Commit:
    """Collective ``tag`` succeeded for the group: its ring op's result goes into the
    output; ``local`` (a group of one): the input is the result (copied to an ``out``)."""

    tag: int
    local: bool = False


@dataclasses.dataclass(frozen=True)
class ApplyResult:
    """Collective ``tag`` was reduced by the master: ``data`` goes into the output (a
    ring op of the call, if any, is rolled back first)."""

    tag: int
    data: bytes


@dataclasses.dataclass(frozen=True)
class Fetch:
    """Fetch what the sync plan says from the peers named there (feed :class:`Fetched`)."""

    plan: m.SyncPlan


@dataclasses.dataclass(frozen=True)
class AbortFetch:
    """Stop the running fetch (it ends with :class:`Fetched`, failed)."""


@dataclasses.dataclass(frozen=True)
class CommitSync:
    """The group committed the sync: the fetched tensors replace the state's, and the
    state's revision becomes ``revision``."""

    revision: int


@dataclasses.dataclass(frozen=True)
class ArmRing:
    """The master confirmed collective ``tag``'s early start: from now on its ring op may
    time out waiting for the previous peer (before, that peer may not have called yet)."""

    tag: int


@dataclasses.dataclass(frozen=True)
class Probe:
    msg: m.ProbeRequest
    generation: int


@dataclasses.dataclass(frozen=True)
class OpenRelay:
    """Open this peer's end of a relayed transfer stream (it serves shared state to a
    fetcher that cannot dial it)."""

    token: bytes
    stream: int


@dataclasses.dataclass(frozen=True)
class Rejoin:
    """Lost the master while accepted: register again (``Welcomed`` ... ``ACCEPT``), or
    feed :class:`RejoinFailed`."""


@dataclasses.dataclass(frozen=True)
class Log:
    """Something for the driver's log: a warning, or (``info``) routine news."""

    message: str
    info: bool = False


Command = (Send | Resolve | Fail | Establish | InstallRing | RunRing | AbortRing | ArmRing
           | Rollback | Commit | ApplyResult | Fetch | AbortFetch | CommitSync | Probe
           | OpenRelay | Rejoin | Log)


class ProtocolViolation(Exception):
    """An event the machine cannot take in its state (a driver bug or a garbage peer)."""

    def __init__(self, kind: ErrorKind, message: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclasses.dataclass
class Collective:
    tag: int
    init: m.CollectiveInit
    phase: CollectivePhase = CollectivePhase.WAIT_PERFORM
    perform: m.CollectivePerform | None = None
    aborted: bool = False  # the master called it off while it ran
    early: bool = False  # runs as an early start the master has not confirmed yet
    redo: m.CollectivePerform | None = None  # the master voided the early start
    redo_aborted: bool = False  # ... and called the run under the new id off already
    running: bool = False  # a ring op runs (RunRing sent, RingDone not yet here)
    held: bool = False  # a ring op's result is neither committed nor rolled back
    ring_ok: bool = False  # this peer's ring op (or its part) succeeded
    cancelled: bool = False  # the caller gave up
    # How the call ends once its ring op has ended: the master's outcome, or a failure
    # of this peer's own (kind, message).
    decided: m.CollectiveOutcome | tuple[ErrorKind, str] | None = None


@dataclasses.dataclass
class Sync:
    init: m.SyncInit
    phase: SyncPhase = SyncPhase.WAIT_PLAN
    plan: m.SyncPlan | None = None
    cancelled: bool = False  # the caller gave up (a withdrawal went to the master)
    reported_ok: bool = False  # this peer fetched everything and said so
    decided: m.SyncOutcome | None = None  # the outcome, once the fetch has ended


_CANCELLED = "cancelled by the caller"
#: How a call the caller gave up on fails.
_CANCELLED_FAILURE = (ErrorKind.CollectiveAbortedError, _CANCELLED)


def known_rings(installed: tuple[int, list[int]], proposed: m.EstablishP2P | None
                ) -> tuple[tuple[int, list[int]], list[tuple[int, list[int]]]]:
    """What a peer reports to a master it registers with after losing its own: the newest
    ring it knows was installed (``installed``, or the first ring its newest proposal was
    counted against if newer) and the later rings that may have been installed without
    it hearing so (the others that proposal was counted against, and the proposal)."""
    base = installed
    if proposed is None:
        return base, []
    counted = list(zip(proposed.quorum_epochs, proposed.quorum_rings))
    # At the installed ring's own epoch, the proposal's first counted ring is that ring
    # as its master keeps it: without the peers that left it since.
    if counted and counted[0][0] >= base[0]:
        base = (counted[0][0], list(counted[0][1]))
    more = [(e, list(r)) for e, r in [*counted[1:], (proposed.epoch, proposed.ring)]
            if e > base[0]]
    return base, more


def without_leavers(ring: tuple[int, list[int]], left: tuple[int, frozenset[int]]
                    ) -> tuple[int, list[int]]:
    """``ring`` (epoch, members) less the peers its master said left gracefully from
    the ring installed at ``left[0]`` (``WorldInfo.left``), when it is that ring: they
    vote for no ring of that epoch or later, so majorities are counted among the others,
    and two masters counting them still share a peer. Later rings were made without
    them (an id there is someone else's, given out again by a restarted master)."""
    epoch, members = ring
    if epoch != left[0] or not left[1]:
        return ring
    return epoch, [p for p in members if p not in left[1]]


class PeerMachine:
    """One peer's protocol state (see the module docstring)."""

    def __init__(self, *, reconnect: bool = True) -> None:
        self.reconnect = reconnect
        self.status = Status.NEW
        self.peer_id: int | None = None
        self.epoch = 0  # newest ring epoch the master told this peer of
        self.ring_epoch = -1  # epoch of the ring links installed here
        self.ring: list[int] = []
        # The newest ring a master proposed to this peer (establish_p2p), recorded before
        # the peer answers: what it reports when registering again, so that a master
        # taking over counts its quorum against every ring that may have been installed.
        self.proposed: m.EstablishP2P | None = None
        # The newest ring this peer knows was installed (epoch, members): a proposal of
        # which the master's topology_updated came.
        self.installed: tuple[int, list[int]] = (0, [])
        self.world: m.WorldInfo | None = None
        # Who left the installed ring gracefully, as the master last said (its epoch).
        self.left: tuple[int, frozenset[int]] = (-1, frozenset())
        self.last_revision = -1  # of the last successful sync
        self.reconnects = 0
        self.generation = 0  # master connections so far (results of older ones are void)
        self.connected = False
        self.lost: tuple[ErrorKind, str] | None = None
        self.waiting: set[Waiter] = set()
        self.collectives: dict[int, Collective] = {}
        self.topology: StartTopology | None = None
        self.sync: Sync | None = None
        self.installs: list[m.TopologyUpdated] = []  # rounds whose ring install runs
        # epoch -> generation of the InstallRing running for it: a second round of the
        # same epoch (the master's repair, then the round the peers called) waits for
        # that install; a second install would close the first one's links and find
        # their pools taken.
        self.installing: dict[int, int] = {}
        self.asking_req: int | None = None  # the collective are_peers_pending() waiting
        # Early starts: successful collectives per tag on the installed ring (what the
        # next early op id derives from), and the ring epoch on which a failure turned
        # them off (a failed ring op may leave pieces on the links: the master rebuilds).
        self.early_counts: dict[int, int] = {}
        self.early_off_epoch = -1
        self._next_req = 0
        # What heartbeat answers report to the master's status page: p2p tx and rx bytes,
        # the running sync's fetched and total bytes (the driver's counters).
        self.traffic: Callable[[], tuple[int, int, int, int]] = lambda: (0, 0, 0, 0)

    # --- queries the driver makes ------------------------------------------------------

    def new_request(self) -> int:
        self._next_req += 1
        return self._next_req

    def usable(self) -> tuple[ErrorKind, str] | None:
        """Why a call cannot be made now (None: it can)."""
        if self.lost is not None:
            return self.lost
        if self.status is Status.RECONNECTING:
            return (ErrorKind.MasterConnectionError,
                    "registering with the master again after losing it; retry once that "
                    "is done")
        if self.status is not Status.ACCEPTED:
            return (ErrorKind.InvalidUsageError,
                    f"this peer is {self.status.name}, not ACCEPTED; call connect() first")
        return None

    def resume(self) -> tuple[int, int, int, list[int]]:
        """What to tell a master when registering again: (peer id, epoch, revision,
        ring); zeros when this is the first registration."""
        if self.status is Status.RECONNECTING and self.peer_id is not None:
            epoch, ring = max(self.ring_epoch, self.epoch, 0), list(self.ring)
            if self.proposed is not None and self.proposed.epoch > epoch:
                # (A single master sends proposals without their members: the last ring.)
                epoch, ring = self.proposed.epoch, list(self.proposed.ring or self.ring)
            epoch, ring = without_leavers((epoch, ring), self.left)
            return (self.peer_id, epoch, self.last_revision, ring)
        return (0, 0, -1, [])

    def resume_base(self) -> tuple[tuple[int, list[int]], list[tuple[int, list[int]]]]:
        """With :meth:`resume`: the newest ring this peer knows was installed, and the
        later rings that may have been ((epoch, members) each): what a master taking
        the group over counts its quorum against."""
        base, more = known_rings(self.installed, self.proposed)
        return (without_leavers(base, self.left),
                [without_leavers(r, self.left) for r in more])

    # --- the one entry point -----------------------------------------------------------

    def handle(self, ev: Event) -> list[Command]:
        out: list[Command] = []
        if isinstance(ev, FromMaster):
            self._on_message(ev.msg, out)
        elif isinstance(ev, Welcomed):
            self.peer_id = ev.peer_id
            self.generation += 1
            self.connected = True
            self.lost = None
            if self.status is Status.NEW:
                self.status = Status.REGISTERED
            self.waiting.add(ACCEPT)
        elif isinstance(ev, MasterLost):
            self._lose(ErrorKind.MasterConnectionError, ev.reason, ev.may_rejoin, out)
        elif isinstance(ev, RejoinFailed):
            self.lost = (ev.kind, ev.reason)
            self.connected = False
            self._fail(REJOIN, ev.kind, ev.reason, out)
        elif isinstance(ev, Closed):
            self.status = Status.CLOSED
            self.connected = False
            if self.lost is not None:  # (closed while it waited for a master: say closed)
                self.lost = (ErrorKind.MasterConnectionError, "the communicator was closed")
            self._fail_all(ErrorKind.MasterConnectionError, "the communicator was closed", out)
        elif isinstance(ev, RingInstalled):
            self._on_installed(ev, out)
        elif isinstance(ev, PoolsEstablished):
            if ev.generation == self.generation and self.connected:
                out.append(Send(m.P2PReport(epoch=ev.epoch, failed=list(ev.failed),
                                            mesh_failed=list(ev.mesh_failed),
                                            dial_seconds=list(ev.dial_seconds))))
        elif isinstance(ev, Probed):
            if ev.generation == self.generation and self.connected:
                out.append(Send(m.ProbeReport(target_ids=list(ev.target_ids),
                                              rates=list(ev.rates),
                                              dial_seconds=list(ev.dial_seconds))))
        elif isinstance(ev, StartTopology):
            self._start_topology(ev, out)
        elif isinstance(ev, EndTopology):
            self.topology = None
            self.waiting.discard(UPDATE)
        elif isinstance(ev, AskPending):
            self._ask(ev, out)
        elif isinstance(ev, EndQuery):
            if self.asking_req == ev.req:
                self.asking_req = None
            self.waiting.discard(query_of(ev.req))
        elif isinstance(ev, StartCollective):
            self._start_collective(ev.init, ev.early, out)
        elif isinstance(ev, RingDone):
            self._ring_done(ev, out)
        elif isinstance(ev, StartSync):
            self._start_sync(ev.init, out)
        elif isinstance(ev, Fetched):
            self._fetched(ev, out)
        elif isinstance(ev, Cancelled):
            if isinstance(ev.call, ReduceCall):
                self._cancel_collective(ev.call.tag, out)
            else:
                self._cancel_sync(out)
        elif isinstance(ev, CallExpired):
            self._expired(ev.call, out)
        else:  # pragma: no cover - the type union is closed
            raise TypeError(ev)
        return out

    # --- helpers ---------------------------------------------------------------------

    def _send(self, msg: m.Message, out: list[Command]) -> None:
        """Sends ``msg`` if a master connection is up (a lost one fails the waiters
        already; what would have been sent is void)."""
        if self.connected and self.lost is None:
            out.append(Send(msg))

    def _resolve(self, w: Waiter, value: Any, out: list[Command]) -> None:
        if w in self.waiting:
            self.waiting.discard(w)
            out.append(Resolve(w, value))

    def _fail(self, w: Waiter, kind: ErrorKind, message: str, out: list[Command]) -> None:
        if w in self.waiting:
            self.waiting.discard(w)
            out.append(Fail(w, kind, message))

    def _fail_all(self, kind: ErrorKind, message: str, out: list[Command],
                  keep: Waiter | None = None) -> None:
        """Every waiting call fails; a collective whose ring op runs is stopped and fails
        once the op has ended (its input is put back then)."""
        for col in list(self.collectives.values()):
            self._end_collective(col, (kind, message), out)
        sync = self.sync
        if sync is not None:
            if sync.phase is SyncPhase.FETCHING:
                out.append(AbortFetch())
            self.sync = None
        for w in sorted(self.waiting, key=repr):
            if w != keep and not (isinstance(w, ReduceCall) and w.tag in self.collectives):
                self._fail(w, kind, message, out)

    def _check_usable(self) -> None:
        why = self.usable()
        if why is not None:
            raise ProtocolViolation(*why)

    def _lose(self, kind: ErrorKind, reason: str, may_rejoin: bool,
              out: list[Command]) -> None:
        if self.status is Status.CLOSED or not self.connected:
            return
        self.connected = False
        self.lost = (kind, reason)
        self.early_off_epoch = self.ring_epoch  # ring ops in flight are aborted unreported
        out.append(Log(f"peer {self.peer_id}: {reason}"))
        rejoin = self.status is Status.ACCEPTED and self.reconnect and may_rejoin
        if rejoin:
            # Set before any command goes out: a driver that runs a failed caller's retry
            # while carrying out these commands finds the peer registering again.
            self.status = Status.RECONNECTING
            self.waiting.add(REJOIN)
        # A call waiting out a re-registration keeps waiting through failed attempts.
        self._fail_all(kind, reason, out, keep=REJOIN)
        if rejoin:
            out.append(Rejoin())

    # --- master messages ---------------------------------------------------------------

    def _on_message(self, msg: m.Message, out: list[Command]) -> None:
        if isinstance(msg, m.Ping):
            tx, rx, sync_rx, sync_total = self.traffic()
            self._send(m.Pong(seq=msg.seq, tx_bytes=tx, rx_bytes=rx, sync_rx_bytes=sync_rx,
                              sync_rx_total=sync_total), out)
        elif isinstance(msg, m.EstablishP2P):
            if self.proposed is None or msg.epoch > self.proposed.epoch:
                self.proposed = msg
            out.append(Establish(msg, self.generation))
        elif isinstance(msg, m.WorldInfo):
            self.world = msg
            if msg.left_epoch >= self.left[0]:
                self.left = (msg.left_epoch, frozenset(msg.left))
        elif isinstance(msg, m.TopologyUpdated):
            self._on_topology_updated(msg, out)
        elif isinstance(msg, m.CollectivePerform):
            col = self.collectives.get(msg.tag)
            if col is None:
                return
            if col.phase is CollectivePhase.WAIT_PERFORM:
                col.perform = msg
                self._perform(col, out)
            elif col.early and col.perform is not None and msg.op_id == col.perform.op_id:
                # Every member called: the early start stands.
                col.early = False
                if col.running:
                    out.append(ArmRing(msg.tag))
            elif col.early and not col.cancelled:
                # The master voided the early start: run again once its ring op ended,
                # from the input as it was.
                col.redo = msg
                if col.running:
                    out.append(AbortRing(msg.tag))
                else:
                    if col.held:
                        out.append(Rollback(col.tag))
                        col.held = False
                    self._run_again(col, out)
        elif isinstance(msg, m.CollectiveAbort):
            col = self.collectives.get(msg.tag)
            if col is not None and col.redo is not None and msg.op_id == col.redo.op_id:
                col.redo_aborted = True  # the run again fails at once
            elif col is not None and (col.perform is None or msg.op_id == col.perform.op_id):
                col.aborted = True
                if col.running:
                    out.append(AbortRing(msg.tag))
        elif isinstance(msg, m.CollectiveOutcome):
            col = self.collectives.get(msg.tag)
            if col is None:
                return  # a withdrawn or forgotten collective: nothing waits for it
            if col.perform is None and msg.ok and msg.world > 0:
                # Reduced by the master: the result is in the outcome; no ring runs.
                col.perform = m.CollectivePerform(tag=col.tag, op_id=msg.op_id, epoch=-1,
                                                  rank=-1, world=msg.world)
                col.phase = CollectivePhase.WAIT_OUTCOME
                self._end_collective(col, msg, out)
            elif col.perform is not None and msg.op_id == col.perform.op_id:
                if msg.ok and col.perform.epoch == self.ring_epoch:
                    self.early_counts[col.tag] = self.early_counts.get(col.tag, 0) + 1
                elif not msg.ok:
                    self.early_off_epoch = self.ring_epoch
                self._end_collective(col, msg, out)
            else:
                # Refused or called off before it ran (an early start included: stop it).
                if col.perform is not None:
                    self.early_off_epoch = self.ring_epoch
                if col.running:
                    col.aborted = True
                self._end_collective(col, (ErrorKind.parse(msg.kind), msg.message), out)
        elif isinstance(msg, (m.TopologyUpdateFailed, m.OptimizeFailed, m.ErrorReply)):
            if isinstance(msg, m.OptimizeFailed):
                kind = ErrorKind.TopologyOptimizationFailedError
            else:
                kind = ErrorKind.parse(msg.kind, ErrorKind.UpdateTopologyFailedError)
            if UPDATE in self.waiting:
                self._fail(UPDATE, kind, msg.message, out)
            elif isinstance(msg, m.ErrorReply):
                out.append(Log(f"peer {self.peer_id}: master reported {msg.kind}: "
                               f"{msg.message}"))
        elif isinstance(msg, m.PendingAnswer):
            self._resolve(query_of(msg.req), msg, out)
        elif isinstance(msg, m.ProbeRequest):
            out.append(Probe(msg, self.generation))
        elif isinstance(msg, m.SyncPlan):
            sync = self.sync
            if sync is not None and sync.phase is SyncPhase.WAIT_PLAN:
                sync.plan = msg
                if sync.cancelled:  # withdrawn already: nothing to fetch; the outcome comes
                    sync.phase = SyncPhase.WAIT_OUTCOME
                else:
                    sync.phase = SyncPhase.FETCHING
                    out.append(Fetch(msg))
        elif isinstance(msg, m.SyncOutcome):
            sync = self.sync
            if sync is None:
                return
            sync.decided = msg
            if sync.phase is SyncPhase.FETCHING:
                out.append(AbortFetch())  # called off while fetching: ends once it stopped
            else:
                self._settle_sync(sync, out)
        elif isinstance(msg, m.RelayOpen):
            out.append(OpenRelay(msg.token, msg.stream))
        elif isinstance(msg, m.Reject):
            self._lose(ErrorKind.MasterConnectionError,
                       f"the master dropped this peer: {msg.message}", True, out)
        else:
            self._lose(ErrorKind.MasterConnectionError,
                       f"unexpected message {msg.TYPE!r} from the master", True, out)

    def _on_topology_updated(self, msg: m.TopologyUpdated, out: list[Command]) -> None:
        p = self.proposed
        if p is not None and p.epoch == msg.epoch and msg.epoch > self.installed[0]:
            self.installed = (p.epoch, list(p.ring))
        if self.world is not None:
            self.ring = list(self.world.ring)
        if msg.epoch != self.ring_epoch and self.peer_id in self.ring:
            i, n = self.ring.index(self.peer_id), len(self.ring)
            nxt = self.ring[(i + 1) % n] if n > 1 else -1
            prv = self.ring[(i - 1) % n] if n > 1 else -1
            if self.installing.get(msg.epoch) != self.generation:
                order, limit = tuple(msg.mesh_order) or tuple(self.ring), msg.mesh_max_bytes
                if sorted(order) != sorted(self.ring):
                    # Every member got the same message: all of them take the ring.
                    out.append(Log(f"peer {self.peer_id}: the master's mesh order "
                                   f"{list(order)} for epoch {msg.epoch} is not an order of "
                                   f"the ring {self.ring}; every collective takes the ring"))
                    order, limit = tuple(self.ring), 0
                out.append(InstallRing(msg.epoch, nxt, prv, self.generation, order, limit))
                self.installing[msg.epoch] = self.generation
            self.installs.append(msg)
        else:
            self._topology_done(msg, "", out)

    def _on_installed(self, ev: RingInstalled, out: list[Command]) -> None:
        if self.installing.get(ev.epoch) == ev.generation:
            del self.installing[ev.epoch]
        if not ev.error:
            if ev.epoch != self.ring_epoch:
                self.early_counts.clear()
            self.ring_epoch = ev.epoch
        else:
            self.early_off_epoch = self.ring_epoch  # its links were closed for the new one
        msgs = [u for u in self.installs if u.epoch == ev.epoch]
        self.installs = [u for u in self.installs if u.epoch != ev.epoch]
        if ev.generation == self.generation and self.connected:
            for u in msgs:
                error = f"could not take over the ring links: {ev.error}" if ev.error else ""
                self._topology_done(u, error, out)
        # Collectives performed on this epoch waited for its links.
        for col in list(self.collectives.values()):
            if col.phase is CollectivePhase.WAIT_INSTALL and col.perform is not None \
                    and col.perform.epoch == ev.epoch:
                self._perform(col, out)

    def _topology_done(self, msg: m.TopologyUpdated, error: str,
                       out: list[Command]) -> None:
        self.epoch = max(self.epoch, msg.epoch)
        if msg.repair:
            if error:
                # Routine: a repair's ring may lose another member before it is taken
                # over (its pool never comes); the master repairs again.
                out.append(Log(f"peer {self.peer_id}: the repaired ring of epoch "
                               f"{msg.epoch} was not taken over ({error}); the master "
                               "repairs again", info=True))
            return  # the master rebuilt the ring on its own: no call waits for this
        if self.status in (Status.REGISTERED, Status.RECONNECTING):
            if error:
                self._fail(ACCEPT, ErrorKind.UpdateTopologyFailedError, error, out)
            elif self.status is Status.REGISTERED:
                self.status = Status.ACCEPTED
                self._resolve(ACCEPT, None, out)
            else:
                self.status = Status.ACCEPTED
                self.reconnects += 1
                self._resolve(ACCEPT, None, out)
                self._resolve(REJOIN, None, out)
                out.append(Log(f"peer {self.peer_id}: registered again with the master; "
                               "the run goes on"))
        elif error:
            self._fail(UPDATE, ErrorKind.UpdateTopologyFailedError, error, out)
        else:
            self._resolve(UPDATE, None, out)

    # --- user calls --------------------------------------------------------------------

    def _start_topology(self, ev: StartTopology, out: list[Command]) -> None:
        self._check_usable()
        what = "optimize_topology()" if ev.optimize else "update_topology()"
        if self.topology is not None:
            raise ProtocolViolation(ErrorKind.InvalidUsageError,
                                    f"a topology operation is already running on this peer "
                                    f"({what} was called)")
        if self.collectives:
            raise ProtocolViolation(
                ErrorKind.PendingAsyncOpsError,
                f"{len(self.collectives)} collective(s) still in flight (tags "
                f"{sorted(self.collectives)}); await them before {what}")
        self.topology = ev
        self.waiting.add(UPDATE)
        self._send(m.OptimizeTopology(timeout=ev.timeout) if ev.optimize
                   else m.UpdateTopology(timeout=ev.timeout), out)

    def _ask(self, ev: AskPending, out: list[Command]) -> None:
        self._check_usable()
        if ev.collective:
            if self.asking_req is not None:
                raise ProtocolViolation(ErrorKind.InvalidUsageError,
                                        "are_peers_pending() is already running on this peer")
            self.asking_req = ev.req
        self.waiting.add(query_of(ev.req))
        self._send(m.PendingQuery(req=ev.req, collective=ev.collective, timeout=ev.timeout),
                   out)

    def _start_collective(self, init: m.CollectiveInit, early: bool,
                          out: list[Command]) -> None:
        self._check_usable()
        if self.topology is not None:
            raise ProtocolViolation(ErrorKind.InvalidUsageError,
                                    "update_topology() is running on this peer")
        if init.tag in self.collectives:
            raise ProtocolViolation(ErrorKind.InvalidUsageError,
                                    f"tag {init.tag} is already in flight on this peer")
        col = self.collectives[init.tag] = Collective(init.tag, init)
        self.waiting.add(ReduceCall(init.tag))
        perform = self._early_perform(init.tag) if early and not init.data else None
        if perform is None:
            self._send(init, out)
            return
        col.init = dataclasses.replace(init, early_op=perform.op_id, epoch=perform.epoch)
        col.perform, col.early = perform, True
        self._send(col.init, out)
        self._perform(col, out)

    def _early_perform(self, tag: int) -> m.CollectivePerform | None:
        """The perform the master would send for ``tag`` now, if this peer may start
        without it: its ring is installed and current, and no failure since."""
        e = self.ring_epoch
        if e < 0 or self.installs or self.epoch != e or self.early_off_epoch == e \
                or self.peer_id not in self.ring:
            return None
        op_id = m.early_op_id(e, tag, self.early_counts.get(tag, 0))
        return m.CollectivePerform(tag=tag, op_id=op_id, epoch=e,
                                   rank=self.ring.index(self.peer_id), world=len(self.ring))

    def _run_again(self, col: Collective, out: list[Command]) -> None:
        """The voided early start ended here (its input is back): the collective runs
        as performed."""
        assert col.redo is not None
        col.perform, col.redo, col.early = col.redo, None, False
        col.aborted, col.redo_aborted = col.redo_aborted, False
        col.phase = CollectivePhase.WAIT_PERFORM
        self._perform(col, out)

    def _perform(self, col: Collective, out: list[Command]) -> None:
        p = col.perform
        assert p is not None
        if p.world <= 1:
            col.phase, col.ring_ok = CollectivePhase.WAIT_OUTCOME, True
            self._send(m.CollectiveDone(tag=col.tag, op_id=p.op_id, ok=True, kind=ErrorKind.NONE,
                                        message=""), out)
        elif p.epoch == self.ring_epoch:
            col.phase = CollectivePhase.RUNNING
            col.running = col.held = True
            out.append(RunRing(col.tag, p, armed=not col.early))
            if col.aborted:
                out.append(AbortRing(col.tag))
        elif col.phase is CollectivePhase.WAIT_PERFORM and \
                any(u.epoch == p.epoch for u in self.installs):
            # Performed on a ring the master just rebuilt: its links are being taken over
            # right now (bounded by p2p_timeout there).
            col.phase = CollectivePhase.WAIT_INSTALL
        else:
            col.phase = CollectivePhase.WAIT_OUTCOME
            self._send(m.CollectiveDone(
                tag=col.tag, op_id=p.op_id, ok=False, kind=ErrorKind.PeerConnectionError,
                message=f"ring epoch {p.epoch} is not installed here ({self.ring_epoch}); "
                        "call update_topology()"), out)

    def _ring_done(self, ev: RingDone, out: list[Command]) -> None:
        col = self.collectives.get(ev.tag)
        if col is None or not col.running:
            return
        col.running, col.ring_ok = False, ev.ok
        if col.decided is not None:
            self._settle(col, out)  # its end was known already; it waited for the op
        elif col.redo is not None:
            # The master voided this early start and knows: put the input back and run
            # the collective again, as performed (nothing to report).
            out.append(Rollback(col.tag))
            col.held = False
            self._run_again(col, out)
        else:
            col.phase = CollectivePhase.WAIT_OUTCOME
            assert col.perform is not None
            self._send(m.CollectiveDone(tag=ev.tag, op_id=col.perform.op_id, ok=ev.ok,
                                        kind=ev.kind, message=ev.message), out)

    def _end_collective(self, col: Collective,
                        decided: m.CollectiveOutcome | tuple[ErrorKind, str],
                        out: list[Command]) -> None:
        """How the call ends is known (the first word counts): it ends now, or, while its
        ring op runs, once the op has stopped."""
        if col.decided is None:
            col.decided = decided
        if col.running:
            if not (isinstance(col.decided, m.CollectiveOutcome) and col.decided.ok):
                out.append(AbortRing(col.tag))
            return
        self._settle(col, out)

    def _settle(self, col: Collective, out: list[Command]) -> None:
        """The commit rule. The call's ring op (if any) has ended. A success the group
        decided is applied here (also for a caller that gave up meanwhile: the group
        must not differ); anything else puts the input back. Then the call ends."""
        self.collectives.pop(col.tag, None)
        call, d, p = ReduceCall(col.tag), col.decided, col.perform
        assert d is not None
        if isinstance(d, m.CollectiveOutcome) and d.ok and p is not None \
                and (d.data or col.ring_ok):
            if d.data:
                if col.held:
                    out.append(Rollback(col.tag))
                out.append(ApplyResult(col.tag, d.data))
                via = "master"
            elif p.world <= 1:
                out.append(Commit(col.tag, local=True))
                via = "local"
            else:
                out.append(Commit(col.tag))
                via = "ring"
            col.held = False
            if col.cancelled:
                self._fail(call, *_CANCELLED_FAILURE, out)
            else:
                self._resolve(call, Reduced(p.world, via, tuple(d.peers)), out)
            return
        if col.held:
            out.append(Rollback(col.tag))
            col.held = False
        if col.cancelled:
            kind, message = _CANCELLED_FAILURE
        elif isinstance(d, m.CollectiveOutcome):
            kind, message = ErrorKind.parse(d.kind), d.message
            if d.ok:  # (a success this peer has no part of: cannot be applied here)
                kind, message = ErrorKind.PCCLError, "the group succeeded without this peer"
        else:
            kind, message = d
        self._fail(call, kind, message, out)

    def _cancel_collective(self, tag: int, out: list[Command]) -> None:
        """The caller gave up. Before this peer reported, its part fails the collective
        for everyone and the call ends now (once its ring op stopped); after, the master
        may already have decided: the call ends with that outcome (or when its bounded
        wait runs out: :class:`CallExpired`)."""
        col = self.collectives.get(tag)
        if col is None or col.cancelled:
            return
        col.cancelled = True
        if col.perform is not None and col.perform.epoch >= 0:
            self.early_off_epoch = self.ring_epoch  # its ring op may leave pieces behind
        # An unconfirmed early start withdraws like a collective not yet performed.
        op_id = col.perform.op_id if col.perform is not None and not col.early else -1
        reported = (col.phase is CollectivePhase.WAIT_OUTCOME and not col.running) or \
            (col.perform is None and bool(col.init.data))  # the init carried its part
        self._send(m.CollectiveDone(tag=tag, op_id=op_id, ok=False,
                                    kind=ErrorKind.CollectiveAbortedError,
                                    message=_CANCELLED),
                   out)
        if reported:
            col.phase = CollectivePhase.WAIT_OUTCOME
        else:
            self._end_collective(col, _CANCELLED_FAILURE, out)

    def _expired(self, call: ReduceCall | SyncCall, out: list[Command]) -> None:
        if isinstance(call, ReduceCall):
            col = self.collectives.get(call.tag)
            if col is None:
                return
            out.append(Log(f"peer {self.peer_id}: cancelled all_reduce(tag={call.tag}); no "
                           "outcome from the master in time: output left as it was"))
            self._end_collective(col, _CANCELLED_FAILURE, out)
            return
        sync = self.sync
        if sync is None:
            return
        out.append(Log(f"peer {self.peer_id}: cancelled sync_shared_state(); no outcome from "
                       "the master in time: nothing committed here"))
        if sync.phase is SyncPhase.FETCHING:
            out.append(AbortFetch())
        self.sync = None
        self._fail(SYNC, *_CANCELLED_FAILURE, out)

    def _start_sync(self, init: m.SyncInit, out: list[Command]) -> None:
        self._check_usable()
        if self.sync is not None:
            raise ProtocolViolation(ErrorKind.InvalidUsageError,
                                    "sync_shared_state() is already running on this peer")
        self.sync = Sync(init)
        self.waiting.add(SYNC)
        self._send(init, out)

    def _fetched(self, ev: Fetched, out: list[Command]) -> None:
        sync = self.sync
        if sync is None or sync.phase is not SyncPhase.FETCHING:
            return
        sync.phase = SyncPhase.WAIT_OUTCOME
        if sync.decided is not None:
            self._settle_sync(sync, out)
        elif not sync.cancelled:  # (a withdrawal was this peer's report)
            sync.reported_ok = ev.ok
            self._send(m.SyncDone(ok=ev.ok, kind=ev.kind, message=ev.message), out)

    def _cancel_sync(self, out: list[Command]) -> None:
        """The caller gave up on the sync after its init went out: withdraw. The call
        ends with the outcome, committed after all if the group decided so before the
        withdrawal and this peer had fetched everything."""
        sync = self.sync
        if sync is None or sync.cancelled:
            return
        sync.cancelled = True
        self._send(m.SyncWithdraw(), out)
        if sync.phase is SyncPhase.FETCHING:
            out.append(AbortFetch())

    def _settle_sync(self, sync: Sync, out: list[Command]) -> None:
        """The sync's commit rule: the fetch (if any) has ended and the outcome is here."""
        d = sync.decided
        assert d is not None
        self.sync = None
        if d.ok and sync.reported_ok:
            self.last_revision = d.revision
            out.append(CommitSync(d.revision))
            if sync.cancelled:
                self._fail(SYNC, *_CANCELLED_FAILURE, out)
            else:
                self._resolve(SYNC, d, out)
            return
        if sync.cancelled:
            kind, message = _CANCELLED_FAILURE
        elif d.ok:  # (the group committed what this peer did not fetch)
            kind, message = ErrorKind.PCCLError, "the group committed without this peer"
        else:
            kind, message = ErrorKind.parse(d.kind), d.message
        self._fail(SYNC, kind, message, out)
