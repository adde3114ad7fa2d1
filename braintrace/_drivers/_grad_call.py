"""The checked arguments of one ``etrace_grad`` call of an :class:`~braintrace.OnlineLearner`.

``learner.etrace_grad``, ``learner.lower_etrace_grad`` and ``learner.grad_args``
run one program on one set of arguments: :func:`grad_call` makes them, each
checked on the host before anything runs — the inputs, targets, mask, chunk
and block sizes and reduction first, then the model's arrays, the algorithm's
own per-step inputs and the traces — and split over the mesh's data axis where
there is one (:func:`place_learner_inputs`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from braintrace._drivers._compiled import Entry
from braintrace._drivers._inputs import check_signal_inputs, loss_weights
from braintrace._drivers._model_state import Leaves
from braintrace._drivers._programs import GradArgs
from braintrace._drivers._sharding import place, place_inputs
from braintrace._loops import LoopSpec, check_positive, choose_loop

__all__ = ["grad_call", "place_learner_inputs"]


def grad_call(entry: Entry, xs: Any, ys: Any, *, mask: Any, chunk_size: Any, block_size: Any,
              reduction: str, signal_inputs: dict[str, Any], leaves: Callable[[], Leaves],
              traces: Callable[[], Any]) -> tuple[LoopSpec, GradArgs]:
    """The loop and the checked arguments of an ``etrace_grad`` call at ``entry``.

    Args:
        entry: What was compiled for the model's mode and the learner's batch size.
        xs, ys, mask, chunk_size, block_size, reduction, signal_inputs: As
            ``learner.etrace_grad`` takes them.
        leaves: Reads the model's arrays, checked and on the mesh (called after the
            inputs are checked, so an input error comes first).
        traces: Reads the learner's traces, checked against ``entry`` (called last).

    Raises:
        ValueError: An argument is invalid (see :func:`~braintrace._drivers._inputs.loss_weights`,
            :func:`~braintrace._drivers._inputs.check_signal_inputs`), or what
            ``leaves`` and ``traces`` raise.
    """
    xs, ys = place_learner_inputs(entry, xs), place_learner_inputs(entry, ys)
    weights = loss_weights(xs, ys, entry.example, mask, chunk_size, reduction, entry.batch_size)
    length = len(weights)
    spec = choose_loop(entry.rules, length=length, chunk_size=chunk_size,
                       block_size=None if block_size is None
                       else check_positive("block_size", block_size))
    params, hidden, other = leaves()
    inputs = check_signal_inputs(entry.rules, hidden, signal_inputs, length)
    if inputs is not None:
        inputs = place_learner_inputs(entry, inputs)
    weights = jnp.asarray(weights, jnp.result_type(*params))
    if entry.layout is not None:
        weights = place(weights, entry.layout.replicated)
    return spec, GradArgs(params, hidden, other, traces(), xs, ys, weights, inputs)


def place_learner_inputs(entry: Entry, tree: Any) -> Any:
    """Inputs or targets split over the mesh's data axis (as they are without a mesh).

    ``jax.ShapeDtypeStruct`` leaves (for ``learner.lower_etrace_grad``) stay as they are.
    """
    lay = entry.layout
    if lay is None or any(isinstance(a, jax.ShapeDtypeStruct) for a in jax.tree.leaves(tree)):
        return tree
    return place_inputs(lay, tree)
