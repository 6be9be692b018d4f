"""The churn soak, bounded for CI: ~60 s of kills, joins, leaves, link faults and master
restarts with a fixed seed; every figure that must be zero is zero."""

from __future__ import annotations

import asyncio
import json
import sys

import numpy as np
import pytest

from pccl.testing import churn


def test_replay_matches_a_direct_computation() -> None:
    sz = churn.Sizes(params=1000, moment=500, quant=100)
    state = churn.initial_state(sz)
    for k in (1, 2, 3):
        state = churn.apply_update(state, k, *churn.gradients(k, sz))
    replay = churn.Replay(sz)
    assert replay.digest(3) == churn.state_digest(state)
    assert replay.digest(1) != replay.digest(2)  # every step changes the state
    assert int(state["step"][0]) == 3


def test_bfloat16_rounding_is_exact_for_small_integers() -> None:
    x = np.arange(-300, 301, dtype=np.float32)
    bits = churn.f32_to_bf16_bits(x)
    back = churn.bf16_bits_to_f32(bits)
    exact = np.abs(x) <= 256
    assert np.array_equal(back[exact], x[exact])
    # Round to nearest even: 257 lies halfway between 256 and 258.
    assert churn.bf16_bits_to_f32(churn.f32_to_bf16_bits(np.float32([257.0])))[0] == 256.0


@pytest.mark.multiprocess
@pytest.mark.alone  # a soak: its peers' timers assume the CPUs are theirs
@pytest.mark.timeout(400)
@pytest.mark.parametrize("failover", [False, True], ids=["one-master", "failover"])
async def test_bounded_churn_soak(tmp_path, failover: bool) -> None:
    """With ``failover``: two masters, the second a standby; each master kill moves the
    group to the other (a master kill every 12 s at least)."""
    out = tmp_path / "churn.json"
    extra = ["--failover", "--master-kill-every", "12"] if failover else []
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "pccl.testing.churn", "--peers", "4", "--seconds", "45",
        "--seed", "7", "--chaos-interval", "1.5", "--params", "262144", *extra,
        "--json", str(out), "--run-dir", str(tmp_path / "logs"),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    try:
        async with asyncio.timeout(360):
            stdout, _ = await proc.communicate()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    text = stdout.decode(errors="replace")
    last = text.strip().splitlines()[-1]
    fig = json.loads(out.read_text())
    logs = "\n".join(p.read_text(errors="replace")[-3000:]
                     for p in sorted((tmp_path / "logs").glob("*.log"))) if fig["hangs"] else ""
    assert proc.returncode == 0, f"{last}\n{json.dumps(fig, indent=1)}\n{logs}"
    assert last.startswith("churn PASS")
    assert fig["hangs"] == fig["parity_violations"] == fig["leaks"] == 0
    assert fig["steps"] >= 10 and fig["peer_steps"] > fig["steps"]
    assert fig["kills"] + fig["graceful_leaves"] >= 3 and fig["joins"] >= 2
    if failover:
        assert fig["master_kills"] >= 2
