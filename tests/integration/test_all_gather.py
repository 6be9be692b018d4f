"""Communicator.all_gather on in-process clusters: every peer gets every peer's bytes in
the ring's order, the same on every path (the master, the ring started early, the ring
after the perform); a group of one; misuse and disagreement; a peer lost before and during a gather.
(The master's refusal of unknown kinds: tests/unit/test_master_state.py.)"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import pccl

# The paths of an all-gather, and the algorithm each reports.
PATHS = {"via_master": ({}, "master"),
         "early_ring": ({"via_master_max_bytes": 0}, "ring"),
         "performed_ring": ({"via_master_max_bytes": 0, "early_start_max_bytes": 0}, "ring")}


def contribution(peer_id: int, count: int, dtype: str = "float32") -> np.ndarray:
    rng = np.random.default_rng(peer_id * 7919 + count)
    return rng.standard_normal(count).astype(dtype)


async def gather_all(cluster, tensors, tag=0, **kw):
    return await asyncio.gather(*(c.all_gather(t, tag=tag, **kw)
                                  for c, t in zip(cluster.comms, tensors)))


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("world", [2, 3, 5])
async def test_every_peer_gets_every_contribution_in_ring_order(pccl_cluster, path,
                                                                world) -> None:
    kwargs, algorithm = PATHS[path]
    cluster = await pccl_cluster(world, comm_kwargs=kwargs)
    for count in (1, 1000, 3001):
        tensors = [contribution(c.peer_id, count) for c in cluster.comms]
        infos = await gather_all(cluster, tensors, tag=4)
        ring = cluster.comms[0].ring
        want = b"".join(tensors[[c.peer_id for c in cluster.comms].index(p)].tobytes()
                        for p in ring)
        for c, t, info in zip(cluster.comms, tensors, infos):
            assert bytes(info.data) == want
            assert info.world_size == world and info.peers == tuple(ring)
            assert info.of(c.peer_id) == t.tobytes()
            big = count * 4 * world > 64 << 10
            assert info.algorithm == ("ring" if big else algorithm)
            if info.algorithm == "ring":
                # World - 1 contributions each way, plus the pieces' headers.
                assert (world - 1) * count * 4 < info.tx_bytes < (world - 1) * (count * 4 + 4096)
                assert info.rx_bytes == info.tx_bytes


@pytest.mark.parametrize("via_master", [0, 64 << 10])
async def test_a_group_of_one_gathers_its_own_bytes(pccl_cluster, via_master) -> None:
    cluster = await pccl_cluster(1, comm_kwargs={"via_master_max_bytes": via_master})
    x = np.arange(10, dtype=np.int16)
    info = await cluster.comms[0].all_gather(x)
    assert bytes(info.data) == x.tobytes() and info.world_size == 1
    assert info.algorithm == ("master" if via_master else "local")
    assert info.peers == (cluster.comms[0].peer_id,)


async def test_gathers_and_reduces_run_side_by_side_on_their_own_tags(pccl_cluster) -> None:
    cluster = await pccl_cluster(3, comm_kwargs={"via_master_max_bytes": 0})
    xs = [np.full(50_000, i + 1, np.float32) for i in range(3)]
    gs = [np.full(20_000, i, np.uint8) for i in range(3)]
    results = await asyncio.gather(
        *(c.all_reduce(x, tag=1) for c, x in zip(cluster.comms, xs)),
        *(c.all_gather(g, tag=2) for c, g in zip(cluster.comms, gs)))
    assert all((x == 6).all() for x in xs)
    gathered = [r for r in results if isinstance(r, pccl.GatherInfo)]
    assert len(gathered) == 3 and len({bytes(g.data) for g in gathered}) == 1
    ids = [c.peer_id for c in cluster.comms]
    for g in gathered:
        for pid in ids:
            assert set(bytes(g.of(pid))) == {ids.index(pid)}


async def test_peers_disagreeing_on_the_size_all_get_invalid_usage(pccl_cluster) -> None:
    cluster = await pccl_cluster(2, comm_kwargs={"via_master_max_bytes": 0})
    a, b = cluster.comms
    results = await asyncio.gather(a.all_gather(np.zeros(10, np.float32)),
                                   b.all_gather(np.zeros(11, np.float32)),
                                   return_exceptions=True)
    assert all(isinstance(r, pccl.InvalidUsageError) for r in results), results
    # An all-reduce and an all-gather under one tag disagree too.
    results = await asyncio.gather(a.all_gather(np.zeros(10, np.float32), tag=3),
                                   b.all_reduce(np.zeros(10, np.float32), tag=3),
                                   return_exceptions=True)
    assert all(isinstance(r, pccl.InvalidUsageError) for r in results), results


async def test_bad_arguments_are_refused_before_anything_is_sent(pccl_cluster) -> None:
    cluster = await pccl_cluster(1)
    comm = cluster.comms[0]
    with pytest.raises(pccl.InvalidArgumentError):
        await comm.all_gather(np.zeros(4, np.float32), tag=-1)
    with pytest.raises(pccl.InvalidArgumentError):
        await comm.all_gather(np.zeros((4, 4), np.float32)[:, 1])  # not contiguous
    with pytest.raises(pccl.InvalidArgumentError):
        await comm.all_gather(np.zeros(4, np.float32), timeout=-1)


async def test_a_peer_lost_before_the_gather_runs_leaves_it_to_the_others(pccl_cluster) -> None:
    """Two of three peers started a gather when the third is lost: the master rebuilds
    the ring and the held gather runs on the two survivors."""
    cluster = await pccl_cluster(3, comm_kwargs={"via_master_max_bytes": 0,
                                                 "early_start_max_bytes": 0})
    a, b, c = cluster.comms
    xa, xb = contribution(a.peer_id, 5000), contribution(b.peer_id, 5000)
    ha, hb = a.all_gather_async(xa), b.all_gather_async(xb)
    await cluster.master.wait_for(lambda s: len(s.collectives) == 1
                                  and len(next(iter(s.collectives.values())).inits) == 2)
    await pccl.testing.crash(c)
    ia, ib = await asyncio.gather(ha, hb)
    assert ia.world_size == ib.world_size == 2 and ia.data == ib.data
    assert ia.of(a.peer_id) == xa.tobytes() and ia.of(b.peer_id) == xb.tobytes()


async def test_a_peer_lost_mid_gather_fails_it_alike_and_a_retry_works(pccl_cluster) -> None:
    """The ring started early on two peers and waits for the third, which is lost: both
    survivors end alike (a typed error, or the gather of the two on the repaired ring),
    and the next gather runs on the two."""
    cluster = await pccl_cluster(3, comm_kwargs={"via_master_max_bytes": 0})
    a, b, c = cluster.comms
    xa, xb = contribution(a.peer_id, 4000), contribution(b.peer_id, 4000)
    ha, hb = a.all_gather_async(xa, tag=6), b.all_gather_async(xb, tag=6)
    await cluster.master.wait_for(lambda s: len(s.collectives) == 1
                                  and len(next(iter(s.collectives.values())).inits) == 2)
    await pccl.testing.crash(c)
    ra, rb = await asyncio.gather(ha, hb, return_exceptions=True)
    if isinstance(ra, BaseException) or isinstance(rb, BaseException):
        assert isinstance(ra, pccl.PCCLError) and type(ra) is type(rb), (ra, rb)
        await asyncio.gather(a.update_topology(), b.update_topology())
        ra, rb = await asyncio.gather(a.all_gather(xa, tag=6), b.all_gather(xb, tag=6))
    assert ra.world_size == rb.world_size == 2 and ra.data == rb.data
    assert ra.of(b.peer_id) == xb.tobytes()


async def test_a_master_of_an_older_protocol_is_not_asked_for_a_gather(pccl_cluster) -> None:
    """A protocol-14 master would run the gather as an all-reduce: the peer refuses to
    ask it, naming the version to upgrade."""
    cluster = await pccl_cluster(1)
    comm = cluster.comms[0]
    comm._master_protocol = 14
    with pytest.raises(pccl.InvalidUsageError, match="protocol 15 or newer; this one speaks 14"):
        await comm.all_gather(np.zeros(4, np.float32))
