"""The documentation site: every example on every page runs as written, and the reference is complete.

``make docs`` builds the site with ``mkdocs build --strict`` (broken links, missing pages and
unresolved references fail it); these tests run without MkDocs installed.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

import lightning_mgpu
from tests.docs_examples import check_page, output_lines, python_blocks, unmatched_line
from tests.helpers import REPO
from tests.test_readme import declared_floors, floor_rows

DOCS = REPO / "docs"
PAGES = sorted(DOCS.rglob("*.md"))
# the README's test runs its scripts (the quick start the front page shows too)
README_SCRIPTS = frozenset(b.code for b in python_blocks(REPO / "README.md") if b.as_script)
PAGES_WITH_CODE = [p for p in PAGES if any(b.code not in README_SCRIPTS for b in python_blocks(p))]
# ::: lightning_mgpu.checkpoint.load.load_state_dict
REFERENCE_ENTRY = re.compile(r"^::: (lightning_mgpu\.[\w.]+)\s*$", flags=re.M)
NAV_ENTRY = re.compile(r":\s*(\S+\.md)\s*$", flags=re.M)


def _page_id(page: Path) -> str:
    return str(page.relative_to(DOCS))


def _reference_entries() -> dict[str, object]:
    """Every object a reference page renders, by the dotted path it names."""
    entries: dict[str, object] = {}
    for page in (DOCS / "reference").glob("*.md"):
        for path in REFERENCE_ENTRY.findall(page.read_text()):
            module, _, name = path.rpartition(".")
            entries[path] = getattr(importlib.import_module(module), name)
    return entries


def test_reference_lists_every_public_name() -> None:
    """The public API is what the reference renders: top-level names and each sub-package's ``__all__``."""
    rendered = {id(obj) for obj in _reference_entries().values()}
    public = [n for n in lightning_mgpu.__all__ if not n.startswith("__")]
    missing = [n for n in public if id(getattr(lightning_mgpu, n)) not in rendered]
    assert not missing, f"add a '::: <module>.<name>' entry under docs/reference/ for {missing}"
    package = Path(lightning_mgpu.__file__).parent
    for init in sorted(package.rglob("*/__init__.py")):
        name = ".".join(init.parent.relative_to(package.parent).parts)
        module = importlib.import_module(name)
        exported = getattr(module, "__all__", [])
        missing += [f"{name}.{n}" for n in exported if id(getattr(module, n)) not in rendered]
    assert not missing, f"document these under docs/reference/, or leave them out of __all__: {missing}"


def test_every_page_is_in_the_navigation() -> None:
    listed = set(NAV_ENTRY.findall((REPO / "mkdocs.yml").read_text()))
    pages = {_page_id(p) for p in PAGES}
    assert pages - listed == set(), "pages missing from mkdocs.yml's nav"
    assert listed - pages == set(), "mkdocs.yml's nav names pages that do not exist"


def test_readme_quick_start_is_the_front_page_one() -> None:
    """The front page shows the README's quick start; the README test runs it."""
    front = [b for b in python_blocks(DOCS / "index.md") if b.as_script]
    assert front
    assert all(b.code in README_SCRIPTS for b in front)


def test_install_page_states_the_declared_floors() -> None:
    text = (DOCS / "install.md").read_text()
    for row in floor_rows(declared_floors()):
        assert row in text, f"docs/install.md's versions table should say {row!r}, as pyproject.toml does"


@pytest.mark.slow
@pytest.mark.parametrize("page", PAGES_WITH_CODE, ids=_page_id)
def test_page_examples_run(page: Path, tmp_path: Path) -> None:
    check_page(page, tmp_path, skip=README_SCRIPTS)


def test_output_block_is_the_whole_output() -> None:
    """A block that leaves out a printed line fails; a '...' line is the only way to cut."""
    printed = "loaded 4 entries from last.ckpt\n  prefixes: removed model.\n"
    assert unmatched_line("loaded 4 entries from last.ckpt\n  prefixes: removed model.\n", printed) is None
    missing = unmatched_line("loaded 4 entries from last.ckpt\n", printed)
    assert missing is not None
    assert "prefixes: removed model." in missing
    assert unmatched_line("loaded 4 entries from last.ckpt\n...\n", printed) is None
    assert unmatched_line("  prefixes: removed model.\n", printed) == "  prefixes: removed model."
    assert unmatched_line("loaded ... entries from ...\n...\n", printed) is None  # '...' within a line


def test_output_lines_drop_what_varies_with_the_machine() -> None:
    """Progress bars, colours and a warning's file and line go; what the example prints stays."""
    actual = (
        "Epoch 0:  25%|██▌       | 2/8 [00:00<00:00, 54.60it/s, v_num=0]\x1b[1mdone\x1b[0m\r"
        "/site-packages/lightning_mgpu/strategies/dp/step.py:78: mgpu_dp split a batch\n\n"
    )
    assert output_lines(actual) == ["done", "mgpu_dp split a batch"]


def test_search_splits_the_names_users_look_up() -> None:
    """The site's search cuts text into words with mkdocs.yml's separator: a dotted or CamelCase name is found
    by its parts, so that "OutOfMemoryError" finds "torch.OutOfMemoryError"."""
    found = re.search(r"^\s+separator: '(.+)'$", (REPO / "mkdocs.yml").read_text(), flags=re.M)
    assert found, "mkdocs.yml's search plugin has no separator"

    def words(text: str) -> list[str]:
        return [w for w in re.split(found.group(1), text) if w]

    assert words("torch.OutOfMemoryError") == ["torch", *words("OutOfMemoryError")]
    assert words("OutOfMemoryError") == ["Out", "Of", "Memory", "Error"]
    assert "load_state_dict" in words("lightning_mgpu.load_state_dict(model)")
    assert "2.13" in words("torch 2.13")  # a version stays one word
