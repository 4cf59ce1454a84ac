"""The notebooks run top to bottom in a fresh kernel, and their saved outputs hold a real run.

Each notebook is executed at its CI size (KVJAX_NOTEBOOK_CI=1: the same cells on smaller
settings) by a kernel running this Python, in a temporary working directory; any cell error
fails the test with the cell and its traceback. `python notebooks/run_notebooks.py` runs them
the same way at full size and saves the outputs.
"""

import json
import sys
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOK_DIR = Path(__file__).resolve().parents[2] / "notebooks"
NOTEBOOKS = ["01_quickstart.ipynb", "02_kv_cache_from_scratch.ipynb",
             "03_train_your_own.ipynb", "04_pretrained.ipynb"]
KERNEL_NAME = "kvjax-notebook-test"


def test_every_notebook_is_tested():
    assert sorted(p.name for p in NOTEBOOK_DIR.glob("*.ipynb")) == NOTEBOOKS


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_saved_outputs_are_a_complete_run(name):
    notebook = nbformat.read(NOTEBOOK_DIR / name, as_version=4)
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    counts = [cell.execution_count for cell in code]
    assert counts == list(range(1, len(code) + 1)), "run top to bottom once, in order"
    outputs = [output for cell in code for output in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    assert any("image/png" in o.get("data", {}) for o in outputs), "no plot saved"
    assert not any("CI (small)" in o.get("text", "") for o in outputs), "saved at CI size"


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs(name, tmp_path, monkeypatch):
    # A kernel spec for this interpreter, so the kernel imports the kvjax under test.
    spec_dir = tmp_path / "jupyter" / "kernels" / KERNEL_NAME
    spec_dir.mkdir(parents=True)
    spec = {"argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
            "display_name": "kvjax test", "language": "python"}
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    monkeypatch.setenv("KVJAX_NOTEBOOK_CI", "1")  # inherited by the kernel
    # What a notebook writes to a temporary directory goes with the test's own.
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    work = tmp_path / "work"
    work.mkdir()

    notebook = nbformat.read(NOTEBOOK_DIR / name, as_version=4)
    client = NotebookClient(notebook, kernel_name=KERNEL_NAME, timeout=600,
                            resources={"metadata": {"path": str(work)}})
    client.execute()  # raises CellExecutionError on the first failing cell

    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert all(cell.execution_count is not None for cell in code)
    first_output = "".join(o.get("text", "") for o in code[0].outputs)
    assert "size: CI (small)" in first_output
