"""Lightning's private names the package uses, each with why, and the releases it was checked on.

Checked on Lightning 2.4 (the floor) to 2.6. Where Lightning offers no public way, the name is
reached here and nowhere else; a rename upstream then breaks one line, which the tests of the
strategies catch. The strategies also override Lightning's private hook ``_configure_launcher``
(``process_group/services.py``, ``fsdp/strategy.py``, which :func:`configure_launcher` calls): an
override cannot live here, it is named here so a reader finds every reach in one place.
"""

from __future__ import annotations

from typing import Any

from lightning.fabric.connector import _convert_precision_to_unified_args
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.fabric.utilities.distributed import _destroy_dist_connection, _set_num_threads_if_needed
from lightning.fabric.utilities.init import _materialize_distributed_module
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.types import _PATH, _Stateful
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.pytorch.strategies.launchers.launcher import _Launcher
from lightning.pytorch.trainer.connectors.signal_connector import _HandlersCompose, _SignalConnector
from lightning.pytorch.utilities.data import _is_dataloader_shuffled, _update_dataloader

__all__ = [
    "PATH",
    "PREPARE_DATALOADER",
    "HandlersCompose",
    "Launcher",
    "Stateful",
    "StrategyRegistry",
    "SubprocessScriptLauncher",
    "attached_trainer",
    "batches_that_stepped",
    "checkpoint_connector",
    "cluster_environment",
    "combined_loader",
    "configure_launcher",
    "convert_precision_to_unified_args",
    "data_connector",
    "ddp_comm_hook",
    "destroy_dist_connection",
    "detach_trainer",
    "forward_redirection",
    "given_backend",
    "hpc_resume_path",
    "is_dataloader_shuffled",
    "is_slurm_requeue_handler",
    "launch_start_method",
    "launcher",
    "loaded_checkpoint",
    "materialize_distributed_module",
    "optimizers_to_device",
    "process_group_timeout",
    "run_slurm_requeue",
    "save_top_k",
    "set_device_mesh",
    "set_fsdp_only_mesh",
    "set_launcher",
    "set_layer_sync",
    "set_num_threads_if_needed",
    "skips_saving",
    "strategy_parts",
    "update_dataloader",
]

# --- types and helpers imported as they are (no public twin in 2.4-2.6) ---------------------------
StrategyRegistry = _StrategyRegistry
"""The registry type ``register_strategies(cls, registry)`` receives (Lightning 2.4-2.6)."""
PATH = _PATH
"""``str | Path``, Lightning's path type, for ``save_checkpoint``'s signature (2.4-2.6)."""
Stateful = _Stateful
"""The ``state_dict``/``load_state_dict`` protocol a loader's place is saved through (2.4-2.6)."""
SubprocessScriptLauncher = _SubprocessScriptLauncher
"""Lightning's ``python train.py``-relaunching launcher, subclassed to start the watchdog with the ranks."""
Launcher = _Launcher
"""The base type of a strategy's launcher (type hints only)."""
HandlersCompose = _HandlersCompose
"""What Lightning installs as a signal handler, to tell its SLURM requeue handler from a user's."""

materialize_distributed_module = _materialize_distributed_module
"""Materialize a meta-device module after sharding, as Lightning's own FSDP strategy does (2.4-2.6)."""
optimizers_to_device = _optimizers_to_device
"""Move optimizer state to the root device, as Lightning's own strategies do (2.4-2.6)."""
set_num_threads_if_needed = _set_num_threads_if_needed
"""Lightning's OMP_NUM_THREADS default for each relaunched rank, kept for the ranks our launcher starts."""
is_dataloader_shuffled = _is_dataloader_shuffled
"""Whether the user's training ``DataLoader`` shuffled; Lightning passes ``shuffle=True`` to every
training sampler regardless (Lightning-AI/pytorch-lightning#10170, open)."""
update_dataloader = _update_dataloader
"""Rebuild a ``DataLoader`` with another sampler, keeping the user's arguments (2.4-2.6)."""
convert_precision_to_unified_args = _convert_precision_to_unified_args
"""Lightning's precision aliases (``16`` -> ``"16-mixed"``) as the Trainer resolves them (2.4-2.6)."""

destroy_dist_connection = _destroy_dist_connection
"""Destroy the default process group if one exists. Used at exit for gloo, which Lightning destroys at
exit only under NCCL: a gloo group left to the interpreter's teardown aborts the process
("terminate called without an active exception"), pytorch/pytorch#190489 (torch 2.6-2.13; the atexit
fix pytorch/pytorch#179291 was abandoned). The torchrun attempt's store (``process_group/torchrun_store.py``)
works around stale keys of an earlier attempt in torchrun's agent store: no upstream issue found for
those keys (the nearest, pytorch/pytorch#135712 and #167302, are about a stale ``MASTER_ADDR``)."""

PREPARE_DATALOADER = "_prepare_dataloader"
"""The ``_DataConnector`` method that builds the ``DistributedSampler`` with ``shuffle=True`` for every
training loader (2.4-2.6); wrapped per trainer to pass the loader's own shuffle
(Lightning-AI/pytorch-lightning#10170)."""


# --- private attributes of Lightning objects ------------------------------------------------------
def attached_trainer(module: Any) -> Any:
    """The module's trainer or ``None``: ``LightningModule.trainer`` raises while detached."""
    return getattr(module, "_trainer", None)


def detach_trainer(module: Any, trainer: Any) -> None:
    """Set the module's trainer (``None`` to detach it): no public setter takes ``None`` (2.4-2.6)."""
    module._trainer = trainer


def data_connector(trainer: Any) -> Any:
    """The trainer's ``_DataConnector``, whose :data:`PREPARE_DATALOADER` builds the samplers (2.4-2.6)."""
    return trainer._data_connector


def checkpoint_connector(trainer: Any) -> Any:
    """The trainer's ``_CheckpointConnector``: ``resume_start`` chooses the checkpoint."""
    return trainer._checkpoint_connector


def hpc_resume_path(connector: Any) -> Any:
    """The newest ``hpc_ckpt`` Lightning would resume under SLURM, complete or not (2.4-2.6)."""
    return connector._hpc_resume_path


def loaded_checkpoint(connector: Any) -> dict[str, Any]:
    """The checkpoint ``resume_start`` just loaded, to report its step and epoch (2.4-2.6)."""
    loaded: dict[str, Any] = connector._loaded_checkpoint
    return loaded


def cluster_environment(trainer: Any) -> Any:
    """The trainer's cluster environment (SLURM's, with its requeue settings) (2.4-2.6)."""
    return trainer._accelerator_connector.cluster_environment


def is_slurm_requeue_handler(handler: Any) -> bool:
    """Whether ``handler`` is the one Lightning installs for SLURM's requeue signal (2.4-2.6)."""
    if not isinstance(handler, _HandlersCompose):
        return False
    ours = _SignalConnector._slurm_sigusr_handler_fn
    return any(getattr(h, "__func__", None) is ours for h in handler.signal_handlers)


def run_slurm_requeue(trainer: Any, signum: int) -> None:
    """Run Lightning's SLURM requeue handler (save ``hpc_ckpt``, ``scontrol requeue``) now (2.4-2.6).

    Lightning runs it inside the signal handler, mid-step; the strategies defer it to the next batch
    start that every rank agrees on. No upstream issue found for deferring it.
    """
    trainer._signal_connector._slurm_sigusr_handler_fn(signum, None)


def combined_loader(trainer: Any) -> Any:
    """The fit loop's ``CombinedLoader`` (``None`` before the loop built it) (2.4-2.6)."""
    return trainer.fit_loop._combined_loader


def batches_that_stepped(trainer: Any) -> int | None:
    """The step Lightning's own logging uses, ``None`` where the loop lacks it (2.4-2.6)."""
    step: int | None = getattr(trainer.fit_loop.epoch_loop, "_batches_that_stepped", None)
    return step


def ddp_comm_hook(strategy: Any) -> Any:
    """The DDP communication hook a ``DDPStrategy`` was given, ``None`` if none (2.4-2.6)."""
    return getattr(strategy, "_ddp_comm_hook", None)


def strategy_parts(strategy: Any) -> tuple[Any, Any, Any, Any]:
    """A strategy's accelerator, precision plugin, checkpoint_io and layer sync as set, ``None`` where
    unset: the public properties build defaults for the unset ones, which ``mgpu_auto`` must not keep
    when it turns into another strategy (2.4-2.6)."""
    return (
        strategy._accelerator,
        strategy._precision_plugin,
        strategy._checkpoint_io,
        getattr(strategy, "_layer_sync", None),
    )


def set_layer_sync(strategy: Any, layer_sync: Any) -> None:
    """Keep the layer sync (``SyncBatchNorm``) a strategy had before it changed class (2.4-2.6)."""
    strategy._layer_sync = layer_sync


def set_fsdp_only_mesh(strategy: Any) -> None:
    """Make ``ModelParallelStrategy``'s mesh one data-parallel dimension over every process, no tensor
    parallelism (FSDP alone), before its ``setup_environment`` builds it: its sizes are set only in
    ``__init__``, as given or ``"auto"`` (2.4-2.6)."""
    strategy._data_parallel_size = strategy.num_nodes * strategy.num_processes
    strategy._tensor_parallel_size = 1


def forward_redirection(strategy: Any) -> Any:
    """The strategy's ``_ForwardRedirection``, which runs a step from inside the module's ``forward`` so
    that its hooks (FSDP2's gathers) run (2.4-2.6)."""
    return strategy._forward_redirection


def given_backend(strategy: Any) -> str | None:
    """The ``process_group_backend`` a strategy was given, ``None`` if none (2.4-2.6)."""
    return getattr(strategy, "_process_group_backend", None)


def set_device_mesh(strategy: Any, mesh: Any) -> None:
    """Give ``ModelParallelStrategy`` and its LightningModule (for ``configure_model``) another mesh after
    ``setup_environment`` built one: no public setter (2.4-2.6)."""
    strategy._device_mesh = mesh
    strategy.lightning_module._device_mesh = mesh


def launcher(strategy: Any) -> Any:
    """The strategy's launcher, ``None`` before it was configured (2.4-2.6)."""
    return strategy._launcher


def set_launcher(strategy: Any, value: Any) -> None:
    """Set a strategy's launcher: one that already started the processes, kept on a strategy that changed
    class, or the watched launcher ``ProcessGroupServices._configure_launcher`` builds (2.4-2.6)."""
    strategy._launcher = value


def launch_start_method(strategy: Any) -> str:
    """``DDPStrategy``'s ``start_method``; ``"popen"`` for a strategy that keeps none
    (``ModelParallelStrategy``, which always relaunches the script) (2.4-2.6)."""
    return str(getattr(strategy, "_start_method", "popen"))


def process_group_timeout(strategy: Any) -> Any:
    """The ``timeout`` a strategy was given for its process group, ``None`` where it keeps none (2.4-2.6)."""
    return getattr(strategy, "_timeout", None)


def skips_saving(callback: Any, trainer: Any) -> bool:
    """Whether a ``ModelCheckpoint`` saves nothing now (sanity check, ``fast_dev_run``, a save at this very
    step already) (2.4-2.6); ``ResumeCheckpoint`` decides by time itself, then asks."""
    return bool(callback._should_skip_saving_checkpoint(trainer))


def save_top_k(callback: Any, trainer: Any) -> None:
    """Save as a ``ModelCheckpoint`` does when a save is due, keeping its ``save_top_k`` (2.4-2.6): no public
    method saves outside Lightning's own schedule."""
    callback._save_topk_checkpoint(trainer, callback._monitor_candidates(trainer))


def configure_launcher(strategy: Any) -> None:
    """Let the strategy build its own launcher, as the Trainer does at setup (2.4-2.6)."""
    strategy._configure_launcher()
