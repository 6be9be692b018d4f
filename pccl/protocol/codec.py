"""msgpack encoding of messages, with strict validation on decode, and framing."""

from __future__ import annotations

import dataclasses
import enum
import struct
import typing

import msgpack

from pccl.errors import ProtocolError
from pccl.protocol.messages import REGISTRY, Message

#: Default hard cap on one control-plane frame (bytes, excluding the 4-byte prefix).
MAX_FRAME = 16 * 1024 * 1024

_LEN = struct.Struct(">I")

# Field validators, derived once per message class from its annotations.
_Check = typing.Callable[[object], bool]


def _checker(tp: object) -> _Check:
    origin = typing.get_origin(tp)
    if isinstance(tp, type) and issubclass(tp, enum.StrEnum):
        # An enum travels as its value; only the enum's own values decode.
        values = frozenset(str(v.value) for v in tp)
        return lambda v: isinstance(v, str) and v in values
    if tp is int:
        return lambda v: isinstance(v, int) and not isinstance(v, bool)
    if tp is float:
        return lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)
    if tp in (str, bytes, bool):
        return lambda v: isinstance(v, tp)
    if origin is list:
        (inner,) = typing.get_args(tp)
        check = _checker(inner)
        return lambda v: isinstance(v, list) and all(check(x) for x in v)
    raise TypeError(f"unsupported message field type {tp!r}")


_FIELDS: dict[type[Message], dict[str, _Check]] = {}
# Fields decoded into an enum (message class -> field name -> enum class).
_ENUMS: dict[type[Message], dict[str, type[enum.StrEnum]]] = {}
for _cls in REGISTRY.values():
    _hints = typing.get_type_hints(_cls)
    _FIELDS[_cls] = {f.name: _checker(_hints[f.name]) for f in dataclasses.fields(_cls)}
    _ENUMS[_cls] = {f.name: _hints[f.name] for f in dataclasses.fields(_cls)
                    if isinstance(_hints[f.name], type)
                    and issubclass(_hints[f.name], enum.StrEnum)}


def encode(msg: Message) -> bytes:
    body = {"t": msg.TYPE}
    for name in _FIELDS[type(msg)]:
        value = getattr(msg, name)
        # Enum fields travel as their plain value.
        body[name] = str(value) if isinstance(value, enum.StrEnum) else value
    packed: bytes = msgpack.packb(body, use_bin_type=True)
    return packed


def frame(msg: Message) -> bytes:
    """The wire form of ``msg``: length prefix and body."""
    body = encode(msg)
    return _LEN.pack(len(body)) + body


class FrameCache:
    """Frames of one batch of outgoing messages: a message object sent to many peers
    (the master's ``world`` goes to every member of a group, the same object each time)
    is encoded once. Keep one per batch: it holds the messages it encoded."""

    def __init__(self) -> None:
        self._frames: dict[int, tuple[Message, bytes]] = {}

    def frame(self, msg: Message) -> bytes:
        hit = self._frames.get(id(msg))
        if hit is None:
            hit = self._frames[id(msg)] = (msg, frame(msg))
        return hit[1]


def decode(data: bytes) -> Message:
    """Decodes and validates one frame body; anything unexpected is ``ProtocolError``."""
    try:
        body = msgpack.unpackb(data, raw=False, strict_map_key=True, use_list=True)
    except Exception as e:  # msgpack raises several unrelated types on garbage
        raise ProtocolError(f"undecodable frame ({type(e).__name__}: {e})") from None
    if not isinstance(body, dict):
        raise ProtocolError("frame is not a msgpack map")
    kind = body.pop("t", None)
    # Only a str can name a type (a list or map there is unhashable: no dict lookup).
    cls = REGISTRY.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ProtocolError("frame has a missing or unknown message type")
    fields = _FIELDS[cls]
    if body.keys() != fields.keys():
        raise ProtocolError(
            f"{cls.TYPE} frame has fields {sorted(body)}, expected {sorted(fields)}"
        )
    for name, check in fields.items():
        if not check(body[name]):
            raise ProtocolError(f"{cls.TYPE}.{name} has the wrong type or an unknown value")
    for name, enum_type in _ENUMS[cls].items():
        body[name] = enum_type(body[name])
    return cls(**body)


def parse_length(prefix: bytes, max_frame: int) -> int:
    """Reads a length prefix, refusing anything over ``max_frame`` before allocating."""
    n: int
    (n,) = _LEN.unpack(prefix)
    if n > max_frame:
        if all(32 <= b < 127 for b in prefix):
            # Text where a length belongs: another protocol (HTTP, SSH, a port scanner).
            raise ProtocolError(
                f"the other side is not speaking pccl (it sent {prefix.decode()!r} where a "
                f"frame length belongs): check the address and port")
        raise ProtocolError(f"frame of {n} bytes exceeds the limit of {max_frame} bytes")
    return n
