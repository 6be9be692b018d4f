"""bench/master_sizing.py in its smallest configuration: every field of its output is
there and what does not depend on timing is right."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.multiprocess, pytest.mark.alone,  # a measurement
              pytest.mark.skipif(shutil.which("ss") is None,
                                 reason="the bench reads socket counters with ss (iproute2)")]

ROW = ("peers", "phase", "tensor_bytes", "offered_per_s", "achieved_per_s", "collectives",
       "algorithm", "window_s", "master_cpu_pct", "master_rss_mb", "master_fds", "in_mbit_s",
       "out_mbit_s", "in_bytes", "out_bytes", "in_segs", "out_segs", "sockets",
       "sockets_gone", "machine_busy_pct", "peer_procs_cpu_pct")
RUN = ("peers", "peer_procs", "join_s", "master_rss_empty_mb", "master_rss_joined_mb",
       "master_fds_empty", "master_fds_joined", "rss_per_peer_kb", "rows")
SUMMARY = ("heartbeat_in_bytes_per_peer_s", "heartbeat_out_bytes_per_peer_s",
           "heartbeat_cpu_us_per_peer_s", "rss_per_peer_kb",
           *(f"{kind}_{what}_per_peer_collective"
             for kind in ("via_master_1024", "via_master_65536", "ring_1048576")
             for what in ("in_bytes", "out_bytes", "cpu_us")))


def _bench() -> Any:
    path = Path(__file__).resolve().parents[2] / "bench" / "master_sizing.py"
    spec = importlib.util.spec_from_file_location("master_sizing", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


async def test_the_smallest_sizing_run_reports_every_field() -> None:
    bench = _bench()
    res = await bench.main(bench.parse(["--peers", "2", "--seconds", "1", "--rates", "5",
                                        "--big-rate", "5", "--ring-rate", "2"]))
    assert set(res) == {"machine", "settings", "summary", "runs"}
    assert res["machine"]["cpu_model"]
    assert set(SUMMARY) <= set(res["summary"]), sorted(set(SUMMARY) - set(res["summary"]))
    (run,) = res["runs"]
    assert set(RUN) <= set(run)
    assert (run["peers"], run["peer_procs"]) == (2, 1)
    # One control connection per peer, nothing else.
    assert run["master_fds_joined"] - run["master_fds_empty"] == 2
    rows = run["rows"]
    assert [(r["phase"], r["tensor_bytes"], r["offered_per_s"]) for r in rows] == [
        ("idle", 0, None), ("via_master", 1024, 5.0), ("via_master", 65536, 5.0),
        ("ring", 1 << 20, 2.0)]
    for r in rows:
        assert set(ROW) <= set(r), sorted(set(ROW) - set(r))
        assert r["peers"] == 2 and r["sockets"] == 2 and r["sockets_gone"] == 0
    assert [r["algorithm"] for r in rows] == ["", "master", "master", "ring"]
    assert all(r["collectives"] > 0 for r in rows[1:])
    # A via-master collective carries every peer's tensor in and the sum back out.
    big = rows[2]
    assert big["in_bytes"] >= 2 * 65536 * big["collectives"]
    assert big["out_bytes"] >= 2 * 65536 * big["collectives"]
