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


@pytest.mark.slow
def test_readme_examples_run(tmp_path: Path) -> None:
    check_page(README, tmp_path)
