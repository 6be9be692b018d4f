"""Who is registered and who is accepted: one :class:`PeerRecord` per peer, and the
:class:`Roster`, a snapshot of them per group (cached by the context until a peer
registers, is accepted or leaves)."""

from __future__ import annotations

import dataclasses
from collections.abc import Collection

from pccl.master.state.events import PeerStatus


@dataclasses.dataclass(frozen=True)
class Claim:
    """What a peer back from another master knows of its group's rings there: the
    newest ring proposed to it, and the newest ring it knows was installed."""

    epoch: int
    ring: frozenset[int]
    base_epoch: int
    base: frozenset[int]
    more: tuple[tuple[int, frozenset[int]], ...] = ()


@dataclasses.dataclass
class PeerRecord:
    peer_id: int
    peer_group: int
    p2p_addr: str
    status: PeerStatus = PeerStatus.REGISTERED
    reachable: bool = True
    allow_relay: bool = True
    punch_addrs: tuple[str, ...] = ()
    # A peer back from another master (or a restarted one) until it is accepted: the
    # newest ring it saw proposed, (epoch, members), and its id in that ring. See
    # quorum.quorum_filter.
    claim: Claim | None = None
    was: int = 0
    # Peers dropped because this one reported its ring link to them failed (see
    # disputes.settle): after one, its own link is taken to be at fault.
    dropped_on_its_word: int = 0
    # The static key it proved in its handshake (b"" in clear text).
    key: bytes = b""
    # PeerRegistered.public_host and lan_addrs.
    public_host: str = ""
    lan_addrs: tuple[str, ...] = ()


def covers(calls: Collection[int], members: Collection[int]) -> bool:
    """Whether every one of ``members`` is among ``calls``: O(1) while some are missing
    (the counts are compared first), which is the common case on every message."""
    return len(calls) >= len(members) and all(p in calls for p in members)


class Roster:
    """Who is registered and who accepted (per group), in registration order: a
    snapshot of ``Context.peers``, taken when first asked after a change."""

    def __init__(self, peers: dict[int, PeerRecord]) -> None:
        self.accepted: list[int] = []
        self.pending: list[int] = []
        self.groups: dict[int, list[int]] = {}
        for p, r in peers.items():
            if r.status is PeerStatus.ACCEPTED:
                self.accepted.append(p)
                self.groups.setdefault(r.peer_group, []).append(p)
            elif r.status is PeerStatus.REGISTERED:
                self.pending.append(p)
        self._sets: dict[int, frozenset[int]] = {}
        self._rings: dict[int, tuple[list[int], int, bool]] = {}

    def __eq__(self, other: object) -> bool:  # a snapshot equals one of the same peers
        return isinstance(other, Roster) and (self.accepted, self.pending, self.groups) \
            == (other.accepted, other.pending, other.groups)

    def __hash__(self) -> int:  # (mutable: a snapshot is compared, never hashed)
        raise TypeError("a roster snapshot is not hashable")

    def group_set(self, group: int) -> frozenset[int]:
        got = self._sets.get(group)
        if got is None:
            got = self._sets[group] = frozenset(self.groups.get(group, ()))
        return got

    def is_ring_of(self, group: int, ring: list[int]) -> bool:
        """Whether ``ring`` holds exactly the group's accepted members (remembered for
        this ring object while it keeps its length)."""
        seen = self._rings.get(group)
        if seen is not None and seen[0] is ring and seen[1] == len(ring):
            return seen[2]
        same = len(ring) == len(self.groups.get(group, ())) and \
            sorted(ring) == sorted(self.groups.get(group, ()))
        self._rings[group] = (ring, len(ring), same)
        return same

