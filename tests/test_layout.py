"""The layout shows the architecture: each part imports only the parts below it (ARCHITECTURE.md), and no module
imports itself back through others, deferred imports (inside functions) included."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "gatedformer"

# What each part may import of the package (besides itself). A part is a subpackage or a top-level module.
ALLOWED: dict[str, set[str]] = {
    "errors": set(),
    "version": set(),
    "io": {"errors"},
    "devices": {"errors"},
    "gates": {"errors"},
    "kernels": {"errors"},
    "ops": {"kernels", "gates", "errors"},
    "nn": {"ops", "kernels", "gates", "errors"},
    "data": {"errors", "io"},
    "config": {"data", "gates", "errors"},
    "models": {"nn", "gates", "config", "errors"},
    "fused": {"models", "nn", "ops", "kernels", "gates", "config", "errors"},
    "tasks": {"fused", "models", "data", "config", "devices", "io", "errors"},
    "train": {"tasks", "kernels", "config", "data", "gates", "devices", "io", "errors", "version", "__init__"},
    "runs": {"tasks", "train", "config", "devices", "errors"},
    "pretrained": {"runs", "tasks", "train", "data", "config", "devices", "io", "errors", "version"},
    "analysis": {"runs", "train", "tasks", "fused", "models", "nn", "ops", "kernels", "gates", "data", "config",
                 "devices", "io", "errors", "__init__"},
    "cli": {"analysis", "runs", "pretrained", "train", "tasks", "data", "config", "errors", "__init__"},
    "__main__": {"cli"},
    "__init__": {"fused", "models", "gates", "config", "errors", "runs", "pretrained", "tasks", "train", "version"},
}


def _module_name(path: Path) -> str:
    """``gatedformer.tasks.lm`` for ``src/gatedformer/tasks/lm.py`` (a package by its ``__init__``)."""
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


_ALL_MODULES = {_module_name(path) for path in PACKAGE.rglob("*.py")}


def _imports(path: Path) -> set[str]:
    """Every ``gatedformer`` module ``path`` imports, at the top or inside a function (``from x import y`` counts
    ``x.y`` where that is a module)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("gatedformer"))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                module = ".".join([*base, node.module] if node.module else base)
            else:
                module = node.module or ""
            if not module.startswith("gatedformer"):
                continue
            submodules = {f"{module}.{alias.name}" for alias in node.names} & _ALL_MODULES
            found.update(submodules)
            if len(submodules) < len(node.names):  # names defined in the module itself
                found.add(module)
    return found - {name}


MODULES = {_module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}
GRAPH = {name: {m for m in _imports(path) if m in MODULES} for name, path in MODULES.items()}


def _part(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_each_part_imports_only_the_parts_below_it(module: str) -> None:
    part = _part(module)
    assert part in ALLOWED, f"{module}: a new part; say in ARCHITECTURE.md and here what it may import"
    wrong = sorted(m for m in GRAPH[module] if _part(m) != part and _part(m) not in ALLOWED[part])
    assert not wrong, f"{module} ({part}) imports {wrong}, which {part} may not"


def test_no_module_imports_itself_back() -> None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(module: str) -> None:
        state[module] = 1
        stack.append(module)
        for other in sorted(GRAPH[module]):
            if state.get(other) == 1:
                cycle = stack[stack.index(other):] + [other]
                pytest.fail("import circle: " + " -> ".join(cycle))
            if other not in state:
                visit(other)
        stack.pop()
        state[module] = 2

    for module in sorted(GRAPH):
        if module not in state:
            visit(module)
