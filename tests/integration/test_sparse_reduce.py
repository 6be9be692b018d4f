"""pccl.sparse.all_reduce on an in-process cluster: every peer decodes the same sum; a
failed, cancelled or poisoned call loses nothing."""

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
async def test_every_peer_gets_the_same_sum_of_every_payload_in_ring_order(
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


async def test_a_garbage_payload_fails_every_honest_peer_alike(pccl_cluster) -> None:
    """A lying insider contributes random bytes of a payload's length: every honest
    peer receives the same slots, refuses them alike (CollectiveAbortedError) and keeps
    its accumulator."""
    cluster = await pccl_cluster(3, comm_kwargs={"via_master_max_bytes": 0})
    liar, *honest = cluster.comms
    codec = sparse.SparseCodec(density=2 / 64, bits=4, chunk=64)
    accs = [_acc(30 + i) for i in range(2)]
    before = [a.copy() for a in accs]
    garbage = np.random.default_rng(1).integers(0, 256, codec.payload_bytes(N), np.uint8)
    results = await asyncio.gather(
        liar.all_gather(garbage, tag=8),
        *(sparse.all_reduce(c, codec, a, np.zeros(N, np.float32), tag=8)
          for c, a in zip(honest, accs)), return_exceptions=True)
    assert isinstance(results[0], pccl.GatherInfo)
    for r in results[1:]:
        assert isinstance(r, pccl.CollectiveAbortedError) and "no valid payload" in str(r)
    for a, b in zip(accs, before):
        assert a.tobytes() == b.tobytes()


async def test_large_tensors_are_coded_off_the_event_loop_with_the_same_bytes(
        pccl_cluster, monkeypatch) -> None:
    """Above the thread threshold the codec runs on worker threads: the same sum, and
    the accumulators keep exactly what they did not send."""
    monkeypatch.setattr(sparse, "_THREAD_MIN_COUNT", 1024)
    cluster = await pccl_cluster(2)
    codec = sparse.SparseCodec(density=1 / 64, bits=2, chunk=64)
    accs = [_acc(40 + i) for i in range(2)]
    before = [a.copy() for a in accs]
    outs = [np.zeros(N, np.float32) for _ in range(2)]
    infos = await asyncio.gather(*(sparse.all_reduce(c, codec, a, o, tag=9)
                                   for c, a, o in zip(cluster.comms, accs, outs)))
    assert outs[0].tobytes() == outs[1].tobytes()
    want = np.zeros(N, np.float32)
    by_id = {c.peer_id: b for c, b in zip(cluster.comms, before)}
    for pid in cluster.comms[0].ring:
        codec.decode_add(codec.compress(by_id[pid].copy()), want)
    assert outs[0].tobytes() == want.tobytes()
    assert all(i.compress_seconds > 0 and i.decode_seconds > 0 for i in infos)


async def test_meta_bytes_ride_with_the_payloads_in_slot_order(pccl_cluster) -> None:
    cluster = await pccl_cluster(3, comm_kwargs={"via_master_max_bytes": 0})
    codec = sparse.SparseCodec(density=2 / 64, bits=2, chunk=64)
    outs = [np.zeros(N, np.float32) for _ in range(3)]
    infos = await asyncio.gather(*(
        sparse.all_reduce(c, codec, _acc(50 + i), o, tag=2, meta=bytes([i + 1, 7]))
        for i, (c, o) in enumerate(zip(cluster.comms, outs))))
    by_id = {c.peer_id: bytes([i + 1, 7]) for i, c in enumerate(cluster.comms)}
    want = tuple(by_id[p] for p in cluster.comms[0].ring)
    assert all(i.metas == want for i in infos)
    assert outs[0].tobytes() == outs[1].tobytes() == outs[2].tobytes()
    with pytest.raises(pccl.InvalidArgumentError):
        await sparse.all_reduce(cluster.comms[0], codec, _acc(1), outs[0], meta=b"x" * 4097)
