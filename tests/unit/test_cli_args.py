"""The master's command line parsed in this process (pccl/__main__.py): which flags override what,
the status address, booleans, log level and format, the doctor's help and the status URL.
(The command line run as a child process: tests/system/test_cli.py.)"""

from __future__ import annotations

import argparse
import logging
import socket
from pathlib import Path

import pytest

import pccl
import pccl.config
from pccl import __main__ as cli

# Shared secrets are keys of at least 128 random bits (pccl.identity.check_secret).
SECRET = "5f0c1a9e7d3b42c8a6e1f0b97c2d4e3a"


@pytest.mark.parametrize(("argv", "env", "kind"), [
    ([], {}, "text"),
    ([], {"PCCL_LOG_FORMAT": "JSON "}, "json"),
    ([], {"PCCL_LOG_FORMAT": "xml"}, "text"),  # warned about at import, ignored
    (["--log-format", "text"], {"PCCL_LOG_FORMAT": "json"}, "text"),
    (["--log-format", "JSON"], {}, "json"),
])
def test_the_log_format(argv: list[str], env: dict[str, str], kind: str) -> None:
    assert cli._log_format(parse(*argv), env) == kind


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    cli._add_master_args(p)
    return p.parse_args(list(argv))


def test_only_the_flags_given_override(tmp_path: Path) -> None:
    (tmp_path / "s").write_text(SECRET + "\n")
    (tmp_path / "t").write_text("tok\n")
    assert cli.master_overrides(parse(), {}) == {"status_listen": "127.0.0.1:48180"}
    args = parse("--listen", "127.0.0.1:0", "--secret-file", str(tmp_path / "s"),
                 "--heartbeat-interval", "0.5", "--heartbeat-timeout", "4",
                 "--handshake-timeout", "3", "--establish-timeout", "9",
                 "--max-establish-attempts", "2", "--recovery-grace", "8", "--no-repair-rings",
                 "--dial-back-timeout", "1", "--max-relayed-streams", "7", "--insecure",
                 "--status", "127.0.0.1:0", "--status-token-file", str(tmp_path / "t"))
    assert cli.master_overrides(args, {}) == {
        "listen": "127.0.0.1:0", "secret": tmp_path / "s", "heartbeat_interval": 0.5,
        "heartbeat_timeout": 4.0, "handshake_timeout": 3.0, "establish_timeout": 9.0,
        "max_establish_attempts": 2, "recovery_grace": 8.0, "repair_rings": False,
        "dial_back_timeout": 1.0, "max_relayed_streams": 7, "insecure": True,
        "status_listen": "127.0.0.1:0", "status_token": "tok"}


@pytest.mark.parametrize(("argv", "env", "status_listen"), [
    ([], {}, "127.0.0.1:48180"),  # pccl-master's own default
    ([], {"PCCL_STATUS_LISTEN": "127.0.0.1:9"}, "127.0.0.1:9"),
    ([], {"PCCL_STATUS_LISTEN": "off"}, None),
    (["--status", "off"], {"PCCL_STATUS_LISTEN": "127.0.0.1:9"}, None),
    (["--status", "127.0.0.1:0"], {"PCCL_STATUS_LISTEN": "127.0.0.1:9"}, "127.0.0.1:0"),
])
def test_the_status_address(argv: list[str], env: dict[str, str],
                            status_listen: str | None) -> None:
    # (The default listen address, 0.0.0.0, needs a secret or an explicit opt-out.)
    m = pccl.MasterNode.from_env(env, **cli.master_overrides(parse(*argv), env),
                                 allow_anonymous=True)
    assert m.status_listen == status_listen


@pytest.mark.parametrize(("argv", "env", "insecure"), [
    ([], {"PCCL_INSECURE": "1"}, True),
    (["--no-insecure"], {"PCCL_INSECURE": "1"}, False),
    (["--insecure"], {"PCCL_INSECURE": "off"}, True),
    ([], {}, False),
])
def test_booleans_can_be_turned_off_by_flag(argv: list[str], env: dict[str, str],
                                            insecure: bool) -> None:
    # (The default listen address, 0.0.0.0, needs a secret or an explicit opt-out.)
    m = pccl.MasterNode.from_env(env, **cli.master_overrides(parse(*argv), env),
                                 allow_anonymous=True)
    assert m.insecure is insecure


@pytest.mark.parametrize(("argv", "env", "level"), [
    ([], {}, logging.INFO),
    ([], {"PCCL_LOG_LEVEL": "debug"}, logging.DEBUG),
    ([], {"PCCL_LOG_LEVEL": "15"}, 15),
    ([], {"PCCL_LOG_LEVEL": "bogus"}, logging.INFO),  # warned about at import, ignored
    (["--log-level", "error"], {"PCCL_LOG_LEVEL": "debug"}, logging.ERROR),
])
def test_the_log_level(argv: list[str], env: dict[str, str], level: int) -> None:
    assert cli._log_level(parse(*argv), env) == level


def test_every_doctor_option_says_what_it_is_for(capsys: pytest.CaptureFixture[str]) -> None:
    from pccl.__main__ import main

    with pytest.raises(SystemExit) as done:
        main(["doctor", "--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    options = [line.split()[0] for line in text.splitlines() if line.startswith("  --")]
    assert "--master" in options and "--trust" in options
    # argparse puts a documented option's help after its flag (or on the next line):
    # every option line is followed by words, not straight by the next option.
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("  --") and line.split()[0] != "--help":
            flag_only = len(line.split()) <= 2
            nxt = lines[i + 1] if i + 1 < len(lines) else ""
            assert not flag_only or (nxt.strip() and not nxt.lstrip().startswith("-")), line


def test_the_status_url_printed_is_one_to_browse_to() -> None:

    from pccl.__main__ import status_url

    assert status_url("127.0.0.1:48180") == "http://127.0.0.1:48180/"
    assert status_url("[::1]:48180") == "http://[::1]:48180/"
    shown = status_url("0.0.0.0:48180")
    assert "0.0.0.0" not in shown
    assert shown.startswith(f"http://{socket.gethostname()}:48180/")
    assert "http://127.0.0.1:48180/" in shown
