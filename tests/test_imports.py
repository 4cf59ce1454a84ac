"""kvjax is a house of layers: a module imports only from its own part of the package or from
the layers below it, and no modules import each other in a circle (lazy imports count).
"""

import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Lowest first. A part is a subpackage or a module of `kvjax` (`kvjax` alone: its __init__).
LAYERS = [
    ("kvjax", "kvjax.tokenizer", "kvjax.model"),
    ("kvjax.parallel", "kvjax.distributed", "kvjax.detokenize", "kvjax.device_loops"),
    ("kvjax.checkpoint", "kvjax.decode"),
    ("kvjax.hf",),
    ("kvjax.text", "kvjax.train"),
    ("kvjax.serve", "kvjax.demo"),
    ("kvjax.benchmarks",),
    ("kvjax.cli",),
]
LAYER = {part: level for level, parts in enumerate(LAYERS) for part in parts}


def modules() -> dict[str, Path]:
    """Every module of the installed package, by dotted name, from pyproject's layout."""
    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = {}
    for package, folder in setup["package-dir"].items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([package, *parts])] = path
    return found


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The kvjax modules `name` imports, anywhere in its file."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            if base == "kvjax" or base.startswith("kvjax."):
                found |= {f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                          for a in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "kvjax"}
    return found


def part(name: str) -> str:
    pieces = name.split(".")
    return ".".join(pieces[:2]) if len(pieces) > 1 else "kvjax"


GRAPH = {name: imports(name, path, set(modules())) for name, path in modules().items()}


def test_every_part_of_the_package_has_a_layer():
    assert {part(name) for name in GRAPH} == set(LAYER)


def test_no_module_imports_from_a_layer_above_or_beside_its_own():
    wrong = [f"{name} imports {target}" for name, targets in GRAPH.items() for target in targets
             if part(target) != part(name) and LAYER[part(target)] >= LAYER[part(name)]]
    assert not wrong


def test_no_modules_import_each_other_in_a_circle():
    def reaches(start):
        seen, todo = set(), [start]
        while todo:
            for target in GRAPH.get(todo.pop(), ()):
                if target not in seen:
                    seen.add(target)
                    todo.append(target)
        return seen

    circles = sorted(name for name in GRAPH if name in reaches(name))
    assert not circles
