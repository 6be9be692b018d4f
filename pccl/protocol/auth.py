"""What both ends of a control-plane connection need to agree on: the address form
("host:port", with pccl's default port) and the handshake's message authentication
codes (HMAC-SHA256 over both nonces, one per direction, so neither side can replay the
other's proof)."""

from __future__ import annotations

import hmac
import ipaddress

from pccl.errors import InvalidArgumentError

#: The master's default port.
DEFAULT_PORT = 48148


def split_host_port(address: str, default_port: int = DEFAULT_PORT) -> tuple[str, int]:
    """ "host:port", "[v6]:port", "host" -> (host, port). InvalidArgumentError for
    anything else (a port that is not a number in 0..65535, an empty address)."""
    if not isinstance(address, str) or not address.strip():
        raise InvalidArgumentError(f"expected an address 'host:port', got {address!r}")
    if address.startswith("["):
        host, _, rest = address[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else str(default_port)
    else:
        host, sep, port = address.rpartition(":")
        if not sep:
            host, port = address, str(default_port)
    if not port.isdigit() or not 0 <= int(port) <= 65535:
        raise InvalidArgumentError(
            f"bad address {address!r}: the port must be a number in 0..65535 "
            f"(e.g. 0.0.0.0:{DEFAULT_PORT}; port 0 picks a free one)")
    return host, int(port)


def is_loopback_host(host: str) -> bool:
    """Whether a listen host can only be reached from this machine (a host name other
    than localhost may resolve to a public address: not loopback)."""
    if host in ("", "0.0.0.0", "::"):
        return False
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def is_lan_address(host: str) -> bool:
    """Whether ``host`` may be offered as a local address (``hello.local_addrs``): an
    IP literal, written plainly (no zone, no IPv4 inside IPv6), of a private network
    (RFC 1918, carrier-grade NAT's 100.64/10, IPv6 unique-local): never loopback,
    unspecified, multicast, link-local, reserved or a public address. Behind a NAT
    (what these addresses are for) the local address is a private one; a neighbour is
    only ever sent to dial one, never a public address a peer picked for it."""
    if not isinstance(host, str) or not 0 < len(host) <= 45 or "%" in host:
        return False
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return False
    return not (
        ip.is_loopback or ip.is_unspecified or ip.is_multicast or ip.is_link_local
        or ip.is_reserved or ip.is_global)


def join_host_port(host: str, port: int) -> str:
    """(host, port) -> "host:port", or "[v6]:port" for an IPv6 host (the inverse of
    :func:`split_host_port`)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def peer_mac(secret: bytes, master_nonce: bytes, peer_nonce: bytes) -> bytes:
    """The peer's proof that it knows ``secret``."""
    return hmac.digest(secret, b"pccl-peer" + master_nonce + peer_nonce, "sha256")


def master_mac(secret: bytes, master_nonce: bytes, peer_nonce: bytes) -> bytes:
    """The master's proof that it knows ``secret``."""
    return hmac.digest(secret, b"pccl-master" + peer_nonce + master_nonce, "sha256")
