"""A batch cut along dim 0 into parts, and the parts' results made one: for ``mgpu_dp`` and micro-batching.

- ``batch.py``: ``split_rows`` (the rows every tensor agrees on), ``split_sizes``, ``scatter_batch``
  (tensors and per-row lists with their rows, or the module's ``split_batch_rows``), ``check_cuttable``,
  ``combine_outputs``, ``weighted_mean``;
- ``logs.py``: ``LogCapture`` records each part's ``self.log`` calls, ``replay_logs`` logs them once;
- ``merge_metrics.py``: torchmetrics updated per part, merged into the module's metric in order.

Imports neither ``dp/`` nor ``microbatch/``, which both use it.
"""
