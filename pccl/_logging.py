"""pccl's logging set-up, done once by ``import pccl``.

Everything pccl logs goes to Python's :mod:`logging` under the ``pccl`` logger: the
Python side under ``pccl.communicator``, ``pccl.master``, ... and the Rust core under
``pccl._core...`` (``pccl._core.net.node``: refused p2p connections, streams accepted;
``pccl._core.py.ring``: rings installed), each record at its own level and at the moment
it happens. pccl attaches no handler of its own unless asked to::

    PCCL_LOG_LEVEL=debug python train.py      # or info, warning, error, critical, 10

sets the level of the ``pccl`` logger and, if the program has not configured logging
(the root logger has no handler), prints pccl's records to stderr until it does. An
invalid value is ignored with a :class:`RuntimeWarning`.

The Rust side keeps the Python loggers' effective levels cached, so a record of a
disabled level costs the Rust threads no trip to Python. That cache is reset whenever
a logging level changes anywhere (``logger.setLevel``, ``logging.disable``,
``logging.config``, pytest's ``caplog.set_level``): levels set at run time apply at
once. At interpreter exit Rust records stop being forwarded (see ``pccl/_shutdown.py``
for why a Rust thread must not enter Python then).
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import warnings

# _shutdown first: its atexit hook must be registered before ours (see setup()).
from pccl import _core, _shutdown  # noqa: F401

ENV_VAR = "PCCL_LOG_LEVEL"

_NAMES = {
    "trace": 5,  # what pyo3-log calls Rust's trace level (pccl's Rust logs none today)
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "warn": logging.WARNING,
    "error": logging.ERROR,
    "critical": logging.CRITICAL,
    "fatal": logging.CRITICAL,
}


class _StderrUntilConfigured(logging.StreamHandler):  # type: ignore[type-arg]
    """Prints pccl's records to stderr while the root logger has no handler; once the
    program configures logging, the root's handlers print them (not twice)."""

    def emit(self, record: logging.LogRecord) -> None:
        if not logging.getLogger().handlers:
            super().emit(record)


def parse_level(value: str) -> int | None:
    """A level name (any case) or a non-negative number; None if it is neither."""
    text = value.strip()
    if text.lower() in _NAMES:
        return _NAMES[text.lower()]
    if text.isdigit():
        return int(text)
    return None


def configure_from_env(environ: dict[str, str] | None = None) -> None:
    """Applies ``PCCL_LOG_LEVEL`` if it is set (see the module docstring)."""
    value = (os.environ if environ is None else environ).get(ENV_VAR, "")
    if not value.strip():
        return
    level = parse_level(value)
    if level is None:
        warnings.warn(
            f"{ENV_VAR}={value!r} is not a log level (use debug, info, warning, error, "
            f"critical or a number); pccl's logging is left as it is",
            RuntimeWarning, stacklevel=2)
        return
    logger = logging.getLogger("pccl")
    logger.setLevel(level)
    if not logging.getLogger().handlers and not any(
            isinstance(h, _StderrUntilConfigured) for h in logger.handlers):
        handler = _StderrUntilConfigured(sys.stderr)
        handler.setFormatter(logging.Formatter(
            "%(asctime)s %(levelname)s %(name)s: %(message)s"))
        logger.addHandler(handler)
    _core.reset_log_cache()


def _follow_level_changes() -> None:
    """Resets the Rust side's level cache whenever logging clears its own: CPython calls
    ``Logger.manager._clear_cache()`` on every level change (``setLevel``,
    ``logging.disable``). Without that hook (another Python), levels are read once per
    logger, and :func:`pccl._core.reset_log_cache` applies a later change."""
    manager = logging.Logger.manager
    clear = getattr(manager, "_clear_cache", None)
    if clear is None or getattr(clear, "_pccl_resets_core", False):
        return

    def _clear_cache() -> None:
        clear()
        _core.reset_log_cache()

    _clear_cache._pccl_resets_core = True  # type: ignore[attr-defined]
    manager._clear_cache = _clear_cache  # type: ignore[attr-defined]  # private, not in typeshed


def setup() -> None:
    """Called once by ``import pccl``."""
    _follow_level_changes()
    configure_from_env()
    # Registered after pccl._shutdown's hook (imported above), so it runs before it:
    # Rust threads stop entering Python before that hook waits for them to leave.
    atexit.register(_core.close_log_bridge)


setup()
