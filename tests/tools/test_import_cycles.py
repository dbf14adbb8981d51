"""No two modules of bik or rl_harness import each other, directly or around a circle, at
module level, inside a function or for the type checker alone: a module can be read after the
modules it imports. Package ``__init__`` files are left out (they gather their submodules)."""

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("bik", "rl_harness")


def _modules() -> dict[str, Path]:
    """Every module of PACKAGES by its dotted name (a package by its own name)."""
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imported(name: str, path: Path, modules: dict[str, Path]) -> Iterator[str]:
    """The modules of ``modules`` that module ``name`` (at ``path``) imports anywhere."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            source = ".".join([*base, *([node.module] if node.module else [])])
            targets = [f"{source}.{alias.name}" for alias in node.names] + [source]
        else:
            continue
        for target in targets:
            while target and target not in modules:  # a name inside a module: the module
                target = target.rpartition(".")[0]
            if target:
                yield target


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The circles of ``graph``: its strongly connected parts of two modules or more
    (Tarjan's algorithm)."""
    order: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(node: str) -> None:
        order[node] = low[node] = len(order)
        stack.append(node)
        for other in graph.get(node, ()):
            if other not in order:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], order[other])
        if low[node] == order[node]:
            part = []
            while not part or part[-1] != node:
                part.append(stack.pop())
            if len(part) > 1:
                found.append(sorted(part))

    for node in sorted(graph):
        if node not in order:
            visit(node)
    return found


def test_no_module_imports_one_that_imports_it_back():
    modules = _modules()
    graph = {
        name: {
            target
            for target in _imported(name, path, modules)
            if target != name and modules[target].name != "__init__.py"
        }
        for name, path in modules.items()
        if path.name != "__init__.py"
    }
    assert _cycles(graph) == []


def test_a_circle_is_found():
    """The control: the search finds a circle of three and ignores a chain."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]
