"""Param construction shared by the drop-in layers."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from flax import nnx
from flax.typing import Dtype, Initializer

__all__ = ["bias_param"]


def bias_param(bias_init: Initializer, rngs: nnx.Rngs, shape: tuple[int, ...] | None,
               param_dtype: Dtype, metadata: Mapping[str, Any]) -> Any:
    """The bias Param of ``shape`` as Flax's layers make it, or ``nnx.data(None)`` without one.

    Draws from ``rngs.params()`` only when there is a bias, as Flax does, so
    the Params equal Flax's under the same ``rngs``.

    Example:
        >>> from flax import nnx
        >>> from flax.nnx.nn.linear import default_bias_init
        >>> bias_param(default_bias_init, nnx.Rngs(0), (3,), 'float32', {}).shape
        (3,)
        >>> isinstance(bias_param(default_bias_init, nnx.Rngs(0), None, 'float32', {}), nnx.Param)
        False
    """
    if shape is None:
        return nnx.data(None)
    return nnx.Param(bias_init(rngs.params(), shape, param_dtype), **metadata)
