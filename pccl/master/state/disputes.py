"""A round's p2p reports, and whom to drop for the ring links that failed (the master
looks for itself where one report convicts nobody)."""

from __future__ import annotations

from pccl.master.state.context import Context, Round
from pccl.master.state.events import CheckReach, Command, PeerStatus
from pccl.protocol import messages as m


def on_p2p_report(ctx: Context, peer: int, msg: m.P2PReport, rnd: Round) -> None:
    """A member's outcome of its links. A peer speaks only for the links it dialed
    itself: its ring link to ``next_of[peer]`` (``failed``) and its mesh partners
    (``mesh_failed``). A report that blames anyone else is a lie (honest peers
    never send one): the reporter is dropped, its blame ignored. Who is dropped for
    a failed ring link is decided once every member reported (settle)."""
    rnd.reported.add(peer)
    group = ctx.peers[peer].peer_group
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
        ctx.links.lan_failed.update((peer, q) for q in msg.mesh_failed
                                    if ctx.links.mesh_paths.get((peer, q)) == "lan")
    if own in msg.failed:
        rnd.accused[peer] = own

def settle(ctx: Context, rnd: Round, out: list[Command]) -> bool:
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
        if ctx.links.paths.get((r, t)) == "lan":
            # A dial on the LAN proves nothing against either peer (another network
            # behind the same public address, a firewall between them, or a lie of
            # either one): nobody goes for it; the round is tried again with the
            # link over the public addresses, as if the LAN had never been there.
            rnd.lan_failed.add((r, t))
            ctx.links.lan_failed.add((r, t))
    checks = [t for r, t in rnd.accused.items() if _checkable(ctx, rnd, r, t)]
    for t in checks:
        if t not in rnd.reach:
            rnd.reach[t] = None
            out.append(CheckReach(rnd.epoch, t, ctx.peers[t].p2p_addr))
    if any(rnd.reach[t] is None for t in checks):
        return False
    for r, t in sorted(rnd.accused.items()):
        if r in rnd.unreachable or t in rnd.unreachable or (r, t) in rnd.lan_failed:
            continue  # decided already (a liar, no path, a LAN dial)
        if (r, t) in rnd.blame:
            rnd.unreachable.add(rnd.blame[(r, t)])
            continue
        newcomers = [x for x in (r, t) if ctx.peers[x].status is not PeerStatus.ACCEPTED]
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
        elif ctx.peers[r].dropped_on_its_word:
            rnd.unreachable.add(r)
            rnd.reasons.setdefault(r, (
                f"it reported its ring link to peer {t} failed after a peer was "
                "already dropped on its word: its own link is taken to be what fails"))
        else:
            ctx.peers[r].dropped_on_its_word += 1
            rnd.unreachable.add(t)
    return True

def _checkable(ctx: Context, rnd: Round, r: int, t: int) -> bool:
    """Whether the master settles the failed link r -> t by dialing t itself: a
    direct link between two peers of the same standing, t reachable from here."""
    if r in rnd.unreachable or t in rnd.unreachable or (r, t) in rnd.blame:
        return False
    if (ctx.peers[r].status is PeerStatus.ACCEPTED) != (
            ctx.peers[t].status is PeerStatus.ACCEPTED):
        return False
    return ctx.links.paths.get((r, t)) == "direct" and ctx.peers[t].reachable
