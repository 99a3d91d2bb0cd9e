"""Lightning's precision names, what each keeps its weights in and what it autocasts to.

One table for the config schema (which names a config may give) and the memory estimate
(which dtypes a name means). Dtypes are written as ``torch`` attribute names, so this module
does not import torch: ``getattr(torch, name)`` gives the dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ALIASES", "FSDP_PRECISIONS", "PRECISIONS", "PrecisionDtypes", "precision_names"]


@dataclass(frozen=True)
class PrecisionDtypes:
    """The dtypes a precision means, as ``torch`` attribute names; ``None``: float32 / no autocast."""

    parameters: str | None = None
    """Dtype the weights are kept in (``"float64"`` for ``64-true``); ``None`` keeps float32."""
    autocast: str | None = None
    """Dtype the forward pass autocasts to (``"bfloat16"`` for ``bf16-mixed``); ``None``: no autocast."""
    sharded: bool = True
    """Whether ``mgpu_fsdp`` (FSDP2 under Lightning's ``ModelParallelStrategy``) trains in it."""


PRECISIONS: dict[str, PrecisionDtypes] = {
    "32-true": PrecisionDtypes(),
    # fp16 AMP under FSDP2 needs a sharded gradient scaler, which Lightning's ModelParallelStrategy lacks
    "16-mixed": PrecisionDtypes(autocast="float16", sharded=False),
    "bf16-mixed": PrecisionDtypes(autocast="bfloat16"),
    "16-true": PrecisionDtypes(parameters="float16"),
    "bf16-true": PrecisionDtypes(parameters="bfloat16"),
    "64-true": PrecisionDtypes(parameters="float64", sharded=False),
}
"""Lightning 2.x's names, in the order the config error lists them."""

FSDP_PRECISIONS: tuple[str, ...] = tuple(name for name, dtypes in PRECISIONS.items() if dtypes.sharded)
"""The names ``mgpu_fsdp`` accepts, in the table's order."""

ALIASES: dict[str, str] = {"32": "32-true", "16": "16-mixed", "bf16": "bf16-mixed", "64": "64-true"}
"""Lightning's older spellings, as the Trainer reads them."""


def precision_names() -> tuple[str, ...]:
    """Every name a ``Trainer(precision=...)`` accepts: the 2.x names, then the older spellings.

    Example::

        "bf16-mixed" in precision_names()  # True
    """
    return (*PRECISIONS, *ALIASES)
