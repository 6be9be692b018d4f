"""Test support for pccl and for code built on it.

- :class:`Cluster`: an in-process master and N accepted communicators in one event loop.
- :class:`PeerProcess`: a peer in a real subprocess, driven over stdin/stdout, that a test
  can SIGKILL or SIGSTOP.
- :class:`LinkEmulator`: a userspace TCP proxy adding latency, bandwidth caps and faults.
- :class:`HeldMessage`: holds back one message from the master to a communicator.
- :func:`crash`: an in-process peer vanishes as a killed process does.
- The pytest plugin ``pccl.testing.plugin`` provides fixtures; it is opt-in
  (``pytest -p pccl.testing.plugin`` or ``pytest_plugins = ["pccl.testing.plugin"]``).
"""

from pccl.testing.cluster import Cluster, connect_all
from pccl.testing.crash import crash
from pccl.testing.delivery import HeldMessage
from pccl.testing.processes import PeerProcess, free_port, stop_process

__all__ = ["Cluster", "HeldMessage", "PeerProcess", "connect_all", "crash", "free_port",
           "stop_process"]

try:  # the emulator is optional at import time while it is being developed
    from pccl.testing.link_emulator import LinkEmulator  # noqa: F401

    __all__.append("LinkEmulator")
except ImportError:  # pragma: no cover
    pass
