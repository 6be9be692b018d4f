"""The operator's key tools (pccl/keys_cli.py): ``python -m pccl secret new``,
``ca new``, ``ca sign``, ``ca revoke``, ``node new`` and ``cert show``. Each test runs the
command line as an operator would, in this process, and checks the files it leaves with
pccl.identity (the same through a child process: tests/system/test_identity_cli.py)."""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

import pytest

from pccl import _core, identity, keys_cli
from pccl.__main__ import main

HEX32 = r"[0-9a-f]{32}"


def pccl(*argv: str | Path) -> int:
    """``python -m pccl ARGV`` in this process: its exit status."""
    with pytest.raises(SystemExit) as exit_info:
        main([str(a) for a in argv])
    code = exit_info.value.code
    assert isinstance(code, int)
    return code


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def node_fingerprint(pub: Path) -> str:
    return _core.key_fingerprint(identity._read(pub, identity.NODE_PUB))


@pytest.fixture
def run_key(tmp_path: Path) -> Path:
    """A run key made by ``ca new``: returns the prefix (``.key`` / ``.pub``)."""
    assert pccl("ca", "new", "--out", tmp_path / "run") == 0
    return tmp_path / "run"


@pytest.fixture
def alice(tmp_path: Path) -> Path:
    """A node key made by ``node new``: returns the prefix."""
    assert pccl("node", "new", "--out", tmp_path / "alice") == 0
    return tmp_path / "alice"


def test_the_groups_offered_are_the_ones_a_handshake_checks() -> None:
    assert set(keys_cli.GROUPS) == {_core.GROUP_PEER, _core.GROUP_MASTER}


def test_secret_new_writes_a_strong_secret_readable_by_the_owner_only(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "secret"
    old = os.umask(0)  # the mode must not depend on the caller's umask
    try:
        assert pccl("secret", "new", "--out", out) == 0
    finally:
        os.umask(old)
    assert mode(out) == 0o600
    raw = out.read_bytes()
    assert identity.check_secret(raw) == raw
    printed = capsys.readouterr().out
    assert "PCCL_SECRET_FILE" in printed and "--secret-file" in printed
    assert raw.decode().strip() not in printed  # the secret itself is never printed


def test_secret_new_refuses_to_overwrite_without_force(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "secret"
    out.write_text("keep me\n")
    out.chmod(0o644)
    assert pccl("secret", "new", "--out", out) == 2
    err = capsys.readouterr().err
    assert err.startswith("python -m pccl secret new: error: ")
    assert "exists already" in err and "--force" in err
    assert out.read_text() == "keep me\n"

    assert pccl("secret", "new", "--out", out, "--force") == 0
    assert mode(out) == 0o600  # --force also takes the others' read access away
    assert identity.check_secret(out.read_bytes()) is not None


def test_secret_new_needs_out(capsys: pytest.CaptureFixture[str]) -> None:
    assert pccl("secret", "new") == 2
    assert "--out" in capsys.readouterr().err


def test_ca_new_and_node_new_write_key_pairs(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert pccl("ca", "new", "--out", tmp_path / "run") == 0
    printed = capsys.readouterr().out
    run_pub = identity._read(tmp_path / "run.pub", identity.RUN_PUB)
    seed = identity._read(tmp_path / "run.key", identity.RUN_KEY)
    assert _core.run_public_key(seed) == run_pub
    assert _core.key_fingerprint(run_pub) in printed
    assert "offline" in printed
    assert mode(tmp_path / "run.key") == 0o600

    assert pccl("node", "new", "--out", tmp_path / "alice") == 0
    printed = capsys.readouterr().out
    secret = identity._read(tmp_path / "alice.key", identity.NODE_KEY)
    node_pub = identity._read(tmp_path / "alice.pub", identity.NODE_PUB)
    assert _core.node_public_key(secret) == node_pub
    assert _core.key_fingerprint(node_pub) in printed
    assert f"ca sign {tmp_path / 'alice.pub'} --key" in printed
    assert mode(tmp_path / "alice.key") == 0o600


@pytest.mark.parametrize("command", ["ca", "node"])
def test_a_new_key_pair_overwrites_nothing_without_force(
        tmp_path: Path, command: str, capsys: pytest.CaptureFixture[str]) -> None:
    # Only the .pub exists: no half pair (a fresh .key beside the old .pub) is left.
    (tmp_path / "k.pub").write_text("old\n")
    assert pccl(command, "new", "--out", tmp_path / "k") == 2
    assert "exists already" in capsys.readouterr().err
    assert not (tmp_path / "k.key").exists()
    assert (tmp_path / "k.pub").read_text() == "old\n"

    assert pccl(command, "new", "--out", tmp_path / "k", "--force") == 0
    assert (tmp_path / "k.pub").read_text() != "old\n"
    assert mode(tmp_path / "k.key") == 0o600


def test_a_signed_certificate_is_accepted_by_identity_load(
        tmp_path: Path, run_key: Path, alice: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    capsys.readouterr()
    before = int(time.time())
    assert pccl("ca", "sign", f"{alice}.pub", "--key", f"{run_key}.key", "--name", "alice",
                "--groups", "master, peer", "--days", "2") == 0
    after = int(time.time())
    printed = capsys.readouterr().out
    cert = tmp_path / "alice.cert"  # the default: NODE.pub with .cert for .pub

    me = identity.load(f"{alice}.key", cert, trust=[f"{run_key}.pub"])
    assert me.checks_certs
    assert me.fingerprint == node_fingerprint(Path(f"{alice}.pub"))

    issuer, node_key, name, groups, not_before, not_after = _core.parse_cert(
        identity._read(cert, identity.CERT))
    assert issuer == identity._read(f"{run_key}.pub", identity.RUN_PUB)
    assert node_key == identity._read(f"{alice}.pub", identity.NODE_PUB)
    assert (name, groups) == ("alice", ["master", "peer"])
    assert before <= not_before <= after
    assert not_after - not_before == 2 * 86400

    assert "alice" in printed and "master, peer" in printed
    assert me.fingerprint in printed
    assert keys_cli._iso(not_after) in printed  # the expiry, as a UTC ISO time
    assert keys_cli._iso(not_after).endswith("Z")


def test_ca_sign_writes_where_out_says_and_keeps_an_existing_cert(
        tmp_path: Path, run_key: Path, alice: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "certs" / "a.cert"
    out.parent.mkdir()
    sign = ("ca", "sign", f"{alice}.pub", "--key", f"{run_key}.key", "--name", "alice",
            "--out", out)
    assert pccl(*sign) == 0
    assert not (tmp_path / "alice.cert").exists()
    first = out.read_text()
    assert pccl(*sign) == 2
    assert "exists already" in capsys.readouterr().err
    assert out.read_text() == first
    assert pccl(*sign, "--force", "--name", "bob") == 0
    assert _core.parse_cert(identity._read(out, identity.CERT))[2] == "bob"


@pytest.mark.parametrize("node_file, message", [
    ("alice.key", "is not a pccl-node-pub-v1 file (it starts with 'pccl-node-key-v1')"),
    ("run.pub", "is not a pccl-node-pub-v1 file (it starts with 'pccl-run-pub-v1')"),
    ("missing.pub", "cannot read"),
])
def test_ca_sign_refuses_the_wrong_kind_of_file(
        tmp_path: Path, run_key: Path, alice: Path, node_file: str, message: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    capsys.readouterr()
    assert pccl("ca", "sign", tmp_path / node_file, "--key", f"{run_key}.key",
                "--name", "alice", "--out", tmp_path / "x.cert") == 2
    err = capsys.readouterr().err
    assert err.startswith("python -m pccl ca sign: error: ")
    assert message in err
    assert "Traceback" not in err
    assert not (tmp_path / "x.cert").exists()


def test_ca_sign_refuses_a_node_key_as_the_run_key(
        tmp_path: Path, alice: Path, capsys: pytest.CaptureFixture[str]) -> None:
    capsys.readouterr()
    assert pccl("ca", "sign", f"{alice}.pub", "--key", f"{alice}.key", "--name", "a") == 2
    assert "is not a pccl-run-key-v1 file" in capsys.readouterr().err
    assert not (tmp_path / "alice.cert").exists()


@pytest.mark.parametrize("extra, message", [
    (("--groups", "masters"), "give one or more of peer, master"),
    (("--groups", ","), "give one or more of peer, master"),
    (("--days", "0"), "days must be in (0, 3660]"),
    (("--days", "nan"), "days must be in (0, 3660]"),
])
def test_ca_sign_refuses_bad_groups_and_days(
        tmp_path: Path, run_key: Path, alice: Path, extra: tuple[str, ...], message: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    capsys.readouterr()
    assert pccl("ca", "sign", f"{alice}.pub", "--key", f"{run_key}.key", "--name", "alice",
                *extra) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "alice.cert").exists()


def test_revoke_versions_the_denylist_and_unrevoke_removes_a_key(
        tmp_path: Path, run_key: Path, alice: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    assert pccl("node", "new", "--out", tmp_path / "bob") == 0
    deny = tmp_path / "deny.list"
    a, b = node_fingerprint(Path(f"{alice}.pub")), node_fingerprint(tmp_path / "bob.pub")
    capsys.readouterr()

    def listed() -> tuple[int, list[str]]:
        _, version, _, fps = _core.parse_denylist(identity.load_denylist(deny))
        return version, [f.hex() for f in fps]

    assert pccl("ca", "revoke", a, "--key", f"{run_key}.key", "--denylist", deny) == 0
    assert listed() == (1, [a])
    printed = capsys.readouterr().out
    assert "version 1" in printed and a in printed

    # Upper case, as a fingerprint may be pasted, names the same key.
    assert pccl("ca", "revoke", b.upper(), a, "--key", f"{run_key}.key",
                "--denylist", deny) == 0
    assert listed() == (2, sorted([a, b]))
    assert "version 2" in capsys.readouterr().out

    assert pccl("cert", "show", deny) == 0
    shown = capsys.readouterr().out
    assert "version:     2" in shown and a in shown and b in shown
    issuer = _core.key_fingerprint(identity._read(f"{run_key}.pub", identity.RUN_PUB))
    assert issuer in shown

    assert pccl("ca", "revoke", a, "--key", f"{run_key}.key", "--denylist", deny,
                "--unrevoke") == 0
    assert listed() == (3, [b])
    printed = capsys.readouterr().out
    assert "version 3" in printed and a not in printed and b in printed

    # A node trusting the run key takes the newest version and denies bob only.
    assert pccl("ca", "sign", f"{alice}.pub", "--key", f"{run_key}.key",
                "--name", "alice") == 0
    me = identity.load(f"{alice}.key", tmp_path / "alice.cert", trust=[f"{run_key}.pub"],
                       denylist=deny)
    assert me.denylist_version == 3
    assert me.is_denied(identity._read(tmp_path / "bob.pub", identity.NODE_PUB))
    assert not me.is_denied(identity._read(f"{alice}.pub", identity.NODE_PUB))


def test_revoke_refuses_a_denylist_of_another_run_key(
        tmp_path: Path, run_key: Path, alice: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    assert pccl("ca", "new", "--out", tmp_path / "other") == 0
    deny = tmp_path / "deny.list"
    fp = node_fingerprint(Path(f"{alice}.pub"))
    assert pccl("ca", "revoke", fp, "--key", tmp_path / "other.key", "--denylist", deny) == 0
    before = deny.read_bytes()
    capsys.readouterr()

    assert pccl("ca", "revoke", fp, "--key", f"{run_key}.key", "--denylist", deny) == 2
    err = capsys.readouterr().err
    assert err.startswith("python -m pccl ca revoke: error: ")
    assert "signed by another run key" in err
    assert deny.read_bytes() == before


def test_revoke_refuses_a_malformed_fingerprint(
        tmp_path: Path, run_key: Path, capsys: pytest.CaptureFixture[str]) -> None:
    deny = tmp_path / "deny.list"
    capsys.readouterr()
    assert pccl("ca", "revoke", "abc", "--key", f"{run_key}.key", "--denylist", deny) == 2
    assert "'abc' is not a key fingerprint (32 hex digits)" in capsys.readouterr().err
    assert not deny.exists()


def test_cert_show_prints_a_certificate(
        tmp_path: Path, run_key: Path, alice: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    assert pccl("ca", "sign", f"{alice}.pub", "--key", f"{run_key}.key",
                "--name", "alice") == 0
    capsys.readouterr()
    assert pccl("cert", "show", tmp_path / "alice.cert") == 0
    shown = capsys.readouterr().out
    _, _, _, _, not_before, not_after = _core.parse_cert(
        identity._read(tmp_path / "alice.cert", identity.CERT))
    issuer = _core.key_fingerprint(identity._read(f"{run_key}.pub", identity.RUN_PUB))
    assert "name:        alice" in shown
    assert "groups:      peer" in shown  # the default group
    assert node_fingerprint(Path(f"{alice}.pub")) in shown
    assert issuer in shown
    assert keys_cli._iso(not_before) in shown and keys_cli._iso(not_after) in shown
    assert "expired" not in shown


def test_cert_show_says_a_past_certificate_is_expired(
        tmp_path: Path, run_key: Path, alice: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    seed = identity._read(f"{run_key}.key", identity.RUN_KEY)
    node_pub = identity._read(f"{alice}.pub", identity.NODE_PUB)
    now = int(time.time())
    raw = _core.sign_cert(seed, node_pub, "alice", ["peer"], now - 3 * 86400, now - 86400)
    cert = tmp_path / "old.cert"
    identity._write(cert, identity.CERT, raw, private=False)
    capsys.readouterr()
    assert pccl("cert", "show", cert) == 0
    shown = capsys.readouterr().out
    assert f"not after:   {keys_cli._iso(now - 86400)} (expired)" in shown


@pytest.mark.parametrize("content, message", [
    (None, "cannot read"),
    ("pccl-run-pub-v1 AAAA\n", "neither a pccl-cert-v1 nor a pccl-denylist-v1 file"),
    ("pccl-cert-v1 not-base64!\n", "is not valid base64"),
    ("pccl-cert-v1 AAAA\n", ""),  # base64 of three zero bytes: no certificate
])
def test_cert_show_refuses_what_is_no_certificate(
        tmp_path: Path, content: str | None, message: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "f"
    if content is not None:
        path.write_text(content)
    assert pccl("cert", "show", path) == 2
    err = capsys.readouterr().err
    assert err.startswith("python -m pccl cert show: error: ")
    assert message in err
    assert len(err.strip().splitlines()) == 1  # one line, never a traceback


