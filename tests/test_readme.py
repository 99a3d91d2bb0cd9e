"""The README's Python blocks run as written and print what it shows, so the README cannot rot."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.docs_examples import check_page, python_blocks
from tests.helpers import REPO

README = REPO / "README.md"
# read in five minutes; whatever does not fit goes to a page under docs/
MAX_LINES = 250
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
# "torch>=2.4", in pyproject.toml's dependencies
FLOOR = re.compile(r'^\s*"(torch|lightning)>=([\d.]+)', flags=re.M)


def declared_floors() -> dict[str, str]:
    """The oldest torch and Lightning pyproject.toml accepts, and its oldest Python."""
    text = (REPO / "pyproject.toml").read_text()
    floors = dict(FLOOR.findall(text))
    python = re.search(r'^requires-python = ">=([\d.]+)"', text, flags=re.M)
    assert python, "pyproject.toml has no requires-python floor"
    assert set(floors) == {"torch", "lightning"}, "pyproject.toml's floors moved: update this test"
    return floors | {"python": python.group(1)}


def test_readme_has_python_blocks() -> None:
    blocks = python_blocks(README)
    assert len(blocks) >= 3  # the quick start, the estimate, the checkpoints
    assert blocks[0].as_script, "the quick start starts DDP processes: it must say it runs as a script"


def test_readme_stays_short() -> None:
    lines = len(README.read_text().splitlines())
    assert lines <= MAX_LINES, f"README.md has {lines} lines: move the details to a page under docs/"


def test_readme_links_point_to_files() -> None:
    targets = [t for t in LINK.findall(README.read_text()) if "://" not in t]
    assert targets
    missing = [t for t in targets if not (REPO / t).exists()]
    assert not missing, f"README.md links to files that do not exist: {missing}"


def floor_rows(floors: dict[str, str]) -> list[str]:
    """The versions table's rows that state the floors, as the README and docs/install.md write them."""
    return [
        f"| Python | {floors['python']}+ |",
        f"| torch | ≥ {floors['torch']} |",
        f"| Lightning | ≥ {floors['lightning']}, < 3 |",
    ]


def test_readme_states_the_declared_floors() -> None:
    """What the install section and the versions table say is what pip will accept."""
    floors, text = declared_floors(), README.read_text()
    wanted = [f"torch ≥ {floors['torch']} and Lightning ≥ {floors['lightning']}", *floor_rows(floors)]
    for said in wanted:
        assert said in text, f"README.md should say {said!r}, as pyproject.toml does"


@pytest.mark.slow
def test_readme_examples_run(tmp_path: Path) -> None:
    check_page(README, tmp_path)
