"""The layout the code keeps: one import namespace, layers whose imports point down only, no
import circle, tooling the runtime does not load. Read from the source as text (ast): nothing
here runs the packages but the install check."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Lowest first: a package imports only those before it (docs/architecture.md).
LAYERS = ("models", "memory", "node", "master", "tui")
TOOLING = ("edgetp.master.bench", "edgetp.master.emulate")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(["edgetp", *parts])


MODULES = {_module_name(p): p for layer in LAYERS for p in (ROOT / layer).rglob("*.py")}


def _ours(name: str) -> str | None:
    """The module of ours that importing `name` (a module or a name in one) loads."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(tree: ast.AST) -> list[tuple[ast.stmt, str]]:
    """Each import statement of ours with the module it loads."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node, m) for a in node.names if (m := _ours(a.name))]
        elif isinstance(node, ast.ImportFrom) and node.module:
            for a in node.names:
                if m := _ours(f"{node.module}.{a.name}") or _ours(node.module):
                    found.append((node, m))
    return found


@cache
def _tree(module: str) -> ast.Module:
    return ast.parse(MODULES[module].read_text())


@cache
def _graph() -> dict[str, set[str]]:
    return {m: {t for _, t in _imports(_tree(m))} - {m} for m in MODULES}


def test_no_generic_package_is_installed(tmp_path):
    """From outside the checkout, none of the folders' bare names imports (they install as
    edgetp.models, edgetp.node, ...), and the command works."""
    for bare in LAYERS:
        result = subprocess.run(
            [sys.executable, "-c", f"import {bare}"], cwd=tmp_path, capture_output=True, text=True
        )
        assert result.returncode != 0 and "No module named" in result.stderr, (bare, result)
    check = "import edgetp.models, edgetp.node, edgetp.master, edgetp.memory, edgetp.tui"
    subprocess.run([sys.executable, "-c", check], cwd=tmp_path, check=True)
    command = subprocess.run(
        [sys.executable, "-m", "edgetp.tui.cli", "--help"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert command.returncode == 0 and "usage: edgetp" in command.stdout, command.stderr


def test_imports_point_down_and_never_circle():
    graph = _graph()
    up = [
        (m, t)
        for m, targets in graph.items()
        for t in targets
        if LAYERS.index(t.split(".")[1]) > LAYERS.index(m.split(".")[1])
    ]
    assert not up, up
    # Tarjan's strongly connected components: a circle is one of more than one module.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = stack[stack.index(v) :]
            del stack[stack.index(v) :]
            if len(part) > 1:
                circles.append(sorted(part))

    for v in graph:
        if v not in index:
            visit(v)
    assert not circles, circles


def test_a_module_that_imports_nothing_of_ours_is_seen_so():
    """The checks above read imports right: a known edge is found, a known absence too."""
    graph = _graph()
    assert "edgetp.models.config" in graph["edgetp.master.cluster.session"]
    assert not any(t.startswith("edgetp.") for t in graph["edgetp.models.errors"])


def test_the_runtime_loads_no_tooling_at_module_level():
    """Benchmarks and device emulation are tools: the runtime's modules import them only where
    a tool is asked for (inside a function) or for types."""
    runtime = [m for m in MODULES if not m.startswith((*TOOLING, "edgetp.tui"))]
    loaded = []
    for m in runtime:
        top = [s for s in _tree(m).body if isinstance(s, ast.Import | ast.ImportFrom)]
        loaded += [(m, t) for s, t in _imports(ast.Module(body=top, type_ignores=[]))
                   if t.startswith(TOOLING)]  # fmt: skip
    assert not loaded, loaded


# Ollama, an API the bridge speaks, is not the Llama family
FAMILY = re.compile(r"gemma|qwen|deltanet|(?<!o)llama|mixtral|gpt_?oss|smollm|phi", re.IGNORECASE)


def _identifiers(tree: ast.AST) -> set[str]:
    """The names a module's code binds or reads: variables, attributes, functions, classes,
    parameters, keyword arguments and what it imports (not its strings or comments)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.keyword) and node.arg:
            names.add(node.arg)
        elif isinstance(node, ast.alias):
            names.update(n for n in (node.name, node.asname) if n)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_the_runtime_names_no_model_family():
    """What a family does differently is its module's under models/ (models/families.py's
    registry): the cluster, the generation loop, the bridge and the node name none."""
    runtime = [m for m in MODULES if m.startswith(("edgetp.master", "edgetp.node"))]
    named = {
        m: sorted(n for n in _identifiers(_tree(m)) if FAMILY.search(n))
        for m in runtime
        if not m.startswith(TOOLING)
    }
    assert not {m: n for m, n in named.items() if n}, named
