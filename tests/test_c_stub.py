"""colomem/_C.pyi (what type checkers read) names exactly what the built core has, with the same bases."""
import ast
import inspect
from pathlib import Path

from colomem import _C

STUB = Path(_C.__file__).with_name("_C.pyi")


def _stub_names() -> dict[str, ast.AST]:
    tree = ast.parse(STUB.read_text())
    return {n.name: n for n in tree.body if isinstance(n, (ast.ClassDef, ast.FunctionDef))}


def test_stub_lists_every_public_name_of_the_module():
    module = {n for n in dir(_C) if not n.startswith("_")}
    stub = set(_stub_names())
    assert module - stub == set(), f"in colomem._C but not in _C.pyi: {sorted(module - stub)}"
    assert stub - module == set(), f"in _C.pyi but not in colomem._C: {sorted(stub - module)}"


def test_stub_classes_have_the_module_bases_and_members():
    for name, node in _stub_names().items():
        obj = getattr(_C, name)
        if not isinstance(node, ast.ClassDef):
            assert callable(obj), name
            continue
        stub_bases = [b.id if isinstance(b, ast.Name) else ast.unparse(b) for b in node.bases]
        real_bases = [b.__name__ for b in obj.__bases__ if b.__name__ != "pybind11_object"]
        assert stub_bases == real_bases, name
        members = {n.name for n in node.body if isinstance(n, ast.FunctionDef) and not n.name.startswith("_")}
        real = {m for m, _ in inspect.getmembers(obj) if not m.startswith("_")}
        if issubclass(obj, BaseException):
            continue  # exception classes: only their bases matter (status / status_name are set per instance)
        assert members <= real, f"{name}: stub members missing in the module: {sorted(members - real)}"
        own = {m for m in real if m in vars(obj)}
        assert own <= members | {m for b in node.bases for m in vars(getattr(_C, ast.unparse(b), object))}, \
            f"{name}: module members missing in the stub: {sorted(own - members)}"
