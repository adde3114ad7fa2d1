"""One run of :meth:`OnlineTrainer.fit`: its progress, as it is saved and resumed.

A :class:`FitRun` is what a fit has done so far: its :class:`History` (whose
last record's ``'step'`` is the number of batches learnt), whether it has
ended, and its callbacks. A checkpoint of the trainer taken while it runs
(``ModelCheckpoint``, or any ``CheckpointManager.save(step, trainer)``) holds it
as two items (:meth:`FitRun.checkpoint_items`): ``fit``, JSON values (the
History, each callback's class name and :meth:`~braintrace.Callback.state_dict`
with its arrays replaced by their index), and ``fit_arrays``, those arrays.
Restored (:func:`restore_template`, :func:`Resumed.of`), it tells the next
``fit`` where to continue, unless the run had ended.

A batch's loss is read on the host lazily (:meth:`FitRun.read_losses`): the
device computes it while the host goes on, and its record gets its ``'loss'``
when something reads it (a callback's ``on_step``, an evaluation, a save, the end).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from braintrace._drivers._callbacks import Callback
from braintrace._drivers._checkpoint import Item, JsonItem, stored_items
from braintrace._drivers._history import History, scored_mean

__all__ = ["FitRun", "Resumed", "restore_template"]

_FORMAT = 1
_ARRAY, _KEY, _ITEMS = "__array__", "__key__", "__items__"


@dataclasses.dataclass
class FitRun:
    """The progress of one fit (module docstring).

    Attributes:
        history: What it measured so far.
        callbacks: Its callbacks, in the order given to ``fit``.
        ended: Whether it has ended: a callback stopped it, or its budget of
            batches is used up. A checkpoint of an ended run is not resumed.
    """

    history: History
    callbacks: Sequence[Callback] = ()
    ended: bool = False
    _unread: list[tuple[dict[str, Any], jax.Array, Any]] = dataclasses.field(
        default_factory=list)

    @property
    def step(self) -> int:
        """The number of batches learnt (the last record's ``'step'``; 0 before the first)."""
        return int(self.history.steps[-1]["step"]) if self.history.steps else 0

    def record(self, step: int, epoch: int, losses: jax.Array, mask: Any) -> dict[str, Any]:
        """Appends the record of a batch; its ``'loss'`` is read later (:meth:`read_losses`)."""
        record: dict[str, Any] = {"step": step, "epoch": epoch}
        self.history.steps.append(record)
        self._unread.append((record, losses, mask))
        return record

    def read_losses(self, *, ready_only: bool = False) -> None:
        """Sets the ``'loss'`` of every record still without one (the scored mean of its
        batch's losses: waits for the device), or, with ``ready_only``, of those whose
        losses the device has finished."""
        while self._unread and not (ready_only and not self._unread[0][1].is_ready()):
            record, losses, mask = self._unread.pop(0)
            record["loss"] = scored_mean(losses, mask)

    def drop_last(self) -> dict[str, Any]:
        """Removes the last batch's record (its call was discarded); returns it."""
        self._unread = [u for u in self._unread if u[0] is not self.history.steps[-1]]
        return self.history.steps.pop()

    def checkpoint_items(self) -> dict[str, Item | JsonItem]:
        """The items ``fit`` and (if any callback state holds arrays) ``fit_arrays``."""
        self.read_losses()
        arrays: list[Any] = []
        value = {"format": _FORMAT, "ended": self.ended,
                 "history": dataclasses.asdict(self.history),
                 "callbacks": [{"type": type(c).__qualname__, "state": _encode(c.state_dict(),
                                                                               arrays)}
                               for c in self.callbacks]}
        items: dict[str, Item | JsonItem] = {"fit": JsonItem(value)}
        if arrays:
            items["fit_arrays"] = Item(arrays, [f"fit_arrays[{i}]" for i in range(len(arrays))],
                                       flax=False)
        return items


class Resumed(NamedTuple):
    """A fit's progress read back from a checkpoint.

    Attributes:
        history: Its History.
        states: Per callback, its class name and its state (arrays as ``jax.Array``).
        ended: Whether the run had ended (then it is not resumed).
    """

    history: History
    states: list[tuple[str, Any]]
    ended: bool

    @classmethod
    def of(cls, restored: dict[str, Any]) -> Resumed:
        """The progress in the restored items ``fit`` and ``fit_arrays``."""
        value, arrays = restored["fit"], restored.get("fit_arrays", [])
        history = History(**value["history"])
        states = [(c["type"], _decode(c["state"], arrays)) for c in value["callbacks"]]
        return cls(history, states, bool(value["ended"]))

    def load_into(self, callbacks: Sequence[Callback]) -> None:
        """Loads each callback's state (after its ``on_start``).

        Raises:
            ValueError: The callbacks are not those of the checkpoint's fit (their
                classes, in order); nothing is loaded then.
        """
        given = [type(c).__qualname__ for c in callbacks]
        saved = [name for name, _ in self.states]
        if given != saved:
            raise ValueError(
                f"fit: the checkpoint restored into this trainer is of a fit with the "
                f"callbacks {saved}; this fit has {given}. Pass the same callbacks, in the "
                "same order, to resume it (or compile a new trainer to start a new run). "
                "Nothing was trained.")
        for callback, (_, state) in zip(callbacks, self.states, strict=True):
            callback.load_state_dict(state)


def restore_template(path: str) -> dict[str, Item | JsonItem]:
    """The items of a fit's progress that the checkpoint at ``path`` holds, as a template
    to restore them (its arrays' shapes and dtypes from the checkpoint's record); ``{}`` if
    it holds none."""
    stored = stored_items(path)
    if "fit" not in stored:
        return {}
    items: dict[str, Item | JsonItem] = {"fit": JsonItem()}
    leaves = stored.get("fit_arrays", [])
    if leaves:
        items["fit_arrays"] = Item(
            [jax.ShapeDtypeStruct(tuple(leaf["shape"]), np.dtype(leaf["dtype"]))
             for leaf in leaves], [leaf["name"] for leaf in leaves], flax=False)
    return items


def _encode(value: Any, arrays: list[Any]) -> Any:
    """``value`` as JSON, each array replaced by ``{'__array__': index}`` into ``arrays``
    (a typed PRNG key by its key data, with ``'__key__'``: its implementation), a dict with
    keys that are not all strings (``nnx.to_pure_dict``'s list indices) as
    ``{'__items__': [[key, value], ...]}``.

    Example:
        >>> arrays = []
        >>> _encode({'best': 0.5, 'params': {0: np.ones(2)}}, arrays)
        {'best': 0.5, 'params': {'__items__': [[0, {'__array__': 0}]]}}
        >>> _decode(_encode({'w': {0: np.ones(2)}}, arrays := []), arrays)['w'][0].tolist()
        [1.0, 1.0]
    """
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value) and _ARRAY not in value \
                and _ITEMS not in value:
            return {k: _encode(v, arrays) for k, v in value.items()}
        return {_ITEMS: [[_encode(k, arrays), _encode(v, arrays)] for k, v in value.items()]}
    if isinstance(value, list | tuple):
        return [_encode(v, arrays) for v in value]
    if isinstance(value, jax.Array | np.ndarray):
        marker: dict[str, Any] = {_ARRAY: len(arrays)}
        if jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key):
            marker[_KEY] = str(jax.random.key_impl(value))
            value = jax.random.key_data(value)
        arrays.append(jnp.asarray(value))
        return marker
    if isinstance(value, np.generic):
        return value.item()
    if value is None or isinstance(value, bool | int | float | str):
        return value
    raise TypeError(f"A callback's state_dict() holds a {type(value).__name__}: it may hold "
                    "numbers, strings, None, arrays, and lists and dicts of them.")


def _decode(value: Any, arrays: Sequence[Any]) -> Any:
    """What :func:`_encode` encoded, its arrays taken from ``arrays``."""
    if isinstance(value, dict):
        if _ARRAY in value:
            array = arrays[value[_ARRAY]]
            return jax.random.wrap_key_data(array, impl=value[_KEY]) if _KEY in value else array
        if _ITEMS in value:
            return {_decode(k, arrays): _decode(v, arrays) for k, v in value[_ITEMS]}
        return {k: _decode(v, arrays) for k, v in value.items()}
    if isinstance(value, list):
        return [_decode(v, arrays) for v in value]
    return value
