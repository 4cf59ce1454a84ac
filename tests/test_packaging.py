"""kvjax installs as one import package: kvjax.model, kvjax.decode, kvjax.train,
kvjax.benchmarks, and nothing else at the top level of site-packages."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax

REPO = Path(__file__).resolve().parents[1]
SOURCE_FILES = ("pyproject.toml", "README.md")  # what setuptools reads to build the package
SOURCE_FOLDERS = ("kvjax", "model", "decode", "train", "benchmarks", "serve")


def test_a_regular_install_is_one_import_package(tmp_path):
    # Built from a copy: setuptools writes its build/ folder beside the sources it builds.
    source = tmp_path / "source"
    source.mkdir()
    for name in SOURCE_FILES:
        shutil.copy2(REPO / name, source / name)
    for name in SOURCE_FOLDERS:
        shutil.copytree(REPO / name, source / name,
                        ignore=shutil.ignore_patterns("__pycache__"))
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
         "--no-compile", "--target", str(target), str(source)],
        check=True, capture_output=True, timeout=300)
    assert sorted(p.name for p in target.iterdir() if not p.name.endswith(".dist-info")) == [
        "bin", "kvjax"]
    # -S: no site-packages and so no .pth files, in particular not an editable install's
    # finder; the dependencies come from where jax is installed, kvjax only from `target`.
    dependencies = Path(jax.__file__).parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(target), str(dependencies)])}
    script = """
import importlib
import kvjax.benchmarks.decode, kvjax.cli, kvjax.decode, kvjax.model, kvjax.train, kvjax.text
print(kvjax.model.__file__)
for name in ("model", "decode", "train", "benchmarks"):
    try:
        importlib.import_module(name)
    except ModuleNotFoundError:
        continue
    raise SystemExit(f"import {name} should fail")
"""
    run = subprocess.run([sys.executable, "-S", "-c", script], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == str(target / "kvjax" / "model" / "__init__.py")
