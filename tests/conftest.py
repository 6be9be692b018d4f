"""Leak checks around every test: no asyncio tasks, sockets, or child processes left."""

from __future__ import annotations

import asyncio
import gc
import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import pytest_asyncio

# pccl's fixtures (pccl_master, pccl_cluster, ...): the plugin is opt-in, as for any user.
pytest_plugins = ["pccl.testing.plugin"]

# Every Python process a test starts (peers, masters, orchestrators) prints the stacks of
# all its threads to stderr if it dies of SIGSEGV, SIGBUS, SIGFPE, SIGILL or SIGABRT: a
# crash in a peer's log then says where, instead of only "exited with -11".
os.environ.setdefault("PYTHONFAULTHANDLER", "1")


def _sockets() -> set[str]:
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:"):
            out.add(f"{fd}->{target}")
    return out


def _children() -> set[int]:
    kids: set[int] = set()
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/children") as f:
                kids.update(int(x) for x in f.read().split())
        except OSError:
            continue
    return kids


@pytest.fixture(autouse=True)
def no_leaked_sockets_or_processes() -> Iterator[None]:
    socks, kids = _sockets(), _children()
    yield
    # What only a reference cycle still holds is closed here, in the test that made it.
    # The survivors are then frozen (gc.freeze): the next test's collection walks only
    # what that test allocated, not the whole heap again (~0.3 s a test with torch
    # loaded, a quarter of the suite's time).
    gc.collect()
    gc.freeze()
    leaked_kids, leaked = _children() - kids, _sockets() - socks
    assert not leaked_kids, f"child processes left running: {leaked_kids}"
    assert not leaked, f"sockets left open: {sorted(leaked)}"


def pytest_unconfigure(config: pytest.Config) -> None:
    # Back into the collector for the interpreter's shutdown: extensions that count their
    # objects at exit (torch's nanobind parts) report everything still frozen as leaked.
    gc.unfreeze()


@pytest_asyncio.fixture(autouse=True)
async def no_leaked_tasks() -> AsyncIterator[None]:
    yield
    me = asyncio.current_task()
    left = [t for t in asyncio.all_tasks() if t is not me and not t.done()]
    assert not left, f"tasks left running: {left}"


# --- tiers ------------------------------------------------------------------------------

#: The tiers, one folder of tests/ each; a test module's folder is its tier and its marker
#: (a module in none fails collection): ``unit`` (pure modules: no socket, no process),
#: ``integration`` (in-process clusters on loopback, the link emulator), ``system``
#: (processes, network namespaces, Slurm, Ray, a browser, notebooks, the CLI).
#: ``./dev.sh test quick`` runs tests/unit and tests/integration; CI runs all three.
#: Helpers shared by tiers (reference.py, bare_env.py, ...) stay in tests/ itself, which
#: pyproject.toml puts on sys.path (``pythonpath``).
TIERS = ("unit", "integration", "system")
_TESTS = Path(__file__).resolve().parent


def _tier(path: Path) -> str | None:
    try:
        parts = path.resolve().relative_to(_TESTS).parts
    except ValueError:
        return None
    return parts[0] if len(parts) > 1 and parts[0] in TIERS else None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        tier = _tier(item.path)
        if tier is None:
            raise pytest.UsageError(
                f"{item.path} is in no tier: move it into tests/unit/, tests/integration/ "
                "or tests/system/ (tests/conftest.py)")
        item.add_marker(getattr(pytest.mark, tier))
