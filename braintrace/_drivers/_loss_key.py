"""A loss function as the compiled programs key it: by what it computes, not by its name.

``jax.jit`` keys a static function argument by the function object, so a loss
that reads a value from outside (an annealed weight in a global or a closure, an
attribute of a config object, a value read by a function it calls) would be
traced once and its first value kept: the next call with the same function
object would silently return the old loss's gradient. :func:`loss_key` traces
the loss alone on one step's abstract values (about a millisecond for the usual
losses) and keys it by that jaxpr — Python numbers it reads are literals of it,
arrays its constants — so a program is reused exactly when the loss it was
compiled with computes the same thing, and a changed value compiles a new one
(a value that changes at every call is cheaper passed with the targets ``ys``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

if TYPE_CHECKING:
    from braintrace._drivers._compiled import Entry

__all__ = ["LossKey", "loss_key"]


class LossKey:
    """``loss_fn``, equal to another key of the same function whose loss traces to the same
    jaxpr with equal constants; called, it is ``loss_fn``.

    Attributes:
        fn: The loss function.
    """

    def __init__(self, fn: Callable[[Any, Any], jax.Array], jaxpr: str | None,
                 consts: tuple[Any, ...]):
        self.fn = fn
        self._jaxpr = jaxpr
        # host constants as they are now (an array the loss reads may change in place);
        # device arrays are immutable: kept as they are, compared by value where not the same
        self._consts = tuple(c if isinstance(c, jax.Array) else np.array(c) for c in consts)
        self._hash = hash((fn, jaxpr, tuple((np.shape(c), str(np.result_type(c)))
                                            for c in self._consts)))

    def __call__(self, *args: Any, **kwargs: Any) -> jax.Array:
        return self.fn(*args, **kwargs)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, LossKey) and self._hash == other._hash
                and self.fn == other.fn and self._jaxpr == other._jaxpr
                and len(self._consts) == len(other._consts)
                and all(a is b or np.array_equal(np.asarray(a), np.asarray(b))
                        for a, b in zip(self._consts, other._consts)))


def loss_key(loss_fn: Any, entry: Entry, ys: Any, weights: Any) -> Any:
    """``loss_fn`` keyed by its jaxpr at one step's values (module docstring): the model's
    output and ``ys[t]``, one sample's with a per-sample mask (``weights`` ``(T, B)``).

    A loss that does not trace on them keeps the function alone as its key (the
    program's own trace then raises its error); a ``LossKey`` is returned as it is.

    Example:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> import braintrace
        >>> from braintrace import layers
        >>> model = nnx.Sequential(layers.ETPLinear(3, 2, rngs=nnx.Rngs(0)), layers.LIF(2))
        >>> learner = braintrace.compile(model, "d_rtrl", jnp.ones(3))
        >>> entry, ys, w = learner._entry(), jnp.zeros((3, 2)), jnp.ones(3)
        >>> scale = 1.0
        >>> loss = lambda y, t: scale * jnp.mean((y - t) ** 2)
        >>> first = loss_key(loss, entry, ys, w)
        >>> first == loss_key(loss, entry, ys, w)
        True
        >>> scale = 0.5  # the same function object, another loss
        >>> first == loss_key(loss, entry, ys, w)
        False
    """
    if isinstance(loss_fn, LossKey):
        return loss_fn
    graph = entry.graph
    drop = 2 if np.ndim(weights) == 2 else 1  # the time axis, and the batch axis per sample
    outs = graph.layout.split_outputs(graph.jaxpr.outvars).y
    y = jax.tree.unflatten(graph.out_treedef, [
        jax.ShapeDtypeStruct(v.aval.shape[drop - 1:], v.aval.dtype) for v in outs])
    y_t = jax.tree.map(lambda a: jax.ShapeDtypeStruct(
        np.shape(a)[drop:], a.dtype if hasattr(a, "dtype") else np.result_type(a)), ys)
    try:
        # a new function each time: make_jaxpr caches its traces by the function object
        closed = jax.make_jaxpr(lambda y, y_t: loss_fn(y, y_t))(y, y_t)
    except Exception:  # noqa: BLE001 - the program's own trace reports it
        return LossKey(loss_fn, None, ())
    return LossKey(loss_fn, str(closed.jaxpr), tuple(closed.consts))
