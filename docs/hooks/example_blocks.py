"""A griffe extension for the API reference: a docstring's ``Example::`` block becomes a fenced code block.

The docstrings end with reStructuredText's ``Example::`` and an indented block, which
``tests/test_docstring_examples.py`` runs. Google-style parsing would show the ``::`` and the code
unhighlighted; this turns the block into an "Example" section holding a fenced block, in the
language of its first line (a ``lightning-mgpu`` command is shell, anything else Python).
"""

from __future__ import annotations

import re
import textwrap
from typing import Any

import griffe

# "Example::", a blank line, then the indented lines up to the first line that is not indented
_EXAMPLE = re.compile(r"^Example::\n\n((?:[ \t]+\S.*\n|[ \t]*\n)+)", flags=re.M)


def fenced(docstring: str) -> str:
    """``docstring`` with each ``Example::`` block fenced."""

    def fence(match: re.Match[str]) -> str:
        code = textwrap.dedent(match.group(1)).strip("\n")
        lang = "bash" if code.startswith("lightning-mgpu ") else "python"
        body = textwrap.indent(f"```{lang}\n{code}\n```", "    ")
        return f"Example:\n{body}\n\n"

    return _EXAMPLE.sub(fence, docstring + "\n").rstrip("\n")


class ExampleBlocks(griffe.Extension):
    """Fences the ``Example::`` blocks of every object's docstring."""

    def on_instance(self, *, node: Any, obj: griffe.Object, agent: Any, **kwargs: Any) -> None:
        if obj.docstring is None:
            return
        obj.docstring.value = fenced(obj.docstring.value)
        if "Example::" in obj.docstring.value:  # a warning fails `mkdocs build --strict`
            griffe.logger.warning(f"{obj.path}: an Example:: block that is not followed by an indented one")
