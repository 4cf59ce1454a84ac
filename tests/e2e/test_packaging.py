"""kvjax installs as one import package: kvjax.model, kvjax.decode, kvjax.train,
kvjax.benchmarks, and nothing else at the top level of site-packages."""

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import jax
import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[2]
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


NOTEBOOK = REPO / "notebooks" / "01_quickstart.ipynb"


def test_the_notebooks_install_cell_keeps_the_runtimes_jax(tmp_path):
    """A runtime that already holds jax (Colab's, a GPU image's) runs a notebook's first cell:
    kvjax is cloned and installed, and pip keeps the jax it found. The runtime is a fresh
    virtual environment that sees this environment's packages, except kvjax, through a .pth
    file, as if they were its own; no network (pip finds no index and nothing to build with
    but what is there)."""
    dependencies = Path(jax.__file__).parents[1]
    unmet = _unmet_requirements(dependencies)
    if unmet:  # pip would need the network, which the test does not have
        pytest.skip(f"the packages beside jax ({dependencies}) do not hold every kvjax "
                    f"dependency: {', '.join(unmet)}")
    shared = tmp_path / "runtime-packages"
    shared.mkdir()
    for entry in dependencies.iterdir():
        if not (entry.name.lower().startswith(("kvjax", "__editable__")) or entry.suffix == ".pth"):
            (shared / entry.name).symlink_to(entry)
    runtime = tmp_path / "runtime"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(runtime)], check=True,
                   timeout=120)
    python = runtime / "bin" / "python"
    where = "import sysconfig; print(sysconfig.get_path('purelib'))"
    site = Path(subprocess.run([python, "-c", where], check=True, capture_output=True,
                               text=True).stdout.strip())
    (site / "runtime-packages.pth").write_text(f"{shared}\n")
    before = _versions(python, tmp_path)
    assert before["kvjax"] is None and before["jax"] == jax.__version__

    # The repository a user would clone: this working tree's sources, committed.
    origin = tmp_path / "origin"
    origin.mkdir()
    for name in SOURCE_FILES:
        shutil.copy2(REPO / name, origin / name)
    for name in SOURCE_FOLDERS:
        shutil.copytree(REPO / name, origin / name, ignore=shutil.ignore_patterns("__pycache__"))
    git = ["git", "-c", "user.name=test", "-c", "user.email=test@localhost"]
    for command in (["init", "-q"], ["add", "."], ["commit", "-q", "-m", "sources"]):
        subprocess.run([*git, *command], cwd=origin, check=True, capture_output=True)

    cell = json.loads(NOTEBOOK.read_text())["cells"]
    source = "".join(next(c for c in cell if c["cell_type"] == "code")["source"])
    assert 'KVJAX_REPO_URL = ""' in source
    source = source.replace('KVJAX_REPO_URL = ""', f"KVJAX_REPO_URL = {str(origin)!r}")
    work = tmp_path / "work"
    work.mkdir()
    env = {**os.environ, "PIP_NO_INDEX": "1", "PIP_NO_BUILD_ISOLATION": "0",
           "PIP_DISABLE_PIP_VERSION_CHECK": "1", "KVJAX_NOTEBOOK_CI": "1"}
    env.pop("PYTHONPATH", None)
    run = subprocess.run([python, "-c", source], cwd=work, env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    assert f"jax {jax.__version__}" in run.stdout
    after = _versions(python, tmp_path)
    assert after["kvjax"] is not None
    assert after["jax"] == before["jax"] and after["jaxlib"] == before["jaxlib"]
    assert after["jax_path"] == before["jax_path"] == str(shared / "jax" / "__init__.py")
    assert not list(site.glob("jax*")), "pip installed a jax of its own"


def _unmet_requirements(site: Path) -> list[str]:
    """kvjax's requirements (pyproject.toml) that the distributions in `site` do not meet."""
    requirements = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    installed = {canonicalize_name(d.metadata["Name"]): d.version
                 for d in importlib.metadata.distributions(path=[str(site)])}
    unmet = []
    for requirement in map(Requirement, requirements):
        version = installed.get(canonicalize_name(requirement.name))
        if version is None or not requirement.specifier.contains(version, prereleases=True):
            unmet.append(f"{requirement} ({version or 'missing'})")
    return unmet


def _versions(python, cwd) -> dict:
    """What `python` finds installed, run away from the repository (`python -c` looks in its
    working directory first, and a source tree holds kvjax.egg-info)."""
    script = """
import importlib.metadata as md, importlib.util, json
def version(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None
spec = importlib.util.find_spec("jax")
print(json.dumps({"kvjax": version("kvjax"), "jax": version("jax"), "jaxlib": version("jaxlib"),
                  "jax_path": spec and spec.origin}))
"""
    out = subprocess.run([python, "-c", script], check=True, capture_output=True, text=True,
                         timeout=120, cwd=cwd)
    return json.loads(out.stdout)
