"""What a call reads from an :class:`~braintrace.OnlineLearner` and writes back into it.

A learner binds together its model (Params and hidden states live in it), the
compiled entry of the model's current mode at the learner's batch size, and the
traces that fit that entry. :class:`LearnerBinding` keeps that binding and what
makes a call cheap on the host: the model's view while its graph is unchanged
(``_model_state.ViewCache``), the entry bound to it, whether the traces are
known to fit it, the checks of arguments shaped like an earlier call's
(``_checked_calls``), the resets that worked (``_learner_state.Reset``) and the
deferred finiteness check of the last call (``_deferred``). Its private methods
are how the learner's own calls, an :class:`~braintrace.OnlineTrainer` driving
it and a checkpoint (``_checkpointable``) read and write that state: the view and
entry, the placed leaves and checked traces, the arguments of a gradient
program; traces written back, the state a call that went wrong started from put
back, the learner as checkpoint items. :class:`~braintrace.OnlineLearner` adds
the public face: the calls, with their checks and docstrings.
"""

from __future__ import annotations

from typing import Any

from flax import nnx

from braintrace._drivers._checked_calls import CheckedCalls
from braintrace._drivers._checkpoint import Item
from braintrace._drivers._checkpointable import Checkpointable
from braintrace._drivers._compiled import CompiledModel, Entry
from braintrace._drivers._deferred import DeferredCheck
from braintrace._drivers._grad_call import grad_call, place_learner_inputs
from braintrace._drivers._learner_state import (
    Reset,
    checked_traces,
    checkpoint_items,
    fresh_traces,
    load_state,
    place_model,
    placed_leaves,
    reset_state,
    restored_state,
)
from braintrace._drivers._model_state import Leaves, ModelView, ViewCache
from braintrace._drivers._programs import GradArgs
from braintrace._loops import LoopSpec

__all__ = ["LearnerBinding"]


class LearnerBinding(Checkpointable):
    """A model, the entry of its mode at a batch size, and the traces that fit it (module
    docstring): the state an :class:`~braintrace.OnlineLearner` keeps between calls.

    Args:
        model: The model (placed on ``compiled``'s mesh, if any).
        compiled: The analysis of the model.

    Example:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> import braintrace
        >>> from braintrace import layers
        >>> model = layers.Stateful(layers.GRUCell(2, 3, rngs=nnx.Rngs(0)))
        >>> learner = braintrace.compile(model, 'd_rtrl', jnp.ones((4, 2)), batch_size=4)
        >>> view, entry = learner._view_entry()
        >>> learner._checked_traces(entry) is learner.traces, entry.batch_size
        (True, 4)
    """

    def __init__(self, model: nnx.Module, compiled: CompiledModel):
        self.model = model
        self.compiled = compiled
        self._batch_size = compiled.base_batch_size
        self._views = ViewCache()
        self._bound: tuple[ModelView, int | None, Entry] | None = None
        self._checked = CheckedCalls()
        self._fitting: Entry | None = None  # the entry the traces are known to fit
        self._deferred = DeferredCheck()
        self._resets: tuple[ModelView | None, dict[int | None, Reset | None]] = (None, {})
        place_model(model, self._entry())
        self._traces = fresh_traces(compiled, self._entry(), model)

    def _set_traces(self, traces: Any, entry: Entry) -> None:
        """Sets traces that a program of ``entry`` returned (they fit it: not checked again)."""
        self._traces, self._fitting = traces, entry

    def _entry(self) -> Entry:
        """The entry of the model's current mode at the learner's batch size."""
        return self._view_entry()[1]

    def _view_entry(self) -> tuple[ModelView, Entry]:
        """The model's :class:`ModelView` (walked again only when its graph changed:
        :class:`ViewCache`) and the entry of its mode at the learner's batch size."""
        view = self._views(self.model)
        bound = self._bound
        if bound is None or bound[0] is not view or bound[1] != self._batch_size:
            entry = self.compiled.entry(view.graphdef, self._batch_size)
            bound = self._bound = (view, self._batch_size, entry)
        return view, bound[2]

    def _checked_traces(self, entry: Entry) -> Any:
        """The traces, after checking they fit ``entry`` (a mode may change what is traced;
        traces a program of ``entry`` returned fit it: not checked again)."""
        if self._fitting is not entry:
            checked_traces(self.compiled, entry, self._traces)
            self._fitting = entry
        return self._traces

    def _leaves(self, entry: Entry, view: ModelView) -> Leaves:
        return placed_leaves(view, entry, self._batch_size)

    def _reset(self, target: Any) -> None:
        """Re-initialises hidden states and traces at batch size ``target`` (checked by
        ``reset_state``; a reset that worked for the model's view is repeated without a
        walk of the model). A failure leaves the model and the learner as they were."""
        view = self._views(self.model)
        done = self._resets_of(view).get(target) if target is None or type(target) is int \
            else None  # (2.0 or True: checked again)
        traces = None if done is None else done.repeat(self.compiled, view)
        if traces is None:
            target, traces = reset_state(self.compiled, self.model, self._batch_size, target)
            view = self._views(self.model)
            self._resets_of(view)[target] = Reset.after(
                view, self.compiled.entry(view.graphdef, target))
        self._batch_size, self._traces, self._fitting = target, traces, None

    def _resets_of(self, view: ModelView) -> dict[int | None, Reset | None]:
        """The resets that worked for ``view`` (:class:`Reset`), by batch size (those of an
        earlier view are forgotten)."""
        if self._resets[0] is not view:
            self._resets = (view, {})
        return self._resets[1]

    def _put_back(self, written: Any, hidden: list[Any], other: list[Any], traces: Any) -> None:
        """Puts back the hidden state, other Variables and traces a call started from, if the
        learner still holds the traces it ``written`` (state set since, by ``reset`` or a
        restore, is kept): a call found to have gone wrong leaves them as they were."""
        if self._traces is written:
            self._views(self.model).write_state(hidden, other)
            self._traces, self._fitting = traces, None

    def _grad_call(self, xs: Any, ys: Any, *, mask: Any, chunk_size: Any, block_size: Any,
                   reduction: str, signal_inputs: dict[str, Any],
                   bound: tuple[ModelView, Entry] | None = None
                   ) -> tuple[Entry, LoopSpec, GradArgs]:
        """The entry, the loop and the checked arguments of an ``etrace_grad`` call (the model
        read through ``bound``'s view, at its entry, when given: :meth:`_view_entry`)."""
        view, entry = self._view_entry() if bound is None else bound
        spec, args = grad_call(entry, xs, ys, mask=mask, chunk_size=chunk_size,
                               block_size=block_size, reduction=reduction,
                               signal_inputs=signal_inputs,
                               leaves=lambda: self._leaves(entry, view),
                               traces=lambda: self._checked_traces(entry),
                               checked=self._checked)
        return entry, spec, args

    @staticmethod
    def _place_inputs(entry: Entry, tree: Any) -> Any:
        """Inputs or targets split over the mesh's data axis (:func:`place_learner_inputs`)."""
        return place_learner_inputs(entry, tree)

    def _load_state(self, state: dict[str, Any]) -> None:
        """Loads a learner's ``state()`` into the model and the learner (onto the mesh, if
        any)."""
        self._traces, self._fitting = load_state(self.model, self._entry(), state), None

    # -- the checkpoint protocol (``_checkpointable.py``) ---------------------------------

    def _checkpoint_items(self, optimizer: nnx.Optimizer | None = None) -> dict[str, Item]:
        """Params, hidden and other state, traces (and ``optimizer``'s state), as named items,
        once the last call's check is read (its error raised: ``sync``)."""
        self._deferred.settle()
        return checkpoint_items(self.model, self._entry().graph, self._traces, optimizer)

    def _restore_items(self, path: str, optimizer: nnx.Optimizer | None = None
                       ) -> dict[str, Item]:
        """The items to restore (shaped as :meth:`_checkpoint_items`'s; the last call's check
        stays to be read by the next call)."""
        del path
        return checkpoint_items(self.model, self._entry().graph, self._traces, optimizer)

    def _load_checkpoint(self, restored: dict[str, Any],
                         optimizer: nnx.Optimizer | None = None) -> None:
        """Writes restored items (of :meth:`_checkpoint_items`) into the model and learner."""
        self._load_state(restored_state(restored))
        if optimizer is not None:
            nnx.update(optimizer, restored["optimizer"])
