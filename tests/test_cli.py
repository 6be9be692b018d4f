"""The command line: every user mistake is one line on stderr and a non-zero exit status;
--version; every MasterNode option reaches the master."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import pccl


def master(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pccl", "master", *args],
                          capture_output=True, text=True, timeout=60, check=False)


def assert_one_line_error(run: subprocess.CompletedProcess[str], code: int, *words: str) -> None:
    assert run.returncode == code, (run.returncode, run.stderr)
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1, run.stderr  # no traceback
    assert lines[0].startswith("python -m pccl master: error: "), lines[0]
    for w in words:
        assert w in lines[0], lines[0]


def test_version() -> None:
    for cmd in ([sys.executable, "-m", "pccl", "--version"],
                [sys.executable, "-c", "from pccl.__main__ import master_main; master_main()",
                 "--version"]):
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=True)
        assert run.stdout.split()[-1] == pccl.__version__


@pytest.mark.parametrize(("listen", "words"), [
    ("127.0.0.1:http", ["'127.0.0.1:http'", "port must be a number"]),
    ("127.0.0.1:70000", ["port must be a number in 0..65535"]),
    ("no-such-host.invalid:0", ["unknown host 'no-such-host.invalid'"]),
])
def test_a_bad_listen_address_is_one_line(listen: str, words: list[str]) -> None:
    assert_one_line_error(master("--listen", listen), 2, *words)


def test_a_port_in_use_is_one_line() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        run = master("--listen", f"127.0.0.1:{port}")
    assert_one_line_error(run, 1, f"127.0.0.1:{port}", "Address already in use")


def test_a_missing_or_empty_secret_file_is_one_line(tmp_path: Path) -> None:
    assert_one_line_error(master("--listen", "127.0.0.1:0", "--secret-file",
                                 str(tmp_path / "nope")), 2, "No such file", "nope")
    (tmp_path / "empty").write_text("\n")
    assert_one_line_error(master("--listen", "127.0.0.1:0", "--secret-file",
                                 str(tmp_path / "empty")), 2, "is empty")


@pytest.mark.parametrize(("args", "words"), [
    (["--heartbeat-interval", "-1"], ["heartbeat_interval", "positive"]),
    (["--heartbeat-timeout", "0.5"], ["heartbeat_timeout=0.5", "must exceed"]),
    (["--establish-timeout", "nan"], ["establish_timeout", "positive"]),
    (["--max-establish-attempts", "0"], ["max_establish_attempts", ">= 1"]),
])
def test_bad_option_values_are_one_line(args: list[str], words: list[str]) -> None:
    assert_one_line_error(master("--listen", "127.0.0.1:0", *args), 2, *words)


def test_an_unknown_option_is_argparse_usage() -> None:
    run = master("--no-such-option")
    assert run.returncode == 2 and "unrecognized arguments: --no-such-option" in run.stderr


def test_every_master_node_option_is_on_the_command_line() -> None:
    run = master("--help")
    defaults = pccl.MasterNode.__init__.__kwdefaults__ or {}
    internal = {"max_frame"}  # a protocol limit, not a deployment setting
    flags = {"repair_rings": ["--repair-rings", "--no-repair-rings"]}
    for name in sorted({"listen", "secret_file", *defaults} - internal):
        for flag in flags.get(name, ["--" + name.replace("_", "-")]):
            assert flag in run.stdout, name


async def test_the_master_runs_with_options_and_stops_on_sigterm(tmp_path: Path) -> None:
    (tmp_path / "secret").write_text("s3cret\n")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "pccl", "master", "--listen", "127.0.0.1:0", "--secret-file",
        str(tmp_path / "secret"), "--no-repair-rings", "--establish-timeout", "7",
        "--heartbeat-interval", "0.2", "--heartbeat-timeout", "2", "--log-level", "warning",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        async with asyncio.timeout(30):
            line = (await proc.stdout.readline()).decode()  # type: ignore[union-attr]
        assert line.startswith("pccl master listening on 127.0.0.1:"), line
        address = line.split()[-1]
        async with pccl.Communicator(address, secret=b"s3cret",
                                     p2p_listen_host="127.0.0.1") as comm:
            assert comm.get_attribute(pccl.Attribute.GLOBAL_WORLD_SIZE) == 1
        proc.send_signal(signal.SIGTERM)
        async with asyncio.timeout(30):
            assert await proc.wait() == 0
    finally:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
