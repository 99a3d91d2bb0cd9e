"""``PlainStateDictExport``: plain weights next to every checkpoint, ready for a model without Lightning."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.fabric.plugins import CheckpointIO
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from lightning_mgpu.checkpoint.export import export_state_dict, exported_state_dict

__all__ = ["PlainStateDictExport"]


class PlainStateDictExport(Callback):
    """Write the plain weights next to each checkpoint Lightning saves, as ``<name>.safetensors``.

    - every checkpoint the trainer saves (``ModelCheckpoint``'s best, top-k and last, and
      ``trainer.save_checkpoint``) gets a sibling with the LightningModule's attribute prefix and
      every wrapper prefix removed; when ``ModelCheckpoint`` deletes an old top-k checkpoint, its
      sibling goes too;
    - at the end of fit, any best or last checkpoint without an up-to-date sibling gets one (a
      ``save_last="link"`` link, a checkpoint written before this callback was added), and the final
      weights are written as ``final.safetensors`` in the checkpoint folder;
    - only global rank 0 writes, so it behaves the same under ``mgpu_ddp``, ``mgpu_dp`` and on one
      device; under ``mgpu_fsdp`` the final weights are first gathered from every rank's shards, and
      a sharded checkpoint folder (which Lightning writes without its ``checkpoint_io``) gets its
      sibling at the end of fit, read from the folder. Files are written atomically.

    How: in ``setup`` the strategy's ``checkpoint_io`` (public Lightning API since 1.6) is wrapped, so
    the export sees the exact path and the checkpoint dict already in memory, with no second read and
    no dependence on ``ModelCheckpoint`` internals. ``teardown`` puts the original back.

    Args:
        submodule: Attribute of the LightningModule to export (``"model"``); ``""`` keeps every
            entry, which is also the default for a module holding its weights in several attributes
            (``self.embed``, ``self.head``). A name that does not exist fails fit at its start.
        prefix: ``"module."`` writes the form that loads into ``nn.DataParallel(model)``.
        format: ``"safetensors"`` (default) or ``"pt"``.
        final_name: File name (without suffix) for the weights at the end of fit; None skips them.

    Example::

        import lightning as L
        from lightning.pytorch.callbacks import ModelCheckpoint
        from lightning_mgpu import PlainStateDictExport

        trainer = L.Trainer(
            strategy="mgpu_ddp",
            callbacks=[ModelCheckpoint(monitor="val_loss", save_last=True), PlainStateDictExport()],
        )
        # checkpoints/epoch=3-step=400.ckpt -> checkpoints/epoch=3-step=400.safetensors
    """

    def __init__(
        self,
        submodule: str | None = None,
        prefix: str = "",
        format: str = "safetensors",
        final_name: str | None = "final",
    ) -> None:
        if format not in ("safetensors", "pt"):
            raise ValueError(
                f"PlainStateDictExport(format=...) must be 'safetensors' or 'pt', got {format!r}"
            )
        self.submodule = submodule
        self.prefix = prefix
        self.format = format
        self.final_name = final_name
        self._suffix = ".safetensors" if format == "safetensors" else ".pt"

    def export_path(self, checkpoint_path: str | os.PathLike[str]) -> Path:
        """Where the plain weights of ``checkpoint_path`` go: same folder and name, new suffix.

        A checkpoint that already ends in the export's suffix (``last.pt`` with ``format="pt"``)
        keeps its file: its weights go to ``last.weights.pt``.
        """
        path = Path(checkpoint_path)
        if path.suffix.lower() == self._suffix:
            return path.with_name(f"{path.stem}.weights{self._suffix}")
        return path.with_suffix(self._suffix)

    def export(self, source: Any, path: str | os.PathLike[str]) -> None:
        """Write the plain weights of ``source`` (a checkpoint dict, path or module) to ``path``."""
        export_state_dict(source, path, submodule=self.submodule, prefix=self.prefix, format=self.format)

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        io = trainer.strategy.checkpoint_io
        if not isinstance(io, _ExportingCheckpointIO):
            trainer.strategy.checkpoint_io = _ExportingCheckpointIO(io, self)

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # a submodule that does not exist fails here, not at the first checkpoint hours later; not
        # in setup, which Lightning calls before configure_model builds the layers
        exported_state_dict(pl_module, submodule=self.submodule)

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # under mgpu_fsdp every rank holds a shard: gathering the final weights takes all of them
        final = _full_checkpoint(pl_module) if self.final_name is not None else None
        if not trainer.is_global_zero:
            return
        folder: str | None = None
        for callback in trainer.checkpoint_callbacks:
            folder = folder or getattr(callback, "dirpath", None)
            for name in ("best_model_path", "last_model_path"):
                path = getattr(callback, name, "")
                if path and _is_local(path) and os.path.exists(path) and self._stale(path):
                    self.export(path, self.export_path(path))
        if self.final_name is not None:
            folder = folder or trainer.default_root_dir
            if _is_local(folder):
                os.makedirs(folder, exist_ok=True)
                self.export(
                    pl_module if final is None else final, Path(folder, self.final_name + self._suffix)
                )

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        io = trainer.strategy.checkpoint_io
        if isinstance(io, _ExportingCheckpointIO):
            trainer.strategy.checkpoint_io = io.inner

    def _stale(self, checkpoint_path: str) -> bool:
        target = self.export_path(checkpoint_path)
        return not target.exists() or target.stat().st_mtime < os.stat(checkpoint_path).st_mtime


def _full_checkpoint(module: pl.LightningModule) -> dict[str, Any] | None:
    """A sharded module's whole weights (``DTensor`` parameters) in a checkpoint dict, else ``None``.

    torch's ``get_model_state_dict`` gathers one tensor at a time into CPU memory; every rank must call it.
    The gathered state_dict goes to the export inside a Lightning checkpoint dict, so the export knows it
    holds a LightningModule's weights and removes the module's one attribute (``model.``) as it does for
    the module itself and for the checkpoint files; a bare state_dict would keep every name.
    """
    from torch.distributed.tensor import DTensor

    if not any(isinstance(p, DTensor) for p in module.parameters()):
        return None
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    weights = get_model_state_dict(module, options=options)
    return {"state_dict": weights, "pytorch-lightning_version": pl.__version__}


def _is_local(path: str | os.PathLike[str]) -> bool:
    return "://" not in str(path)


class _ExportingCheckpointIO(CheckpointIO):
    """Delegates to the strategy's own checkpoint IO, then writes or removes the plain weights."""

    def __init__(self, inner: CheckpointIO, callback: PlainStateDictExport) -> None:
        self.inner = inner
        self.callback = callback
        self._warned = False

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        self.inner.save_checkpoint(checkpoint, path, storage_options=storage_options)
        if not _is_local(path):
            if not self._warned:
                rank_zero_warn(f"PlainStateDictExport writes local files only; skipping {path}")
                self._warned = True
            return
        if "state_dict" not in checkpoint:
            rank_zero_warn(f"PlainStateDictExport: {path} has no 'state_dict' (a sharded strategy?); skipped")
            return
        self.callback.export(checkpoint, self.callback.export_path(path))

    @override
    def load_checkpoint(
        self, path: Any, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        # Lightning < 2.6 has no weights_only argument here
        extra = {} if weights_only is None else {"weights_only": weights_only}
        return self.inner.load_checkpoint(path, map_location=map_location, **extra)

    @override
    def remove_checkpoint(self, path: Any) -> None:
        self.inner.remove_checkpoint(path)
        if _is_local(path):
            self.callback.export_path(path).unlink(missing_ok=True)

    @override
    def teardown(self) -> None:
        self.inner.teardown()
