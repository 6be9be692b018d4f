"""A child interpreter's import path holding exactly some distributions and what they
require, as a user's fresh environment would: for tests of what pccl needs installed."""

from __future__ import annotations

import importlib.metadata
import os
from pathlib import Path

import pccl


def closure(names: list[str], without: set[str] = frozenset()
            ) -> list[importlib.metadata.Distribution]:  # type: ignore[assignment]
    """The distributions ``names`` need to run (their requirements, recursively, extras
    off), less those in ``without``."""
    from packaging.requirements import Requirement

    seen: dict[str, importlib.metadata.Distribution] = {}
    todo = list(names)
    while todo:
        name = todo.pop()
        if name.lower().replace("_", "-") in without:
            continue
        dist = importlib.metadata.distribution(name)
        key = dist.metadata["Name"].lower().replace("_", "-")
        if key in seen:
            continue
        seen[key] = dist
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return list(seen.values())


def environment(tmp: Path, names: list[str], without: set[str] = frozenset()
                ) -> dict[str, str]:  # type: ignore[assignment]
    """Environment variables for ``python -S``: PYTHONPATH is a folder of links to the
    top-level modules of ``closure(names, without)`` and nothing else."""
    site = tmp / "site"
    site.mkdir()
    for dist in closure(names, without):
        tops = {Path(str(f)).parts[0] for f in dist.files or []}
        for top in sorted(tops):
            src = Path(str(dist.locate_file(top)))
            if top in ("..", "__pycache__") or top.endswith(".pth") or not src.exists() \
                    or (site / top).exists():
                continue  # scripts, caches, the editable path hook, shared dirs
            (site / top).symlink_to(src)
        if dist.metadata["Name"] == "pccl" and not (site / "pccl").exists():
            (site / "pccl").symlink_to(Path(pccl.__file__).parent)  # an editable install
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(site),
            "HOME": str(tmp), "PYTHONDONTWRITEBYTECODE": "1"}
