"""The process group of a torchrun attempt, in a key space of torchrun's store that no earlier attempt wrote.

Since torch 2.4, torchrun's c10d rendezvous shares its own TCPStore with the workers
(``TORCHELASTIC_USE_AGENT_STORE=True``: every rank connects to ``MASTER_ADDR:MASTER_PORT`` as a
client) and keeps that store for the whole job. After a ``--max-restarts`` restart the new
workers' ``init_process_group`` finds the keys the dead attempt left there, under the same names
(gloo's peer addresses, NCCL's unique id, the store barrier's counters): a rank that reads a peer's
entry before the peer rewrote it connects to a port of a process that no longer exists ("Gloo
connectFullMesh failed ... Connection refused") or waits forever. ``TORCHELASTIC_RESTART_COUNT``
cannot name the attempt: each node's agent counts only its own workers' failures, so after a
failure on one node the nodes disagree. No upstream issue found for these keys (torch 2.6 to 2.13);
the nearest, pytorch/pytorch#135712 and the fix #167302, are about a stale ``MASTER_ADDR`` in the
same store.

:func:`init_process_group` lets the ranks agree on a fresh token through the store itself, and
creates the process group under it. The agreement holds although the store is full of earlier
attempts' keys, because every process of an earlier attempt has ended before any process of the
next one starts (torchrun stops a node's workers before it joins the next rendezvous round):

- each rank ``r > 0`` writes a random ``hello/r`` and waits for a ``reply/r`` that starts with it;
  only this attempt's rank 0 can have written that reply, so the token in it is this attempt's;
- rank 0 draws the token and answers every ``hello`` it sees (an earlier attempt's too: harmless)
  until each rank wrote ``got/r`` ending with the token.
"""

from __future__ import annotations

import logging
import os
import secrets
import time
from datetime import timedelta

import torch
import torch.distributed as dist

__all__ = ["attempt_token", "current_token", "init_process_group", "store_client"]

log = logging.getLogger(__name__)

_KEYS = "lightning_mgpu/attempt/"
_POLL = 0.01
_TOKEN: str | None = None


def current_token() -> str | None:
    """The token this process's group was created under by :func:`init_process_group`, if it was."""
    return _TOKEN


def store_client(timeout: timedelta) -> dist.TCPStore:
    """A client of the run's store at ``MASTER_ADDR:MASTER_PORT`` (torchrun's, or rank 0's process's)."""
    return dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout
    )


def attempt_token(store: dist.Store, rank: int, world_size: int, timeout: float) -> str:
    """A token every rank of this attempt gets and no earlier attempt used, agreed through ``store``.

    Raises:
        TimeoutError: If the other ranks do not answer within ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    if rank == 0:
        return _lead(store, world_size, deadline, timeout)
    return _follow(store, rank, deadline, timeout)


def _lead(store: dist.Store, world_size: int, deadline: float, timeout: float) -> str:
    token = secrets.token_hex(8)
    answered: dict[int, str] = {}
    waiting = set(range(1, world_size))
    while waiting:
        for rank in sorted(waiting):
            got = f"{_KEYS}got/{rank}"
            if store.check([got]) and store.get(got).decode().endswith(f":{token}"):
                waiting.discard(rank)
                continue
            hello = f"{_KEYS}hello/{rank}"
            if store.check([hello]):
                nonce = store.get(hello).decode()
                if answered.get(rank) != nonce:  # a new hello: this attempt's, or still the last one's
                    store.set(f"{_KEYS}reply/{rank}", f"{nonce}:{token}")
                    answered[rank] = nonce
        if waiting:
            _wait(deadline, timeout, f"rank(s) {sorted(waiting)} did not join rank 0")
    log.debug("rank 0: this attempt's process group lives under %s%s/", _KEYS, token)
    return token


def _follow(store: dist.Store, rank: int, deadline: float, timeout: float) -> str:
    nonce = secrets.token_hex(8)
    store.set(f"{_KEYS}hello/{rank}", nonce)
    reply = f"{_KEYS}reply/{rank}"
    while True:
        if store.check([reply]):
            answer = store.get(reply).decode()
            if answer.startswith(f"{nonce}:"):
                token = answer.split(":", 1)[1]
                store.set(f"{_KEYS}got/{rank}", f"{nonce}:{token}")
                return token
        _wait(deadline, timeout, f"rank 0 did not answer rank {rank}")


def _wait(deadline: float, timeout: float, what: str) -> None:
    if time.monotonic() > deadline:
        where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
        raise TimeoutError(
            f"{what} within {timeout:g} s through torchrun's store at {where}: every rank must"
            " start; raise the strategy's `timeout` if some start much later than others"
        )
    time.sleep(_POLL)


def init_process_group(
    backend: str, rank: int, world_size: int, timeout: timedelta, device: torch.device
) -> None:
    """Under torchrun's shared store, create the default process group under a fresh token.

    - does nothing outside torchrun's shared store (Lightning's launcher, SLURM: each attempt there
      has a store of its own) or once a process group exists;
    - otherwise agrees on the token with :func:`attempt_token` and creates the group over
      ``PrefixStore(token, store)`` with the arguments Lightning would pass; other users of the
      store (the watchdog) put the token (:func:`current_token`) in their keys too.
    """
    global _TOKEN
    # a torchrun worker whose process group lives in torchrun's own store
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
    if not agent_store or not dist.is_available() or dist.is_initialized():
        return
    client = store_client(timeout)
    token = attempt_token(client, rank, world_size, timeout.total_seconds())
    store = dist.PrefixStore(f"{_KEYS}{token}/", client)
    _TOKEN = token
    device_id = device if device.type != "cpu" else None
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=world_size, timeout=timeout, device_id=device_id
    )
    log.debug("rank %d: process group created under torchrun's store, attempt token %s", rank, token)
