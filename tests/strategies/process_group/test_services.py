"""``ProcessGroupServices`` on a host other than DDP: Lightning's ``ModelParallelStrategy``.

``mgpu_ddp``'s own runs (``test_ddp.py``) exercise every service; these tests pin the
contract a second host relies on, inside ``Trainer(...)``, before any process starts.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
from lightning.pytorch.strategies import ModelParallelStrategy

from lightning_mgpu.strategies.process_group.launcher import _WatchedSubprocessScriptLauncher
from lightning_mgpu.strategies.process_group.services import ProcessGroupServices
from lightning_mgpu.strategies.process_group.summary import format_summary
from lightning_mgpu.strategies.process_group.watchdog.verdicts import RankInfo


class _Sharded(ProcessGroupServices, ModelParallelStrategy):
    strategy_name = "sharded_for_test"

    def __init__(self, stall_timeout: float | None = 300.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)  # ModelParallelStrategy's arguments
        self._init_services(stall_timeout=stall_timeout)

    def _summary_extra_lines(self) -> list[str]:
        return ["plan: every Linear sharded"]


def _trainer(strategy: _Sharded) -> L.Trainer:
    return L.Trainer(accelerator="cpu", devices=2, strategy=strategy, logger=False, enable_progress_bar=False)


def test_a_model_parallel_host_gets_the_watched_launcher_and_gloo() -> None:
    strategy = _Sharded(stall_timeout=30)
    trainer = _trainer(strategy)
    assert trainer.strategy is strategy
    assert isinstance(strategy.launcher, _WatchedSubprocessScriptLauncher)
    assert strategy.stall_timeout == 30.0
    assert strategy._get_process_group_backend() == "gloo"


def test_a_model_parallel_host_checks_its_backend_before_any_process_starts() -> None:
    with pytest.raises(ValueError, match=r"process_group_backend='glooo' is not available"):
        _trainer(_Sharded(process_group_backend="glooo"))
    with pytest.raises(ValueError, match=r"stall_timeout must be a positive number"):
        _Sharded(stall_timeout=0)


def test_extra_summary_lines_close_the_summary() -> None:
    info = RankInfo(0, 10, 1, "node-a", 0, "cpu", "CPU")
    text = format_summary(
        name="sharded_for_test",
        infos={0: info},
        num_nodes=1,
        processes_per_node=1,
        backend="gloo",
        launcher="Lightning's launcher",
        batch_size=4,
        extra_lines=_Sharded()._summary_extra_lines(),
    )
    assert text.splitlines()[-2:] == ["  batch size: 4 per device, 4 global", "  plan: every Linear sharded"]
