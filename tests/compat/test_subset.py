"""``tests/compat/subset.txt`` names tests that exist: a renamed or moved test fails ``make test``."""

from __future__ import annotations

import re

import pytest

from tests.helpers import REPO

SUBSET = REPO / "tests" / "compat" / "subset.txt"
COMBINATIONS = {"floor", "gloo-sum", "newest"}  # tests/compat/run.sh's
LINES = [line for line in (raw.strip() for raw in SUBSET.read_text().splitlines()) if line and line[0] != "#"]


def runs_in(combination: str) -> set[str]:
    """The files of the lines that ``combination`` runs."""
    return {line.split()[-1].split("::")[0] for line in LINES if combination in line.split()[:-1]}


def test_every_combination_covers_every_strategy_it_can_run() -> None:
    for combination in COMBINATIONS:
        files = runs_in(combination)
        assert "tests/compat/test_pip_keeps_torch.py" in files, combination
        assert "tests/compat/test_newer_torch.py" in files, combination
    fsdp = "tests/strategies/fsdp/test_gloo_average.py"
    assert fsdp in runs_in("gloo-sum")
    assert fsdp in runs_in("newest")
    for needed in ("ddp", "dp", "fsdp", "microbatch"):
        assert any(f"tests/strategies/{needed}/" in f for f in runs_in("newest")), needed
    for combination in ("floor", "newest"):
        assert {"tests/test_readme.py", "tests/cli/test_run.py"} <= runs_in(combination), combination


@pytest.mark.parametrize("line", LINES)
def test_each_line_names_its_combinations_and_a_test_file_and_function(line: str) -> None:
    *combinations, node = line.split()
    assert combinations, f"{SUBSET.name}: {line!r} names no combination ({', '.join(sorted(COMBINATIONS))})"
    assert set(combinations) <= COMBINATIONS, f"{SUBSET.name}: {line!r}: unknown combination"
    path, _, name = node.partition("::")
    assert (REPO / path).is_file(), f"{SUBSET.name}: {path} does not exist"
    if name:
        assert re.search(rf"^def {re.escape(name)}\(", (REPO / path).read_text(), flags=re.M), (
            f"{SUBSET.name}: {path} has no test {name}"
        )
