"""A griffe extension for the API reference: the docstrings' reStructuredText bits, as Markdown shows them.

- The docstrings end with ``Example::`` and an indented block, which ``tests/test_docstring_examples.py``
  runs. Google-style parsing would show the ``::`` and the code unhighlighted; the block becomes an
  "Example" section holding a fenced block, in the language of its first line (a ``lightning-mgpu``
  command is shell, anything else Python).
- A role such as ``:func:`load_state_dict``` (``~`` keeping the last name of a dotted path) would show as
  the text ":func:" and, in a ``Returns:`` line, be read as a name: it becomes inline code.
"""

from __future__ import annotations

import re
import textwrap
from typing import Any

import griffe

# "Example::", a blank line, then the indented lines up to the first line that is not indented
_EXAMPLE = re.compile(r"^Example::\n\n((?:[ \t]+\S.*\n|[ \t]*\n)+)", flags=re.M)
_ROLE = re.compile(r":(?:func|class|meth|data|attr|mod|exc|obj):`(~?)([\w.]+)`")


def _code(match: re.Match[str]) -> str:
    tilde, path = match.groups()
    return f"`{path.rsplit('.', 1)[-1] if tilde else path}`"


def fenced(docstring: str) -> str:
    """``docstring`` with each ``Example::`` block fenced and each role as inline code."""

    def fence(match: re.Match[str]) -> str:
        code = textwrap.dedent(match.group(1)).strip("\n")
        lang = "bash" if code.startswith("lightning-mgpu ") else "python"
        body = textwrap.indent(f"```{lang}\n{code}\n```", "    ")
        return f"Example:\n{body}\n\n"

    return _ROLE.sub(_code, _EXAMPLE.sub(fence, docstring + "\n").rstrip("\n"))


class MarkdownDocstrings(griffe.Extension):
    """Rewrites every object's docstring with :func:`fenced`."""

    def on_instance(self, *, node: Any, obj: griffe.Object, agent: Any, **kwargs: Any) -> None:
        if obj.docstring is None:
            return
        obj.docstring.value = fenced(obj.docstring.value)
        if "Example::" in obj.docstring.value:  # a warning fails `mkdocs build --strict`
            griffe.logger.warning(f"{obj.path}: an Example:: block that is not followed by an indented one")
