"""Quorums for runs with several masters (split-brain protection): which members a round
may go on with, and sending the others to their other masters."""

from __future__ import annotations

from pccl.master.state.context import Context
from pccl.master.state.events import Command


def held_groups(ctx: Context) -> list[int]:
    """The groups this master holds: accepted peers, or peers back from another
    master that it is gathering (what a challenge tells a peer with several
    masters, which registers where its group is held)."""
    roster = ctx.roster_now()
    held = set(roster.groups)
    held.update(ctx.peers[p].peer_group for p in roster.pending
                if ctx.peers[p].claim is not None)
    return sorted(held)

def quorum_filter(ctx: Context, lineage: dict[int, tuple[int, frozenset[int]]],
                  members: list[int], out: list[Command]
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

    tests/integration/test_failover.py checks on a model of two masters and peers moving between
    them at random that installed rings form one chain, each holding a majority of
    the one before."""
    keep: list[int] = []
    counted: dict[int, list[tuple[int, list[int]]]] = {}
    by_group: dict[int, list[int]] = {}
    for p in members:
        by_group.setdefault(ctx.peers[p].peer_group, []).append(p)
    for g, ms in by_group.items():
        while ms:
            own = lineage.get(g)
            claims = {p: c for p in ms if (c := ctx.peers[p].claim) is not None}
            # Rings to count, each with whether its ids are this master's.
            base: tuple[int, frozenset[int], bool] | None = (
                (own[0], own[1], True) if own is not None else None)
            for c in claims.values():
                if c.base and (base is None or c.base_epoch > base[0]):
                    base = (c.base_epoch, c.base, False)
            if ctx.standby and base is None:
                # (Peers that saw only a first ring proposed know of nothing
                # installed: the master that proposed it may have started over.)
                send_away(ctx, g, ms, "this master is a standby and knows of no "
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
            ids_there = {ctx.peers[p].was for p in claims}
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
            send_away(ctx, g, away, (
                f"no quorum here for peer group {g}: {present} of the {len(ring)} peers "
                f"of its ring of epoch {epoch} ({sorted(ring)})"), out, epoch)
            ms = [p for p in ms if p not in away]
        keep.extend(ms)
    return sorted(keep), counted

def send_away(ctx: Context, group: int, peers: list[int], why: str, out: list[Command],
              epoch: int = 0) -> None:
    """Drops ``peers`` telling them to try their other masters first."""
    ctx.note("no_quorum", f"{why}; sending {sorted(peers)} to their other masters",
             sorted(peers), group, epoch)
    for p in peers:
        ctx.forget(p, why, out, tell=True, elsewhere=True)
