"""The status page in a real browser (Debian's headless Chromium, driven by selenium
through chromium-driver; nothing is downloaded at run time): peers in real processes,
one SIGKILLed and a joiner admitted while the page stays open, and the page follows
without a reload. The JSON API and the metrics are checked against the same run.

``PCCL_STATUS_SCREENSHOT=docs/img/status.png pytest tests/system/test_status_browser.py``
also saves a screenshot of the page during the run (the one in the README).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from pccl.master.server import MasterNode
from pccl.testing.processes import PeerProcess

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")

pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.alone,
    pytest.mark.timeout(180),
    pytest.mark.skipif(CHROMIUM is None or CHROMEDRIVER is None,
                       reason="needs Debian's chromium and chromium-driver (./dev.sh setup "
                              "installs them when root)"),
]


def start_browser() -> Any:
    webdriver = pytest.importorskip("selenium.webdriver")
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1400,1100", "--no-first-run", "--disable-extensions"):
        opts.add_argument(arg)
    return webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=opts)


async def until(what: str, check: Callable[[], Any], timeout: float = 30.0) -> Any:
    """Polls ``check`` (run in a thread: selenium blocks) until it returns something true."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = await asyncio.to_thread(check)
        if last:
            return last
        await asyncio.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what} (last: {last!r})")


async def test_status_page_follows_a_kill_and_a_join_live() -> None:
    master = MasterNode(listen="127.0.0.1:0", status_listen="127.0.0.1:0",
                        heartbeat_interval=0.25, heartbeat_timeout=3.0)
    await master.start()
    peers: list[PeerProcess] = []
    browser: Any = None
    try:
        first = PeerProcess(master.address)
        peers.append(first)
        await first.start()
        await first.wait_accepted()
        rest = [PeerProcess(master.address) for _ in range(2)]
        peers += rest
        for p in rest:
            await p.start()
        await master.wait_for(lambda s: len(s.pending()) == 2)
        await first.call("update_topology")
        for p in rest:
            await p.wait_accepted()
        for p in peers:
            await p.call("make_tensor", name="x", dtype="float32", count=1 << 16, seed=p.peer_id)
        await asyncio.gather(*(p.call("all_reduce", name="x") for p in peers))

        base = f"http://{master.status_address}"
        browser = await asyncio.to_thread(start_browser)
        await asyncio.to_thread(browser.get, base + "/")
        find = browser.find_element
        by_id = "id"

        def text_of(element_id: str) -> str:
            return str(find(by_id, element_id).text)

        await until("3 peers on the page", lambda: text_of("peer-count") == "3")
        await until("the live stream", lambda: text_of("live") == "live")
        # A mark in the page's JS state: a reload would lose it.
        await asyncio.to_thread(browser.execute_script, "window.__pcclMark = 42;")
        assert text_of("collectives") == "1 / 0"
        rows = await asyncio.to_thread(browser.find_elements, "css selector", "#peers tbody tr")
        assert sorted(int(r.get_attribute("data-peer")) for r in rows) == \
            sorted(p.peer_id for p in peers if p.peer_id is not None)
        rings = await asyncio.to_thread(browser.find_elements, "css selector",
                                        "#rings svg circle")
        assert len(rings) == 3

        # SIGKILL one peer: the page shows 2 peers and the drop, without a reload.
        victim = peers[1]
        victim.kill()
        await until("2 peers after the kill", lambda: text_of("peer-count") == "2")
        dropped = await until("the drop on the timeline", lambda: [
            e.text for e in browser.find_elements(
                "css selector", '#timeline li[data-kind="dropped"]')])
        assert any(f"peer {victim.peer_id} " in t for t in dropped), dropped

        # A joiner, admitted by the survivors' update_topology().
        joiner = PeerProcess(master.address)
        peers.append(joiner)
        await joiner.start()
        await master.wait_for(lambda s: len(s.pending()) == 1)
        await until("the joiner waiting on the page",
                    lambda: text_of("pending-count") == "1")
        survivors = [p for p in peers if p is not victim and p is not joiner]
        await asyncio.gather(*(p.call("update_topology") for p in survivors))
        await joiner.wait_accepted()
        await until("3 peers after the join", lambda: text_of("peer-count") == "3")
        admitted = await until("the admission on the timeline", lambda: [
            e.text for e in browser.find_elements(
                "css selector", '#timeline li[data-kind="admitted"]')
            if f"peer {joiner.peer_id} " in e.text])
        assert admitted
        await joiner.call("make_tensor", name="x", dtype="float32", count=1 << 16, seed=9)
        await asyncio.gather(*(p.call("all_reduce", name="x") for p in [*survivors, joiner]))
        await until("the second collective", lambda: text_of("collectives") == "2 / 0")
        assert await asyncio.to_thread(browser.execute_script, "return window.__pcclMark;") == 42
        updates = int(await asyncio.to_thread(
            browser.execute_script, "return document.body.dataset.updates;"))
        assert updates >= 4  # pushed documents, not page loads
        shot = os.environ.get("PCCL_STATUS_SCREENSHOT")
        if shot:
            Path(shot).parent.mkdir(parents=True, exist_ok=True)
            await asyncio.to_thread(browser.save_screenshot, shot)

        # The JSON API and the metrics tell the same story.
        async with aiohttp.ClientSession() as http:
            async with http.get(base + "/api/status") as r:
                st = json.loads(await r.text())
            async with http.get(base + "/metrics") as r:
                metrics = await r.text()
        live_ids = sorted(p.peer_id for p in [*survivors, joiner] if p.peer_id is not None)
        assert sorted(p["id"] for p in st["peers"]) == live_ids
        assert st["collectives"]["ok"] == 2
        kinds = [e["kind"] for e in st["timeline"]]
        assert kinds.count("joined") == 4 and kinds.count("dropped") == 1
        assert 'pccl_peers{state="accepted"} 3.0' in metrics
        assert 'pccl_peers_dropped_total{cause="connection_closed"} 1.0' in metrics
    finally:
        if browser is not None:
            await asyncio.to_thread(browser.quit)
        for p in peers:
            await p.close()
        await master.stop()


async def test_a_token_link_leaves_the_address_bar_and_the_page_works_by_cookie() -> None:
    """``/?token=TOKEN`` typed into a browser: the page ends at ``/``, reads its API and
    its event stream with the cookie it was given, and script cannot read that cookie."""
    master = MasterNode(listen="127.0.0.1:0", status_listen="127.0.0.1:0",
                        status_token="s3cret-token")
    await master.start()
    browser: Any = None
    try:
        base = f"http://{master.status_address}"
        browser = await asyncio.to_thread(start_browser)
        await asyncio.to_thread(browser.get, base + "/?token=s3cret-token")
        assert browser.current_url == base + "/"

        def text_of(element_id: str) -> str:
            return str(browser.find_element("id", element_id).text)

        await until("the master's address from /api/status",
                    lambda: text_of("master-address") == master.address)
        await until("the live stream", lambda: text_of("live") == "live")
        assert await asyncio.to_thread(browser.execute_script,
                                       "return document.cookie;") == ""  # HttpOnly
        # Without the cookie the same URL is refused.
        await asyncio.to_thread(browser.delete_all_cookies)
        await asyncio.to_thread(browser.get, base + "/api/status")
        assert "needs its token" in browser.page_source
    finally:
        if browser is not None:
            await asyncio.to_thread(browser.quit)
        await master.stop()
