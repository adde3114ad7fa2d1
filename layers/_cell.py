"""``AbstractCell``: what every recurrent cell of ``braintrace.layers`` shares.

A cell follows the Flax cell protocol (``cell(carry, x) -> (carry, y)``,
``initialize_carry``, ``num_feature_axes``). The base class holds the carry
construction, the one feature axis and the check that a step's input fits its
carry; a final cell only says how many carry arrays it has (``carry_size``)
and implements one step (``_advance``).
"""

from __future__ import annotations

import abc
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import initializers
from flax.typing import Dtype, Initializer

__all__ = ["AbstractCell"]

Carry = Any


class AbstractCell(nnx.RNNCellBase):
    """A recurrent cell whose carry is ``carry_size`` arrays of shape ``(*batch, hidden_features)``.

    Subclasses set ``in_features``, ``hidden_features`` and ``param_dtype`` in
    their constructor, the class variable ``carry_size`` (1: the carry is one
    array; 2: a pair such as ``(c, h)``) and implement :meth:`_advance`.
    ``rngs`` and ``carry_init`` are the defaults of :meth:`initialize_carry`
    (Flax's deprecated constructor options, kept only by
    :class:`OptimizedLSTMCell`; ``None`` elsewhere).

    Example:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> from braintrace import layers
        >>> from braintrace.layers._cell import AbstractCell
        >>> cell = layers.MinGRUCell(3, 5, rngs=nnx.Rngs(0))
        >>> isinstance(cell, AbstractCell), cell.carry_size, cell.num_feature_axes
        (True, 1, 1)
        >>> cell(cell.initialize_carry((2, 3)), jnp.ones((4, 3)))
        Traceback (most recent call last):
        ValueError: MinGRUCell: input of shape (4, 3) does not fit the carry of shape (2, 5); ...
    """

    carry_size: ClassVar[int]
    in_features: int
    hidden_features: int
    param_dtype: Dtype
    rngs: nnx.RngStream | None = None
    carry_init: Initializer | None = None

    @abc.abstractmethod
    def _advance(self, carry: Carry, inputs: jax.Array) -> tuple[Carry, jax.Array]:
        """One step on an input already checked against the carry: ``(carry', y)``."""

    def __call__(self, carry: Carry, inputs: jax.Array) -> tuple[Carry, jax.Array]:  # type: ignore[override]
        """One step: returns ``(carry', y)``.

        Args:
            carry: The carry from :meth:`initialize_carry` or the previous step.
            inputs: The input, ``(*batch, in_features)`` for a carry of batch shape ``batch``.

        Returns:
            The new carry and the output.
        """
        self._check_step(carry, inputs)
        return self._advance(carry, inputs)

    def _check_step(self, carry: Carry, inputs: jax.Array) -> None:
        """Raises if ``inputs`` is not ``(*batch, in_features)`` for the carry's ``batch``."""
        first = jax.tree.leaves(carry)[0]
        expected = (*first.shape[:-1], self.in_features)
        if tuple(jnp.shape(inputs)) != expected:
            raise ValueError(
                f"{type(self).__name__}: input of shape {tuple(jnp.shape(inputs))} does not fit "
                f"the carry of shape {tuple(first.shape)}; expected input shape {expected}. "
                f"Build the carry with initialize_carry(input_shape) for the input's batch shape.")

    def initialize_carry(self, input_shape: tuple[int, ...], rngs: Any = None,
                         carry_init: Initializer | None = None) -> Carry:  # type: ignore[override]
        """The initial carry for inputs of shape ``input_shape``.

        Each of the ``carry_size`` arrays has shape ``(*input_shape[:-1],
        hidden_features)`` and dtype ``param_dtype``. With a random stream
        (``rngs``, or the one the cell keeps) the arrays are drawn from it in
        order with ``carry_init`` (else the cell's, else zeros), as Flax draws
        them; without one they are zeros, and a ``carry_init`` is an error.

        Args:
            input_shape: The shape of one step's input.
            rngs: An ``nnx.Rngs`` (its ``carry`` stream is used) or an ``nnx.RngStream``.
            carry_init: Initializer of the carry arrays.

        Returns:
            One array when ``carry_size`` is 1, else a tuple of ``carry_size`` arrays.
        """
        shape = (*tuple(input_shape)[:-1], self.hidden_features)
        stream = self.rngs if rngs is None else rngs
        stream = stream.carry if isinstance(stream, nnx.Rngs) else stream
        init = self.carry_init if carry_init is None else carry_init
        if stream is None:
            if init is not None:
                raise ValueError(f"{type(self).__name__}.initialize_carry: a carry_init needs "
                                 f"rngs; pass rngs=nnx.Rngs(...).")
            arrays = tuple(jnp.zeros(shape, self.param_dtype) for _ in range(self.carry_size))
        else:
            init = initializers.zeros_init() if init is None else init
            arrays = tuple(init(stream(), shape, self.param_dtype)
                           for _ in range(self.carry_size))
        return arrays[0] if self.carry_size == 1 else arrays

    @property
    def num_feature_axes(self) -> int:
        """The number of feature axes of an input (one)."""
        return 1
