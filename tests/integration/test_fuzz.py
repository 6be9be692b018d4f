"""Fuzzing the control plane.

- The codec: random bytes, random msgpack values, valid messages with their bytes or
  their fields mutated. Decoding either yields a well-typed message or raises
  ``ProtocolError``, nothing else.
- A live in-process ``MasterNode`` with real ``Communicator``s: fake peers connect and
  send random and mutated message sequences, before and after a valid handshake, while
  the real peers keep all-reducing. The master keeps serving, logs no errors, forgets
  every fake peer once it is gone, and the real peers' results stay exact; a peer joining
  and leaving afterwards still works.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import logging
import secrets
import struct
import typing
from collections.abc import AsyncIterator

import msgpack
import numpy as np
import pytest
import pytest_asyncio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as hs

import pccl
from pccl.errors import ErrorKind, ProtocolError
from pccl.master import state as st
from pccl.protocol import PROTOCOL_VERSION, codec
from pccl.protocol import messages as m
from pccl.protocol.auth import peer_mac
from pccl.protocol.transport import ConnectionClosed, FramedConnection
from pccl.testing import Cluster
from pccl.testing.control import dial_master, write_raw

# --- strategies -----------------------------------------------------------------------

# Every integer msgpack can carry, with the small ones (ids, enums, ports) favoured.
INTS = hs.one_of(
    hs.integers(-3, 70),
    hs.sampled_from([-(1 << 63), -1 - (1 << 31), (1 << 31) - 1, 1 << 32, 1 << 48,
                     (1 << 63) - 1, 1 << 63, (1 << 64) - 1]),
    hs.integers(-(1 << 63), (1 << 64) - 1),
)
TEXT = hs.text(hs.characters(codec="utf-8"), max_size=12)


def _field(tp: object) -> hs.SearchStrategy[object]:
    if tp is int:
        return INTS
    if tp is float:
        # (finite: the codec refuses NaN and infinities, which no honest field holds)
        return hs.one_of(hs.floats(allow_nan=False, allow_infinity=False), INTS)
    if tp is str:
        return TEXT
    if tp is bytes:
        return hs.binary(max_size=40)
    if tp is bool:
        return hs.booleans()
    if isinstance(tp, type) and issubclass(tp, enum.StrEnum):
        return hs.sampled_from(list(tp))
    if typing.get_origin(tp) is list:
        (inner,) = typing.get_args(tp)
        return hs.lists(_field(inner), max_size=4)
    raise TypeError(tp)


def _message_of(cls: type[m.Message]) -> hs.SearchStrategy[m.Message]:
    hints = typing.get_type_hints(cls)
    return hs.builds(cls, **{f.name: _field(hints[f.name]) for f in dataclasses.fields(cls)})


#: Any registered message with arbitrary (well-typed) field values.
MESSAGES = hs.sampled_from(sorted(m.REGISTRY.values(), key=lambda c: c.TYPE)).flatmap(
    _message_of)

#: Any msgpack value (the shapes a peer can put in a frame).
VALUES = hs.recursive(
    hs.none() | hs.booleans() | INTS | hs.floats() | TEXT | hs.binary(max_size=16),
    lambda inner: hs.lists(inner, max_size=4) | hs.dictionaries(TEXT, inner, max_size=4),
    max_leaves=10,
)


def _fields(msg: m.Message) -> dict[str, object]:
    return {"t": msg.TYPE, **{f.name: getattr(msg, f.name) for f in dataclasses.fields(msg)}}


@hs.composite
def _mutated_map(draw: hs.DrawFn) -> dict[str, object]:
    """A valid message's map with a field dropped, added, or given another value."""
    body = _fields(draw(MESSAGES))
    how = draw(hs.sampled_from(["drop", "add", "replace", "type"]))
    if how == "drop":
        del body[draw(hs.sampled_from(sorted(body)))]
    elif how == "add":
        body[draw(TEXT)] = draw(VALUES)
    elif how == "replace":
        body[draw(hs.sampled_from(sorted(body)))] = draw(VALUES)
    else:
        body["t"] = draw(hs.one_of(TEXT, VALUES, hs.sampled_from(sorted(m.REGISTRY))))
    return body


@hs.composite
def _mutated_bytes(draw: hs.DrawFn, data: bytes) -> bytes:
    """``data`` with one to four byte-level edits."""
    buf = bytearray(data)
    for _ in range(draw(hs.integers(1, 4))):
        at = draw(hs.integers(0, len(buf)))
        how = draw(hs.sampled_from(["flip", "insert", "delete", "truncate"]))
        if how == "flip" and at < len(buf):
            buf[at] ^= draw(hs.integers(1, 255))
        elif how == "insert":
            buf[at:at] = draw(hs.binary(min_size=1, max_size=6))
        elif how == "delete":
            del buf[at:at + draw(hs.integers(1, 6))]
        else:
            del buf[at:]
    return bytes(buf)


ENCODED = MESSAGES.map(codec.encode)
MUTATED_ENCODINGS = ENCODED.flatmap(_mutated_bytes)


def _well_typed(msg: m.Message) -> bool:
    hints = typing.get_type_hints(type(msg))

    def ok(tp: object, v: object) -> bool:
        if tp is int:
            return isinstance(v, int) and not isinstance(v, bool)
        if tp is float:
            return isinstance(v, int | float) and not isinstance(v, bool)
        if typing.get_origin(tp) is list:
            (inner,) = typing.get_args(tp)
            return isinstance(v, list) and all(ok(inner, x) for x in v)
        return isinstance(v, tp)  # type: ignore[arg-type]

    return all(ok(hints[f.name], getattr(msg, f.name)) for f in dataclasses.fields(msg))


def _decode_checked(data: bytes) -> m.Message | None:
    """Decodes ``data``; ``None`` for a ``ProtocolError``. Anything else fails the test."""
    try:
        msg = codec.decode(data)
    except ProtocolError:
        return None
    assert type(msg) in m.REGISTRY.values()
    assert _well_typed(msg), msg
    assert codec.decode(codec.encode(msg)) == msg or _has_nan(msg)
    return msg


def _has_nan(msg: m.Message) -> bool:
    values = [getattr(msg, f.name) for f in dataclasses.fields(msg)]
    flat = [x for v in values for x in (v if isinstance(v, list) else [v])]
    return any(isinstance(x, float) and x != x for x in flat)


# --- the codec --------------------------------------------------------------------------

CODEC = settings(max_examples=150, deadline=None)


@CODEC
@given(MESSAGES)
def test_every_valid_message_round_trips(msg: m.Message) -> None:
    assert _decode_checked(codec.encode(msg)) == msg


@CODEC
@given(hs.binary(max_size=300))
def test_random_bytes(data: bytes) -> None:
    _decode_checked(data)


@CODEC
@given(VALUES)
def test_any_msgpack_value(value: object) -> None:
    _decode_checked(msgpack.packb(value, use_bin_type=True))


@CODEC
@given(MUTATED_ENCODINGS)
def test_mutated_encodings(data: bytes) -> None:
    _decode_checked(data)


@CODEC
@given(_mutated_map())
def test_mutated_fields(body: dict[str, object]) -> None:
    msg = _decode_checked(msgpack.packb(body, use_bin_type=True))
    if msg is not None:  # the mutation kept the message valid: it means what it says:
        # the fields it knows as sent, a newer sender's extra field skipped, an older
        # sender's missing field at its default
        defaults = {"t": msg.TYPE, **{f.name: getattr(type(msg)(**{
            g.name: getattr(msg, g.name) for g in dataclasses.fields(msg)
            if g.default is dataclasses.MISSING and g.default_factory is dataclasses.MISSING
        }), f.name) for f in dataclasses.fields(msg)}}
        expected = {k: body.get(k, defaults[k]) for k in _fields(msg)}
        assert _fields(msg) == expected or _has_nan(msg)


@pytest.mark.parametrize("kind", [[1], {"a": 1}, [], {}, None, 1.5, b"ping"])
def test_a_type_that_is_not_a_string_is_a_protocol_error(kind: object) -> None:
    # Regression: a list or map as the type made the lookup raise TypeError (unhashable),
    # which escaped the master's read loop and left the peer registered forever. (A map
    # there is refused sooner: no message holds a map inside.)
    with pytest.raises(ProtocolError, match="unknown message type|map inside"):
        codec.decode(msgpack.packb({"t": kind, "seq": 1}, use_bin_type=True))


@settings(max_examples=150, deadline=None)
@given(stream=hs.lists(hs.one_of(ENCODED.map(lambda b: struct.pack(">I", len(b)) + b),
                                 MUTATED_ENCODINGS, hs.binary(max_size=12)), max_size=6)
       .map(b"".join),
       cap=hs.sampled_from([0, 8, 64, codec.MAX_FRAME]))
async def test_frames_from_a_stream(stream: bytes, cap: int) -> None:
    """Whatever arrives, ``recv`` yields messages, then ends in ``ProtocolError`` or
    ``ConnectionClosed``; it never reads past the cap."""
    reader = asyncio.StreamReader()
    reader.feed_data(stream)
    reader.feed_eof()
    conn = FramedConnection(reader, None, max_frame=cap)  # type: ignore[arg-type]
    for _ in range(len(stream) + 1):
        try:
            msg = await conn.recv()
        except (ProtocolError, ConnectionClosed):
            return
        assert _well_typed(msg)
    pytest.fail("recv did not stop at the end of the stream")


# --- a live master ----------------------------------------------------------------------

# Shared secrets are keys of at least 128 random bits (pccl.identity.check_secret).
SECRET = b"5f0c1a9e7d3b42c8a6e1f0b97c2d4e3a"
GUESS = b"c0ffee00d15ea5e5b16b00b5a11ce0de"  # a fake's wrong (strong) secret
N = 1024  # elements per all-reduce


@dataclasses.dataclass(frozen=True)
class FakePeer:
    """One scripted connection to the master."""

    # "none": no hello; "valid"; "wrong-secret": the transport handshake with another
    # secret (refused there); or how the hello is wrong ("bad-mac": encrypted, the
    # handshake proved the secret and the master ignores the MAC)
    hello: str
    group: int
    resume: tuple[int, int, int, list[int]]  # resume_peer_id, epoch, revision, peers
    chunks: list[bytes]  # what it sends after the handshake (or instead of it)
    ending: str  # "half-close": FIN and wait for the master; "abort": RST; "close"


def _frame(body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + body


CHUNKS = hs.one_of(
    MESSAGES.map(codec.frame),  # well-formed messages of every type, fields random
    MUTATED_ENCODINGS.map(_frame),  # broken bodies
    _mutated_map().map(lambda b: _frame(msgpack.packb(b, use_bin_type=True))),
    ENCODED.map(_frame).flatmap(_mutated_bytes),  # broken framing
    hs.binary(min_size=1, max_size=24),  # raw garbage
    hs.just(struct.pack(">I", 0xFFFFFFFF)),  # 4 GiB prefix
)

FAKE_PEERS = hs.builds(
    FakePeer,
    hello=hs.sampled_from(["none", "valid", "valid", "valid", "bad-mac", "bad-version",
                           "bad-port", "wrong-secret"]),
    group=hs.sampled_from([0, 0, 1, -1, 1 << 62]),
    resume=hs.one_of(
        hs.just((0, 0, -1, [])),
        hs.tuples(hs.one_of(hs.integers(1, 40), hs.integers(0, 1 << 50)), INTS, INTS,
                  hs.lists(INTS, max_size=3))),
    chunks=hs.lists(CHUNKS, max_size=6),
    ending=hs.sampled_from(["half-close", "abort", "close"]),
)


async def _run_fake(address: str, fake: FakePeer) -> None:
    if fake.hello == "wrong-secret":
        with pytest.raises(pccl.AuthenticationError, match="shared secrets"):
            await dial_master(address, GUESS)
        return
    conn = await dial_master(address, SECRET)
    reader, writer = conn.reader, conn.writer
    try:
        # The challenge comes first: once it is here the master serves this connection.
        challenge = await conn.recv()
        assert isinstance(challenge, m.Challenge) and challenge.auth
        if fake.hello != "none":
            nonce = secrets.token_bytes(16)
            rid, epoch, revision, peers = fake.resume
            hello = m.Hello(
                version=PROTOCOL_VERSION + (fake.hello == "bad-version"),
                peer_group=fake.group, p2p_port=0 if fake.hello == "bad-port" else 9,
                p2p_host="127.0.0.1", nonce=nonce,
                mac=peer_mac(SECRET if fake.hello != "bad-mac" else GUESS, challenge.nonce,
                             nonce),
                resume_peer_id=rid, resume_epoch=epoch, resume_revision=revision,
                resume_peers=peers)
            conn.send_nowait(hello)
        for chunk in fake.chunks:
            write_raw(conn, chunk)
            await writer.drain()
            await asyncio.sleep(0)  # let the master and the real peers interleave
        if fake.ending == "half-close":
            writer.write_eof()
            while await reader.read(1 << 16):  # until the master hangs up
                pass
    except (OSError, asyncio.IncompleteReadError):
        pass  # the master hung up on us: expected for most scripts
    finally:
        if fake.ending == "abort":
            writer.transport.abort()
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


async def _check_all_reduce(comms: list[pccl.Communicator], salt: int) -> None:
    """Every peer reduces ``(rank + 1) * arange + salt``; SUM must be exact."""
    xs = [np.arange(N, dtype=np.float32) * (i + 1) + salt for i in range(len(comms))]
    want = sum(x.copy() for x in xs)
    infos = await asyncio.gather(*(c.all_reduce(x) for c, x in zip(comms, xs)))
    assert all(info.world_size == len(comms) for info in infos)
    for x in xs:
        np.testing.assert_array_equal(x, want)


class _Errors(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@dataclasses.dataclass
class Live:
    cluster: Cluster
    serve: asyncio.Task[None]
    errors: _Errors


@pytest_asyncio.fixture
async def live() -> AsyncIterator[Live]:
    """Two accepted real peers on a master with a secret, served by ``serve_forever``;
    shared by all examples of a test (a long-lived master is the point)."""
    errors = _Errors()
    logging.getLogger().addHandler(errors)
    cluster = Cluster(2, secret=SECRET, master_kwargs={
        "heartbeat_interval": 0.25, "heartbeat_timeout": 5.0, "handshake_timeout": 2.0,
        "recovery_grace": 0.5})
    try:
        async with cluster:
            serve = asyncio.create_task(cluster.master.serve_forever())
            yield Live(cluster, serve, errors)
            await cluster.close()
            async with asyncio.timeout(10):
                await serve
    finally:
        logging.getLogger().removeHandler(errors)


def _assert_baseline(live: Live, real: set[int], handlers: set[asyncio.Task[None]]) -> None:
    master = live.cluster.master
    s = master.state
    assert not live.serve.done(), "the master's serve task ended"
    assert master.serving
    assert set(s.peers) == real and s.accepted() == sorted(real) and not s.pending()
    assert set(master._conns) == real
    assert master._handlers == handlers
    assert s.phase is st.Phase.IDLE and not s.votes and s.round is None
    assert not s.collectives and not s.syncs and not s.recovery_awaiting
    assert set(s.last_revision) <= real  # resumed revisions of fakes are forgotten too
    assert not live.errors.records, [r.getMessage() for r in live.errors.records]


LIVE = settings(max_examples=40, deadline=None, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow, HealthCheck.data_too_large])


@LIVE
@given(fakes=hs.lists(FAKE_PEERS, min_size=1, max_size=4))
async def test_fake_peers_do_not_disturb_a_live_master(live: Live,
                                                       fakes: list[FakePeer]) -> None:
    cluster, master = live.cluster, live.cluster.master
    comms = [c for c in cluster.comms if c.state.name == "ACCEPTED"]
    real = {c.peer_id for c in comms}
    handlers = set(master._handlers)
    _assert_baseline(live, real, handlers)
    await _check_all_reduce(comms, salt=-1)

    # During: the fakes talk while the real peers keep reducing.
    done = asyncio.Event()

    async def keep_reducing() -> int:
        rounds = 0
        while not done.is_set() or rounds == 0:
            await _check_all_reduce(comms, salt=rounds)
            rounds += 1
        return rounds

    reducing = asyncio.create_task(keep_reducing())
    try:
        async with asyncio.timeout(30):
            await asyncio.gather(*(_run_fake(master.address, f) for f in fakes))
    finally:
        done.set()
        async with asyncio.timeout(30):
            assert await reducing >= 1

    # After: every fake is forgotten once its connection handler ended.
    extra = master._handlers - handlers
    if extra:
        _, pending = await asyncio.wait(extra, timeout=10)
        assert not pending, "a connection handler outlived its fake peer"
    _assert_baseline(live, real, handlers)
    await _check_all_reduce(comms, salt=-2)

    # Membership still works: a peer joins (a new round and epoch), reduces, leaves.
    late = cluster.new_comm()
    async with asyncio.timeout(30):
        await cluster.admit([late])
        await _check_all_reduce([*comms, late], salt=-3)
        await late.close()
        cluster.comms.remove(late)
        await master.wait_for(lambda s: late.peer_id not in s.peers, timeout=10)
        await asyncio.gather(*(c.update_topology() for c in comms))
        await _check_all_reduce(comms, salt=-4)
    extra = master._handlers - handlers
    if extra:
        _, pending = await asyncio.wait(extra, timeout=10)
        assert not pending, "the late peer's connection handler did not end"
    _assert_baseline(live, real, handlers)


# --- regressions found by the tests above -------------------------------------------------


async def _register_fake(address: str, **resume: object) -> FramedConnection:
    conn = await dial_master(address, SECRET)
    challenge = await conn.recv()
    assert isinstance(challenge, m.Challenge)
    nonce = secrets.token_bytes(16)
    conn.send_nowait(m.Hello(
        version=PROTOCOL_VERSION, peer_group=0, p2p_port=9, p2p_host="127.0.0.1",
        nonce=nonce, mac=peer_mac(SECRET, challenge.nonce, nonce), **resume))
    return conn


async def _hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Waits (bounded) until the master closes the connection, then closes ours."""
    with contextlib.suppress(OSError):
        async with asyncio.timeout(10):
            while await reader.read(1 << 16):
                pass
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()


async def test_a_registered_peer_sending_an_unhashable_type_is_dropped(live: Live) -> None:
    master = live.cluster.master
    conn = await _register_fake(master.address)
    await master.wait_for(lambda s: len(s.pending()) == 1, timeout=10)
    write_raw(conn, _frame(msgpack.packb({"t": [1], "seq": 1})))
    await master.wait_for(lambda s: not s.pending(), timeout=10)
    await _hang_up(conn.reader, conn.writer)
    assert not live.errors.records, [r.getMessage() for r in live.errors.records]
    await _check_all_reduce(live.cluster.comms, salt=0)


async def test_a_resume_epoch_out_of_range_cannot_break_the_next_round(live: Live) -> None:
    # Regression: a peer registering with resume info raised the master's epoch to its
    # resume_epoch unchecked; at 2**64 - 1 the next round's epoch (one more) no longer
    # fit in msgpack, so the master failed while sending establish_p2p and the round hung.
    cluster, master = live.cluster, live.cluster.master
    conn = await _register_fake(master.address, resume_peer_id=77,
                                resume_epoch=(1 << 64) - 1)
    conn.writer.write_eof()
    await _hang_up(conn.reader, conn.writer)
    assert master.state.epoch < 1 << 48
    late = cluster.new_comm()
    async with asyncio.timeout(20):
        await cluster.admit([late])
    await _check_all_reduce(cluster.comms, salt=1)
    assert not live.errors.records, [r.getMessage() for r in live.errors.records]


@pytest.mark.parametrize("kind", ["NoSuchError", "peerconnectionerror", "all_reduce", 3])
def test_an_error_kind_outside_the_one_list_is_a_protocol_error(kind: object) -> None:
    body = {"t": "coll_outcome", "tag": 1, "op_id": 2, "ok": False, "kind": kind,
            "message": "x", "data": b"", "world": 0}
    with pytest.raises(ProtocolError, match="kind"):
        codec.decode(msgpack.packb(body, use_bin_type=True))
    body["kind"] = "PeerConnectionError"
    msg = codec.decode(msgpack.packb(body, use_bin_type=True))
    assert isinstance(msg, m.CollectiveOutcome) and msg.kind is ErrorKind.PeerConnectionError
