"""Which tests start processes: the ``processes`` marker, read from the tests' own source.

A test starts processes when its function, a fixture it requests, or a function or class of the
tests it uses (in its module, a conftest.py above it, or an imported ``tests.`` module) uses a
module that starts them (``subprocess``, ``multiprocessing``, nbclient's kernels), directly or
through other such functions. ``conftest.py`` marks those tests, so ``make test-fast`` can leave them
out; a test that starts a process without the marker is reported at its teardown (see conftest.py).
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
from collections.abc import Iterable
from pathlib import Path

__all__ = ["starts_processes"]

TESTS = Path(__file__).resolve().parent
# modules whose use starts a process (nbclient starts a Jupyter kernel)
STARTING_MODULES = ("subprocess", "multiprocessing", "torch.multiprocessing", "nbclient")


def _starts(module: str) -> bool:
    return any(module == name or module.startswith(f"{name}.") for name in STARTING_MODULES)


def _names_used(node: ast.AST) -> set[str]:
    """Names ``node`` reads, and its arguments' names (the fixtures it requests)."""
    used: set[str] = set()
    for child in ast.walk(node):
        if isinstance(child, ast.Name):
            used.add(child.id)
        elif isinstance(child, ast.arg):
            used.add(child.arg)
    return used


def _starting_imports(tree: ast.AST) -> set[str]:
    """Names bound to process-starting things by the imports anywhere in ``tree``."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _starts(alias.name):
                    names.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if _starts(node.module):
                names.update(alias.asname or alias.name for alias in node.names)
            elif node.module == "tests" or node.module.startswith("tests."):
                starters = _module_starters(node.module)
                names.update(alias.asname or alias.name for alias in node.names if alias.name in starters)
    return names


def _module_path(module: str) -> Path | None:
    parts = module.split(".")[1:]
    if not parts:  # `from tests import x`: no module of the tests is named
        return None
    relative = Path(*parts)
    for path in (TESTS / relative.with_suffix(".py"), TESTS / relative / "__init__.py"):
        if path.is_file():
            return path
    return None


def _module_starters(module: str) -> frozenset[str]:
    path = _module_path(module)
    return _file_starters(path) if path is not None else frozenset()


_READING: set[Path] = set()  # files being read: an import cycle among tests files ends there


@functools.cache
def _file_starters(path: Path) -> frozenset[str]:
    """Top-level names of a tests file that start processes, directly or through each other."""
    if path in _READING:
        return frozenset()
    _READING.add(path)
    try:
        return _read_starters(path)
    finally:
        _READING.discard(path)


def _read_starters(path: Path) -> frozenset[str]:
    tree = ast.parse(path.read_text())
    starters = _starting_imports(tree)
    if path.name.startswith("test_"):  # a test module's fixtures may request those of a conftest.py
        starters |= _conftest_starters(path)
    defined: dict[str, set[str]] = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            defined[node.name] = _names_used(node)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if isinstance(target, ast.Name) and node.value is not None:
                    defined[target.id] = _names_used(node.value)
    grew = True
    while grew:
        grew = False
        for name, used in defined.items():
            if name not in starters and used & starters:
                starters.add(name)
                grew = True
    # an autouse fixture runs for every test: conftest.py's check for unmarked starts only watches
    return frozenset(starters & defined.keys()) - _autouse_fixtures(tree)


def _autouse_fixtures(tree: ast.Module) -> set[str]:
    names = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            for decorator in node.decorator_list:
                if isinstance(decorator, ast.Call) and any(
                    k.arg == "autouse" and isinstance(k.value, ast.Constant) and k.value.value
                    for k in decorator.keywords
                ):
                    names.add(node.name)
    return names


@functools.cache
def _file_imports(path: Path) -> frozenset[str]:
    return frozenset(_starting_imports(ast.parse(path.read_text())))


def _conftest_starters(path: Path) -> frozenset[str]:
    """Fixtures that start processes, from the conftest.py files above ``path``."""
    found: set[str] = set()
    for folder in _folders_above(path):
        conftest = folder / "conftest.py"
        if conftest.is_file() and conftest != path:
            found |= _file_starters(conftest)
    return frozenset(found)


def _folders_above(path: Path) -> Iterable[Path]:
    folder = path.parent
    while folder == TESTS or TESTS in folder.parents:
        yield folder
        folder = folder.parent


def starts_processes(function: object, path: Path, fixtures: Iterable[str]) -> bool:
    """Whether the test ``function`` in the file ``path``, requesting ``fixtures``, starts processes."""
    if TESTS not in path.parents:
        return False
    starters = _file_starters(path) | _file_imports(path) | _conftest_starters(path)
    if starters.intersection(fixtures):
        return True
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(function)))  # type: ignore[arg-type]
    except (OSError, TypeError):
        return False
    return bool(_starting_imports(tree) or _names_used(tree) & starters)
