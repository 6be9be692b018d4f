"""Leak checks around every test: no asyncio tasks, sockets, or child processes left."""

from __future__ import annotations

import asyncio
import gc
import os
from collections.abc import AsyncIterator, Iterator

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
    gc.collect()
    leaked_kids = _children() - kids
    assert not leaked_kids, f"child processes left running: {leaked_kids}"
    leaked = _sockets() - socks
    assert not leaked, f"sockets left open: {sorted(leaked)}"


@pytest_asyncio.fixture(autouse=True)
async def no_leaked_tasks() -> AsyncIterator[None]:
    yield
    me = asyncio.current_task()
    left = [t for t in asyncio.all_tasks() if t is not me and not t.done()]
    assert not left, f"tasks left running: {left}"


# --- tiers ------------------------------------------------------------------------------

#: Each test module's tier (one list; a new module must be put in one, or collection
#: fails): ``unit`` (pure modules: no socket, no process), ``integration`` (in-process
#: clusters on loopback, the link emulator), ``system`` (processes, network namespaces,
#: Slurm, Ray, a browser, notebooks, the CLI). ``./dev.sh test quick`` runs unit and
#: integration (``-m "unit or integration"``); CI runs all three.
TIERS: dict[str, tuple[str, ...]] = {
    "unit": (
        "test_bench_rounds", "test_docs_links", "test_hash", "test_master_state",
        "test_peer_options", "test_peer_state", "test_protocol", "test_recovery",
        "test_scale_sim", "test_sim", "test_tensors", "test_topology_solver",
    ),
    "integration": (
        "test_adversary", "test_adversary_http", "test_adversary_parking", "test_config",
        "test_failover", "test_fuzz", "test_identity", "test_link_emulator",
        "test_long_runs", "test_master_scan", "test_membership", "test_mitm",
        "test_port_clash", "test_quantization", "test_rotation", "test_stragglers",
        "test_strangers", "test_topology", "test_transport_security", "test_user_errors",
        "test_via_master",
    ),
    "system": (
        "test_admin", "test_allreduce", "test_blocking", "test_churn", "test_cli",
        "test_deploy_unit", "test_diloco", "test_doctor", "test_early_start",
        "test_examples", "test_exit", "test_failover_run", "test_faults",
        "test_identity_cli", "test_kubernetes", "test_layers", "test_liveness",
        "test_logging_and_hash", "test_master_restart", "test_master_sizing", "test_mesh",
        "test_multiprocess", "test_nat", "test_netns", "test_notebook",
        "test_optional_numpy", "test_pause", "test_pccl_programs", "test_pytest_plugin",
        "test_ray", "test_sharded_nodes", "test_shared_state", "test_slurm", "test_status",
        "test_status_browser", "test_upgrade",
    ),
}
_TIER_OF = {module: tier for tier, modules in TIERS.items() for module in modules}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        module = item.nodeid.split("::", 1)[0].rsplit("/", 1)[-1].removesuffix(".py")
        tier = _TIER_OF.get(module)
        if tier is None:
            raise pytest.UsageError(f"tests/{module}.py has no tier: add it to TIERS in "
                                    "tests/conftest.py")
        item.add_marker(getattr(pytest.mark, tier))
