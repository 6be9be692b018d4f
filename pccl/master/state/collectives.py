"""Collectives: per peer group and tag, from the members' inits to the outcome (early
starts, the perform on the ring, tiny ones reduced here, withdrawals and failures)."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Collection, Iterable

from pccl import _core
from pccl.enums import DTYPES, DataType, QuantizationAlgorithm, ReduceOp
from pccl.errors import ErrorKind, PCCLError
from pccl.master.state.context import Context, Part
from pccl.master.state.events import (
    CollectiveDeadline,
    Command,
    PeerStatus,
    Send,
)
from pccl.master.state.roster import PeerRecord, covers
from pccl.protocol import messages as m


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


def _slots(col: Collective) -> list[int]:
    """What an outcome tells the peers of whose bytes are where: an all-gather's
    participants in rank order (its result's slots); nothing for an all-reduce."""
    first = next(iter(col.inits.values()), None)
    return list(col.participants) if first is not None and first.kind == "all_gather" else []


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

# All-gathers gathered by the master: at most this many bytes of result, which goes to
# every member in one frame (well below protocol.MAX_FRAME).
VIA_MASTER_MAX_GATHER = 4 << 20

# What a CollectiveInit may ask for.
KINDS = ("all_reduce", "all_gather")

# Values of pccl.SharedStateSyncStrategy (kept numeric on the wire).


class Collectives(Part):
    """The collectives in flight and the counts their op ids derive from."""

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        self.collectives: dict[tuple[int, int], Collective] = {}
        self.next_op_id = 1
        # (group, tag) -> (ring epoch, successful collectives of the tag on that ring):
        # what the op id of an early start derives from (see m.early_op_id).
        self.early_counts: dict[tuple[int, int], tuple[int, int]] = {}
        # How collectives ran: early starts that stood (one master round trip), early
        # starts voided (run again), reduced here (tiny ones: one round trip, no ring).
        self.collective_paths = {"early": 0, "voided": 0, "via_master": 0}

    def on_init(self, peer: int, msg: m.CollectiveInit, out: list[Command]) -> None:
        ctx = self.ctx
        rec = ctx.peers[peer]

        def refuse(kind: ErrorKind, why: str) -> None:
            out.append(Send(peer, m.CollectiveOutcome(tag=msg.tag, op_id=-1, ok=False,
                                                      kind=kind, message=why)))
            if msg.early_op >= 0 and rec.status is PeerStatus.ACCEPTED:
                # Its early ring op may have left pieces on the group's links.
                ctx.mark_broken(rec.peer_group)

        if rec.status is not PeerStatus.ACCEPTED:
            refuse(ErrorKind.InvalidUsageError,
                   "collectives need an accepted peer; call connect() first")
            return
        if msg.kind not in KINDS:
            refuse(ErrorKind.InvalidUsageError,
                   f"unknown collective kind {msg.kind[:32]!r}; one of {', '.join(KINDS)}")
            return
        if msg.kind == "all_gather" and msg.quant_algorithm:
            refuse(ErrorKind.InvalidUsageError, "an all-gather is not quantized")
            return
        key = (rec.peer_group, msg.tag)
        col = self.collectives.get(key)
        if col is not None and (peer in col.inits or col.op_id >= 0):
            refuse(ErrorKind.InvalidUsageError,
                   f"tag {msg.tag} is already in flight on this peer group")
            return
        if col is None:
            col = self.collectives[key] = Collective(rec.peer_group, msg.tag)
            col.deadline = ctx.arm(CollectiveDeadline(col.group, col.tag), msg.timeout, out)
        col.inits[peer] = msg
        ctx.fresh.discard(peer)
        if msg.early_op >= 0:
            self._on_early_start(peer, col, msg, out)
        if ctx.group_in_vote(rec.peer_group):
            self.fail_unperformed(col, ErrorKind.CollectiveAbortedError, (
                "other peers of the group are in update_topology(); call update_topology() "
                "and retry"), out)
            return
        if (rec.peer_group in ctx.repair_failed or not ctx.repair_rings) \
                and ctx.ring_broken(rec.peer_group):
            # Fail fast: no repair is coming, waiting could wait forever.
            self.fail_unperformed(col, ErrorKind.PeerConnectionError, (
                f"the ring of peer group {col.group} is broken and could not be rebuilt; "
                "call update_topology() and retry"), out)
            return
        self.maybe_perform(col, out)
        ctx.hub.waiting_changed(out)

    def _early_op(self, group: int, tag: int) -> int:
        """The op id an early start of ``tag`` must carry now (see m.early_op_id)."""
        ctx = self.ctx
        epoch = ctx.ring_epochs.get(group, 0)
        counted, n = self.early_counts.get((group, tag), (epoch, 0))
        return m.early_op_id(epoch, tag, n if counted == epoch else 0)

    def _on_early_start(self, peer: int, col: Collective, msg: m.CollectiveInit,
                        out: list[Command]) -> None:
        """A member started the ring as op ``msg.early_op`` when it called. It stands if
        it is the op the ring's members agree on now; otherwise the attempt is void."""
        ctx = self.ctx
        rnd = ctx.round
        why = ""
        if col.early_void:
            why = "an earlier member's early start failed"
        elif msg.epoch != ctx.ring_epochs.get(col.group, 0) or ctx.ring_broken(col.group) \
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
            self.void_early(col, why, out)

    def void_early(self, col: Collective, why: str, out: list[Command]) -> None:
        """Calls off the early start of a collective not yet performed: its members stop
        their ring op (and run the collective again once performed), and the ring is
        rebuilt first (its links may hold pieces of the void op)."""
        ctx = self.ctx
        if col.early < 0 or col.op_id >= 0:
            return
        if not col.early_void:
            col.early_void = True
            self.collective_paths["voided"] += 1
            for p in sorted(col.early_peers):
                if p not in col.early_done:
                    out.append(Send(p, m.CollectiveAbort(tag=col.tag, op_id=col.early,
                                                         message=f"early start void: {why}")))
        ctx.mark_broken(col.group)

    def maybe_perform(self, col: Collective, out: list[Command]) -> None:
        ctx = self.ctx
        if not ctx.all_joined(col.group, col.inits):
            return
        members = ctx.members(col.group)
        rnd = ctx.round
        if ctx.ring_broken(col.group) or (rnd is not None and rnd.repair
                                          and col.group in rnd.groups):
            self.void_early(col, "the ring is being rebuilt", out)
            return  # held until the master repaired the ring (see Rounds.maybe_repair)
        ctx.disarm(col.deadline)
        first = col.inits[members[0]]
        # Shapes are compared where both peers know theirs (a raw buffer has none).
        ref = next((tuple(col.inits[p].shape) for p in members if col.inits[p].shape), ())
        odd = [p for p in members if _describe(col.inits[p]) != _describe(first)
               or col.inits[p].shape and tuple(col.inits[p].shape) != ref]
        if odd:
            detail = "; ".join(f"peer {p}: {_explain(col.inits[p])}"
                               for p in [members[0], *odd])
            self.fail_unperformed(col, ErrorKind.InvalidUsageError, (
                f"peers disagree on collective tag {col.tag}: {detail}"), out)
            return
        if col.early < 0 and all(col.inits[p].data for p in members) \
                and len(members) * len(first.data) <= (
                    VIA_MASTER_MAX_GATHER if first.kind == "all_gather" else VIA_MASTER_MAX_TOTAL):
            self._reduce_here(col, first, out)
            return
        ring = ctx.rings.get(col.group, [])
        col.epoch = ctx.ring_epochs.get(col.group, 0)
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
        ctx.note("collective_started", "", ring, col.group, col.op_id,
                 first.count * _ELEMENT_BYTES.get(first.dtype, 0), col.tag)
        for rank, p in enumerate(ring):
            out.append(Send(p, m.CollectivePerform(tag=col.tag, op_id=col.op_id,
                                                   epoch=col.epoch, rank=rank,
                                                   world=len(ring))))
        if col.reported:
            self._maybe_finish(col, out)

    def _reduce_here(self, col: Collective, first: m.CollectiveInit,
                     out: list[Command]) -> None:
        """Every member sent its tensor with its init (a tiny collective): reduce them
        here, in the ring's order (the bytes the ring would produce), or for an
        all-gather join them in rank order, and answer everyone with the result: one
        round trip, no ring."""
        ctx = self.ctx
        ring = ctx.rings.get(col.group, [])
        size = first.count * _ELEMENT_BYTES.get(first.dtype, 0)
        bad = [p for p in ring if len(col.inits[p].data) != size]
        if bad or first.quant_algorithm:
            self.fail_unperformed(col, ErrorKind.InvalidUsageError, (
                f"collective tag {col.tag}: peers {bad} sent tensors that are not "
                f"{first.count} x {_name(DataType, first.dtype)} ({size} bytes)"
                if bad else "quantized collectives are not reduced by the master"), out)
            return
        try:
            if first.kind == "all_gather":
                result = b"".join(col.inits[p].data for p in ring)  # in rank order
            else:
                result = _core.star_all_reduce([col.inits[p].data for p in ring],
                                               first.dtype, first.op)
        except PCCLError as e:
            self.fail_unperformed(col, ErrorKind.of(e), str(e), out)
            return
        del self.collectives[(col.group, col.tag)]
        ctx.disarm(col.deadline)
        col.op_id = self.next_op_id
        self.next_op_id += 1
        col.participants = list(ring)
        self.collective_paths["via_master"] += 1
        ctx.note("collective_started", "", ring, col.group, col.op_id, size, col.tag)
        ctx.note("collective_done", "", ring, col.group, col.op_id, tag=col.tag)
        gather = first.kind == "all_gather" and len(ring) > 1
        for rank, p in enumerate(ring):
            # An all-gather's member gets the others' bytes: it has its own. (Alone, it
            # gets its own back: an outcome's empty data would mean "no result here".)
            data = result[:rank * size] + result[(rank + 1) * size:] if gather else result
            out.append(Send(p, m.CollectiveOutcome(tag=col.tag, op_id=col.op_id, ok=True,
                                                   kind=ErrorKind.NONE, message="",
                                                   data=data, world=len(ring),
                                                   peers=_slots(col))))

    def fail_unperformed(self, col: Collective, kind: ErrorKind, why: str, out: list[Command],
                         skip: int | None = None) -> None:
        ctx = self.ctx
        del self.collectives[(col.group, col.tag)]
        ctx.disarm(col.deadline)
        if col.early >= 0:
            # Early members ran the ring: its links may hold pieces of the op.
            ctx.mark_broken(col.group)
        ctx.note("collective_failed", f"collective tag {col.tag} of group {col.group} "
                 f"called off before it ran: {why}", sorted(col.inits), col.group, -1,
                 tag=col.tag)
        for p in col.inits:
            if p == skip:
                continue
            out.append(Send(p, m.CollectiveOutcome(tag=col.tag, op_id=-1, ok=False,
                                                   kind=kind, message=why)))

    def on_done(self, peer: int, msg: m.CollectiveDone, out: list[Command]) -> None:
        ctx = self.ctx
        col = self.collectives.get((ctx.peers[peer].peer_group, msg.tag))
        if col is not None and col.op_id < 0 and msg.op_id >= 0 and msg.op_id == col.early \
                and peer in col.early_peers:
            # An early ring op ended before every member had called.
            if col.early_void:
                return  # it runs again once performed
            col.early_done[peer] = msg
            if not msg.ok:
                self.void_early(col, f"peer {peer}: {msg.message}", out)
            return
        if col is not None and msg.op_id < 0 and col.op_id < 0 and peer in col.inits:
            # The peer gave up before the collective ran: call it off for everyone.
            # The withdrawing peer hears nothing (it may already reuse the tag), unless
            # it sent its tensor to be reduced here: it waits to hear which came first.
            self.fail_unperformed(col, ErrorKind.CollectiveAbortedError,
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
            self._failed(col, msg.kind or ErrorKind.PeerConnectionError,
                                    f"peer {peer}: {msg.message}", out)
        self._maybe_finish(col, out)

    def _failed(self, col: Collective, kind: ErrorKind, why: str,
                           out: list[Command]) -> None:
        if col.error is not None:
            return
        col.error = (kind, why)
        for p in col.participants:
            if p not in col.reported:
                out.append(Send(p, m.CollectiveAbort(tag=col.tag, op_id=col.op_id, message=why)))

    def _maybe_finish(self, col: Collective, out: list[Command]) -> None:
        ctx = self.ctx
        if not covers(col.reported, col.participant_set):
            return
        del self.collectives[(col.group, col.tag)]
        kind, why = col.error or (ErrorKind.NONE, "")
        if col.error is None:
            ctx.note("collective_done", "", col.participants, col.group, col.op_id,
                     tag=col.tag)
            if col.epoch == ctx.ring_epochs.get(col.group, 0):
                counted, n = self.early_counts.get((col.group, col.tag), (col.epoch, 0))
                self.early_counts[(col.group, col.tag)] = (
                    col.epoch, n + 1 if counted == col.epoch else 1)
        else:
            ctx.note("collective_failed", f"collective op {col.op_id} (tag {col.tag}) of "
                     f"group {col.group} aborted: {kind}: {why}", col.participants,
                     col.group, col.op_id, tag=col.tag)
        if col.error is not None:
            # Links may hold half-sent pieces: the rings must be rebuilt before reuse.
            ctx.mark_broken(col.group)
        for p in col.participants:
            out.append(Send(p, m.CollectiveOutcome(tag=col.tag, op_id=col.op_id,
                                                   ok=col.error is None, kind=kind, message=why,
                                                   peers=_slots(col))))

    def _lose(self, peer: int, group: int, out: list[Command]) -> None:
        ctx = self.ctx
        for col in list(self.collectives.values()):
            if col.group != group:
                continue
            if col.op_id < 0 and not ctx.repair_rings:
                col.inits.pop(peer, None)
                self.fail_unperformed(col, ErrorKind.PeerConnectionError, (
                    f"peer {peer} left the group; call update_topology() and retry"), out)
            elif col.op_id < 0:
                # As in PCCL, the others go on without it: the collective runs once the
                # master repaired the ring (or at once, if the rest already joined).
                col.inits.pop(peer, None)
                col.early_peers.discard(peer)
                col.early_done.pop(peer, None)
                self.void_early(col, f"peer {peer} left the group", out)
                if not col.inits:
                    del self.collectives[(col.group, col.tag)]
                    ctx.disarm(col.deadline)
            elif peer in col.participant_set:
                col.participants.remove(peer)
                col.participant_set = col.participant_set - {peer}
                col.reported.discard(peer)
                self._failed(col, ErrorKind.PeerConnectionError,
                                        f"peer {peer} was lost during the collective", out)
                self._maybe_finish(col, out)

    # --- what the other sub-machines set off ------------------------------------------

    def on_peer_dropped(self, peer: int, rec: PeerRecord, out: list[Command]) -> None:
        if rec.status is PeerStatus.ACCEPTED:
            self._lose(peer, rec.peer_group, out)

    def on_vote_started(self, peer: int, group: int, what: str, out: list[Command]) -> None:
        for col in list(self.collectives.values()):
            if col.group == group and col.op_id < 0:
                self.fail_unperformed(col, ErrorKind.CollectiveAbortedError, (
                    f"peer {peer} called {what} while this peer called a collective "
                    f"(tag {col.tag}); call {what} and retry"), out)

    def on_repair_started(self, groups: Collection[int], out: list[Command]) -> None:
        for col in self.collectives.values():
            if col.group in groups:
                # Their members' early ring ops end with the links being replaced.
                self.void_early(col, "the ring is being rebuilt", out)

    def on_repair_failed(self, groups: Collection[int], attempts: int,
                         out: list[Command]) -> None:
        # Fail what waited for the repair instead of holding it.
        for col in list(self.collectives.values()):
            if col.group in groups and col.op_id < 0:
                self.fail_unperformed(col, ErrorKind.PeerConnectionError, (
                    f"the ring of peer group {col.group} could not be rebuilt after "
                    f"a peer was lost ({attempts} attempts); call "
                    "update_topology() and retry"), out)

    def on_rings_ready(self, out: list[Command]) -> None:
        for col in list(self.collectives.values()):
            if col.op_id < 0 and (col.group, col.tag) in self.collectives:
                self.maybe_perform(col, out)

    def waiting(self) -> Iterable[tuple[int, Collection[int]]]:
        return [(col.group, col.inits) for col in self.collectives.values() if col.op_id < 0]

    def running_groups(self) -> Iterable[int]:
        return {c.group for c in self.collectives.values() if c.op_id >= 0}

    def on_deadline(self, what: CollectiveDeadline, did: int, advice: str,
                    out: list[Command]) -> None:
        col = self.collectives.get((what.group, what.tag))
        if col is not None and col.deadline == did and col.op_id < 0:
            late = self.ctx.missing(self.ctx.members(col.group), col.inits)
            self.fail_unperformed(col, ErrorKind.OperationTimeoutError, (
                f"collective tag {col.tag}: peers {late} did not join it in time; "
                f"{advice}"), out)
