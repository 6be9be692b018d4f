"""Control-plane codec: round trips, validation, framing limits."""

from __future__ import annotations

import dataclasses
import struct

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as hs

from pccl.errors import ProtocolError
from pccl.protocol import codec
from pccl.protocol import messages as m

EXAMPLES: list[m.Message] = [
    m.Challenge(version=1, nonce=b"\x00" * 16, auth=True),
    m.Hello(version=1, peer_group=3, p2p_port=1234, p2p_host="", nonce=b"n", mac=b"m"),
    m.Welcome(peer_id=7, mac=b"", heartbeat_interval=0.5, heartbeat_timeout=2),
    m.Denylist(data=b"pccl-denylist-v1 signed bytes"),
    m.Reject(kind="AuthenticationError", message="no"),
    m.Shutdown(reason="an upgrade", final=False),
    m.Ping(seq=1),
    m.Pong(seq=1),
    m.UpdateTopology(),
    m.EstablishP2P(epoch=2, ring=[1, 2, 3], next_id=2, next_addr="127.0.0.1:9"),
    m.EstablishP2P(epoch=2, ring=[1, 2, 3], next_id=2, next_addr="127.0.0.1:9",
                   route="relay", token=b"t" * 16, prev_id=3, prev_addr="10.0.0.3:4",
                   prev_route="reverse", prev_token=b"u" * 16),
    # With the roster: the static keys of the peers it names (protocol 13).
    m.EstablishP2P(epoch=3, ring=[1, 2], next_id=2, next_addr="127.0.0.1:9",
                   key_ids=[1, 2], keys=[b"\x01" * 32, b"\x02" * 32]),
    m.RelayOpen(token=b"t" * 16, stream=3),
    m.DoctorHello(version=5, nonce=b"n" * 16, mac=b"m" * 32, p2p_port=4000),
    m.DoctorReport(observed="203.0.113.7:5000", reachable=True, mac=b"", master_time=1.5),
    m.DoctorEcho(payload=b"\0" * 10, reply_bytes=20, master_time=2.5),
    m.P2PReport(epoch=2, failed=[3]),
    m.WorldInfo(epoch=1, ring=[1], global_world_size=1, peer_group_world_size=1,
                num_peer_groups=1, largest_peer_group_world_size=1),
    m.TopologyUpdated(epoch=4),
    m.TopologyUpdateFailed(message="x"),
    m.PendingQuery(req=9),
    m.PendingAnswer(req=9, pending=False),
    m.Leave(),
    m.ErrorReply(kind="InvalidUsageError", message="y"),
    m.CollectiveInit(tag=1, kind="all_reduce", dtype=2, count=10, op=0, quant_algorithm=0,
                     quant_dtype=0),
    m.CollectivePerform(tag=1, op_id=5, epoch=2, rank=0, world=3),
    m.CollectiveDone(tag=1, op_id=5, ok=False, kind="PeerConnectionError", message="x"),
    m.CollectiveAbort(tag=1, op_id=5, message="peer 3 died"),
    m.CollectiveOutcome(tag=1, op_id=5, ok=True, kind="", message=""),
    m.SyncInit(revision=1, strategy=0, keys=["w"], dtypes=[2], counts=[3], hashes=[b"h"],
               unequal=[False]),
    m.SyncPlan(revision=2, fetch_keys=["w"], fetch_hashes=[b"h"], fetch_sources=[[1, 2]],
               source_ids=[1, 2], source_addrs=["a:1", "b:2"], key_ids=[1, 2],
               keys=[b"\x01" * 32, b"\x02" * 32]),
    m.SyncDone(ok=True, kind="", message=""),
    m.SyncWithdraw(),
    m.SyncOutcome(ok=False, kind="InvalidUsageError", message="x", revision=0),
    m.OptimizeTopology(),
    m.ProbeRequest(target_ids=[2], target_addrs=["a:1"], seconds=0.5, key_ids=[2],
                   keys=[b"\x02" * 32]),
    m.ProbeReport(target_ids=[2], rates=[1e9]),
    m.OptimizeFailed(message="x"),
]


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
