"""``lightning-mgpu export``: write the plain (or DataParallel) weights of a checkpoint.

Examples::

    lightning-mgpu export lightning_logs/version_0/checkpoints/last.ckpt model.safetensors
    lightning-mgpu export last.ckpt model_dp.pt --dataparallel --format pt
    lightning-mgpu export last.ckpt student.safetensors --submodule student
    lightning-mgpu export train_state.pt ema.safetensors --key ema
"""

from __future__ import annotations

import argparse

from lightning_mgpu.cli._errors import user_errors


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "checkpoint",
        help="checkpoint to read: Lightning .ckpt, .pt/.pth, .safetensors, or the folder of a sharded "
        "checkpoint (FSDP, ModelParallelStrategy)",
    )
    parser.add_argument("out", help="file to write; the format follows the suffix unless --format is given")
    parser.add_argument(
        "--dataparallel",
        action="store_true",
        help="prefix every key with 'module.', the form that loads into nn.DataParallel(model)",
    )
    parser.add_argument(
        "--submodule",
        metavar="NAME",
        default=None,
        help="LightningModule attribute to export (e.g. model); '' keeps every entry",
    )
    parser.add_argument("--format", choices=("safetensors", "pt"), default=None, help="output format")
    parser.add_argument(
        "--dtype",
        choices=("float32", "float16", "bfloat16"),
        default=None,
        help="cast floating-point weights",
    )
    add_reading_options(parser)


def add_reading_options(parser: argparse.ArgumentParser) -> None:
    """``--key`` and ``--trust-pickle``, how the file is read: shared with ``lightning-mgpu inspect``."""
    parser.add_argument(
        "--key",
        metavar="NAME",
        default=None,
        help="entry of a training checkpoint holding several state_dicts to use (e.g. ema)",
    )
    parser.add_argument(
        "--trust-pickle",
        action="store_true",
        help="unpickle arbitrary Python objects from a legacy file; this runs code from the file, "
        "so only for files you trust",
    )


def run(args: argparse.Namespace) -> int:
    from lightning_mgpu.checkpoint.export import export_state_dict

    with user_errors(KeyError):  # --key or --submodule naming no entry
        report = export_state_dict(
            args.checkpoint,
            args.out,
            submodule=args.submodule,
            prefix="module." if args.dataparallel else "",
            format=args.format,
            dtype=args.dtype,
            trust_pickle=args.trust_pickle,
            key=args.key,
        )
    print(report)
    return 0
