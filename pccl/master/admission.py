"""What the master checks and counts before it trusts a connection (no I/O here).

Anyone who can reach the master's port can open connections, and a registered peer can
send whatever it likes. Two tools keep that from costing the run anything:

- :class:`Budget`: a bounded count of something a remote party makes the master hold
  (connections that have not registered yet, ``pccl doctor`` sessions, relay streams),
  in all and per key (a source address, a peer). A full budget refuses the newcomer; it
  never takes a slot from whoever holds one.
- :func:`admit`: a ``hello``, every field of which the peer chose itself, turned into a
  :class:`Registration` the master may use as it is (checked, bounded, cleaned), or the
  reason it is refused. The server reads no field of a hello but through it.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import re
from collections import Counter
from collections.abc import Hashable

from pccl.errors import ErrorKind
from pccl.master import state as st
from pccl.protocol import messages as m
from pccl.protocol.auth import is_lan_address, join_host_port

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
    if not 0 <= hello.peer_group < 1 << 32:
        return f"invalid peer group {hello.peer_group}"
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


#: Punch ports, ring members and resumed rings a hello may name that the master uses.
MAX_PUNCH_PORTS = 16
MAX_RESUMED_RING = 4096
MAX_RESUMED_RINGS = 64
#: Masters a peer may say it fails over between (more is taken as this many).
MAX_MASTERS = 64


@dataclasses.dataclass(frozen=True)
class Registration:
    """A hello as the master uses it: every field checked, bounded and cleaned."""

    peer_group: int
    p2p_host: str  # "" = the address the connection comes from
    p2p_port: int
    resume: st.Resume | None
    name: str  # printable characters only ("": none)
    punch_ports: tuple[int, ...]
    masters: int
    allow_relay: bool
    local_addrs: tuple[str, ...]  # private IP literals
    version: int

    def punch_addrs(self, host: str) -> tuple[str, ...]:
        return tuple(join_host_port(host, port) for port in self.punch_ports)

    def lan_addrs(self) -> tuple[str, ...]:
        return tuple(join_host_port(a, self.p2p_port) for a in self.local_addrs)


def admit(hello: m.Hello, run_id: str | None) -> Registration | tuple[ErrorKind, str]:
    """``hello`` as a :class:`Registration`, or why the master refuses it (the error
    kind and the text the peer is told). ``run_id``: the run this master serves."""
    problem = hello_problem(hello)
    if problem is not None:
        return ErrorKind.ProtocolError, problem
    if (hello.run_id or None) != run_id:
        theirs = repr(hello.run_id) if hello.run_id else "no run id"
        mine = repr(run_id) if run_id else "no run id"
        return ErrorKind.InvalidUsageError, (
            f"this peer is for run {theirs}, this master serves {mine}: check PCCL_MASTER "
            f"and PCCL_RUN_ID (Communicator(run_id=), pccl-master --run-id)")
    resume: st.Resume | None = None
    if 0 < hello.resume_peer_id < MAX_RESUMED:
        resume = st.Resume(
            hello.resume_epoch, hello.resume_revision,
            tuple(hello.resume_peers[:MAX_RESUMED_RING]), hello.resume_peer_id,
            min(max(hello.resume_base_epoch, 0), MAX_RESUMED),
            tuple(hello.resume_base_peers[:MAX_RESUMED_RING]),
            tuple((e, tuple(r[:MAX_RESUMED_RING])) for e, r in zip(
                hello.resume_more_epochs[:MAX_RESUMED_RINGS],
                hello.resume_more_peers[:MAX_RESUMED_RINGS])))
    return Registration(
        peer_group=hello.peer_group, p2p_host=hello.p2p_host, p2p_port=hello.p2p_port,
        resume=resume, name="".join(c for c in hello.name if c.isprintable()),
        punch_ports=tuple(p for p in hello.p2p_punch_ports[:MAX_PUNCH_PORTS]
                          if 0 < p < 65536),
        masters=max(1, min(hello.masters, MAX_MASTERS)), allow_relay=hello.allow_relay,
        local_addrs=tuple(hello.local_addrs), version=min(hello.version, 1 << 20))
