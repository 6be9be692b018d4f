"""PCCL's own loops under churn (issue 16), bounded for CI: each idiom through
pccl.blocking and through the asyncio API for ~20 s of SIGKILLs and spawns every
0.5-2 s. Long runs by hand: ``python -m pccl.testing.pccl_programs --minutes 10``
(figures in docs/reliability.md)."""

from __future__ import annotations

import asyncio
import json
import sys

import numpy as np
import pytest

from pccl.testing import pccl_programs


def test_replay_is_the_sum_of_the_gradients() -> None:
    replay = pccl_programs.Replay(1000)
    state = pccl_programs.initial_state(1000)
    for k in (1, 2, 3):
        state = state + pccl_programs.gradient(k, 1000)
    assert replay.digest(3) == pccl_programs.digest(state)
    assert replay.digest(0) != replay.digest(1)
    g = pccl_programs.gradient(5, 1000, salt=3)
    assert np.all(g != 0) and np.all(np.abs(g) <= 8) and np.all(g == np.round(g))


def _log_tails(run_dir, problems: list[str]) -> str:
    """The ends of the run's logs, those of the peers a problem names first (a crashed
    peer's log holds its faulthandler stacks)."""
    paths = sorted(run_dir.glob("*.log"))
    named = [p for p in paths if any(f"{p.stem}:" in q or f"{p.stem} " in q for q in problems)]
    return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-4000:]}"
                     for p in named + [p for p in paths if p not in named])


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("api", pccl_programs.APIS)
@pytest.mark.parametrize("idiom", pccl_programs.IDIOMS)
async def test_pccl_idiom_survives_churn(idiom: str, api: str, tmp_path) -> None:
    out = tmp_path / "fig.json"
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "pccl.testing.pccl_programs", "--idiom", idiom, "--api", api,
        "--seconds", "20", "--seed", "3", "--run-dir", str(tmp_path / "logs"),
        "--json", str(out), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    try:
        async with asyncio.timeout(270):
            stdout, _ = await proc.communicate()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    text = stdout.decode(errors="replace")
    fig = json.loads(out.read_text())
    logs = _log_tails(tmp_path / "logs", fig.get("problems", [])) if proc.returncode else ""
    assert proc.returncode == 0, f"{text[-3000:]}\n{logs[:12000]}"
    assert fig["hangs"] == fig["crashes"] == fig["parity_violations"] == 0
    assert fig["rollbacks"] == fig["reduce_violations"] == 0
    assert fig["steps"] >= 20 and fig["syncs_checked"] >= 4 and fig["kills"] >= 2
