"""The wheel and sdist carry what a package index shows and the license asks for; the sdist holds no tests.

Both are built offline from a copy of the files ``git`` would ship, with this environment's setuptools.
"""

from __future__ import annotations

import email
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from email.message import Message
from pathlib import Path

import pytest

from tests.helpers import REPO

pytestmark = pytest.mark.slow

SITE_URL = re.search(r"^site_url:\s*(\S+)", (REPO / "mkdocs.yml").read_text(), flags=re.M)
# [text](target) and <https://...> in Markdown
LINKS = re.compile(r"\]\(([^)\s]+)\)|<(https?://[^>\s]+)>")


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The wheel and the sdist of a copy of the repository, tests included in the copy."""
    src = tmp_path_factory.mktemp("src")
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for name in ("lightning_mgpu", "recipes", "tests"):
        shutil.copytree(REPO / name, src / name, ignore=ignore)
    for name in ("pyproject.toml", "README.md", "PYPI.md", "LICENSE", "MANIFEST.in"):
        shutil.copy(REPO / name, src / name)
    out = tmp_path_factory.mktemp("dist")
    for hook in ("build_wheel", "build_sdist"):  # one hook a process, as a build frontend calls them
        code = f"import sys; from setuptools import build_meta; build_meta.{hook}(sys.argv[1])"
        run = [sys.executable, "-c", code, str(out)]
        subprocess.run(run, cwd=src, check=True, capture_output=True, timeout=300)
    (wheel,) = out.glob("*.whl")
    (sdist,) = out.glob("*.tar.gz")
    return wheel, sdist


def wheel_metadata(wheel: Path) -> Message:
    with zipfile.ZipFile(wheel) as archive:
        (name,) = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
        return email.message_from_bytes(archive.read(name))


def test_the_wheel_carries_the_license_text_and_says_so(built: tuple[Path, Path]) -> None:
    wheel, _ = built
    meta = wheel_metadata(wheel)
    assert meta["License-Expression"] == "Apache-2.0"
    assert meta.get_all("License-File") == ["LICENSE"]
    with zipfile.ZipFile(wheel) as archive:
        (name,) = [n for n in archive.namelist() if n.endswith(".dist-info/licenses/LICENSE")]
        text = archive.read(name).decode()
    assert text == (REPO / "LICENSE").read_text()
    assert "Apache License" in text
    assert "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text


def test_the_index_page_shows_urls_classifiers_and_an_author(built: tuple[Path, Path]) -> None:
    meta = wheel_metadata(built[0])
    urls = dict(url.split(", ", 1) for url in meta.get_all("Project-URL") or [])
    assert {"Documentation", "Source", "Issues"} <= set(urls)
    assert SITE_URL is not None
    assert urls["Documentation"] == SITE_URL.group(1)
    assert urls["Issues"] == urls["Source"] + "/issues"
    assert meta["Author"]
    classifiers = meta.get_all("Classifier") or []
    floor = int(meta["Requires-Python"].removeprefix(">=3."))
    pythons = [
        c.rsplit(" ", 1)[1]
        for c in classifiers
        if re.fullmatch(r"Programming Language :: Python :: 3\.\d+", c)
    ]
    # from the floor up to the newest Python that make test-compat runs
    newest = re.search(r"COMPAT_NEWEST_PYTHON:-3\.(\d+)", (REPO / "tests/compat/run.sh").read_text())
    assert newest is not None
    assert pythons == [f"3.{minor}" for minor in range(floor, int(newest.group(1)) + 1)]
    assert "Typing :: Typed" in classifiers
    assert any(c.startswith("Topic :: ") for c in classifiers)


def test_every_link_of_the_description_is_absolute_and_names_a_docs_page(built: tuple[Path, Path]) -> None:
    meta = wheel_metadata(built[0])
    assert meta["Description-Content-Type"] == "text/markdown"
    description = meta.get_payload()
    assert isinstance(description, str)
    links = [a or b for a, b in LINKS.findall(description)]
    assert links
    relative = [link for link in links if not link.startswith("https://")]
    assert not relative, f"PYPI.md links that do not resolve on a package index: {relative}"
    assert SITE_URL is not None
    for link in links:
        if link.startswith(SITE_URL.group(1)):
            page = link.removeprefix(SITE_URL.group(1)).strip("/") or "index"
            assert (REPO / "docs" / f"{page}.md").is_file(), f"PYPI.md: {link} names no page under docs/"


def test_the_sdist_holds_the_package_and_no_tests(built: tuple[Path, Path]) -> None:
    _, sdist = built
    with tarfile.open(sdist) as archive:
        names = [name.split("/", 1)[1] for name in archive.getnames() if "/" in name]
    assert "LICENSE" in names
    assert "lightning_mgpu/__init__.py" in names
    assert "recipes/configs/digits.yaml" in names
    assert not [name for name in names if name.startswith("tests")]
