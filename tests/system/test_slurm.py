"""``python -m pccl.launch.slurm`` and ``examples/slurm/train.sbatch`` on a real Slurm.

The first tests check the launcher's plan (master address, one ``srun`` per peer) with
no Slurm at all. ``test_sbatch_peer_failures`` starts a single-node Slurm on this machine
(``tests/_slurm_cluster.py``: munged, slurmctld, slurmd; root only), submits the
example, cancels one peer's job step and SIGKILLs another peer's process while the run
trains, and checks that both come back as joiners, that the job completes, and that
every peer ends with the same weights (bit for bit) and the exact reduced probe.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from _slurm_cluster import SlurmCluster, poll, skip_reason

from pccl.launch import slurm

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "slurm"


# --- the plan, without Slurm --------------------------------------------------------------


@pytest.mark.parametrize("nodelist, first", [
    ("node7", "node7"),
    ("gpu[03-05,9],cpu1", "gpu03"),
    ("a[1,3],b[2-4]", "a1"),
    ("rack1-n[008-011]", "rack1-n008"),
    ("x[1-2]y[3-4]", "x1y3"),
])
def test_first_host(nodelist: str, first: str) -> None:
    assert slurm.first_host(nodelist) == first


def test_derived_port_range() -> None:
    ports = {slurm.derive_port(j) for j in range(1, 30000)}
    assert min(ports) == slurm.PORT_BASE and max(ports) < slurm.PORT_BASE + slurm.PORT_SPAN
    assert 48148 not in ports


def test_dry_run(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("5f0c1a9e7d3b42c8a6e1f0b97c2d4e3a\n")  # a key, not a password
    env = {"SLURM_JOB_ID": "12345", "SLURM_NTASKS": "4", "SLURM_CPUS_PER_TASK": "2",
           "SLURM_MEM_PER_NODE": "3000", "SLURM_TASKS_PER_NODE": "2(x2)",
           "SLURM_JOB_NODELIST": "n[1-2]", "PATH": os.environ["PATH"]}
    status = slurm.main(["--dry-run", "--host", "n1", "--secret-file", str(secret),
                         "--", "python", "train.py", "--steps", "5"], env)
    out = capsys.readouterr().out.splitlines()
    assert status == 0
    assert out[0] == "master: n1:22345"
    assert len(out) == 4  # the master and 3 peers: one task slot is the master's
    assert out[2].startswith(f"peer 1: PCCL_SECRET_FILE={secret} PCCL_MASTER=n1:22345 "
                             "PCCL_SLURM_PEER=1 PCCL_SLURM_PEERS=3 PCCL_SLURM_RESTART=0 ")
    assert out[2].endswith("srun --job-name=pccl-peer1 --nodes=1 --ntasks=1 "
                           "--cpus-per-task=2 --exact --mem=1500M python train.py --steps 5")


def test_dry_run_per_node(capsys: pytest.CaptureFixture[str]) -> None:
    env = {"SLURM_JOB_ID": "9", "SLURM_NTASKS": "3", "SLURM_JOB_NUM_NODES": "3",
           "SLURM_MEM_PER_CPU": "1000", "PATH": os.environ["PATH"]}
    status = slurm.main(["--dry-run", "--host", "n1", "--per-node", "--cpus-per-peer", "8",
                         "--srun-arg=--gpus-per-task=8", "--", "python", "t.py"], env)
    out = capsys.readouterr().out.splitlines()
    assert status == 0 and out[0] == "master: n1:20009" and len(out) == 4
    for i in range(3):
        assert out[i + 1].endswith(
            f"srun --job-name=pccl-peer{i} --nodes=1 --ntasks=1 --cpus-per-task=8 --exact "
            f"--relative={i} --gpus-per-task=8 python t.py"), out


def test_refuses_to_run_in_a_step(capsys: pytest.CaptureFixture[str]) -> None:
    env = {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "4"}
    assert slurm.main(["--dry-run", "--", "true"], env) == 2
    assert "run it from the batch script" in capsys.readouterr().err


# --- a real Slurm ---------------------------------------------------------------------------


class Run:
    """The job's run directory: the peers' event logs and results."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def events(self, peer: int) -> list[dict[str, Any]]:
        f = self.path / f"peer{peer}.jsonl"
        if not f.exists():
            return []
        return [json.loads(line) for line in f.read_text().splitlines() if line.endswith("}")]

    def has(self, peer: int, event: str, **match: Any) -> bool:
        return any(e["event"] == event and all(e.get(k) == v for k, v in match.items())
                   for e in self.events(peer))

    def result(self, peer: int) -> dict[str, Any]:
        return dict(json.loads((self.path / f"result-peer{peer}.json").read_text()))


def submit(cluster: SlurmCluster) -> tuple[str, Run, Callable[[], str]]:
    """Submits the example (3 peers, until the stop file appears); returns the job id,
    its run directory and a function that returns the job's output and slurmctld's log."""
    run = Run(cluster.root / "run")
    out = cluster.root / "job.out"
    env = {"PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
           "PYTHON": sys.executable, "PCCL_EXAMPLE_DIR": str(EXAMPLE),
           "PCCL_RUN_DIR": str(run.path), "PCCL_MAX_RESTARTS": "3"}
    job = cluster.sbatch(["--output", str(out), str(EXAMPLE / "train.sbatch"),
                          "--steps", "1000000", "--report-every", "5"], env=env, cwd=ROOT)

    def context() -> str:
        text = out.read_text(errors="replace") if out.exists() else "(no job output)"
        return f"job output:\n{text[-6000:]}\nslurmctld:\n{cluster.logs('slurmctld')}"

    return job, run, context


def check_results(run: Run, restarts: list[int]) -> dict[str, Any]:
    """All three peers at the same revision, bit-identical weights, the exact probe."""
    results = [run.result(i) for i in range(3)]
    assert [r["restart"] for r in results] == restarts, results
    assert len({r["weights_hash"] for r in results}) == 1, results
    assert len({r["revision"] for r in results}) == 1, results
    last = results[0]["revision"] - 1
    for r in results:
        assert r["world"] == 3 and r["probe_world"] == 3, r
        assert r["probe_revision"] == last, r
        assert r["probe"] == [3.0, 3.0 * last], r  # SUM of [1, revision] over 3 peers
        assert r["loss"] < r["loss_at_zero"] / 2, r  # and it learned something
    return results[0]


@pytest.mark.multiprocess
@pytest.mark.alone  # a Slurm controller and node daemon
def test_sbatch_peer_failures() -> None:
    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    t0 = time.monotonic()
    with SlurmCluster() as cluster:
        startup = cluster.startup_seconds
        job, run, context = submit(cluster)
        try:
            poll(lambda: all(run.has(i, "step") for i in range(3)), 45,
                 "training on all 3 peers")
            underway = time.monotonic() - t0

            # 1. Cancel peer 0's job step: the launcher starts a new step.
            steps = {name: sid for sid, name in cluster.steps(job).items()}
            cluster.cmd("scancel", steps["pccl-peer0"])
            poll(lambda: run.has(0, "synced", restart=1), 45, "peer 0's replacement")

            # 2. SIGKILL peer 2's process (not the step): the step fails, same path.
            victim = [e for e in run.events(2) if e["event"] == "started"][-1]
            assert victim["restart"] == 0
            os.kill(victim["pid"], signal.SIGKILL)
            poll(lambda: run.has(2, "synced", restart=1), 45, "peer 2's replacement")
            poll(lambda: run.has(0, "step", restart=1) and run.has(2, "step", restart=1),
                 30, "the replacements training")

            # Every peer stops after the same step once this file exists.
            (run.path / "stop").touch()
            info = cluster.wait_job_done(job, 45)
        except Exception as e:
            raise AssertionError(f"{e}\n{context()}") from e
        total = time.monotonic() - t0
        log = context()
        assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", log

        # The launcher noticed both failures and started each peer again, once.
        assert "peer 0: starting again (restart 1 of 3)" in log, log
        assert "peer 2: starting again (restart 1 of 3)" in log, log
        assert "peer 1: starting again" not in log, log

        # Each replacement joined the running run and received its state.
        for peer in (0, 2):
            synced = [e for e in run.events(peer) if e["event"] == "synced"]
            assert [e["restart"] for e in synced] == [0, 1], synced
            assert synced[1]["strategy"] == "RECEIVE_ONLY", synced
            assert synced[1]["revision"] > 0 and synced[1]["rx_bytes"] > 0, synced

        final = check_results(run, [1, 0, 1])
        print(f"slurm start-up {startup:.1f} s, training underway at {underway:.1f} s, "
              f"job done at {total:.1f} s, {final['revision']} steps")


def steps_since_resume(run: Run, peer: int) -> int:
    kinds = [e["event"] for e in run.events(peer)]
    if "checkpoint_loaded" not in kinds:
        return 0
    return kinds[kinds.index("checkpoint_loaded"):].count("step")


@pytest.mark.multiprocess
@pytest.mark.alone  # a Slurm controller and node daemon
def test_sbatch_requeue_resumes_from_checkpoint() -> None:
    """A requeued job (as after preemption) starts again from the peers' checkpoints."""
    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    t0 = time.monotonic()
    with SlurmCluster() as cluster:
        job, run, context = submit(cluster)
        try:
            poll(lambda: all(run.has(i, "step") for i in range(3)), 45,
                 "training on all 3 peers")
            # What preemption with PreemptMode=REQUEUE does: SIGTERM to the batch script and
            # every step, then the job goes back to the queue.
            cluster.cmd("scontrol", "requeue", job)
            poll(lambda: cluster.job(job).get("JobState") == "PENDING", 30, "requeued job")
            # Slurm holds a requeued job back for a while (Reason=BeginTime); not here.
            cluster.cmd("scontrol", "update", f"JobId={job}", "StartTime=now")
            poll(lambda: all(run.has(i, "checkpoint_loaded") for i in range(3)), 45,
                 "the requeued job's peers")
            poll(lambda: all(steps_since_resume(run, i) >= 2 for i in range(3)), 30,
                 "training after the requeue")
            (run.path / "stop").touch()
            info = cluster.wait_job_done(job, 45)
        except Exception as e:
            raise AssertionError(f"{e}\n{context()}") from e
        log = context()
        assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", log
        assert info["Restarts"] == "1", info
        assert "(start 2)" in log, log

        left = []
        for peer in range(3):
            events = [e for e in run.events(peer) if e["event"] != "step"]
            kinds = [e["event"] for e in events]
            # First job: joined, trained, left cleanly on SIGTERM. Second: loaded, synced.
            assert kinds == ["started", "joined", "synced", "left", "checkpoint_loaded",
                             "started", "joined", "synced", "finished"], events
            assert events[3]["reason"] == "SIGTERM", events
            left.append(events[3]["revision"])
            resumed = events[4]["revision"]
            assert events[7]["revision"] == resumed and events[7]["strategy"] == \
                "ENFORCE_POPULAR", events
        assert resumed == max(left), (left, resumed)
        final = check_results(run, [0, 0, 0])
        assert final["revision"] > resumed
        print(f"requeue test: job done at {time.monotonic() - t0:.1f} s; left at {left}, "
              f"resumed at {resumed}, finished at {final['revision']}")
