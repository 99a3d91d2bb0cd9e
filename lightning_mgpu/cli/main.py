"""``lightning-mgpu``: the command line entry point.

Subcommand modules are imported only when their subcommand runs, so
``lightning-mgpu --help`` answers without importing torch. Each module provides
``add_arguments(parser)`` and ``run(args) -> int``.

Errors a user can fix (``_errors.USER_ERRORS``) are printed as one line, without a traceback;
any other error is a bug and shows its traceback. Output whose reader stops
early (``lightning-mgpu inspect --all f | head``) ends quietly with status 141, as a process ended
by SIGPIPE does, and Ctrl-C prints one line and ends with status 130, as a shell reports SIGINT
(files being written are removed first, see ``_atomic``).
"""

from __future__ import annotations

import argparse
import importlib
import os
import select
import sys
from collections.abc import Sequence

from lightning_mgpu.cli._errors import USER_ERRORS

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

# the status of a process ended by SIGPIPE / SIGINT, as a shell reports it
_SIGPIPE_EXIT = 128 + 13
_SIGINT_EXIT = 128 + 2


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
    args, extra = parser.parse_known_args(args_list)
    if "overrides" in args:  # CONFIG key=value ... commands: options may follow the overrides
        args.overrides = [*args.overrides, *extra]
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command is None:
        parser.print_help()
        return 2
    try:
        module = importlib.import_module(COMMANDS[args.command][0])
        code = int(module.run(args) or 0)
        sys.stdout.flush()  # a closed pipe shows here, not at exit where it would print a traceback
        return code
    except BrokenPipeError as err:
        if not _stdout_reader_gone():
            return _user_error(args.command, err)
        # the reader stopped early (``| head``): end quietly, as other command line tools do; what
        # is still buffered goes to devnull so that the flush at exit does not fail again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return _SIGPIPE_EXIT
    except USER_ERRORS as err:
        return _user_error(args.command, err)
    except KeyboardInterrupt:
        print(f"lightning-mgpu {args.command}: interrupted", file=sys.stderr)
        return _SIGINT_EXIT


def _user_error(command: str, err: Exception) -> int:
    if os.environ.get("LIGHTNING_MGPU_DEBUG"):
        raise err
    print(f"lightning-mgpu {command}: error: {err}", file=sys.stderr)
    return 1


def _stdout_reader_gone() -> bool:
    """Whether stdout is a pipe whose reader has closed it, rather than some other pipe breaking."""
    if not hasattr(select, "poll"):  # Windows: cannot tell; stdout is by far the likeliest
        return True
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), 0)  # POLLERR is reported whatever is asked for
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (OSError, ValueError, AttributeError):  # stdout replaced by an object without a file
        return False


if __name__ == "__main__":
    sys.exit(main())
