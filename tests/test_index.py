"""tests/README.md's index: every module of the package has a test file named after it where
the tests mirror the package, or a row naming the files that test it; every row is needed and
names files that exist."""

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ROW = re.compile(r"^\| `([^`]+)` \| (.+) \|$")


def package_modules() -> list[Path]:
    """Every module of the import package, relative to the repository root (benchmarks/ has
    its own convention, test_bench_<name>.py)."""
    directories = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-dir"].values()
    return sorted(path.relative_to(ROOT) for directory in directories if directory != "benchmarks"
                  for path in (ROOT / directory).rglob("*.py") if path.name != "__init__.py")


def mirrored_test_file(module: Path) -> Path:
    """tests/<part>/test_<name>.py: model/x.py, kvjax/cli/x.py -> tests/model/, tests/cli/;
    kvjax/x.py -> tests/."""
    part = module.parts[1:-1] if module.parts[0] == "kvjax" else module.parts[:-1]
    return Path("tests", *part, f"test_{module.stem}.py")


def index_rows() -> dict[str, list[str]]:
    rows = {}
    for line in (ROOT / "tests" / "README.md").read_text().splitlines():
        if match := ROW.match(line):
            rows[match.group(1)] = re.findall(r"`([^`]+)`", match.group(2))
    return rows


def test_every_module_has_its_own_test_file_or_a_row():
    rows = index_rows()
    unfound = [str(m) for m in package_modules()
               if not (ROOT / mirrored_test_file(m)).exists() and str(m) not in rows]
    assert not unfound, f"no test file of their name, no row in tests/README.md: {unfound}"


def test_every_row_is_needed_and_names_test_files_that_exist():
    modules = {str(m): m for m in package_modules()}
    rows = index_rows()
    assert rows, "no row of the table in tests/README.md was read"
    for module, files in rows.items():
        assert module in modules, f"{module} is not a module of the package"
        assert not (ROOT / mirrored_test_file(modules[module])).exists(), (
            f"{module} has {mirrored_test_file(modules[module])}: its row is not needed")
        assert files and all((ROOT / f).is_file() and Path(f).name.startswith("test_")
                             for f in files), (module, files)
