"""The master's status server: /api/status, /api/events (SSE), /metrics, /healthz, the
token, the INFO log lines; and a peer's own /metrics (Communicator(metrics_listen=))."""

from __future__ import annotations

import asyncio
import json
import logging
import re
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

import pccl
from pccl.__main__ import DEFAULT_STATUS
from pccl.config import read_secret_file
from pccl.master.status import KEEPALIVE
from pccl.testing.cluster import Cluster

pytestmark = pytest.mark.timeout(60)

STATUS = {"status_listen": "127.0.0.1:0"}


def metric(text: str, name: str, **labels: str) -> float:
    """The value of one sample of the Prometheus text ``text``."""
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    raise AssertionError(f"no sample {name}{labels} in:\n{text}")


async def get(session: aiohttp.ClientSession, url: str, **kw: object) -> tuple[int, str]:
    async with session.get(url, **kw) as r:  # type: ignore[arg-type]
        return r.status, await r.text()


async def test_status_metrics_and_timeline_follow_the_run(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="pccl.master")
    async with Cluster(3, master_kwargs=STATUS) as cluster, aiohttp.ClientSession() as http:
        base = f"http://{cluster.master.status_address}"
        x = [np.full(1000, float(i + 1), dtype=np.float32) for i in range(3)]
        for _ in range(4):
            infos = await asyncio.gather(*(c.all_reduce(a) for c, a in zip(cluster.comms, x)))
        assert all(float(a[0]) == 6.0 * 3**3 for a in x)  # (1+2+3) then x3 three more times
        code, body = await get(http, base + "/api/status")
        assert code == 200
        st = json.loads(body)
        assert st["schema"] == 1
        assert st["master"]["address"] == cluster.master.address
        ids = sorted(c.peer_id for c in cluster.comms)
        assert sorted(p["id"] for p in st["peers"]) == ids
        assert all(p["state"] == "accepted" and p["encrypted"] is True for p in st["peers"])
        assert all(p["path_in"] == "direct" and p["path_out"] == "direct" for p in st["peers"])
        (group,) = st["groups"]
        assert sorted(group["ring"]) == ids and len(group["links"]) == 3
        assert st["collectives"]["ok"] == 4 and st["collectives"]["failed"] == 0
        kinds = [e["kind"] for e in st["timeline"]]
        assert kinds.count("joined") == 3 and "admitted" in kinds and "ring" in kinds

        code, text = await get(http, base + "/metrics")
        assert code == 200
        assert metric(text, "pccl_peers", state="accepted") == 3
        assert metric(text, "pccl_collectives_total", outcome="ok") == 4
        assert metric(text, "pccl_collective_seconds_count") == 4
        assert metric(text, "pccl_collective_bytes_total") == 4 * 1000 * 4
        assert metric(text, "pccl_peers_admitted_total") == 3
        # Byte totals are counters, and no counter carries a "_created" twin series.
        families = {f.name: f.type for f in text_string_to_metric_families(text)}
        assert families["pccl_peer_p2p_tx_bytes"] == "counter"
        assert families["pccl_peer_p2p_rx_bytes"] == "counter"
        assert not [line for line in text.splitlines() if "_created" in line]

        # A peer leaves: the timeline, the peer count and the drop counter say so.
        gone = cluster.comms[2]
        await gone.close()
        await cluster.master.wait_for(lambda s: gone.peer_id not in s.peers)
        st = json.loads((await get(http, base + "/api/status"))[1])
        assert gone.peer_id not in [p["id"] for p in st["peers"]]
        assert any(e["kind"] == "dropped" and e["peers"] == [gone.peer_id]
                   for e in st["timeline"])
        text = (await get(http, base + "/metrics"))[1]
        assert metric(text, "pccl_peers", state="accepted") == 2
        assert metric(text, "pccl_peers_dropped_total", cause="left") == 1
        assert infos[0].tx_bytes > 0

    # The INFO lines an operator reads: one per admission, ring epoch and drop.
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert any(line.startswith("admitted peers") for line in lines), lines
    assert any(line.startswith("ring epoch 1: group 0: ") for line in lines), lines
    assert any(f"peer {gone.peer_id} (accepted, group 0) dropped" in line for line in lines)


async def test_heartbeats_carry_each_peers_traffic_and_the_sync_shows_up() -> None:
    async with Cluster(2, master_kwargs=STATUS) as cluster, aiohttp.ClientSession() as http:
        base = f"http://{cluster.master.status_address}"
        a = [np.arange(100_000, dtype=np.float32) * (i + 1) for i in range(2)]
        infos = await asyncio.gather(*(c.all_reduce(t) for c, t in zip(cluster.comms, a)))
        states = [pccl.SharedState([pccl.TensorInfo("w", np.full(10, 1.5))]) for _ in range(2)]
        for s in states:
            s.revision = 1
        await asyncio.gather(*(c.sync_shared_state(s) for c, s in zip(cluster.comms, states)))
        # Heartbeats (every 0.25 s here) bring the peers' counters to the master.
        me = cluster.comms[0]

        async def reported() -> dict[str, object]:
            while True:
                st = json.loads((await get(http, base + "/api/status"))[1])
                (row,) = [p for p in st["peers"] if p["id"] == me.peer_id]
                if row["tx_bytes"] >= infos[0].tx_bytes:
                    return row
                await asyncio.sleep(0.05)

        row = await asyncio.wait_for(reported(), 10)
        assert row["tx_bytes"] == me.metrics.tx_bytes
        assert row["rx_bytes"] == me.metrics.rx_bytes
        assert row["revision"] == 1
        st = json.loads((await get(http, base + "/api/status"))[1])
        assert st["syncs"]["ok"] == 1 and st["syncs"]["running"] == []
        # Counted, not on the timeline (a run may sync every step); failures would be.
        assert not any(e["kind"].startswith("sync") for e in st["timeline"])


async def test_events_stream_pushes_a_new_document_on_each_change() -> None:
    async with Cluster(1, master_kwargs=STATUS) as cluster, aiohttp.ClientSession() as http:
        base = f"http://{cluster.master.status_address}"
        async with http.get(base + "/api/events") as stream:
            assert stream.status == 200
            assert stream.headers["Content-Type"].startswith("text/event-stream")

            async def next_document() -> dict[str, object]:
                data = b""
                async for line in stream.content:
                    if line.startswith(b"data: "):
                        data = line[6:]
                    elif line == b"\n" and data:
                        return json.loads(data)  # type: ignore[no-any-return]
                raise AssertionError("the stream ended")

            first = await asyncio.wait_for(next_document(), KEEPALIVE * 3)
            assert len(first["peers"]) == 1  # type: ignore[arg-type]
            joiner = cluster.new_comm()
            await cluster.admit([joiner])

            async def until_two() -> dict[str, object]:
                for _ in range(100):
                    doc = await next_document()
                    if len([p for p in doc["peers"] if p["state"] == "accepted"]) == 2:  # type: ignore[attr-defined, index]
                        return doc
                raise AssertionError("the stream never showed the joiner")

            doc = await asyncio.wait_for(until_two(), 20)
            assert any(e["kind"] == "admitted" and e["peers"] == [joiner.peer_id]
                       for e in doc["timeline"])  # type: ignore[attr-defined, index]


async def test_token_guards_everything_but_healthz_and_nothing_writes() -> None:
    kw = {"status_listen": "127.0.0.1:0", "status_token": "s3cret"}
    async with Cluster(1, master_kwargs=kw) as cluster, aiohttp.ClientSession() as http:
        base = f"http://{cluster.master.status_address}"
        for path in ("/", "/api/status", "/metrics", "/api/events"):
            code, body = await get(http, base + path)
            assert code == 401, path
            assert "token" in body
            code, _ = await get(http, base + path + "?token=wrong")
            assert code == 401
        assert await get(http, base + "/healthz") == (200, "ok\n")
        code, body = await get(http, base + "/api/status",
                               headers={"Authorization": "Bearer s3cret"})
        assert code == 200 and json.loads(body)["schema"] == 1
        async with http.get(base + "/?token=s3cret", allow_redirects=False) as r:
            assert r.status == 303  # (what a browser does with it: the test below)
        async with http.post(base + "/api/status?token=s3cret", data=b"{}") as r:
            assert r.status == 405


async def test_a_url_token_is_exchanged_for_a_cookie_and_leaves_the_url() -> None:
    async with pccl.MasterNode(listen="127.0.0.1:0", status_listen="127.0.0.1:0",
                               status_token="s3cret") as master:
        assert master.status_address is not None
        base = f"http://{master.status_address}"
        name = f"pccl-token-{master.status_address.rsplit(':', 1)[1]}"
        async with aiohttp.ClientSession() as http:
            async with http.get(base + "/?token=s3cret&view=peers",
                                allow_redirects=False) as r:
                assert r.status == 303
                assert r.headers["Location"] == "/?view=peers"  # the rest of the query kept
                assert r.headers["Referrer-Policy"] == "no-referrer"
                morsel = r.cookies[name]
                assert (morsel["path"], morsel["httponly"], morsel["samesite"],
                        morsel["secure"]) == ("/", True, "Strict", "")  # plain http
                assert "s3cret" not in r.headers["Set-Cookie"]  # a digest, not the token
            cookie = {"Cookie": f"{name}={morsel.value}"}
            # The cookie alone opens every route, as the token does.
            code, body = await get(http, base + "/", headers=cookie)
            assert code == 200 and "<title>pccl run status</title>" in body
            for path in ("/api/status", "/metrics"):
                assert (await get(http, base + path, headers=cookie))[0] == 200, path
            # A wrong cookie, or the right value under another port's name, does not.
            for wrong in (f"{name}={'0' * 64}", f"{name}=s3cret",
                          f"pccl-token-1={morsel.value}"):
                assert (await get(http, base + "/api/status",
                                  headers={"Cookie": wrong}))[0] == 401, wrong
            # A wrong token in the URL gets no cookie.
            async with http.get(base + "/api/status?token=s3cre",
                                allow_redirects=False) as r:
                assert r.status == 401 and "Set-Cookie" not in r.headers
            # Programs keep the header.
            code, body = await get(http, base + "/api/status",
                                   headers={"Authorization": "Bearer s3cret"})
            assert code == 200 and json.loads(body)["schema"] == 1
        # A client that keeps cookies, as a browser: one request with the token in the
        # URL lands on the page without it, and what follows needs no token.
        async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as browser:
            async with browser.get(base + "/?token=s3cret") as r:
                assert r.status == 200 and str(r.url) == base + "/"
                assert "<title>pccl run status</title>" in await r.text()
            assert (await get(browser, base + "/api/status"))[0] == 200
            async with browser.get(base + "/api/events") as stream:
                assert stream.status == 200
                assert (await stream.content.readline()).startswith(b"event: status")


def test_status_on_another_machines_reach_needs_a_token() -> None:
    with pytest.raises(pccl.InvalidArgumentError, match="status_token"):
        pccl.MasterNode(listen="127.0.0.1:0", status_listen="0.0.0.0:0")
    pccl.MasterNode(listen="127.0.0.1:0", status_listen="0.0.0.0:0", status_token="t")


async def test_status_port_in_use_fails_start_with_the_port_named() -> None:
    async with pccl.MasterNode(listen="127.0.0.1:0", status_listen="127.0.0.1:0") as first:
        taken = first.status_address
        second = pccl.MasterNode(listen="127.0.0.1:0", status_listen=taken)
        with pytest.raises(OSError, match="status server cannot listen"):
            await second.start()
        assert second.status_address is None


async def test_peer_metrics_count_links_collectives_and_retries() -> None:
    # The link counters are the ring's: the mesh is off, so that 128 KiB (above the
    # master's 64 KiB) takes the ring whatever the cost model would pick.
    async with Cluster(2, comm_kwargs={"metrics_listen": "127.0.0.1:0"},
                       master_kwargs={"mesh_max_bytes": 0}) as cluster, \
            aiohttp.ClientSession() as http:
        a = [np.ones(1 << 15, dtype=np.float32) for _ in range(2)]  # 128 KiB: the ring
        infos = await asyncio.gather(*(c.all_reduce(t) for c, t in zip(cluster.comms, a)))
        assert {i.algorithm for i in infos} == {"ring"}
        me, other = cluster.comms
        code, text = await get(http, f"http://{me._metrics_server.address}/metrics")  # type: ignore[union-attr]
        assert code == 200
        assert metric(text, "pccl_peer_collectives_total", outcome="ok") == 1
        assert metric(text, "pccl_peer_collective_seconds_count") == 1
        assert metric(text, "pccl_peer_link_tx_bytes_total", to=str(other.peer_id)) \
            == infos[0].tx_bytes
        assert metric(text, "pccl_peer_link_rx_bytes_total", **{"from": str(other.peer_id)}) \
            == infos[0].rx_bytes
        assert metric(text, "pccl_peer_p2p_tx_bytes_total") == infos[0].tx_bytes
        assert not [line for line in text.splitlines() if "_created" in line]


async def test_a_restarted_master_logs_and_counts_the_recovery(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="pccl.master")
    fast = {"heartbeat_interval": 0.2, "heartbeat_timeout": 2.0, **STATUS}
    async with Cluster(2, master_kwargs=fast) as cluster, aiohttp.ClientSession() as http:
        address = cluster.master.address
        await cluster.master.stop()
        cluster.master = pccl.MasterNode(listen=address, **fast)  # type: ignore[arg-type]
        await cluster.master.start()
        await cluster.master.wait_for(lambda s: len(s.accepted()) == 2, timeout=30)
        base = f"http://{cluster.master.status_address}"
        st = json.loads((await get(http, base + "/api/status"))[1])
        resumed = [e for e in st["timeline"] if e["kind"] == "resume"]
        assert sorted(e["peers"][0] for e in resumed) == sorted(c.peer_id for c in cluster.comms)
        text = (await get(http, base + "/metrics"))[1]
        assert metric(text, "pccl_master_restarts_total") == 1
        assert metric(text, "pccl_peers_resumed_total") == 2
    assert sum("came back after a master restart" in r.getMessage()
               for r in caplog.records if r.levelno == logging.INFO) == 2


@pytest.mark.multiprocess
async def test_pccl_master_serves_its_status_page_and_says_where() -> None:
    import os
    import sys

    from pccl.testing.processes import stop_process

    env = {k: v for k, v in os.environ.items() if not k.startswith("PCCL_")}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "pccl", "master", "--listen", "127.0.0.1:0",
        "--status", "127.0.0.1:0", stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL, env=env)
    try:
        assert proc.stdout is not None
        async with asyncio.timeout(30):
            first = (await proc.stdout.readline()).decode()
            second = (await proc.stdout.readline()).decode()
        assert first.startswith("pccl master listening on 127.0.0.1:")
        assert second.startswith("status page on http://127.0.0.1:")
        url = second.split()[-1]
        async with aiohttp.ClientSession() as http:
            code, body = await get(http, url + "api/status")
            assert code == 200
            st = json.loads(body)
            assert st["master"]["address"] == first.split()[-1] and st["peers"] == []
            assert await get(http, url + "healthz") == (200, "ok\n")
    finally:
        await stop_process(proc)
        if proc._transport is not None:  # type: ignore[attr-defined]
            proc._transport.close()  # type: ignore[attr-defined]


def test_import_pccl_leaves_aiohttp_for_those_who_serve() -> None:
    """aiohttp takes a fifth of a second to import: every peer process would pay it."""
    import subprocess
    import sys

    code = ("import sys, pccl, pccl.blocking\n"
            "c = pccl.Communicator(master='127.0.0.1:1')\n"
            "m = pccl.MasterNode(listen='127.0.0.1:0')\n"
            "print('aiohttp' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True)
    assert out.stdout.strip() == "False"


def documented_scrape_configs() -> list[dict[str, Any]]:
    """The ``scrape_configs`` of the Prometheus example in docs/operations.md."""
    yaml = pytest.importorskip("yaml")
    doc = (Path(__file__).resolve().parents[2] / "docs" / "operations.md").read_text()
    found = re.search(r"```yaml\n# prometheus.yml\n(.*?)```", doc, re.S)
    assert found, "no prometheus.yml block in docs/operations.md"
    jobs: list[dict[str, Any]] = yaml.safe_load(found.group(1))["scrape_configs"]
    return jobs


async def test_the_documented_prometheus_scrape_configs_work(tmp_path: Path) -> None:
    """Each job of the example, scraped as Prometheus would (scheme, path, and the
    ``authorization`` header from its credentials file, whitespace trimmed) from a
    master whose token file is that same file, and a peer likewise."""
    jobs = {str(j["job_name"]): j for j in documented_scrape_configs()}
    assert set(jobs) == {"pccl-master", "pccl-peers"}
    master_target = jobs["pccl-master"]["static_configs"][0]["targets"][0]
    assert master_target.rsplit(":", 1)[1] == DEFAULT_STATUS.rsplit(":", 1)[1]
    files: dict[str, Path] = {}
    for name, token in (("pccl-master", "st4tus-token"), ("pccl-peers", "m3trics-token")):
        doc_path = Path(jobs[name]["authorization"]["credentials_file"])
        files[name] = tmp_path / doc_path.name
        files[name].write_text(token + "\n")  # (as an editor leaves it)
    # Each server reads its token from the file its scraper reads, as pccl-master does.
    master_kw = {"status_listen": "127.0.0.1:0",
                 "status_token": read_secret_file(files["pccl-master"]).decode()}
    comm_kw = {"metrics_listen": "127.0.0.1:0",
               "metrics_token": read_secret_file(files["pccl-peers"]).decode()}
    async with Cluster(1, master_kwargs=master_kw, comm_kwargs=comm_kw) as cluster, \
            aiohttp.ClientSession() as http:
        peer_server = cluster.comms[0]._metrics_server
        assert peer_server is not None
        where = {"pccl-master": cluster.master.status_address, "pccl-peers": peer_server.address}
        expect = {"pccl-master": "pccl_master_uptime_seconds",
                  "pccl-peers": "pccl_peer_collectives_total"}
        for name, job in jobs.items():
            auth = job["authorization"]
            path = job.get("metrics_path", "/metrics")
            url = f"{job.get('scheme', 'http')}://{where[name]}{path}"
            # Prometheus: the file's contents with surrounding whitespace trimmed.
            header = f"{auth.get('type', 'Bearer')} {files[name].read_text().strip()}"
            async with http.get(url, headers={"Authorization": header},
                                allow_redirects=False) as r:
                assert r.status == 200, name
                assert r.headers["Content-Type"].startswith("text/plain")
                body = await r.text()
            assert expect[name] in body, name
            async with http.get(url, allow_redirects=False) as r:
                assert r.status == 401, name
