"""DiLoCo with SparseLoCo compression (pccl.sparse): parity at every outer step, far
fewer bytes than the dense reduce, and a joiner that starts owing nothing."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import pccl
from pccl.diloco import DiLoCo
from pccl.sparse import SparseLoCo

N = 64 * 512
H = 2


def _model(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"w": rng.standard_normal(N).astype(np.float32)}


def _inner(model: dict[str, np.ndarray], peer: int, step: int) -> None:
    # A deterministic "inner step" that differs per peer.
    rng = np.random.default_rng(1000 * peer + step)
    model["w"] -= np.float32(0.01) * rng.standard_normal(N).astype(np.float32)


async def _run(cluster, compression, steps: int,
               async_mode: bool = False) -> tuple[list[DiLoCo], list[int]]:
    models = [_model(7) for _ in cluster.comms]
    ds = [DiLoCo(m, None, c, inner_steps=H, outer_momentum=0.0, compression=compression,
                 async_mode=async_mode)
          for m, c in zip(models, cluster.comms)]
    await asyncio.gather(*(d.start() for d in ds))
    tx: list[int] = []
    for step in range(steps):
        for i, m in enumerate(models):
            _inner(m, i, step)
        infos = [None] * len(ds)
        for _ in range(H):
            infos = await asyncio.gather(*(d.step() for d in ds))
        assert all(i is not None and (i.applied or async_mode and step == 0) for i in infos)
        tx.append(infos[0].tx_bytes)
        # Parity: every peer's model and global state are the same bytes.
        assert len({m["w"].tobytes() for m in models}) == 1
        assert len({pccl.content_hash(d.global_parameters["w"]) for d in ds}) == 1
    return ds, tx


async def _up_to_the_outer_step(cluster, codec, seed: int
                                 ) -> tuple[list[dict[str, np.ndarray]], list[DiLoCo]]:
    """Every peer of ``cluster`` started with the same model, trained one round and
    stepped ``H - 1`` times: its next ``step()`` is the outer step's."""
    models = [_model(seed) for _ in cluster.comms]
    ds = [DiLoCo(m, None, c, inner_steps=H, outer_momentum=0.0, compression=codec)
          for m, c in zip(models, cluster.comms)]
    await asyncio.gather(*(d.start() for d in ds))
    for i, m in enumerate(models):
        _inner(m, i, 0)
    for _ in range(H - 1):
        await asyncio.gather(*(d.step() for d in ds))
    return models, ds


@pytest.mark.parametrize("async_mode", [False, True])
async def test_sparse_outer_steps_keep_parity_with_far_fewer_bytes(pccl_cluster,
                                                                   async_mode) -> None:
    cluster = await pccl_cluster(3, comm_kwargs={"via_master_max_bytes": 0})
    codec = SparseLoCo(density=1 / 64, bits=2, chunk=64, beta=0.9)
    ds, sparse_tx = await _run(cluster, codec, steps=3, async_mode=async_mode)
    # Each accumulator holds what its peer still owes: not nothing, and not shared.
    owed = [d.feedback_accumulator for d in ds]
    assert all(a is not None and a.any() for a in owed)
    assert len({a.tobytes() for a in owed if a is not None}) == 3
    dense = await pccl_cluster(3, comm_kwargs={"via_master_max_bytes": 0})
    _, dense_tx = await _run(dense, None, steps=1)
    # Bytes counted by the ring (weights reduce included): the all-gather moves k - 1
    # payloads of about N/64 bytes against a float32 ring's 2 * 4N (k-1)/k.
    assert dense_tx[0] > 100 * max(sparse_tx), (dense_tx, sparse_tx)


async def test_a_joiner_starts_with_an_empty_accumulator_and_keeps_parity(pccl_cluster) -> None:
    cluster = await pccl_cluster(2, comm_kwargs={"via_master_max_bytes": 0})
    codec = SparseLoCo(density=2 / 64, bits=4, chunk=64, beta=1.0)
    models, ds = await _up_to_the_outer_step(cluster, codec, seed=3)
    # A third peer joins; the outer step admits it (are_peers_pending).
    comm = cluster.new_comm()
    joining = asyncio.create_task(comm.connect())
    await cluster.master.wait_for(lambda s: len(s.pending()) == 1, timeout=30)
    stepping = asyncio.gather(*(d.step() for d in ds))
    await joining  # admitted by the outer step's update_topology()
    models.append(_model(99))
    joiner = DiLoCo(models[2], None, comm, inner_steps=H, outer_momentum=0.0,
                    compression=codec)
    await asyncio.gather(stepping, joiner.start())  # its first sync is the group's
    ds.append(joiner)
    assert joiner.feedback_accumulator is not None and not joiner.feedback_accumulator.any()
    assert models[2]["w"].tobytes() == models[0]["w"].tobytes()
    for i, m in enumerate(models):
        _inner(m, i, 1)
    for _ in range(H):
        infos = await asyncio.gather(*(d.step() for d in ds))
    assert all(i is not None and i.world_size == 3 for i in infos)
    assert len({m["w"].tobytes() for m in models}) == 1
    await comm.close()


def test_compression_and_quantization_do_not_mix() -> None:
    comm = pccl.Communicator("127.0.0.1:1")
    with np.testing.assert_raises(pccl.InvalidArgumentError):
        DiLoCo(_model(1), None, comm, compression=SparseLoCo(),
               quantization=pccl.QuantizationOptions(pccl.QuantizationAlgorithm.MIN_MAX,
                                                     pccl.DataType.UINT8))
    with np.testing.assert_raises(pccl.InvalidArgumentError):
        SparseLoCo(beta=1.5)


async def test_a_peer_lost_in_the_reduce_is_retried_without_it_and_parity_holds(
        pccl_cluster) -> None:
    """Two of three peers reach the outer step's reduce; the third crashes there. The
    survivors' collective runs again without it (the payload rebuilt from the untouched
    accumulator: no backup needed) and every survivor holds the same bytes."""
    cluster = await pccl_cluster(3, comm_kwargs={"via_master_max_bytes": 0})
    codec = SparseLoCo(density=2 / 64, bits=2, chunk=64, beta=0.9)
    models, ds = await _up_to_the_outer_step(cluster, codec, seed=5)
    survivors = asyncio.gather(ds[0].step(), ds[1].step())
    await cluster.master.wait_for(lambda s: any(len(c.inits) == 2
                                                for c in s.collectives.values()), timeout=30)
    await pccl.testing.crash(cluster.comms[2])
    infos = await survivors
    assert all(i is not None and i.applied and i.world_size == 2 for i in infos), infos
    assert models[0]["w"].tobytes() == models[1]["w"].tobytes()
    acc = [d.feedback_accumulator for d in ds[:2]]
    assert all(a is not None and a.any() for a in acc)
