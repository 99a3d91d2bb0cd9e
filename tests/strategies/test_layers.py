"""strategies/ imports run one way: auto -> the families -> process_group -> resume; microbatch -> split.

Below strategies/, the estimate and the sharding plan never import upwards. Read from the source
with ``ast``, so a cycle dodged by an import inside a function shows too; the cycle check covers the
whole package (two modules of one room importing each other included).
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import lightning_mgpu
import lightning_mgpu.strategies
from lightning_mgpu.strategies.ddp.strategy import MGPUDDPStrategy
from lightning_mgpu.strategies.dp.strategy import MGPUDataParallelStrategy
from lightning_mgpu.strategies.fsdp.strategy import MGPUFSDPStrategy

ROOT = Path(lightning_mgpu.strategies.__file__).parent
PACKAGE = "lightning_mgpu.strategies"

# folder (or top-level module) -> the folders of strategies/ it may import besides itself
ALLOWED = {
    "mixin": set(),
    "split": set(),
    "resume": set(),
    "process_group": {"mixin", "resume"},
    "microbatch": {"mixin", "split"},
    "ddp": {"mixin", "process_group", "microbatch"},
    "fsdp": {"mixin", "process_group", "microbatch"},
    "dp": {"mixin", "microbatch", "split"},
    "auto": {"ddp", "fsdp", "dp", "microbatch", "mixin", "process_group", "resume"},
}


# room of the package -> the rooms it must not import. The sharding plan and what it leaves on each
# device are used by mgpu_fsdp (which applies the plan and refuses a model too big) and by the estimate
# (which predicts mgpu_fsdp's peak from the same units): they live in _sharding/, below both, so that
# neither owns them and the estimate needs nothing of strategies/, which itself imports the estimate.
BELOW = {
    "lightning_mgpu._sharding": ("lightning_mgpu.strategies", "lightning_mgpu.estimate"),
    "lightning_mgpu.estimate": ("lightning_mgpu.strategies",),
}


def _room(module: str) -> str:
    return module.removeprefix(PACKAGE + ".").split(".")[0]


def _imports(path: Path, package: str = PACKAGE) -> list[tuple[str, bool]]:
    """(imported module of ``package``, whether the import sits inside a function) for one file."""
    tree = ast.parse(path.read_text())
    found: list[tuple[str, bool]] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inside = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if isinstance(child, ast.ImportFrom) and child.module and child.module.startswith(package + "."):
                # `from package import submodule` imports the submodule (the package's __init__ runs too)
                named = [f"{child.module}.{a.name}" for a in child.names]
                subs = [name for name in named if name in ALL_MODULES]
                found.extend((sub, inside) for sub in subs or [child.module])
            elif isinstance(child, ast.Import):
                found.extend((a.name, inside) for a in child.names if a.name.startswith(package + "."))
            visit(child, inside)

    visit(tree, False)
    return found


def _modules(root: Path, package: str) -> dict[str, Path]:
    return {
        ".".join((package, *path.relative_to(root).with_suffix("").parts)).removesuffix(".__init__"): path
        for path in root.rglob("*.py")
    }


MODULES = _modules(ROOT, PACKAGE)
ALL_MODULES = _modules(Path(lightning_mgpu.__file__).parent, "lightning_mgpu")


def test_every_room_is_known_and_imports_only_below_it() -> None:
    wrong = []
    for module, path in MODULES.items():
        if module == PACKAGE:
            continue
        room = _room(module)
        assert room in ALLOWED, f"{path}: a new room of strategies/; add it to ALLOWED with its layer"
        for target, _ in _imports(path):
            if _room(target) != room and _room(target) not in ALLOWED[room]:
                wrong.append(f"{module} imports {target}")
    assert not wrong, "imports against the direction:\n" + "\n".join(wrong)


def _within(module: str, room: str) -> bool:
    return module == room or module.startswith(room + ".")


def test_the_estimate_and_the_sharding_plan_import_nothing_above_them() -> None:
    wrong = [
        f"{module} imports {target}"
        for module, path in ALL_MODULES.items()
        for room, above in BELOW.items()
        if _within(module, room)
        for target, _ in _imports(path, "lightning_mgpu")
        if any(_within(target, upper) for upper in above)
    ]
    assert not wrong, "imports against the direction:\n" + "\n".join(wrong)


def test_no_import_inside_a_function_and_no_cycle() -> None:
    inside = [f"{m} imports {t} inside a function" for m, p in MODULES.items() for t, f in _imports(p) if f]
    assert not inside, "\n".join(inside)
    imports = {m: _imports(p, "lightning_mgpu") for m, p in ALL_MODULES.items()}
    graph = {m: {t for t, _ in found if t in ALL_MODULES} for m, found in imports.items()}
    done: set[str] = set()

    def walk(module: str, path: list[str]) -> None:
        if module in path:
            raise AssertionError("import cycle: " + " -> ".join([*path[path.index(module) :], module]))
        if module in done:
            return
        for target in graph[module]:
            walk(target, [*path, module])
        done.add(module)

    for module in graph:
        walk(module, [])


def test_constructor_arguments_show_in_the_signature() -> None:
    for cls in (MGPUDDPStrategy, MGPUFSDPStrategy, MGPUDataParallelStrategy):
        parameters = inspect.signature(cls).parameters
        assert "micro_batch_size" in parameters, cls
        assert not any(p.kind is p.VAR_POSITIONAL for p in parameters.values()), cls
    ddp = inspect.signature(MGPUDDPStrategy).parameters
    for name in ("stall_timeout", "process_group_backend", "timeout", "start_method", "ddp_comm_hook"):
        assert name in ddp, name
    assert "stall_timeout" in inspect.signature(MGPUFSDPStrategy).parameters
