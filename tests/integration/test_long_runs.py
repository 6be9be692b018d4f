"""Day two (issue 38): a run id keeps two jobs on one master apart, and the timeline
outlives a master restart (``state_dir``)."""

from __future__ import annotations

import json
import logging
import stat
from pathlib import Path

import pytest

import pccl
from pccl.master import status


async def test_a_peer_of_another_run_is_refused_by_name(
        caplog: pytest.LogCaptureFixture) -> None:
    # Before: two jobs pointed at one master silently shared a group.
    caplog.set_level(logging.INFO, logger="pccl")
    async with pccl.MasterNode(listen="127.0.0.1:0", run_id="job-a") as master:
        for theirs, said in (("job-b", "'job-b'"), (None, "no run id")):
            comm = pccl.Communicator(master=master.address, run_id=theirs)
            with pytest.raises(pccl.InvalidUsageError, match=(
                    f"this peer is for run {said}, this master serves 'job-a': check "
                    "PCCL_MASTER and PCCL_RUN_ID")):
                await comm.connect()
            await comm.close()
        async with pccl.Communicator(master=master.address, run_id="job-a",
                                     name="alice") as comm:
            port = comm.p2p_port
        # Its log says what it got: id, name, master, group, run, p2p address, reachability.
        said = [r.getMessage() for r in caplog.records if "registered with" in r.getMessage()]
        assert said == [f"peer {comm.peer_id} 'alice': registered with the master at "
                        f"{master.address} (group 0, run 'job-a', p2p 127.0.0.1:"
                        f"{port}, reachable from the master: others dial it; "
                        f"encrypted, key {comm.identity.fingerprint})"]
    async with pccl.MasterNode(listen="127.0.0.1:0") as master:
        comm = pccl.Communicator(master=master.address, run_id="job-a")
        with pytest.raises(pccl.InvalidUsageError, match="this master serves no run id"):
            await comm.connect()
        await comm.close()


@pytest.mark.parametrize("bad", ["", "x" * 65, "tab\there", 7])
def test_a_run_id_is_short_printable_text(bad: object) -> None:
    with pytest.raises(pccl.InvalidArgumentError, match="run_id"):
        pccl.MasterNode(listen="127.0.0.1:0", run_id=bad)  # type: ignore[arg-type]
    with pytest.raises(pccl.InvalidArgumentError, match="run_id"):
        pccl.Communicator(master="127.0.0.1:1", run_id=bad)  # type: ignore[arg-type]


async def test_the_timeline_outlives_a_master_restart(tmp_path: Path) -> None:
    # Before: a restarted master started with an empty timeline.
    state = tmp_path / "state"
    async with pccl.MasterNode(listen="127.0.0.1:0", state_dir=str(state)) as first:
        async with pccl.Communicator(master=first.address):
            pass
        before = list(first.monitor.timeline)
    assert [e["kind"] for e in before] == ["master", "joined", "admitted", "ring", "dropped"]
    path = state / status.TIMELINE_FILE
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(state.stat().st_mode) == 0o700
    with path.open("a") as f:
        f.write('{"seq": 99, "kind": "cut by a cra')  # a crash mid-line
    async with pccl.MasterNode(listen="127.0.0.1:0", state_dir=str(state)) as second:
        after = list(second.monitor.timeline)
    assert after[:len(before)] == before
    assert [e["kind"] for e in after[len(before):]] == ["master"]
    assert after[-1]["seq"] == before[-1]["seq"] + 1
    lines = path.read_text().splitlines()
    assert [json.loads(line)["seq"] for line in lines if line.endswith("}")
            and '"cut by' not in line] == [e["seq"] for e in after]


async def test_the_timeline_file_is_rotated(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(status, "TIMELINE_FILE_MAX_BYTES", 300)
    async with pccl.MasterNode(listen="127.0.0.1:0", state_dir=str(tmp_path)) as master:
        for i in range(5):
            master.monitor.add("test", f"entry {i}")
    rotated = tmp_path / (status.TIMELINE_FILE + ".1")
    assert rotated.exists()
    assert (tmp_path / status.TIMELINE_FILE).stat().st_size <= 300 + 200


async def test_a_state_dir_that_cannot_be_used_fails_at_start(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    master = pccl.MasterNode(listen="127.0.0.1:0", state_dir=str(blocker))
    with pytest.raises(pccl.InvalidUsageError, match="state_dir"):
        await master.start()
    await master.stop()
