"""What the master checks and counts before it trusts a connection (no I/O here).

Anyone who can reach the master's port can open connections, and a registered peer can
send whatever it likes. Two tools keep that from costing the run anything:

- :class:`Budget`: a bounded count of something a remote party makes the master hold
  (connections that have not registered yet, ``pccl doctor`` sessions, relay streams),
  in all and per key (a source address, a peer). A full budget refuses the newcomer; it
  never takes a slot from whoever holds one.
- :func:`hello_problem`: the fields of a ``hello`` a peer chose itself, checked before
  any of them is used (its address is dialed back and shown to every other peer).
"""

from __future__ import annotations

import ipaddress
import re
from collections import Counter
from collections.abc import Hashable

from pccl.protocol import messages as m
from pccl.protocol.auth import is_lan_address

#: Longest DNS name (RFC 1035); an advertised p2p host longer than this is refused.
MAX_HOST = 253
# A DNS name: labels of letters, digits, '-' and '_' (container names), dot-separated.
_HOSTNAME = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?"
                       r"(?:\.[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?)*\.?")
#: Ids and epochs a peer may ask to resume: far below what a message can carry, so
#: that counting up from them never overflows.
MAX_RESUMED = 1 << 48
#: A resumed peer id is kept only below this: ids above it would move the next fresh
#: id (one hello could push every later peer's id past MAX_RESUMED).
MAX_KEPT_ID = 1 << 32


def source_key(host: str) -> str:
    """What the per-address budgets count by: the address itself for IPv4, its /64 for
    IPv6 (one host is usually given a whole /64, and can pick any address in it)."""
    try:
        addr = ipaddress.ip_address(host)
    except ValueError:
        return host
    if isinstance(addr, ipaddress.IPv6Address):
        if addr.ipv4_mapped is not None:
            return str(addr.ipv4_mapped)
        return str(ipaddress.ip_network(f"{addr}/64", strict=False))
    return str(addr)


class Budget:
    """At most ``total`` holders in all and ``per_key`` per key. ``take`` answers
    whether the newcomer got a slot; every successful ``take`` is matched by one
    ``release`` of the same key."""

    def __init__(self, total: int, per_key: int) -> None:
        self.total = total
        self.per_key = per_key
        self._held: Counter[Hashable] = Counter()
        self._count = 0
        #: Newcomers refused so far (for logs and metrics).
        self.refused = 0

    def __len__(self) -> int:
        return self._count

    def held(self, key: Hashable) -> int:
        return self._held[key]

    def take(self, key: Hashable) -> bool:
        if self._count >= self.total or self._held[key] >= self.per_key:
            self.refused += 1
            return False
        self._held[key] += 1
        self._count += 1
        return True

    def release(self, key: Hashable) -> None:
        if self._held[key] <= 0:
            raise ValueError(f"release of {key!r}, which holds nothing")
        self._held[key] -= 1
        if not self._held[key]:
            del self._held[key]
        self._count -= 1


def valid_host(host: str) -> bool:
    """Whether ``host`` is an IP address or a DNS name (what a peer may advertise as
    the host of its p2p address): no spaces, control characters or NULs, at most
    :data:`MAX_HOST` characters."""
    if not host or len(host) > MAX_HOST:
        return False
    try:
        ipaddress.ip_address(host.strip("[]") if host.startswith("[") else host)
        return True
    except ValueError:
        pass
    return _HOSTNAME.fullmatch(host) is not None


def hello_problem(hello: m.Hello) -> str | None:
    """Why the master refuses ``hello`` (the reason it tells the peer), or None."""
    if not 0 < hello.p2p_port < 65536:
        return f"invalid p2p port {hello.p2p_port}"
    if hello.p2p_host and not valid_host(hello.p2p_host):
        shown = repr(hello.p2p_host[:64]) + ("..." if len(hello.p2p_host) > 64 else "")
        return (f"invalid p2p host {shown}: give an IP address or a DNS name of at most "
                f"{MAX_HOST} characters (p2p_advertise_address)")
    # A neighbour behind the same NAT may be sent to dial these: private IP literals
    # only (never a name to resolve, a public address, loopback or a broadcast).
    for host in hello.local_addrs[:m.MAX_LOCAL_ADDRS + 1]:
        if not is_lan_address(host):
            return (f"invalid local address {host[:64]!r}: hello.local_addrs takes IP "
                    "addresses of private networks only")
    if len(hello.local_addrs) > m.MAX_LOCAL_ADDRS:
        return (f"{len(hello.local_addrs)} local addresses (hello.local_addrs takes at most "
                f"{m.MAX_LOCAL_ADDRS})")
    # The state adopts a resumed epoch and counts up from it.
    if not 0 <= hello.resume_epoch < MAX_RESUMED:
        return f"invalid resume epoch {hello.resume_epoch}"
    return None
