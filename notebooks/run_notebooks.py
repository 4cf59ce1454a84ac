"""Runs the notebooks top to bottom in a fresh kernel and saves them with their outputs.

    python notebooks/run_notebooks.py                 # every notebook, full size, saved in place
    python notebooks/run_notebooks.py 02_kv_cache_from_scratch.ipynb
    python notebooks/run_notebooks.py --ci --no-save  # the test suite's small size, a dry run

The kernel is this Python (`sys.executable`) and runs in a temporary directory, so whatever a
notebook writes there is deleted afterwards. tests/e2e/test_notebooks.py runs them the same way.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

HERE = Path(__file__).resolve().parent
KERNEL_NAME = "kvjax-notebooks"


def run(path: Path, *, ci: bool, timeout: int = 600,
        record_timing: bool = False) -> nbformat.NotebookNode:
    """Executes the notebook at `path`; raises `nbclient.exceptions.CellExecutionError` naming
    the failing cell. Each cell's stdout and stderr are saved as one output each, as they end up
    on screen (a progress bar's redraws collapse into its final line). Cell timestamps are
    recorded only if asked: saved, they would change every cell's metadata on every run."""
    notebook = nbformat.read(path, as_version=4)
    with tempfile.TemporaryDirectory() as jupyter_dir, tempfile.TemporaryDirectory() as work:
        spec_dir = Path(jupyter_dir) / "kernels" / KERNEL_NAME
        spec_dir.mkdir(parents=True)
        spec = {"argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                "display_name": "Python 3", "language": "python"}
        (spec_dir / "kernel.json").write_text(json.dumps(spec))
        env = {"JUPYTER_PATH": jupyter_dir, "KVJAX_NOTEBOOK_CI": "1" if ci else "0"}
        saved = {name: os.environ.get(name) for name in env}
        os.environ.update(env)  # read by the kernel spec lookup and inherited by the kernel
        try:
            client = NotebookClient(notebook, kernel_name=KERNEL_NAME, timeout=timeout,
                                    record_timing=record_timing, coalesce_streams=True,
                                    resources={"metadata": {"path": work}})
            client.execute()
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
    # Saved as if run by the default Python 3 kernel, which is what Colab and Jupyter offer.
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                       "language": "python"}
    return notebook


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="*", help="file names in notebooks/ (default: all)")
    parser.add_argument("--ci", action="store_true", help="the test suite's small size")
    parser.add_argument("--no-save", action="store_true", help="do not write the outputs back")
    args = parser.parse_args()
    paths = [HERE / name for name in args.notebooks] or sorted(HERE.glob("*.ipynb"))
    for path in paths:
        start = time.perf_counter()
        notebook = run(path, ci=args.ci)
        if not args.no_save:
            nbformat.write(notebook, path)
        print(f"{path.name}: ran in {time.perf_counter() - start:.0f} s"
              + ("" if args.no_save else ", saved"))


if __name__ == "__main__":
    main()
