"""``lightning-mgpu``: the command line entry point.

Subcommand modules are imported only when their subcommand runs, so
``lightning-mgpu --help`` answers without importing torch. Each module provides
``add_arguments(parser)`` and ``run(args) -> int``.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "run": ("lightning_mgpu.cli.run", "train or predict with a recipe from a YAML config"),
    "recipes": ("lightning_mgpu.cli.recipes", "list the shipped recipes"),
    "devices": ("lightning_mgpu.cli.devices", "show devices, their memory, and what mgpu_auto would pick"),
    "estimate": ("lightning_mgpu.cli.estimate", "estimate per-device memory for a config before training"),
    "plot-memory": ("lightning_mgpu.cli.plot_memory", "plot per-device memory of a run folder to a PNG"),
    "export": ("lightning_mgpu.cli.export", "export plain (or DataParallel) weights from a checkpoint"),
    "inspect": ("lightning_mgpu.cli.inspect", "show what a checkpoint or weights file holds"),
}

# Errors a user can fix; they are printed as one line, without a traceback.
_USER_ERRORS = (OSError, ValueError, KeyError, TypeError)


def _build_parser(selected: str | None) -> argparse.ArgumentParser:
    from lightning_mgpu import __version__

    parser = argparse.ArgumentParser(
        prog="lightning-mgpu",
        description="Multi-GPU training with PyTorch Lightning: strategies, memory, checkpoints and recipes.",
    )
    parser.add_argument("--version", action="version", version=f"lightning-mgpu {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == selected:
            importlib.import_module(module).add_arguments(p)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the process exit code."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    selected = next((a for a in args_list if not a.startswith("-")), None)
    parser = _build_parser(selected if selected in COMMANDS else None)
    args = parser.parse_args(args_list)
    if args.command is None:
        parser.print_help()
        return 2
    module = importlib.import_module(COMMANDS[args.command][0])
    try:
        return int(module.run(args) or 0)
    except _USER_ERRORS as err:
        if os.environ.get("LIGHTNING_MGPU_DEBUG"):
            raise
        message = err.args[0] if isinstance(err, KeyError) and err.args else err
        print(f"lightning-mgpu {args.command}: error: {message}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
