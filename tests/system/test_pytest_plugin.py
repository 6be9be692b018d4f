"""Installing pccl must not change anyone's pytest runs: its fixtures are opt-in.

Each test runs pytest in a child interpreter whose import path holds only what a user's
fresh environment would: pytest and its dependencies, numpy, msgpack and pccl with its
installed metadata (entry points included), and, where a test says so, pytest-asyncio.
"""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

import bare_env
import pytest


def _environment(tmp: Path, extra: list[str]) -> dict[str, str]:
    return bare_env.environment(tmp, ["pytest", "pccl", *extra])


def _pytest(tmp: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-S", "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
        cwd=tmp, env=env, capture_output=True, text=True, timeout=120, check=False)


def test_installed_pccl_does_not_register_a_pytest_plugin() -> None:
    eps = importlib.metadata.distribution("pccl").entry_points
    assert [ep for ep in eps if ep.group == "pytest11"] == []


def test_a_users_plain_pytest_run_is_untouched(tmp_path: Path) -> None:
    """No pytest-asyncio installed, pccl installed: a trivial test runs and passes, and
    pccl is not imported behind the user's back."""
    env = _environment(tmp_path, [])
    (tmp_path / "test_trivial.py").write_text(
        "import sys\n\n"
        "def test_sum():\n"
        "    assert 1 + 1 == 2\n"
        "    assert 'pccl' not in sys.modules\n")
    run = _pytest(tmp_path, env, "test_trivial.py")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "1 passed" in run.stdout


def test_opting_in_without_pytest_asyncio_says_what_is_missing(tmp_path: Path) -> None:
    env = _environment(tmp_path, [])
    (tmp_path / "test_trivial.py").write_text("def test_sum():\n    assert 1 + 1 == 2\n")
    run = _pytest(tmp_path, env, "-p", "pccl.testing.plugin", "test_trivial.py")
    assert run.returncode != 0
    assert "pccl.testing.plugin needs pytest-asyncio" in run.stdout + run.stderr


@pytest.mark.multiprocess
def test_opting_in_from_a_conftest_gives_the_fixtures(tmp_path: Path) -> None:
    env = _environment(tmp_path, ["pytest-asyncio"])
    (tmp_path / "conftest.py").write_text('pytest_plugins = ["pccl.testing.plugin"]\n')
    (tmp_path / "test_master.py").write_text(
        "import pytest\n\n"
        "@pytest.mark.asyncio\n"
        "async def test_master_listens(pccl_master):\n"
        "    assert pccl_master.address.startswith('127.0.0.1:')\n")
    run = _pytest(tmp_path, env, "test_master.py")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "1 passed" in run.stdout
