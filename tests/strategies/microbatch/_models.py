"""Small modules and plain-torch references shared by the micro-batching and ``global_mean`` tests.

Imported by the tests and by the scripts they run in real processes (``tests`` is on their path).
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics import MeanSquaredError

import lightning_mgpu

QUIET = {
    "logger": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
    "enable_checkpointing": False,
}
LOSSES = ("masked", "sum", "mean", "naive")
LIMITED_MEMORY = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_ARENA_MAX": "1"}
"""Environment of a process whose address space a test limits: large tensors in mmap, so freed memory
is returned at once, and one malloc arena, so a thread's first allocation does not reserve 64 MiB of
address space and eat into the limit at a moment that varies from run to run."""


def token_data(rows: int = 32, seed: int = 1) -> TensorDataset:
    """Inputs, targets and a mask with uneven valid counts per row (rows without a valid token too)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 4, generator=g)
    y = torch.randn(rows, 3, generator=g)
    mask = (torch.rand(rows, 3, generator=g) < torch.linspace(0.3, 0.95, rows)[:, None]).float()
    return TensorDataset(x, y, mask)


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))


def loss_of(kind: str, out: torch.Tensor, y: torch.Tensor, mask: torch.Tensor, helper: bool) -> torch.Tensor:
    """``kind``'s loss on one part; ``helper`` uses ``global_mean``, otherwise the plain per-part formula."""
    if kind == "mean":
        return F.mse_loss(out, y)
    if kind == "sum":
        total, count = F.mse_loss(out, y, reduction="sum"), torch.tensor(float(len(out)))
    else:  # masked tokens ("naive" is the masked loss written without the helper)
        total, count = (((out - y) ** 2) * mask).sum(), mask.sum()
    return lightning_mgpu.global_mean(total, count) if helper else total / count


class TokenModel(L.LightningModule):
    """Trains ``net()`` with SGD + momentum on the loss ``kind`` (see ``loss_of``)."""

    def __init__(self, kind: str = "masked", lr: float = 0.1) -> None:
        super().__init__()
        self.kind = kind
        self.lr = lr
        self.net = net()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, mask = batch
        return loss_of(self.kind, self.net(x), y, mask, helper=self.kind != "naive")

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


class LoggedTokenModel(TokenModel):
    """``TokenModel`` that logs its loss as ``train_loss``, averaged over the ranks (``sync_dist=True``)."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss, sync_dist=True)
        return loss


class LossRecorder(Callback):
    """Each step's loss as a user sees it: returned by ``training_step`` (the progress bar) and logged."""

    def __init__(self) -> None:
        self.returned: list[float] = []
        self.logged: list[float] = []

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.returned.append(float(outputs["loss"]))
        self.logged.append(float(trainer.callback_metrics["train_loss"]))

    def losses(self) -> dict[str, list[float]]:
        """What was recorded, for a JSON file."""
        return {"returned": self.returned, "logged": self.logged}


def masked_mean(err: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``global_mean`` of ``err`` over the rows whose first input is positive: uneven counts per part."""
    mask = (x[:, :1] > 0).to(err.dtype)
    return lightning_mgpu.global_mean((err * mask).sum(), mask.sum())


def reference(data: TensorDataset, kind: str, batch_size: int, steps: int, lr: float = 0.1) -> nn.Module:
    """One device, plain torch: ``steps`` steps on consecutive batches of ``batch_size`` rows."""
    model = net()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    x, y, mask = data.tensors
    for step in range(steps):
        rows = slice(step * batch_size, (step + 1) * batch_size)
        loss = loss_of(
            "masked" if kind == "naive" else kind, model(x[rows]), y[rows], mask[rows], helper=False
        )
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model


def loader(data: TensorDataset, batch_size: int) -> DataLoader:
    return DataLoader(data, batch_size=batch_size, shuffle=False)


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Largest absolute difference between two state dicts (keys of ``a`` may carry a ``net.`` prefix)."""
    b = {k.removeprefix("net."): v for k, v in b.items()}
    a = {k.removeprefix("net."): v for k, v in a.items()}
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def regression_data(rows: int = 32, seed: int = 2) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 4, generator=g)
    return TensorDataset(x, x @ torch.randn(4, 1, generator=g))


class Hungry(L.LightningModule):
    """A tiny model whose activations take ``ROW_BYTES`` per row (saved for backward, about 4 in backward).

    ``forward_extra`` more of them are held for a moment without gradient, so forward needs
    ``(1 + forward_extra)`` row-sizes per row (2 without gradient, where nothing is saved). From the
    first batch on, ``limit_rank`` (if set) limits its process's address space to what it holds plus
    ``budget`` row-sizes, so a large activation fails in the allocator as a real out-of-memory would;
    from step ``lift_at`` on the limit is lifted again. With ``limit_in="eval"`` the limit holds
    during each validation, test and predict run instead, and is lifted at its end. ``masked``
    trains on ``masked_mean`` instead of the mean over rows; the loss is logged as ``train_loss``.

    Validation and test log ``{val,test}_loss`` (``sync_dist=True``, on step and epoch) and
    ``{val,test}_mse`` (a torchmetrics metric); ``predict_step`` returns the predictions. A
    non-persistent buffer, as BatchNorm keeps, makes DDP broadcast buffers at its first forward.
    """

    ROW_FLOATS = 2**20  # 4 MiB per row

    def __init__(
        self,
        limit_rank: int | None = None,
        budget: float = 24,
        forward_extra: int = 0,
        lift_at: int | None = None,
        masked: bool = False,
        limit_in: str = "train",
        limit_from: int = 0,
    ) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 16)
        self.head = nn.Linear(16, 1)
        self.register_buffer("shift", torch.zeros(1), persistent=False)
        self.mse = MeanSquaredError()
        self.limit_rank = limit_rank
        self.budget = budget
        self.forward_extra = forward_extra
        self.lift_at = lift_at
        self.masked = masked
        self.limit_in = limit_in
        self.limit_from = limit_from
        self.sizes_seen: list[int] = []
        self.eval_sizes_seen: list[int] = []
        self._limited = False

    def _limit(self) -> None:
        import resource

        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        with open("/proc/self/status") as status:
            held = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmSize:"))
        resource.setrlimit(resource.RLIMIT_AS, (held + int(self.budget * self.ROW_FLOATS * 4), hard))

    def _lift(self) -> None:
        import resource

        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        resource.setrlimit(resource.RLIMIT_AS, (hard, hard))

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self.limit_rank != self.global_rank or self.limit_in != "train":
            return
        if not self._limited and self.trainer.global_step >= self.limit_from:
            self._limited = True
            self._limit()
        elif self.trainer.global_step == self.lift_at:
            self._lift()

    def _limit_evaluation(self) -> None:
        if self.limit_rank == self.global_rank and self.limit_in == "eval" and not self._limited:
            self._limited = True
            self._limit()

    def _lift_evaluation(self) -> None:
        if self.limit_in == "eval" and self._limited:
            self._limited = False
            self._lift()

    def on_validation_batch_start(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self._limit_evaluation()

    def on_test_batch_start(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self._limit_evaluation()

    def on_predict_batch_start(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self._limit_evaluation()

    def on_validation_end(self) -> None:
        self._lift_evaluation()

    def on_test_end(self) -> None:
        self._lift_evaluation()

    def on_predict_end(self) -> None:
        self._lift_evaluation()

    def predictions(self, x: torch.Tensor) -> torch.Tensor:
        """The model's output for ``x``, holding ``ROW_FLOATS`` floats per row on the way."""
        h = torch.tanh(self.lin(x))
        big = h.repeat(1, self.ROW_FLOATS // 16)
        if self.forward_extra:
            with torch.no_grad():
                held = big.repeat(1, self.forward_extra)
            del held
        act = (big * big).mean(1, keepdim=True)
        return self.head(h) + act + self.shift

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        if x.device.type != "meta":  # not the estimate's dry run of the step (``"auto"`` on CUDA)
            self.sizes_seen.append(len(x))
        out = self.predictions(x)
        loss = masked_mean((out - y) ** 2, x) if self.masked else F.mse_loss(out, y)
        self.log("train_loss", loss)
        return loss

    def _evaluate(self, batch: Any, stage: str) -> None:
        x, y = batch
        if x.device.type != "meta":
            self.eval_sizes_seen.append(len(x))
        out = self.predictions(x)
        self.log(f"{stage}_loss", F.mse_loss(out, y), sync_dist=True, on_step=True, on_epoch=True)
        self.mse(out, y)
        self.log(f"{stage}_mse", self.mse)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self._evaluate(batch, "val")

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self._evaluate(batch, "test")

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.eval_sizes_seen.append(len(batch[0]))
        return self.predictions(batch[0])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class HungryBlock(nn.Module):
    """A unit ``mgpu_fsdp`` shards on its own, holding ``Hungry.ROW_FLOATS`` floats per row for backward."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.lin(h))
        big = h.repeat(1, Hungry.ROW_FLOATS // 16)
        return h + (big * big).mean(1, keepdim=True)


class HungryBlocks(Hungry):
    """``Hungry`` whose activations live in two blocks, so an out-of-memory falls between FSDP's gathers.

    ``forward_extra`` row-sizes per row are held for a moment in the root, before the blocks.
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        torch.manual_seed(1)
        self.blocks = nn.ModuleList([HungryBlock(), HungryBlock()])

    def predictions(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.lin(x))
        if self.forward_extra:
            with torch.no_grad():
                held = h.repeat(1, self.ROW_FLOATS // 16 * self.forward_extra)
            del held
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def assert_both_ranks_stopped(result: Any) -> None:
    """``result`` (a finished script) ended because rank 1 could not fit one row: both ranks say so."""
    assert result.returncode != 0
    assert (
        "[rank 1] out of memory at batch 0 of epoch 0 even with micro-batches of 1 row. Attempts on this"
        " rank: 8 rows (out of memory in forward); 4 rows (out of memory in forward); 2 rows (out of memory"
        " in forward); 1 row (out of memory in forward)." in result.output
    ), result.output
    assert (
        "[rank 0] stopping: rank 1 ran out of memory at batch 0 of epoch 0 even with micro-batches"
        " of 1 row" in result.output
    ), result.output
