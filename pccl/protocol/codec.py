"""msgpack encoding of messages, with strict validation on decode, and framing.

Everything decoded here comes from the network, so decoding is bounded before anything
is trusted: the frame's length was checked against a cap before it was read
(:func:`parse_length`); msgpack refuses a string, a byte string or an array longer
than the frame could honestly hold, any map but the message's own (refused as it is
built), and more than :data:`MAX_CONTAINERS` arrays per frame (nested empty arrays or
maps are the cheapest way to make a few bytes cost a lot of memory: ``[[]]*4M`` is 4 MB
on the wire and 300 MB as Python lists). What remains costs at most ~20 bytes of memory
per byte of frame (a list of 2-character strings), and only while one frame is
decoded. Then every field is checked against its annotation, including the limits of
:class:`Bound`: too many items refuse the frame, too long a text is clipped.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import struct
import typing

import msgpack

from pccl.errors import ProtocolError
from pccl.protocol.messages import REGISTRY, Bound, Hello, Message

#: Default hard cap on one control-plane frame (bytes, excluding the 4-byte prefix).
MAX_FRAME = 16 * 1024 * 1024
#: Largest frame a master reads before the dialer registered (its hello, resumed rings
#: included: :func:`fit_hello`). Anyone may send one, and every connection waiting in
#: the handshake may hold one.
PRE_HELLO_MAX_FRAME = 64 << 10
#: Arrays one frame may hold (all levels together). The largest honest message holds
#: one array per field plus one per tensor of a shared-state plan.
MAX_CONTAINERS = 1 << 17
#: Characters a string field may have when its annotation gives no :class:`Bound`
#: (addresses, names, keys): longer ones refuse the frame.
MAX_STR = 4096

_LEN = struct.Struct(">I")

# Field validators, derived once per message class from its annotations.
_Check = typing.Callable[[object], bool]


def _checker(tp: object) -> _Check:
    origin = typing.get_origin(tp)
    if origin is typing.Annotated:
        inner, *extras = typing.get_args(tp)
        check = _checker(inner)
        bound = next(b for b in extras if isinstance(b, Bound))
        if bound.clip:  # text, clipped after the checks (_CLIPS) rather than refused
            return lambda v: isinstance(v, str)
        # the length first: a field far past its bound is refused without a pass over it
        return lambda v: isinstance(v, (str, list)) and len(v) <= bound.n and check(v)
    if isinstance(tp, type) and issubclass(tp, enum.StrEnum):
        # An enum travels as its value; only the enum's own values decode.
        values = frozenset(str(v.value) for v in tp)
        return lambda v: isinstance(v, str) and v in values
    if tp is int:
        return lambda v: isinstance(v, int) and not isinstance(v, bool)
    if tp is float:
        # NaN and infinities are never honest values here (rates, seconds), and they
        # would break whatever compares or prints them (JSON has neither).
        return lambda v: (isinstance(v, float) and math.isfinite(v)) or (
            isinstance(v, int) and not isinstance(v, bool))
    if tp is str:
        return lambda v: isinstance(v, str) and len(v) <= MAX_STR
    if tp in (bytes, bool):
        return lambda v: isinstance(v, tp)
    if origin is list:
        (inner,) = typing.get_args(tp)
        check = _checker(inner)
        return lambda v: isinstance(v, list) and all(check(x) for x in v)
    raise TypeError(f"unsupported message field type {tp!r}")


def _clip_length(tp: object) -> int | None:
    """The length a text field is clipped to (``Annotated[str, Bound(n, clip=True)]``)."""
    if typing.get_origin(tp) is typing.Annotated:
        for extra in typing.get_args(tp)[1:]:
            if isinstance(extra, Bound) and extra.clip:
                return extra.n
    return None


def clip_text(text: str, n: int) -> str:
    """``text`` cut to at most ``n`` characters, saying how much was cut."""
    if len(text) <= n:
        return text
    note = f"... [{len(text) - n} more characters cut]"
    return text[:max(0, n - len(note))] + note


_FIELDS: dict[type[Message], dict[str, _Check]] = {}
# Fields decoded into an enum (message class -> field name -> enum class).
_ENUMS: dict[type[Message], dict[str, type[enum.StrEnum]]] = {}
# Text fields clipped on decode (message class -> field name -> characters).
_CLIPS: dict[type[Message], dict[str, int]] = {}
# Fields without a default, which every version sends (message class -> names).
_REQUIRED: dict[type[Message], frozenset[str]] = {}
for _cls in REGISTRY.values():
    _hints = typing.get_type_hints(_cls, include_extras=True)
    _FIELDS[_cls] = {f.name: _checker(_hints[f.name]) for f in dataclasses.fields(_cls)}
    _ENUMS[_cls] = {f.name: _hints[f.name] for f in dataclasses.fields(_cls)
                    if isinstance(_hints[f.name], type)
                    and issubclass(_hints[f.name], enum.StrEnum)}
    _CLIPS[_cls] = {f.name: n for f in dataclasses.fields(_cls)
                    if (n := _clip_length(_hints[f.name])) is not None}
    _REQUIRED[_cls] = frozenset(
        f.name for f in dataclasses.fields(_cls)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)


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


def fit_hello(hello: Hello) -> Hello:
    """``hello`` cut to fit :data:`PRE_HELLO_MAX_FRAME`: the rings it resumes are what
    can grow (with thousands of peers); the later ones of ``resume_more_*`` go first,
    then every ring is shortened. Only for a peer with one master, where the rings only
    help a restarted master re-form the group: with several, a master counts quorums
    against them, and a cut ring could make a minority look like a majority, so a hello
    that does not fit raises :class:`ProtocolError` instead."""
    limit = PRE_HELLO_MAX_FRAME - 4
    if hello.masters > 1 and len(encode(hello)) > limit:
        raise ProtocolError(
            f"this peer's hello ({len(encode(hello))} bytes, with the rings it resumes) "
            f"exceeds the {PRE_HELLO_MAX_FRAME}-byte limit of a first frame: with several "
            f"masters, groups of up to ~10,000 peers fit")
    while len(encode(hello)) > limit and hello.resume_more_epochs:
        hello = dataclasses.replace(hello, resume_more_epochs=hello.resume_more_epochs[:-1],
                                    resume_more_peers=hello.resume_more_peers[:-1])
    n = max(len(hello.resume_peers), len(hello.resume_base_peers))
    while len(encode(hello)) > limit and n > 0:
        n //= 2
        hello = dataclasses.replace(hello, resume_peers=hello.resume_peers[:n],
                                    resume_base_peers=hello.resume_base_peers[:n])
    return hello


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


class _TooManyContainers(Exception):
    pass


class _NestedMap(Exception):
    pass


def _unpack(data: bytes) -> object:
    """msgpack with limits (see the module's docstring)."""
    containers = 0
    maps = 0

    def count(items: list[object]) -> list[object]:
        nonlocal containers
        containers += 1
        if containers > MAX_CONTAINERS:
            raise _TooManyContainers
        return items

    def one_map(pairs: dict[object, object]) -> dict[object, object]:
        # A message is one map and no field holds another: a second map (nested empty
        # maps cost as much as nested arrays) refuses the frame as it is built.
        nonlocal maps
        maps += 1
        if maps > 1:
            raise _NestedMap
        return pairs

    n = len(data)
    try:
        return msgpack.unpackb(
            data, raw=False, strict_map_key=True, use_list=True, list_hook=count,
            object_hook=one_map,
            # Every element takes at least a byte: nothing honest is longer than the
            # frame. A message is one map of at most a few dozen fields.
            max_str_len=n, max_bin_len=n, max_array_len=n, max_map_len=64,
            max_ext_len=0)
    except _TooManyContainers:
        raise ProtocolError(f"frame holds more than {MAX_CONTAINERS} arrays") from None
    except _NestedMap:
        raise ProtocolError("frame holds a map inside the message") from None
    except Exception as e:  # msgpack raises several unrelated types on garbage
        raise ProtocolError(
            f"undecodable frame ({type(e).__name__}: {clip_text(str(e), 200)})") from None


def decode(data: bytes) -> Message:
    """Decodes and validates one frame body; anything unexpected is ``ProtocolError``."""
    body = _unpack(data)
    if not isinstance(body, dict):
        raise ProtocolError("frame is not a msgpack map")
    kind = body.pop("t", None)
    # Only a str can name a type (a list or map there is unhashable: no dict lookup).
    cls = REGISTRY.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ProtocolError("frame has a missing or unknown message type")
    fields = _FIELDS[cls]
    # Versions next to each other work together (a rolling upgrade): a field this
    # version does not know is a newer sender's and is skipped (the map holds at most
    # 64), and a field with a default may be missing (an older sender's). A field
    # without a default must be there.
    for name in [k for k in body if k not in fields]:
        del body[name]
    missing = sorted(name for name in _REQUIRED[cls] if name not in body)
    if missing:
        raise ProtocolError(f"{cls.TYPE} frame lacks the fields {missing}")
    for name, check in fields.items():
        if name in body and not check(body[name]):
            raise ProtocolError(f"{cls.TYPE}.{name} has the wrong type, an unknown value or "
                                "too many items")
    for name, enum_type in _ENUMS[cls].items():
        if name in body:
            body[name] = enum_type(body[name])
    for name, n in _CLIPS[cls].items():
        if name in body:
            body[name] = clip_text(body[name], n)
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
