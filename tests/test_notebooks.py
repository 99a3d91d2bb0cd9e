"""Each notebook runs top to bottom on a CPU in a temporary folder, and is committed without outputs."""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest
from ipykernel.kernelspec import write_kernel_spec
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

from tests.helpers import REPO

NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))
CELL_TIMEOUT_S = 120
KERNEL = "lightning-mgpu-test"
ANSI_COLOUR = re.compile(r"\x1b\[[0-9;]*m")


@pytest.fixture
def this_python_kernel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A kernel spec for this interpreter, found before any ``python3`` spec the user registered."""
    write_kernel_spec(tmp_path / "jupyter" / "kernels" / KERNEL)
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    return KERNEL


def test_the_three_notebooks_are_there() -> None:
    assert [p.name for p in NOTEBOOKS] == [
        "01_quickstart.ipynb",
        "02_memory.ipynb",
        "03_checkpoints.ipynb",
    ]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_committed_without_outputs(path: Path) -> None:
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    assert nb.nbformat == 4
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [], f"{path.name}: clear the outputs before committing"
            assert cell.execution_count is None, f"{path.name}: clear the execution counts before committing"


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs(path: Path, tmp_path: Path, this_python_kernel: str) -> None:
    nb = nbformat.read(path, as_version=4)
    workdir = tmp_path / "cwd"  # the notebooks write only to their own temporary folders
    workdir.mkdir()
    client = NotebookClient(
        nb,
        timeout=CELL_TIMEOUT_S,
        kernel_name=this_python_kernel,
        resources={"metadata": {"path": str(workdir)}},
    )
    try:
        client.execute()
    except CellExecutionError as err:
        pytest.fail(f"{path.name} failed in a cell:\n{ANSI_COLOUR.sub('', str(err))}", pytrace=False)
    assert list(workdir.iterdir()) == []
