"""Control-plane codec: round trips, validation, framing limits."""

from __future__ import annotations

import dataclasses
import struct

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as hs
from message_examples import EXAMPLES

from pccl.errors import ProtocolError
from pccl.protocol import codec
from pccl.protocol import messages as m


def test_every_registered_message_has_an_example() -> None:
    assert {type(e) for e in EXAMPLES} == set(m.REGISTRY.values())


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda x: x.TYPE)
def test_round_trip(msg: m.Message) -> None:
    assert codec.decode(codec.encode(msg)) == msg
    wire = codec.frame(msg)
    (n,) = struct.unpack(">I", wire[:4])
    assert n == len(wire) - 4


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"\xc1",  # never-used msgpack byte
        msgpack.packb([1, 2, 3]),
        msgpack.packb({"t": "no-such-type"}),
        msgpack.packb({"seq": 1}),
        msgpack.packb({"t": "ping"}),  # missing field
        msgpack.packb({"t": "ping", "seq": "1"}),
        msgpack.packb({"t": "ping", "seq": True}),
        msgpack.packb({"t": "p2p_report", "epoch": 1, "failed": ["x"]}),
        msgpack.packb({1: 2}),
    ],
)
def test_malformed_bodies_are_protocol_errors(body: bytes) -> None:
    with pytest.raises(ProtocolError):
        codec.decode(body)


def test_a_newer_senders_field_is_skipped_and_an_older_senders_missing_one_defaults() -> None:
    # Rolling upgrades (issue 38): adjacent protocol versions decode each other's frames.
    newer = codec.decode(msgpack.packb({"t": "ping", "seq": 7, "added_later": [1, 2]}))
    assert newer == m.Ping(seq=7)
    older = codec.decode(msgpack.packb({"t": "challenge", "version": 14, "nonce": b"n",
                                        "auth": True}, use_bin_type=True))
    assert older == m.Challenge(version=14, nonce=b"n", auth=True)
    assert older.min_version == 0 and older.groups == []
    with pytest.raises(ProtocolError, match=r"lacks the fields \['nonce'\]"):
        codec.decode(msgpack.packb({"t": "challenge", "version": 14, "auth": True}))


def test_length_prefix_over_cap_is_refused_before_reading() -> None:
    with pytest.raises(ProtocolError, match="exceeds"):
        codec.parse_length(struct.pack(">I", 0xFFFFFFFF), codec.MAX_FRAME)
    assert codec.parse_length(struct.pack(">I", 10), 10) == 10


@given(hs.binary(max_size=512))
def test_random_bytes_never_crash_the_decoder(data: bytes) -> None:
    try:
        msg = codec.decode(data)
    except ProtocolError:
        return
    assert dataclasses.is_dataclass(msg)
