"""The ``Example::`` blocks of the public docstrings run as written, on a CPU-only machine."""

from __future__ import annotations

import inspect
import textwrap
from pathlib import Path

import pytest

import lightning_mgpu
from lightning_mgpu.checkpoint.export import ExportReport

# examples that say so start DDP processes and only work as a script: they are compiled, not run
SCRIPT_ONLY = "run as a script"

NAMES = [
    "MGPUDataParallelStrategy",
    "MGPUDDPStrategy",
    "MGPUFSDPStrategy",
    "MemoryEstimate",
    "estimate_memory",
    "LoadReport",
    "load_state_dict",
    "export_state_dict",
    "StrategyChoice",
    "choose_strategy",
]


def _example(obj: object) -> str:
    """The indented block after ``Example::`` in ``obj``'s docstring, dedented."""
    doc = inspect.getdoc(obj) or ""
    assert "Example::" in doc, f"{obj!r} has no Example:: block"
    block: list[str] = []
    for line in doc.split("Example::", 1)[1].splitlines()[1:]:
        if line.strip() and not line.startswith(" "):
            break
        block.append(line)
    code = textwrap.dedent("\n".join(block)).strip()
    assert code, f"{obj!r} has an empty Example:: block"
    return code + "\n"


EXAMPLES = {name: getattr(lightning_mgpu, name) for name in NAMES} | {"ExportReport": ExportReport}


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_example_runs(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    code = _example(EXAMPLES[name])
    compiled = compile(code, f"<{name} example>", "exec")
    if SCRIPT_ONLY in code:
        pytest.skip("the example starts DDP processes and runs only as a script")
    monkeypatch.chdir(tmp_path)
    exec(compiled, {"__name__": "__main__"})


def test_script_only_examples_still_compile_and_say_why() -> None:
    """The DDP example is not run here, but it must parse and tell the reader how to run it."""
    code = _example(lightning_mgpu.MGPUDDPStrategy)
    assert code.startswith(f"# {SCRIPT_ONLY}")
    compile(code, "<MGPUDDPStrategy example>", "exec")
