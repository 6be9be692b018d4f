"""What a new user gets wrong, and the clear, typed error each mistake must give."""

from __future__ import annotations

import asyncio
import gc
import logging
import threading

import numpy as np
import pytest

import pccl
import pccl.blocking
from pccl.testing import free_port


async def test_a_peer_dialing_a_web_server_is_told_it_is_not_pccl() -> None:
    async def http(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
        await writer.drain()
        await reader.read()  # until the peer hangs up
        writer.close()

    server = await asyncio.start_server(http, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        comm = pccl.Communicator(f"127.0.0.1:{port}", p2p_listen_host="127.0.0.1")
        with pytest.raises(pccl.ProtocolError, match=r"not speaking pccl \(it sent 'HTTP'"):
            await comm.connect(n_attempts=1)
    finally:
        server.close()
        await server.wait_closed()


async def test_a_web_server_in_the_master_list_is_skipped_while_a_master_answers() -> None:
    """Several master addresses: one that is not pccl is passed over when another one
    answers; when none does, its typed error (naming it) is what connect() raises."""
    async def http(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
        await writer.drain()
        await reader.read()
        writer.close()

    server = await asyncio.start_server(http, "127.0.0.1", 0)
    web = f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
    try:
        async with pccl.MasterNode("127.0.0.1:0") as master:
            comm = pccl.Communicator([web, master.address], p2p_listen_host="127.0.0.1")
            try:
                await comm.connect(n_attempts=1)
                assert master.state.accepted() == [comm.peer_id]
            finally:
                await comm.close()
        closed = f"127.0.0.1:{free_port()}"
        lone = pccl.Communicator([web, closed], p2p_listen_host="127.0.0.1")
        with pytest.raises(pccl.ProtocolError, match=rf"the master at {web}: .*not speaking pccl"):
            await lone.connect(n_attempts=1)
    finally:
        server.close()
        await server.wait_closed()


async def test_a_web_client_at_the_master_is_logged_as_not_pccl(caplog) -> None:
    caplog.set_level(logging.WARNING, logger="pccl.master.server")
    async with pccl.MasterNode("127.0.0.1:0") as master:
        host, port = master.address.rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"GET / HTTP/1.1\r\nHost: example\r\n\r\n")
        await writer.drain()
        async with asyncio.timeout(10):
            while await reader.read(4096):  # the master's challenge, then it hangs up
                pass
        writer.close()
        await writer.wait_closed()
    assert any("not speaking pccl (it sent 'GET '" in r.getMessage() for r in caplog.records), \
        [r.getMessage() for r in caplog.records]


@pytest.mark.parametrize("listen", ["garbage:port", "127.0.0.1:99999", "", "[::1]:x"])
def test_master_node_refuses_a_malformed_listen_address(listen: str) -> None:
    with pytest.raises(pccl.InvalidArgumentError, match="port must be a number|address"):
        pccl.MasterNode(listen)


async def test_master_node_with_an_unknown_host_says_so() -> None:
    # (allow_anonymous: a host name is not loopback, and an anonymous master off
    # loopback is refused at construction otherwise.)
    master = pccl.MasterNode("no-such-host.invalid:0", allow_anonymous=True)
    with pytest.raises(pccl.InvalidArgumentError, match="unknown host 'no-such-host.invalid'"):
        await master.start()


@pytest.mark.parametrize("kwargs", [{"heartbeat_interval": -1.0},
                                    {"heartbeat_timeout": float("nan")},
                                    {"establish_timeout": 0},
                                    {"max_establish_attempts": 0}])
def test_master_node_refuses_bad_numbers(kwargs: dict[str, float]) -> None:
    with pytest.raises(pccl.InvalidArgumentError, match=next(iter(kwargs))):
        pccl.MasterNode("127.0.0.1:0", **kwargs)  # type: ignore[arg-type]


def test_shared_state_of_bare_arrays_says_to_name_them() -> None:
    w = np.zeros(4, np.float32)
    with pytest.raises(pccl.InvalidArgumentError, match=r"entry 0 is a numpy.ndarray, not a "
                                                        r"pccl.TensorInfo.*from_numpy"):
        pccl.SharedState([w])
    with pytest.raises(pccl.InvalidArgumentError, match="list of pccl.TensorInfo"):
        pccl.SharedState({"w": w})  # type: ignore[arg-type]
    with pytest.raises(pccl.InvalidArgumentError, match="name must be a non-empty string"):
        pccl.SharedState([pccl.TensorInfo(None, w)])  # type: ignore[arg-type]
    with pytest.raises(pccl.blocking.ArgumentValueError, match="not a pccl.TensorInfo"):
        pccl.blocking.SharedState([w])


async def test_a_communicator_called_from_another_event_loop_raises(pccl_cluster) -> None:
    cluster = await pccl_cluster(2)
    a, _ = cluster.comms
    caught: list[BaseException] = []

    def other_thread() -> None:
        async def use() -> None:
            for call in (lambda: a.all_reduce(np.ones(4, np.float32)),
                         a.are_peers_pending, a.update_topology, a.close):
                with pytest.raises(pccl.InvalidUsageError, match="another event loop"):
                    await call()

        try:
            asyncio.run(use())
        except BaseException as e:  # noqa: BLE001 - reported to the test below
            caught.append(e)

    t = threading.Thread(target=other_thread, daemon=True)  # a regression hangs in it
    t.start()
    await asyncio.to_thread(t.join, 30)
    assert not t.is_alive() and caught == []
    # The communicator is untouched and still works from its own loop.
    x, y = np.ones(4, np.float32), np.ones(4, np.float32)
    await asyncio.gather(a.all_reduce(x), cluster.comms[1].all_reduce(y))
    assert (x == 2).all()


async def test_close_with_a_handle_pending_settles_it_quietly(pccl_cluster) -> None:
    cluster = await pccl_cluster(2)
    a, _ = cluster.comms
    loop = asyncio.get_running_loop()
    reports: list[dict[str, object]] = []
    old = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, ctx: reports.append(ctx))
    try:
        kept = a.all_reduce_async(np.ones(4, np.float32), tag=1)  # b never joins
        dropped = a.all_reduce_async(np.ones(4, np.float32), tag=2)
        await a.close()
        assert kept.done() and dropped.done()
        with pytest.raises(pccl.MasterConnectionError, match="closed"):
            await kept  # a caller who keeps the handle still hears what happened
        del dropped
        gc.collect()
        assert reports == []  # no "Task exception was never retrieved"
    finally:
        loop.set_exception_handler(old)


@pytest.mark.parametrize("option", ["timeout", "p2p_timeout", "peer_timeout",
                                    "reconnect_timeout", "collective_timeout"])
@pytest.mark.parametrize("value", [-1.0, float("nan"), float("inf"), 1e300, True])
def test_communicator_refuses_bad_timeouts_at_construction(option: str, value: float) -> None:
    with pytest.raises(pccl.InvalidArgumentError, match=option):
        pccl.Communicator("127.0.0.1:1", **{option: value})


@pytest.mark.parametrize(("option", "value"), [
    ("p2p_connection_pool_size", 0), ("p2p_connection_pool_size", 65),
    ("p2p_connection_pool_size", 2.0), ("peer_group", -1), ("peer_group", 1 << 32),
    ("p2p_listen_port", -1), ("p2p_listen_port", 65536), ("piece_bytes", 0),
    ("piece_bytes", -5), ("piece_bytes", 1 << 40), ("max_frame", 10), ("max_frame", True),
    ("max_frame", 1 << 40)])
def test_communicator_refuses_bad_sizes_at_construction(option: str, value: object) -> None:
    """Sizes and ports are checked at the edge: an out-of-range number never reaches the
    Rust extension (where it used to surface as OverflowError or a panic)."""
    with pytest.raises(pccl.InvalidArgumentError, match=option):
        pccl.Communicator("127.0.0.1:1", **{option: value})


@pytest.mark.parametrize("n_attempts", [0, -1, 1.5, True])
async def test_connect_refuses_a_bad_attempt_count(n_attempts: object) -> None:
    comm = pccl.Communicator("127.0.0.1:1")
    with pytest.raises(pccl.InvalidArgumentError, match="n_attempts"):
        await comm.connect(n_attempts=n_attempts)  # type: ignore[arg-type]


async def test_a_bad_per_call_timeout_is_refused_before_anything_is_sent(pccl_cluster) -> None:
    cluster = await pccl_cluster(1)
    (c,) = cluster.comms
    for value in (-1.0, 0.0, float("nan"), 1e12):
        with pytest.raises(pccl.InvalidArgumentError, match="timeout"):
            await c.all_reduce(np.ones(4, np.float32), timeout=value)
        with pytest.raises(pccl.InvalidArgumentError, match="timeout"):
            await c.update_topology(timeout=value)
    assert await c.pending_peer_count() == 0  # still healthy


@pytest.mark.parametrize(("listen", "secret", "warned"), [
    ("0.0.0.0:0", None, True), ("0.0.0.0:0", b"5f0c1a9e7d3b42c8a6e1f0b97c2d4e3a", False),
    ("127.0.0.1:0", None, False), ("127.0.0.2:0", None, False)])
async def test_a_master_open_to_the_network_without_a_secret_warns_loudly(
        caplog: pytest.LogCaptureFixture, listen: str, secret: bytes | None,
        warned: bool) -> None:
    """Off loopback without a secret, a master must be told allow_anonymous=True (it is
    refused otherwise), and then warns loudly."""
    if warned:
        with pytest.raises(pccl.InvalidUsageError, match="allow_anonymous=True"):
            pccl.MasterNode(listen, secret=secret)
    master = pccl.MasterNode(listen, secret=secret, allow_anonymous=warned)
    with caplog.at_level(logging.WARNING, logger="pccl.master.server"):
        await master.start()
        try:
            assert any("WITHOUT AUTHENTICATION" in r.getMessage()
                       for r in caplog.records) is warned
        finally:
            await master.stop()
