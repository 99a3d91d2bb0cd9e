"""``CONFIG [key=value ...]`` arguments whose options may come anywhere, also after the overrides.

argparse alone leaves out ``trainer.devices=2`` of ``run digits --print-config trainer.devices=2`` (a
positional after an option once the positionals were matched): ``main`` parses with
``parse_known_args`` and hands what is left over to the overrides, where ``split_overrides`` finds
options the subcommand does not have.
"""

from __future__ import annotations

import argparse


def add_config_arguments(parser: argparse.ArgumentParser, default: str | None = None) -> None:
    """Add ``config`` (optional given a ``default``) and the overrides."""
    parser.add_argument(
        "config",
        nargs="?" if default else None,
        default=default,
        help="a YAML file or a shipped config name such as digits or resnet18"
        + (f" (default: {default})" if default else ""),
    )
    parser.add_argument(
        "overrides",
        nargs="*",
        default=[],  # no override is needed
        metavar="key=value",
        help="change the config: trainer.devices=[0,3] data.batch_size=128 callbacks.memory.enabled=false",
    )
    parser.set_defaults(_default_config=default)


def split_overrides(args: argparse.Namespace) -> tuple[str, list[str]]:
    """``(config, overrides)``.

    A first argument holding ``=`` (and not naming a YAML file) is an override: the default
    config is used.

    Raises:
        ValueError: an option the subcommand does not have, or overrides without a config where
            the subcommand has no default.
    """
    prog = f"lightning-mgpu {args.command}"
    if unknown := [item for item in args.overrides if item.startswith("-")]:
        raise ValueError(f"unknown option {unknown[0]}; see {prog} --help")
    config = args.config
    if "=" in config and not config.endswith((".yaml", ".yml")):
        if args._default_config is None:
            raise ValueError(f"give a config before the overrides, e.g. {prog} digits {config}")
        return args._default_config, [config, *args.overrides]
    return config, args.overrides
