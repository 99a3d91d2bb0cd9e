"""A griffe extension for the API reference: the docstrings' reStructuredText bits, as Markdown shows them.

- The docstrings end with ``Example::`` and an indented block, which ``tests/test_docstring_examples.py``
  runs. Google-style parsing would show the ``::`` and the code unhighlighted; the block becomes an
  "Example" section holding a fenced block, in the language of its first line (a ``lightning-mgpu``
  command is shell, anything else Python).
- A role such as ``:func:`load_state_dict``` (``~`` keeping the last name of a dotted path) would show as
  the text ":func:" and, in a ``Returns:`` line, be read as a name: it becomes inline code.
- A class's ``Args:`` list the arguments a user sets first: the keyword-only ones (``stall_timeout``,
  ``micro_batch_size``, ``resume``, ...), then the others in the order of the signature, and last those
  the Trainer fills in (``accelerator``, ``parallel_devices``, ...), which a strategy's signature starts with.
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


def users_first(docstring: str, keyword_only: set[str]) -> str:
    """``docstring`` with the ``Args:`` named in ``keyword_only`` first, those in ``TRAINER_FILLS`` last."""
    lines = docstring.split("\n")
    try:
        start = lines.index("Args:") + 1
    except ValueError:
        return docstring
    end = start
    while end < len(lines) and (lines[end].startswith(" ") or not lines[end].strip()):
        end += 1
    while end > start and not lines[end - 1].strip():  # the blank lines after the list stay after it
        end -= 1
    entries: list[list[str]] = []
    for line in lines[start:end]:
        if _ARG.match(line) or not entries:
            entries.append([line])
        else:
            entries[-1].append(line)
    first = [e for e in entries if _arg_name(e[0]) in keyword_only]
    last = [e for e in entries if _arg_name(e[0]) in TRAINER_FILLS and e not in first]
    rest = [e for e in entries if e not in first and e not in last]
    reordered = [line for entry in first + rest + last for line in entry]
    return "\n".join(lines[:start] + reordered + lines[end:])


# a strategy's arguments that the Trainer sets from its own (accelerator=, devices=, precision=, ...)
TRAINER_FILLS = frozenset(
    {"accelerator", "parallel_devices", "cluster_environment", "checkpoint_io", "precision_plugin"}
)
_ARG = re.compile(r"^    (\*{0,2}\w+)(?: \(.*\))?:")


def _arg_name(line: str) -> str:
    match = _ARG.match(line)
    return match.group(1) if match else ""


class MarkdownDocstrings(griffe.Extension):
    """Rewrites every object's docstring with :func:`fenced`."""

    def on_instance(self, *, node: Any, obj: griffe.Object, agent: Any, **kwargs: Any) -> None:
        if obj.docstring is None:
            return
        obj.docstring.value = fenced(obj.docstring.value)
        if "Example::" in obj.docstring.value:  # a warning fails `mkdocs build --strict`
            griffe.logger.warning(f"{obj.path}: an Example:: block that is not followed by an indented one")

    def on_class_members(self, *, node: Any, cls: griffe.Class, agent: Any, **kwargs: Any) -> None:
        init = cls.members.get("__init__")
        if cls.docstring is None or not isinstance(init, griffe.Function):
            return
        keyword_only = {p.name for p in init.parameters if p.kind is griffe.ParameterKind.keyword_only}
        cls.docstring.value = users_first(cls.docstring.value, keyword_only)
