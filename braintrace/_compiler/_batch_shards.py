"""How many devices the batch axis of the program being traced is split over.

The drivers trace a sharded program inside :func:`splitting_batch` with the
size of the mesh's data axis. A neuron axis splits the hidden units, not the
batch, so the whole mesh's size does not say it.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import jax

__all__ = ["batch_shards", "splitting_batch"]

_SHARDS: contextvars.ContextVar[int | None] = contextvars.ContextVar("batch_shards", default=None)


def batch_shards() -> int:
    """The number of devices the batch is split over (1: not split).

    Inside :func:`splitting_batch`, its value; elsewhere, the size of the
    abstract mesh set (``jax.sharding.use_abstract_mesh``), 1 without one.

    Example:
        >>> from braintrace._compiler import batch_shards, splitting_batch
        >>> batch_shards()
        1
        >>> with splitting_batch(4):
        ...     batch_shards()
        4
    """
    shards = _SHARDS.get()
    return max(jax.sharding.get_abstract_mesh().size, 1) if shards is None else shards


@contextlib.contextmanager
def splitting_batch(shards: int) -> Iterator[None]:
    """Traces inside run with the batch split over ``shards`` devices (:func:`batch_shards`)."""
    token = _SHARDS.set(shards)
    try:
        yield
    finally:
        _SHARDS.reset(token)
