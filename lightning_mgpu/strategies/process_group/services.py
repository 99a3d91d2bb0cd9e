"""What every multi-process ``mgpu_*`` strategy adds to its Lightning base: ``ProcessGroupServices``.

The mixin goes first in the bases, before a Lightning strategy that runs one process per device and creates
a process group::

    class MGPUDDPStrategy(ProcessGroupServices, DDPStrategy): ...
    class MGPUFSDPStrategy(ProcessGroupServices, ModelParallelStrategy): ...

The host's ``__init__`` initialises its Lightning base with Lightning's arguments, then hands
``stall_timeout`` and ``resume/``'s options to ``_init_services``. The mixin overrides these hooks and calls
the host's own through ``super()`` in each:

- ``_configure_launcher``: ``checks.check_devices`` before any process starts, then the watched subprocess
  launcher for ``start_method="popen"`` (``ModelParallelStrategy``, which keeps no start method, counts as
  popen), the host's own launcher otherwise;
- ``_get_process_group_backend``: the explicit ``process_group_backend``, else ``checks.default_backend``
  for the root device;
- ``setup_environment`` / ``teardown``: the watchdog starts before the process group, joins the run's store
  after it, and stops (thread joined) when the run ends; under torchrun the group lives in a key space fresh
  to the attempt (``torchrun_store.py``); the training ``DataLoader``'s own ``shuffle`` is kept, and its
  place in the epoch goes into every checkpoint (``resume/position.py``); a ``fit`` gets the
  ``checkpoint_every`` safety net and, on a restart, resumes by itself (``resume/``);
- ``on_train_start``, ``on_validation_start``, ``on_test_start``, ``on_predict_start``: rank 0 prints the
  start-up summary once;
- ``pre_backward``, ``barrier``, ``broadcast``, ``reduce``, ``all_gather``: count progress for the watchdog;
- ``optimizer_step``: an out-of-memory in the step itself (not in forward or backward, which run in its
  closure, where micro-batching's ``"auto"`` may recover it) gets this rank's optimizer state and the
  options in front of its message (``step_memory.py``);
- ``on_exception``: a communication error gets the watchdog's reason (which rank died and how); this rank's
  own error is reported to the others. Should the exception end the process, each rank prints one line
  naming the rank that failed first and the cause, and only that rank prints its traceback.

The host class must provide what Lightning's ``DDPStrategy`` and ``ModelParallelStrategy`` both have:
``strategy_name`` (a class attribute, used in messages and the summary), ``_process_group_backend``,
``_get_process_group_backend()``, ``set_world_ranks()``, ``num_nodes``, ``num_processes``,
``parallel_devices``, ``cluster_environment``, ``root_device``, ``global_rank``, ``local_rank``,
``node_rank`` and ``world_size``. A host adds lines to the start-up summary (a sharding plan, say) by
overriding ``_summary_extra_lines``.
"""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.plugins.layer_sync import TorchSyncBatchNorm
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_mgpu._compat.lightning import (
    PREPARE_DATALOADER,
    attached_trainer,
    data_connector,
    given_backend,
    is_dataloader_shuffled,
    launch_start_method,
    process_group_timeout,
    set_launcher,
    strategy_parts,
)
from lightning_mgpu.oom import is_out_of_memory
from lightning_mgpu.strategies.mixin import StrategyMixin
from lightning_mgpu.strategies.process_group import at_exit, checks, torchrun_store
from lightning_mgpu.strategies.process_group.errors import add_to_message
from lightning_mgpu.strategies.process_group.launcher import _WatchedSubprocessScriptLauncher
from lightning_mgpu.strategies.process_group.requeue import DeferredRequeue
from lightning_mgpu.strategies.process_group.step_memory import step_memory, step_oom_message
from lightning_mgpu.strategies.process_group.summary import format_summary, launcher_name, rank_info
from lightning_mgpu.strategies.process_group.watchdog.heartbeats import loop_progress
from lightning_mgpu.strategies.process_group.watchdog.verdicts import RankInfo
from lightning_mgpu.strategies.process_group.watchdog.watchdog import DEAD_AFTER, watchdog
from lightning_mgpu.strategies.resume.resumption import Resumption

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["STALL_TIMEOUT", "ProcessGroupServices"]

log = logging.getLogger(__name__)
_RUNS = itertools.count()

STALL_TIMEOUT = 300.0
"""``stall_timeout``'s default in every strategy that takes it: 5 minutes."""


class ProcessGroupServices(StrategyMixin):
    """Device checks, backend, watchdog, kept shuffle and start-up summary for a process-group strategy.

    The options, which the host's ``__init__`` passes to ``_init_services``:

    Args:
        stall_timeout: Seconds without progress on every rank (while some ranks wait in a
            collective for the others) after which the run stops. ``None`` turns stall
            detection off.
        resume: Whether a ``fit`` without ``ckpt_path`` resumes from the run's newest complete
            checkpoint: ``None`` on a restart only, ``True`` always, ``False`` never.
        checkpoint_every: A resumable checkpoint every that many steps (``int``) or that often
            (``timedelta``); ``"auto"``: 30 minutes where the run can be restarted; ``None``: never.
        requeue_on_failure: Under SLURM, requeue the job after a failed task, at most this often.

    Raises:
        ValueError: If ``stall_timeout`` or an option of ``resume/`` is none of those it accepts.
    """

    if TYPE_CHECKING:  # what the host (DDPStrategy, ModelParallelStrategy) has beyond ParallelStrategy
        strategy_name: str
        _process_group_backend: str | None
        num_nodes: int

        @property
        def num_processes(self) -> int: ...

        def set_world_ranks(self) -> None: ...

    def _init_services(
        self,
        *,
        stall_timeout: float | None = STALL_TIMEOUT,
        resume: bool | None = None,
        checkpoint_every: int | timedelta | str | None = "auto",
        requeue_on_failure: int = 0,
    ) -> None:
        """Take the services' options (checked) and set up their state.

        Called by the host's ``__init__`` once its Lightning base is initialised; the mixin has no
        ``__init__`` of its own, so nothing reaches it through ``super().__init__(**kwargs)``.
        """
        number = isinstance(stall_timeout, (int, float)) and not isinstance(stall_timeout, bool)
        if stall_timeout is not None and (not number or stall_timeout <= 0):
            raise ValueError(
                f"stall_timeout must be a positive number of seconds or None (no stall detection),"
                f" got {stall_timeout!r}"
            )
        self.stall_timeout = None if stall_timeout is None else float(stall_timeout)
        self._progress = 0
        self._watching = False
        self._summary_printed = False
        self._batch_size: int | None = None
        self._requeue = DeferredRequeue()
        self._resumption = Resumption(self, resume, checkpoint_every, requeue_on_failure)

    # ------------------------------------------------------------ set-up
    @override
    def _configure_launcher(self) -> None:
        # runs inside Trainer(...), before any process starts
        *_, layer_sync = strategy_parts(self)
        sync_batchnorm = isinstance(layer_sync, TorchSyncBatchNorm)
        checks.check_devices(self.parallel_devices or [], given_backend(self), sync_batchnorm)
        start_method = launch_start_method(self)
        if start_method == "popen":
            assert self.cluster_environment is not None
            log.debug("%s: start_method='popen': the watched subprocess launcher", self.strategy_name)
            environment, processes = self.cluster_environment, self.num_processes
            set_launcher(self, _WatchedSubprocessScriptLauncher(environment, processes, self.num_nodes))
        else:
            log.debug("%s: start_method=%r: the host's own launcher", self.strategy_name, start_method)
            super()._configure_launcher()

    # the hosts' hook (DDPStrategy's, ModelParallelStrategy's); ParallelStrategy, the checker's host, lacks it
    @override
    def _get_process_group_backend(self) -> str:  # type: ignore[misc]
        backend = given_backend(self)
        if backend:
            log.debug("%s: backend %s, given explicitly", self.strategy_name, backend)
            return backend
        return checks.default_backend(self.root_device)

    @override
    def setup_environment(self) -> None:
        # under the spawn/fork launchers the ranks are only set later, in setup_distributed
        self.set_world_ranks()
        self._watching = self.world_size > 1
        if self._watching:
            watchdog().start(self.global_rank, self.local_rank)
        # under torchrun, before Lightning creates the group in the store earlier attempts left keys in
        timeout = process_group_timeout(self) or default_pg_timeout
        backend = self._get_process_group_backend()
        torchrun_store.init_process_group(
            backend, self.global_rank, self.world_size, timeout, self.root_device
        )
        super().setup_environment()
        at_exit.destroy_at_exit()  # before the watchdog's exit guard, which then runs first
        if self._watching:
            self._attach_watchdog()
        trainer = self._trainer()
        if trainer is not None:
            self._keep_user_shuffle(trainer)
            if trainer.state.fn == TrainerFn.FITTING:
                self._resumption.setup_fit(trainer, self.cluster_environment)

    def _attach_watchdog(self) -> None:
        restart = torchrun_store.current_token() or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        try:
            client = torchrun_store.store_client(timedelta(seconds=DEAD_AFTER))
        except (KeyError, ValueError, RuntimeError) as err:
            rank_zero_warn(
                f"{self.strategy_name}: cannot reach the run's store ({err}); dead or stalled ranks on other"
                " machines will not be detected, only those on this machine"
            )
            return
        # a fresh key space per run: a later fit/test, or a torchrun restart, starts clean
        store = dist.PrefixStore(f"lightning_mgpu/{restart}/{next(_RUNS)}/", client)
        watchdog().attach(store, self.world_size, self._rank_info(), self._progress_count, self.stall_timeout)

    def _rank_info(self) -> RankInfo:
        return rank_info(self.root_device, self.global_rank, self.node_rank)

    def _keep_user_shuffle(self, trainer: pl.Trainer) -> None:
        """Let the training sampler shuffle only when the user's ``DataLoader`` did.

        Lightning builds the ``DistributedSampler`` in ``_DataConnector._prepare_dataloader``
        and passes ``shuffle=True`` for every training loader. The original loader is only
        visible there, so this trainer's connector gets the shuffle its loader had.
        """
        connector = data_connector(trainer)
        original = getattr(type(connector), PREPARE_DATALOADER, None)
        if original is None:  # a Lightning above the versions checked (2.4-2.6) that renamed it
            rank_zero_warn(
                f"{self.strategy_name}: this Lightning version has no `{PREPARE_DATALOADER}`; the training"
                " sampler shuffles even if the DataLoader did not"
            )
            return
        if PREPARE_DATALOADER in vars(connector):
            return  # installed by an earlier fit/validate/test of this trainer

        def prepare(dataloader: object, shuffle: bool, mode: RunningStage) -> object:
            if isinstance(dataloader, DataLoader) and mode in (RunningStage.TRAINING, trainer.state.stage):
                sampler = dataloader.batch_sampler
                self._batch_size = dataloader.batch_size or getattr(sampler, "batch_size", None)
            if mode == RunningStage.TRAINING and isinstance(dataloader, DataLoader):
                shuffle = is_dataloader_shuffled(dataloader)
            prepared = original(connector, dataloader, shuffle=shuffle, mode=mode)
            if mode == RunningStage.TRAINING:  # its place in the epoch goes into every checkpoint
                prepared = self._resumption.position.wrap(prepared, trainer)
            return prepared

        setattr(connector, PREPARE_DATALOADER, prepare)

    def _trainer(self) -> pl.Trainer | None:
        trainer: pl.Trainer | None = attached_trainer(self.lightning_module)
        return trainer

    # --------------------------------------------------------- summary
    def _summary_extra_lines(self) -> list[str]:
        """Lines the host adds at the end of the start-up summary (a sharding plan, say); none here."""
        return []

    def _print_summary(self) -> None:
        if self._summary_printed or self.global_rank != 0:
            return
        self._summary_printed = True
        # every rank's, through the watchdog's store; this rank's alone without one
        infos = (watchdog().infos() if self._watching else {}) or {self.global_rank: self._rank_info()}
        trainer = self._trainer()
        fitting = trainer is not None and trainer.state.fn == TrainerFn.FITTING
        text = format_summary(
            name=self.strategy_name,
            infos=infos,
            num_nodes=self.num_nodes,
            processes_per_node=self.num_processes,
            backend=self._get_process_group_backend(),
            launcher=launcher_name(self.cluster_environment),
            batch_size=self._batch_size,
            accumulate=trainer.accumulate_grad_batches if fitting and trainer is not None else 1,
            extra_lines=self._summary_extra_lines(),
        )
        rank_zero_info(text)

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        self._print_summary()
        trainer = self._trainer()
        if trainer is not None:  # Lightning has set its signal handlers by now
            self._requeue.install(trainer)
            self._resumption.on_train_start(trainer)

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        self._requeue.at_batch_start(self.root_device)

    @override
    def on_validation_start(self) -> None:
        super().on_validation_start()
        trainer = self._trainer()
        if trainer is not None and trainer.state.fn == TrainerFn.VALIDATING:
            self._print_summary()

    @override
    def on_test_start(self) -> None:
        super().on_test_start()
        self._print_summary()

    @override
    def on_predict_start(self) -> None:
        super().on_predict_start()
        self._print_summary()

    # ------------------------------------------------ progress for the watchdog
    def _progress_count(self) -> int:
        """This rank's progress for the watchdog: Lightning's own epoch and batch counters (read
        from the watchdog thread, never written) plus the backward passes and collectives that
        go through the strategy, which tell a rank waiting there from one stuck before it."""
        trainer = self._trainer()
        return self._progress + (loop_progress(trainer) if trainer is not None else 0)

    def note_progress(self) -> None:
        """Count work that passes none of the hooks below (a micro-batch's backward, run by the module)."""
        self._progress += 1

    @override
    def pre_backward(self, closure_loss: torch.Tensor) -> None:
        # the gradient all-reduce waits inside backward
        self._progress += 1
        super().pre_backward(closure_loss)

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        self._progress += 1
        super().barrier(*args, **kwargs)  # type: ignore[safe-super]  # the host implements it

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        self._progress += 1
        return super().broadcast(obj, src)  # type: ignore[safe-super]

    @override
    def reduce(self, *args: Any, **kwargs: Any) -> Any:
        self._progress += 1
        return super().reduce(*args, **kwargs)  # type: ignore[safe-super]

    @override
    def all_gather(self, *args: Any, **kwargs: Any) -> Any:
        self._progress += 1
        return super().all_gather(*args, **kwargs)

    # ---------------------------------------------------------- failures
    @override
    def optimizer_step(
        self, optimizer: torch.optim.Optimizer, closure: Callable[[], Any], model: Any = None, **kwargs: Any
    ) -> Any:
        stepping = False

        def closure_then_step() -> Any:
            nonlocal stepping
            output = closure()
            stepping = True  # forward and backward are done: what runs out from here is the step's
            return output

        try:
            return super().optimizer_step(optimizer, closure_then_step, model, **kwargs)
        except BaseException as error:
            if stepping and is_out_of_memory(error) and self.lightning_module is not None:
                self._explain_step(error, optimizer, self.lightning_module)
            raise

    def _explain_step(
        self, error: BaseException, optimizer: torch.optim.Optimizer, module: torch.nn.Module
    ) -> None:
        try:  # the original error surfaces whatever happens here
            rank, world, device = self.global_rank, self.world_size, self.root_device
            memory = step_memory(self.strategy_name, rank, world, module, optimizer, device)
            add_to_message(error, step_oom_message(memory))
        except Exception as failure:
            log.debug("cannot explain the optimizer step's out-of-memory: %r", failure)

    @override
    def on_exception(self, exception: BaseException) -> None:
        super().on_exception(exception)
        if self._watching:
            watchdog().explain_failure(exception)
        verdict = watchdog().verdict if self._watching else None
        # a rank gone, stuck or failed by itself; not a signal (a cancel, Ctrl-C, the end of a time limit)
        if verdict is not None and (verdict.dead or verdict.stuck or verdict.origin >= 0):
            self._resumption.after_failure(self.world_size, verdict.dead)

    @override
    def teardown(self) -> None:
        if self._watching:
            watchdog().detach()
            self._watching = False
        super().teardown()
