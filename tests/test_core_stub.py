"""The typed stub `qwen4exp/_core.pyi` and the compiled `qwen4exp._core` agree, and the stub is documented.

Every public name of the module is in the stub and vice versa; per class, the same public members of
the same kind (property, method, staticmethod), the same special methods, the same parameters
(names, keyword-only or not, defaulted or not), the same exception bases. Read with ast and inspect.
"""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import pytest

import qwen4exp._core as core

STUB = Path(core.__file__).with_name("_core.pyi")
if not STUB.exists():  # an installed wheel keeps the stub beside the package sources
    STUB = Path(__file__).resolve().parents[1] / "daemon" / "qwen4exp" / "_core.pyi"

# Special methods that come with every class or need no stub entry.
IGNORED_DUNDERS = {"__doc__", "__module__", "__new__", "__repr__", "__str__", "__weakref__", "__dict__"}


def _tree() -> ast.Module:
    return ast.parse(STUB.read_text(), filename=str(STUB))


def _stub_top_level() -> tuple[dict[str, ast.ClassDef], set[str]]:
    classes: dict[str, ast.ClassDef] = {}
    names: set[str] = set()
    for node in _tree().body:
        if isinstance(node, ast.ClassDef):
            classes[node.name] = node
            names.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.FunctionDef):
            names.add(node.name)
    return classes, names


def _kind(fn: ast.FunctionDef) -> str:
    decorators = {d.id for d in fn.decorator_list if isinstance(d, ast.Name)}
    if "property" in decorators:
        return "property"
    if "staticmethod" in decorators:
        return "staticmethod"
    return "method"


def _stub_members(cls: ast.ClassDef) -> dict[str, ast.FunctionDef]:
    return {n.name: n for n in cls.body if isinstance(n, ast.FunctionDef)}


def _compiled_kind(cls: type, name: str) -> str:
    raw = cls.__dict__[name]
    if isinstance(raw, staticmethod):
        return "staticmethod"
    if inspect.isgetsetdescriptor(raw) or isinstance(raw, property):
        return "property"
    return "method"


def _stub_params(fn: ast.FunctionDef) -> list[tuple[str, str, bool]]:
    """(name, kind, has default) per parameter, self left out."""
    a = fn.args
    positional = a.posonlyargs + a.args
    defaults = [False] * (len(positional) - len(a.defaults)) + [True] * len(a.defaults)
    out = [(p.arg, "positional", d) for p, d in zip(positional, defaults)]
    out += [(p.arg, "keyword", d is not None) for p, d in zip(a.kwonlyargs, a.kw_defaults)]
    return [p for p in out if p[0] != "self"]


def _compiled_params(obj: object) -> list[tuple[str, str, bool]]:
    sig = inspect.signature(obj)  # type: ignore[arg-type]
    kinds = {inspect.Parameter.KEYWORD_ONLY: "keyword"}
    return [
        (p.name, kinds.get(p.kind, "positional"), p.default is not inspect.Parameter.empty)
        for p in sig.parameters.values()
        if p.name != "self"
    ]


def _public(names: object) -> set[str]:
    return {n for n in names if not n.startswith("_")}  # type: ignore[attr-defined]


def test_module_and_stub_name_the_same_things() -> None:
    classes, names = _stub_top_level()
    compiled = _public(dir(core)) | {"__version__"}
    assert _public(names) | {"__version__"} == compiled
    assert "__version__" in names


@pytest.mark.parametrize("name", sorted(_stub_top_level()[0]))
def test_each_class_has_the_same_members(name: str) -> None:
    stub = _stub_members(_stub_top_level()[0][name])
    cls = getattr(core, name)
    compiled = {n: _compiled_kind(cls, n) for n in _public(cls.__dict__)}
    assert {n: _kind(f) for n, f in stub.items() if not n.startswith("_")} == compiled
    dunders = {n for n in cls.__dict__ if n.startswith("__")} - IGNORED_DUNDERS
    assert {n for n in stub if n.startswith("__")} - {"__init__"} == dunders
    assert ("__init__" in stub) == ("__new__" in cls.__dict__), "constructible iff the stub has __init__"


@pytest.mark.parametrize("name", sorted(_stub_top_level()[0]))
def test_each_signature_matches(name: str) -> None:
    stub = _stub_members(_stub_top_level()[0][name])
    cls = getattr(core, name)
    for member, fn in stub.items():
        if _kind(fn) == "property" or member in ("__len__", "__contains__"):
            continue
        target = cls if member == "__init__" else getattr(cls, member)
        assert _stub_params(fn) == _compiled_params(target), f"{name}.{member}"


def test_exceptions_have_the_same_bases() -> None:
    classes, _ = _stub_top_level()
    for name, node in classes.items():
        cls = getattr(core, name)
        if not issubclass(cls, BaseException):
            assert not node.bases, name
            continue
        stub_bases = [b.id for b in node.bases if isinstance(b, ast.Name)]
        assert stub_bases == [b.__name__ for b in cls.__bases__], name


def test_every_class_method_argument_and_exception_is_documented() -> None:
    classes, _ = _stub_top_level()
    assert ast.get_docstring(_tree()), "module docstring"
    for name, node in classes.items():
        assert ast.get_docstring(node), f"{name} has no docstring"
        for member, fn in _stub_members(node).items():
            doc = ast.get_docstring(fn)
            assert doc, f"{name}.{member} has no docstring"
            params = [p[0] for p in _stub_params(fn)]
            if params and member not in ("__contains__",):
                assert "Args:" in doc, f"{name}.{member} documents no arguments"
                for p in params:
                    assert f"{p}:" in doc, f"{name}.{member} does not document {p!r}"


def test_raises_sections_name_real_exceptions() -> None:
    known = {n for n in dir(core) if isinstance(getattr(core, n), type)} | {"TypeError", "ValueError", "OverflowError"}
    for node in ast.walk(_tree()):
        if not (isinstance(node, ast.FunctionDef) and (doc := ast.get_docstring(node)) and "Raises:" in doc):
            continue
        raised = []
        for line in doc.split("Raises:", 1)[1].splitlines()[1:]:
            if line and not line.startswith(" "):
                break  # the next section
            if (m := re.match(r"^    (\w+): ", line)) is not None:
                raised.append(m.group(1))
        assert raised, f"{node.name}: empty Raises section"
        assert set(raised) <= known, (node.name, raised)


def test_constants_have_the_documented_values() -> None:
    assert (core.TRAINED_CONTEXT, core.CONTEXT_STEP, core.FLOOR_CONTEXT, core.CHUNK_ROWS) == (262144, 4096, 4096, 256)
    assert core.DEFAULT_HEADROOM == pytest.approx(0.1)
    assert isinstance(core.__version__, str)
