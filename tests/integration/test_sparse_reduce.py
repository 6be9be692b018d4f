"""pccl.sparse.all_reduce on an in-process cluster: every peer decodes the same sum."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import pccl
from pccl import sparse

N = 64 * 300


def _acc(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(N).astype(np.float32)


@pytest.mark.parametrize("bits", [2, 8])
async def test_every_peer_gets_the_same_sum_of_every_payload_in_rank_order(
        pccl_cluster, bits: int) -> None:
    cluster = await pccl_cluster(3)
    codec = sparse.SparseCodec(density=2 / 64, bits=bits, chunk=64)
    accs = [_acc(i) for i in range(3)]
    before = [a.copy() for a in accs]
    outs = [np.full(N, np.nan, np.float32) for _ in range(3)]
    infos = await asyncio.gather(*(sparse.all_reduce(c, codec, a, o, tag=3)
                                   for c, a, o in zip(cluster.comms, accs, outs)))
    assert [i.world_size for i in infos] == [3, 3, 3]
    assert infos[0].payload_bytes == codec.payload_bytes(N)
    assert outs[0].tobytes() == outs[1].tobytes() == outs[2].tobytes()
    # The reference: each peer's own payload (from its accumulator as it was), added
    # in the ring's order.
    ring = cluster.comms[0].ring
    by_id = {c.peer_id: b for c, b in zip(cluster.comms, before)}
    want = np.zeros(N, np.float32)
    for pid in ring:
        codec.decode_add(codec.compress(by_id[pid].copy()), want)
    assert outs[0].tobytes() == want.tobytes()
    # Each accumulator keeps exactly what it did not send.
    for a, b in zip(accs, before):
        sent = np.zeros(N, np.float32)
        codec.decode_add(codec.compress(b.copy()), sent)
        assert np.array_equal(a, b - sent)


async def test_a_failed_collective_puts_the_accumulator_back(pccl_cluster) -> None:
    """Peers with different codecs: payload sizes differ, the all-reduce is refused on
    every peer, and nothing is lost: each accumulator is back as it was."""
    cluster = await pccl_cluster(2)
    codecs = [sparse.SparseCodec(density=2 / 64, bits=2, chunk=64),
              sparse.SparseCodec(density=4 / 64, bits=2, chunk=64)]
    accs = [_acc(10), _acc(11)]
    before = [a.copy() for a in accs]
    results = await asyncio.gather(
        *(sparse.all_reduce(c, k, a, np.zeros(N, np.float32), tag=5)
          for c, k, a in zip(cluster.comms, codecs, accs)), return_exceptions=True)
    assert all(isinstance(r, pccl.InvalidUsageError) for r in results), results
    for a, b in zip(accs, before):
        assert a.tobytes() == b.tobytes()
    # The group goes on: the same call with agreeing codecs works.
    outs = [np.zeros(N, np.float32) for _ in range(2)]
    await asyncio.gather(*(sparse.all_reduce(c, codecs[0], a, o, tag=5)
                           for c, a, o in zip(cluster.comms, accs, outs)))
    assert outs[0].tobytes() == outs[1].tobytes()


async def test_a_cancelled_call_puts_the_accumulator_back(pccl_cluster) -> None:
    cluster = await pccl_cluster(2)
    a = cluster.comms[0]
    codec = sparse.SparseCodec()
    acc = _acc(20)
    before = acc.copy()
    task = asyncio.create_task(sparse.all_reduce(a, codec, acc, np.zeros(N, np.float32)))
    # The other peer never calls: cancel once the collective waits for it.
    await cluster.master.wait_for(lambda s: any(s.collectives.values()), timeout=30)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert acc.tobytes() == before.tobytes()
