"""The package's modules import each other without circles (imports inside functions count too): a circle means
two modules that cannot be understood, tested or moved one without the other."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "daemon" / "qwen4exp"


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that `name` imports, anywhere in its file."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            # `from x import y` imports the module x.y when there is one, else names from x.
            found |= {f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names}
    return {m for m in found if m in modules and m != name}


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []

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
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return circles


def test_the_finder_sees_a_circle():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_circles_in_the_package():
    modules = _modules()
    assert "qwen4exp.server.app" in modules and "qwen4exp.engine.model.moe" in modules
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert "qwen4exp.server.generate_api" in graph["qwen4exp.server.app"]      # the finder reads imports
    assert _circles(graph) == []


def test_the_kernels_import_nothing_of_ours_but_each_other():
    """docs/ARCHITECTURE.md's rule: kernels/ stands alone (built and compiled ahead of time without the model)."""
    modules = _modules()
    def in_kernels(name: str) -> bool:
        return name == "qwen4exp.kernels" or name.startswith("qwen4exp.kernels.")

    kernels = {name: path for name, path in modules.items() if in_kernels(name)}
    assert "qwen4exp.kernels.quant_tiles" in kernels
    outside = {name: sorted(m for m in _imports(name, path, modules) if not in_kernels(m))
               for name, path in kernels.items()}
    assert {name: found for name, found in outside.items() if found} == {}
