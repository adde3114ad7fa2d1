"""The checked arguments of one ``etrace_grad`` call of an :class:`~braintrace.OnlineLearner`.

``learner.etrace_grad``, ``learner.lower_etrace_grad`` and ``learner.grad_args``
run one program on one set of arguments: :func:`grad_call` makes them, each
checked on the host before anything runs — the inputs, targets, mask, chunk
and block sizes and reduction first, then the model's arrays, the algorithm's
own per-step inputs and the traces — and split over the mesh's data axis where
there is one (:func:`place_learner_inputs`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import SingleDeviceSharding

from braintrace._drivers._checked_calls import CheckedCalls, call_signature, signature_of
from braintrace._drivers._compiled import Entry
from braintrace._drivers._inputs import check_signal_inputs, loss_weights
from braintrace._drivers._model_state import Leaves
from braintrace._drivers._programs import GradArgs
from braintrace._drivers._sharding import gathered, place, place_inputs
from braintrace._loops import LoopSpec, check_positive, choose_loop

__all__ = ["device_weights", "grad_call", "place_learner_inputs"]


def grad_call(entry: Entry, xs: Any, ys: Any, *, mask: Any, chunk_size: Any, block_size: Any,
              reduction: str, signal_inputs: dict[str, Any], leaves: Callable[[], Leaves],
              traces: Callable[[], Any], checked: CheckedCalls) -> tuple[LoopSpec, GradArgs]:
    """The loop and the checked arguments of an ``etrace_grad`` call at ``entry``.

    Args:
        entry: What was compiled for the model's mode and the learner's batch size.
        xs, ys, mask, chunk_size, block_size, reduction, signal_inputs: As
            ``learner.etrace_grad`` takes them.
        leaves: Reads the model's arrays, checked and on the mesh (called after the
            inputs are checked, so an input error comes first).
        traces: Reads the learner's traces, checked against ``entry`` (called last).
        checked: Where the checks of ``xs``, ``ys``, the sizes and the reduction (and the
            loop and the device weights they give) are remembered, for calls without a
            mask (``_checked_calls``).

    Raises:
        ValueError: An argument is invalid (see :func:`~braintrace._drivers._inputs.loss_weights`,
            :func:`~braintrace._drivers._inputs.check_signal_inputs`), or what
            ``leaves`` and ``traces`` raise.
    """
    xs, ys, signature = _placed(entry, xs, ys, None if mask is not None
                                else (chunk_size, block_size, reduction))

    def checks() -> tuple[LoopSpec, jax.Array, int]:
        weights = loss_weights(xs, ys, entry.example, mask, chunk_size, reduction,
                               entry.batch_size)
        return loop(len(weights)), device_weights(weights, entry.param_dtype, entry.layout,
                                                  reuse=mask is None), len(weights)

    def loop(length: int) -> LoopSpec:  # remembered apart: a mask's checks run every call
        return checked.check(entry, call_signature(statics=("loop", length, chunk_size,
                                                            block_size)),
                             lambda: choose_loop(entry.rules, length=length,
                                                 chunk_size=chunk_size,
                                                 block_size=None if block_size is None
                                                 else check_positive("block_size", block_size)))

    spec, weights, length = checked.check(entry, signature, checks)
    params, hidden, other = leaves()
    inputs = check_signal_inputs(entry.rules, hidden, signal_inputs, length)
    if inputs is not None:
        inputs = place_learner_inputs(entry, inputs)
    return spec, GradArgs(params, hidden, other, traces(), xs, ys, weights, inputs)


def _placed(entry: Entry, xs: Any, ys: Any, statics: tuple[Any, ...] | None
            ) -> tuple[Any, Any, tuple[Any, ...] | None]:
    """``xs`` and ``ys`` placed (:func:`place_learner_inputs`) and their
    :func:`~braintrace._drivers._checked_calls.call_signature` with ``statics`` (``None``
    without them), from one flattening where they need no placing (the usual case)."""
    leaves, treedef = jax.tree.flatten((xs, ys))
    if entry.layout is not None or not all(map(_on_one_device, leaves)):
        xs, ys = place_learner_inputs(entry, xs), place_learner_inputs(entry, ys)
        leaves, treedef = jax.tree.flatten((xs, ys))
    return xs, ys, None if statics is None else signature_of(leaves, treedef, statics)


def device_weights(weights: np.ndarray, dtype: Any, lay: Any, *, reuse: bool) -> jax.Array:
    """The host loss weights in ``dtype`` on the device (replicated on the layout's mesh).

    Converted on the host and copied once (converting on the device is a
    program of its own: a round trip per call on an accelerator). With
    ``reuse`` (no mask: the weights depend only on ``T`` and the reduction)
    one array per value is kept and handed out again.

    Example:
        >>> a = device_weights(np.full(3, 1 / 3), np.float32, None, reuse=True)
        >>> a.dtype, a is device_weights(np.full(3, 1 / 3), np.float32, None, reuse=True)
        (dtype('float32'), True)
    """
    sharding = None if lay is None else lay.replicated
    if reuse:
        weights = np.asarray(weights, np.float64)
        return _kept_weights(weights.tobytes(), weights.shape, np.dtype(dtype), sharding)
    return _put(np.asarray(weights, dtype), sharding)


@functools.lru_cache(maxsize=16)
def _kept_weights(data: bytes, shape: tuple[int, ...], dtype: np.dtype, sharding: Any) -> jax.Array:
    return _put(np.frombuffer(data, np.float64).reshape(shape).astype(dtype), sharding)


def _put(host: np.ndarray, sharding: Any) -> jax.Array:
    return jax.device_put(host) if sharding is None else place(host, sharding)


def place_learner_inputs(entry: Entry, tree: Any) -> Any:
    """Inputs or targets split over the mesh's data axis; without a mesh, gathered whole
    where they are split over a mesh's explicit axes (:func:`gathered`).

    ``jax.ShapeDtypeStruct`` leaves (for ``learner.lower_etrace_grad``) stay as they are.
    """
    lay = entry.layout
    leaves = jax.tree.leaves(tree)
    if lay is None and all(map(_on_one_device, leaves)):
        return tree  # each on one device: nothing to gather (the usual case, checked quickly)
    if any(isinstance(a, jax.ShapeDtypeStruct) for a in leaves):
        return tree
    return gathered("inputs", tree) if lay is None else place_inputs(lay, tree)


def _on_one_device(a: Any) -> bool:
    """Whether ``a`` is a concrete array on one device (nothing to place or gather)."""
    return (isinstance(a, jax.Array) and not isinstance(a, jax.core.Tracer)
            and type(a.sharding) is SingleDeviceSharding)
