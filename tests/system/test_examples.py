"""examples/train.py end to end, at its smallest: a master, peer processes behind link
emulators, a byte-level language model on the standard library's source.

- data parallel with int8 all-reduces: the run exits 0, the peers' parameter hashes were
  compared (and agreed) at every check point, bytes were counted (by pccl, and by the
  emulators on both the p2p and the master link), the loss went down;
- a churn run of async DiLoCo with fp8 pseudo-gradients: one peer SIGKILLed during an
  outer step, a fresh peer joining later; the survivors carry on, the joiner's first sync
  gives it the group's exact bytes, and every outer step's hashes agree on every peer.

The checks themselves run in the launcher (a mismatch makes it exit 1); the tests read
its JSON to make sure they really ran.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(400)]

TRAIN = Path(__file__).resolve().parents[2] / "examples" / "train.py"
TINY = ["--size", "tiny", "--batch", "8", "--val-windows", "32", "--bandwidth", "50e6",
        "--latency", "0.005", "--timeout", "300"]


def run_example(tmp_path: Path, *args: str) -> dict[str, Any]:
    out = tmp_path / "result.json"
    proc = subprocess.run([sys.executable, str(TRAIN), *args, *TINY, "--json", str(out)],
                          capture_output=True, text=True, timeout=360)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    assert "training examples: PASS" in proc.stdout
    runs = json.loads(out.read_text())["runs"]
    assert len(runs) == 1
    return runs[0]


def test_ddp_int8(tmp_path: Path) -> None:
    r = run_example(tmp_path, "--mode", "ddp", "--quant", "int8", "--peers", "2",
                    "--steps", "12", "--inner-steps", "4")
    assert r["ok"] and not r["errors"]
    # Hashes compared at steps 0, 4, 8 and 12, on both peers.
    assert r["parity"] == {"points_compared": 4, "ok": True, "problems": [], "joiner": None}
    assert [p[0] for p in r["train_curve"]] == list(range(1, 13))
    assert [v["step"] for v in r["val_curve"]] == [0, 4, 8, 12]
    assert r["val_curve"][-1]["val"] < r["val_curve"][0]["val"]
    # int8 on the wire: a quarter of the float32 bytes (plus piece headers).
    float32_ring = 12 * 2 * (2 - 1) / 2 * 4 * r["params"]
    assert 0.2 * float32_ring < r["tx_bytes_per_peer"] < 0.3 * float32_ring
    assert 0 < r["comm_fraction"] < 1
    # The emulators counted both links of each peer: the ring's bytes on the p2p link
    # (what pccl says it sent, plus handshakes and framing), control traffic on the
    # master link.
    p2p, master = r["p2p_link_bytes_per_peer"], r["master_link_bytes_per_peer"]
    assert r["tx_bytes_per_peer"] <= p2p < 1.05 * r["tx_bytes_per_peer"] + 20_000
    assert master > 0
    assert r["link_bytes_per_peer"] == p2p + master
    assert r["link_bytes_per_outer_step"] == r["link_bytes_per_peer"] / 3
    # Counted at every validation point too, growing with the steps.
    counts = [v["link_bytes"] for v in r["val_curve"]]
    assert counts == sorted(counts) and counts[-1] <= r["link_bytes_per_peer"]


def test_churn_async_diloco_fp8(tmp_path: Path) -> None:
    steps, h = 48, 4
    r = run_example(tmp_path, "--churn", "--mode", "async-diloco", "--quant", "fp8",
                    "--peers", "3", "--steps", str(steps), "--inner-steps", str(h),
                    "--kill-at", "2", "--join-after", "2")
    assert r["ok"] and not r["errors"] and r["parity"]["ok"]
    assert r["kill"]["peer"] == "peer2" and r["kill"]["during_outer_step"] == 2
    join = r["join"]
    assert join["bit_identical"] and join["compared_with"] == ["peer0", "peer1"]
    assert join["outer_step"] >= 2
    # The joiner too reached the master and its peers through emulated links.
    assert r["joiner_link_bytes"]["master"] > 0 and r["joiner_link_bytes"]["p2p"] > 0
    # Every outer step was compared across peers (the initial state and the flush too).
    assert r["parity"]["points_compared"] == steps // h + 2
    by_step: dict[int, list[dict[str, Any]]] = {}
    for o in r["outer_steps"]:
        by_step.setdefault(o["outer_step"], []).append(o)
    # Async mode: the first outer step applies nothing (its reduce runs meanwhile).
    assert {(o["world"], o["applied"]) for o in by_step[1]} == {(0, False)}
    # Between the kill and the join the two survivors reduce on their own...
    assert any(o["world"] == 2 and o["peer"] in ("peer0", "peer1")
               for s in range(2, join["outer_step"] + 1) for o in by_step[s])
    # ...and at the end the joiner is one of three peers that all trained.
    last = [o for o in by_step[steps // h] if not o["flush"]]
    assert sorted(o["peer"] for o in last) == ["joiner", "peer0", "peer1"]
    assert {(o["world"], o["contributors"]) for o in last} == {(3, 3)}
    # The loss curve goes on through the kill and the join: every step was trained.
    assert [p[0] for p in r["train_curve"]] == list(range(1, steps + 1))
