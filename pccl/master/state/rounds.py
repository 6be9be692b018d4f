"""Rounds: registration (and recovery admission after a master restart), the
update_topology() vote, establishing the p2p links of every group's ring, repairs the
master starts on its own when a ring lost a peer, and installing the rings a round built.

A round runs in phases over the whole run (all peer groups; see the package docstring);
its links are routed by :mod:`~pccl.master.state.routes`, its failures settled by
:mod:`~pccl.master.state.disputes`, and with several masters its members are counted by
:mod:`~pccl.master.state.quorum`."""

from __future__ import annotations

from collections.abc import Collection

from pccl.errors import ErrorKind
from pccl.master.state import disputes, quorum, routes
from pccl.master.state.context import Context, Part, Round
from pccl.master.state.events import (
    ArmRecoveryTimer,
    Command,
    PeerRegistered,
    PeerStatus,
    Phase,
    ReachChecked,
    RecoveryTimeout,
    RoundTimeout,
    Send,
    VoteDeadline,
)
from pccl.master.state.optimize import Optimize
from pccl.master.state.roster import Claim, PeerRecord, covers
from pccl.protocol import messages as m


class Rounds(Part):
    """The vote, the round in progress (``ctx.round``) and what installed rings carry."""

    def __init__(self, ctx: Context, optimize: Optimize) -> None:
        super().__init__(ctx)
        self.optimize = optimize  # ring orders, mesh orders and limits come from there
        # Per group: (epoch, members) of the last ring installed here, less the peers
        # that left it gracefully since (they never vote elsewhere): what a quorum counts.
        self.lineage: dict[int, tuple[int, frozenset[int]]] = {}
        # Per group: the mesh limit of its current ring epoch (sent with TopologyUpdated).
        self.mesh_limits: dict[int, int] = {}
        # Per group: the mesh's rank order (peer ids) of its current ring epoch.
        self.mesh_orders: dict[int, list[int]] = {}
        # The first epoch this master built (None: none yet). A peer resuming from an
        # epoch at or after it was dropped by this master, not left by a restart.
        self.first_own_epoch: int | None = None
        self.attempts = 0
        self.vote_deadline = 0
        # Recovery after a master restart: peers named by resuming peers that have not
        # registered yet; admission waits for them (bounded by the recovery timer).
        self.recovery_awaiting: set[int] = set()
        self.recovery_id = 0

    # --- events -----------------------------------------------------------------------

    def on_update_topology(self, peer: int, rec: PeerRecord, msg: m.UpdateTopology,
                           out: list[Command]) -> None:
        ctx = self.ctx
        if rec.status is not PeerStatus.ACCEPTED:
            out.append(Send(peer, m.ErrorReply(
                kind=ErrorKind.InvalidUsageError,
                message="update_topology() before this peer was accepted")))
        elif peer in ctx.votes or ctx.phase is Phase.OPTIMIZE_TOPOLOGY or (
                ctx.phase is Phase.ESTABLISH_P2P and not ctx.repairing()):
            out.append(Send(peer, m.ErrorReply(
                kind=ErrorKind.InvalidUsageError,
                message="update_topology() is already in progress for this peer")))
        else:
            if not ctx.votes:
                self.vote_deadline = ctx.arm(VoteDeadline(), msg.timeout, out)
            ctx.votes.add(peer)
            # Peers of this group that wait in a collective would wait forever for
            # this voter, and it for them: call their collectives off.
            ctx.hub.vote_started(peer, rec.peer_group, "update_topology()", out)
            if ctx.phase is Phase.ESTABLISH_P2P:
                ctx.hub.waiting_changed(out)
                return  # a repair is running: the vote is counted when it ends
            ctx.phase = Phase.VOTE_ACCEPT_NEW_PEERS
            self._maybe_finish_vote(out)
            ctx.hub.waiting_changed(out)

    def on_p2p_report(self, peer: int, msg: m.P2PReport, out: list[Command]) -> None:
        rnd = self.ctx.round
        if rnd is not None and msg.epoch == rnd.epoch and peer in rnd.member_set \
                and peer not in rnd.reported:
            disputes.on_p2p_report(self.ctx, peer, msg, rnd)
            self.maybe_finish_round(out)

    def on_leave(self, peer: int, rec: PeerRecord) -> None:
        """It will not vote for this ring anywhere else: quorums no longer count it."""
        lin = self.lineage.get(rec.peer_group)
        if lin is not None and peer in lin[1]:
            self.lineage[rec.peer_group] = (lin[0], lin[1] - {peer})

    def on_reach_checked(self, ev: ReachChecked, out: list[Command]) -> None:
        rnd = self.ctx.round
        if rnd is not None and rnd.epoch == ev.epoch and ev.peer_id in rnd.reach \
                and rnd.reach[ev.peer_id] is None:
            rnd.reach[ev.peer_id] = ev.ok
            self.maybe_finish_round(out)

    def on_round_timeout(self, ev: RoundTimeout, out: list[Command]) -> None:
        ctx = self.ctx
        rnd = ctx.round
        if rnd is not None and rnd.epoch == ev.epoch:
            silent = [p for p in rnd.members if p not in rnd.reported]
            # A silent peer whose link waits for a silent receiver (to dial it back,
            # or to punch a hole) is not to blame: the receiver is, unless that would
            # leave nobody to blame.
            links = [*ctx.links.paths.items(), *ctx.links.mesh_paths.items()]
            waiting = {a for (a, b), path in links
                       if path in ("reverse", "punch") and a in silent and b in silent}
            blamed = [p for p in silent if p not in waiting] or silent
            rnd.unreachable.update(blamed)
            rnd.reported.update(silent)
            self.maybe_finish_round(out)

    def on_recovery_timeout(self, ev: RecoveryTimeout, out: list[Command]) -> None:
        if ev.recovery_id == self.recovery_id and self.recovery_awaiting:
            self.recovery_awaiting.clear()
            self.admit_if_nobody_accepted(out)

    def on_deadline(self, did: int, advice: str, out: list[Command]) -> None:
        ctx = self.ctx
        if did == self.vote_deadline and ctx.votes and (
                ctx.phase is Phase.VOTE_ACCEPT_NEW_PEERS or ctx.repairing()):
            late = ctx.missing(ctx.accepted(), ctx.votes)
            voters = sorted(ctx.votes)
            ctx.votes.clear()
            if ctx.phase is Phase.VOTE_ACCEPT_NEW_PEERS:
                ctx.phase = Phase.IDLE
            for p in voters:
                out.append(Send(p, m.TopologyUpdateFailed(
                    kind=ErrorKind.OperationTimeoutError,
                    message=f"update_topology(): peers {late} did not vote in time; "
                            f"{advice}")))

    def on_optimized(self, voters: set[int], out: list[Command]) -> None:
        """optimize_topology() chose the ring orders: rebuild the rings in them (its
        voters return at the round's end, as voters of update_topology())."""
        ctx = self.ctx
        ctx.phase = Phase.IDLE
        ctx.votes = set(voters)
        ctx.phase = Phase.VOTE_ACCEPT_NEW_PEERS
        ctx.rings_stale = True  # force a round, even with nothing pending
        self.attempts = 0
        self.start_round(ctx.accepted(), out)

    # --- transitions ------------------------------------------------------------------

    def on_registered(self, ev: PeerRegistered, out: list[Command]) -> None:
        ctx = self.ctx
        if ev.peer_id in ctx.peers:
            raise ValueError(f"peer id {ev.peer_id} registered twice")
        res = ev.resume
        ctx.peers[ev.peer_id] = PeerRecord(ev.peer_id, ev.peer_group, ev.p2p_addr,
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
        ctx.roster_changed()
        self.recovery_awaiting.discard(ev.peer_id)
        if res is not None:
            # Epochs must keep increasing across the restart: peers still hold links
            # keyed by their old epochs.
            ctx.epoch = max(ctx.epoch, res.epoch)
            own = self.first_own_epoch is not None and res.epoch >= self.first_own_epoch
            how = ("registered again after this master dropped it" if own
                   else "came back after a master restart")
            ctx.note("rejoin" if own else "resume", f"peer {ev.peer_id} {how} "
                     f"(its ring epoch {res.epoch}, shared-state revision {res.revision}, "
                     f"old ring {list(res.peers)})", (ev.peer_id,), ev.peer_group,
                     res.epoch)
            if res.revision >= 0:
                ctx.last_revision[ev.peer_id] = res.revision
            if ctx.phase is Phase.IDLE and not ctx.accepted():
                missing = set(res.peers).union(res.base, *(r for _, r in res.more)) \
                    - set(ctx.peers)
                if missing:
                    if not self.recovery_awaiting:
                        self.recovery_id += 1
                        out.append(ArmRecoveryTimer(self.recovery_id))
                    self.recovery_awaiting |= missing
        self.admit_if_nobody_accepted(out)

    def _broken(self) -> list[int]:
        """Groups whose ring cannot carry collectives until it is rebuilt."""
        ctx = self.ctx
        return sorted(g for g, ms in ctx.groups().items()
                      if g not in ctx.repair_failed and ctx.ring_broken(g))

    def maybe_repair(self, out: list[Command]) -> None:
        """PCCL drops a dead peer without anyone calling update_topology(): once no ring
        operation runs in a group whose ring lost a peer (or whose links failed), and no
        topology operation is under way, rebuild that group's ring from the peers left.
        Collectives called meanwhile wait for it and then run on the new ring."""
        ctx = self.ctx
        if not ctx.repair_rings or ctx.phase is not Phase.IDLE or ctx.votes \
                or ctx.opt_votes or self.recovery_awaiting:
            return
        running = ctx.hub.running_groups()
        groups = [g for g in self._broken() if g not in running]
        if not groups:
            return
        ctx.hub.repair_started(groups, out)
        members = [p for p in ctx.accepted() if ctx.peers[p].peer_group in groups]
        self.attempts = 0
        self.start_round(members, out, repair=True)

    def on_peer_removed(self, peer: int, rec: PeerRecord, out: list[Command]) -> None:
        """``peer`` was lost or left (forgotten already, and an optimization it was in
        failed): rebuild the round it was in, count the vote without it, tell the rest."""
        ctx = self.ctx
        rnd = ctx.round
        if rnd is not None and peer in rnd.member_set:
            # The ring that was being built contains a dead peer: build it again.
            remaining = [p for p in rnd.members if p != peer]
            self.start_round(remaining, out, repair=rnd.repair)
        elif ctx.phase is Phase.VOTE_ACCEPT_NEW_PEERS:
            self._maybe_finish_vote(out)
        if rec.status is PeerStatus.ACCEPTED and (ctx.phase is not Phase.ESTABLISH_P2P
                                                  or ctx.repairing()):
            # (A repair rebuilds only some groups: the others must hear of the loss now.)
            self.broadcast_world(ctx.accepted(), out)
        self.admit_if_nobody_accepted(out)
        ctx.hub.waiting_changed(out)

    def admit_if_nobody_accepted(self, out: list[Command]) -> None:
        ctx = self.ctx
        if self.recovery_awaiting:
            return  # a restarted master waits for the rest of the old group
        if ctx.phase is Phase.IDLE and not ctx.accepted() and ctx.pending():
            self.attempts = 0
            self.start_round(ctx.pending(), out)

    def _maybe_finish_vote(self, out: list[Command]) -> None:
        ctx = self.ctx
        roster = ctx.roster_now()
        if not roster.accepted:
            ctx.votes.clear()
            ctx.phase = Phase.IDLE
            return
        if not covers(ctx.votes, roster.accepted):
            return
        accepted = list(roster.accepted)
        ctx.disarm(self.vote_deadline)
        pending = ctx.pending()
        if not pending and not ctx.rings_stale:
            # Nothing changed: the rings in place are still right.
            voters = sorted(ctx.votes)
            ctx.votes.clear()
            ctx.phase = Phase.IDLE
            ctx.fresh |= set(voters)
            for p in voters:
                g = ctx.peers[p].peer_group
                out.append(Send(p, m.TopologyUpdated(
                    epoch=ctx.ring_epochs.get(g, ctx.epoch),
                    mesh_max_bytes=self.mesh_limits.get(g, 0),
                    mesh_order=self._mesh_order_sent(g))))
            return
        self.attempts = 0
        self.start_round(accepted + pending, out)

    def start_round(self, members: list[int], out: list[Command], *,
                    repair: bool = False) -> None:
        ctx = self.ctx
        # (Without quorums peers learn installed rings from topology_updated alone.)
        counted: dict[int, list[tuple[int, list[int]]]] = {}
        if ctx.quorum_on:
            members, counted = quorum.quorum_filter(ctx, self.lineage, members, out)
        if not members:
            ctx.round = None
            ctx.phase = Phase.IDLE
            if not repair:
                ctx.votes.clear()
            # Peers that registered meanwhile have nobody left to vote them in.
            self.admit_if_nobody_accepted(out)
            self._after_repair(out)
            return
        ctx.epoch += 1
        if self.first_own_epoch is None:
            self.first_own_epoch = ctx.epoch
        ctx.phase = Phase.ESTABLISH_P2P
        members = sorted(members)  # join order: peer ids are handed out increasingly
        rnd = ctx.round = Round(ctx.epoch, members, repair=repair,
                                groups={ctx.peers[p].peer_group for p in members})
        ctx.links.new_round()
        rnd.rings = self.optimize.rings_of(members)
        for group, ring in rnd.rings.items():
            rnd.mesh_orders[group] = self.optimize.mesh_order(ring)
        routes.establish(ctx, rnd, counted, out)

    def maybe_finish_round(self, out: list[Command]) -> None:
        ctx = self.ctx
        rnd = ctx.round
        assert rnd is not None
        if not covers(rnd.reported, rnd.member_set):
            return
        if not disputes.settle(ctx, rnd, out):
            return  # (ReachChecked comes back here)
        if rnd.unreachable:
            self.attempts += 1
            dropped_accepted = False
            for p in sorted(rnd.unreachable):
                reason = rnd.reasons.get(p)
                rec = ctx.forget(p, reason or "unreachable by its ring neighbour over p2p",
                                 out, tell=reason is not None)
                dropped_accepted |= rec.status is PeerStatus.ACCEPTED
            remaining = [p for p in rnd.members if p not in rnd.unreachable]
            ctx.note("round_failed", f"round {rnd.epoch} ({'repair' if rnd.repair else 'vote'},"
                     f" attempt {self.attempts} of {ctx.max_establish_attempts}): "
                     f"unreachable {sorted(rnd.unreachable)}"
                     + ("; trying again without them"
                        if self.attempts < ctx.max_establish_attempts else "; giving up"),
                     sorted(rnd.unreachable), value=rnd.epoch)
            if self.attempts < ctx.max_establish_attempts:
                self.start_round(remaining, out, repair=rnd.repair)
                return
            ctx.round = None
            ctx.phase = Phase.IDLE
            if rnd.repair:
                # Stop repairing these groups until a voted round succeeds, and fail what
                # waited for the repair instead of holding it.
                ctx.repair_failed |= rnd.groups
                if dropped_accepted:
                    self.broadcast_world(ctx.accepted(), out)
                ctx.hub.repair_failed(rnd.groups, self.attempts, out)
                self._after_repair(out)
                return
            voters = sorted(ctx.votes)
            ctx.votes.clear()
            ctx.rings_stale = True
            if dropped_accepted:
                # The accepted set shrank: tell the rest, as any other loss does.
                self.broadcast_world(ctx.accepted(), out)
            for p in voters:
                out.append(Send(p, m.TopologyUpdateFailed(
                    message=f"p2p rings could not be formed after {self.attempts} attempts")))
            self.admit_if_nobody_accepted(out)
            return
        if rnd.lan_failed:
            # Not an attempt that counts: every retry takes at least one more pair off
            # the LAN for good (lan_failed), so they end.
            ctx.note("round_failed", f"round {rnd.epoch} ({'repair' if rnd.repair else 'vote'}"
                     f"): ring links dialed on a LAN failed ("
                     + ", ".join(f"{r} -> {t}" for r, t in sorted(rnd.lan_failed))
                     + "); trying again over the public addresses",
                     sorted({x for pair in rnd.lan_failed for x in pair}), value=rnd.epoch)
            self.start_round(rnd.members, out, repair=rnd.repair)
            return
        if rnd.repair:
            rings = rnd.rings
            for g in rnd.groups:
                if g in rings:
                    ctx.rings[g] = rings[g]
                    ctx.ring_epochs[g] = rnd.epoch
                    self.lineage[g] = (rnd.epoch, frozenset(rings[g]))
                    self.mesh_limits[g] = self.optimize.mesh_limit(g, rings[g], rnd)
                    self.mesh_orders[g] = rnd.mesh_orders.get(g, rings[g])
                else:
                    ctx.rings.pop(g, None)
                    ctx.ring_epochs.pop(g, None)
                    self.mesh_limits.pop(g, None)
                    self.mesh_orders.pop(g, None)
                ctx.broken_groups.discard(g)
            ctx.note("repair", f"ring epoch {rnd.epoch}: rebuilt without the lost peers: "
                     + self._describe_rings(rnd.groups), rnd.members, value=rnd.epoch)
            ctx.round = None
            ctx.phase = Phase.IDLE
            self.broadcast_world(rnd.members, out)
            for p in rnd.members:
                g = ctx.peers[p].peer_group
                out.append(Send(p, m.TopologyUpdated(
                    epoch=rnd.epoch, repair=True, mesh_max_bytes=self.mesh_limits.get(g, 0),
                    mesh_order=self._mesh_order_sent(g))))
            self._after_repair(out)
            return
        joined = [p for p in rnd.members if ctx.peers[p].status is PeerStatus.REGISTERED]
        for p in rnd.members:
            ctx.peers[p].status = PeerStatus.ACCEPTED
            ctx.peers[p].claim = None  # part of this master's lineage from now on
        ctx.roster_changed()
        if joined:
            ctx.note("admitted", f"admitted peer{'s' if len(joined) > 1 else ''} "
                     + ", ".join(f"{p} (group {ctx.peers[p].peer_group})" for p in joined),
                     joined, value=rnd.epoch)
        # Every member has just come out of update_topology() (or was admitted by it).
        ctx.fresh |= set(rnd.members)
        ctx.rings = rnd.rings
        ctx.ring_epochs = dict.fromkeys(ctx.rings, rnd.epoch)
        for g, ring in ctx.rings.items():
            self.lineage[g] = (rnd.epoch, frozenset(ring))
        self.mesh_limits = {g: self.optimize.mesh_limit(g, ring, rnd)
                            for g, ring in ctx.rings.items()}
        self.mesh_orders = {g: rnd.mesh_orders.get(g, ring) for g, ring in ctx.rings.items()}
        ctx.rings_stale = rnd.reorder_pending
        ctx.broken_groups.clear()
        ctx.repair_failed.clear()
        ctx.round = None
        ctx.phase = Phase.IDLE
        ctx.votes.clear()
        ctx.note("ring", f"ring epoch {rnd.epoch}: " + self._describe_rings(ctx.rings),
                 rnd.members, value=rnd.epoch)
        self.broadcast_world(rnd.members, out)
        for p in rnd.members:
            g = ctx.peers[p].peer_group
            out.append(Send(p, m.TopologyUpdated(
                epoch=rnd.epoch, mesh_max_bytes=self.mesh_limits.get(g, 0),
                mesh_order=self._mesh_order_sent(g))))

    def _describe_rings(self, groups: Collection[int]) -> str:
        ctx = self.ctx
        def mesh(g: int) -> str:
            order = self._mesh_order_sent(g)
            return f" (mesh ranks {' '.join(map(str, order))})" if order else ""

        return "; ".join(
            f"group {g}: " + (" -> ".join(map(str, ctx.rings[g])) + mesh(g)
                              if len(ctx.rings[g]) > 1 else f"{ctx.rings[g][0]} alone")
            for g in sorted(groups) if ctx.rings.get(g)) or "no rings"

    def _after_repair(self, out: list[Command]) -> None:
        """A repair ended: count the votes cast meanwhile, run what waited for it."""
        ctx = self.ctx
        if ctx.votes:
            ctx.phase = Phase.VOTE_ACCEPT_NEW_PEERS
            self._maybe_finish_vote(out)
            ctx.hub.waiting_changed(out)
            return
        ctx.hub.rings_ready(out)
        # A repair that dropped a peer may leave every remaining member asking
        # are_peers_pending(): answer them now (found by the population test: nothing
        # else would, and the run hung with joiners waiting).
        ctx.hub.waiting_changed(out)

    def broadcast_world(self, targets: list[int], out: list[Command]) -> None:
        ctx = self.ctx
        sizes = ctx.group_sizes()
        total = sum(sizes.values())
        largest = max(sizes.values(), default=0)
        # One message per group, the same object for each of its members: the server
        # encodes it once (codec.FrameCache). Messages are not modified once made.
        worlds: dict[int, m.WorldInfo] = {}
        for p in targets:
            group = ctx.peers[p].peer_group
            world = worlds.get(group)
            if world is None:
                left_epoch, left = self._left(group)
                world = worlds[group] = m.WorldInfo(
                    epoch=ctx.epoch,
                    ring=[q for q in ctx.rings.get(group, []) if q in ctx.peers],
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
        ctx = self.ctx
        lin = self.lineage.get(group)
        ring = ctx.rings.get(group)
        if lin is None or ring is None or lin[0] != ctx.ring_epochs.get(group):
            return -1, []
        left = sorted(set(ring) - lin[1])
        return (lin[0], left) if left else (-1, [])

    def _mesh_order_sent(self, group: int) -> list[int]:
        """What TopologyUpdated carries of ``group``'s mesh order: empty where it is the
        ring's own."""
        ctx = self.ctx
        order = self.mesh_orders.get(group, [])
        return [] if order == ctx.rings.get(group, []) else list(order)
