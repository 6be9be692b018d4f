"""pccl.diloco on a tiny MLP over 3 in-process peers: outer updates equal a reference
computed by hand (the pseudo-gradient average in the ring's order, then Nesterov SGD, all
float32: compared bit for bit), parity after every outer step, a peer crashing in the
middle of an outer step, joiners (at an outer step and during a retried reduce), async
mode's delayed update and its overlap with inner compute, bfloat16, numpy, quantization."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import numpy as np
import pytest
from reference import ring_reference

import pccl
from pccl import _core
from pccl.diloco import DiLoCo, OuterStepFailedError
from pccl.testing import LinkEmulator, crash

torch = pytest.importorskip("torch")
nn = torch.nn

# torch imports much of itself lazily (the first optimizer pulls in torch._dynamo, ~3 s):
# pay for it here, not inside a test, where it would stall the event loop past the
# master's heartbeat timeout.
torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1).step()

H = 3  # inner steps per outer step
LR, MU = 0.7, 0.9
IN, HIDDEN, OUT = 5, 7, 3


def make_model(seed: int, dtype=torch.float32, device: str = "cpu") -> nn.Module:
    gen = torch.Generator().manual_seed(seed)
    model = nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, OUT))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    return model.to(dtype=dtype, device=device)


def batch(peer: int, step: int, dtype=torch.float32, device: str = "cpu"):
    gen = torch.Generator().manual_seed(10_000 * peer + step)
    x, y = torch.randn(8, IN, generator=gen), torch.randn(8, OUT, generator=gen)
    return x.to(dtype=dtype, device=device), y.to(dtype=dtype, device=device)


def flat(model: nn.Module) -> np.ndarray:
    return torch.cat([p.detach().reshape(-1).float().cpu() for p in model.parameters()]).numpy()


def global_flat(d: DiLoCo) -> np.ndarray:
    return np.concatenate([v.reshape(-1) for v in d.global_parameters.values()]).copy()


def momentum_flat(d: DiLoCo) -> np.ndarray:
    return np.concatenate([v.reshape(-1) for v in d.momentum_buffers.values()]).copy()


def param_hashes(model: nn.Module) -> list[bytes]:
    return [_core.content_hash(p.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
                               .numpy()) for p in model.parameters()]


def state_hashes(d: DiLoCo) -> list[bytes]:
    return [_core.content_hash(np.ascontiguousarray(i.tensor).reshape(-1).view(np.uint8))
            for i in d.shared_state.infos]


class Peer:
    def __init__(self, comm: pccl.Communicator, idx: int, seed: int = 1,
                 dtype=torch.float32, device: str = "cpu", **kw) -> None:
        self.comm, self.idx, self.dtype, self.device = comm, idx, dtype, device
        self.model = make_model(seed, dtype, device)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.05)
        self.d = DiLoCo(self.model, self.opt, comm, inner_steps=H, **kw)
        self.steps = 0

    def loss_fn(self):
        x, y = batch(self.idx, self.steps, self.dtype, self.device)
        self.steps += 1
        return lambda: nn.functional.mse_loss(self.model(x), y)

    def local_step(self) -> None:
        """One inner step run by the caller itself (the step() API)."""
        self.opt.zero_grad()
        self.loss_fn()().backward()
        self.opt.step()

    async def round(self, threaded: int = 0):
        """H inner steps (the first ``threaded`` through inner_step()); returns the local
        parameters just before the outer step and the step's info."""
        for i in range(H - 1):
            if i < threaded:
                assert isinstance(await self.d.inner_step(self.loss_fn()), float)
            else:
                self.local_step()
                assert await self.d.step() is None
        self.local_step()
        before = flat(self.model)
        info = await self.d.step()
        assert info is not None
        return before, info


def ring_order(peers: list[Peer], values: list) -> list:
    ranks = [p.comm.ring.index(p.comm.peer_id) for p in peers]
    return [v for _, v in sorted(zip(ranks, values), key=lambda t: t[0])]


def nesterov(theta, m, g):
    """The documented outer update, float32, in the documented order."""
    m = m * np.float32(MU) + g
    d = g + m * np.float32(MU)
    return theta - d * np.float32(LR), m


def reference_step(theta, m, peers, locals_, *, zeros: int = 0, scale=None):
    """One outer step by hand: pseudo-gradients, their AVG in the ring's order (plus
    ``zeros`` non-contributors, who come last in ``peers``), optional rescale, Nesterov."""
    pgs = [theta - x for x in locals_] + [np.zeros_like(theta)] * zeros
    g = ring_reference(ring_order(peers, pgs), pccl.ReduceOp.AVG, "float32")
    if scale is not None:
        g = g * np.float32(scale)
    return nesterov(theta, m, g)


def assert_parity(peers: list[Peer]) -> None:
    ref = peers[0]
    for p in peers[1:]:
        assert param_hashes(p.model) == param_hashes(ref.model)
        assert state_hashes(p.d) == state_hashes(ref.d)
        assert p.d.shared_state.revision == ref.d.shared_state.revision
        assert p.d.outer_step == ref.d.outer_step


async def start_all(peers: list[Peer]) -> None:
    await asyncio.gather(*(p.d.start() for p in peers))


async def cluster_with_slow_peer(pccl_cluster, emu: LinkEmulator, master_kwargs=None,
                                 **peer_kw):
    """Two peers plus a third whose incoming ring link runs through ``emu``. These tests
    stall that link mid-reduce: the (small) model's reduce must take the ring, not the
    master (which reduces tensors of up to 64 KiB itself by default)."""
    cluster = await pccl_cluster(2, comm_kwargs={"via_master_max_bytes": 0},
                                 master_kwargs=master_kwargs)
    await cluster.admit_behind(emu)
    peers = [Peer(c, i, **peer_kw) for i, c in enumerate(cluster.comms)]
    return cluster, peers


# --- synchronous DiLoCo ---------------------------------------------------------------


async def test_outer_steps_match_the_reference_and_stay_bit_identical(pccl_cluster) -> None:
    cluster = await pccl_cluster(3)
    # Different initial weights: the founders agree on the earliest joiner's.
    peers = [Peer(c, i, seed=i + 1) for i, c in enumerate(cluster.comms)]
    await start_all(peers)
    first = min(peers, key=lambda p: p.comm.peer_id)
    theta = flat(make_model(first.idx + 1))
    assert all(np.array_equal(flat(p.model), theta) for p in peers)
    assert_parity(peers)
    m = np.zeros_like(theta)
    for step in range(1, 4):
        results = await asyncio.gather(*(p.round(threaded=1) for p in peers))
        locals_ = [r[0] for r in results]
        # The same step in float64 (no ring order, no roundings) stays within 2e-6: a few
        # float32 roundings (2^-24 relative) of values below 4 in magnitude.
        g64 = np.mean([theta.astype(np.float64) - x for x in locals_], axis=0)
        m64 = MU * m.astype(np.float64) + g64
        theta64 = theta - LR * (g64 + MU * m64)
        theta, m = reference_step(theta, m, peers, locals_)
        assert np.max(np.abs(theta - theta64)) < 2e-6 and np.max(np.abs(theta)) < 4
        for p, (_, info) in zip(peers, results):
            assert info.outer_step == step and info.applied and info.retries == 0
            assert info.world_size == info.contributors == 3
            assert global_flat(p.d).tobytes() == theta.tobytes()
            assert momentum_flat(p.d).tobytes() == m.tobytes()
            assert flat(p.model).tobytes() == theta.tobytes()
        assert_parity(peers)
    assert peers[0].d.shared_state.revision == 3


async def test_step_before_start_and_mismatched_configuration_are_refused(pccl_cluster) -> None:
    cluster = await pccl_cluster(2)
    a = Peer(cluster.comms[0], 0)
    with pytest.raises(pccl.InvalidUsageError, match="start"):
        await a.d.step()
    b = Peer(cluster.comms[1], 1)
    b.d = DiLoCo(b.model, b.opt, b.comm, inner_steps=H + 1)  # a different H
    first = min((a, b), key=lambda p: p.comm.peer_id)
    other = b if first is a else a
    res = await asyncio.gather(a.d.start(), b.d.start(), return_exceptions=True)
    odd = res[[a, b].index(other)]
    assert isinstance(odd, pccl.InvalidUsageError) and "inner_steps" in str(odd)
    with pytest.raises(pccl.InvalidArgumentError):
        DiLoCo(a.model, a.opt, a.comm, inner_steps=0)


async def test_a_communicator_with_its_own_synced_state_is_refused(pccl_cluster) -> None:
    cluster = await pccl_cluster(2)
    other = [pccl.SharedState([pccl.TensorInfo.from_numpy(np.zeros(3), "x")]) for _ in range(2)]
    await asyncio.gather(*(c.sync_shared_state(s) for c, s in zip(cluster.comms, other)))
    peers = [Peer(c, i) for i, c in enumerate(cluster.comms)]
    res = await asyncio.gather(*(p.d.start() for p in peers), return_exceptions=True)
    assert all(isinstance(r, pccl.InvalidUsageError) and "fresh Communicator" in str(r)
               for r in res), res


async def test_peer_crashing_mid_outer_step(pccl_cluster) -> None:
    async with LinkEmulator() as emu:
        cluster, peers = await cluster_with_slow_peer(pccl_cluster, emu)
        await start_all(peers)
        theta, m = flat(peers[0].model), np.zeros(flat(peers[0].model).size, np.float32)
        results = await asyncio.gather(*(p.round() for p in peers))
        theta, m = reference_step(theta, m, peers, [r[0] for r in results])
        # Round 2: the victim's incoming link stalls, so the reduce cannot finish; the
        # victim dies while it runs.
        victim, survivors = peers[2], peers[:2]
        revision = survivors[0].d.shared_state.revision
        emu.blackhole()
        tasks = [asyncio.create_task(p.round()) for p in peers]
        await cluster.master.wait_for(
            lambda s: any(c.op_id >= 0 for c in s.collectives.values()), timeout=30)
        await crash(victim.comm)
        emu.blackhole(False)
        res = await asyncio.gather(*tasks, return_exceptions=True)
        assert isinstance(res[2], pccl.MasterConnectionError)
        theta, m = reference_step(theta, m, survivors, [r[0] for r in res[:2]])
        for p, (_, info) in zip(survivors, res[:2]):
            # The recovery policy: a lost peer is retried at once on the ring the master
            # rebuilt, with no vote and no re-sync (the outer step's one sync only).
            assert info.retries == 1 and info.world_size == info.contributors == 2
            assert p.d.shared_state.revision == revision + 1
            assert flat(p.model).tobytes() == theta.tobytes()
            assert momentum_flat(p.d).tobytes() == m.tobytes()
        assert_parity(survivors)
        # And training goes on with two.
        results = await asyncio.gather(*(p.round() for p in survivors))
        theta, m = reference_step(theta, m, survivors, [r[0] for r in results])
        assert all(flat(p.model).tobytes() == theta.tobytes() for p in survivors)


async def test_retries_are_bounded(pccl_cluster) -> None:
    async with LinkEmulator() as emu:
        cluster, peers = await cluster_with_slow_peer(pccl_cluster, emu, max_retries=0)
        await start_all(peers)
        emu.blackhole()
        tasks = [asyncio.create_task(p.round()) for p in peers]
        await cluster.master.wait_for(
            lambda s: any(c.op_id >= 0 for c in s.collectives.values()), timeout=30)
        await crash(peers[2].comm)
        emu.blackhole(False)
        res = await asyncio.gather(*tasks, return_exceptions=True)
        for r in res[:2]:
            assert isinstance(r, OuterStepFailedError), r
            assert "max_retries=0" in str(r) and isinstance(r.__cause__, pccl.PCCLError)


async def test_joiner_at_an_outer_step_receives_the_state(pccl_cluster) -> None:
    cluster = await pccl_cluster(3)
    peers = [Peer(c, i) for i, c in enumerate(cluster.comms)]
    await start_all(peers)
    theta, m = flat(peers[0].model), np.zeros(flat(peers[0].model).size, np.float32)
    results = await asyncio.gather(*(p.round() for p in peers))
    theta, m = reference_step(theta, m, peers, [r[0] for r in results])

    comm = cluster.new_comm()
    joining = asyncio.create_task(comm.connect())
    await cluster.master.wait_for(lambda s: len(s.pending()) == 1, timeout=30)

    async def join() -> Peer:
        await joining
        peer = Peer(comm, 3, seed=99)  # its own (different) initial weights
        assert not np.array_equal(flat(peer.model), theta)
        info = await peer.d.start()
        assert info.rx_bytes > 0 and info.tx_bytes == 0  # it fetched the run's state
        return peer

    *results, joiner = await asyncio.gather(*(p.round() for p in peers), join())
    theta, m = reference_step(theta, m, peers, [r[0] for r in results])
    assert joiner.d.outer_step == 2 and joiner.d.inner_step_count == 0
    assert flat(joiner.model).tobytes() == theta.tobytes()
    assert momentum_flat(joiner.d).tobytes() == m.tobytes()
    peers.append(joiner)
    assert_parity(peers)
    # The joiner trains the next round like everyone: a world of four.
    results = await asyncio.gather(*(p.round() for p in peers))
    theta, m = reference_step(theta, m, peers, [r[0] for r in results])
    for p, (_, info) in zip(peers, results):
        assert info.world_size == info.contributors == 4
        assert flat(p.model).tobytes() == theta.tobytes()
    assert_parity(peers)


async def test_joiner_admitted_during_a_retry_contributes_nothing(pccl_cluster) -> None:
    """A peer dies mid-reduce while a joiner waits, and the master does not repair rings:
    the retry at once fails on the broken ring, so the policy votes; that
    update_topology() admits the joiner, which joins the retried reduce with weight 0;
    the update is the mean over the two peers that trained (the AVG over three, times
    3/2)."""
    async with LinkEmulator() as emu:
        cluster, peers = await cluster_with_slow_peer(
            pccl_cluster, emu, master_kwargs={"repair_rings": False})
        await start_all(peers)
        theta, m = flat(peers[0].model), np.zeros(flat(peers[0].model).size, np.float32)
        comm = cluster.new_comm()
        joining = asyncio.create_task(comm.connect())
        await cluster.master.wait_for(lambda s: len(s.pending()) == 1, timeout=30)
        emu.blackhole()
        tasks = [asyncio.create_task(p.round()) for p in peers]
        await cluster.master.wait_for(
            lambda s: any(c.op_id >= 0 for c in s.collectives.values()), timeout=30)
        await crash(peers[2].comm)
        emu.blackhole(False)
        await joining
        joiner = Peer(comm, 3, seed=7)
        await joiner.d.start()  # joins the retried reduce and finishes the outer step
        survivors = peers[:2]
        res = await asyncio.gather(*tasks, return_exceptions=True)
        assert isinstance(res[2], pccl.MasterConnectionError)
        group = [*survivors, joiner]
        theta, m = reference_step(theta, m, group, [r[0] for r in res[:2]], zeros=1,
                                  scale=3 / 2)
        for _, info in res[:2]:
            assert info.world_size == 3 and info.contributors == 2 and info.retries >= 2
        assert joiner.d.last_info is not None and joiner.d.last_info.contributors == 2
        for p in group:
            assert flat(p.model).tobytes() == theta.tobytes()
            assert momentum_flat(p.d).tobytes() == m.tobytes()
        assert_parity(group)
        results = await asyncio.gather(*(p.round() for p in group))
        theta, m = reference_step(theta, m, group, [r[0] for r in results])
        assert all(flat(p.model).tobytes() == theta.tobytes() for p in group)
        assert all(info.contributors == 3 for _, info in results)


# --- async DiLoCo ---------------------------------------------------------------------


async def test_async_mode_applies_each_update_one_step_late(pccl_cluster) -> None:
    cluster = await pccl_cluster(3)
    peers = [Peer(c, i, async_mode=True) for i, c in enumerate(cluster.comms)]
    await start_all(peers)
    theta = flat(peers[0].model)
    m = np.zeros_like(theta)
    in_flight: list[np.ndarray] | None = None  # pseudo-gradients of the reduce in flight
    for step in range(1, 5):
        results = await asyncio.gather(*(p.round(threaded=1) for p in peers))
        # This round started from theta: its pseudo-gradients are measured from there...
        pgs = [theta - r[0] for r in results]
        # ...and the update applied now is the previous round's.
        if in_flight is not None:
            g = ring_reference(ring_order(peers, in_flight), pccl.ReduceOp.AVG, "float32")
            theta, m = nesterov(theta, m, g)
        in_flight = pgs
        for p, (_, info) in zip(peers, results):
            assert info.outer_step == step and info.applied == (step > 1)
            assert flat(p.model).tobytes() == theta.tobytes()
            assert momentum_flat(p.d).tobytes() == m.tobytes()
        assert_parity(peers)
    infos = await asyncio.gather(*(p.d.flush() for p in peers))
    g = ring_reference(ring_order(peers, in_flight), pccl.ReduceOp.AVG, "float32")
    theta, m = nesterov(theta, m, g)
    assert all(i is not None and i.applied for i in infos)
    for p in peers:
        assert flat(p.model).tobytes() == theta.tobytes()
        assert not p.d.reduce_in_flight
    assert_parity(peers)
    await asyncio.gather(*(p.d.close() for p in peers))


async def test_async_inner_steps_progress_while_the_reduce_is_in_flight(pccl_cluster) -> None:
    """The reduce of outer step 1 is held on a stalled link: every peer still completes
    the inner steps of the next round (run in worker threads through inner_step()), the
    reduce is in flight all along, and once the link heals the delayed update is right."""
    async with LinkEmulator() as emu:
        cluster, peers = await cluster_with_slow_peer(pccl_cluster, emu, async_mode=True)
        await start_all(peers)
        theta = flat(peers[0].model)
        emu.blackhole()
        first = await asyncio.gather(*(p.round(threaded=H - 1) for p in peers))
        assert all(p.d.reduce_in_flight for p in peers)
        counts = [p.d.inner_step_count for p in peers]
        for _ in range(H - 1):
            await asyncio.gather(*(p.d.inner_step(p.loss_fn()) for p in peers))
        # Inner compute went on: H - 1 more inner steps each, the reduce still in flight.
        assert [p.d.inner_step_count for p in peers] == [c + H - 1 for c in counts]
        assert all(p.d.reduce_in_flight for p in peers)
        assert emu.connection_count > 0
        emu.blackhole(False)
        for p in peers:
            p.local_step()
        infos = await asyncio.gather(*(p.d.step() for p in peers))
        assert all(i is not None and i.applied for i in infos)
        g = ring_reference(ring_order(peers, [theta - r[0] for r in first]),
                           pccl.ReduceOp.AVG, "float32")
        theta, _ = nesterov(theta, np.zeros_like(theta), g)
        assert all(flat(p.model).tobytes() == theta.tobytes() for p in peers)
        await asyncio.gather(*(p.d.close() for p in peers))


async def test_async_joiner_takes_part_in_the_reduce_it_missed(pccl_cluster) -> None:
    cluster = await pccl_cluster(3)
    peers = [Peer(c, i, async_mode=True) for i, c in enumerate(cluster.comms)]
    await start_all(peers)
    theta = flat(peers[0].model)
    m = np.zeros_like(theta)
    results = await asyncio.gather(*(p.round() for p in peers))
    in_flight = [theta - r[0] for r in results]
    comm = cluster.new_comm()
    joining = asyncio.create_task(comm.connect())
    await cluster.master.wait_for(lambda s: len(s.pending()) == 1, timeout=30)

    async def join() -> Peer:
        await joining
        peer = Peer(comm, 3, seed=42, async_mode=True)
        await peer.d.start()
        return peer

    *results, joiner = await asyncio.gather(*(p.round() for p in peers), join())
    g = ring_reference(ring_order(peers, in_flight), pccl.ReduceOp.AVG, "float32")
    new_pgs = [theta - r[0] for r in results]
    theta, m = nesterov(theta, m, g)
    assert flat(joiner.model).tobytes() == theta.tobytes()
    peers.append(joiner)
    assert_parity(peers)
    # The reduce launched at that step has the joiner's zeros with weight 0: the update
    # applied next is the old peers' mean (AVG over four, times 4/3).
    results = await asyncio.gather(*(p.round() for p in peers))
    g = ring_reference(ring_order(peers, new_pgs + [np.zeros_like(theta)]),
                       pccl.ReduceOp.AVG, "float32") * np.float32(4 / 3)
    theta, m = nesterov(theta, m, g)
    for p, (_, info) in zip(peers, results):
        assert info.world_size == 4 and info.contributors == 3
        assert flat(p.model).tobytes() == theta.tobytes()
    assert_parity(peers)
    await asyncio.gather(*(p.d.close() for p in peers))


async def test_async_flush_retried_with_a_joiner(pccl_cluster) -> None:
    """Async mode: a peer dies while flush() waits on the last reduce and a joiner is
    pending, and the master does not repair rings (so the policy's retry at once fails
    and it votes); the joiner is admitted by that vote, lands in the flush (not in an
    outer step) with weight 0, and everyone ends on the survivors' mean update."""
    async with LinkEmulator() as emu:
        cluster, peers = await cluster_with_slow_peer(
            pccl_cluster, emu, master_kwargs={"repair_rings": False}, async_mode=True)
        await start_all(peers)
        theta = flat(peers[0].model)
        emu.blackhole()  # the reduce launched at the first outer step stays in flight
        results = await asyncio.gather(*(p.round() for p in peers))
        comm = cluster.new_comm()
        joining = asyncio.create_task(comm.connect())
        await cluster.master.wait_for(lambda s: len(s.pending()) == 1, timeout=30)
        flushes = [asyncio.create_task(p.d.flush()) for p in peers]
        await crash(peers[2].comm)
        emu.blackhole(False)
        await joining
        joiner = Peer(comm, 3, seed=11, async_mode=True)
        await joiner.d.start()
        res = await asyncio.gather(*flushes, return_exceptions=True)
        assert isinstance(res[2], pccl.MasterConnectionError)
        group = [*peers[:2], joiner]
        pgs = [theta - r[0] for r in results[:2]] + [np.zeros_like(theta)]
        g = ring_reference(ring_order(group, pgs), pccl.ReduceOp.AVG, "float32")
        theta, m = nesterov(theta, np.zeros_like(theta), g * np.float32(3 / 2))
        for info in [*res[:2], joiner.d.last_info]:
            assert info.applied and info.world_size == 3 and info.contributors == 2
        for p in group:
            assert flat(p.model).tobytes() == theta.tobytes()
            assert not p.d.reduce_in_flight and p.d.outer_step == 1
        assert_parity(group)
        # Training resumes: the next outer step starts a new reduce, applied one later.
        results = await asyncio.gather(*(p.round() for p in group))
        assert all(not info.applied for _, info in results)
        await asyncio.gather(*(p.d.close() for p in group))


# --- dtypes, numpy, quantization, CUDA --------------------------------------------------


def bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 -> float32, rounding to nearest even (torch's rounding)."""
    return torch.from_numpy(x).to(torch.bfloat16).float().numpy()


async def test_bfloat16_model(pccl_cluster) -> None:
    cluster = await pccl_cluster(3)
    peers = [Peer(c, i, dtype=torch.bfloat16) for i, c in enumerate(cluster.comms)]
    await start_all(peers)
    theta = flat(peers[0].model)  # the global parameters start as the bf16 init, in f32
    m = np.zeros_like(theta)
    for _ in range(2):
        results = await asyncio.gather(*(p.round() for p in peers))
        # Pseudo-gradients in float32 from the bf16 start the round had.
        start = bf16(theta)
        pgs = [start - r[0] for r in results]
        g = ring_reference(ring_order(peers, pgs), pccl.ReduceOp.AVG, "float32")
        theta, m = nesterov(theta, m, g)
        for p in peers:
            assert global_flat(p.d).tobytes() == theta.tobytes()  # float32 global state
            assert flat(p.model).tobytes() == bf16(theta).tobytes()
            assert all(q.dtype == torch.bfloat16 for q in p.model.parameters())
        assert_parity(peers)


async def test_numpy_parameters(pccl_cluster) -> None:
    """Plain numpy parameters and step(); outer_lr=1 without momentum is model averaging."""
    cluster = await pccl_cluster(3)
    rng = np.random.default_rng(5)
    init = {"w": rng.standard_normal((4, 3)).astype(np.float32),
            "b": rng.standard_normal(3).astype(np.float16)}
    params = [{k: v.copy() for k, v in init.items()} for _ in range(3)]
    ds = [DiLoCo(p, None, c, inner_steps=2, outer_lr=1.0, outer_momentum=0.0)
          for p, c in zip(params, cluster.comms)]
    await asyncio.gather(*(d.start() for d in ds))
    assert ds[0].momentum_buffers == {}

    async def train(i: int) -> None:
        for s in range(2):
            params[i]["w"] -= np.float32(0.1 * (i + 1) * (s + 1))
            params[i]["b"] += np.float16(0.25 * i)
            await ds[i].step()

    start = [np.concatenate([v.reshape(-1).astype(np.float32) for v in p.values()])
             for p in params]
    ends = []
    for i in range(3):
        p = {k: v.copy() for k, v in params[i].items()}
        p["w"] -= np.float32(0.1 * (i + 1))
        p["w"] -= np.float32(0.2 * (i + 1))
        p["b"] += np.float16(0.25 * i)
        p["b"] += np.float16(0.25 * i)
        ends.append(np.concatenate([v.reshape(-1).astype(np.float32) for v in p.values()]))
    await asyncio.gather(*(train(i) for i in range(3)))
    pgs = [start[0] - e for e in ends]
    ranks = [c.ring.index(c.peer_id) for c in cluster.comms]
    g = ring_reference([x for _, x in sorted(zip(ranks, pgs), key=lambda t: t[0])],
                       pccl.ReduceOp.AVG, "float32")
    theta = start[0] - g * np.float32(1.0)
    for p in params:
        assert p["w"].tobytes() == theta[:12].reshape(4, 3).tobytes()
        assert p["b"].tobytes() == theta[12:].astype(np.float16).tobytes()


async def test_quantized_pseudo_gradients(pccl_cluster) -> None:
    cluster = await pccl_cluster(3)
    q = pccl.QuantizationOptions(pccl.QuantizationAlgorithm.MIN_MAX, pccl.DataType.UINT8)
    peers = [Peer(c, i, quantization=q) for i, c in enumerate(cluster.comms)]
    await start_all(peers)
    theta = flat(peers[0].model)
    results = await asyncio.gather(*(p.round() for p in peers))
    pgs = [theta - r[0] for r in results]
    exact, _ = nesterov(theta, np.zeros_like(theta),
                        ring_reference(ring_order(peers, pgs), pccl.ReduceOp.AVG, "float32"))
    assert_parity(peers)  # bit-identical even though the wire was 8-bit
    got = flat(peers[0].model)
    # Documented bound: world x half a code step of each partial's range per encoding;
    # a partial's range is at most the sum of the inputs' ranges. One step from zero
    # momentum moves theta by lr * (1 + mu) * g.
    span = sum(float(x.max() - x.min()) for x in pgs)
    bound = LR * (1 + MU) * 3 * span / 252 + 1e-6
    assert np.max(np.abs(got - exact)) <= bound
    assert not np.array_equal(got, theta)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
async def test_cuda_parameters_are_staged_through_pinned_memory(pccl_cluster) -> None:
    cluster = await pccl_cluster(2)
    peers = [Peer(c, i, device="cuda") for i, c in enumerate(cluster.comms)]
    await start_all(peers)
    assert all(t.is_pinned() for t in peers[0].d._keep)
    theta = flat(peers[0].model)
    m = np.zeros_like(theta)
    results = await asyncio.gather(*(p.round() for p in peers))
    theta, m = reference_step(theta, m, peers, [r[0] for r in results])
    for p in peers:
        assert flat(p.model).tobytes() == theta.tobytes()
        assert all(q.device.type == "cuda" for q in p.model.parameters())
    assert_parity(peers)


def test_importing_pccl_does_not_import_torch() -> None:
    code = ("import sys, pccl, pccl.diloco; "
            "sys.exit(1 if 'torch' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0
