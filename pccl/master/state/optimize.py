"""optimize_topology(): the vote, the bandwidth probes and their reports, the solver's
answers, and what the measurements decide between rounds (each group's ring order, the
mesh's rank order, the mesh's size limit from the cost model)."""

from __future__ import annotations

import math
from collections.abc import Callable

from pccl import algorithms
from pccl.master.state import routes
from pccl.master.state.context import Context, Part, Round
from pccl.master.state.events import (
    BetterRing,
    Command,
    OptimizeDeadline,
    PeerStatus,
    Phase,
    Send,
    Solve,
    Solved,
)
from pccl.master.state.roster import PeerRecord, covers
from pccl.protocol import messages as m


def rotation_of(a: list[int], b: list[int]) -> bool:
    """Whether ``a`` is ``b`` started elsewhere (the same cycle)."""
    if len(a) != len(b) or not a:
        return a == b
    try:
        s = b.index(a[0])
    except ValueError:
        return False
    return b[s:] + b[:s] == a


class Optimize(Part):
    """Measured bandwidths and latencies, the preferred ring orders, and the
    optimize_topology() round in progress (its voters are ``ctx.opt_votes``)."""

    #: Seconds each probe measures a link for.
    probe_seconds = 0.25
    #: What the solver assumes of a link between two peers behind NAT, against a direct
    #: one: it is hole-punched (one stream instead of a pool) or, if that fails, relayed
    #: through the master (every byte twice through one process). A guess, not a
    #: measurement (the probes cannot reach such a pair); it makes the solver place NAT'd
    #: peers between dialable ones where the group allows.
    nat_pair_factor = 0.25
    #: The largest group :meth:`mesh_order` orders (beyond it the mesh takes the ring's
    #: order; up to pccl.algorithms.MESH_ORDER_MAX_WORLD it is built to the mesh's shape,
    #: above only the ring's best start is chosen: 8 starts, each k log k lookups).
    mesh_order_max_peers = 4096

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        # Measured bandwidths (bytes/s) with the optimization round they were measured
        # in, the preferred ring order per group, and the state of the round in progress.
        self.bandwidth: dict[tuple[int, int], tuple[float, int]] = {}
        # One-way latency (seconds) per ordered pair, from the probes' dials, with the
        # round it was measured in (as bandwidth).
        self.latency: dict[tuple[int, int], tuple[float, int]] = {}
        self.ring_order: dict[int, list[int]] = {}
        self.opt_round = 0
        self.opt_probers: set[int] = set()
        self.opt_solving: set[int] = set()
        self.opt_deadline = 0
        self.max_bandwidth_age = 4  # rounds after which a measurement is taken again
        # The mesh orders computed for rings (cleared when a latency is measured).
        self.mesh_order_memo: dict[tuple[int, ...], list[int]] = {}
        # Per group: what the cost model was given for it (one-way latency s, bytes/s).
        self.mesh_inputs: dict[int, tuple[float, float]] = {}

    # --- the vote, the probes, the solver ---------------------------------------------

    def on_vote(self, peer: int, rec: PeerRecord, msg: m.OptimizeTopology,
                out: list[Command]) -> None:
        ctx = self.ctx
        if rec.status is not PeerStatus.ACCEPTED:
            out.append(Send(peer, m.OptimizeFailed(
                message="optimize_topology() before this peer was accepted")))
            return
        if ctx.phase not in (Phase.IDLE, Phase.OPTIMIZE_TOPOLOGY) or peer in ctx.opt_votes \
                or self.opt_probers or self.opt_solving:
            out.append(Send(peer, m.OptimizeFailed(
                message="another topology operation is in progress; retry after it")))
            return
        ctx.phase = Phase.OPTIMIZE_TOPOLOGY
        if not ctx.opt_votes:
            self.opt_deadline = ctx.arm(OptimizeDeadline(), msg.timeout, out)
        ctx.opt_votes.add(peer)
        ctx.hub.vote_started(peer, rec.peer_group, "optimize_topology()", out)
        if not covers(ctx.opt_votes, ctx.roster_now().accepted):
            ctx.hub.waiting_changed(out)
            return
        ctx.disarm(self.opt_deadline)
        self.opt_round += 1
        # Forget the pairs of peers that are gone (ids are never reused): in a long run
        # with churn they would pile up, k per departed peer.
        self.bandwidth = {pair: v for pair, v in self.bandwidth.items()
                          if pair[0] in ctx.peers and pair[1] in ctx.peers}
        self.latency = {pair: v for pair, v in self.latency.items()
                        if pair[0] in ctx.peers and pair[1] in ctx.peers}
        self.mesh_order_memo.clear()
        # Measure every ordered pair inside a group that is unknown or too old.
        plan: dict[int, list[int]] = {}
        for members in ctx.groups().values():
            if len(members) < 3:
                continue  # one ring only: nothing to choose
            for i in members:
                for j in members:
                    if i == j or not ctx.peers[j].reachable:
                        continue  # a peer behind NAT cannot be dialed: estimated instead
                    seen = self.bandwidth.get((i, j))
                    if seen is None or self.opt_round - seen[1] > self.max_bandwidth_age:
                        plan.setdefault(i, []).append(j)
        self.opt_probers = set(plan)
        for i, targets in sorted(plan.items()):
            out.append(Send(i, m.ProbeRequest(
                target_ids=targets, target_addrs=[ctx.peers[t].p2p_addr for t in targets],
                seconds=self.probe_seconds, **ctx.keys(targets))))
        if not plan:
            self._solve_all(out)

    def on_probe_report(self, peer: int, msg: m.ProbeReport, out: list[Command]) -> None:
        if peer not in self.opt_probers or len(msg.target_ids) != len(msg.rates):
            return
        peers = self.ctx.peers
        self.opt_probers.discard(peer)
        dials = msg.dial_seconds if len(msg.dial_seconds) == len(msg.target_ids) else []
        for t, rate in zip(msg.target_ids, msg.rates):
            if t in peers:
                self.bandwidth[(peer, t)] = (max(float(rate), 0.0), self.opt_round)
        for t, dial in zip(msg.target_ids, dials):
            if t in peers and math.isfinite(dial) and dial >= 0:
                self.latency[(peer, t)] = (algorithms.one_way_latency([dial]), self.opt_round)
                self.mesh_order_memo.clear()
        if not self.opt_probers:
            self._solve_all(out)

    def _edge_bandwidth(self, i: int, j: int, typical: float) -> float:
        """The solver's bytes/s for ring link i -> j: measured when j can be dialed; a
        link into a peer behind NAT is made by a connection it opens (reverse), as good
        as a ``typical`` measured link, or punched / relayed when i is behind NAT too."""
        peers = self.ctx.peers
        if peers[j].reachable:
            return self.bandwidth.get((i, j), (0.0, 0))[0]
        if peers[i].reachable or routes.lan_addr(self.ctx, i, j):
            return typical  # (dialed the other way, or on a LAN the two share)
        return typical * self.nat_pair_factor

    def _solve_all(self, out: list[Command]) -> None:
        groups = {g: ms for g, ms in self.ctx.groups().items() if len(ms) >= 3}
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
            self._finish(out)

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

    def on_solved(self, ev: Solved, out: list[Command]) -> None:
        if ev.round_id != self.opt_round or ev.group not in self.opt_solving:
            return
        self.opt_solving.discard(ev.group)
        if sorted(ev.ring) == sorted(p for p in ev.ring if p in self.ctx.peers):
            self.ring_order[ev.group] = list(ev.ring)
        if not self.opt_solving:
            self._finish(out)

    def on_better_ring(self, ev: BetterRing) -> None:
        ctx = self.ctx
        members = set(ctx.groups().get(ev.group, []))
        if ev.round_id == self.opt_round and set(ev.ring) == members:
            self.ring_order[ev.group] = list(ev.ring)
            ctx.rings_stale = True  # the next update_topology() rebuilds in it
            if ctx.round is not None:
                ctx.round.reorder_pending = True

    def _finish(self, out: list[Command]) -> None:
        """Rebuild the rings in the new order; voters return at the round's end."""
        ctx = self.ctx
        voters = ctx.opt_votes
        ctx.opt_votes = set()
        groups = ctx.groups()
        ctx.note("optimized", f"optimize_topology() round {self.opt_round}: ring order "
                 + "; ".join(f"group {g}: {order}" for g, order in sorted(self.ring_order.items())
                             if g in groups), sorted(voters), value=self.opt_round)
        ctx.hub.optimized(voters, out)

    def fail(self, why: str, out: list[Command]) -> None:
        ctx = self.ctx
        ctx.note("optimize_failed", f"optimize_topology() round {self.opt_round} failed: "
                 f"{why}", sorted(ctx.opt_votes), value=self.opt_round)
        for p in sorted(ctx.opt_votes):
            if p in ctx.peers:
                out.append(Send(p, m.OptimizeFailed(message=why)))
        ctx.opt_votes = set()
        self.opt_probers = set()
        self.opt_solving = set()
        ctx.disarm(self.opt_deadline)
        ctx.phase = Phase.IDLE

    def on_deadline(self, did: int, advice: str, out: list[Command]) -> None:
        ctx = self.ctx
        if did == self.opt_deadline and ctx.opt_votes and not self.opt_probers \
                and not self.opt_solving:
            late = ctx.missing(ctx.accepted(), ctx.opt_votes)
            self.fail(f"optimize_topology(): peers {late} did not vote in time; {advice}", out)

    def on_peer_removed(self, peer: int, rec: PeerRecord, out: list[Command]) -> None:
        """A member lost or gone: an optimization in progress fails (its rings stay)."""
        if self.ctx.phase is Phase.OPTIMIZE_TOPOLOGY and rec.status is PeerStatus.ACCEPTED:
            self.fail(f"peer {peer} was lost during optimize_topology(); the previous "
                      "rings stay (call update_topology())", out)

    # --- what the measurements decide for a round -------------------------------------

    def rings_of(self, members: list[int]) -> dict[int, list[int]]:
        """Rings per group: the optimized order where there is one, join order else;
        started where the mesh's ranks start when the mesh's order is a rotation of the
        ring (the same cycle: nothing more to send than the ring)."""
        rings: dict[int, list[int]] = {}
        for p in members:
            rings.setdefault(self.ctx.peers[p].peer_group, []).append(p)
        for g, ring in rings.items():
            order = {p: i for i, p in enumerate(self.ring_order.get(g, []))}
            ring.sort(key=lambda p: (0, order[p]) if p in order else (1, p))
            mesh = self.mesh_order(ring)
            if rotation_of(mesh, ring):
                rings[g] = mesh
        return rings

    def mesh_order(self, ring: list[int]) -> list[int]:
        """The mesh's rank order over ``ring`` (peer ids): pccl.algorithms.mesh_order
        from the latencies the probes measured (with regions: split along a rank bit,
        so that few of the mesh's steps cross between them). The ring's own order
        without measured latencies or without a mesh."""
        k = len(ring)
        if k < 3 or k > self.mesh_order_max_peers or self.ctx.mesh_max_bytes == 0 \
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
        if rotation_of(order, ring):  # (the ring is then started there: rings_of)
            self.mesh_order_memo[tuple(order)] = order
        return order

    def _ring_latency(self, ring: list[int], fallback: float) -> Callable[[int, int], float]:
        """One-way latency from ring position ``i`` to ``j``, as the probes measured the
        pair, else ``fallback`` (pccl.algorithms' ``latency`` arguments)."""
        pairs = self.latency
        return lambda i, j: pairs.get((ring[i], ring[j]), (fallback, 0))[0]

    def mesh_limit(self, group: int, ring: list[int], rnd: Round) -> int:
        """The mesh limit of ``group``'s new ring (see pccl.algorithms): 0 without mesh
        links, the master's fixed value if it has one, else the cost model's, from the
        dials measured in this round and the group's measured bandwidths."""
        if group not in rnd.mesh_ok or len(ring) < 2:
            return 0
        if self.ctx.mesh_max_bytes > 0:
            return self.ctx.mesh_max_bytes
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
