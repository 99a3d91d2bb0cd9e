"""FSDP2 over gloo averages gradients exactly on every torch: the probe tells the truth, the fix is exact.

On torch 2.7 and 2.8 gloo's ``reduce_scatter_tensor`` sums when asked to average (pytorch/pytorch#162338);
``make test-compat`` runs this file on torch 2.8 (the ``gloo-sum`` combination) and on the newest torch.
The two ranks run tests/scripts/gloo_average.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import run_file


@pytest.mark.slow
def test_the_probe_tells_whether_gloo_sums_and_the_gradients_equal_one_process(tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    result = run_file("gloo_average.py", tmp_path, args=[str(out)], timeout=240)
    assert result.returncode == 0, result.output
    found = json.loads(out.read_text())
    # without a correction FSDP's gradients are the average (1x) or, where gloo sums, 2x one process's
    ratios = set(round(r, 4) for r in found["plain_ratio"].values())
    assert ratios == ({2.0} if found["sums"] else {1.0}), found
    assert found["changed"] is found["sums"]
    assert found["corrected_error"] < 1e-6, found
