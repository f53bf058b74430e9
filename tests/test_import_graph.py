"""The package's structure stays one-way: each package imports only those below it, no module cycle, every
tensorpar import at the top of its module; no source file over 500 lines (bench/ and scripts/ too) and no function
over 60 lines in src/."""

import ast
import pathlib

import tensorpar

ROOT = pathlib.Path(tensorpar.__file__).parent
REPO = pathlib.Path(__file__).resolve().parent.parent
MAX_LINES = 500
MAX_FUNCTION_LINES = 60

# Bottom to top. A module may import its own package and any package of a lower level; packages that share a
# level do not import each other. Planning sits beside the stack: only the commands (and the cli) import it.
LEVELS = [
    {"errors"},
    {"config"},
    {"layout"},  # the parallel layout as one value, its rules and the pipeline split
    {"distributed", "data", "functional"},
    {"pipeline_parallel"},  # schedules, the runner and the split backward: no layer of its own
    {"tensor_parallel"},
    {"context_parallel", "expert_parallel"},
    {"layers"},  # attention and norms (TP x CP), and the public TP API re-exported
    {"models"},
    {"optim"},
    {"data_parallel", "inference"},
    {"checkpoints"},
    {"training"},
    {"serving"},  # the HTTP server, the engine and the paged KV cache: inference and checkpoints below it
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
    """'tensorpar.tensor_parallel.linear' -> 'layers'; 'tensorpar' (its __init__) -> '__init__'."""
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


def _python_files() -> list[pathlib.Path]:
    """Every Python file of the package, bench/ and scripts/ (where the checkout has them)."""
    files = sorted(ROOT.rglob("*.py"))
    for folder in ("bench", "scripts"):
        files += sorted((REPO / folder).rglob("*.py"))
    return files


def long_files(files) -> list[str]:
    return [f"{p} has {n} lines (at most {MAX_LINES})" for p in files
            if (n := len(p.read_text().splitlines())) > MAX_LINES]


def long_functions(path: pathlib.Path) -> list[str]:
    """The functions and methods of `path` longer than MAX_FUNCTION_LINES (from `def` to their last line)."""
    return [f"{path}:{node.lineno} {node.name} has {n} lines (at most {MAX_FUNCTION_LINES})"
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and (n := node.end_lineno - node.lineno + 1) > MAX_FUNCTION_LINES]


def test_source_files_stay_readable():
    files = _python_files()
    assert len(files) > 100, "the scan found too few files to mean anything"
    assert long_files(files) == []


def test_functions_stay_readable():
    assert [f for p in sorted(ROOT.rglob("*.py")) for f in long_functions(p)] == []


def test_the_checks_catch_what_they_guard_against():
    """The checkers themselves: an upward edge, a same-level edge and a cycle are reported."""
    edges = {"tensorpar.tensor_parallel.linear": {"tensorpar.training.trainer"},
             "tensorpar.data.dataset": {"tensorpar.distributed.mesh"},
             "tensorpar.models.a": {"tensorpar.models.b"}, "tensorpar.models.b": {"tensorpar.models.a"}}
    bad = upward_edges(edges)
    assert any("tensor_parallel" in b and "training" in b for b in bad) and any("data" in b for b in bad)
    assert find_cycle(edges) in (["tensorpar.models.a", "tensorpar.models.b", "tensorpar.models.a"],
                                 ["tensorpar.models.b", "tensorpar.models.a", "tensorpar.models.b"])


def test_the_size_checks_catch_what_they_guard_against(tmp_path):
    """A file of MAX_LINES + 1 lines and a function of MAX_FUNCTION_LINES + 1 lines are reported; their limits
    are not."""
    short = tmp_path / "short.py"
    short.write_text("def f():\n" + "    x = 1\n" * (MAX_FUNCTION_LINES - 1))
    long = tmp_path / "long.py"
    long.write_text("def f():\n" + "    x = 1\n" * MAX_FUNCTION_LINES + "\n" * (MAX_LINES - MAX_FUNCTION_LINES))
    assert long_files([short]) == [] and long_functions(short) == []
    assert len(long_files([long])) == 1 and len(long_functions(long)) == 1
