"""Hidden state: the recurrent state that eligibility traces follow through time."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.typing import ArrayLike

__all__ = ["HiddenState", "state_batch_size"]


class _FrozenArray:
    """A hashable, content-compared host copy of a per-sample initial value.

    Variable metadata ends up in a graph definition, which must be hashable;
    a non-uniform initial value is stored in this form.
    """

    __slots__ = ("array",)

    def __init__(self, array: np.ndarray):
        self.array = np.array(array, copy=True)
        self.array.setflags(write=False)

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, _FrozenArray) and self.array.dtype == other.array.dtype
                and self.array.shape == other.array.shape
                and bool(np.array_equal(self.array, other.array)))

    def __hash__(self) -> int:
        return hash((self.array.shape, str(self.array.dtype), self.array.tobytes()))

    def __repr__(self) -> str:
        return f"_FrozenArray(shape={self.array.shape}, dtype={self.array.dtype})"


def _freeze_init(value: Any) -> float | _FrozenArray:
    """The hashable per-sample initial value of a state built from ``value``.

    A uniform value is stored as a Python scalar, any other concrete value as a
    frozen host copy; an abstract value (built under a JAX transform) gives 0.
    """
    if isinstance(value, _FrozenArray):
        return value
    try:
        array = np.asarray(value)
    except jax.errors.TracerArrayConversionError:
        return 0.0
    flat = array.reshape(-1)
    if flat.size == 0 or bool(np.all(flat == flat[0])):
        return flat[0].item() if flat.size else 0.0
    return _FrozenArray(array)


class HiddenState(nnx.Variable):
    """A recurrent state variable of a model step (membrane potential, RNN carry).

    A subclass of :class:`flax.nnx.Variable` but not of :class:`flax.nnx.Param`,
    so optimisers created with ``wrt=nnx.Param`` skip it. A model step reads its
    hidden states at ``t-1`` and writes them at ``t``; the compiler finds them
    by type.

    Build a state *per sample* (no batch axis, e.g. ``(n,)``);
    :func:`braintrace.init_states` later re-initialises it for a batch
    (``(batch_size, n)``). The construction value is remembered as the
    per-sample initial value (metadata ``init``; pass ``init=`` to override
    it, e.g. when building under a JAX transform), and its shape as
    ``sample_shape``.

    Args:
        value: The per-sample initial value.
        init: The per-sample initial value used when re-initialising: a scalar
            fill value or an array of ``value``'s shape. Defaults to ``value``.
        **metadata: Further :class:`flax.nnx.Variable` metadata.

    Example:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> import braintrace
        >>> class Leaky(nnx.Module):
        ...     def __init__(self):
        ...         self.h = braintrace.HiddenState(jnp.zeros(3))
        ...     def __call__(self, x):
        ...         self.h[...] = 0.9 * self.h[...] + x
        ...         return self.h[...]
        >>> model = Leaky()
        >>> model(jnp.ones(3))
        Array([1., 1., 1.], dtype=float32)
        >>> len(nnx.state(model, nnx.Param))
        0
        >>> model.h.initial_value(batch_size=2)
        Array([[0., 0., 0.],
               [0., 0., 0.]], dtype=float32)
    """

    def __init__(self, value: ArrayLike, *, init: ArrayLike | None = None, **metadata: Any):
        metadata.setdefault("sample_shape", tuple(jnp.shape(value)))
        metadata["init"] = _freeze_init(value if init is None else init)
        super().__init__(value, **metadata)

    def initial_value(self, batch_size: int | None = None) -> jax.Array:
        """The initial value, per sample or for a batch of ``batch_size`` samples.

        Args:
            batch_size: Number of samples; ``None`` gives the per-sample shape.

        Returns:
            An array of shape ``sample_shape`` or ``(batch_size, *sample_shape)``
            in the state's current dtype (never weakly typed).
        """
        sample_shape = tuple(self.get_metadata("sample_shape"))
        shape = sample_shape if batch_size is None else (int(batch_size), *sample_shape)
        dtype = jnp.result_type(self.get_value())
        init = self.get_metadata("init")
        fill = init.array if isinstance(init, _FrozenArray) else init
        return jnp.broadcast_to(jnp.asarray(fill, dtype=dtype), shape)


def state_batch_size(model: nnx.Module) -> int | None:
    """The batch size of the model's hidden states (``None`` for per-sample states)."""
    for _, node in nnx.iter_graph(model):
        if isinstance(node, HiddenState):
            sample_shape = tuple(node.get_metadata("sample_shape", node.shape))
            return node.shape[0] if len(node.shape) > len(sample_shape) else None
    return None
