"""pccl's log formats (pccl/_logging.py) in this process: UTC text, one JSON object per line,
a bogus level warned about. (Through PCCL_LOG_LEVEL / PCCL_LOG_FORMAT in child processes:
tests/system/test_logging_and_hash.py.)"""

from __future__ import annotations

import json
import logging
import re
import sys

import pytest

from pccl import _logging


def test_bogus_value_in_process_warns() -> None:
    before = logging.getLogger("pccl").level
    with pytest.warns(RuntimeWarning, match="is not a log level"):
        _logging.configure_from_env({_logging.ENV_VAR: "loud"})
    assert logging.getLogger("pccl").level == before


UTC_STAMP = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z")


def _record(created: float, msg: str = "hello %s", args: tuple[object, ...] = ("world",),
            exc: bool = False) -> logging.LogRecord:
    exc_info = None
    if exc:
        try:
            raise ValueError("broken \"thing\"\nsecond line")
        except ValueError:
            exc_info = sys.exc_info()
    record = logging.LogRecord("pccl.master.status", logging.WARNING, __file__, 1, msg, args,
                               exc_info)
    record.created, record.msecs = created, (created % 1) * 1000
    return record


def test_the_text_format_writes_utc() -> None:
    # 2025-03-01T12:34:56.789 UTC, whatever the local time zone
    line = _logging.formatter("text").format(_record(1740832496.789))
    assert line == "2025-03-01T12:34:56.789Z WARNING pccl.master.status: hello world"


def test_the_json_format_is_one_object_per_line_with_the_exception() -> None:
    fmt = _logging.formatter("json")
    plain = fmt.format(_record(1740832496.0012))
    assert json.loads(plain) == {"ts": "2025-03-01T12:34:56.001Z", "level": "WARNING",
                                 "logger": "pccl.master.status", "msg": "hello world"}
    failed = fmt.format(_record(0.5, "line one\nline two", (), exc=True))
    assert "\n" not in failed  # one line, whatever the texts hold
    doc = json.loads(failed)
    assert doc["ts"] == "1970-01-01T00:00:00.500Z" and doc["msg"] == "line one\nline two"
    assert doc["exc"].startswith("Traceback (most recent call last):")
    assert doc["exc"].endswith('ValueError: broken "thing"\nsecond line')
    with pytest.raises(ValueError, match="xml"):
        _logging.formatter("xml")
