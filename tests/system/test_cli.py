"""The command line: every user mistake is one line on stderr and a non-zero exit status;
--version; every MasterNode option reaches the master; every flag falls back to its
environment variable (pccl/config.py) and a flag given wins.

Every master started here passes ``--status off`` (or a port-0 status address): the
default status address, 127.0.0.1:48180, is one port for every test."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import pccl
import pccl.config
from pccl.protocol import MIN_PROTOCOL_VERSION, PROTOCOL_VERSION

# Shared secrets are keys of at least 128 random bits (pccl.identity.check_secret).
SECRET = "5f0c1a9e7d3b42c8a6e1f0b97c2d4e3a"
OTHER_SECRET = "c0ffee00d15ea5e5b16b00b5a11ce0de"


def clean_env(**pccl_vars: str) -> dict[str, str]:
    """This process's environment without any PCCL_ variable, plus ``pccl_vars``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PCCL_")}
    return {**env, **pccl_vars}


def master(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    status = [] if "--status" in args or (env or {}).get("PCCL_STATUS_LISTEN") \
        else ["--status", "off"]
    return subprocess.run([sys.executable, "-m", "pccl", "master", *status, *args],
                          capture_output=True, text=True, timeout=60, check=False,
                          env=clean_env(**(env or {})))


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
        # The release, and the protocol window a rolling upgrade must stay within.
        assert run.stdout.split()[1] == pccl.__version__
        assert run.stdout.split(None, 2)[2].strip() == (
            f"(protocol {PROTOCOL_VERSION}, works with {MIN_PROTOCOL_VERSION} to "
            f"{PROTOCOL_VERSION})")


@pytest.mark.parametrize(("listen", "words"), [
    ("127.0.0.1:http", ["'127.0.0.1:http'", "port must be a number"]),
    ("127.0.0.1:70000", ["port must be a number in 0..65535"]),
    ("no-such-host.invalid:0", ["unknown host 'no-such-host.invalid'"]),
])
def test_a_bad_listen_address_is_one_line(listen: str, words: list[str]) -> None:
    # (--allow-anonymous: an unknown host is not loopback, and a master off loopback with
    # nothing to authenticate peers is refused first otherwise.)
    assert_one_line_error(master("--listen", listen, "--allow-anonymous"), 2, *words)


def test_an_anonymous_master_off_loopback_is_one_line() -> None:
    assert_one_line_error(master("--listen", "0.0.0.0:0"), 1,
                          "is reachable from other machines", "--allow-anonymous")


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
    (tmp_path / "weak").write_text("s3cret\n")  # a password, not a key
    assert_one_line_error(master("--listen", "127.0.0.1:0", "--secret-file",
                                 str(tmp_path / "weak")), 2, "too weak", "pccl secret new")


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
    flags = {"repair_rings": ["--repair-rings", "--no-repair-rings"],
             "insecure": ["--insecure", "--no-insecure"],
             "status_listen": ["--status"], "status_token": ["--status-token-file"]}
    for name in sorted({"listen", "secret_file", *defaults} - internal):
        for flag in flags.get(name, ["--" + name.replace("_", "-")]):
            assert flag in run.stdout, name
    # ... and each flag's help names the environment variable it falls back to
    for v in pccl.config.variables(pccl.MasterNode):
        if v.param not in internal:
            assert f"${v.name}" in run.stdout, v.name
            if v.file_name:
                assert f"${v.file_name}" in run.stdout, v.file_name
    assert "$PCCL_LOG_LEVEL" in run.stdout
    assert "$PCCL_LOG_FORMAT" in run.stdout


async def test_the_master_runs_with_options_and_stops_on_sigterm(tmp_path: Path) -> None:
    (tmp_path / "secret").write_text(SECRET + "\n")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "pccl", "master", "--listen", "127.0.0.1:0", "--secret-file",
        str(tmp_path / "secret"), "--no-repair-rings", "--establish-timeout", "7",
        "--heartbeat-interval", "0.2", "--heartbeat-timeout", "2", "--log-level", "warning",
        "--status", "off", env=clean_env(),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        async with asyncio.timeout(30):
            line = (await proc.stdout.readline()).decode()  # type: ignore[union-attr]
        assert line.startswith("pccl master listening on 127.0.0.1:"), line
        address = line.split()[-1]
        async with pccl.Communicator(address, secret=SECRET,
                                     p2p_listen_host="127.0.0.1") as comm:
            assert comm.get_attribute(pccl.Attribute.GLOBAL_WORLD_SIZE) == 1
        proc.send_signal(signal.SIGTERM)
        async with asyncio.timeout(30):
            assert await proc.wait() == 0
    finally:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()


UTC_STAMP = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z")


async def test_log_format_json_writes_one_json_object_per_line(tmp_path: Path) -> None:
    # A time zone far from UTC: the timestamps must not follow it.
    before = datetime.datetime.now(datetime.UTC)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "pccl", "master", "--listen", "127.0.0.1:0", "--status", "off",
        "--log-format", "json", "--log-level", "info", env=clean_env(TZ="Asia/Kolkata"),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        async with asyncio.timeout(30):
            line = (await proc.stdout.readline()).decode()  # type: ignore[union-attr]
        async with pccl.Communicator(line.split()[-1], p2p_listen_host="127.0.0.1") as comm:
            me = comm.peer_id
        proc.send_signal(signal.SIGTERM)
        async with asyncio.timeout(30):
            _, err = await proc.communicate()
        assert proc.returncode == 0
    finally:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
    after = datetime.datetime.now(datetime.UTC)
    records = [json.loads(x) for x in err.decode().splitlines()]  # every line is JSON
    assert records
    for r in records:
        assert set(r) == {"ts", "level", "logger", "msg"}, r
        assert UTC_STAMP.fullmatch(r["ts"]), r["ts"]
        when = datetime.datetime.fromisoformat(r["ts"].replace("Z", "+00:00"))
        # (a bracket around the run, wide enough for any clock step but not a time zone)
        assert before - datetime.timedelta(minutes=5) <= when \
            <= after + datetime.timedelta(minutes=5), r["ts"]
    assert any(r["level"] == "INFO" and r["logger"] == "pccl.master.server"
               and r["msg"].startswith(f"peer {me} registered") for r in records), records


async def test_the_default_log_format_is_text_in_utc() -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "pccl", "master", "--listen", "127.0.0.1:0", "--status", "off",
        "--log-level", "debug", env=clean_env(TZ="America/New_York"),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        async with asyncio.timeout(30):
            await proc.stdout.readline()  # type: ignore[union-attr]
        proc.send_signal(signal.SIGTERM)
        async with asyncio.timeout(30):
            _, err = await proc.communicate()
    finally:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
    lines = err.decode().splitlines()
    assert any(" DEBUG pccl.config: MasterNode.from_env(): " in x for x in lines), lines
    for x in lines:
        stamp, level, logger, _ = x.split(" ", 3)
        assert UTC_STAMP.fullmatch(stamp) and level in ("DEBUG", "INFO") \
            and logger.endswith(":"), x


# --- the environment --------------------------------------------------------------------


async def test_every_flag_falls_back_to_its_environment_variable(tmp_path: Path) -> None:
    (tmp_path / "secret").write_text(OTHER_SECRET + "\n")
    env = clean_env(PCCL_MASTER_LISTEN="127.0.0.1:0", PCCL_SECRET_FILE=str(tmp_path / "secret"),
                    PCCL_STATUS_LISTEN="off", PCCL_HEARTBEAT_INTERVAL="0.2",
                    PCCL_HEARTBEAT_TIMEOUT="2", PCCL_REPAIR_RINGS="no",
                    PCCL_MAX_RELAYED_STREAMS="0", PCCL_LOG_LEVEL="debug")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "pccl", "master", env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        async with asyncio.timeout(30):
            line = (await proc.stdout.readline()).decode()  # type: ignore[union-attr]
        assert line.startswith("pccl master listening on 127.0.0.1:"), line
        async with pccl.Communicator(line.split()[-1], secret=OTHER_SECRET,
                                     p2p_listen_host="127.0.0.1") as comm:
            assert comm.get_attribute(pccl.Attribute.GLOBAL_WORLD_SIZE) == 1
        proc.send_signal(signal.SIGTERM)
        async with asyncio.timeout(30):
            _, err = await proc.communicate()
        assert proc.returncode == 0
    finally:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
    stderr = err.decode()
    config_line = next(x for x in stderr.splitlines() if "MasterNode.from_env(): " in x)
    for part in ["listen='127.0.0.1:0' (PCCL_MASTER_LISTEN='127.0.0.1:0')",
                 f"secret=<hidden> (PCCL_SECRET_FILE={str(tmp_path / 'secret')!r})",
                 "heartbeat_interval=0.2 (PCCL_HEARTBEAT_INTERVAL='0.2')",
                 "heartbeat_timeout=2.0 (PCCL_HEARTBEAT_TIMEOUT='2')",
                 "repair_rings=False (PCCL_REPAIR_RINGS='no')",
                 "max_relayed_streams=0 (PCCL_MAX_RELAYED_STREAMS='0')",
                 "status_listen=None (PCCL_STATUS_LISTEN='off')",
                 "establish_timeout=60.0 (default)"]:
        assert part in config_line, part
    assert OTHER_SECRET not in stderr


@pytest.mark.parametrize(("env", "words"), [
    ({"PCCL_HEARTBEAT_INTERVAL": "fast"},
     ["PCCL_HEARTBEAT_INTERVAL='fast' is not valid: expected a number (e.g. 10 or 2.5)"]),
    ({"PCCL_MAX_ESTABLISH_ATTEMPTS": "0"},
     ["max_establish_attempts", ">= 1", "(from the environment: "
      "PCCL_MAX_ESTABLISH_ATTEMPTS='0')"]),
    ({"PCCL_SECRET": "a", "PCCL_SECRET_FILE": "/run/secret"},
     ["both PCCL_SECRET and PCCL_SECRET_FILE are set: set one of them"]),
    ({"PCCL_SECRET_FILE": "/no/such/pccl.secret"},
     ["cannot read the secret file '/no/such/pccl.secret': No such file or directory"]),
    ({"PCCL_STATUS_LISTEN": "0.0.0.0:0"},
     ["status_token", "(from the environment: PCCL_STATUS_LISTEN='0.0.0.0:0')"]),
])
def test_bad_environment_values_are_one_line(env: dict[str, str], words: list[str]) -> None:
    assert_one_line_error(master("--listen", "127.0.0.1:0", env=env), 2, *words)


def test_flags_win_and_the_variables_they_replace_are_not_read() -> None:
    run = master("--listen", "127.0.0.1:0", "--heartbeat-interval", "-1",
                 env={"PCCL_MASTER_LISTEN": "nonsense", "PCCL_HEARTBEAT_INTERVAL": "fast"})
    assert_one_line_error(run, 2, "heartbeat_interval", "positive", "-1")
    assert "PCCL_" not in run.stderr


def test_the_listen_address_comes_from_the_environment() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        run = master(env={"PCCL_MASTER_LISTEN": f"127.0.0.1:{port}"})
    assert_one_line_error(run, 1, f"127.0.0.1:{port}", "Address already in use")


def test_status_token_file_errors_say_status_token_file(tmp_path: Path) -> None:
    assert_one_line_error(
        master("--listen", "127.0.0.1:0", "--status", "127.0.0.1:0", "--status-token-file",
               str(tmp_path / "nope")),
        2, f"cannot read the status token file {str(tmp_path / 'nope')!r}: No such file")
    (tmp_path / "empty").write_text("  \n")
    assert_one_line_error(
        master("--listen", "127.0.0.1:0", "--status", "127.0.0.1:0", "--status-token-file",
               str(tmp_path / "empty")),
        2, f"the status token file {str(tmp_path / 'empty')!r} is empty")


