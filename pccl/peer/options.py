"""The arguments of a peer's calls: their types, defaults and checks at the edge (every
duration, size and option is checked here, before anything reaches the master or the
Rust data plane, with :class:`InvalidArgumentError` naming the argument)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Generic, NoReturn, Protocol, TypeVar, overload

from pccl import _core
from pccl.enums import DTYPES, DataType, QuantizationAlgorithm, ReduceOp
from pccl.protocol import MAX_FRAME
from pccl.protocol import messages as m
from pccl.protocol.auth import DEFAULT_PORT, is_loopback_host, split_host_port
from pccl.tensors import RawTensor


@dataclasses.dataclass(frozen=True)
class ReduceInfo:
    """What one all-reduce cost this peer."""

    tx_bytes: int  #: bytes this peer put on the wire (headers included)
    rx_bytes: int  #: bytes this peer received
    world_size: int  #: peers that took part
    #: How it ran: "ring", "mesh" (recursive doubling between the peers), "master"
    #: (reduced by the master) or "local" (a group of one). Not compared: infos that
    #: report the same costs are equal however they ran.
    algorithm: str = dataclasses.field(default="ring", compare=False)


@dataclasses.dataclass(frozen=True)
class GatherInfo:
    """What one all-gather gave and cost this peer: ``data`` holds every peer's
    contribution in the order of the ring it ran on (slot ``r`` at
    ``r * len(data) // world_size``, from peer ``peers[r]``), the same bytes on every
    peer. That order is the ring's, not :attr:`Communicator.rank`'s: find a peer's
    contribution with :meth:`of`."""

    data: bytearray  #: the contributions, concatenated in ring order
    world_size: int  #: peers that took part (contributions in ``data``)
    tx_bytes: int  #: bytes this peer put on the wire (headers included)
    rx_bytes: int  #: bytes this peer received
    #: The peer id of each slot (empty only from a master that predates the field).
    peers: tuple[int, ...] = ()
    #: "ring", "master" (gathered by the master) or "local" (a group of one).
    algorithm: str = dataclasses.field(default="ring", compare=False)

    def part(self, slot: int) -> memoryview:
        """The contribution in slot ``slot`` (a view into ``data``)."""
        if not 0 <= slot < self.world_size:
            raise IndexError(f"slot {slot} outside 0..{self.world_size - 1}")
        n = len(self.data) // self.world_size
        return memoryview(self.data)[slot * n:(slot + 1) * n]

    def of(self, peer_id: int) -> memoryview:
        """Peer ``peer_id``'s contribution; ``KeyError`` if it took no part."""
        if peer_id not in self.peers:
            raise KeyError(f"peer {peer_id} took no part in this all-gather")
        return self.part(self.peers.index(peer_id))


@dataclasses.dataclass(frozen=True)
class QuantizationOptions:
    """How values travel on the wire (``NONE``: as they are)."""

    algorithm: QuantizationAlgorithm = QuantizationAlgorithm.NONE
    dtype: DataType = DataType.UINT8


@dataclasses.dataclass
class ReduceDescriptor:
    """One all-reduce for :meth:`Communicator.all_reduce_multiple_with_retry`."""

    tensor: Any
    out: Any = None
    op: ReduceOp = ReduceOp.SUM
    tag: int = 0
    quantization: QuantizationOptions | None = None


_WIRE_TYPES = (DataType.UINT8, DataType.INT8, DataType.FLOAT8_E4M3, DataType.FLOAT8_E5M2)


def check_quantization(q: QuantizationOptions, src: RawTensor, op: ReduceOp) -> None:
    try:
        algorithm, wire = QuantizationAlgorithm(q.algorithm), DataType(q.dtype)
    except ValueError:
        raise _core.InvalidArgumentError(f"invalid quantization options {q}") from None
    if wire not in _WIRE_TYPES:
        raise _core.InvalidArgumentError(
            f"{wire.name} cannot carry quantized values; use UINT8, INT8, FLOAT8_E4M3 or "
            "FLOAT8_E5M2")
    if not DTYPES[src.dtype].is_float:
        raise _core.InvalidArgumentError(
            f"quantization applies to float tensors, not {src.dtype.name}")
    if op not in (ReduceOp.SUM, ReduceOp.AVG):
        raise _core.InvalidArgumentError(
            f"quantized {op.name} is not exact on the wire; use SUM or AVG, or no "
            f"quantization ({algorithm.name} was asked)")


def check_master_address(master: str) -> None:
    """A master address without a port used to mean 48148 silently; on a shared machine
    that joins somebody else's run. The port must be said."""
    if not isinstance(master, str) or not master:
        raise _core.InvalidArgumentError(f"master must be a 'host:port' string, not {master!r}")
    host, sep, port = master.rpartition(":") if not master.startswith("[") else (
        master.partition("]")[0] + "]", ":" if "]:" in master else "",
        master.partition("]:")[2])
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise _core.InvalidArgumentError(
            f"master address {master!r} has no valid port: give 'host:port' (pccl's "
            f"default port is {DEFAULT_PORT}, e.g. '{master.rstrip(':') or '127.0.0.1'}:"
            f"{DEFAULT_PORT}')")


def check_metrics_listen(listen: str | None, token: str | None) -> None:
    """``Communicator(metrics_listen=..., metrics_token=...)``: a malformed address, or an
    address other machines can reach without a token, fails at construction (the same
    rule as the master's ``status_listen`` and ``status_token``)."""
    if token is not None and (not isinstance(token, str) or not token):
        raise _core.InvalidArgumentError(
            f"metrics_token must be a non-empty string or None, got {token!r}")
    if listen is None:
        return
    host, _ = split_host_port(listen)
    if not is_loopback_host(host) and not token:
        raise _core.InvalidArgumentError(
            f"Communicator(metrics_listen={listen!r}) is reachable from other machines: "
            f"give metrics_token=... (PCCL_METRICS_TOKEN; scrapers send 'Authorization: "
            f"Bearer TOKEN'), or listen on 127.0.0.1")


MAX_MASTERS = 16


def master_addresses(master: object) -> tuple[str, ...]:
    """The master addresses a peer fails over between, in the order it tries them:
    ``master`` is one "host:port", several separated by commas (as ``PCCL_MASTER``
    carries them), or a list or tuple of them."""
    if isinstance(master, str):
        parts = [a.strip() for a in master.split(",")] if "," in master else [master]
    elif isinstance(master, (list, tuple)):
        parts = list(master)
    else:
        raise _core.InvalidArgumentError(
            f"master must be a 'host:port' string or a list of them, not {master!r}")
    if not parts or len(parts) > MAX_MASTERS:
        raise _core.InvalidArgumentError(
            f"master names {len(parts)} addresses; give 1 to {MAX_MASTERS}")
    for a in parts:
        check_master_address(a)
    if len(set(parts)) != len(parts):
        raise _core.InvalidArgumentError(f"master names an address twice: {master!r}")
    return tuple(parts)


_MAX_SECONDS = 7 * 24 * 3600.0  # a week: longer is a mistake (and past the master's cap)


def check_deadline(value: float | None, what: str) -> float | None:
    return None if value is None else check_seconds(value, what, none_ok=True)


def check_seconds(value: float, what: str, zero_ok: bool = False,
                   none_ok: bool = False) -> float:
    """A number of seconds in (0, a week] ([0, a week] with ``zero_ok``), as a float."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not (0 <= value if zero_ok else 0 < value) or not value <= _MAX_SECONDS:
        raise _core.InvalidArgumentError(
            f"{what} must be a {'non-negative' if zero_ok else 'positive'} number of seconds "
            f"up to a week ({_MAX_SECONDS:.0f}){' or None' if none_ok else ''}, got {value!r}")
    return float(value)


def check_int(value: object, what: str, low: int, high: int) -> int:
    """An integer (not a bool) in ``low..high``: every size, count and port a peer takes
    is checked here, before it can reach the Rust edge as an out-of-range number."""
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise _core.InvalidArgumentError(
            f"{what} must be an integer in {low}..{high}, got {value!r}")
    return value


@dataclasses.dataclass(frozen=True)
class PeerOptions:
    """The settings of one :class:`pccl.communicator.Communicator`: its constructor's
    parameters less the live state (the secret, the identity), checked once, here.

    The defaults here are the constructor's (its signature takes them from this class).
    Every field is checked when an instance is made, so ``dataclasses.replace`` checks
    the new values too, and a bad one raises :class:`InvalidArgumentError` naming it::

        opts = dataclasses.replace(comm.options, via_master_max_bytes=0)
    """

    #: As given: one "host:port", several separated by commas, or a sequence of them
    #: (a list is kept as a tuple). ``masters`` is what it names.
    master: str | Sequence[str] = f"127.0.0.1:{DEFAULT_PORT}"
    peer_group: int = 0
    p2p_connection_pool_size: int = 4
    p2p_listen_host: str | None = None
    p2p_listen_port: int = 0  # 0: ephemeral
    p2p_advertise_host: str | None = None
    #: "host:port" others should dial instead of our listener (NAT, or a test proxy).
    p2p_advertise_address: str | None = None
    timeout: float = 10.0
    p2p_timeout: float = 10.0
    peer_timeout: float = 30.0
    piece_bytes: int = 1 << 20
    max_frame: int = MAX_FRAME
    reconnect_timeout: float = 600.0
    collective_timeout: float | None = 1800.0
    insecure: bool = False
    allow_relay: bool = True
    #: "host:port": this peer's own Prometheus /metrics (bytes per link, retries, time in
    #: collectives); None: not served.
    metrics_listen: str | None = None
    #: What /metrics asks for (a non-loopback metrics_listen needs one). Not in the repr.
    metrics_token: str | None = dataclasses.field(default=None, repr=False)
    #: All-reduces of at most this many bytes start the ring when called, on a ring that
    #: ran its last collectives without a failure (one master round trip instead of two;
    #: 0: never). Their pieces may reach a neighbour that has not called yet: it holds
    #: them, bounded (see docs/semantics.md).
    early_start_max_bytes: int = 4 << 20
    #: Unquantized all-reduces of at most this many bytes go to the master with the
    #: request; when every member's does, the master reduces them in the ring's order and
    #: answers everyone with the result (one round trip at any world size, no ring; 0:
    #: never). The tensor travels in one control-plane frame: at most 1 MiB of it.
    via_master_max_bytes: int = 64 << 10
    allow_anonymous: bool = False
    #: What the operator calls this peer (status page, the master's log).
    name: str | None = None
    run_id: str | None = None
    #: Where this peer registers, in order of preference (several: it fails over); made
    #: from ``master``.
    masters: tuple[str, ...] = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        check_int(self.p2p_connection_pool_size, "p2p_connection_pool_size", 1, 64)
        check_int(self.peer_group, "peer_group", 0, (1 << 32) - 1)
        check_int(self.p2p_listen_port, "p2p_listen_port", 0, 65535)
        check_int(self.piece_bytes, "piece_bytes", 1, 1 << 30)
        check_int(self.max_frame, "max_frame", 1 << 10, 1 << 31)
        check_int(self.early_start_max_bytes, "early_start_max_bytes", 0, 1 << 40)
        check_int(self.via_master_max_bytes, "via_master_max_bytes", 0, 1 << 20)
        # (Frozen: the derived and normalised fields are set once, here.)
        object.__setattr__(self, "masters", master_addresses(self.master))
        if isinstance(self.master, list):
            object.__setattr__(self, "master", tuple(self.master))
        object.__setattr__(self, "collective_timeout", check_deadline(
            self.collective_timeout, "collective_timeout"))
        for what in ("timeout", "p2p_timeout", "peer_timeout"):
            check_seconds(getattr(self, what), what)
        check_seconds(self.reconnect_timeout, "reconnect_timeout", zero_ok=True)
        for what in ("insecure", "allow_relay", "allow_anonymous"):
            if not isinstance(flag := getattr(self, what), bool):
                raise _core.InvalidArgumentError(f"{what} must be a bool, got {flag!r}")
        name = self.name
        if name is not None and (not isinstance(name, str) or not 0 < len(name) <= 64
                                 or not name.isprintable()):
            raise _core.InvalidArgumentError(
                f"Communicator(name=...) must be 1 to 64 printable characters, got {name!r}")
        if self.run_id is not None and (why := m.run_id_problem(self.run_id)) is not None:
            raise _core.InvalidArgumentError(f"Communicator(run_id=...) {why}")
        check_metrics_listen(self.metrics_listen, self.metrics_token)


class Configured(Protocol):
    """An object that holds its settings as ``options``."""

    options: PeerOptions


T = TypeVar("T")


class OptionView(Generic[T]):
    """A read-only attribute that reads one field of its object's ``options``:
    ``timeout = OptionView(lambda o: o.timeout)`` makes ``comm.timeout`` read
    ``comm.options.timeout`` (typed as the field is). Assigning to it raises
    ``AttributeError``: the options are replaced whole (``dataclasses.replace``)."""

    def __init__(self, get: Callable[[PeerOptions], T]) -> None:
        self._get = get
        self._name = "?"

    def __set_name__(self, owner: type, name: str) -> None:
        self._name = name
        self.__doc__ = f"``options.{name}`` (read-only)."

    @overload
    def __get__(self, obj: None, owner: type | None = None) -> OptionView[T]: ...

    @overload
    def __get__(self, obj: Configured, owner: type | None = None) -> T: ...

    def __get__(self, obj: Configured | None, owner: type | None = None) -> T | OptionView[T]:
        return self if obj is None else self._get(obj.options)

    def __set__(self, obj: Configured, value: NoReturn) -> NoReturn:
        raise AttributeError(
            f"{type(obj).__name__}.{self._name} is read-only; give it to the constructor, "
            f"or replace the options: comm.options = dataclasses.replace(comm.options, "
            f"{self._name}=...)")


class _Default:
    def __repr__(self) -> str:
        return "<the Communicator's collective_timeout>"


#: ``timeout=`` default of collective calls: the Communicator's ``collective_timeout``.
DEFAULT_TIMEOUT: Any = _Default()
