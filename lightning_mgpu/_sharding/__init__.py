"""How ``mgpu_fsdp`` cuts a model, as pure functions of the module tree: internal, shared by two rooms.

- ``plan.py``: ``plan_sharding``, which submodules become units of their own (``block_classes`` or
  the automatic policy) and ``validate_block_classes``, the check of that argument;
- ``per_device.py``: what that cut leaves on each device (shards with dim 0's padding, the largest unit
  gathered), ``sharded_need``, the least a device needs, and ``fewest_devices``.

``mgpu_fsdp`` (``strategies/fsdp/``) applies the plan and refuses a model that cannot fit; the estimate
(``estimate/``) predicts ``mgpu_fsdp``'s peak from the same units. Neither owns the other's
decisions, and this room imports neither: only torch and ``devices``.
"""

__all__: list[str] = []  # internal: import from the module that defines a name
