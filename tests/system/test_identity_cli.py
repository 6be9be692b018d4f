"""The operator's key tools through ``python -m pccl`` in a child process: the exit status
and stderr a script sees (the tools themselves, in this process: tests/unit/test_keys_cli.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def test_the_module_entry_point_runs_the_key_tools(tmp_path: Path) -> None:
    """The same through ``python -m pccl`` in a child process: exit status and stderr."""
    def child(*argv: str | Path) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "pccl", *map(str, argv)],
                              capture_output=True, text=True, timeout=60, cwd=tmp_path)

    ok = child("node", "new", "--out", "n")
    assert ok.returncode == 0, ok.stderr
    assert (tmp_path / "n.key").exists() and (tmp_path / "n.pub").exists()
    bad = child("ca", "sign", "n.key", "--key", "n.key", "--name", "n")
    assert bad.returncode == 2
    assert bad.stderr.startswith("python -m pccl ca sign: error: ")
    assert "Traceback" not in bad.stderr
