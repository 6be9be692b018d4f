"""docs/quickstart.ipynb runs top to bottom in a real Jupyter kernel (this interpreter)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat", reason="nbformat is not installed (pip install .[test])")
nbclient = pytest.importorskip("nbclient", reason="nbclient is not installed (pip install .[test])")
pytest.importorskip("ipykernel", reason="ipykernel is not installed (pip install .[test])")
pytest.importorskip("matplotlib", reason="matplotlib is not installed (pip install .[test])")

NOTEBOOK = Path(__file__).resolve().parents[2] / "docs" / "quickstart.ipynb"
KERNEL = "pccl-quickstart-test"
CELL_TIMEOUT = 120  # seconds per cell; the whole notebook takes seconds


def write_kernelspec(root: Path, env: dict[str, str]) -> None:
    """A kernelspec that starts this very interpreter, so the kernel sees the test's
    environment whatever other "python3" kernelspecs the machine has."""
    spec = root / "kernels" / KERNEL
    spec.mkdir(parents=True)
    spec.joinpath("kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "pccl quickstart (test)",
        "language": "python",
        "env": env,
    }))


def hide_torch(root: Path) -> dict[str, str]:
    """Kernel environment in which ``import torch`` fails, as on a machine without it."""
    blocker = root / "torch"
    blocker.mkdir(parents=True)
    blocker.joinpath("__init__.py").write_text('raise ImportError("torch hidden by the test")\n')
    path = [str(root), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {"PYTHONPATH": os.pathsep.join(path)}


def stdout_of(cells) -> str:
    return "".join(o.get("text", "") for c in cells for o in c.outputs
                   if o.output_type == "stream" and o.name == "stdout")


@pytest.mark.timeout(6 * CELL_TIMEOUT)
@pytest.mark.parametrize("torch_in_kernel", ["as installed", "hidden"])
async def test_quickstart_notebook_runs_and_shows_every_step(
        tmp_path, monkeypatch, torch_in_kernel) -> None:
    env = hide_torch(tmp_path / "no-torch") if torch_in_kernel == "hidden" else {}
    write_kernelspec(tmp_path / "jupyter", env)
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    work = tmp_path / "cwd"  # the kernel's working directory: nothing may land in the repo
    work.mkdir()
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(
        nb, kernel_name=KERNEL, timeout=CELL_TIMEOUT, startup_timeout=CELL_TIMEOUT,
        resources={"metadata": {"path": str(work)}})
    # Raises CellExecutionError at the first failing cell (its asserts included); the
    # kernel process is shut down either way.
    await client.async_execute()

    code = [c for c in nb.cells if c.cell_type == "code"]
    assert not [o for c in code for o in c.outputs if o.output_type == "error"]
    out = stdout_of(code)
    assert "world sizes [3, 3, 3]" in out
    assert "SUM on every peer: [ 0.  6. 12. 18. 24. 30. 36. 42.]" in out
    assert "AVG on every peer: [ 0.  2.  4.  6.  8. 10. 12. 14.]" in out
    if torch_in_kernel == "hidden":
        assert "torch is not installed: skipping" in out
        assert "torch SUM" not in out
    else:
        assert ("torch SUM on every peer: tensor([6., 6., 6., 6.])" in out
                or "torch is not installed: skipping" in out)
    after = [line for line in out.splitlines() if " after: " in line]
    assert len(after) == 3 and len({line.split(" after: ")[1].split("}")[0] for line in after}) == 1
    assert "joiners pending? True" in out  # a alone: the only accepted peer
    # The crash: the reduce that waited for c ran on the ring the master repaired.
    assert "PeerConnectionError" not in out
    assert "world size [2, 2] | result [30. 30. 30. 30.] [30. 30. 30. 30.] | ring" in out
    assert "joiners pending? [False, False] | pending_peer_count() 0" in out
    images = [o for c in code for o in c.outputs if "image/png" in o.get("data", {})]
    assert len(images) == 1, "the plot cell should show exactly one inline figure"
    assert "peers: ['CLOSED', 'CLOSED', 'CLOSED'] | master stopped" in out
    assert not list(work.iterdir()), "the notebook wrote files"


def test_quickstart_uses_only_the_public_api() -> None:
    """A new user copies from the notebook: no private modules or attributes in it."""
    import re

    private = re.compile(r"(?:\bfrom\s+pccl\S*\s+import\s+_\w|\bpccl\.\w*\._|\._[a-z]\w*)")
    for cell in json.loads(NOTEBOOK.read_text())["cells"]:
        if cell["cell_type"] != "code":
            continue
        for line in "".join(cell["source"]).splitlines():
            assert not private.search(line.split("#")[0]), line
