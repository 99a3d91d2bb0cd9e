"""Micro-batching for every ``mgpu_*`` strategy: one implementation, mixed into each strategy class.

- ``mixin.py``: ``MicroBatching``, the ``micro_batch_size=`` argument (an int or ``"auto"``);
- ``batch_runner.py``: one batch run as micro-batches (forward only in evaluation), retried smaller after an
  out-of-memory;
- ``host.py``: what the runner needs of its strategy (``MicroBatchHost``, ``CollectivePasses``);
- ``first_size.py``: the first ``"auto"`` size, from the memory estimate where the device's memory is known;
- ``agreement.py``: how the ranks learn of each other's out-of-memory errors (one all-reduce at
  the end of each attempt, meeting the announcements of the collectives ``mgpu_fsdp``'s passes enter);
- ``sizes.py``: the micro-batch size of one rank: halve on out-of-memory, grow after clean batches;
- ``grads.py``: the gradients of a batch kept apart until every rank succeeded, then averaged once.

Cutting the batch, replaying ``self.log`` and merging torchmetrics updated per micro-batch are
``split/``'s; the out-of-memory predicate is
``lightning_mgpu.oom.is_out_of_memory``. ``MicroBatching`` is public (documented); the rest is internal.
"""

from lightning_mgpu.strategies.microbatch.mixin import MicroBatching

__all__ = ["MicroBatching"]
