"""Private names of Lightning, torch and torchmetrics are reached from ``lightning_mgpu/_compat/`` only.

Read from the source with ``ast``: an import of a private module or name from one of these projects
outside ``_compat/`` fails, and so does a private attribute that ``_compat/`` wraps, read or written
outside it on anything but ``self``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import lightning_mgpu

ROOT = Path(lightning_mgpu.__file__).parent
COMPAT = ROOT / "_compat"
DEPENDENCIES = ("lightning", "pytorch_lightning", "torch", "torchmetrics")


def _is_private(dotted: str) -> bool:
    return any(part.startswith("_") for part in dotted.split("."))


def private_imports(source: str) -> list[str]:
    """The private names of the dependencies that ``source`` imports, as ``line: what``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in DEPENDENCIES:
            names = [a.name for a in node.names if a.name.startswith("_")]
            if _is_private(node.module) or names:
                found.append(
                    f"{node.lineno}: from {node.module} import {', '.join(a.name for a in node.names)}"
                )
        elif isinstance(node, ast.Import):
            found.extend(
                f"{node.lineno}: import {a.name}"
                for a in node.names
                if a.name.split(".")[0] in DEPENDENCIES and _is_private(a.name)
            )
    return found


def _is_self(node: ast.expr) -> bool:
    if isinstance(node, ast.Name):
        return node.id in ("self", "cls")
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super"


def _private_attributes(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, name) of every ``x._name`` and ``getattr/hasattr/setattr(x, "_name")``, but on ``self`` or
    ``super()`` (an override of a private hook calls its parent's)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            if not _is_self(node.value):
                found.append((node.lineno, node.attr))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr", "setattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
            and node.args[1].value.startswith("_")
            and not _is_self(node.args[0])
        ):
            found.append((node.lineno, node.args[1].value))
    return found


def _package_files() -> list[Path]:
    return [p for p in sorted(ROOT.rglob("*.py")) if COMPAT not in p.parents]


def test_no_private_import_of_a_dependency_outside_compat() -> None:
    wrong = [
        f"{path.relative_to(ROOT)}:{hit}"
        for path in _package_files()
        for hit in private_imports(path.read_text())
    ]
    assert not wrong, "import these through lightning_mgpu/_compat/ instead:\n" + "\n".join(wrong)


def test_private_attributes_wrapped_in_compat_are_used_nowhere_else() -> None:
    wrapped = {
        name
        for path in COMPAT.glob("*.py")
        for _, name in _private_attributes(ast.parse(path.read_text()))
        if not name.startswith("__")
    }
    assert {"_checkpoint_connector", "_combined_loader", "_update_count", "_fsdp_param_groups"} <= wrapped
    wrong = [
        f"{path.relative_to(ROOT)}:{line}: {name}"
        for path in _package_files()
        for line, name in _private_attributes(ast.parse(path.read_text()))
        if name in wrapped
    ]
    assert not wrong, "use the accessor in lightning_mgpu/_compat/ instead:\n" + "\n".join(wrong)


def test_compat_imports_nothing_of_the_package() -> None:
    """The bottom layer: every room may use it, so it uses none."""
    for path in COMPAT.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                assert not (node.module or "").startswith("lightning_mgpu"), (
                    f"{path.name} imports {node.module}"
                )


def test_the_import_check_finds_each_form() -> None:
    source = (
        "from torch.utils._pytree import tree_flatten\n"
        "from lightning.fabric.utilities.types import _PATH\n"
        "import torch._dynamo\n"
        "from torchmetrics.utilities import _x\n"
        "from torch import nn\n"
        "from lightning_mgpu._words import counted\n"
        "import torch.distributed as dist\n"
    )
    found = private_imports(source)
    assert [hit.split(":")[0] for hit in found] == ["1", "2", "3", "4"]
    assert "torch._dynamo" in found[2]
