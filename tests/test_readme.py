"""The README's Python blocks run as written, so the README cannot rot."""

from __future__ import annotations

import re

import pytest

from tests.helpers import REPO, run_script

BLOCKS = re.findall(r"```python\n(.*?)```", (REPO / "README.md").read_text(), flags=re.S)


def test_readme_has_python_blocks() -> None:
    assert len(BLOCKS) >= 2  # the ten-line example and the checkpoint/memory one


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_block_runs(index: int, tmp_path) -> None:
    result = run_script(BLOCKS[index], tmp_path, timeout=240)
    assert result.returncode == 0, result.output[-4000:]
