"""are_peers_pending(): the plain question (answered at once) and the collective one
(answered to every accepted peer at once, when all asked or wait in operations that only
wait for askers)."""

from __future__ import annotations

from pccl.errors import ErrorKind
from pccl.master.state.context import Context, Part
from pccl.master.state.events import Command, PeerStatus, PendingDeadline, Send
from pccl.master.state.roster import PeerRecord, covers
from pccl.protocol import messages as m


class Pending(Part):
    """The collective are_peers_pending() in progress."""

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        # Collective are_peers_pending(): voter -> request id, answered all at once.
        self.pending_votes: dict[int, int] = {}
        self.pending_deadline = 0

    def on_query(self, peer: int, rec: PeerRecord, msg: m.PendingQuery,
                 out: list[Command]) -> None:
        ctx = self.ctx
        if not msg.collective or rec.status is not PeerStatus.ACCEPTED:
            n = len(ctx.roster_now().pending)
            out.append(Send(peer, m.PendingAnswer(req=msg.req, pending=n > 0, count=n)))
            return
        if peer in self.pending_votes:
            # Its earlier question was given up (a cancelled caller): this one replaces it.
            self.pending_votes[peer] = msg.req
            self.on_waiting_changed(out)
            return
        if not self.pending_votes:
            self.pending_deadline = ctx.arm(PendingDeadline(), msg.timeout, out)
        self.pending_votes[peer] = msg.req
        self.on_waiting_changed(out)

    def on_waiting_changed(self, out: list[Command]) -> None:
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
        ctx = self.ctx
        if not self.pending_votes:
            return
        askers = set(self.pending_votes)
        busy = askers | ctx.votes | ctx.opt_votes
        joiners = askers & ctx.fresh
        if joiners:
            for group, inits in ctx.hub.waiting():
                missing = set(ctx.members(group)) - set(inits)
                if missing and missing <= joiners:
                    busy |= set(inits)
        roster = ctx.roster_now()
        if not covers(busy, roster.accepted):
            return
        n = len(roster.pending)
        pending = n > 0 or bool(ctx.votes)
        voters, self.pending_votes = self.pending_votes, {}
        ctx.fresh -= set(voters)
        ctx.disarm(self.pending_deadline)
        for p, req in sorted(voters.items()):
            out.append(Send(p, m.PendingAnswer(req=req, pending=pending, count=n)))

    def on_peer_dropped(self, peer: int, rec: PeerRecord, out: list[Command]) -> None:
        self.pending_votes.pop(peer, None)

    def on_deadline(self, did: int, advice: str, out: list[Command]) -> None:
        if did != self.pending_deadline:
            return
        late = self.ctx.missing(self.ctx.accepted(), self.pending_votes)
        askers, self.pending_votes = self.pending_votes, {}
        for p, req in sorted(askers.items()):
            out.append(Send(p, m.PendingAnswer(
                req=req, pending=False, ok=False, kind=ErrorKind.OperationTimeoutError,
                message=f"are_peers_pending(): peers {late} did not ask in time; "
                        f"{advice}")))
