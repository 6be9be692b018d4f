"""What a new user trips over (issue 17): Rust log records reach ``logging`` at their own
level as they happen, ``PCCL_LOG_LEVEL`` works, bad timeouts are typed errors (never a
``PanicException``), and ``pccl.content_hash`` hashes any tensor like the sync does."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import re
import subprocess
import sys

import numpy as np
import pytest

import pccl
from pccl import _core, _logging
from pccl.peer import state as ps
from pccl.protocol import messages as m

RUST = "pccl._core"
# Shared secrets are keys of at least 128 random bits (pccl.identity.check_secret).
SECRET = b"5f0c1a9e7d3b42c8a6e1f0b97c2d4e3a"
OTHER_SECRET = b"c0ffee00d15ea5e5b16b00b5a11ce0de"


async def _bind_pair(id_a: int, id_b: int, secret_a: bytes | None = None,
                     secret_b: bytes | None = None) -> tuple[_core.P2PNode, _core.P2PNode]:
    """Two p2p nodes, each with its own key and knowing the other's (what the master's
    roster tells them in a run): every stream proves its node's key."""
    ia, ib = _core.Identity(), _core.Identity()
    a = await _core.P2PNode.bind(id_a, secret=secret_a, identity=ia)
    b = await _core.P2PNode.bind(id_b, secret=secret_b, identity=ib)
    keys = {id_a: ia.public_key, id_b: ib.public_key}
    a.set_peer_keys(keys)
    b.set_peer_keys(keys)
    return a, b


async def _records(caplog: pytest.LogCaptureFixture, needle: str, within: float = 5.0
                   ) -> list[logging.LogRecord]:
    """Records from the Rust core whose message contains ``needle``, waiting (bounded)
    for them: the listener logs from a tokio thread while the dialer's call returns."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while True:
        got = [r for r in caplog.records
               if r.name.startswith(RUST) and needle in r.getMessage()]
        if got or loop.time() > deadline:
            return got
        await asyncio.sleep(0.01)


# --- Rust records in Python's logging ----------------------------------------------------

async def test_wrong_secret_is_logged_at_warning_as_it_happens(caplog) -> None:
    caplog.set_level(logging.DEBUG, logger="pccl")
    a, b = await _bind_pair(8101, 8102, SECRET, OTHER_SECRET)
    try:
        with pytest.raises(pccl.AuthenticationError, match="shared secrets"):
            await a.connect_pool(f"127.0.0.1:{b.port}", 8102, 1, 2)
        # No Communicator, no read loop, nothing drains: the records come by themselves.
        # (Of a pool of two, the other stream may just see the dialer hang up: INFO.)
        # (The encrypted transport's handshake, keyed by the secret, refuses it.)
        refused = await _records(caplog, "secure handshake failed")
        assert refused, "the refusal was never logged"
        for r in refused:
            assert r.name == "pccl._core.net.node"
            assert r.levelno == logging.WARNING
            assert r.getMessage().startswith("peer 8102: p2p connection from 127.0.0.1:")
            assert "same secret" in r.getMessage()
    finally:
        await a.close()
        await b.close()


async def test_garbage_is_a_warning_and_a_good_stream_a_debug_record(caplog) -> None:
    caplog.set_level(logging.DEBUG, logger="pccl")
    a, b = await _bind_pair(8201, 8202)
    try:
        _, w = await asyncio.open_connection("127.0.0.1", b.port)
        w.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        await w.drain()
        refused = await _records(caplog, "peer 8202: p2p connection from")
        w.close()
        with contextlib.suppress(ConnectionError):  # the listener hung up on us
            await w.wait_closed()
        assert refused and all(r.levelno == logging.WARNING for r in refused)
        await a.connect_pool(f"127.0.0.1:{b.port}", 8202, 1, 2)
        accepted = await _records(caplog, "peer 8202: accepted p2p stream")
        assert accepted and all(r.levelno == logging.DEBUG for r in accepted)
        assert {r.name for r in accepted} == {"pccl._core.net.node"}
    finally:
        await a.close()
        await b.close()


async def test_level_changes_at_run_time_apply_to_rust_records(caplog) -> None:
    """The Rust side caches each logger's level; a later setLevel must still count."""
    caplog.set_level(logging.WARNING, logger="pccl")
    a, b = await _bind_pair(8301, 8302)
    try:
        await a.connect_pool(f"127.0.0.1:{b.port}", 8302, 1, 1)
        await asyncio.sleep(0.2)  # the debug record, disabled, is dropped (and cached so)
        assert not await _records(caplog, "peer 8302: accepted", within=0.0)
        caplog.set_level(logging.DEBUG, logger="pccl")
        await a.connect_pool(f"127.0.0.1:{b.port}", 8302, 2, 1)
        assert await _records(caplog, "peer 8302: accepted p2p stream 0 of 1 from peer 8301 "
                                      "(epoch 2)")
        logging.getLogger("pccl").setLevel(logging.ERROR)
        caplog.clear()
        await a.connect_pool(f"127.0.0.1:{b.port}", 8302, 3, 1)
        await asyncio.sleep(0.2)
        assert not await _records(caplog, "peer 8302: accepted", within=0.0)
    finally:
        await a.close()
        await b.close()


def _python(code: str, level: str | None, **extra: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items()
           if k not in (_logging.ENV_VAR, _logging.FORMAT_ENV_VAR)}
    if level is not None:
        env[_logging.ENV_VAR] = level
    env.update(extra)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=60)


@pytest.mark.parametrize(("value", "want"), [("debug", 10), ("INFO", 20), (" warning ", 30),
                                             ("error", 40), ("15", 15), (None, 0), ("", 0)])
def test_pccl_log_level_sets_the_pccl_logger(value, want) -> None:
    p = _python("import pccl, logging; print(logging.getLogger('pccl').level)", value)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == str(want)
    assert "Warning" not in p.stderr


@pytest.mark.parametrize("value", ["verbose", "-3", "debugg"])
def test_a_bogus_pccl_log_level_warns_and_changes_nothing(value) -> None:
    p = _python("import pccl, logging; print(logging.getLogger('pccl').level)", value)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "0"
    assert "RuntimeWarning" in p.stderr and f"PCCL_LOG_LEVEL={value!r}" in p.stderr


_REFUSED_SCRIPT = """
import asyncio, pccl
from pccl import _core
async def main():
    ia, ib = _core.Identity(), _core.Identity()
    a = await _core.P2PNode.bind(1, secret=b"5f0c1a9e7d3b42c8a6e1f0b97c2d4e3a", identity=ia)
    b = await _core.P2PNode.bind(2, secret=b"c0ffee00d15ea5e5b16b00b5a11ce0de", identity=ib)
    keys = {1: ia.public_key, 2: ib.public_key}
    a.set_peer_keys(keys)
    b.set_peer_keys(keys)
    try:
        await a.connect_pool(f"127.0.0.1:{b.port}", 2, 1, 1)
    except pccl.IdentityError:
        raise
    except pccl.AuthenticationError:
        pass
    await asyncio.sleep(0.5)
    await a.close(); await b.close()
asyncio.run(main())
"""


def test_pccl_log_level_prints_rust_records_to_stderr() -> None:
    """A program that configured no logging still sees pccl's records when asked to."""
    p = _python(_REFUSED_SCRIPT, "debug")
    assert p.returncode == 0, p.stderr
    assert "WARNING pccl._core.net.node: peer 2: p2p connection from" in p.stderr
    quiet = _python(_REFUSED_SCRIPT, None)
    assert quiet.returncode == 0, quiet.stderr
    # Python's last-resort handler still shows warnings, once each, without our format.
    assert "WARNING pccl._core" not in quiet.stderr


UTC_STAMP = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z")


def test_pccl_log_format_json_prints_json_lines_to_stderr() -> None:
    """A peer's program that configured no logging: PCCL_LOG_FORMAT=json alone prints
    pccl's warnings as JSON (at the default level), in UTC whatever TZ says."""
    p = _python(_REFUSED_SCRIPT, None, PCCL_LOG_FORMAT="json", TZ="Asia/Kolkata")
    assert p.returncode == 0, p.stderr
    records = [json.loads(x) for x in p.stderr.splitlines()]
    assert records and all(UTC_STAMP.fullmatch(r["ts"]) for r in records)
    assert {r["level"] for r in records} == {"WARNING"}
    assert any(r["logger"] == "pccl._core.net.node"
               and r["msg"].startswith("peer 2: p2p connection from") for r in records)
    with_level = _python("import logging, pccl; print(logging.getLogger('pccl').level)",
                         "info", PCCL_LOG_FORMAT="json")
    assert with_level.stdout.strip() == "20"


def test_a_bogus_pccl_log_format_warns_and_logs_text() -> None:
    p = _python(_REFUSED_SCRIPT, "warning", PCCL_LOG_FORMAT="xml")
    assert p.returncode == 0, p.stderr
    assert "RuntimeWarning" in p.stderr and "PCCL_LOG_FORMAT='xml'" in p.stderr
    assert re.search(r"^\S+Z WARNING pccl\._core\.net\.node: peer 2: p2p connection from",
                     p.stderr, re.M), p.stderr


# --- timeouts from Python are checked, never a panic -------------------------------------

BAD_SECONDS = [-1.0, -1e-9, math.nan, math.inf, -math.inf, 1e300, 1e10]


async def _node_pair():
    return await _bind_pair(8401, 8402)


@pytest.mark.parametrize("bad", BAD_SECONDS)
async def test_bad_timeouts_raise_invalid_argument(bad) -> None:
    a, b = await _node_pair()
    addr = f"127.0.0.1:{b.port}"
    out = np.zeros(16, dtype=np.uint8)
    calls = [
        lambda: _core.P2PNode.bind(1, handshake_timeout=bad),
        lambda: _core.P2PNode.bind(1, connect_timeout=bad),
        lambda: a.install_ring(1, 8402, 8402, pool_timeout=bad),
        lambda: a.install_ring(1, 8402, 8402, io_timeout=bad),
        lambda: a.probe(addr, 8402, seconds=bad),
        lambda: a.probe(addr, 8402, io_timeout=bad),
        lambda: a.fetch_into(addr, 8402, "k", out, io_timeout=bad),
        lambda: a.fetch_many_into(addr, 8402, ["k"], [out], io_timeout=bad),
    ]
    try:
        for call in calls:
            # Refused at the call, before anything is scheduled (so nothing to await).
            with pytest.raises(pccl.InvalidArgumentError, match="must be a number of seconds"):
                call()
    finally:
        await a.close()
        await b.close()


async def test_good_edge_timeouts_are_accepted() -> None:
    a, b = await _node_pair()
    try:
        await a.install_ring(1, -1, -1, pool_timeout=0.0, io_timeout=1e9)  # ring of one
        node = await _core.P2PNode.bind(1, handshake_timeout=1e9, connect_timeout=0.5)
        await node.close()
    finally:
        await a.close()
        await b.close()


# --- pccl.content_hash (in this process: tests/unit/test_content_hash.py) ----------------

def _sample(shape=(64, 33), dtype=np.float32) -> np.ndarray:
    return np.random.default_rng(7).standard_normal(shape).astype(dtype)


def test_numpy_input_does_not_import_torch() -> None:
    code = ("import sys, numpy as np, pccl; pccl.content_hash(np.arange(9.0)[::2]); "
            "print('torch' in sys.modules)")
    p = _python(code, None)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "False"


async def test_content_hash_is_what_the_sync_compares(pccl_cluster) -> None:
    """The hashes a peer announces in its sync are pccl.content_hash's, and after a
    sync every peer's tensors have the same pccl.content_hash."""
    cluster = await pccl_cluster(2)
    good = _sample((100, 10))
    bad = good.copy()
    bad[3, 3] += 1.0
    bad_copy = bad.copy()
    tensors = [{"w": good.copy(), "n": np.arange(5, dtype=np.int64)},
               {"w": bad, "n": np.arange(5, dtype=np.int64)}]
    sent: list[m.SyncInit] = []
    comm = cluster.comms[0]
    feed = comm._feed

    def spy(ev: ps.Event) -> None:
        if isinstance(ev, ps.StartSync):
            sent.append(ev.init)  # the machine sends this init to the master
        feed(ev)

    comm._feed = spy  # type: ignore[method-assign]
    before = {k: pccl.content_hash(v) for k, v in tensors[0].items()}
    states = [pccl.SharedState([pccl.TensorInfo.from_numpy(v, k) for k, v in t.items()])
              for t in tensors]
    await asyncio.gather(*(c.sync_shared_state(s) for c, s in zip(cluster.comms, states)))
    assert len(sent) == 1
    assert [h.hex() for h in sent[0].hashes] == [before[k] for k in sent[0].keys]
    # One of the two "w" won; either way both peers now hash the same.
    for k in ("w", "n"):
        assert pccl.content_hash(tensors[1][k]) == pccl.content_hash(tensors[0][k])
    assert pccl.content_hash(tensors[0]["w"]) in {before["w"], pccl.content_hash(bad_copy)}
