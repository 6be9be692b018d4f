"""The systemd units of docs/deploying.md, read from the page itself (the docs cannot
drift from what is tested): ``systemd-analyze verify`` accepts them, and the master's
``ExecStart=`` runs as its ``DynamicUser=`` would.

systemd is not PID 1 here, so nothing is started by systemd. What it does for
``DynamicUser=yes`` and ``LoadCredential=`` is done by hand instead: an unused uid from
the range systemd allocates dynamic users from, a credentials directory only that uid
can read holding copies of root-only (0600) files, ``${CREDENTIALS_DIRECTORY}``
substituted in ``ExecStart=``, and the command run as that uid. The listen addresses
become ``127.0.0.1:0``. The unit the page used to show (reading ``/etc/pccl/secret``
directly) fails there as it failed for an operator: that test keeps the emulation honest.
"""

from __future__ import annotations

import asyncio
import contextlib
import grp
import os
import pwd
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import pytest

import pccl

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "deploying.md"
SYSTEMD_ANALYZE = "/usr/bin/systemd-analyze"
VENV_BIN = "/opt/pccl/venv/bin/"  # where the page installs pccl
#: The unit docs/deploying.md showed before credentials: DynamicUser=yes and a
#: root-only secret file, which the dynamic user cannot read.
OLD_MASTER_UNIT = """\
[Unit]
Description=pccl master
After=network-online.target

[Service]
ExecStart=/opt/pccl/venv/bin/pccl-master --listen 0.0.0.0:48148 --secret-file /etc/pccl/secret
Restart=always
DynamicUser=yes
LoadCredential=secret:/etc/pccl/secret

[Install]
WantedBy=multi-user.target
"""

OTHER_SECRET = "c0ffee00d15ea5e5b16b00b5a11ce0de"

pytestmark = pytest.mark.timeout(60)


def units() -> dict[str, str]:
    """File name -> text of every ``ini`` block of the page whose first line names a file
    in /etc/systemd/system/."""
    found = re.findall(r"```ini\n# /etc/systemd/system/(\S+)\n(.*?)```", DOC.read_text(), re.S)
    return dict(found)


def service_section(unit: str) -> dict[str, list[str]]:
    """The ``[Service]`` section's settings (a key given several times has several
    values), with backslash-continued lines joined and comments left out."""
    out: dict[str, list[str]] = {}
    section = ""
    pending = ""
    for raw in unit.splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith(("#", ";"))):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = pending + line, ""
        if line.startswith("["):
            section = line.strip("[]")
        elif section == "Service":
            key, _, value = line.partition("=")
            out.setdefault(key.strip(), []).append(value.strip())
    return out


def test_the_page_has_a_master_and_a_peer_unit() -> None:
    found = units()
    assert set(found) == {"pccl-master.service", "pccl-peer.service"}
    master = service_section(found["pccl-master.service"])
    assert master["DynamicUser"] == ["yes"]
    assert master["Restart"] == ["always"]
    assert int(master["LimitNOFILE"][0]) >= 65536
    creds = dict(c.split(":", 1) for c in master["LoadCredential"])
    assert creds == {"secret": "/etc/pccl/secret", "status-token": "/etc/pccl/status-token"}
    argv = shlex.split(master["ExecStart"][0])
    # Every credential is read from the credentials directory, nothing from /etc.
    assert argv[argv.index("--secret-file") + 1] == "${CREDENTIALS_DIRECTORY}/secret"
    assert argv[argv.index("--status-token-file") + 1] == "${CREDENTIALS_DIRECTORY}/status-token"
    assert not any(a.startswith("/etc/") for a in argv)
    peer = service_section(found["pccl-peer.service"])
    assert "PCCL_SECRET_FILE=%d/secret" in peer["Environment"]
    assert peer["LoadCredential"] == ["secret:/etc/pccl/secret"]


@pytest.fixture
def bin_dir() -> Iterator[Path]:
    """A stand-in for /opt/pccl/venv/bin, which a uid other than root can use:
    ``pccl-master`` (a launcher of this tree's pccl) and ``python``. The interpreter is
    this one when that uid may run it, else the system's of the same version (this
    venv's may live under /root)."""
    d = Path(tempfile.mkdtemp(prefix="pccl-unit-bin-"))
    try:
        d.chmod(0o755)
        paths = [str(ROOT)] + [p for p in sys.path if p.endswith("site-packages")]
        minor = f"{sys.version_info.major}.{sys.version_info.minor}"
        for interp in (sys.executable, f"/usr/bin/python{minor}"):
            launcher = d / "pccl-master"
            launcher.write_text(f"#!{interp}\nimport sys\nsys.path[:0] = {paths!r}\n"
                                f"from pccl.__main__ import master_main\nmaster_main()\n")
            launcher.chmod(0o755)
            if os.geteuid() != 0 or _runs_as(dynamic_uid(), [str(launcher), "--version"]):
                (d / "python").symlink_to(interp)
                break
        else:
            pytest.skip("no Python interpreter that an unprivileged uid may run")
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _runs_as(uid: int, argv: list[str]) -> bool:
    try:
        run = subprocess.run(argv, user=uid, group=uid, extra_groups=[], cwd="/",
                             capture_output=True, timeout=30, check=False,
                             env={"PATH": "/usr/bin:/bin", "PYTHONDONTWRITEBYTECODE": "1"})
    except PermissionError:
        return False
    return run.returncode == 0


def dynamic_uid() -> int:
    """A uid (and gid) from systemd's dynamic range 61184..65519 that no user or group
    has here."""
    for uid in range(61234, 65519):
        with contextlib.suppress(KeyError):
            pwd.getpwuid(uid)
            continue
        with contextlib.suppress(KeyError):
            grp.getgrgid(uid)
            continue
        return uid
    pytest.skip("no free uid in systemd's dynamic range")


def local_unit(text: str, bin_dir: Path) -> str:
    return text.replace(VENV_BIN, f"{bin_dir}/")


@pytest.mark.skipif(not os.path.exists(SYSTEMD_ANALYZE), reason="needs systemd-analyze")
def test_systemd_analyze_verify_accepts_the_units(bin_dir: Path, tmp_path: Path) -> None:
    # (verify checks that ExecStart's program exists: the stand-in replaces /opt/pccl.)
    files = []
    for name, text in units().items():
        (tmp_path / name).write_text(local_unit(text, bin_dir))
        files.append(str(tmp_path / name))
    run = subprocess.run([SYSTEMD_ANALYZE, "verify", "--man=no", *files],
                         capture_output=True, text=True, timeout=60, check=False)
    # An unknown or malformed setting is only a warning (exit status 0): none may appear.
    assert (run.returncode, run.stderr) == (0, "")
    bad = tmp_path / "pccl-master.service"
    bad.write_text(bad.read_text().replace("DynamicUser=", "DynamicUsr="))
    run = subprocess.run([SYSTEMD_ANALYZE, "verify", "--man=no", str(bad)],
                         capture_output=True, text=True, timeout=60, check=False)
    assert "DynamicUsr" in run.stderr  # (the check above can see a wrong key)


# --- running ExecStart= as the dynamic user ---------------------------------------------


@pytest.fixture
def etc_pccl() -> Iterator[Path]:
    """/etc/pccl as the page makes it: a directory anyone may enter, a secret from
    ``pccl secret new`` and a status token, both 0600 and root's."""
    d = Path(tempfile.mkdtemp(prefix="pccl-unit-etc-"))
    try:
        d.chmod(0o755)
        subprocess.run([sys.executable, "-m", "pccl", "secret", "new", "--out",
                        str(d / "secret")], check=True, capture_output=True, timeout=60)
        token = d / "status-token"
        token.write_text("0123456789abcdef" * 4 + "\n")
        token.chmod(0o600)
        assert (d / "secret").stat().st_mode & 0o777 == 0o600
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def load_credentials(svc: dict[str, list[str]], etc: Path, creds: Path, uid: int) -> None:
    """What ``LoadCredential=`` does: a copy of each file in ``creds``, which only
    ``uid`` may read."""
    for cred in svc.get("LoadCredential", []):
        name, source = cred.split(":", 1)
        copy = creds / name
        shutil.copyfile(etc / Path(source).relative_to("/etc/pccl"), copy)
        os.chown(copy, uid, uid)
        copy.chmod(0o400)
    os.chown(creds, uid, uid)
    creds.chmod(0o500)


@contextlib.asynccontextmanager
async def exec_start_as_dynamic_user(unit: str, bin_dir: Path,
                                     etc: Path) -> AsyncIterator[asyncio.subprocess.Process]:
    """The unit's ``ExecStart=`` started as systemd would start it for ``DynamicUser=yes``
    (see the module docstring); /etc/pccl is ``etc``. Killed and cleaned up on exit."""
    svc = service_section(local_unit(unit, bin_dir))
    assert svc["DynamicUser"] == ["yes"]
    uid = dynamic_uid()
    creds = Path(tempfile.mkdtemp(prefix="pccl-unit-creds-"))
    # StateDirectory=: a directory the service's user owns (systemd makes it).
    state = Path(tempfile.mkdtemp(prefix="pccl-unit-state-"))
    os.chown(state, uid, uid)
    proc: asyncio.subprocess.Process | None = None
    try:
        load_credentials(svc, etc, creds, uid)

        def expand(text: str) -> str:
            for name in ("${CREDENTIALS_DIRECTORY}", "$CREDENTIALS_DIRECTORY", "%d"):
                text = text.replace(name, str(creds))
            text = text.replace("${STATE_DIRECTORY}", str(state))
            return text.replace("/etc/pccl/", f"{etc}/")

        env = {"PATH": "/usr/bin:/bin", "CREDENTIALS_DIRECTORY": str(creds),
               "PYTHONDONTWRITEBYTECODE": "1"}
        for setting in svc.get("Environment", []):
            key, _, value = expand(setting).partition("=")
            env[key] = value
        argv = shlex.split(expand(svc["ExecStart"][0]))
        argv[argv.index("--listen") + 1] = "127.0.0.1:0"
        if "--status" in argv:
            argv[argv.index("--status") + 1] = "127.0.0.1:0"
        else:  # (never the default 127.0.0.1:48180: one port for every test)
            argv += ["--status", "127.0.0.1:0"]
        proc = await asyncio.create_subprocess_exec(
            *argv, user=uid, group=uid, extra_groups=[], cwd="/", env=env,
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE)
        proc.state_dir = state  # type: ignore[attr-defined]  # (for the test to look into)
        yield proc
    finally:
        if proc is not None:
            if proc.returncode is None:
                proc.kill()
            await proc.communicate()
        shutil.rmtree(creds, ignore_errors=True)
        shutil.rmtree(state, ignore_errors=True)


async def addresses(proc: asyncio.subprocess.Process) -> tuple[str, str]:
    """The master's control and status addresses, from its first lines on stdout."""
    assert proc.stdout is not None and proc.stderr is not None
    found: dict[str, str] = {}
    async with asyncio.timeout(30):
        while len(found) < 2:
            line = (await proc.stdout.readline()).decode()
            if not line:
                raise AssertionError(f"the master exited: {await proc.stderr.read()!r}")
            if m := re.match(r"pccl master listening on (\S+)", line):
                found["master"] = m.group(1)
            elif m := re.match(r"status page on http://(\S+)/", line):
                found["status"] = m.group(1)
    return found["master"], found["status"]


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="runs a process as another uid")


@needs_root
async def test_the_master_unit_runs_as_a_dynamic_user(bin_dir: Path, etc_pccl: Path) -> None:
    unit = units()["pccl-master.service"]
    secret = (etc_pccl / "secret").read_text().strip()
    token = (etc_pccl / "status-token").read_text().strip()
    async with exec_start_as_dynamic_user(unit, bin_dir, etc_pccl) as proc:
        master, status = await addresses(proc)
        uid = dynamic_uid()
        assert os.stat(f"/proc/{proc.pid}").st_uid == uid
        # A peer holding the same secret is admitted; a wrong one is refused.
        async with pccl.Communicator(master=master, secret=secret) as comm:
            me = comm.peer_id
            with pytest.raises(pccl.AuthenticationError):
                async with pccl.Communicator(master=master, secret=OTHER_SECRET):
                    pass
            async with aiohttp.ClientSession() as http:
                url = f"http://{status}/api/status"
                async with http.get(url) as r:
                    assert r.status == 401
                async with http.get(url, headers={"Authorization": f"Bearer {token}"}) as r:
                    assert r.status == 200
                    doc = await r.json()
            assert [p["id"] for p in doc["peers"]] == [me]
            assert doc["master"]["authenticated"] is True
        proc.terminate()  # systemctl stop
        async with asyncio.timeout(30):
            assert await proc.wait() == 0
        # StateDirectory=: the timeline was kept where the unit says, by its user.
        kept = proc.state_dir / "timeline.jsonl"  # type: ignore[attr-defined]
        assert os.stat(kept).st_uid == uid
        assert '"kind":"joined"' in kept.read_text()


@needs_root
async def test_the_old_unit_fails_as_its_dynamic_user(bin_dir: Path, etc_pccl: Path) -> None:
    async with exec_start_as_dynamic_user(OLD_MASTER_UNIT, bin_dir, etc_pccl) as proc:
        async with asyncio.timeout(30):
            _, err = await proc.communicate()
        assert proc.returncode == 2
        assert "cannot read the secret file" in err.decode()
        assert "Permission denied" in err.decode()
