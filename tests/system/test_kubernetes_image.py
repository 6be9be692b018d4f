"""The image's stand-in peer (deploy/Dockerfile's /app/peer.py) runs two peers against a
master and leaves on SIGTERM. (The manifests and the Dockerfile checked as text and against
the Kubernetes schema: tests/unit/test_kubernetes.py.)"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import sys
from pathlib import Path

import pytest

import pccl
from pccl import identity as pccl_identity

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
DOCKERFILE = DEPLOY / "Dockerfile"


def peer_script() -> str:
    match = re.search(r'^COPY <<"EOF" /app/peer.py\n(.*?)^EOF$', DOCKERFILE.read_text(),
                      re.MULTILINE | re.DOTALL)
    assert match is not None
    return match[1]


@pytest.mark.multiprocess
async def test_the_images_peer_script_runs_two_peers_and_leaves_on_sigterm(
        tmp_path: Path) -> None:
    pytest.importorskip("numpy")  # the image installs pccl[numpy]
    script = tmp_path / "peer.py"
    script.write_text(peer_script())
    secret = pccl_identity.new_secret()  # (what the operator puts in secret.yaml)
    (tmp_path / "secret").write_text(secret + "\n")
    base = {k: v for k, v in os.environ.items() if not k.startswith("PCCL_")}
    async with pccl.MasterNode(listen="127.0.0.1:0",
                               secret=secret) as master:
        env = {**base, "PCCL_MASTER": master.address, "PCCL_P2P_LISTEN_HOST": "127.0.0.1",
               "PCCL_SECRET_FILE": str(tmp_path / "secret"), "PCCL_TIMEOUT": "30"}
        procs = []
        try:
            for _ in range(2):
                procs.append(await asyncio.create_subprocess_exec(
                    sys.executable, str(script), env=env, stdout=asyncio.subprocess.PIPE,
                    stderr=asyncio.subprocess.PIPE))

            async def until_two(proc: asyncio.subprocess.Process) -> str:
                assert proc.stdout is not None
                while True:
                    line = (await proc.stdout.readline()).decode()
                    assert line, "the peer exited"
                    if ": 2 peers, sent " in line:
                        return line

            async with asyncio.timeout(60):
                lines = await asyncio.gather(*(until_two(p) for p in procs))
            assert all(re.fullmatch(r"step \d+: 2 peers, sent \d+ bytes\n", x) for x in lines)
            for p in procs:
                p.send_signal(signal.SIGTERM)
            async with asyncio.timeout(60):
                results = [await p.communicate() for p in procs]
            assert [p.returncode for p in procs] == [0, 0], [r[1].decode() for r in results]
        finally:
            for p in procs:
                with contextlib.suppress(ProcessLookupError):
                    p.kill()
                await p.wait()
