"""``lightning-mgpu inspect``: show what a checkpoint or weights file holds and what it loads into.

Example::

    lightning-mgpu inspect lightning_logs/version_0/checkpoints/last.ckpt
"""

from __future__ import annotations

import argparse

from lightning_mgpu.cli._errors import user_errors
from lightning_mgpu.cli.export import add_reading_options


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "file",
        help="checkpoint or weights file (.ckpt, .pt/.pth, .safetensors) or a sharded checkpoint's folder",
    )
    parser.add_argument("--all", action="store_true", help="list every entry (default: 20 per group)")
    add_reading_options(parser)


def run(args: argparse.Namespace) -> int:
    from lightning_mgpu.checkpoint.inspect import inspect_checkpoint

    with user_errors(KeyError):  # --key naming no entry
        info = inspect_checkpoint(args.file, trust_pickle=args.trust_pickle, key=args.key)
    print(info.render(max_per_group=None if args.all else 20))
    return 0
