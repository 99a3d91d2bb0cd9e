"""DDP's unused-parameter error, rewritten to name the parameters and give both fixes.

DDP's "Expected to have finished reduction in the prior iteration" names no parameter (only
reducer indices, unless ``TORCH_DISTRIBUTED_DEBUG`` is set); ``unused_parameters_message`` maps
the indices back to parameter names. The indices follow the module's own parameter order, so a
process that holds an unwrapped copy of the model (the one that spawned the ranks) names them as
well as the rank.
"""

from __future__ import annotations

import re

from torch import nn

from lightning_mgpu._compat.torch import ddp_ignored_names

__all__ = ["UNUSED_PATTERN", "unused_parameters_message"]

UNUSED_PATTERN = "Expected to have finished reduction in the prior iteration"
_DETAIL_NAMES = re.compile(r"Parameters which did not receive grad for rank \d+: ([^\n]+)")
_INDICES = re.compile(r"Parameter indices which did not receive grad for rank \d+: ([\d ]+)")


def _reducer_parameter_names(model: nn.Module) -> list[str]:
    """Parameter names in the order DDP's reducer numbers them (``_build_params_for_reducer``).

    ``model`` is the DDP wrapper or the module it wraps (or an identical copy of it).
    """
    if isinstance(model, nn.parallel.DistributedDataParallel):
        ignore: set[str] = set(getattr(model, "parameters_to_ignore", ()))
        model = model.module
    else:  # what DDP would read from the module when wrapping it
        ignore = ddp_ignored_names(model)
    seen: set[int] = set()
    names = []
    for module_name, module in model.named_modules():
        for param_name, param in module.named_parameters(recurse=False):
            if not param.requires_grad or f"{module_name}.{param_name}" in ignore or id(param) in seen:
                continue
            seen.add(id(param))
            names.append(f"{module_name}.{param_name}" if module_name else param_name)
    return names


def unused_parameter_names(text: str, model: nn.Module | None) -> list[str]:
    """Names of the parameters that got no gradient, read from DDP's message and the model."""
    detail = _DETAIL_NAMES.search(text)
    if detail:
        return [name.strip() for name in detail.group(1).split(",") if name.strip()]
    indices = _INDICES.search(text)
    if indices and model is not None:
        names = _reducer_parameter_names(model)
        return [names[int(i)] for i in indices.group(1).split() if int(i) < len(names)]
    if not isinstance(model, nn.parallel.DistributedDataParallel):
        return []  # only the rank that ran the step knows which gradients are missing
    return [name for name, p in model.module.named_parameters() if p.requires_grad and p.grad is None]


def unused_parameters_message(
    text: str, model: nn.Module | None, strategy_name: str, manual_optimization: bool = False
) -> str:
    """The replacement for DDP's unused-parameter error.

    Under manual optimization DDP checks at every ``manual_backward``, so the parameters
    were missed by the previous backward pass, which may be an earlier one of the same step.
    """
    names = unused_parameter_names(text, model)
    cls = "MGPUDDPStrategy" if strategy_name.startswith("mgpu_ddp") else "DDPStrategy"
    listed = ", ".join(names) if names else "(DDP did not say which; TORCH_DISTRIBUTED_DEBUG=INFO names them)"
    if manual_optimization:
        when = (
            "the previous backward pass (an earlier manual_backward of this training step, or the last"
            " one of the previous step)"
        )
        each, loss = "backward", "every loss you pass to manual_backward"
    else:
        when, each, loss = "the previous training step", "step", "the loss that training_step returns"
    return (
        f"These parameters received no gradient in {when}: {listed}.\n"
        "DDP all-reduces every parameter's gradient after each backward, so each parameter must take part"
        f" in the loss of every {each} unless DDP is told to look for unused ones. Fix it one of two ways:\n"
        f"  1. let DDP find them (costs an extra pass over the autograd graph per step):"
        f' Trainer(strategy="{strategy_name}_find_unused_parameters_true")'
        f" or {cls}(find_unused_parameters=True);\n"
        f"  2. change the model: use these parameters in {loss},"
        " or remove them, or freeze them with param.requires_grad_(False) before fit."
    )
