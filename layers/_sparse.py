"""``ETPSparseLinear``: a linear layer over a fixed sparse connectivity, one Param per synapse."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.nnx.nn.linear import default_bias_init
from flax.typing import Dtype, Initializer
from jax.typing import ArrayLike

from braintrace._primitives import Connectivity, sparse_matmul

from ._checks import check_features
from ._params import bias_param

__all__ = ["ETPSparseLinear"]


def _connectivity(connectivity: Any, in_features: int, out_features: int) -> Connectivity:
    """A :class:`Connectivity` from a boolean mask ``(in, out)`` or a ``(pre, post)`` pair."""
    if isinstance(connectivity, Connectivity):
        conn = connectivity
    elif isinstance(connectivity, tuple) and len(connectivity) == 2:
        conn = Connectivity.from_indices(*connectivity, in_features, out_features)
    else:
        mask = np.asarray(connectivity)
        if mask.shape != (in_features, out_features) or mask.dtype != np.bool_:
            raise ValueError(
                f"ETPSparseLinear: connectivity must be a boolean mask of shape "
                f"({in_features}, {out_features}) or a (pre, post) pair of index arrays, got "
                f"{type(connectivity).__name__} of shape {mask.shape} and dtype {mask.dtype}.")
        conn = Connectivity.from_mask(mask)
    if (conn.num_in, conn.num_out) != (in_features, out_features):
        raise ValueError(f"ETPSparseLinear: {conn} does not connect {in_features} inputs to "
                         f"{out_features} outputs.")
    return conn


def default_sparse_weight_init(key: jax.Array, shape: tuple[int, ...], dtype: Dtype,
                               fan_in: float) -> jax.Array:
    """LeCun normal over the actual fan-in: ``N(0, 1/mean_fan_in)``."""
    return jax.random.normal(key, shape, dtype) / jnp.sqrt(jnp.asarray(max(fan_in, 1.0), dtype))


class ETPSparseLinear(nnx.Module):
    """``y[post] += w · x[pre]`` over a fixed connectivity, learning online.

    Only the connected weights are Params: ``weight (nnz,)``, in the order of
    the connectivity (row-major for a mask), and ``bias (out,)``. The map is a
    sum of gathers over the connections grouped by output (no scatter, also in
    its gradients; on a TPU, float32 sums run as Pallas kernels that read the
    rows from the core's memory); the D-RTRL trace is ``(B, nnz, S)``, so its
    memory and cost scale with the number of connections, not ``in·out``.
    With ``max_events`` set, boolean inputs (spikes) take an event-driven path
    that reads only the rows of active inputs, at most ``max_events`` per
    sample (a sample with more gets NaN outputs, never a silent cut): work
    ``max_events × fan_out`` per sample instead of ``nnz``, the same outputs
    and gradients as the same input given as floats.

    Args:
        in_features: Number of inputs.
        out_features: Number of outputs.
        connectivity: A boolean mask ``(in, out)``, a ``(pre, post)`` pair of
            index arrays, or a :class:`braintrace.Connectivity`.
        use_bias: Whether to add a bias.
        max_events: Bound on the active inputs per sample that turns on the
            event-driven path for boolean inputs; ``None``: off.
        param_dtype: Dtype of the parameters.
        weight_init: ``weight_init(key, (nnz,), dtype)``; default LeCun normal
            over the mean fan-in ``nnz / out``.
        bias_init: Initializer of the bias.
        rngs: Random number generators.
        weight_metadata: Metadata of the weight Param.
        bias_metadata: Metadata of the bias Param.

    Example:
        >>> import numpy as np, jax.numpy as jnp
        >>> from flax import nnx
        >>> from braintrace import layers
        >>> mask = np.eye(4, 3, dtype=bool)
        >>> layer = layers.ETPSparseLinear(4, 3, connectivity=mask, rngs=nnx.Rngs(0))
        >>> layer.weight.shape, layer.bias.shape
        ((3,), (3,))
        >>> layer(jnp.ones((2, 4))).shape
        (2, 3)
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        connectivity: Any,
        use_bias: bool = True,
        max_events: int | None = None,
        param_dtype: Dtype = jnp.float32,
        weight_init: Initializer | None = None,
        bias_init: Initializer = default_bias_init,
        rngs: nnx.Rngs,
        weight_metadata: Mapping[str, Any] = MappingProxyType({}),
        bias_metadata: Mapping[str, Any] = MappingProxyType({}),
    ):
        self.connectivity = _connectivity(connectivity, in_features, out_features)
        nnz = self.connectivity.nnz
        key = rngs.params()
        weight = (default_sparse_weight_init(key, (nnz,), param_dtype, nnz / out_features)
                  if weight_init is None else weight_init(key, (nnz,), param_dtype))
        self.weight = nnx.Param(weight, **weight_metadata)
        self.bias: nnx.Param[jax.Array] | None
        self.bias = bias_param(bias_init, rngs, (out_features,) if use_bias else None,
                               param_dtype, bias_metadata)
        self.in_features = in_features
        self.out_features = out_features
        self.max_events = max_events

    def __call__(self, inputs: ArrayLike) -> jax.Array:
        """Applies the map to ``inputs (..., in_features)``; returns ``(..., out_features)``."""
        check_features(type(self).__name__, jnp.shape(inputs), self.in_features)
        bias = self.bias[...] if self.bias is not None else None
        return sparse_matmul(inputs, self.weight[...], self.connectivity, bias,
                             max_events=self.max_events)
