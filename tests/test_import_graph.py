"""The package's import graph runs one way: rooms (subpackages and top-level modules) form no circle, nor do the
modules, and the arrows issue #55 untied stay untied. Every import counts, function-level ones too: a lazy import is
still an arrow a reader has to follow."""

import ast
import collections
from pathlib import Path

import inductor_attn

PACKAGE = Path(inductor_attn.__file__).parent
# (from room, to room): the tuner is handed what it needs to time compiled code (measure.thin_op_launch), backends
# share error texts through messages.py, and the store is handed library versions
FORBIDDEN = {("tuning", "ops"), ("tuning", "runtime"), ("tuning", "lowering"), ("backends", "ops"),
             ("store", "backends")}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _room(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None  # the package's own __init__ is no room: it gathers them all


def _imported(module: str, is_package: bool, node: ast.AST) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.startswith("inductor_attn")]
    base = module.split(".") if is_package else module.split(".")[:-1]
    if node.level:
        base = base[: len(base) - node.level + 1]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    return [f"{target}.{a.name}" for a in node.names] if target.startswith("inductor_attn") else []


def room_graph() -> dict[str, set[str]]:
    """{room: the rooms it imports from}."""
    graph = collections.defaultdict(set)
    for path in PACKAGE.rglob("*.py"):
        module = _module_name(path)
        source = _room(module)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for name in _imported(module, path.name == "__init__.py", node):
                    target = _room(name)
                    if source and target and target != source:
                        graph[source].add(target)
    return graph


def module_graph() -> dict[str, set[str]]:
    """{module: the package's modules it imports}; ``from pkg import name`` counts as an arrow to ``pkg.name`` where
    that is a module, else to ``pkg``. Not the arrow from a module to the packages it lies in: Python imports those
    first, as a consequence and not a choice."""
    paths = {_module_name(path): path for path in PACKAGE.rglob("*.py")}
    graph = collections.defaultdict(set)
    for module, path in paths.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for name in _imported(module, path.name == "__init__.py", node):
                    target = name if name in paths else name.rpartition(".")[0]
                    if target in paths and target != module and not module.startswith(target + "."):
                        graph[module].add(target)
    return graph


def _circles(graph: dict[str, set[str]]) -> list[str]:
    seen, circles = {}, []

    def visit(node, path):
        seen[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if seen.get(nxt) == "open":
                circles.append(" -> ".join(path[path.index(nxt):] + [nxt]))
            elif nxt not in seen:
                visit(nxt, path + [nxt])
        seen[node] = "done"

    for node in sorted(graph):
        if node not in seen:
            visit(node, [node])
    return circles


def test_the_arrows_that_ran_back_up_the_pipeline_stay_gone():
    graph = room_graph()
    assert sorted((a, b) for a, b in FORBIDDEN if b in graph.get(a, ())) == []


def test_no_circle_among_rooms():
    assert _circles(room_graph()) == []


def test_no_circle_among_modules():
    assert _circles(module_graph()) == []
