"""Old import path of ``measure_model_state``, which lives in ``lightning_mgpu.estimate.model_state``."""

from lightning_mgpu.estimate.model_state import ModelState, StateBytes, measure_model_state

__all__ = ["ModelState", "StateBytes", "measure_model_state"]
