"""Errors of a multi-process run: a peer's failure told from this rank's own, and messages extended.

- ``is_communication_error``: whether an exception came from a collective losing a peer
  (gloo's "Connection reset by peer", NCCL errors, store timeouts), as opposed to an error
  of this rank's own code;
- ``add_to_message``: an explanation put in front of (or in place of) an exception's message,
  keeping its type, so the caller's ``except`` clauses still match.
"""

from __future__ import annotations

import torch

__all__ = ["add_to_message", "is_communication_error"]

# what torch.distributed's own errors say (gloo and NCCL name themselves, c10d its store); plain words
# such as "connection" or "timed out" also appear in a user's own errors (a database, a DataLoader)
_COMMUNICATION_WORDS = (
    "gloo",
    "nccl",
    "c10d",
    "tcpstore",
    "processgroup",
    "connection closed by peer",
    "connection reset by peer",
)


def is_communication_error(exception: BaseException) -> bool:
    """Whether ``exception`` is a collective or store failing because a peer went away."""
    if isinstance(exception, torch.distributed.DistError):
        return True
    text = str(exception).lower()
    return isinstance(exception, RuntimeError) and any(word in text for word in _COMMUNICATION_WORDS)


def add_to_message(exception: BaseException, text: str, replace: bool = False) -> None:
    """Put ``text`` in front of the exception's message (or in its place), keeping its type."""
    if exception.args and isinstance(exception.args[0], str):
        first = text if replace else f"{text}\n(the original error follows) {exception.args[0]}"
        exception.args = (first, *exception.args[1:])
    else:
        exception.args = (text, *exception.args)
