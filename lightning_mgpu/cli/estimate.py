"""``lightning-mgpu estimate CONFIG [key=value ...] [--gpu-memory 12GiB] [--devices N]``: memory ahead.

Usage::

    lightning-mgpu estimate resnet50 --gpu-memory 12GiB --devices 4
    lightning-mgpu estimate digits data.batch_size=512 --devices 2

Builds the config's model and one small batch of its data, measures one training step with
``lightning_mgpu.estimate_memory`` (on meta tensors where it can, so no GPU is needed; for
``task: predict`` or ``validate`` an inference pass, without gradients or optimizer state) and
prints each strategy's peak per device for the config's GLOBAL ``data.batch_size``: one device
holds it all, ``mgpu_dp`` splits it over the devices (card 0 also receives the whole batch
and the gathered outputs), ``mgpu_ddp`` gives each process ``batch_size / N``, and ``mgpu_fsdp``
does too with 1/N of the model state on each device. With a device memory it also says whether
each fits, the largest ``data.batch_size`` that would, and from how many devices ``mgpu_fsdp`` fits.
"""

from __future__ import annotations

import argparse
from typing import Any

from lightning_mgpu.cli._config_args import add_config_arguments, split_overrides

# The batch actually pushed through the model; the estimate scales it to data.batch_size.
_SAMPLE = 8


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--gpu-memory",
        metavar="SIZE",
        help="memory of one device, e.g. 12GiB or 80GB (default: the smallest GPU here)",
    )
    parser.add_argument(
        "--devices",
        type=int,
        metavar="N",
        help="devices to spread the batch over (default: the config's devices)",
    )
    add_config_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from lightning_mgpu.config import load_config
    from lightning_mgpu.config.instantiate import build_data, build_module
    from lightning_mgpu.estimate.predict import estimate_memory

    config, overrides = split_overrides(args)
    if args.devices is not None and args.devices < 1:
        raise ValueError(f"--devices must be at least 1, got {args.devices}")
    cfg = load_config(config, overrides)
    devices = args.devices or _device_count(cfg.trainer.accelerator, cfg.trainer.devices)
    module = build_module(cfg, with_weights=False)
    sample = build_data(cfg).example_batch(min(_SAMPLE, cfg.data.batch_size))  # type: ignore[attr-defined]
    common = dict(devices=devices, device_memory=args.gpu_memory, batch_size=cfg.data.batch_size)
    # fit: the config's optimizer, without a Trainer's schedule; validate and predict: an inference pass
    step = (
        dict(optimizer=module.make_optimizer())  # type: ignore[operator]
        if cfg.task == "fit"
        else dict(inference=True, step_fn=_forward)
    )
    est = estimate_memory(module, sample, **common, **step, precision=cfg.trainer.precision)
    print(report(est, cfg.recipe, cfg.data.batch_size, devices, task=cfg.task))
    return 0


def _forward(module: Any, batch: Any) -> Any:
    """What validate and predict run for a recipe, less its small metrics: the network on the inputs."""
    return module(batch[0] if isinstance(batch, (list, tuple)) else batch)


def _device_count(accelerator: str, devices: Any) -> int:
    """The devices ``run`` would use; indices count as GPUs even where none is visible here."""
    from lightning_mgpu.config.instantiate import resolve_devices

    if isinstance(devices, list):
        return len(devices)
    _, resolved = resolve_devices(accelerator, devices)
    return 1 if resolved == "auto" else int(resolved)  # "auto" left: an accelerator with nothing visible


def report(est: Any, recipe: str, batch_size: int, devices: int, task: str = "fit") -> str:
    """The estimate in the config's terms: ``batch_size`` is the global batch of every strategy."""
    from lightning_mgpu.devices import format_bytes
    from lightning_mgpu.estimate.memory_estimate import format_estimate

    memory = f", {format_bytes(est.device_memory)} per device" if est.device_memory else ""
    what = (
        f"task {task}: inference, no gradients or optimizer state"
        if est.inference
        else f"optimizer {est.optimizer}"
    )
    heading = (
        f"{recipe}: {est.model}, data.batch_size={batch_size} (global), {devices} device(s){memory},"
        f" {est.precision}, {what}, measured on {est.measured_on}"
    )
    return format_estimate(est, heading=heading, global_batch=True)
