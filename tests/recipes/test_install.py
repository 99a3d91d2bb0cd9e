"""Recipes and configs work from a normal, non-editable install, run from outside the checkout."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_mgpu.recipes import RECIPES
from tests.helpers import REPO, run_command


def test_every_package_is_listed_for_setuptools() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    tool = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    on_disk = {
        ".".join(p.parent.relative_to(REPO).parts) for p in (REPO / "lightning_mgpu").rglob("__init__.py")
    }
    assert set(tool["packages"]) == on_disk | {"lightning_mgpu.recipes"}
    assert tool["package-dir"] == {"lightning_mgpu.recipes": "recipes"}


def test_non_editable_install_runs_outside_the_checkout(tmp_path: Path) -> None:
    src = tmp_path / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("lightning_mgpu", "recipes"):
        shutil.copytree(REPO / name, src / name, ignore=ignore)
    for name in ("pyproject.toml", "PYPI.md", "LICENSE", "MANIFEST.in"):
        shutil.copy(REPO / name, src / name)
    site = tmp_path / "site"
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation"]
    subprocess.run([*pip, "--target", str(site), str(src)], check=True, capture_output=True, timeout=180)
    shutil.rmtree(src)  # nothing may be read from the source tree any more
    assert (site / "lightning_mgpu" / "recipes" / "configs" / "digits.yaml").is_file()
    assert not (site / "recipes").exists()  # no top-level package named "recipes"

    work = tmp_path / "elsewhere"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "LOCAL_RANK", "RANK", "WORLD_SIZE")}
    env["PYTHONPATH"] = str(site)
    listing = run_command([str(site / "bin" / "lightning-mgpu"), "recipes"], cwd=work, env=env)
    assert listing.returncode == 0, listing.output
    assert [line.split()[0] for line in listing.stdout.splitlines()] == list(RECIPES)

    code = (
        "import lightning_mgpu.recipes as r, lightning_mgpu.recipes.digits as d;"
        "from lightning_mgpu.cli.main import main;"
        "print(r.CONFIG_DIR); print(d.__file__);"
        "raise SystemExit(main(['run', 'digits', 'trainer.fast_dev_run=true', 'trainer.devices=1',"
        " 'trainer.accelerator=cpu', 'trainer.enable_progress_bar=false']))"
    )
    result = run_command([sys.executable, "-c", code], cwd=work, env=env)
    assert result.returncode == 0, result.output
    config_dir, module_file = result.stdout.splitlines()[:2]
    assert config_dir == str(site / "lightning_mgpu" / "recipes" / "configs")
    assert module_file == str(site / "lightning_mgpu" / "recipes" / "digits.py")
    (run_dir,) = (work / "runs").iterdir()
    assert (run_dir / "config.yaml").is_file()
