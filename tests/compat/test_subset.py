"""``tests/compat/subset.txt`` names tests that exist: a renamed or moved test fails ``make test``."""

from __future__ import annotations

import re

import pytest

from tests.helpers import REPO

SUBSET = REPO / "tests" / "compat" / "subset.txt"
LINES = [line for line in (raw.strip() for raw in SUBSET.read_text().splitlines()) if line and line[0] != "#"]


def test_the_subset_covers_every_strategy_and_the_command_line() -> None:
    files = {line.split("::")[0] for line in LINES}
    for needed in ("ddp", "dp", "fsdp", "microbatch"):
        assert any(f"tests/strategies/{needed}/" in f for f in files), needed
    assert "tests/test_readme.py" in files
    assert "tests/cli/test_run.py" in files


@pytest.mark.parametrize("node", LINES)
def test_each_line_names_a_test_file_and_function(node: str) -> None:
    path, _, name = node.partition("::")
    assert (REPO / path).is_file(), f"{SUBSET.name}: {path} does not exist"
    if name:
        assert re.search(rf"^def {re.escape(name)}\(", (REPO / path).read_text(), flags=re.M), (
            f"{SUBSET.name}: {path} has no test {name}"
        )
