"""``lightning-mgpu run [CONFIG] [key=value ...]``: train (or validate, or predict) with a recipe config.

Usage::

    lightning-mgpu run digits                                   # all local devices, mgpu_auto
    lightning-mgpu run digits trainer.devices=1                 # one device
    lightning-mgpu run my_config.yaml trainer.max_epochs=3 --print-config

CONFIG is a YAML file or a shipped config name (``lightning-mgpu recipes`` lists them); without
it the ``digits`` config runs. The config is validated before any training process starts; a
mistake is reported with every problem at once and no traceback.
"""

from __future__ import annotations

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "config",
        nargs="?",
        default="digits",
        help="a YAML file or a shipped config name such as digits or resnet18 (default: digits)",
    )
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="key=value",
        help="change the config: trainer.devices=[0,3] data.batch_size=128 callbacks.memory.enabled=false",
    )
    parser.add_argument(
        "--print-config", action="store_true", help="print the resolved, validated config and exit"
    )


def run(args: argparse.Namespace) -> int:
    from lightning_mgpu.config import load_config

    config, overrides = args.config, list(args.overrides)
    if "=" in config and not config.endswith((".yaml", ".yml")):  # only overrides were given
        config, overrides = "digits", [config, *overrides]
    try:
        cfg = load_config(config, overrides)
        if args.print_config:
            from omegaconf import OmegaConf

            print(OmegaConf.to_yaml(OmegaConf.structured(cfg)), end="")
            return 0
        from lightning_mgpu.cli._job import run_job

        return run_job(cfg)
    except ModuleNotFoundError as err:  # a recipe's optional dependency, e.g. scikit-learn or Pillow
        print(f"lightning-mgpu run: error: {err}", file=sys.stderr)
        return 1
