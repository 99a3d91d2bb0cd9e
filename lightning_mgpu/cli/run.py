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

from lightning_mgpu.cli._config_args import add_config_arguments, split_overrides
from lightning_mgpu.cli._errors import user_errors


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--print-config", action="store_true", help="print the resolved, validated config and exit"
    )
    add_config_arguments(parser, default="digits")


def run(args: argparse.Namespace) -> int:
    from lightning_mgpu.config import load_config

    config, overrides = split_overrides(args)
    with user_errors(ModuleNotFoundError):  # a recipe's optional dependency, e.g. scikit-learn or Pillow
        cfg = load_config(config, overrides)
        if args.print_config:
            from omegaconf import OmegaConf

            print(OmegaConf.to_yaml(OmegaConf.structured(cfg)), end="")
            return 0
        from lightning_mgpu.runner import run_job

        closing = run_job(cfg)  # rank 0's summary; None on the other ranks
    if closing is not None:
        print(closing)
    return 0
