"""Train a byte-level language model on the Python standard library with pccl.

One command starts a master, two LinkEmulators per peer (one in front of the peer's p2p
listener, one between the peer and the master: a bandwidth cap and a latency each) and
the peer processes, each training on its own shard of the data (see ``stdlib_lm.py``)::

    python examples/train.py --mode ddp --quant none --peers 3 --steps 240
    python examples/train.py --mode diloco --quant int8 --inner-steps 20
    python examples/train.py --mode async-diloco --quant fp8
    python examples/train.py --churn            # DiLoCo; a peer SIGKILLed, a fresh one joins
    python examples/train.py --all --plot docs  # every mode x quantization, back to back
                                                # -> bench/results/training.json + PNGs
    python examples/train.py --preset slowlink  # 8 peers, 10 MB/s, 50 ms, 4.3 M params:
                                                # DiLoCo fp32/int8 beside SparseLoCo

Modes:

- ``ddp``: data parallel. Every step each peer computes its gradient, the gradients are
  averaged with one ``all_reduce(op=AVG)`` and every peer applies the same AdamW step.
- ``diloco``: ``pccl.diloco.DiLoCo``; AdamW inner steps, an outer step (the pseudo-
  gradients averaged, Nesterov SGD on the global parameters) every ``--inner-steps``.
- ``async-diloco``: the same with ``async_mode=True``: each outer step's reduce runs
  during the next round's inner steps and is applied one outer step late.

``--quant`` quantizes what goes on the wire: ``int8`` = MIN_MAX to UINT8 codes, ``fp8``
= MIN_MAX to FLOAT8_E4M3 (1 byte per element either way, plus a small header per piece).

Every peer reports, as JSON lines on its stdout, its training loss per step, the
validation loss every ``--inner-steps`` steps (on the model all peers then hold), the
bytes it sent (``ReduceInfo.tx_bytes`` / ``OuterStepInfo.tx_bytes``), the time it spent
computing and the time it spent in pccl calls, and a content hash of its parameters
after every outer step (DDP: every ``--inner-steps`` steps). The launcher checks that all
peers report the same hashes at every one of those points, that each peer's model equals
the global parameters, and that a joiner holds the group's exact bytes after its first
sync; any mismatch fails the run (exit status 1). The summary goes to ``--json``.

Bytes: besides pccl's own count, every emulator counts what it forwards (both ways),
read at each validation point and at the end: ``p2p_link_bytes_per_peer``,
``master_link_bytes_per_peer`` (control traffic and the small collectives that pccl
reduces through the master) and their sum ``link_bytes_per_peer``, also per outer step.
The last table gives each run's seconds to a target validation loss (``--target-loss``,
or the worst final loss of the DiLoCo fp32/int8 runs of the invocation).

Clocks: each peer's clock starts once every founding peer is admitted and excludes its
own validation passes, so the wall-clock curves measure training alone.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
MODES = ("ddp", "diloco", "async-diloco")
QUANTS = ("none", "int8", "fp8")
# DiLoCo only: SparseLoCo compression (pccl.sparse) instead of quantization, by name:
# (density, bits, chunk, beta).
SPARSE = {"sparse-1/64-2b": (1 / 64, 2, 64, 0.95), "sparse-2/64-2b": (2 / 64, 2, 64, 0.95),
          "sparse-2/64-4b": (2 / 64, 4, 64, 0.95), "sparse-1/128-2b": (1 / 128, 2, 128, 0.95)}
SIZES = ("tiny", "small", "medium")  # stdlib_lm.SIZES (not imported here: it imports torch)
# --preset: defaults for a family of runs; flags given on the command line win.
PRESETS: dict[str, dict[str, Any]] = {
    # 8 peers on a slow link (10 MB/s and 50 ms each way, to the master too) with the
    # 4.3 M-parameter model and H = 10: DiLoCo fp32 spends about 3/4 of its time in pccl
    # calls on a 2-core machine (H = 20: 3/5). About 16 minutes for the five rows there.
    "slowlink": {"peers": 8, "bandwidth": 10e6, "latency": 0.05, "size": "medium",
                 "inner_steps": 10, "steps": 480, "timeout": 1800.0},
}
# (An all-gather's bytes grow with the group: at 8 peers 1/128 is what keeps SparseLoCo
# 100x below DiLoCo fp32; see docs/training.md.)
SLOWLINK_SPARSE = ("sparse-2/64-2b", "sparse-1/64-2b", "sparse-1/128-2b")


def compression(name: str) -> Any:
    from pccl.sparse import SparseLoCo

    if name not in SPARSE:
        return None
    density, bits, chunk, beta = SPARSE[name]
    return SparseLoCo(density=density, bits=bits, chunk=chunk, beta=beta)


def quantization(name: str) -> Any:
    import pccl

    if name == "none" or name in SPARSE:
        return None
    wire = {"int8": pccl.DataType.UINT8, "fp8": pccl.DataType.FLOAT8_E4M3}[name]
    return pccl.QuantizationOptions(pccl.QuantizationAlgorithm.MIN_MAX, wire)


# --- peer process ------------------------------------------------------------------------


def emit(**obj: Any) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def tensors_hash(tensors: list[Any]) -> str:
    """SHA-256 over the content hashes (pccl's xxh3 tree hash) of the tensors' bytes."""
    import numpy as np

    from pccl import _core

    h = hashlib.sha256()
    for t in tensors:
        if not isinstance(t, np.ndarray):
            t = t.detach().contiguous().reshape(-1).numpy()
        h.update(_core.content_hash(np.ascontiguousarray(t).reshape(-1).view(np.uint8)))
    return h.hexdigest()[:32]


class Worker:
    def __init__(self, a: argparse.Namespace) -> None:
        import stdlib_lm as lm
        import torch

        torch.set_num_threads(1)
        self.a, self.torch, self.lm = a, torch, lm
        corpus = lm.load_corpus()
        self.model = lm.tiny_lm(a.size, a.seed)
        self.ctx = self.model.size.ctx
        self.data = corpus.shard(a.shard, a.shards)
        self.val = lm.val_batches(corpus.val, self.ctx, a.val_windows)
        self.params = [p for _, p in self.model.named_parameters()]
        # With the byte-pair table (millions of parameters for little compute) the
        # default per-tensor AdamW would be most of a step; the fused kernel is about
        # 10x faster on a CPU. The other sizes keep the default (the measured tables).
        fused = {"fused": True} if self.model.size.pairs else {}
        self.opt = torch.optim.AdamW(self.params, lr=a.lr, weight_decay=0.0, **fused)
        # torch imports parts of itself on the first optimizer step (seconds): not while
        # connected, where it would hold up the event loop.
        torch.optim.AdamW([torch.zeros(1, requires_grad=True)], **fused).step()
        self.comm: Any = None
        self.compute_s = 0.0  # forward, backward, optimizer (worker threads)
        self.comm_s = 0.0  # inside pccl calls during training
        self.codec_s = 0.0  # SparseLoCo: encoding and decoding payloads (part of comm_s)
        self.eval_s = 0.0
        self.tx = 0
        self.t0 = 0.0

    def clock(self) -> float:
        return time.perf_counter() - self.t0 - self.eval_s

    def batch(self, step: int) -> Any:
        return self.lm.batch(self.data, self.ctx, self.a.batch, self.a.seed, self.a.shard, step)

    def evaluate(self, step: int) -> None:
        t = time.perf_counter()
        val = self.lm.evaluate(self.model, self.val)
        self.eval_s += time.perf_counter() - t
        emit(ev="eval", step=step, val=val, t=self.clock())

    async def run(self) -> int:
        import pccl

        a = self.a
        self.comm = pccl.Communicator(
            master=a.master, p2p_connection_pool_size=1, p2p_listen_host="127.0.0.1",
            p2p_listen_port=a.p2p_port, p2p_advertise_address=a.advertise,
            peer_timeout=30.0)
        # Imports take seconds, more on a loaded machine: the launcher says "go" once
        # every process is ready (so the founders start together), and to the joiner
        # when it is to join.
        emit(ev="waiting", params=sum(p.numel() for p in self.params), ctx=self.ctx)
        line = await asyncio.to_thread(sys.stdin.readline)
        if line.strip() != "go":
            return 0
        try:
            async with asyncio.timeout(a.connect_timeout):
                await self.comm.connect(n_attempts=30)
                emit(ev="accepted", peer_id=self.comm.peer_id)
                if not a.joiner:
                    await self.admit_founders()
            self.t0 = time.perf_counter()
            emit(ev="train_start", wall=time.time())
            if a.mode == "ddp":
                await self.ddp()
            else:
                await self.diloco()
        finally:
            await self.comm.close()
        emit(ev="done", compute_s=self.compute_s, comm_s=self.comm_s, eval_s=self.eval_s,
             codec_s=self.codec_s, wall_s=self.clock(), tx_bytes=self.tx)
        return 0

    async def admit_founders(self) -> None:
        """Every founding peer runs this until all ``--peers`` are in the run.
        (``are_peers_pending()`` is a collective: every accepted founder asks it here,
        once per round, and all get the same answer, so all vote or none does.)"""
        import pccl

        while self.comm.get_attribute(pccl.Attribute.GLOBAL_WORLD_SIZE) < self.a.peers:
            if await self.comm.are_peers_pending():
                await self.comm.update_topology()
            else:
                await asyncio.sleep(0.05)  # nobody waiting yet: ask again (bounded by caller)

    # -- data parallel --

    async def ddp(self) -> None:
        import numpy as np

        import pccl

        a, torch = self.a, self.torch
        if a.quant in SPARSE:
            raise SystemExit(f"--quant {a.quant} is for the DiLoCo modes")
        q = quantization(a.quant)
        sizes = [p.numel() for p in self.params]
        flat = np.zeros(sum(sizes), dtype=np.float32)
        views = [t.view(p.shape) for t, p in
                 zip(torch.from_numpy(flat).split(sizes), self.params)]

        def forward_backward(step: int) -> float:
            x, y = self.batch(step)
            self.opt.zero_grad()
            loss = self.model.loss(x, y)
            loss.backward()
            for v, p in zip(views, self.params):
                v.copy_(p.grad)
            return float(loss.detach())

        def apply() -> None:
            for v, p in zip(views, self.params):
                p.grad.copy_(v)
            self.opt.step()

        self.report_hash(0, self.params)
        self.evaluate(0)
        for step in range(1, a.steps + 1):
            t = time.perf_counter()
            loss = await asyncio.to_thread(forward_backward, step)
            t1 = time.perf_counter()
            for attempt in range(1, 9):
                try:
                    info = await self.comm.all_reduce(flat, op=pccl.ReduceOp.AVG, tag=1,
                                                      quantization=q)
                    break
                except pccl.PCCLError:  # all-or-nothing: flat is untouched; retry
                    if attempt == 8:
                        raise
                    await self.comm.update_topology()
            t2 = time.perf_counter()
            await asyncio.to_thread(apply)
            self.compute_s += (t1 - t) + (time.perf_counter() - t2)
            self.comm_s += t2 - t1
            self.tx += info.tx_bytes
            emit(ev="step", step=step, loss=loss, t=self.clock(), tx=self.tx,
                 world=info.world_size)
            if step % a.inner_steps == 0 or step == a.steps:
                self.report_hash(step // a.inner_steps, self.params)
                self.evaluate(step)

    def report_hash(self, point: int, params: list[Any]) -> None:
        h = tensors_hash(params)
        emit(ev="outer", outer_step=point, params_hash=h, model_hash=h, momentum_hash="",
             tx=self.tx)

    # -- DiLoCo --

    async def diloco(self) -> None:
        import pccl
        from pccl.diloco import DiLoCo

        a = self.a
        H = a.inner_steps
        outer_steps = a.steps // H
        d = DiLoCo(self.model, self.opt, self.comm, inner_steps=H,
                   async_mode=a.mode == "async-diloco", quantization=quantization(a.quant),
                   compression=compression(a.quant), outer_lr=a.outer_lr,
                   outer_momentum=a.outer_momentum)
        t = time.perf_counter()
        # A joiner takes the group's state or nothing (RECEIVE_ONLY: with nobody to
        # receive from it fails rather than starting a run of its own).
        await d.start(pccl.SharedStateSyncStrategy.RECEIVE_ONLY if a.joiner else None)
        self.comm_s += time.perf_counter() - t
        # The joiner's (or founder's) state right after its first sync.
        emit(ev="joined" if a.joiner else "started", **self.state_hashes(d))
        if not a.joiner:
            self.evaluate(0)

        def inner(step: int) -> float:
            x, y = self.batch(step)
            self.opt.zero_grad()
            loss = self.model.loss(x, y)
            loss.backward()
            self.opt.step()
            return float(loss.detach())

        local = 0
        try:
            while d.outer_step < outer_steps:
                step = d.outer_step * H + local + 1
                t = time.perf_counter()
                loss = await asyncio.to_thread(inner, step)
                t1 = time.perf_counter()
                self.compute_s += t1 - t
                emit(ev="step", step=step, loss=loss, t=self.clock(), tx=self.tx)
                local += 1
                if local == H:
                    emit(ev="outer_begin", outer_step=d.outer_step + 1)
                info = await d.step()
                self.comm_s += time.perf_counter() - t1
                if info is not None:
                    local = 0
                    self.tx += info.tx_bytes
                    emit(ev="outer", **self.state_hashes(d), applied=info.applied,
                         world=info.world_size, contributors=info.contributors,
                         retries=info.retries, tx=self.tx, sync_rx=info.sync_rx_bytes,
                         t=self.clock())
                    self.evaluate(d.outer_step * H)
            if d.async_mode:
                t = time.perf_counter()
                info = await d.flush()
                self.comm_s += time.perf_counter() - t
                if info is not None:
                    self.tx += info.tx_bytes
                    emit(ev="outer", **self.state_hashes(d), flush=True, applied=info.applied,
                         world=info.world_size, contributors=info.contributors,
                         retries=info.retries, tx=self.tx, sync_rx=info.sync_rx_bytes,
                         t=self.clock())
                    self.evaluate(d.outer_step * H)
        finally:
            self.codec_s = d.codec_seconds
            await d.close()

    def state_hashes(self, d: Any) -> dict[str, Any]:
        g = d.global_parameters
        return {"outer_step": d.outer_step,
                "params_hash": tensors_hash([g[n] for n in sorted(g)]),
                "momentum_hash": tensors_hash([m for _, m in sorted(d.momentum_buffers.items())]),
                "model_hash": tensors_hash(
                    [p for _, p in sorted(self.model.named_parameters(), key=lambda kv: kv[0])])}


def worker_main(a: argparse.Namespace) -> int:
    sys.path.insert(0, str(HERE))
    return asyncio.run(Worker(a).run())


# --- launcher ------------------------------------------------------------------------------


class Run:
    """One configuration: a master, the peers behind their emulators, their reports.

    Each peer has two emulated links with the same caps: one in front of its p2p
    listener (everything other peers send it: ring links, shared-state fetches) and one
    between it and the master (its control traffic, and the small collectives pccl
    reduces through the master). Each emulator counts the bytes it forwards, both ways.
    """

    def __init__(self, a: argparse.Namespace, mode: str, quant: str, churn: bool,
                 outer_momentum: float, outer_lr: float | None = None) -> None:
        self.a, self.mode, self.quant, self.churn = a, mode, quant, churn
        self.outer_momentum = outer_momentum
        self.outer_lr = a.outer_lr if outer_lr is None else outer_lr
        self.master: asyncio.subprocess.Process | None = None
        self.master_addr = ""
        self.peers: dict[str, dict[str, Any]] = {}
        self.events: list[dict[str, Any]] = []
        self.emus: list[Any] = []
        self.errors: list[str] = []
        self.killed: str | None = None
        self.kill_info: dict[str, Any] | None = None
        self.join_spawned: dict[str, Any] | None = None
        self.tasks: list[asyncio.Task[None]] = []
        self.started = time.monotonic()
        self.params = self.ctx = 0

    async def start_master(self) -> None:
        self.master = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "pccl", "master", "--listen", "127.0.0.1:0",
            "--heartbeat-timeout", "15", "--log-level", "WARNING", "--status", "off",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL)
        assert self.master.stdout is not None
        async with asyncio.timeout(60):
            line = (await self.master.stdout.readline()).decode()
        if "listening on" not in line:
            raise RuntimeError(f"the master did not start: {line!r}")
        self.master_addr = line.split()[-1]

    async def spawn(self, name: str, shard: int, joiner: bool) -> None:
        from pccl.testing import LinkEmulator, free_port

        a = self.a
        port = free_port()
        emu = LinkEmulator(f"127.0.0.1:{port}", latency=a.latency, bandwidth=a.bandwidth)
        master_emu = LinkEmulator(self.master_addr, latency=a.latency,
                                  bandwidth=a.bandwidth)
        for e in (emu, master_emu):
            await e.start()
            self.emus.append(e)
        args = [sys.executable, str(HERE / "train.py"), "--worker",
                "--master", master_emu.address, "--p2p-port", str(port),
                "--advertise", emu.address, "--mode", self.mode, "--quant", self.quant,
                "--peers", str(a.peers), "--shard", str(shard), "--shards", str(a.peers),
                "--steps", str(a.steps), "--inner-steps", str(a.inner_steps),
                "--size", a.size, "--batch", str(a.batch), "--lr", str(a.lr),
                "--seed", str(a.seed), "--val-windows", str(a.val_windows),
                "--outer-lr", str(self.outer_lr), "--outer-momentum", str(self.outer_momentum),
                "--connect-timeout", str(a.timeout)]
        if joiner:
            args.append("--joiner")
        proc = await asyncio.create_subprocess_exec(
            *args, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, limit=1 << 20)
        peer = {"name": name, "proc": proc, "emu": emu, "master_emu": master_emu,
                "shard": shard, "joiner": joiner, "done": None, "stderr": b""}
        self.peers[name] = peer
        self.tasks.append(asyncio.create_task(self.read(peer)))

    async def read(self, peer: dict[str, Any]) -> None:
        proc = peer["proc"]
        assert proc.stdout is not None and proc.stderr is not None

        async def drain_stderr() -> None:
            peer["stderr"] = await proc.stderr.read()

        err = asyncio.create_task(drain_stderr())
        while line := await proc.stdout.readline():
            try:
                ev = json.loads(line)
            except ValueError:
                continue
            ev["peer"] = peer["name"]
            ev["at"] = time.monotonic() - self.started
            self.events.append(ev)
            await self.on_event(peer, ev)
        await err
        if not peer.get("waiting"):
            # It died before it was ready: the others would wait for "go" forever.
            self.errors.append(f"{peer['name']} ended before it was ready")
            for p in self.peers.values():
                if p is not peer:
                    await self.go(p, b"stop")

    def link_bytes(self) -> float:
        """Bytes forwarded so far by all the emulators, per peer of the run."""
        return sum(e.bytes_forwarded for e in self.emus) / self.a.peers

    async def on_event(self, peer: dict[str, Any], ev: dict[str, Any]) -> None:
        a = self.a
        if ev["ev"] == "done":
            peer["done"] = ev
        if ev["ev"] == "eval":
            # Read as the line arrives: after an outer step nothing else moves until the
            # next one (sync mode), so this is the traffic of the steps so far.
            ev["link_bytes"] = self.link_bytes()
        if ev["ev"] == "waiting":
            self.params, self.ctx = ev["params"], ev["ctx"]
            peer["waiting"] = True
            if all(p.get("waiting") for p in self.peers.values()):
                for p in self.peers.values():
                    if not p["joiner"]:
                        await self.go(p)
        if not self.churn:
            return
        victim = f"peer{a.peers - 1}"
        if (ev["ev"] == "outer_begin" and peer["name"] == victim and self.killed is None
                and ev["outer_step"] >= a.kill_at):
            # SIGKILL in the middle of the outer step: its reduce is starting.
            peer["proc"].send_signal(signal.SIGKILL)
            self.killed = victim
            self.kill_info = {"peer": victim, "during_outer_step": ev["outer_step"],
                              "step": ev["outer_step"] * a.inner_steps}
        if (ev["ev"] == "outer" and self.join_spawned is None and self.killed is not None
                and ev["outer_step"] >= a.join_after and not peer["joiner"]):
            self.join_spawned = {"after_outer_step": ev["outer_step"]}
            await self.go(self.peers["joiner"])

    async def run(self) -> dict[str, Any]:
        a = self.a
        await self.start_master()
        try:
            for i in range(a.peers):
                await self.spawn(f"peer{i}", i, joiner=False)
            if self.churn:  # it takes over the shard of the peer that will be killed
                await self.spawn("joiner", a.peers - 1, joiner=True)
            async with asyncio.timeout(a.timeout):
                founders = [p["proc"] for p in self.peers.values() if not p["joiner"]]
                await asyncio.gather(*(p.wait() for p in founders))
            if self.churn:
                await self.finish_joiner()
            await asyncio.gather(*self.tasks)
        except TimeoutError:
            self.errors.append(f"the run did not finish within {a.timeout}s")
        finally:
            await self.shutdown()
        return self.summary()

    async def go(self, peer: dict[str, Any], word: bytes = b"go") -> None:
        with contextlib.suppress(ConnectionError):  # it died meanwhile: seen at exit
            peer["proc"].stdin.write(word + b"\n")
            await peer["proc"].stdin.drain()

    async def finish_joiner(self) -> None:
        """The founders are done: the joiner ends too (it leaves with them, or it was
        never told to join, or it never got in: then it is stopped)."""
        proc = self.peers["joiner"]["proc"]
        if self.join_spawned is None:
            await self.go(self.peers["joiner"], b"stop")
        try:
            async with asyncio.timeout(60):
                await proc.wait()
        except TimeoutError:
            self.errors.append("the joiner did not end within 60 s of the founders")
            proc.kill()
            await proc.wait()

    async def shutdown(self) -> None:
        from pccl.testing import stop_process

        for p in self.peers.values():
            if p["proc"].returncode is None:
                p["proc"].kill()
                await p["proc"].wait()
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for p in self.peers.values():
            p["p2p_link_bytes"] = p["emu"].bytes_forwarded
            p["master_link_bytes"] = p["master_emu"].bytes_forwarded
        for emu in self.emus:
            await emu.stop()
        if self.master is not None:
            await stop_process(self.master)

    # -- checks and figures --

    def check_parity(self) -> dict[str, Any]:
        """Every peer's hashes agree at every outer step; each model equals the global
        parameters; a joiner's first sync gave it the group's exact state."""
        points: dict[tuple[int, bool], dict[str, tuple[str, str]]] = {}
        problems = []
        for ev in self.events:
            if ev["ev"] in ("outer", "started"):
                key = (ev["outer_step"], bool(ev.get("flush")))
                points.setdefault(key, {})[ev["peer"]] = (ev["params_hash"],
                                                          ev["momentum_hash"])
                if ev["model_hash"] != ev["params_hash"]:
                    problems.append(f"{ev['peer']}: its model differs from the global "
                                    f"parameters after outer step {ev['outer_step']}")
        compared = 0
        for (step, flush), by_peer in sorted(points.items()):
            if len(set(by_peer.values())) > 1:
                problems.append(f"outer step {step}{' (flush)' if flush else ''}: hashes "
                                f"differ: {by_peer}")
            compared += len(by_peer) >= 2
        joined = [ev for ev in self.events if ev["ev"] == "joined"]
        joiner = None
        for ev in joined:
            group = points.get((ev["outer_step"], False), {})
            others = {k: v for k, v in group.items() if k != ev["peer"]}
            mine = (ev["params_hash"], ev["momentum_hash"])
            same = bool(others) and all(v == mine for v in others.values())
            joiner = {"peer": ev["peer"], "outer_step": ev["outer_step"],
                      "bit_identical": same, "compared_with": sorted(others)}
            if ev["model_hash"] != ev["params_hash"]:
                problems.append(f"{ev['peer']}: its model differs from the global "
                                "parameters after its first sync")
            if not same:
                problems.append(f"{ev['peer']}: after its first sync (outer step "
                                f"{ev['outer_step']}) it does not hold the group's state "
                                f"{others} != {mine}")
        if compared == 0:
            problems.append("no point where two peers' hashes could be compared")
        return {"points_compared": compared, "ok": not problems, "problems": problems,
                "joiner": joiner}

    def summary(self) -> dict[str, Any]:
        a = self.a
        for p in self.peers.values():
            rc = p["proc"].returncode
            if p["name"] != self.killed and rc != 0:
                tail = p["stderr"].decode(errors="replace")[-3000:]
                self.errors.append(f"{p['name']} exited with {rc}: {tail}")
        parity = self.check_parity()
        founders = [p for p in self.peers.values()
                    if p["name"] != self.killed and not p["joiner"]]
        done = [p["done"] for p in founders if p["done"]]
        # Training loss per step: the mean over the peers that reported that step.
        per_step: dict[int, list[float]] = {}
        times: dict[int, list[float]] = {}
        for ev in self.events:
            if ev["ev"] == "step":
                per_step.setdefault(ev["step"], []).append(ev["loss"])
                times.setdefault(ev["step"], []).append(ev["t"])
        train = [[s, sum(v) / len(v), max(times[s])] for s, v in sorted(per_step.items())]
        val: dict[int, dict[str, Any]] = {}
        for ev in self.events:
            if ev["ev"] == "eval" and ev["peer"] == "peer0":
                val[ev["step"]] = {"step": ev["step"], "val": ev["val"], "t": ev["t"],
                                   "link_bytes": ev["link_bytes"]}
        wall = max((d["wall_s"] for d in done), default=0.0)

        def per_founder(key: str) -> float | None:
            return (sum(p.get(key, 0) for p in founders) / len(founders) if founders
                    else None)

        p2p, master = per_founder("p2p_link_bytes"), per_founder("master_link_bytes")
        link = p2p + master if p2p is not None and master is not None else None
        outer_steps = a.steps // a.inner_steps
        out: dict[str, Any] = {
            "mode": self.mode, "quant": self.quant, "churn": self.churn,
            "outer_lr": self.outer_lr if self.mode != "ddp" else None,
            "outer_momentum": self.outer_momentum if self.mode != "ddp" else None,
            "peers": a.peers, "steps": a.steps, "inner_steps": a.inner_steps,
            "size": a.size, "params": self.params, "batch": a.batch, "ctx": self.ctx,
            "tokens_per_peer": a.steps * a.batch * self.ctx,
            "bandwidth": a.bandwidth, "latency": a.latency,
            "wall_s": round(wall, 2),
            "final_val": list(val.values())[-1]["val"] if val else None,
            "tx_bytes_per_peer": (sum(d["tx_bytes"] for d in done) / len(done)
                                  if done else None),
            # Counted by the emulators, both directions, mean over the founders that
            # lived to the end; "outer step": --inner-steps steps (DDP too).
            "p2p_link_bytes_per_peer": p2p, "master_link_bytes_per_peer": master,
            "link_bytes_per_peer": link, "outer_step_count": outer_steps,
            "link_bytes_per_outer_step": link / outer_steps if link is not None else None,
            "time_to_target_s": None,
            "comm_fraction": (sum(d["comm_s"] / d["wall_s"] for d in done) / len(done)
                              if done else None),
            "compute_s_per_peer": (sum(d["compute_s"] for d in done) / len(done)
                                   if done else None),
            # SparseLoCo's codec (compress + decode) against the inner steps' compute.
            "codec_s_per_peer": (sum(d.get("codec_s", 0.0) for d in done) / len(done)
                                 if done else None),
            "codec_fraction_of_compute": (
                sum(d.get("codec_s", 0.0) / d["compute_s"] for d in done if d["compute_s"])
                / len(done) if done else None),
            "parity": parity, "errors": self.errors,
            "val_curve": list(val.values()), "train_curve": train,
            "tx_curve": [[ev["step"], ev["tx"], ev["t"]] for ev in self.events
                         if ev["ev"] == "step" and ev["peer"] == "peer0"],
        }
        if self.churn:
            out["kill"] = self.kill_info
            out["join"] = parity["joiner"]
            out["join_spawned"] = self.join_spawned
            j = self.peers["joiner"]
            out["joiner_link_bytes"] = {"p2p": j.get("p2p_link_bytes"),
                                        "master": j.get("master_link_bytes")}
            out["outer_steps"] = [
                {k: ev.get(k) for k in ("peer", "outer_step", "flush", "world", "contributors",
                                         "retries", "applied", "sync_rx", "params_hash")}
                for ev in self.events if ev["ev"] == "outer"]
        if self.churn and self.killed is None:
            self.errors.append("the victim was never killed (too few outer steps?)")
        if self.churn and parity["joiner"] is None:
            self.errors.append("the joiner never completed its first sync")
        out["ok"] = not self.errors and parity["ok"]
        return out


def run_name(r: dict[str, Any]) -> str:
    name = f"churn {r['mode']}" if r["churn"] else f"{r['mode']}/{r['quant']}"
    if r["outer_momentum"] is not None and r["outer_momentum"] != 0.9:
        name += f" mu={r['outer_momentum']:g}"
    if r["outer_lr"] is not None and r["outer_lr"] != 0.7:
        name += f" lr={r['outer_lr']:g}"
    return name


def describe(r: dict[str, Any]) -> str:
    name = run_name(r)
    fv = f"{r['final_val']:.3f}" if r["final_val"] is not None else "-"
    tx = f"{r['tx_bytes_per_peer'] / 1e6:.1f} MB" if r["tx_bytes_per_peer"] is not None else "-"
    cf = f"{100 * r['comm_fraction']:.0f}%" if r["comm_fraction"] is not None else "-"
    par = r["parity"]
    return (f"{name:<20} val {fv}  wall {r['wall_s']:.1f}s  tx/peer {tx}  comm {cf}  "
            f"parity {'ok' if par['ok'] else 'FAILED'} ({par['points_compared']} points)"
            f"{'' if r['ok'] else '  FAILED'}")


def target_loss(a: argparse.Namespace, results: list[dict[str, Any]]) -> float | None:
    """``--target-loss``, or else the worst final validation loss of this invocation's
    DiLoCo runs without compression (sync mode, no churn): a loss all of them reached."""
    if a.target_loss is not None:
        return float(a.target_loss)
    finals = [r["final_val"] for r in results
              if r["mode"] == "diloco" and r["quant"] in QUANTS and not r["churn"]
              and r["final_val"] is not None]
    return max(finals) if finals else None


def time_to_target(r: dict[str, Any], target: float | None) -> float | None:
    """Training seconds (peer0's clock) at the first validation point at or below
    ``target``; None if it never got there."""
    if target is None:
        return None
    return next((p["t"] for p in r["val_curve"] if p["val"] <= target), None)


def reference(results: list[dict[str, Any]], quant: str) -> dict[str, Any] | None:
    """The first sync DiLoCo run with this quantization (the rows the others compare to)."""
    return next((r for r in results if r["mode"] == "diloco" and r["quant"] == quant
                 and not r["churn"] and r["link_bytes_per_peer"]), None)


def fewer(ref: dict[str, Any] | None, per: float | None) -> str:
    """How many times fewer link bytes per outer step than the reference run."""
    if ref is None or not per:
        return "-"
    return f"{ref['link_bytes_per_outer_step'] / per:.1f}x"


def summary_table(results: list[dict[str, Any]], target: float | None) -> str:
    fp32, int8 = reference(results, "none"), reference(results, "int8")
    head = (f"{'run':<32} {'final val':>9} {'to target':>9} {'wall s':>7} "
            f"{'link B/outer step':>17} {'vs fp32':>8} {'vs int8':>8} {'comm':>5} "
            f"{'codec':>6}")
    lines = [f"target validation loss: {target:.4f}" if target is not None
             else "target validation loss: none (no DiLoCo fp32/int8 run, no --target-loss)",
             head, "-" * len(head)]
    for r in results:
        fv = f"{r['final_val']:.4f}" if r["final_val"] is not None else "-"
        tt = f"{r['time_to_target_s']:.1f}" if r["time_to_target_s"] is not None else "never"
        per = r["link_bytes_per_outer_step"]
        cf = f"{100 * r['comm_fraction']:.0f}%" if r["comm_fraction"] is not None else "-"
        codec = r.get("codec_fraction_of_compute")
        cc = f"{100 * codec:.2f}%" if codec else "-"
        lines.append(f"{run_name(r):<32} {fv:>9} {tt:>9} {r['wall_s']:>7.1f} "
                     f"{per if per is not None else 0:>17,.0f} {fewer(fp32, per):>8} "
                     f"{fewer(int8, per):>8} {cf:>5} {cc:>6}")
    return "\n".join(lines)


async def launch(a: argparse.Namespace) -> list[dict[str, Any]]:
    if a.preset == "slowlink" and not (a.all or a.sparse):
        # DiLoCo fp32 and int8 beside the three SparseLoCo settings at their best outer
        # lr (3; the --sparse rows), all without outer momentum as in --sparse.
        configs = [("diloco", q, False, 0.0) for q in ("none", "int8")]
        configs += [("diloco", q, False, 0.0, 3.0) for q in SLOWLINK_SPARSE]
    elif a.all:
        # The DiLoCo runs with DiLoCo's usual outer optimizer (Nesterov, momentum 0.9),
        # then both DiLoCo modes again without outer momentum (see docs/training.md).
        configs = [(m, q, False, a.outer_momentum) for m in MODES for q in QUANTS]
        configs += [("diloco", "none", False, 0.0)]
        configs += [("async-diloco", q, False, 0.0) for q in QUANTS]
    elif a.sparse:
        # SparseLoCo beside DiLoCo fp32 and int8, all without outer momentum (SparseLoCo
        # runs its outer step without it: the error feedback does that job). The sparse
        # rows also run at outer lr 3 (a sparse update carries less per step; 3 was the
        # best of 0.7-4 here, docs/training.md).
        configs = [("diloco", q, False, 0.0) for q in ("none", "int8", *SPARSE)]
        configs += [("diloco", q, False, 0.0, 3.0) for q in SPARSE]
    else:
        configs = [(a.mode, a.quant, a.churn, a.outer_momentum)]
    results = []
    for mode, quant, churn, outer_momentum, *lr in configs:
        t = time.monotonic()
        r = await Run(a, mode, quant, churn, outer_momentum, *lr).run()
        r["launcher_s"] = round(time.monotonic() - t, 1)
        results.append(r)
        print(describe(r), flush=True)
        for e in r["errors"] + r["parity"]["problems"]:
            print(f"  !! {e}", flush=True)
    target = target_loss(a, results)
    for r in results:
        r["target_loss"] = target
        r["time_to_target_s"] = time_to_target(r, target)
    print(summary_table(results, target), flush=True)
    return results


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mode", choices=MODES, default="diloco")
    p.add_argument("--quant", choices=(*QUANTS, *SPARSE), default="none",
                   help="wire quantization, or (DiLoCo) SparseLoCo compression")
    p.add_argument("--sparse", action="store_true",
                   help="SparseLoCo rows beside DiLoCo fp32 and int8, back to back")
    p.add_argument("--all", action="store_true",
                   help="every mode x quantization, back to back")
    p.add_argument("--churn", action="store_true",
                   help="SIGKILL the last peer at outer step --kill-at; a fresh peer joins "
                        "after outer step --join-after (DiLoCo modes)")
    p.add_argument("--peers", type=int, default=3)
    p.add_argument("--steps", type=int, default=240, help="inner steps per peer")
    p.add_argument("--inner-steps", type=int, default=20,
                   help="H: inner steps per outer step (DDP: steps between checks)")
    p.add_argument("--size", default="small", choices=SIZES,
                   help="model size (stdlib_lm.SIZES)")
    p.add_argument("--batch", type=int, default=16, help="sequences per step per peer")
    p.add_argument("--lr", type=float, default=2e-3, help="AdamW learning rate")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--outer-lr", type=float, default=0.7, help="DiLoCo's outer learning rate")
    p.add_argument("--outer-momentum", type=float, default=0.9,
                   help="DiLoCo's outer Nesterov momentum (0: plain outer SGD)")
    p.add_argument("--val-windows", type=int, default=128)
    p.add_argument("--bandwidth", type=float, default=20e6,
                   help="bytes/s into each peer (its LinkEmulator's cap)")
    p.add_argument("--latency", type=float, default=0.03, help="one-way seconds")
    p.add_argument("--kill-at", type=int, default=3, help="churn: outer step of the kill")
    p.add_argument("--join-after", type=int, default=5,
                   help="churn: start the joiner once this outer step is done")
    p.add_argument("--timeout", type=float, default=600.0, help="bound on one run (s)")
    p.add_argument("--preset", choices=sorted(PRESETS),
                   help="slowlink: 8 peers, 10 MB/s, 50 ms, --size medium, 480 steps, "
                        "--inner-steps 10; runs "
                        "DiLoCo fp32 and int8 and SparseLoCo 2/64-4b, 2/64-2b, 1/64-2b at "
                        "outer lr 3 (flags given explicitly override its values)")
    p.add_argument("--target-loss", type=float, default=None,
                   help="report each run's seconds to this validation loss (default: the "
                        "worst final loss of the DiLoCo fp32/int8 runs of this invocation)")
    p.add_argument("--json", default="", help="write the results here")
    p.add_argument("--plot", default="", help="draw PNGs into this folder (matplotlib)")
    # worker mode
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--joiner", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--master", default="", help=argparse.SUPPRESS)
    p.add_argument("--p2p-port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--advertise", default="", help=argparse.SUPPRESS)
    p.add_argument("--shard", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--shards", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--connect-timeout", type=float, default=120.0, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.preset:
        p.set_defaults(**PRESETS[a.preset])
        a = p.parse_args(argv)
    if a.worker:
        sys.exit(worker_main(a))
    if a.churn and a.mode == "ddp":
        p.error("--churn runs DiLoCo (--mode diloco or async-diloco)")
    if a.steps % a.inner_steps:
        p.error("--steps must be a multiple of --inner-steps")
    if a.churn and a.steps // a.inner_steps <= a.join_after:
        p.error("--churn needs more outer steps than --join-after")
    if a.all and not a.json:
        a.json = str(HERE.parent / "bench" / "results" / "training.json")
    if a.churn and a.plot and not a.json:
        a.json = str(HERE.parent / "bench" / "results" / "training-churn.json")
    results = asyncio.run(launch(a))
    doc = {"command": "python examples/train.py " + " ".join(sys.argv[1:] if argv is None
                                                              else argv),
           "date": time.strftime("%Y-%m-%d"), "cpus": os.cpu_count(),
           "load_avg_at_end": os.getloadavg(), "runs": results}
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(doc, indent=1) + "\n")
    if a.plot:
        sys.path.insert(0, str(HERE))
        from plot_training import plot

        for path in plot(doc, Path(a.plot), f"training-{a.preset}" if a.preset else "training"):
            print(f"wrote {path}")
    ok = all(r["ok"] for r in results)
    print("training examples: " + ("PASS" if ok else "FAIL"), flush=True)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
