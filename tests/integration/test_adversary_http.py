"""The HTTP ports (the master's status server, a peer's metrics_listen) against a stranger
or an insider: documents stay strict JSON whatever numbers peers report, a slow or
flooding client cannot hold connections past their budgets and deadlines, a peer's
/metrics can ask for a token, and the timeline stays small whatever text peers send."""

from __future__ import annotations

import asyncio
import json
import math
import os
import socket
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

import pccl
from pccl.master import state as st
from pccl.master.status_server import StatusServer
from pccl.observe.server import MetricsServer
from pccl.protocol import messages as m
from pccl.testing.cluster import Cluster

pytestmark = pytest.mark.timeout(90)

STATUS = {"status_listen": "127.0.0.1:0"}
#: How often a slowloris client sends its next byte (its pace; never a synchronisation:
#: each tick also ends as soon as a connection closes).
TICK = 0.05
#: Ticks a slowloris client keeps going at most (far past any head deadline set here).
MAX_TICKS = 600


def strict_json(text: str) -> Any:
    """``json.loads`` that refuses NaN and the infinities, as a browser's does."""
    def refuse(name: str) -> Any:
        raise ValueError(f"not JSON: {name}")
    return json.loads(text, parse_constant=refuse)


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def server_ends(address: str, peer: str | None = None) -> int:
    """Connections this process holds open on the listening port of ``address``: its
    server's ends (the kernel's socket table, whatever the server's own count says);
    with ``peer``, only those of clients at that IPv4 address."""
    port = host_port(address)[1]
    mine = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            mine.add(target[len("socket:["):-1])
    count = 0
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local_port = int(fields[1].rsplit(":", 1)[1], 16)
        listening = fields[3] == "0A"
        # (IPv4 addresses in the table are hex in host byte order: little-endian here.)
        remote = socket.inet_ntoa(bytes.fromhex(fields[2].split(":")[0])[::-1])
        if local_port == port and not listening and fields[9] in mine \
                and peer in (None, remote):
            count += 1
    return count


async def get(session: aiohttp.ClientSession, url: str, **kw: Any) -> tuple[int, str]:
    async with session.get(url, **kw) as r:
        return r.status, await r.text()


def host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host, int(port)


# --- 9: no NaN reaches a document ---------------------------------------------------------


async def test_nan_and_infinity_from_probe_reports_leave_the_status_strict_json() -> None:
    async with Cluster(2, master_kwargs=STATUS) as cluster, aiohttp.ClientSession() as http:
        base = f"http://{cluster.master.status_address}"
        state = cluster.master.state
        a, b = (c.peer_id for c in cluster.comms)
        # A probe report as a peer sends it (the state takes it while the peer is one of
        # the round's probers; a second, absent prober keeps the round from solving).
        state.opt_probers = {a, 1 << 40}
        state.handle(st.Received(a, m.ProbeReport(target_ids=[b], rates=[math.nan])))
        state.opt_probers = {b, 1 << 40}
        state.handle(st.Received(b, m.ProbeReport(target_ids=[a], rates=[math.inf])))
        state.opt_probers = set()
        # Whatever the state makes of such reports, the edge where JSON is made must cope
        # with a measurement that is not finite: one stored as it came.
        state.bandwidth[(b, a)] = (-math.inf, 0)
        cluster.master.monitor.changed.set()

        code, text = await get(http, base + "/api/status")
        assert code == 200
        assert "NaN" not in text and "Infinity" not in text
        doc = strict_json(text)
        rates = {(e["from"], e["to"]): e["bytes_per_s"] for e in doc["bandwidth"]}
        assert rates[(b, a)] is None
        assert rates.get((a, b)) is None or math.isfinite(rates[(a, b)])

        # The event stream's documents too.
        async with http.get(base + "/api/events") as stream:
            assert stream.status == 200
            data = b""
            async with asyncio.timeout(30):
                async for line in stream.content:
                    if line.startswith(b"data: "):
                        data = line[6:]
                    elif line == b"\n" and data:
                        break
            event = strict_json(data.decode())
            assert {(e["from"], e["to"]): e["bytes_per_s"]
                    for e in event["bandwidth"]}[(b, a)] is None

        # /metrics stays Prometheus text a scraper reads.
        code, text = await get(http, base + "/metrics")
        assert code == 200
        assert list(text_string_to_metric_families(text))


# --- 10: budgets and deadlines of the HTTP ports ------------------------------------------


@asynccontextmanager
async def http_server(kind: str) -> AsyncIterator[tuple[MetricsServer, str]]:
    """(the server, its "host:port"): the master's status server or a peer's metrics
    server (the one behind Communicator(metrics_listen=...))."""
    if kind == "master":
        async with pccl.MasterNode(listen="127.0.0.1:0", **STATUS) as master:
            server = master._status
            assert server is not None and master.status_address is not None
            yield server, master.status_address
    else:
        server = MetricsServer(CollectorRegistry(), "127.0.0.1:0")
        await server.start()
        try:
            yield server, server.address
        finally:
            await server.stop()


def limit(monkeypatch: pytest.MonkeyPatch, kind: str, **values: float) -> None:
    cls = StatusServer if kind == "master" else MetricsServer
    for name, value in values.items():
        monkeypatch.setattr(cls, name, value, raising=False)


class Slowloris:
    """``n`` connections to ``address`` from the loopback addresses ``sources`` (in turn),
    each sending a request head one byte per tick and never finishing it."""

    HEAD = b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"z" * 4000

    def __init__(self, address: str, n: int, sources: list[str]) -> None:
        self.address, self.n, self.sources = address, n, sources
        self.writers: list[asyncio.StreamWriter] = []
        self.closed: list[asyncio.Task[bytes]] = []  # each ends when its connection does
        self.answers: list[bytes] = []

    async def __aenter__(self) -> Slowloris:
        host, port = host_port(self.address)
        for i in range(self.n):
            reader, writer = await asyncio.open_connection(
                host, port, local_addr=(self.sources[i % len(self.sources)], 0))
            self.writers.append(writer)
            self.closed.append(asyncio.create_task(self._until_closed(reader)))
        return self

    async def __aexit__(self, *exc: object) -> None:
        for task in self.closed:
            task.cancel()
        await asyncio.gather(*self.closed, return_exceptions=True)
        for w in self.writers:
            w.close()
        await asyncio.gather(*(w.wait_closed() for w in self.writers), return_exceptions=True)

    @staticmethod
    async def _until_closed(reader: asyncio.StreamReader) -> bytes:
        try:
            return await reader.read()  # everything up to the server's EOF
        except ConnectionError:
            return b""

    def open(self) -> int:
        return sum(not t.done() for t in self.closed)

    async def trickle(self, during: Callable[[int], None] = lambda tick: None) -> int:
        """One byte per tick on every open connection until the server has closed them
        all (or MAX_TICKS); ``during(tick)`` runs once a tick. The ticks it took."""
        for tick in range(MAX_TICKS):
            during(tick)
            pending = [t for t in self.closed if not t.done()]
            if not pending:
                return tick
            for w, t in zip(self.writers, self.closed):
                if not t.done() and not w.is_closing():
                    w.write(self.HEAD[tick % len(self.HEAD):][:1])
            await asyncio.wait(pending, timeout=TICK)
        return MAX_TICKS


@pytest.mark.parametrize("kind", ["master", "peer"])
async def test_a_slowloris_flood_from_one_address_is_cut_and_others_are_served(
        kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    limit(monkeypatch, kind, head_timeout=1.0, keepalive_timeout=30.0, max_connections=32,
          max_connections_per_ip=8)
    n = 60
    async with http_server(kind) as (server, address):
        base = open_fds()
        async with Slowloris(address, n, ["127.0.0.2"]) as flood:
            seen: list[tuple[int, int]] = []  # (fds, server ends) each tick

            def watch(tick: int) -> None:
                # (The flood's ends only: the honest client's end below may outlive
                # its session by a turn of the server's loop.)
                seen.append((open_fds(), server_ends(address, "127.0.0.2")))

            # An honest client from another address is answered while the flood holds
            # its eight connections (the 52 others were refused at once). Its connection
            # is accepted after the flood's (the kernel queues them in order): once it
            # is answered, the server has dealt with every connection of the flood.
            async with aiohttp.ClientSession() as http:
                code, _ = await get(http, f"http://{address}/metrics")
            assert code == 200
            ticks = await flood.trickle(watch)
            assert ticks < MAX_TICKS, f"{flood.open()} connections were never closed"
            # Each connection was closed by the server (EOF read), none answered: the
            # refused ones got a 503, the admitted ones nothing before the deadline.
            assert all(t.result() in (b"",) or t.result().startswith(b"HTTP/1.1 503")
                       for t in flood.closed)
            refused = sum(t.result().startswith(b"HTTP/1.1 503") for t in flood.closed)
            assert server.refused >= refused >= n - 8 - 8  # (some may see a reset)
            # The server held at most its per-address budget of the flood; the process
            # (both ends of every socket live here) at most the flood's 60 client ends,
            # the 8 admitted server ends and a little.
            assert max(c for _, c in seen) <= 8, seen
            assert max(f for f, _ in seen) <= base + n + 8 + 6, (base, seen)
        assert server.connections == 0 and server_ends(address) == 0


async def test_a_full_budget_refuses_newcomers_and_keeps_established_clients(
        monkeypatch: pytest.MonkeyPatch) -> None:
    limit(monkeypatch, "master", head_timeout=4.0, keepalive_timeout=60.0,
          max_connections=16, max_connections_per_ip=8)
    async with http_server("master") as (server, address), \
            aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as honest:
        url = f"http://{address}/api/status"
        assert (await get(honest, url))[0] == 200  # its connection stays open (keep-alive)
        sources = [f"127.0.0.{i}" for i in range(2, 10)]
        async with Slowloris(address, 48, sources) as flood:
            # Full (the flood took the 15 places left): a newcomer is turned away at
            # once, with a 503. (Accepted after the flood's connections, it is answered
            # once the server has dealt with all of them.)
            reader, writer = await asyncio.open_connection(*host_port(address),
                                                           local_addr=("127.0.0.10", 0))
            try:
                answer = await asyncio.wait_for(reader.read(), 30)
            finally:
                writer.close()
                await writer.wait_closed()
            assert answer.startswith(b"HTTP/1.1 503")
            assert server_ends(address) <= 16
            assert server.connections <= 16 and server.refused > 0
            # The established client goes on being served.
            code, text = await get(honest, url)
            assert code == 200 and strict_json(text)["schema"] == 1
            assert await flood.trickle() < MAX_TICKS
        # The flood is gone (each connection cut at its head deadline): room again.
        assert (await get(honest, url))[0] == 200
        async with aiohttp.ClientSession() as fresh:
            assert (await get(fresh, url))[0] == 200


async def test_event_streams_count_against_the_budget_and_end(
        monkeypatch: pytest.MonkeyPatch) -> None:
    limit(monkeypatch, "master", max_connections_per_ip=2, stream_seconds=1.0)
    async with http_server("master") as (server, address):
        url = f"http://{address}/api/events"
        connector = aiohttp.TCPConnector(local_addr=("127.0.0.2", 0))
        async with aiohttp.ClientSession(connector=connector) as http:
            streams = [await http.get(url) for _ in range(2)]
            try:
                assert [s.status for s in streams] == [200, 200]
                # A third connection from that address is over its budget.
                reader, writer = await asyncio.open_connection(
                    *host_port(address), local_addr=("127.0.0.2", 0))
                try:
                    answer = await asyncio.wait_for(reader.read(), 30)
                except ConnectionError:
                    answer = b""
                finally:
                    writer.close()
                    await writer.wait_closed()
                assert answer == b"" or answer.startswith(b"HTTP/1.1 503")
                # Each stream ends on its own after stream_seconds (the stream reaches
                # its end: the loop below ends on EOF, bounded by the read timeout).
                for s in streams:
                    async with asyncio.timeout(30):
                        async for _ in s.content:
                            pass
                    assert s.content.at_eof()
            finally:
                for s in streams:
                    s.release()


# --- 10: the token of a peer's /metrics ---------------------------------------------------


async def test_a_peers_metrics_can_ask_for_a_token() -> None:
    kw = {"metrics_listen": "127.0.0.1:0", "metrics_token": "m3trics"}
    async with Cluster(1, comm_kwargs=kw) as cluster, aiohttp.ClientSession() as http:
        server = cluster.comms[0]._metrics_server
        assert server is not None
        base = f"http://{server.address}"
        code, body = await get(http, base + "/metrics")
        assert code == 401 and "token" in body
        assert (await get(http, base + "/metrics?token=wrong"))[0] == 401
        assert (await get(http, base + "/metrics",
                          headers={"Authorization": "Bearer wrong"}))[0] == 401
        code, body = await get(http, base + "/metrics",
                               headers={"Authorization": "Bearer m3trics"})
        assert code == 200 and "pccl_peer_collectives_total" in body
        # A token in the URL is only exchanged for a cookie (for browsers), never served.
        assert (await get(http, base + "/metrics?token=m3trics", allow_redirects=False))[0] \
            == 303
        assert await get(http, base + "/healthz") == (200, "ok\n")


def test_a_peers_metrics_off_loopback_needs_a_token(tmp_path: Path) -> None:
    with pytest.raises(pccl.InvalidArgumentError, match="metrics_token"):
        pccl.Communicator(master="127.0.0.1:1", metrics_listen="0.0.0.0:0")
    with pytest.raises(pccl.InvalidArgumentError, match="metrics_token"):
        pccl.Communicator(master="127.0.0.1:1", metrics_listen="127.0.0.1:0",
                          metrics_token="")
    pccl.Communicator(master="127.0.0.1:1", metrics_listen="0.0.0.0:0", metrics_token="t")
    (tmp_path / "token").write_text("from-a-file\n")
    comm = pccl.Communicator.from_env({"PCCL_METRICS_LISTEN": "0.0.0.0:9400",
                                       "PCCL_METRICS_TOKEN_FILE": str(tmp_path / "token")})
    assert (comm.metrics_listen, comm.metrics_token) == ("0.0.0.0:9400", "from-a-file")
    comm = pccl.Communicator.from_env({"PCCL_METRICS_TOKEN": "tok"})
    assert comm.metrics_token == "tok"


# --- 8: the timeline's size ---------------------------------------------------------------

#: What the timeline may take as JSON (pccl.master.status.TIMELINE_MAX_BYTES).
TIMELINE_BOUND = 128 * 1024


async def test_a_huge_timeline_text_is_cut_and_the_timeline_stays_small() -> None:
    async with pccl.MasterNode(listen="127.0.0.1:0", **STATUS) as master, \
            aiohttp.ClientSession() as http:
        monitor = master.monitor
        huge = "x" * (2 << 20)
        monitor.add("dropped", "peer 7 (accepted, group 0) dropped: protocol error: " + huge,
                    (7,))
        entry = monitor.timeline[-1]
        assert entry["text"].startswith("peer 7 (accepted, group 0) dropped: protocol error")
        assert len(entry["text"]) <= 400 and "more characters" in entry["text"]
        # The state's notes (the way a peer's text reaches the timeline) are cut alike.
        monitor.notes([st.Note("dropped", "peer 8 dropped: " + huge, (8,))])
        assert len(monitor.timeline[-1]["text"]) <= 400
        for i in range(2000):
            monitor.add("collective_failed", f"{i}: " + "y" * 10_000, tuple(range(1000)))
        kept = json.dumps(list(monitor.timeline), separators=(",", ":"))
        assert len(kept) <= TIMELINE_BOUND
        assert monitor.timeline[-1]["text"].startswith("1999: ")
        code, text = await get(http, f"http://{master.status_address}/api/status")
        assert code == 200
        assert len(text) <= TIMELINE_BOUND + 16 * 1024
        assert strict_json(text)["timeline"][-1]["text"].startswith("1999: ")
