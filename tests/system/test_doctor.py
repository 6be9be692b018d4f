"""``pccl doctor`` against real masters: a healthy setup is "ready"; a wrong secret, a
clear-text mismatch or no master at all is a FAIL with advice and a non-zero exit; the
doctor never registers as a peer."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pccl
from pccl.doctor import FAIL, OK, diagnose
from pccl.testing import free_port

SECRET = b"5f0c1a9e7d3b42c8a6e1f0b97c2d4e3a"
WRONG_SECRET = b"c0ffee00d15ea5e5b16b00b5a11ce0de"  # as strong, but another run's


def _levels(report) -> dict[str, str]:
    return {f.check: f.level for f in report.findings}


async def test_a_healthy_setup_is_ready_and_nothing_registers() -> None:
    async with pccl.MasterNode("127.0.0.1:0", secret=SECRET) as master:
        report = await diagnose(master.address, SECRET)
        text = report.render()
        assert not report.failed, text
        levels = _levels(report)
        for check in ("address", "connect", "handshake", "nat", "reachability", "latency",
                      "clock", "throughput"):
            assert levels.get(check) == OK, (check, text)
        assert "the shared secret matches" in text and "no NAT" in text
        assert text.endswith("verdict: ready")
        assert not master.state.peers  # the doctor registered nothing


async def test_a_wrong_or_missing_secret_fails_with_advice() -> None:
    async with pccl.MasterNode("127.0.0.1:0", secret=SECRET) as master:
        for secret in (WRONG_SECRET, None):
            report = await diagnose(master.address, secret)
            assert report.failed, report.render()
            assert _levels(report)["handshake"] == FAIL
            assert "secret" in report.render()
        assert not master.state.peers


async def test_clear_text_against_an_encrypting_master_fails_naming_insecure() -> None:
    async with pccl.MasterNode("127.0.0.1:0") as master:
        report = await diagnose(master.address, insecure=True)
        assert report.failed and "insecure" in report.render()


async def test_no_master_fails_at_connect() -> None:
    report = await diagnose(f"127.0.0.1:{free_port()}", timeout=5.0)
    assert report.failed and _levels(report)["connect"] == FAIL
    assert "is the master running" in report.render()


async def test_the_command_line_exit_status_follows_the_verdict(tmp_path) -> None:
    secret_file = tmp_path / "secret"
    secret_file.write_bytes(SECRET + b"\n")
    async with pccl.MasterNode("127.0.0.1:0", secret=SECRET) as master:
        for secret, want in ((SECRET, 0), (WRONG_SECRET, 1)):
            secret_file.write_bytes(secret)
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "pccl", "doctor", "--master", master.address,
                "--secret-file", str(secret_file), stdout=subprocess.PIPE,
                stderr=subprocess.PIPE)
            async with asyncio.timeout(60):
                out, err = await proc.communicate()
            assert proc.returncode == want, (out.decode(), err.decode())
            assert b"verdict:" in out
