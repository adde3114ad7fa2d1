"""``ETPEmbed``: :class:`flax.nnx.Embed` whose lookup is the embedding ETP primitive."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import dtypes
from flax.nnx.nn.linear import default_embed_init
from flax.typing import Dtype, Initializer
from jax.typing import ArrayLike

from braintrace._primitives import embed_lookup

__all__ = ["ETPEmbed"]


class ETPEmbed(nnx.Module):
    """An embedding table, ``y = embedding[inputs]``, that learns online.

    A drop-in replacement for :class:`flax.nnx.Embed`: the same constructor,
    the same Param (``embedding (num_embeddings, features)``, initialised
    identically under the same ``rngs``) and the same outputs, but the lookup
    runs through :func:`braintrace.embed_lookup`, so the eligibility-trace
    compiler recognises it. Every element of ``inputs`` is one sample's index.

    Its D-RTRL trace is shaped like the table per sample: memory
    ``B·V·F·S`` (batch, vocabulary, features, states of the hidden group it
    feeds), exact for an embedding feeding a diagonal (e.g. leaky) state.
    IO-dim algorithms (ES-D-RTRL, pp_prop) do not apply to an index input.
    :meth:`attend` is plain JAX (``query @ embeddingᵀ``): a table reused as an
    output layer is not traced online, it gets its exact same-step gradient.

    Args:
        num_embeddings: Number of rows ``V``.
        features: Number of features ``F`` per row.
        dtype: Dtype of the output (default: the embedding's).
        param_dtype: Dtype of the table.
        embedding_init: Initializer of the table (Flax's default).
        promote_dtype: Dtype promotion function, as in Flax.
        rngs: Random number generators.
        embedding_metadata: Metadata of the Param.

    Example:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> from braintrace import layers
        >>> embed = layers.ETPEmbed(10, 4, rngs=nnx.Rngs(0))
        >>> embed.embedding.shape
        (10, 4)
        >>> embed(jnp.array([[1, 2, 3]])).shape
        (1, 3, 4)
    """

    def __init__(
        self,
        num_embeddings: int,
        features: int,
        *,
        dtype: Dtype | None = None,
        param_dtype: Dtype = jnp.float32,
        embedding_init: Initializer = default_embed_init,
        promote_dtype: Any = dtypes.promote_dtype,
        rngs: nnx.Rngs,
        embedding_metadata: Mapping[str, Any] = MappingProxyType({}),
    ):
        self.embedding = nnx.Param(
            embedding_init(rngs.params(), (num_embeddings, features), param_dtype),
            **embedding_metadata)
        self.num_embeddings = num_embeddings
        self.features = features
        self.dtype = dtype or self.embedding.dtype
        self.param_dtype = param_dtype
        self.promote_dtype = promote_dtype

    def __call__(self, inputs: ArrayLike) -> jax.Array:
        """Looks up ``inputs`` (integers of any shape): the output is ``(*inputs.shape, F)``.

        Raises:
            ValueError: ``inputs`` is not integer.
        """
        inputs = jnp.asarray(inputs)
        if not jnp.issubdtype(inputs.dtype, jnp.integer):
            raise ValueError(f"ETPEmbed: inputs must be integer indices, got dtype "
                             f"{inputs.dtype}.")
        (embedding,) = self.promote_dtype((self.embedding[...],), dtype=self.dtype,
                                          inexact=False)
        return embed_lookup(inputs, embedding)

    def attend(self, query: ArrayLike) -> jax.Array:
        """``query @ embeddingᵀ`` in plain JAX (not traced online), as :meth:`nnx.Embed.attend`."""
        query, embedding = self.promote_dtype((query, self.embedding[...]), dtype=self.dtype)
        return jnp.dot(query, embedding.T)
