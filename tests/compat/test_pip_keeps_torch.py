"""``pip install -e .`` into an environment whose torch meets the floor installs the project and nothing else.

``make test-compat`` runs this in each fresh venv: torch 2.6 (the floor), 2.8 and the newest. pip runs
offline (``--no-index``) and without this machine's pip configuration (an index's constraints file would
judge the machine, not the project): had the project asked for a newer torch than the one installed, pip
would have to fetch one, and fails saying so.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import REPO


@pytest.mark.slow
def test_pip_install_editable_keeps_this_torch(tmp_path: Path) -> None:
    pytest.importorskip("setuptools", minversion="77")  # --no-build-isolation builds with this environment's
    report = tmp_path / "report.json"
    pip = [sys.executable, "-m", "pip", "install", "--dry-run", "--no-index", "--no-build-isolation"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")} | {"PIP_CONFIG_FILE": os.devnull}
    result = subprocess.run(
        [*pip, "--report", str(report), "-e", str(REPO)], capture_output=True, text=True, timeout=300, env=env
    )
    assert result.returncode == 0, (
        f"pip wants something this torch {torch.__version__} venv lacks:\n{result.stderr}"
    )
    installs = [item["metadata"]["name"] for item in json.loads(report.read_text())["install"]]
    assert installs == ["lightning-mgpu"], installs
