"""The package's structure stays one-way: each package imports only those below it, no module cycle, every
tensorpar import at the top of its module, and no source file over 600 lines."""

import ast
import pathlib

import pytest

import tensorpar

ROOT = pathlib.Path(tensorpar.__file__).parent
MAX_LINES = 600

# Bottom to top. A module may import its own package and any package of a lower level; packages that share a
# level do not import each other. Planning sits beside the stack: only the commands (and the cli) import it.
LEVELS = [
    {"errors"},
    {"config"},
    {"distributed", "data"},
    {"layers"},
    {"models"},
    {"optim"},
    {"parallel", "data_parallel", "inference"},
    {"checkpoints"},
    {"training"},
    {"planning"},
    {"commands"},
    {"cli", "__init__"},
    {"__main__"},
]
LEVEL = {package: i for i, packages in enumerate(LEVELS) for package in packages}


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_of(module: str) -> str:
    """'tensorpar.layers.linear' -> 'layers'; 'tensorpar' (its __init__) -> '__init__'."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def sources() -> dict[str, pathlib.Path]:
    return {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _targets(node, modules) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.startswith("tensorpar")]
    if node.module is None or not node.module.startswith("tensorpar"):
        return []
    return [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module for a in node.names]


def import_edges() -> tuple[dict[str, set[str]], list[str]]:
    """({module: tensorpar modules it imports at its top level}, ['module:line imports X inside a function'])."""
    modules = sources()
    edges, inner = {m: set() for m in modules}, []
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        for node in tree.body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                edges[name].update(_targets(node, modules))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                for sub in ast.walk(node):
                    if isinstance(sub, (ast.Import, ast.ImportFrom)) and _targets(sub, modules):
                        inner.append(f"{name}:{sub.lineno} imports {_targets(sub, modules)} inside {node.name}")
    return edges, inner


def upward_edges(edges: dict[str, set[str]]) -> list[str]:
    bad = []
    for src, targets in edges.items():
        for dst in targets:
            a, b = package_of(src), package_of(dst)
            if a not in LEVEL or b not in LEVEL:
                bad.append(f"{src} -> {dst}: package not placed in LEVELS")
            elif a != b and LEVEL[b] >= LEVEL[a]:
                bad.append(f"{src} -> {dst}: {a} (level {LEVEL[a]}) must not import {b} (level {LEVEL[b]})")
    return bad


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a list of modules (first = last), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    stack: list[str] = []

    def visit(node):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_package_imports_a_package_above_it():
    edges, _ = import_edges()
    assert sum(map(len, edges.values())) > 100, "the import scan found too few imports to mean anything"
    assert upward_edges(edges) == []


def test_no_module_import_cycle():
    assert find_cycle(import_edges()[0]) is None


def test_tensorpar_imports_sit_at_the_top_of_their_module():
    assert import_edges()[1] == []


def test_no_two_modules_share_a_name():
    """A newcomer looking for `checkpoint.py` or `schedule.py` finds one file, not two in different packages."""
    seen: dict[str, list[str]] = {}
    for name, path in sources().items():
        if path.name != "__init__.py":
            seen.setdefault(path.name, []).append(name)
    assert {k: v for k, v in seen.items() if len(v) > 1} == {}


def test_every_package_is_placed():
    assert {package_of(m) for m in sources()} <= set(LEVEL)


@pytest.mark.parametrize("name,path", sorted(sources().items()))
def test_source_files_stay_readable(name, path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{name} has {lines} lines (at most {MAX_LINES})"


def test_the_checks_catch_what_they_guard_against():
    """The checkers themselves: an upward edge, a same-level edge and a cycle are reported."""
    edges = {"tensorpar.layers.linear": {"tensorpar.training.trainer"},
             "tensorpar.data.dataset": {"tensorpar.distributed.mesh"},
             "tensorpar.models.a": {"tensorpar.models.b"}, "tensorpar.models.b": {"tensorpar.models.a"}}
    bad = upward_edges(edges)
    assert any("layers" in b and "training" in b for b in bad) and any("data" in b for b in bad)
    assert find_cycle(edges) in (["tensorpar.models.a", "tensorpar.models.b", "tensorpar.models.a"],
                                 ["tensorpar.models.b", "tensorpar.models.a", "tensorpar.models.b"])
