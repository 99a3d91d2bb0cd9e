"""What the command line prints as one line, without a traceback: errors a user can fix.

- ``USER_ERRORS``: the kinds of error that are the user's to fix: a file that is missing or
  cannot be written (``OSError``), a value the library rejects (``ValueError``, the project's
  ``ConfigError`` and ``LoadError`` among them), and ``UsageError``;
- ``UsageError``: raised by a subcommand for bad input its library call reports with another
  kind (``--key`` naming no entry is a ``KeyError`` of ``export_state_dict``);
- ``user_errors(*kinds)``: turns those kinds, raised inside the ``with`` block, into ``UsageError``.

Anything else (a ``KeyError`` or ``TypeError`` from the project's own code, say) is a bug and
keeps its traceback.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

__all__ = ["USER_ERRORS", "UsageError", "user_errors"]


class UsageError(Exception):
    """Bad input to a subcommand, said in one line with the fix."""


USER_ERRORS: tuple[type[Exception], ...] = (OSError, ValueError, UsageError)


@contextlib.contextmanager
def user_errors(*kinds: type[Exception]) -> Iterator[None]:
    """Inside the block, an error of one of ``kinds`` is the user's: it becomes a ``UsageError``."""
    try:
        yield
    except kinds as err:
        # a KeyError's str() is the repr of its message, quotes and all
        message = err.args[0] if isinstance(err, KeyError) and err.args else str(err)
        raise UsageError(message) from err
