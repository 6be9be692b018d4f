"""How each link of a round is made (direct, dialed back, on a LAN, hole-punched,
relayed), as functions of the round and the peers in the :class:`Context`: they fill the
round's route tables (:class:`Links`) and the EstablishP2P messages; they keep no state
of their own."""

from __future__ import annotations

from pccl import algorithms
from pccl.master.state.context import Context, Links, Round
from pccl.master.state.events import Command, PeerStatus, Send
from pccl.protocol import messages as m


def establish(ctx: Context, rnd: Round, counted: dict[int, list[tuple[int, list[int]]]],
              out: list[Command]) -> None:
    """Routes every ring and mesh link of ``rnd`` (whose ``rings`` and ``mesh_orders``
    are set) and sends each member its EstablishP2P. ``counted``: per group, the rings
    a quorum counted (sent with the proposal)."""
    for group, ring in rnd.rings.items():
        n = len(ring)
        routes = {}
        for i, p in enumerate(ring):
            if n > 1:
                routes[p] = route(ctx, p, ring[(i + 1) % n], rnd)
        order = rnd.mesh_orders[group]
        rank = {p: r for r, p in enumerate(order)}
        mesh = mesh_routes(ctx, order)
        if mesh is not None:
            rnd.mesh_ok.add(group)
        for i, p in enumerate(ring):
            nxt = ring[(i + 1) % n] if n > 1 else -1
            prv = ring[(i - 1) % n] if n > 1 else -1
            way, token = routes.get(p, ("direct", b""))
            prev_route, prev_token = routes.get(prv, ("direct", b""))
            partners = ([order[r] for r in algorithms.mesh_partners(rank[p], n)]
                        if mesh is not None else [])
            rnd.next_of[p] = nxt
            rnd.partners_of[p] = frozenset(partners)
            out_routes = [mesh[(p, q)] for q in partners] if mesh is not None else []
            in_routes = [mesh[(q, p)] for q in partners] if mesh is not None else []
            out.append(Send(p, m.EstablishP2P(
                epoch=ctx.epoch,
                # Peers take their ring from ``world``; a proposal's members matter
                # only to quorums (several masters): k ids to each of k peers.
                ring=list(ring) if ctx.quorum_on else [],
                next_id=nxt,
                next_addr=dial_addr(ctx, p, nxt) if nxt >= 0 else "",
                route=way, token=token, prev_id=prv,
                prev_addr=inbound_addr(ctx, prv, prev_route),
                prev_route=prev_route, prev_token=prev_token,
                mesh_ids=partners,
                mesh_addrs=[dial_addr(ctx, p, q) for q in partners],
                mesh_routes=[r for r, _ in out_routes],
                mesh_tokens=[t for _, t in out_routes],
                mesh_in_addrs=[ctx.peers[q].p2p_addr for q in partners],
                mesh_in_routes=[r for r, _ in in_routes],
                mesh_in_tokens=[t for _, t in in_routes],
                quorum_epochs=[e for e, _ in counted.get(group, [])],
                quorum_rings=[list(r) for _, r in counted.get(group, [])],
                **ctx.keys([nxt, prv, *partners]),
            )))


def mesh_routes(ctx: Context, order: list[int]
                ) -> dict[tuple[int, int], tuple[str, bytes]] | None:
    """How each directed mesh link over the ranks ``order`` is made: (sender,
    receiver) -> (route, token), dialed when the receiver is reachable, dialed back
    when only the sender is, else through the relay. None: no mesh for this ring
    (the mesh is off, the ring is too small, or two partners behind NAT cannot use
    the relay); its collectives then all take the ring, and nobody is dropped for
    it."""
    n = len(order)
    if ctx.mesh_max_bytes == 0 or n < 2:
        return None
    routes: dict[tuple[int, int], tuple[str, bytes]] = {}
    lan: dict[tuple[int, int], str] = {}
    for i, p in enumerate(order):
        for r in algorithms.mesh_partners(i, n):
            q = order[r]
            a, b = ctx.peers[p], ctx.peers[q]
            token = ctx.token(f"{ctx.epoch}:{p}:{q}:mesh")
            if b.reachable:
                routes[(p, q)] = ("direct", b"")
            elif a.reachable:
                routes[(p, q)] = ("reverse", token)
            elif lan_addr_ := lan_addr(ctx, p, q):
                # (A failed one turns the mesh off for the epoch, as any failed mesh
                # pool does, and the pair is relayed from the next round on.)
                routes[(p, q)] = ("direct", b"")
                lan[(p, q)] = lan_addr_
            elif ctx.relay and a.allow_relay and b.allow_relay:
                routes[(p, q)] = ("relay", token)
            else:
                return None
    links = ctx.links
    links.lan_dials.update(lan)
    for pair, (way, token) in routes.items():
        links.mesh_paths[pair] = "lan" if pair in lan else way
        if way == "relay":  # the relay splices only what presents a known token
            links.relay_tokens[token] = pair
            links.mesh_tokens.add(token)
    return routes


def inbound_addr(ctx: Context, prv: int, way: str) -> str:
    """Where the receiver of ``prv``'s ring link meets it: its punch port of this
    epoch for a punched link, else its p2p address."""
    if prv < 0:
        return ""
    rec = ctx.peers[prv]
    if way == "punch" and rec.punch_addrs:
        return rec.punch_addrs[ctx.epoch % len(rec.punch_addrs)]
    return rec.p2p_addr


def route(ctx: Context, p: int, nxt: int, rnd: Round) -> tuple[str, bytes]:
    """How ``p`` gets its streams to ``nxt``: dial it when it is reachable; else be
    dialed by it when ``p`` is reachable; else, both behind the same NAT, dial it on
    their LAN ("lan": a direct route to its private address); else (or once that
    failed) punch a hole between the two, with the relay to fall back on if both
    allow it (if not, a failed punch drops one of them, with the reason)."""
    a, b = ctx.peers[p], ctx.peers[nxt]
    links = ctx.links
    token = ctx.token(f"{ctx.epoch}:{p}:{nxt}")
    if b.reachable:
        way = ("direct", b"")
    elif a.reachable:
        way = ("reverse", token)
    elif lan_addr_ := lan_addr(ctx, p, nxt):
        # The peers' own direct dial (a pool, no hole, no relay), to the address the
        # receiver gave (Hello.local_addrs) and pinned to the key it proved like
        # any dial: a peer that lies about its address only fails its own link. A
        # failure drops nobody: the round is tried again over the public addresses
        # (disputes.settle, Links.lan_failed).
        links.lan_dials[(p, nxt)] = lan_addr_
        links.paths[(p, nxt)] = "lan"
        return ("direct", b"")
    else:
        # Both behind NAT: punch a hole (simultaneous open to each other's public
        # address as seen here); if that fails, the relay, where allowed (at once
        # when punching between these two failed before).
        relay_ok = ctx.relay and a.allow_relay and b.allow_relay
        way = ("relay" if relay_ok and (p, nxt) in links.punch_failed else "punch", token)
        if relay_ok:
            links.relay_tokens[token] = (p, nxt)
        else:
            refusers = [x for x in (p, nxt) if not ctx.peers[x].allow_relay]
            why = (f"peer {refusers[0]} refuses relaying (allow_relay=False)"
                   if refusers else "the master does not relay (max_relayed_streams=0)")
            # Drop a refuser rather than a peer that would have accepted the relay,
            # and a newcomer rather than a member of the group.
            blame = sorted(refusers or [p, nxt], key=lambda x: (
                ctx.peers[x].status is PeerStatus.ACCEPTED, x != nxt))[0]
            rnd.blame[(p, nxt)] = blame
            rnd.reasons[blame] = (
                f"peers {p} and {nxt} are both unreachable from outside (behind NAT or a "
                f"firewall), hole punching between them failed (a NAT that maps each "
                f"connection to a new port?), and {why}; forward a port to one of them "
                "(p2p_listen_port and p2p_advertise_address) or allow relaying")
    links.paths[(p, nxt)] = way[0]
    return way


def lan_addr(ctx: Context, p: int, q: int) -> str:
    """Where ``p`` dials ``q`` on a LAN the two share ("" if they do not seem to):
    both came from the same public host (the master saw their control connections
    from one address: one NAT), ``q`` said where it listens on its private network,
    and no dial there from ``p`` failed yet. Only asked for two peers that cannot be
    dialed from outside."""
    a, b = ctx.peers[p], ctx.peers[q]
    if not a.public_host or a.public_host != b.public_host or not b.lan_addrs \
            or (p, q) in ctx.links.lan_failed:
        return ""
    return b.lan_addrs[0]


def dial_addr(ctx: Context, p: int, q: int) -> str:
    """The address ``p`` dials for its link to ``q`` in this round: the LAN one of a
    "lan" link, else ``q``'s p2p address."""
    return ctx.links.lan_dials.get((p, q)) or ctx.peers[q].p2p_addr


def links_now(links: Links) -> dict[tuple[int, int], str]:
    """How each ring link of the current rings runs, as an operator should see it:
    the route the master chose (``paths``), except that a "punch" link whose hole
    punching failed runs through the relay (``Relayed``), and says so."""
    return {pair: "relay" if path == "punch" and pair in links.punch_failed else path
            for pair, path in links.paths.items()}


def on_relayed(links: Links, token: bytes) -> None:
    """A relayed stream of ``token`` started: a punched ring link fell back to the
    relay, so its hole punching failed (the next rounds relay it at once)."""
    pair = links.relay_tokens.get(token)
    if pair is not None and links.paths.get(pair) == "punch" \
            and token not in links.mesh_tokens:
        links.punch_failed.add(pair)
