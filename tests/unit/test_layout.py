"""The package's house rules (README, "Layout"): imports run one way, logs <- registry <- joiner <- recovery/tools <-
airflow/cli, over a foundation that imports nothing of photon but durable.py and settings.py (the two import nothing of
photon), and no module reaches itself through its imports.

Every import counts, also those inside a function: a lazy import only moves the circle to run time."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PHOTON = Path(__file__).resolve().parents[2] / "plugins" / "photon"

FOUNDATION = {"photon.settings", "photon.pg", "photon.durable", "photon.spark_session", "photon.storage"}
# What each part may import besides itself (the folders' __init__ docstrings say the same).
ALLOWED: dict[str, set[str]] = {
    # The foundation modules the others build on (they import nothing of photon): file writes, the settings
    "foundation": {"photon.durable", "photon.settings"},
    "logs": {"photon.settings", "photon.durable", "photon.storage"},
    "registry": {"logs", "foundation"},
    "joiner": {"registry", "logs", "foundation"},
    "recovery": {"joiner", "registry", "logs", "foundation"},
    "tools": {"recovery", "joiner", "registry", "logs", "foundation"},
    "airflow": {"tools", "recovery", "joiner", "registry", "logs", "foundation"},
    "cli": {"airflow", "tools", "recovery", "joiner", "registry", "logs", "foundation"},
}
FOLDERS = ("logs", "registry", "joiner", "recovery", "tools", "airflow")


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PHOTON.rglob("*.py")):
        parts = path.relative_to(PHOTON.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


MODULES = _modules()


def _part(module: str) -> str:
    if module in FOUNDATION or module == "photon":
        return "foundation"
    if module in ("photon.cli", "photon.__main__"):
        return "cli"
    folder = module.split(".")[1]
    assert folder in FOLDERS, f"{module} is in no known part of the house: add it to tests/unit/test_layout.py"
    return folder


def _imports(module: str) -> set[str]:
    """The photon modules ``module`` imports, anywhere in its body (``from photon.x import y`` names module
    ``photon.x.y`` when that is a module, else ``photon.x``)."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "photon"}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*package.split(".")[: len(package.split(".")) - node.level + 1], base]).rstrip(".")
            if base.split(".")[0] != "photon":
                continue
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base)
    unknown = found - set(MODULES)
    assert not unknown, f"{module} imports {unknown}, which do not exist"
    return found - {module}


GRAPH = {m: _imports(m) for m in MODULES}


def _allowed(importer: str, imported: str) -> bool:
    mine, theirs = _part(importer), _part(imported)
    if imported == "photon":
        return True
    return (mine == theirs and mine != "foundation") or theirs in ALLOWED[mine] or imported in ALLOWED[mine]


def test_imports_run_one_way() -> None:
    wrong = sorted(
        f"{m} ({_part(m)}) imports {i} ({_part(i)})" for m, deps in GRAPH.items() for i in deps if not _allowed(m, i)
    )
    assert not wrong, "imports against the house's direction:\n" + "\n".join(wrong)


def test_no_import_circles() -> None:
    # Tarjan's strongly connected components: any component of more than one module is a circle.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(m: str) -> None:
        index[m] = low[m] = len(index)
        stack.append(m)
        for d in GRAPH[m]:
            if d not in index:
                visit(d)
                low[m] = min(low[m], low[d])
            elif d in stack:
                low[m] = min(low[m], index[d])
        if low[m] == index[m]:
            component = []
            while True:
                d = stack.pop()
                component.append(d)
                if d == m:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for m in sorted(GRAPH):
        if m not in index:
            visit(m)
    assert not circles, f"import circles: {circles}"


@pytest.mark.parametrize("folder", FOLDERS)
def test_a_folders_init_is_only_its_docstring(folder: str) -> None:
    """Importing one submodule never drags in the rest of its folder: an ``__init__`` re-exports nothing."""
    body = ast.parse((PHOTON / folder / "__init__.py").read_text()).body
    assert body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
    assert len(body) == 1, f"photon/{folder}/__init__.py holds more than its docstring"


def test_the_check_sees_what_it_must() -> None:
    """The parser finds lazy imports and modules imported as names (``from photon.registry import sql as q``)."""
    assert "photon.registry.sql" in GRAPH["photon.registry.gc"]
    assert "photon.tools.demo" in GRAPH["photon.cli"]  # imported inside the demo command
    assert not _allowed("photon.recovery.verify", "photon.tools.audit")
    assert not _allowed("photon.logs.parse", "photon.pg")
    assert not _allowed("photon.pg", "photon.storage")
    assert not _allowed("photon.tools.demo", "photon.cli")
