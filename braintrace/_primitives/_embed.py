"""The embedding ETP primitive: ``y = embedding[index]``, a table lookup that learns online.

``embedding (V, F)`` as in :class:`flax.nnx.Embed`; the input is an integer
index per sample. Registered as ``etp_embed`` (``x: ()``) and
``etp_embed_batched`` (``x: (B,)``). Out-of-range indices give NaN rows, as
``jnp.take`` (and ``nnx.Embed``) does, and get no gradient.

Rules (per sample, index ``x``, cotangent ``d: (F,)``):

.. math::

    \\mathrm{xy\\_to\\_dw}: \\quad dE = 0\\;\\text{except}\\; dE[x, :] \\mathrel{+}= d
    \\qquad (\\text{a scatter-add, } \\texttt{.at[x].add(d)})

    \\mathrm{dt\\_to\\_t}: \\quad \\epsilon[v, f] \\mapsto \\epsilon[v, f]\\, d[f]

The lookup's Jacobian is sparse (one row of the table per sample and step),
so the pullback is a scatter-add, never a one-hot matmul. The D-RTRL trace is
exact when shaped like the table per sample: ``(V, F, S)``, i.e. memory
``B·V·F·S`` for a batch (every row a sample ever visited keeps decaying in
it). An index cannot be smoothed over time, so the IO-dim algorithms
(ES-D-RTRL, pp_prop, OSTL's feedforward rule) do not apply: ``xy_to_dw``
refuses a non-integer ``x`` with an error that says so.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from braintrace._primitives._register import register_pair
from braintrace._primitives._rules import (
    ETPRules,
    output_axis_contract,
    scale_output_axis,
    zeros_like_params,
)

__all__ = ["EMBED_RULES", "embed_lookup", "etp_embed_batched_p", "etp_embed_p"]


def _embed_impl(x, embedding):
    return jnp.take(embedding, x, axis=0)


def embed_xy_to_dw(x, d, theta, **params) -> dict[str, jax.Array]:
    """Pullback at ``(x, θ)``: ``d`` scatter-added into the rows ``x`` (leading axes summed).

    ``x`` holds integer indices; a non-integer ``x`` (an algorithm probing
    shapes with zeros) is cast to ``int32``.
    """
    del params
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.integer):
        x = x.astype(jnp.int32)
    table = theta["embedding"]
    rows = d.reshape(-1, d.shape[-1]).astype(table.dtype)
    return {"embedding": jnp.zeros_like(table).at[x.reshape(-1)].add(rows, mode="drop")}


EMBED_RULES = ETPRules(
    xy_to_dw=embed_xy_to_dw,
    dt_to_t=scale_output_axis,
    init_drtrl=zeros_like_params,
    contract=output_axis_contract,
)
"""The embedding rules: a table-shaped trace filled by scatter-add, scaled along features.

No ``init_pp``: an index cannot be smoothed over time, so the IO-dim algorithms
refuse the embedding (:class:`braintrace.MissingRuleError` when compiling)."""

etp_embed_p, etp_embed_batched_p = register_pair(
    "etp_embed", _embed_impl, EMBED_RULES, trainable_invars_fn=lambda params: {"embedding": 1})


def embed_lookup(x: ArrayLike, embedding: ArrayLike) -> jax.Array:
    """``embedding[x]`` (``jnp.take`` along the rows) through the embedding ETP primitive.

    Args:
        x: Integer indices of any shape; every element is one sample's lookup.
        embedding: The table ``(V, F)``.

    Returns:
        The rows, ``(*x.shape, F)``.

    Raises:
        ValueError: ``x`` is not integer or ``embedding`` not two-dimensional.

    Example:
        >>> import jax.numpy as jnp
        >>> import braintrace
        >>> table = jnp.arange(6.0).reshape(3, 2)
        >>> braintrace.embed_lookup(jnp.array([2, 0]), table)
        Array([[4., 5.],
               [0., 1.]], dtype=float32)
    """
    x, embedding = jnp.asarray(x), jnp.asarray(embedding)
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise ValueError(f"braintrace.embed_lookup: indices must be integers, got dtype {x.dtype}.")
    if embedding.ndim != 2:
        raise ValueError(f"braintrace.embed_lookup: embedding must be a (V, F) table, got shape "
                         f"{embedding.shape}.")
    if x.ndim == 0:
        return etp_embed_p.bind(x, embedding)
    y = etp_embed_batched_p.bind(x.reshape(-1), embedding)
    return y.reshape(*x.shape, embedding.shape[-1])
