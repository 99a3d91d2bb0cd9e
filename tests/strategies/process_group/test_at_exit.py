"""A finished run exits 0: at the interpreter's last ``atexit`` handler no process group or thread is left.

torchrun marked finished runs FAILED now and then: "terminate called without an active exception"
(SIGABRT) at exit, from a gloo group torn down with the interpreter after its own shutdown.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import run_script

# registered before Lightning and the strategy start, the report runs after their exit handlers
SCRIPT = """
import atexit, os, sys, threading
import torch, lightning as L
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
import lightning_mgpu

def report():
    alive = sorted(t.name for t in threading.enumerate() if t is not threading.main_thread())
    with open(f"exit_rank{os.environ.get('LOCAL_RANK', '0')}.txt", "w") as f:
        f.write(f"group alive: {dist.is_available() and dist.is_initialized()}, threads: {alive}")

atexit.register(report)

class Regression(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        return nn.functional.mse_loss(self.net(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

trainer = L.Trainer(
    accelerator="cpu", devices=2, strategy=sys.argv[1], max_epochs=1, logger=False,
    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
)
trainer.fit(Regression(), DataLoader(TensorDataset(torch.randn(32, 4), torch.randn(32, 1)), batch_size=4))
"""


@pytest.mark.parametrize("strategy", ["mgpu_ddp", "mgpu_fsdp"])
def test_the_group_and_every_thread_are_gone_before_the_interpreter_exits(
    tmp_path: Path, strategy: str
) -> None:
    """About 10 s each: one fit on two processes."""
    result = run_script(SCRIPT, tmp_path, args=[strategy])
    assert result.returncode == 0, result.output[-3000:]
    for rank in (0, 1):
        assert (tmp_path / f"exit_rank{rank}.txt").read_text() == "group alive: False, threads: []"
