"""pytest plugin with pccl fixtures. It is opt-in: installing pccl changes nothing in
anyone's pytest runs. Turn it on with ``pytest -p pccl.testing.plugin``, or with one line
in a ``conftest.py``::

    pytest_plugins = ["pccl.testing.plugin"]

It needs pytest-asyncio (``pip install "pccl[test]"``, or pytest-asyncio alone).

- ``pccl_master``: a started in-process :class:`~pccl.MasterNode` on 127.0.0.1:0 with
  fast heartbeats, stopped after the test.
- ``pccl_cluster``: a factory ``await pccl_cluster(n, groups=..., pool_size=...)`` giving
  a started :class:`~pccl.testing.Cluster`; all clusters are closed after the test.
- ``pccl_peer_process``: a factory for :class:`~pccl.testing.PeerProcess`; every process
  is killed and reaped after the test.
- ``pccl_netns``: a started :class:`~pccl.testing.netns.VirtualLan` (peers and master in
  their own network namespaces behind a private bridge); its processes, ports and
  namespaces are removed after the test, failed or not. Skips, with the reason, where
  that cannot work (not root, no iproute2, no namespace support).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

try:
    import pytest_asyncio
except ImportError as e:  # a clear message instead of a bare ModuleNotFoundError
    raise ImportError(
        "pccl.testing.plugin needs pytest-asyncio: pip install pytest-asyncio "
        "(or pip install \"pccl[test]\")") from e

from pccl.master.server import MasterNode
from pccl.testing.cluster import Cluster
from pccl.testing.netns import VirtualLan, netns_unavailable
from pccl.testing.processes import PeerProcess


@pytest_asyncio.fixture
async def pccl_master() -> AsyncIterator[MasterNode]:
    master = MasterNode(listen="127.0.0.1:0", heartbeat_interval=0.25, heartbeat_timeout=3.0)
    await master.start()
    try:
        yield master
    finally:
        await master.stop()


@pytest_asyncio.fixture
async def pccl_cluster() -> AsyncIterator[Callable[..., Awaitable[Cluster]]]:
    clusters: list[Cluster] = []

    async def make(n: int, **kwargs: Any) -> Cluster:
        cluster = Cluster(n, **kwargs)
        await cluster.__aenter__()
        clusters.append(cluster)
        return cluster

    try:
        yield make
    finally:
        for c in clusters:
            await c.close()


@pytest_asyncio.fixture
async def pccl_peer_process() -> AsyncIterator[Callable[..., Awaitable[PeerProcess]]]:
    procs: list[PeerProcess] = []

    async def spawn(master: str, **kwargs: Any) -> PeerProcess:
        p = PeerProcess(master, **kwargs)
        procs.append(p)
        await p.start()
        return p

    try:
        yield spawn
    finally:
        for p in procs:
            await p.close()


@pytest_asyncio.fixture
async def pccl_netns() -> AsyncIterator[VirtualLan]:
    reason = netns_unavailable()
    if reason is not None:
        pytest.skip(f"real test hosts unavailable: {reason}")
    async with VirtualLan() as lan:
        yield lan
