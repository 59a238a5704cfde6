"""The CPU-mesh walkthrough notebook runs top to bottom and shows what its prose claims.

The notebook runs in a fresh kernel process, so this file's conftest device setup does not reach
it: the notebook's first cell asks for its own 8 CPU devices. The kernel is pinned to this
interpreter through a private kernelspec, so a `python3` kernelspec installed elsewhere on the
machine (another Python, another venv) cannot be picked up by mistake.
"""

import json
import math
import os
import re
import sys

import pytest

nbformat = pytest.importorskip("nbformat", reason="the dev extra (nbformat, nbclient) is not installed")
NotebookClient = pytest.importorskip("nbclient", reason="the dev extra (nbformat, nbclient) is not installed").NotebookClient

NOTEBOOKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "notebooks")
WALKTHROUGH = os.path.join(NOTEBOOKS, "cpu_mesh_walkthrough.ipynb")
KERNEL = "megascale-jax-test"


def _kernelspec(tmp_path, monkeypatch) -> None:
    """A kernelspec named KERNEL running ipykernel on this interpreter, found first via JUPYTER_PATH."""
    spec_dir = tmp_path / "jupyter" / "kernels" / KERNEL
    spec_dir.mkdir(parents=True)
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "megascale-jax test kernel",
        "language": "python",
        "env": {"JAX_PLATFORMS": "cpu"},
    }
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))


def _stdout(cell) -> str:
    return "".join(o.get("text", "") for o in cell.get("outputs", []) if o["output_type"] == "stream")


def test_committed_notebook_has_no_outputs():
    nb = nbformat.read(WALKTHROUGH, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code, "the walkthrough has no code cells"
    dirty = [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and (c.outputs or c.execution_count)]
    assert not dirty, f"cells {dirty} carry outputs; clear them before committing the notebook"


@pytest.mark.slow
def test_walkthrough_runs_and_matches_one_device(tmp_path, monkeypatch):
    _kernelspec(tmp_path, monkeypatch)
    nb = nbformat.read(WALKTHROUGH, as_version=4)
    client = NotebookClient(nb, timeout=300, kernel_name=KERNEL, resources={"metadata": {"path": NOTEBOOKS}})
    client.execute()  # raises CellExecutionError, with the traceback, if a cell fails

    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    errors = [o for o in outputs if o["output_type"] == "error"]
    assert not errors, f"notebook raised: {errors[0]['ename']}: {errors[0]['evalue']}"
    text = "\n".join(_stdout(c) for c in nb.cells if c.cell_type == "code")

    # The kernel really simulated 8 devices and built the dp=2 x tp=4 mesh.
    assert "CpuDevice(id=7)" in "".join(str(o.get("data", {}).get("text/plain", "")) for o in outputs)
    assert "mesh axes: {'dp': 2, 'pp': 1, 'cp': 1, 'tp': 4}" in text
    assert re.search(r"^layers/mlp/w1 +\(2, 64, 256\) -> P\('pp', None, 'tp'\)$", text, re.M), text

    steps = [(int(s), float(v)) for s, v in re.findall(r"^step (\d+): loss (\S+)$", text, re.M)]
    assert [s for s, _ in steps] == list(range(1, len(steps) + 1)) and len(steps) >= 3, text
    losses = [v for _, v in steps]
    assert all(math.isfinite(v) for v in losses), losses
    # A byte-level model starts near the uniform guess ln 256 and improves within a few steps.
    assert abs(losses[0] - math.log(256)) < 0.1, losses
    assert losses[-1] < losses[0], losses

    found = re.findall(r"^relative difference: (\S+)$", text, re.M)
    assert len(found) == 1, text
    assert float(found[0]) < 1e-5, f"8-device and 1-device losses differ by {found[0]} (relative)"
