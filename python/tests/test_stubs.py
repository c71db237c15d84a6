"""The type stubs shipped with the package name what the module has."""

import ast
import inspect
from pathlib import Path

import lanes
from lanes import _lanes

STUB = Path(lanes.__file__).with_name("_lanes.pyi")


def stub_names():
    tree = ast.parse(STUB.read_text())
    top, members = set(), {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            top.add(node.name)
            members[node.name] = {
                n.name for n in node.body if isinstance(n, ast.FunctionDef) and not n.name.startswith("__")
            }
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            top.add(node.target.id)
    return top, members


def test_stub_ships_with_the_package():
    assert STUB.is_file()
    assert STUB.with_name("py.typed").is_file()


def test_stub_matches_the_module():
    top, members = stub_names()
    public = {n for n in dir(_lanes) if not n.startswith("_")} | {"__version__"}
    assert top - {"Array", "Feeds"} == public
    for cls, names in members.items():
        obj = getattr(_lanes, cls)
        if issubclass(obj, BaseException):
            continue
        have = {n for n, _ in inspect.getmembers(obj) if not n.startswith("_")}
        assert names == have, (cls, names ^ have)
    assert set(lanes.__all__) == public
