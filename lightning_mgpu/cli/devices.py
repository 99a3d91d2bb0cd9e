"""``lightning-mgpu devices``: the devices here, what they hold, and what ``mgpu_auto`` would pick.

For each visible CUDA device: its index for torch (``cuda:N``) and, under
``CUDA_VISIBLE_DEVICES``, the physical index ``nvidia-smi`` uses; its name; used and
total memory and the processes holding memory on it (through NVML, the
``lightning-mgpu[nvml]`` extra). On a machine without CUDA it says so and shows the CPU
cores and RAM. Then it prints the strategy ``Trainer(strategy="mgpu_auto",
devices="auto")`` would use here, and why, and what ``lightning-mgpu run`` does with
``trainer.devices: auto``: the same on GPUs, but on a machine without GPU it starts one
CPU process per core (at most 4) where Lightning's ``auto`` means one CPU device.
"""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``lightning-mgpu devices``."""
    parser.add_argument(
        "--num-nodes",
        type=int,
        default=1,
        help="nodes the Trainer would run on, for the mgpu_auto decision (default: 1)",
    )


def run(args: argparse.Namespace) -> int:
    """Print the devices and the ``mgpu_auto`` decision; returns the exit code."""
    if args.num_nodes < 1:
        raise ValueError(f"--num-nodes must be at least 1, got {args.num_nodes}")
    from lightning_mgpu.config.instantiate import resolve_devices
    from lightning_mgpu.config.schema import CPU_DEVICE_CAP
    from lightning_mgpu.devices import (
        cpu_summary,
        cuda_devices,
        format_bytes,
        nvml_available,
        visible_cuda_devices,
    )
    from lightning_mgpu.strategies.auto.strategy import choose_strategy

    devices = cuda_devices()
    visible = visible_cuda_devices()
    if visible is not None:
        print(f"CUDA_VISIBLE_DEVICES={','.join(visible) or '(empty)'}")
    if not devices:
        cpu = cpu_summary()
        print("No CUDA device is visible: this machine trains on CPU only.")
        ram = f"RAM {format_bytes(cpu['ram_used'])} used of {format_bytes(cpu['ram_total'])}"
        print(f"CPU: {cpu['cores']} logical cores, {ram}")
    for device in devices:
        physical = f" (physical {device.physical})" if device.physical != str(device.index) else ""
        memory = (
            f"{format_bytes(device.used_bytes)} used of {format_bytes(device.total_bytes)}"
            if device.used_bytes is not None
            else f"{format_bytes(device.total_bytes)} total"
        )
        print(f"cuda:{device.index}{physical}  {device.name}  {memory}")
        for proc in device.processes:
            held = "" if proc.used_bytes is None else f"  {format_bytes(proc.used_bytes)}"
            print(f"    pid {proc.pid}  {proc.name or '?'}{held}")
    if devices and not nvml_available():
        print("(used memory and processes need NVML: pip install 'lightning-mgpu[nvml]')")
    choice = choose_strategy(devices="auto", num_nodes=args.num_nodes)
    print(f'Trainer(strategy="mgpu_auto", devices="auto") would pick {choice}')
    accelerator, count = resolve_devices("auto", "auto")
    choice = choose_strategy(devices=count, accelerator=accelerator, num_nodes=args.num_nodes)
    every = f"one CPU process per core, at most {CPU_DEVICE_CAP}"
    if accelerator == "gpu":
        every = "every visible GPU"
    print(f"lightning-mgpu run with trainer.devices=auto ({every}) would pick {choice}")
    return 0
