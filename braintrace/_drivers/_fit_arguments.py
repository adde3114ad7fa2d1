"""The arguments of :meth:`OnlineTrainer.fit`, checked before anything is learnt, and its stream.

Every check raises with a message that names the argument and ends "Nothing was
trained". :func:`batch_stream` turns ``batches`` (an iterable, a sequence, or a
function of the batch to start from) into the ``(epoch, batch, ends_epoch)``
triples the loop learns from, from a given batch on (a resumed fit's).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import jax

from braintrace._arguments import check_integer
from braintrace._drivers._callbacks import Callback

__all__ = ["Metric", "batch_stream", "check_callbacks", "check_counts", "check_metrics",
           "unpack", "validation_batches"]

Metric = Callable[[jax.Array, Any], jax.Array]
"""``metric(outputs, batch) -> scalar``: ``outputs`` time-major, ``batch`` as given."""


def unpack(batch: Any) -> tuple[Any, Any, Any]:
    """``(xs, ys, mask)`` of a batch: a pair, a triple or a :class:`~braintrace.tasks.Batch`."""
    if isinstance(batch, tuple | list) and len(batch) in (2, 3):
        return (*batch, None) if len(batch) == 2 else tuple(batch)
    raise ValueError("A batch must be (xs, ys) or (xs, ys, mask) (a braintrace.tasks.Batch "
                     f"is one), got {type(batch).__name__}.")


def batch_stream(batches: Any, epochs: int, steps: int | None, start: int,
                 mark_epoch_ends: bool) -> Iterator[tuple[int, Any, bool]]:
    """``(epoch, batch, ends_epoch)`` triples: ``epochs`` passes, at most ``steps`` batches
    in all, from the ``start``-th batch on (0-based, over all epochs).

    A sequence (a list) is indexed there; a function is called as
    ``batches(start)`` and is one stream (``epochs`` must be 1); any other
    iterable is passed over from its beginning and its first ``start`` batches
    dropped. ``ends_epoch`` says a batch is the last of its epoch (found by
    reading the next batch first, with ``mark_epoch_ends`` only; else ``False``).

    Raises:
        ValueError: ``batches`` is a one-shot iterator (a generator) with
            ``epochs > 1`` and no ``steps``, or a function with ``epochs > 1``.
        TypeError: ``batches`` is neither iterable nor a function.

    Example:
        >>> list(batch_stream(['a', 'b', 'c'], epochs=2, steps=None, start=2,
        ...                   mark_epoch_ends=True))
        [(0, 'c', True), (1, 'a', False), (1, 'b', False), (1, 'c', True)]
        >>> list(batch_stream(lambda start: iter(range(start, 5)), 1, None, 3, False))
        [(0, 3, False), (0, 4, False)]
    """
    if isinstance(batches, Sequence):
        size = len(batches)
        first, offset = divmod(start, size) if size else (epochs, 0)
        passes = ((epoch, (batches[i] for i in range(offset if epoch == first else 0, size)))
                  for epoch in range(first, epochs))
        skip = 0
    elif isinstance(batches, Iterable):
        if iter(batches) is batches and epochs > 1 and steps is None:
            raise ValueError("fit: batches is a one-shot iterator (a generator), which can be "
                             "passed over once; give steps=N (a budget of batches) or "
                             "epochs=1. Nothing was trained.")
        passes, skip = ((epoch, iter(batches)) for epoch in range(epochs)), start
    elif callable(batches):
        if epochs != 1:
            raise ValueError("fit: batches is a function (batches(start) -> the batches from "
                             "the start-th on), one stream; give steps=N (a budget of "
                             "batches) rather than epochs. Nothing was trained.")
        passes, skip = iter([(0, iter(batches(start)))]), 0
    else:
        raise TypeError("fit: batches must be an iterable of batches (a list, a data loader, a "
                        "generator) or a function batches(start) returning one, got a "
                        f"{type(batches).__name__}. Nothing was trained.")
    triples = (item for epoch, it in passes for item in _marked(epoch, it, mark_epoch_ends))
    triples = itertools.islice(triples, skip, None)
    return triples if steps is None else itertools.islice(triples, max(steps - start, 0))


def _marked(epoch: int, batches: Iterator[Any], mark: bool) -> Iterator[tuple[int, Any, bool]]:
    """``(epoch, batch, ends_epoch)`` for each batch of one pass."""
    if not mark:
        yield from ((epoch, batch, False) for batch in batches)
        return
    previous = next(batches, _NONE)
    for batch in batches:
        yield epoch, previous, False
        previous = batch
    if previous is not _NONE:
        yield epoch, previous, True


_NONE = object()


def validation_batches(validation: Any) -> list[Any] | None:
    """``validation`` as a list of batches, each checked to be ``(xs, ys)`` or ``(xs, ys, mask)``.

    A tuple of 2 or 3 is one batch (its inputs may be a tuple, as training's),
    unless every element of it is a batch itself: then it is a tuple of batches.
    """
    if validation is None:
        return None
    if hasattr(validation, "shape"):
        raise ValueError(
            "fit: validation is one array (inputs without targets?); pass validation=(xs, ys) "
            "or (xs, ys, mask), or a list of such batches. Nothing was trained.")
    one = isinstance(validation, tuple) and len(validation) in (2, 3) and \
        not all(_is_batch(part) for part in validation)
    batches = [validation] if one else list(validation)
    for i, batch in enumerate(batches):
        if not _is_batch(batch):
            raise ValueError(
                f"fit: validation[{i}] must be a batch (xs, ys) or (xs, ys, mask) (a "
                f"braintrace.tasks.Batch is one), got a {type(batch).__name__}; validation is "
                "one batch or a list of them. Nothing was trained.")
    return batches


def _is_batch(batch: Any) -> bool:
    return isinstance(batch, tuple | list) and len(batch) in (2, 3)


def check_metrics(metrics: Any) -> dict[str, Metric]:
    """``metrics`` (``None``: none), after checking it is ``{name: metric}`` of functions."""
    if metrics is None:
        return {}
    if not isinstance(metrics, Mapping):
        raise TypeError(
            "fit: metrics must be a dict {name: metric(outputs, batch) -> scalar}, got a "
            f"{type(metrics).__name__}. Nothing was trained.")
    for name, metric in metrics.items():
        if not callable(metric):
            raise TypeError(f"fit: metrics[{name!r}] must be a function metric(outputs, batch) "
                            f"-> scalar, got a {type(metric).__name__}. Nothing was trained.")
    return dict(metrics)


def check_callbacks(callbacks: Any) -> Sequence[Callback]:
    """``callbacks``, after checking it is a list or tuple (not one callback)."""
    if not isinstance(callbacks, list | tuple):
        name = type(callbacks).__name__
        raise TypeError(
            f"fit: callbacks must be a list or tuple of Callback objects, got a {name}"
            + (f": pass callbacks=[{name}(...)]" if isinstance(callbacks, Callback) else "")
            + ". Nothing was trained.")
    return callbacks


def check_counts(epochs: Any, steps: Any, eval_every: Any
                 ) -> tuple[int, int | None, int | None]:
    """``epochs``, ``steps`` and ``eval_every`` as ints (``None`` kept), checked before any
    batch is learnt.

    Raises:
        ValueError: One is not a positive int (a float or a bool is not one: then an
            ``ArgumentTypeError``, also a ``TypeError``); the message names it.
    """
    untouched = ". Nothing was trained"
    epochs = check_integer("fit: epochs", epochs, minimum=1, note=untouched)
    if steps is not None:
        steps = check_integer("fit: steps", steps, minimum=1,
                              note=" (None: no budget)" + untouched)
    if eval_every is not None:
        eval_every = check_integer("fit: eval_every", eval_every, minimum=1,
                                   note=" (None: after each epoch)" + untouched)
    return epochs, steps, eval_every
