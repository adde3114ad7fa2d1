"""Trace storage: eligibility traces kept in a narrower dtype than they are computed in.

With a ``trace_dtype`` (``braintrace.compile(..., trace_dtype=jnp.bfloat16)``), every
array of a trace state (a leaf with at least one axis: D-RTRL's ``ε``, ES-D-RTRL's
``ε_x`` and ``ε_f``, e-prop's ``ē``) is stored in it, and each rule reads it widened
to the working dtype, float32 (``trace_dtype`` itself if wider):

.. math::

    \\epsilon^t = \\mathrm{round}\\big(D^t\\, \\mathrm{wide}(\\epsilon^{t-1})
        + Df^t \\otimes x^t\\big)

each update computed in float32 (or wider) from the stored trace, the result rounded
once when stored. Scalars (ES-D-RTRL's ``α_f^t`` and ``Σ_k α_x^k``) keep their
dtype: they cost nothing to store and set the bias correction. Halving the bytes of
the trace halves what D-RTRL's per-step update reads and writes, its bandwidth floor.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from braintrace._arguments import ArgumentTypeError

__all__ = ["check_trace_dtype", "reading_widened", "stored", "widened_from", "widened_traces",
           "working"]

_WIDENED: contextvars.ContextVar[np.dtype | None] = contextvars.ContextVar("widened_traces",
                                                                          default=None)


def check_trace_dtype(trace_dtype: Any) -> np.dtype | None:
    """``trace_dtype`` as a NumPy dtype (``None`` stays ``None``), after checking it is a
    floating-point dtype that JAX keeps (float64 only with ``jax_enable_x64``).

    Raises:
        ArgumentTypeError: It is not a dtype, or not a real floating-point one (an
            integer, bool or complex dtype); a ``TypeError`` that is also a ``ValueError``.
        ValueError: It is float64 while ``jax_enable_x64`` is off (JAX would store
            float32).

    Example:
        >>> import jax.numpy as jnp
        >>> from braintrace._algorithms._trace_storage import check_trace_dtype
        >>> check_trace_dtype(jnp.bfloat16)
        dtype(bfloat16)
        >>> check_trace_dtype(jnp.int8)
        Traceback (most recent call last):
        ...
        braintrace._arguments.ArgumentTypeError: trace_dtype must be a floating-point dtype \
(e.g. jnp.bfloat16 or jnp.float32) or None, got int8.
    """
    if trace_dtype is None:
        return None
    try:
        dtype = jnp.dtype(trace_dtype)
    except TypeError:
        dtype = None
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
        got = dtype if dtype is not None else repr(trace_dtype)
        raise ArgumentTypeError(
            "trace_dtype must be a floating-point dtype (e.g. jnp.bfloat16 or jnp.float32) "
            f"or None, got {got}.")
    if jnp.dtype(jax.dtypes.canonicalize_dtype(dtype)) != dtype:
        raise ValueError(
            f"trace_dtype={dtype} needs jax_enable_x64 (without it JAX stores "
            f"{jax.dtypes.canonicalize_dtype(dtype)}): enable it, or choose float32 or "
            "bfloat16.")
    return dtype


def _is_trace(a: Any) -> bool:
    """Whether a leaf of a trace state is stored in the trace dtype (a floating array with
    an axis)."""
    return jnp.ndim(a) > 0 and jnp.issubdtype(jnp.result_type(a), jnp.floating)


def stored(states: Any, trace_dtype: np.dtype | None) -> Any:
    """``states`` as stored: every trace array rounded to ``trace_dtype`` (``None``: as
    they are).

    Example:
        >>> import jax.numpy as jnp
        >>> from braintrace._algorithms._trace_storage import stored
        >>> state = {"eps": jnp.ones((2,)), "power": jnp.ones(())}
        >>> {k: str(v.dtype) for k, v in stored(state, jnp.dtype(jnp.bfloat16)).items()}
        {'eps': 'bfloat16', 'power': 'float32'}
    """
    if trace_dtype is None:
        return states
    return jax.tree.map(lambda a: a.astype(trace_dtype) if _is_trace(a) else a, states)


def working(states: Any, trace_dtype: np.dtype | None) -> Any:
    """``states`` as the rules read them: every trace array widened to float32
    (``trace_dtype`` itself if wider; ``None``: as they are).

    Example:
        >>> import jax.numpy as jnp
        >>> from braintrace._algorithms._trace_storage import working
        >>> working([jnp.ones((2,), jnp.bfloat16)], jnp.dtype(jnp.bfloat16))[0].dtype
        dtype('float32')
    """
    if trace_dtype is None:
        return states
    wide = trace_dtype if trace_dtype.itemsize > 4 else jnp.dtype(jnp.float32)
    return jax.tree.map(lambda a: a.astype(wide) if _is_trace(a) else a, states)


@contextlib.contextmanager
def reading_widened(trace_dtype: np.dtype | None) -> Iterator[None]:
    """Within the block, :func:`widened_traces` says whether the rules read traces widened
    by :func:`working` from a narrower stored ``trace_dtype`` (a time-blocked update that
    would hand the whole trace to a kernel then hands it the widened copy, which XLA
    materialises, instead of fusing the widening into its own passes).

    Example:
        >>> import jax.numpy as jnp
        >>> from braintrace._algorithms._trace_storage import reading_widened, widened_traces
        >>> with reading_widened(jnp.dtype(jnp.bfloat16)):
        ...     widened_traces()
        True
        >>> widened_traces()
        False
    """
    narrow = trace_dtype is not None and trace_dtype.itemsize < 4
    token = _WIDENED.set(jnp.dtype(trace_dtype) if narrow else None)
    try:
        yield
    finally:
        _WIDENED.reset(token)


def widened_traces() -> bool:
    """Whether the traces being read are widened copies (:func:`reading_widened`)."""
    return _WIDENED.get() is not None


def widened_from() -> np.dtype | None:
    """The dtype the traces being read are stored in, where they are widened copies
    (:func:`reading_widened`); else ``None``.

    Example:
        >>> import jax.numpy as jnp
        >>> from braintrace._algorithms._trace_storage import reading_widened, widened_from
        >>> with reading_widened(jnp.dtype(jnp.bfloat16)):
        ...     str(widened_from())
        'bfloat16'
        >>> widened_from() is None
        True
    """
    return _WIDENED.get()
