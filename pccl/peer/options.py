"""The arguments of a peer's calls: their types, defaults and checks at the edge (every
duration, size and option is checked here, before anything reaches the master or the
Rust data plane, with :class:`InvalidArgumentError` naming the argument)."""

from __future__ import annotations

import dataclasses
from typing import Any

from pccl import _core
from pccl.enums import DTYPES, DataType, QuantizationAlgorithm, ReduceOp
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


class _Default:
    def __repr__(self) -> str:
        return "<the Communicator's collective_timeout>"


#: ``timeout=`` default of collective calls: the Communicator's ``collective_timeout``.
DEFAULT_TIMEOUT: Any = _Default()
