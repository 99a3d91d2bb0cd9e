"""``lightning-mgpu recipes``: one line per recipe, with the shipped configs that run it.

Run one with ``lightning-mgpu run CONFIG [key=value ...]``.
"""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """No options."""


def run(args: argparse.Namespace) -> int:
    from omegaconf import DictConfig, OmegaConf

    from lightning_mgpu.config.parse import shipped_configs
    from lightning_mgpu.recipes import DEFAULT_RECIPE, RECIPES

    configs: dict[str, list[str]] = {name: [] for name in RECIPES}
    for config_name, path in shipped_configs().items():
        loaded = OmegaConf.load(path)
        recipe = loaded.get("recipe") if isinstance(loaded, DictConfig) else None
        configs.setdefault(str(recipe), []).append(config_name)
    width = max(len(name) for name in RECIPES)
    for name, description in RECIPES.items():
        default = " (default)" if name == DEFAULT_RECIPE else ""
        runs = ", ".join(configs[name]) or "-"
        print(f"{name:<{width}}  {description}{default}  [configs: {runs}]")
    return 0
