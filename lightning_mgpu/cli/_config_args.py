"""``CONFIG [key=value ...]`` arguments whose options may come anywhere, also after the overrides.

argparse alone refuses ``run digits --print-config trainer.devices=2`` (a positional after an
option once the positionals were matched), so the overrides take the rest of the command
line and the options found among them are parsed here.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

Options = Callable[[argparse.ArgumentParser], None]


def add_config_arguments(
    parser: argparse.ArgumentParser, options: Options, default: str | None = None
) -> None:
    """Add the subcommand's ``options``, then ``config`` (optional given a ``default``) and overrides."""
    options(parser)
    parser.add_argument(
        "config",
        nargs="?" if default else None,
        default=default,
        help="a YAML file or a shipped config name such as digits or resnet18"
        + (f" (default: {default})" if default else ""),
    )
    overrides = parser.add_argument(
        "overrides",
        nargs=argparse.REMAINDER,
        metavar="key=value",
        help="change the config: trainer.devices=[0,3] data.batch_size=128 callbacks.memory.enabled=false",
    )
    overrides.required = False  # argparse marks a REMAINDER positional required; none is needed
    parser.set_defaults(_parser=parser, _options=options)


def split_overrides(args: argparse.Namespace) -> tuple[str, list[str]]:
    """``(config, overrides)``; options among the overrides are set on ``args``.

    A first argument holding ``=`` (and not naming a YAML file) is an override: the default
    config is used.

    Raises:
        ValueError: an option the subcommand does not have.
    """
    trailing = argparse.ArgumentParser(prog=args._parser.prog, add_help=False)
    args._options(trailing)
    trailing.add_argument("-h", "--help", action="store_true")
    found, rest = trailing.parse_known_args(args.overrides)
    if found.help:
        args._parser.print_help()
        raise SystemExit(0)
    for name, value in vars(found).items():
        if name != "help" and value != trailing.get_default(name):
            setattr(args, name, value)
    unknown = [r for r in rest if r.startswith("-")]
    if unknown:
        raise ValueError(f"unknown option {unknown[0]}; see {args._parser.prog} --help")
    config = args.config
    if "=" in config and not config.endswith((".yaml", ".yml")):
        default = args._parser.get_default("config")
        if default is None:
            raise ValueError(f"give a config before the overrides, e.g. {args._parser.prog} digits {config}")
        return default, [config, *rest]
    return config, rest
