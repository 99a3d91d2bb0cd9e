"""Every reach into another project's internals, one module per dependency.

- ``lightning.py``: Lightning's private functions, classes and attributes the strategies use.
- ``torch.py``: what features need of torch beyond the floor (``require``), and torch's private names.
- ``torchmetrics.py``: a ``Metric``'s private state that merging split batches reads and writes.

Each name here says why it is needed, the versions it was checked against (the floor in
``pyproject.toml`` up to the newest tested), and the upstream issue or PR where one exists, so that
it can be dropped when the dependency offers a public way. No module outside this folder imports a
private name of these projects, nor touches a private attribute wrapped here
(``tests/test_compat.py`` checks both).
"""
