r"""The linear recurrent unit (LRU; Orvieto et al., 2023), learning online.

A complex diagonal recurrence driven by a linear map of the input and read
out by a linear map of the state (Orvieto et al., "Resurrecting recurrent
neural networks for long sequences", ICML 2023):

.. math::

    \lambda = \exp(-\exp(\nu_{\log}) + i \exp(\theta_{\log})), \quad
    \gamma = \exp(\gamma_{\log}), \\
    h_t = \lambda \odot h_{t-1} + \gamma \odot (B x_t), \quad
    y_t = \mathrm{Re}(C h_t) + D \odot x_t,

with ``B = B_re + i B_im`` of shape ``(hidden, in)`` and ``C = C_re + i C_im``
of shape ``(out, hidden)``. Every Param is real, and the complex state is
kept as the real pair ``(h_re, h_im)``: per unit, ``λ`` acts as the 2×2
rotation-scaling ``[[Re λ, -Im λ], [Im λ, Re λ]]``, so the compiler groups the
pair as ``S = 2`` states per unit and its Jacobian stays unit-diagonal. (A
complex ``HiddenState`` is not used: the algorithms keep traces in the
Params' real dtype, which would drop their imaginary parts between steps.)

Online learning: ``B_re``/``B_im`` run through the dense ETP primitive and
``ν``, ``θ``, ``γ`` through the elementwise one, so the compiler traces each of
them into ``h``. The recurrence is diagonal and each input reaches ``h``
elementwise, so D-RTRL equals BPTT for every Param of one layer (``C`` and
``D`` are readouts with exact same-step gradients).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx
from flax.typing import Dtype
from jax.typing import ArrayLike

from braintrace._hidden import HiddenState
from braintrace._primitives import element_wise, matmul

from ._cell import AbstractCell
from ._checks import check_step_input

__all__ = ["LRU", "LRUCell"]


def _modulus(nu_log: jax.Array) -> jax.Array:
    """``|λ| = exp(-exp(ν_log))``."""
    return jnp.exp(-jnp.exp(nu_log))


def _check_args(in_features: int, hidden_features: int, out_features: int, r_min: float,
                r_max: float, max_phase: float) -> None:
    for name, value in (("in_features", in_features), ("hidden_features", hidden_features),
                        ("out_features", out_features)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"LRU: {name} must be a positive int, got {value!r}.")
    if not 0.0 <= r_min < r_max <= 1.0:
        raise ValueError(
            f"LRU: the ring of initial eigenvalue moduli needs 0 <= r_min < r_max <= 1, got "
            f"r_min={r_min}, r_max={r_max}; |λ| > 1 would make the recurrence unstable.")
    if not max_phase > 0:
        raise ValueError(f"LRU: max_phase must be positive, got {max_phase}.")


class _LRUParams(nnx.Module):
    """The Params of an LRU layer and its step ``(h, x) -> (h', y)``.

    Init as the paper's reference code: ``λ`` uniform on the ring
    ``r_min <= |λ| <= r_max`` with phase in ``[0, max_phase]``,
    ``γ = sqrt(1 - |λ|²)``, ``B ~ N(0, 1/(2 in))``, ``C ~ N(0, 1/hidden)``,
    ``D ~ N(0, 1)``.
    """

    def __init__(self, in_features: int, hidden_features: int, *, rngs: nnx.Rngs,
                 out_features: int | None = None, r_min: float = 0.0, r_max: float = 1.0,
                 max_phase: float = 2 * math.pi, param_dtype: Dtype = jnp.float32):
        out_features = in_features if out_features is None else out_features
        _check_args(in_features, hidden_features, out_features, r_min, r_max, max_phase)
        self.in_features = in_features
        self.hidden_features = hidden_features
        self.out_features = out_features
        self.param_dtype = param_dtype
        n, shape = hidden_features, (hidden_features,)
        u1 = jax.random.uniform(rngs.params(), shape, param_dtype)
        u2 = jax.random.uniform(rngs.params(), shape, param_dtype)
        nu_log = jnp.log(-0.5 * jnp.log(u1 * (r_max ** 2 - r_min ** 2) + r_min ** 2))
        self.nu_log = nnx.Param(nu_log)
        self.theta_log = nnx.Param(jnp.log(max_phase * u2))
        self.gamma_log = nnx.Param(jnp.log(jnp.sqrt(1.0 - _modulus(nu_log) ** 2)))

        def normal(shape: tuple[int, ...], std: float) -> nnx.Param:
            return nnx.Param(std * jax.random.normal(rngs.params(), shape, param_dtype))

        self.B_re = normal((n, in_features), 1.0 / math.sqrt(2 * in_features))
        self.B_im = normal((n, in_features), 1.0 / math.sqrt(2 * in_features))
        self.C_re = normal((out_features, n), 1.0 / math.sqrt(n))
        self.C_im = normal((out_features, n), 1.0 / math.sqrt(n))
        if out_features == in_features:
            self.D = normal((in_features,), 1.0)
        else:
            self.D = normal((out_features, in_features), 1.0 / math.sqrt(in_features))

    def eigenvalues(self) -> tuple[jax.Array, jax.Array]:
        """``(Re λ, Im λ)`` of ``λ = exp(-exp(ν_log) + i exp(θ_log))``.

        ``|λ|`` and the phase are read through elementwise ETP primitives.
        """
        modulus = element_wise(self.nu_log[...], _modulus)
        phase = element_wise(self.theta_log[...], jnp.exp)
        return modulus * jnp.cos(phase), modulus * jnp.sin(phase)

    def _step(self, h_re: jax.Array, h_im: jax.Array, x: jax.Array
              ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """``h' = λ ⊙ h + γ ⊙ (B x)`` on ``h = h_re + i h_im``, ``y = Re(C h') + D ⊙ x``."""
        x = jnp.asarray(x, self.param_dtype)
        lam_re, lam_im = self.eigenvalues()
        gamma = element_wise(self.gamma_log[...], jnp.exp)
        new_re = lam_re * h_re - lam_im * h_im + gamma * matmul(x, self.B_re[...].T)
        new_im = lam_im * h_re + lam_re * h_im + gamma * matmul(x, self.B_im[...].T)
        y = matmul(new_re, self.C_re[...].T) - matmul(new_im, self.C_im[...].T)
        if self.D[...].ndim == 1:
            y = y + element_wise(self.D[...]) * x
        else:
            y = y + matmul(x, self.D[...].T)
        return new_re.astype(h_re.dtype), new_im.astype(h_im.dtype), y


class LRUCell(_LRUParams, AbstractCell):
    r"""The linear recurrent unit on the Flax cell protocol: ``cell(carry, x) -> (carry, y)``.

    See the module docstring for the equations. The carry is the state
    ``h = h_re + i h_im`` as the real pair ``(h_re, h_im)``, each of shape
    ``(*batch, hidden_features)``.

    Args:
        in_features: Number of input features ``H``.
        hidden_features: Number of complex state units ``N``.
        rngs: Random number generators.
        out_features: Number of outputs (default ``in_features``). ``D`` is the
            paper's elementwise skip ``(in,)`` when it equals ``in_features``,
            else a dense skip ``(out, in)``.
        r_min: Smallest initial eigenvalue modulus.
        r_max: Largest initial eigenvalue modulus.
        max_phase: Largest initial eigenvalue phase.
        param_dtype: Dtype of the Params and the carry.

    Example:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> from braintrace import layers
        >>> cell = layers.LRUCell(3, 8, rngs=nnx.Rngs(0))
        >>> h_re, h_im = cell.initialize_carry((2, 3))
        >>> (h_re, h_im), y = cell((h_re, h_im), jnp.ones((2, 3)))
        >>> h_im.shape, y.shape
        ((2, 8), (2, 3))
        >>> nnx.RNN(cell)(jnp.ones((2, 7, 3))).shape
        (2, 7, 3)
    """

    carry_size = 2

    def _advance(self, carry: tuple[jax.Array, jax.Array], inputs: ArrayLike
                 ) -> tuple[tuple[jax.Array, jax.Array], jax.Array]:
        """One step: returns ``((h_re', h_im'), y)``."""
        h_re, h_im = carry
        new_re, new_im, y = self._step(h_re, h_im, jnp.asarray(inputs))
        return (new_re, new_im), y


class LRU(_LRUParams):
    r"""The linear recurrent unit as a one-step layer keeping its state in hidden states.

    ``layer(x_t)`` advances ``h = h_re + i h_im`` (two
    :class:`~braintrace.HiddenState`\ s ``h_re``, ``h_im``, each
    ``(hidden_features,)`` per sample) and returns ``y_t``; see the module
    docstring for the equations. Use :func:`braintrace.init_states` to batch
    or reset it.

    Args:
        in_features: Number of input features ``H``.
        hidden_features: Number of complex state units ``N``.
        rngs: Random number generators.
        out_features: Number of outputs (default ``in_features``); see :class:`LRUCell`.
        r_min: Smallest initial eigenvalue modulus.
        r_max: Largest initial eigenvalue modulus.
        max_phase: Largest initial eigenvalue phase.
        param_dtype: Dtype of the Params and the state.

    Example:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> import braintrace
        >>> from braintrace import layers
        >>> lru = layers.LRU(3, 8, out_features=2, rngs=nnx.Rngs(0))
        >>> sorted(k for k, _ in nnx.state(lru, nnx.Param).items())
        ['B_im', 'B_re', 'C_im', 'C_re', 'D', 'gamma_log', 'nu_log', 'theta_log']
        >>> braintrace.init_states(lru, batch_size=4)
        >>> lru(jnp.ones((4, 3))).shape, lru.h.shape, lru.h.dtype
        ((4, 2), (4, 8), dtype('complex64'))
    """

    def __init__(self, in_features: int, hidden_features: int, *, rngs: nnx.Rngs,
                 out_features: int | None = None, r_min: float = 0.0, r_max: float = 1.0,
                 max_phase: float = 2 * math.pi, param_dtype: Dtype = jnp.float32):
        super().__init__(in_features, hidden_features, rngs=rngs, out_features=out_features,
                         r_min=r_min, r_max=r_max, max_phase=max_phase, param_dtype=param_dtype)
        self.h_re = HiddenState(jnp.zeros((hidden_features,), param_dtype))
        self.h_im = HiddenState(jnp.zeros((hidden_features,), param_dtype))

    @property
    def h(self) -> jax.Array:
        """The complex state ``h_re + i h_im``."""
        return jax.lax.complex(self.h_re[...], self.h_im[...])

    def __call__(self, x: ArrayLike) -> jax.Array:
        """One step on ``x`` of shape ``(*batch, in_features)``; returns ``y_t``."""
        check_step_input(type(self).__name__, jnp.shape(x), self.h_re, self.in_features, "h_re")
        new_re, new_im, y = self._step(self.h_re[...], self.h_im[...], jnp.asarray(x))
        self.h_re[...] = new_re
        self.h_im[...] = new_im
        return y
