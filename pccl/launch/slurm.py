"""pccl on Slurm: the master and one job step per peer, failed peers started again.

Usage, as the last line of a batch script (``examples/slurm/train.sbatch``)::

    #SBATCH --ntasks=4 --cpus-per-task=1 --mem-per-cpu=1G --requeue
    exec python -m pccl.launch.slurm -- python train.py --steps 1000

How a run is laid out:

- **The launcher** runs in the batch script (``exec`` it, so that the signals Slurm sends
  the batch shell reach it). Slurm runs the batch script on the first node of the
  allocation, and that is where the master is: the launcher runs a
  :class:`pccl.MasterNode` itself, on ``0.0.0.0:PORT``.
- **Every peer** is a job step of its own: ``srun --nodes=1 --ntasks=1 --exact
  --cpus-per-task=C PROGRAM ...``, ``--peers`` of them (default ``SLURM_NTASKS - 1``: the
  allocation's first task slot is the master's, one slot per peer). Slurm places each
  step where the allocation has room; ``--per-node`` runs one peer on each node instead
  (``srun --relative=i``; the master shares the first node with peer 0), the usual
  layout for GPU nodes.
- **A peer step that ends unsuccessfully** (its process crashed or was killed, the step
  was ``scancel``-ed, its node failed) is started again as a new step after a backoff
  (``--backoff`` seconds, doubled each time up to ``--max-backoff``), at most
  ``--max-restarts`` times per peer. The new process is a joiner: it waits in
  ``connect()`` until the running peers admit it with ``update_topology()`` and takes
  the running state with its first ``sync_shared_state()``. A step that ends with status
  0 is done; when every peer is done (or has used up its restarts) the master stops
  once its peers have left and the launcher exits: 0 when every peer finished, 1 when
  one gave up.

Why one step per peer rather than one ``srun`` of N tasks: a failure stays one peer's
(``srun`` of many tasks ends as a whole when Slurm ends it, and ``scancel`` of such a step
takes every peer with it); each peer shows up in ``squeue --steps`` and ``sacct`` as
itself, and can be cancelled alone (``scancel JOBID.STEPID``) to make room, test
recovery, or drain a bad node.

What each peer's program gets in its environment, besides the batch script's:
``PCCL_MASTER`` (``host:port`` of the master, for ``pccl.Communicator.from_env()``),
``PCCL_SECRET_FILE`` when ``--secret-file`` is given, ``PCCL_SLURM_PEER`` (the peer's
index, ``0 .. peers-1``, the same across restarts), ``PCCL_SLURM_PEERS`` (the number of
peers), ``PCCL_SLURM_RESTART`` (0 for the first process of that index, then 1, 2, ...:
above 0 the process replaces a failed one and joins a running run).

Signals: SIGTERM or SIGINT to the launcher (the job cancelled, preempted or requeued, or
``#SBATCH --signal=B:TERM@SECONDS`` before the time limit) ends the restarts and sends
SIGTERM to every peer step (``scancel --signal=TERM JOBID``: every step of the job, not
the batch script); the peers get ``--grace`` seconds to leave the run cleanly, then their
steps are cancelled; the master stops once they are gone, and the launcher exits with 128
plus the signal's number. SIGUSR1 and SIGUSR2 are passed on to the peer steps the same
way. (``srun`` itself does not pass SIGTERM on: it kills its step instead.)

The master: port ``--port``, default ``20000 + SLURM_JOB_ID % 10000`` (20000-29999,
below Linux's ephemeral ports; two jobs on one node collide only if their ids are a
multiple of 10000 apart); the peers dial ``--host``, default the address Slurm has for
the node the launcher runs on (its ``NodeAddr``). Everything else comes from the
master's environment variables (``PCCL_HEARTBEAT_TIMEOUT``, ``PCCL_STATUS_LISTEN``,
``PCCL_STATUS_TOKEN_FILE``, ...: :mod:`pccl.config`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from pccl.errors import InvalidArgumentError
from pccl.master.server import MasterNode

__all__ = ["PORT_BASE", "PORT_SPAN", "Plan", "Supervised", "derive_port", "first_host",
           "main", "plan"]

log = logging.getLogger("pccl.launch.slurm")

PORT_BASE = 20000  #: derived master ports are PORT_BASE .. PORT_BASE + PORT_SPAN - 1
PORT_SPAN = 10000


class UsageError(Exception):
    """A mistake in how the launcher was started: one line on stderr, status 2."""


# --- the allocation ------------------------------------------------------------------


def derive_port(job_id: int) -> int:
    """The master port of job ``job_id`` when ``--port`` is not given."""
    return PORT_BASE + job_id % PORT_SPAN


def first_host(nodelist: str) -> str:
    """The first node name of a Slurm hostlist expression, as ``scontrol show hostnames``
    lists it first: ``"gpu[03-05,9],cpu1"`` -> ``"gpu03"``."""
    text = nodelist.strip()
    depth = 0
    for i, ch in enumerate(text):  # the first entry ends at the first comma outside []
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            text = text[:i]
            break
    match = re.fullmatch(r"([^\[\]]*)\[([^\]]+)\](.*)", text)
    if match is None:
        if not text or "[" in text or "]" in text:
            raise ValueError(f"cannot read the node list {nodelist!r}")
        return text
    prefix, ranges, rest = match.groups()
    start = ranges.split(",")[0].split("-")[0]
    return prefix + start + (first_host(rest) if rest else "")


def node_address(node: str) -> str:
    """The address Slurm reaches ``node`` at (its ``NodeAddr``); ``node`` itself when
    ``scontrol`` is missing or does not say."""
    if shutil.which("scontrol") is None:
        return node
    try:
        res = subprocess.run(["scontrol", "-o", "show", "node", node], capture_output=True,
                             text=True, timeout=30, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return node
    match = re.search(r"\bNodeAddr=(\S+)", res.stdout)
    return match[1] if res.returncode == 0 and match and match[1] != "(null)" else node


def _max_tasks_per_node(spec: str) -> int:
    """The largest count of ``SLURM_TASKS_PER_NODE`` (``"2(x3),1"`` -> 2)."""
    counts = [int(m) for m in re.findall(r"(\d+)(?:\(x\d+\))?", spec)]
    return max(counts, default=1) or 1


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def describe(status: int) -> str:
    """An exit status in words (srun reports a task killed by signal N as 128 + N)."""
    if status < 0:
        return f"killed by {_signal_name(-status)}"
    if 128 < status < 128 + 65:
        return f"status {status} (killed by {_signal_name(status - 128)}?)"
    return f"status {status}"


# --- what to run ---------------------------------------------------------------------


@dataclass
class Plan:
    """What the launcher runs (``--dry-run`` prints it)."""

    job_id: str
    master_host: str
    port: int
    peer_argv: list[list[str]]  #: one srun command per peer index
    env: dict[str, str] = field(default_factory=dict)  #: added for master and peers

    @property
    def master_address(self) -> str:
        return f"{self.master_host}:{self.port}"

    def peer_env(self, index: int, restart: int) -> dict[str, str]:
        """The variables peer ``index`` gets on its ``restart``-th restart."""
        return {**self.env, "PCCL_MASTER": self.master_address,
                "PCCL_SLURM_PEER": str(index), "PCCL_SLURM_PEERS": str(len(self.peer_argv)),
                "PCCL_SLURM_RESTART": str(restart)}


def plan(args: argparse.Namespace, environ: Mapping[str, str]) -> Plan:
    """The master's address and each peer's ``srun`` command for this job."""
    job = environ.get("SLURM_JOB_ID", "")
    if not job.isdigit():
        raise UsageError("SLURM_JOB_ID is not set: run this in a Slurm batch script (or "
                         "under salloc)")
    if environ.get("SLURM_STEP_ID"):
        raise UsageError("this runs in a job step (under srun): run it from the batch "
                         "script itself; it starts one step per peer")
    host = args.host or node_address(environ.get("SLURMD_NODENAME") or socket.gethostname())
    port = args.port if args.port is not None else derive_port(int(job))
    nodes = int(environ.get("SLURM_JOB_NUM_NODES") or environ.get("SLURM_NNODES") or 1)
    peers = args.peers
    if peers is None and args.per_node:
        peers = nodes
    if peers is None:
        ntasks = environ.get("SLURM_NTASKS", "")
        if not ntasks.isdigit() or int(ntasks) < 2:
            raise UsageError(f"cannot tell how many peers to run: SLURM_NTASKS is "
                             f"{ntasks or 'unset'} (the launcher wants peers + 1 tasks: one "
                             f"slot for the master); give --peers")
        peers = int(ntasks) - 1
    cpus = args.cpus_per_peer or int(environ.get("SLURM_CPUS_PER_TASK") or 1)
    opts = ["--nodes=1", "--ntasks=1", f"--cpus-per-task={cpus}", "--exact"]
    extra = list(args.srun_arg)
    # A job given --mem (per node) hands a step all of it unless the step asks for less,
    # and the next step waits for memory: share it between the task slots of a node.
    mem_node = environ.get("SLURM_MEM_PER_NODE", "")
    if (mem_node.isdigit() and not environ.get("SLURM_MEM_PER_CPU")
            and not any(a.startswith("--mem") for a in extra)):
        share = int(mem_node) // _max_tasks_per_node(environ.get("SLURM_TASKS_PER_NODE", "1"))
        if share > 0:
            opts.append(f"--mem={share}M")

    def place(i: int) -> list[str]:  # --per-node: peer i on the allocation's node i
        return [f"--relative={i % nodes}"] if args.per_node else []

    argv = [["srun", f"--job-name=pccl-peer{i}", *opts, *place(i), *extra, *args.program]
            for i in range(peers)]
    env = {"PCCL_SECRET_FILE": os.path.abspath(args.secret_file)} if args.secret_file else {}
    return Plan(job, host, port, argv, env)


# --- supervision ---------------------------------------------------------------------


class Supervised:
    """One command run again after each failure until it succeeds, its restarts run out
    or the run stops. ``argv(restart)`` and ``env(restart)`` give each attempt's command
    and the variables added to the launcher's environment."""

    def __init__(self, name: str, argv: Callable[[int], list[str]],
                 env: Callable[[int], dict[str, str]], *, max_restarts: int, backoff: float,
                 max_backoff: float) -> None:
        self.name, self.argv, self.env = name, argv, env
        self.max_restarts, self.backoff, self.max_backoff = max_restarts, backoff, max_backoff
        self.proc: asyncio.subprocess.Process | None = None
        self.restarts = 0

    def send(self, sig: int) -> None:
        """Sends ``sig`` to the running process (srun), if any."""
        if self.proc is not None and self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(sig)

    async def _once(self) -> int:
        argv = self.argv(self.restarts)
        log.info("%s: starting%s: %s", self.name,
                 f" again (restart {self.restarts} of {self.max_restarts})" if self.restarts
                 else "", shlex.join(argv))
        try:
            self.proc = await asyncio.create_subprocess_exec(
                *argv, env={**os.environ, **self.env(self.restarts)},
                stdin=asyncio.subprocess.DEVNULL)
        except OSError as e:
            log.error("%s: cannot start %s: %s", self.name, argv[0], e.strerror or e)
            return 127
        return await self.proc.wait()

    async def run(self, stop: asyncio.Event) -> int:
        """Runs the command, again after failures; returns the last exit status."""
        status = 0
        for attempt in range(self.max_restarts + 1):
            self.restarts = attempt
            status = await self._once()
            if status == 0:
                log.info("%s: finished", self.name)
                return 0
            if stop.is_set():
                log.info("%s: ended with %s; the run is stopping", self.name, describe(status))
                return status
            if attempt == self.max_restarts:
                break
            delay = min(self.backoff * 2 ** attempt, self.max_backoff)
            log.warning("%s: ended with %s; starting it again in %.1f s, as a joiner",
                        self.name, describe(status), delay)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), delay)
            if stop.is_set():
                return status
        log.error("%s: ended with %s after all %d restarts; giving up on it", self.name,
                  describe(status), self.max_restarts)
        return status


async def signal_steps(job_id: str, sig: int) -> None:
    """Sends ``sig`` to every step of the job, not to the batch script (that is us)."""
    argv = ["scancel", f"--signal={_signal_name(sig).removeprefix('SIG')}", job_id]
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE)
    except OSError as e:
        log.warning("%s: %s", shlex.join(argv), e.strerror or e)
        return
    try:
        async with asyncio.timeout(30):
            _, err = await proc.communicate()
    except TimeoutError:
        log.warning("%s: no answer in 30 s", shlex.join(argv))
        proc.kill()
        await proc.wait()
        return
    if proc.returncode != 0:
        text = err.decode(errors="replace").strip()
        # "Invalid job id": the job is being ended already, its steps signalled by Slurm.
        log.log(logging.INFO if "Invalid job id" in text else logging.WARNING, "%s: %s",
                shlex.join(argv), text)


async def stop_master(master: MasterNode, grace: float) -> None:
    """Stops ``master`` once its peers have left (waiting at most ``grace`` seconds)."""
    if master.state.peers:
        log.info("master: stopping once its %d peer(s) have left (at most %.0f s)",
                 len(master.state.peers), grace)
        with contextlib.suppress(TimeoutError):
            await master.wait_for(lambda s: not s.peers, timeout=grace)
    await master.stop()


async def run(args: argparse.Namespace, p: Plan) -> int:
    """Runs the master here and the peer steps under supervision; the exit status."""
    overrides: dict[str, object] = {"listen": f"0.0.0.0:{p.port}"}
    if args.status:
        overrides["status_listen"] = None if args.status == "off" else args.status
    master = MasterNode.from_env({**os.environ, **p.env}, **overrides)
    await master.start()
    log.info("master listening on %s; peers dial %s; starting %d peer step(s)",
             master.address, p.master_address, len(p.peer_argv))

    stop = asyncio.Event()
    received: list[int] = []
    loop = asyncio.get_running_loop()
    signalling: set[asyncio.Task[None]] = set()

    def forward(sig: int) -> None:
        task = asyncio.create_task(signal_steps(p.job_id, sig))
        signalling.add(task)
        task.add_done_callback(signalling.discard)

    def on_stop(sig: int) -> None:
        if not received:
            log.warning("received %s: no more restarts; asking the peers to leave",
                        _signal_name(sig))
        received.append(sig)
        stop.set()
        forward(signal.SIGTERM)

    def peer(i: int) -> Supervised:
        return Supervised(f"peer {i}", lambda r: p.peer_argv[i], lambda r: p.peer_env(i, r),
                          max_restarts=args.max_restarts, backoff=args.backoff,
                          max_backoff=args.max_backoff)

    peers = [peer(i) for i in range(len(p.peer_argv))]
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_stop, sig)
    for sig in (signal.SIGUSR1, signal.SIGUSR2):
        loop.add_signal_handler(sig, forward, sig)
    tasks = [asyncio.create_task(s.run(stop)) for s in peers]
    try:
        stopped = asyncio.create_task(stop.wait())
        all_done = asyncio.create_task(asyncio.wait(tasks))
        await asyncio.wait([stopped, all_done], return_when=asyncio.FIRST_COMPLETED)
        stopped.cancel()
        all_done.cancel()
        if stop.is_set():
            await _wait_or_cancel(peers, tasks, args.grace)
        if received:
            return 128 + received[0]
        failed = [i for i, t in enumerate(tasks) if t.result() != 0]
        if failed:
            log.error("peer(s) %s gave up", ", ".join(map(str, failed)))
        return 1 if failed else 0
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2):
            loop.remove_signal_handler(sig)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, *signalling, return_exceptions=True)
        await stop_master(master, args.grace)
        log.info("master stopped")


async def _wait_or_cancel(peers: Sequence[Supervised], tasks: Sequence[asyncio.Task[int]],
                          grace: float) -> None:
    """Waits up to ``grace`` seconds for the peers to end; then ends their steps (SIGTERM
    to srun cancels its step), and SIGKILLs an srun that does not go."""
    pending = {t for t in tasks if not t.done()}
    for sig, wait in ((None, grace), (signal.SIGTERM, 30.0), (signal.SIGKILL, 30.0)):
        if sig is not None:
            log.warning("%d peer step(s) still running; sending srun %s", len(pending),
                        _signal_name(sig))
            for s in peers:
                s.send(sig)
        if pending:
            _, pending = await asyncio.wait(pending, timeout=wait)
        if not pending:
            return


# --- command line --------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m pccl.launch.slurm",
        usage="python -m pccl.launch.slurm [options] -- PROGRAM [ARGS...]",
        description="From a Slurm batch script: run a pccl master here and PROGRAM as one "
                    "job step per peer; a peer step that fails is started again and joins "
                    "the running run. See docs/operations.md (Slurm).")
    p.add_argument("--peers", type=int, default=None, metavar="N",
                   help="peer steps to run (default: SLURM_NTASKS - 1; with --per-node: "
                        "the number of nodes)")
    p.add_argument("--per-node", action="store_true",
                   help="one peer per node of the allocation, peer i on node i (srun "
                        "--relative); the master shares the first node with peer 0")
    p.add_argument("--host", default=None,
                   help="host the peers dial for the master (default: this node's address "
                        "as Slurm knows it)")
    p.add_argument("--port", type=int, default=None,
                   help=f"master port (default: {PORT_BASE} + SLURM_JOB_ID %% {PORT_SPAN})")
    p.add_argument("--secret-file", default=None, metavar="FILE",
                   help="shared secret for the master and every peer (exported as "
                        "PCCL_SECRET_FILE; default: $PCCL_SECRET_FILE if set, else none)")
    p.add_argument("--status", default=None, metavar="HOST:PORT",
                   help="the master's status page, or 'off' (default: $PCCL_STATUS_LISTEN, "
                        "else off)")
    p.add_argument("--max-restarts", type=int, default=10, metavar="N",
                   help="times each peer is started again after a failure (%(default)s)")
    p.add_argument("--backoff", type=float, default=1.0, metavar="S",
                   help="seconds before a peer's first restart, doubled for each further "
                        "one (%(default)s)")
    p.add_argument("--max-backoff", type=float, default=30.0, metavar="S",
                   help="longest wait before a restart (%(default)s)")
    p.add_argument("--grace", type=float, default=20.0, metavar="S",
                   help="after SIGTERM: seconds the peers get to leave before their steps "
                        "are cancelled; keep it below Slurm's KillWait (%(default)s)")
    p.add_argument("--cpus-per-peer", type=int, default=None, metavar="N",
                   help="CPUs of each peer step (default: SLURM_CPUS_PER_TASK, else 1)")
    p.add_argument("--srun-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for every peer's srun, e.g. "
                        "--srun-arg=--gpus-per-task=1 (repeatable)")
    p.add_argument("--master-log-level", default="WARNING", type=str.upper,
                   choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                   help="the master's own log (INFO: every join, leave and sync; "
                        "%(default)s)")
    p.add_argument("--log-level", default="INFO", type=str.upper,
                   choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                   help="the launcher's log (%(default)s)")
    p.add_argument("--dry-run", action="store_true",
                   help="print the master's address and the peers' commands, and exit")
    p.add_argument("program", nargs=argparse.REMAINDER,
                   help="the peer program and its arguments, after --")
    return p


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    """The command line; returns the exit status."""
    env = os.environ if environ is None else environ
    p = _parser()
    args = p.parse_args(argv)
    if args.program and args.program[0] == "--":
        args.program = args.program[1:]
    if not args.program:
        p.error("no program given: python -m pccl.launch.slurm [options] -- PROGRAM ...")
    if args.peers is not None and args.peers < 1:
        p.error("--peers must be at least 1")
    if args.max_restarts < 0:
        p.error("--max-restarts must be >= 0")
    for name in ("backoff", "max_backoff", "grace"):
        if not getattr(args, name) >= 0:
            p.error(f"--{name.replace('_', '-')} must be >= 0")
    if args.secret_file is None and env.get("PCCL_SECRET_FILE"):
        args.secret_file = env["PCCL_SECRET_FILE"]
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("pccl.master").setLevel(args.master_log_level)
    try:
        the_plan = plan(args, env)
        if args.dry_run:
            print(f"master: {the_plan.master_address}")
            for i, cmd in enumerate(the_plan.peer_argv):
                added = " ".join(f"{k}={v}" for k, v in the_plan.peer_env(i, 0).items())
                print(f"peer {i}: {added} {shlex.join(cmd)}")
            return 0
        if shutil.which("srun") is None:
            raise UsageError("srun is not on PATH")
        return asyncio.run(run(args, the_plan))
    except (UsageError, InvalidArgumentError) as e:
        print(f"{p.prog}: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # the master's port is taken, ...
        print(f"{p.prog}: error: {e.strerror or e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
