"""Day two (issue 38): the run's secret is rotated while it trains, one node at a time,
without a restart; afterwards the old secret no longer gets anyone in."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import numpy as np
import pytest

import pccl
from pccl import identity
from pccl.testing.cluster import connect_all

OLD = identity.new_secret()
NEW = identity.new_secret()
FAST = {"heartbeat_interval": 0.2, "heartbeat_timeout": 2.0}


async def _until(pred, what: str, timeout: float = 15.0) -> None:  # type: ignore[no-untyped-def]
    async with asyncio.timeout(timeout):
        while not pred():  # noqa: ASYNC110 - a bounded poll of a node's own state
            await asyncio.sleep(0.05)


def _write(path: Path, *secrets: str) -> None:
    """Replaces ``path`` in one step, as an operator's tool (or a config manager) would."""
    tmp = path.with_suffix(".new")
    tmp.write_text("".join(s + "\n" for s in secrets))
    tmp.replace(path)


async def _reduce(comms: list[pccl.Communicator]) -> None:
    x = [np.full(1024, i + 1.0, dtype=np.float32) for i in range(len(comms))]
    await asyncio.gather(*(c.all_reduce(a, tag=7) for c, a in zip(comms, x)))
    total = float(sum(range(1, len(comms) + 1)))
    assert all(np.array_equal(a, np.full(1024, total, dtype=np.float32)) for a in x)


async def test_a_secret_is_rotated_node_by_node_while_the_run_trains(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # Before: the secret was read once; changing it meant restarting every node at once.
    caplog.set_level(logging.WARNING, logger="pccl")
    files = {n: tmp_path / n for n in ("master", "a", "b", "c")}
    for f in files.values():
        _write(f, OLD)
    master = pccl.MasterNode(listen="127.0.0.1:0", secret=files["master"], secret_grace=2.0,
                             **FAST)
    await master.start()
    comms: list[pccl.Communicator] = []
    try:
        comms = [pccl.Communicator(master=master.address, secret=files[n]) for n in "ab"]
        await connect_all(master, comms)
        await _reduce(comms)

        # 1. The master's file: it takes the new secret, and the old one for its grace.
        _write(files["master"], NEW)
        await _until(lambda: master.secret == NEW.encode(), "the master rotates")
        assert master.secrets.also() == [OLD.encode()]
        await _reduce(comms)

        # 2. Peer a's file: a dials with the new secret and still holds the old one.
        _write(files["a"], NEW)
        await _until(lambda: comms[0].secret == NEW.encode(), "peer a rotates")

        # 3. A newcomer started during the rotation holds both (the file's second line):
        # its links agree on the new secret with a and the master, the old one with b.
        _write(files["c"], NEW, OLD)
        comms.append(pccl.Communicator(master=master.address, secret=files["c"]))
        await connect_all(master, comms)
        await _reduce(comms)

        # 4. Peer b last: now every node holds the new secret.
        _write(files["b"], NEW)
        await _until(lambda: comms[1].secret == NEW.encode(), "peer b rotates")
        await asyncio.gather(*(c.update_topology() for c in comms))  # fresh links, new keys
        await _reduce(comms)

        # 5. The master's grace runs out: the old secret gets nobody in any more.
        await _until(lambda: not master.secrets.also(), "the grace runs out")
        stale = pccl.Communicator(master=master.address, secret=OLD, reconnect_timeout=0)
        with pytest.raises(pccl.AuthenticationError,
                           match="holds none of the shared secrets we offered"):
            await stale.connect()
        await stale.close()
        await _reduce(comms)
        said = caplog.text
        assert "the shared secret was rotated" in said
        assert [e["kind"] for e in master.monitor.timeline].count("secret") == 1
    finally:
        for c in comms:
            await c.close()
        await master.stop()


async def test_a_secret_file_that_breaks_keeps_the_secret(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    f = tmp_path / "secret"
    _write(f, OLD)
    async with pccl.MasterNode(listen="127.0.0.1:0", secret=f, **FAST) as master:
        caplog.set_level(logging.ERROR, logger="pccl.master")
        _write(f, "password")  # too weak: refused, the secret stays
        await _until(lambda: "keeps its secret" in caplog.text, "the error is logged")
        assert master.secret == OLD.encode()
        async with pccl.Communicator(master=master.address, secret=OLD) as comm:
            assert comm.peer_id is not None


def test_secrets_keep_older_ones_for_their_grace_only() -> None:
    s = identity.Secrets(OLD, grace=10.0)
    assert s.rotate(NEW, now=100.0) and not s.rotate(NEW, now=101.0)
    assert s.current == NEW.encode() and s.also(now=109.0) == [OLD.encode()]
    assert s.also(now=110.0) == []
    with pytest.raises(pccl.InvalidArgumentError, match="too weak"):
        s.rotate("hunter2")
    with pytest.raises(pccl.InvalidArgumentError, match="without a secret"):
        identity.Secrets(None).rotate(NEW)


def test_a_secret_file_holds_the_secret_then_older_ones(tmp_path: Path) -> None:
    f = tmp_path / "secret"
    _write(f, NEW, OLD)
    s = identity.Secrets(f)
    assert (s.current, s.also()) == (NEW.encode(), [OLD.encode()])
    _write(f, *[identity.new_secret() for _ in range(5)])
    with pytest.raises(pccl.InvalidArgumentError, match="at most 3 older ones"):
        s.reread()
    assert s.current == NEW.encode()  # (kept)


async def test_rotate_secret_by_call(tmp_path: Path) -> None:
    async with pccl.MasterNode(listen="127.0.0.1:0", secret=OLD, **FAST) as master:
        async with pccl.Communicator(master=master.address, secret=OLD) as comm:
            master.rotate_secret(NEW)
            comm.rotate_secret(NEW)
            newcomer = pccl.Communicator(master=master.address, secret=NEW)
            await connect_all(master, [comm, newcomer])
            await _reduce([comm, newcomer])
            await newcomer.close()
