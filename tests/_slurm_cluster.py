"""A throwaway single-node Slurm for tests: munged, slurmctld and slurmd on this machine.

Everything lives in one temporary directory (configuration, munge key and socket, state,
spool, logs) and every daemon runs in the foreground as a child of the test process, so
nothing outside that directory is touched and :meth:`SlurmCluster.stop` can account for
every process it started::

    reason = skip_reason()
    if reason: pytest.skip(reason)
    with SlurmCluster() as cluster:      # ~2 s on 2 cores
        job = cluster.sbatch(["script.sbatch"])
        cluster.wait_job_done(job, timeout=60)

Choices, for this machine (Debian 12's slurm-wlm 22.05, possibly inside a sandbox where
cgroups cannot be managed):

- ``ProctrackType=proctrack/linuxproc`` and ``TaskPlugin=task/none``: Slurm tracks job
  processes through ``/proc`` and never touches cgroups, so no ``cgroup.conf`` is needed.
- ``SlurmdParameters=config_overrides`` with ``CPUs=8``: the node advertises more CPUs than
  it has, so a job of 4 one-CPU tasks (a pccl master and 3 peers) fits on 2 cores.
- ``CR_CPU_Memory``: memory is a scheduled resource as on real clusters, so what works here
  (steps with ``--mem-per-cpu``) works there.
- Ports are picked free at start, and the munge socket is private, so a test cluster
  never talks to a system Slurm or munge.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import TypeVar

T = TypeVar("T")

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "squeue", "scancel", "scontrol", "sinfo")


def skip_reason() -> str | None:
    """Why a test cluster cannot run here, or None when it can."""
    if os.geteuid() != 0:
        return ("a test Slurm needs root (slurmd runs jobs as their user and munged "
                "guards its key); run the test as root")
    for tool in DAEMONS:
        if _find(tool) is None:
            return (f"{tool} is not installed (Debian: apt-get install slurm-wlm munge); "
                    "no Slurm to test against")
    for tool in CLIENTS:
        if shutil.which(tool) is None:
            return f"the Slurm client {tool} is not installed (Debian: slurm-client)"
    return None


def _find(tool: str) -> str | None:
    return shutil.which(tool) or next(
        (str(p) for d in ("/usr/sbin", "/sbin", "/usr/local/sbin")
         if (p := Path(d) / tool).is_file()), None)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def poll(condition: Callable[[], T], timeout: float, what: str, interval: float = 0.2) -> T:
    """Calls ``condition()`` until it returns something truthy (returned) or ``timeout``
    seconds pass (TimeoutError naming ``what``)."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} within {timeout:.0f}s")
        time.sleep(interval)


class SlurmCluster:
    """munged + slurmctld + slurmd for one node (this host), in a temporary directory."""

    def __init__(self, cpus: int = 8, memory_mb: int = 4096, keep_on_failure: bool = False
                 ) -> None:
        self.cpus, self.memory_mb = cpus, memory_mb
        self.keep_on_failure = keep_on_failure
        self.root = Path(tempfile.mkdtemp(prefix="pccl-slurm-"))
        # munged insists the socket's directory is reachable by everyone.
        self.root.chmod(0o711)
        self.conf = self.root / "slurm.conf"
        self.node = socket.gethostname()
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.startup_seconds: float | None = None
        self.env = {**{k: v for k, v in os.environ.items() if not k.startswith("SLURM_")},
                    "SLURM_CONF": str(self.conf)}

    # --- start -------------------------------------------------------------------------

    def _write_config(self) -> None:
        r = self.root
        for d in ("state", "spool", "logs"):
            (r / d).mkdir(mode=0o755)
        key = r / "munge.key"
        key.write_bytes(os.urandom(128))
        key.chmod(0o400)
        ctld_port, slurmd_port = _free_port(), _free_port()
        self.conf.write_text(f"""\
# Written by tests/_slurm_cluster.py: a single-node test cluster; see its docstring.
ClusterName=pccltest
SlurmctldHost={self.node}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={r}/munge.socket
CredType=cred/munge
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool
SlurmctldPidFile={r}/slurmctld.pid
SlurmdPidFile={r}/slurmd.pid
SlurmctldLogFile={r}/logs/slurmctld.log
SlurmdLogFile={r}/logs/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU_Memory
SlurmdParameters=config_overrides
SchedulerType=sched/builtin
MpiDefault=none
ReturnToService=2
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
# How long Slurm waits between SIGTERM and SIGKILL when it ends a job or step.
KillWait=10
# Finished jobs stay visible to `scontrol show job` (no accounting database here).
MinJobAge=600
NodeName={self.node} NodeAddr=127.0.0.1 CPUs={self.cpus} RealMemory={self.memory_mb} State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
""")

    def _spawn(self, name: str, argv: list[str]) -> None:
        log = (self.root / "logs" / f"{name}.out").open("wb")
        try:
            self.procs[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                                stdin=subprocess.DEVNULL, env=self.env)
        finally:
            log.close()

    def start(self, timeout: float = 60.0) -> float:
        """Starts the daemons; returns the seconds until the node was idle."""
        t0 = time.monotonic()
        self._write_config()
        r = self.root
        munged = _find("munged")
        assert munged is not None
        # --force: munged refuses root and a world-writable /tmp otherwise; -F: foreground.
        self._spawn("munged", [munged, "-F", "--force", f"--socket={r}/munge.socket",
                               f"--key-file={r}/munge.key", f"--pid-file={r}/munged.pid",
                               f"--seed-file={r}/munged.seed", f"--log-file={r}/munged.log"])
        poll(lambda: (r / "munge.socket").exists() or self._died(), 20, "munge socket")
        self._check_alive()
        ctld, slurmd = _find("slurmctld"), _find("slurmd")
        assert ctld is not None and slurmd is not None
        # -D: foreground; -i: ignore state files (a fresh directory has none anyway).
        self._spawn("slurmctld", [ctld, "-D", "-i", "-f", str(self.conf)])
        self._spawn("slurmd", [slurmd, "-D", "-f", str(self.conf), "-N", self.node])
        poll(lambda: self._died() or self.node_state() == "idle", timeout, "idle Slurm node")
        self._check_alive()
        self.startup_seconds = time.monotonic() - t0
        return self.startup_seconds

    def _died(self) -> bool:
        return any(p.poll() is not None for p in self.procs.values())

    def _check_alive(self) -> None:
        for name, p in self.procs.items():
            if p.poll() is not None:
                raise RuntimeError(f"{name} exited with {p.returncode}:\n{self.logs(name)}")

    # --- clients -------------------------------------------------------------------------

    def cmd(self, *argv: str, check: bool = True, timeout: float = 30.0
            ) -> subprocess.CompletedProcess[str]:
        """Runs a Slurm client against this cluster."""
        res = subprocess.run(list(argv), env=self.env, capture_output=True, text=True,
                             timeout=timeout, stdin=subprocess.DEVNULL)
        if check and res.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} failed ({res.returncode}): "
                               f"{res.stderr.strip()}")
        return res

    def node_state(self) -> str:
        res = self.cmd("sinfo", "-h", "-n", self.node, "-o", "%t", check=False, timeout=10)
        return res.stdout.strip() if res.returncode == 0 else ""

    def sbatch(self, argv: list[str], env: dict[str, str] | None = None,
               cwd: str | Path | None = None) -> str:
        """Submits a batch job; returns its id."""
        res = subprocess.run(["sbatch", "--parsable", *argv], env={**self.env, **(env or {})},
                             capture_output=True, text=True, timeout=30, cwd=cwd,
                             stdin=subprocess.DEVNULL)
        if res.returncode != 0:
            raise RuntimeError(f"sbatch failed ({res.returncode}): {res.stderr.strip()}")
        return res.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job`` as a dict (JobState, ExitCode, ...); empty if unknown."""
        res = self.cmd("scontrol", "-o", "show", "job", job_id, check=False)
        fields: dict[str, str] = {}
        for item in res.stdout.split():
            key, sep, value = item.partition("=")
            if sep:
                fields.setdefault(key, value)
        return fields

    def steps(self, job_id: str) -> dict[str, str]:
        """The job's running steps: step id ("12.3") -> step name."""
        res = self.cmd("squeue", "-h", "-s", "-j", job_id, "-o", "%i|%j", check=False)
        return dict(line.split("|", 1) for line in res.stdout.splitlines() if "|" in line)

    def wait_job_done(self, job_id: str, timeout: float) -> dict[str, str]:
        """Waits until the job left the queue (any end state); returns its record."""
        ended = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
                 "BOOT_FAIL", "DEADLINE", "PREEMPTED")

        def done() -> dict[str, str] | None:
            info = self.job(job_id)
            return info if info.get("JobState") in ended else None

        result = poll(done, timeout, f"end of job {job_id}", interval=0.5)
        assert result is not None
        return result

    def logs(self, name: str) -> str:
        """The last lines a daemon wrote (for failure messages)."""
        out = []
        for path in (self.root / "logs" / f"{name}.out", self.root / "logs" / f"{name}.log"):
            if path.exists():
                out += path.read_text(errors="replace").splitlines()[-40:]
        return "\n".join(out)

    # --- stop ----------------------------------------------------------------------------

    def _strays(self) -> list[int]:
        """Processes started through this cluster (slurmstepd, job scripts and steps):
        they carry our SLURM_CONF in their environment."""
        mark = f"SLURM_CONF={self.conf}".encode()
        ours = {os.getpid(), *(p.pid for p in self.procs.values())}
        found = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) in ours:
                continue
            with contextlib.suppress(OSError):
                if mark in Path(f"/proc/{entry}/environ").read_bytes().split(b"\0"):
                    found.append(int(entry))
        return found

    def stop(self, failed: bool = False) -> None:
        """Cancels every job, stops the daemons, removes the directory (kept when
        ``failed`` and ``keep_on_failure``). Leaves no process behind."""
        if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
            res = self.cmd("squeue", "-h", "-o", "%A", check=False, timeout=10)
            jobs = res.stdout.split()
            if jobs:
                self.cmd("scancel", *jobs, check=False, timeout=10)
                with contextlib.suppress(TimeoutError):
                    poll(lambda: not self.cmd("squeue", "-h", "-o", "%A", check=False,
                                              timeout=10).stdout.split(), 30, "empty queue")
        for name in reversed(DAEMONS):
            p = self.procs.get(name)
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(timeout=15)
        # Whatever slurmstepd left (they detach from slurmd), by pid.
        for _ in range(3):
            strays = self._strays()
            if not strays:
                break
            for pid in strays:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(TimeoutError):
                poll(lambda: not self._strays(), 10, "stray job processes to exit")
        if failed and self.keep_on_failure:
            print(f"slurm test cluster kept in {self.root}")
        else:
            shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> SlurmCluster:
        try:
            self.start()
        except BaseException:
            self.stop(failed=True)
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop(failed=exc is not None)

