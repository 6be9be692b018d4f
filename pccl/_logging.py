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

What that handler prints (and ``pccl-master``, ``python -m pccl ...``) is one line per
record, timestamps in UTC (ISO 8601, milliseconds, ``Z``)::

    2025-03-01T12:00:00.123Z INFO pccl.master.status: admitted peer 4 (group 0)

or, with ``PCCL_LOG_FORMAT=json`` (``pccl-master --log-format json``), one JSON object
per line: ``ts`` (as above), ``level``, ``logger``, ``msg``, and ``exc`` (the traceback)
when the record has one (here on two lines)::

    {"ts": "2025-03-01T12:00:00.123Z", "level": "INFO", "logger": "pccl.master.status",
     "msg": "admitted peer 4 (group 0)"}

``PCCL_LOG_FORMAT`` alone also prints pccl's records (at the ``pccl`` logger's level,
WARNING unless set) while the program has configured no logging. A program that
configures logging itself chooses its own format.

The Rust side keeps the Python loggers' effective levels cached, so a record of a
disabled level costs the Rust threads no trip to Python. That cache is reset whenever
a logging level changes anywhere (``logger.setLevel``, ``logging.disable``,
``logging.config``, pytest's ``caplog.set_level``): levels set at run time apply at
once. At interpreter exit Rust records stop being forwarded (see ``pccl/_shutdown.py``
for why a Rust thread must not enter Python then).
"""

from __future__ import annotations

import atexit
import datetime
import json
import logging
import os
import sys
import warnings

# _shutdown first: its atexit hook must be registered before ours (see setup()).
from pccl import _core, _shutdown  # noqa: F401

ENV_VAR = "PCCL_LOG_LEVEL"
FORMAT_ENV_VAR = "PCCL_LOG_FORMAT"
#: The values of PCCL_LOG_FORMAT and ``--log-format``.
FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

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


def utc_timestamp(record: logging.LogRecord) -> str:
    """When ``record`` was made, in UTC: ``2025-03-01T12:00:00.123Z``."""
    when = datetime.datetime.fromtimestamp(record.created, datetime.UTC)
    return f"{when:%Y-%m-%dT%H:%M:%S}.{int(record.msecs):03d}Z"


class UTCFormatter(logging.Formatter):
    """The text format, its ``%(asctime)s`` in UTC (:func:`utc_timestamp`)."""

    def __init__(self, fmt: str = TEXT_FORMAT) -> None:
        super().__init__(fmt)

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:  # noqa: N802
        return utc_timestamp(record)


class JSONFormatter(logging.Formatter):
    """One JSON object per record, on one line: ``ts``, ``level``, ``logger``, ``msg``,
    and ``exc`` (the formatted exception) and ``stack`` when the record has them."""

    def format(self, record: logging.LogRecord) -> str:
        doc = {"ts": utc_timestamp(record), "level": record.levelname,
               "logger": record.name, "msg": record.getMessage()}
        if record.exc_info:
            # (cached on the record, as logging.Formatter does, for other handlers)
            if not record.exc_text:
                record.exc_text = self.formatException(record.exc_info)
        if record.exc_text:
            doc["exc"] = record.exc_text
        if record.stack_info:
            doc["stack"] = self.formatStack(record.stack_info)
        return json.dumps(doc)


def formatter(kind: str) -> logging.Formatter:
    """The formatter of ``kind``: ``"text"`` or ``"json"``."""
    if kind == "json":
        return JSONFormatter()
    if kind == "text":
        return UTCFormatter()
    raise ValueError(f"log format {kind!r}: expected one of {', '.join(FORMATS)}")


def parse_format(value: str) -> str | None:
    """``text`` or ``json`` (any case, surrounding whitespace ignored); None if neither."""
    text = value.strip().lower()
    return text if text in FORMATS else None


def configure_root(level: int, kind: str = "text") -> None:
    """What the command-line programs do, as :func:`logging.basicConfig` (nothing if
    the root logger has a handler already): the root logger prints to stderr in ``kind``
    (:func:`formatter`) from ``level`` on."""
    root = logging.getLogger()
    if root.handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter(kind))
    root.addHandler(handler)
    root.setLevel(level)


def parse_level(value: str) -> int | None:
    """A level name (any case) or a non-negative number; None if it is neither."""
    text = value.strip()
    if text.lower() in _NAMES:
        return _NAMES[text.lower()]
    if text.isdigit():
        return int(text)
    return None


def env_format(environ: dict[str, str] | None = None) -> str | None:
    """``PCCL_LOG_FORMAT`` if it is set to a format, else None (an invalid value is
    warned about by :func:`configure_from_env`, at import)."""
    return parse_format((os.environ if environ is None else environ).get(FORMAT_ENV_VAR, ""))


def configure_from_env(environ: dict[str, str] | None = None) -> None:
    """Applies ``PCCL_LOG_LEVEL`` and ``PCCL_LOG_FORMAT`` if they are set (see the module
    docstring)."""
    env = os.environ if environ is None else environ
    value = env.get(ENV_VAR, "")
    kind_value = env.get(FORMAT_ENV_VAR, "")
    level = parse_level(value) if value.strip() else None
    kind = parse_format(kind_value) if kind_value.strip() else None
    if kind_value.strip() and kind is None:
        warnings.warn(
            f"{FORMAT_ENV_VAR}={kind_value!r} is not a log format (use text or json); "
            f"pccl logs as text", RuntimeWarning, stacklevel=2)
    if value.strip() and level is None:
        warnings.warn(
            f"{ENV_VAR}={value!r} is not a log level (use debug, info, warning, error, "
            f"critical or a number); pccl's logging is left as it is",
            RuntimeWarning, stacklevel=2)
        return
    if level is None and kind is None:
        return
    logger = logging.getLogger("pccl")
    if level is not None:
        logger.setLevel(level)
    attached = [h for h in logger.handlers if isinstance(h, _StderrUntilConfigured)]
    if attached:
        attached[0].setFormatter(formatter(kind or "text"))
    elif not logging.getLogger().handlers:
        handler = _StderrUntilConfigured(sys.stderr)
        handler.setFormatter(formatter(kind or "text"))
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
