"""SnAp-n: sparse n-step approximation of RTRL (Menick et al. 2021).

RTRL's influence ``M_r[n, θ] = dh_n/dθ`` is kept only where the unit ``j`` of
the operation's output that ``θ`` feeds can reach hidden unit ``n`` within
``n_steps`` steps: immediately (``h^t_n`` depends on ``y_j``) and then through
at most ``n_steps − 1`` steps of the recurrent graph (``h^t`` depends on
``h^{t-1}``). The compiler derives both patterns structurally
(``_compiler/_patterns.py``). After every update

.. math::

    M_r \\leftarrow (J M_r + I_r) \\odot P_r, \\qquad
    P_r = \\big((1 + A)^{n-1} \\, \\mathrm{Imm}_r\\big) > 0,

applied to the trace through the primitive's ``dt_to_t`` rule (which scales a
θ-shaped trace along its output axes). ``SnAp(1)`` keeps a parameter's own
units.

Saturation: the influence ``M_r`` is never non-zero outside the closure
``P_r^∞`` of ``Imm_r`` under ``A`` (``M^t = J M^{t-1} + I^t`` only spreads along
``A``). Once ``P_r = P_r^∞`` for every relation the mask changes nothing and
``SnAp(n)`` *is* :class:`~braintrace.RTRL`. :meth:`SnAp.saturation` gives the
smallest such ``n`` of a compiled model; below it ``SnAp(n)`` reports the
dropped influence and ``strict=True`` refuses it. With ``S`` states per unit
the influence moves between a unit's states one step at a time, so ``n``
grows with ``S``: one dense recurrent layer of one state per unit (a GRU,
a recurrent LIF layer) saturates at ``n = 2``, as does an LSTM (``c`` and
``h`` both follow the gates within a step), while a recurrent ALIF layer
(``v``, ``a``) needs ``n = 3``: an input weight reaches ``v_j``, the next step
``v_k`` of every neuron and ``a_j``, the step after ``a_k`` (``v_j → v_k → a_k``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from braintrace._algorithms._approximations import algorithm_approximation
from braintrace._algorithms._base import AbstractAlgorithm
from braintrace._algorithms._relation_rule import RelationRule
from braintrace._algorithms._rtrl import RTRL_ELEMENTWISE, RTRL_INPUT, flat_signal
from braintrace._algorithms._trace_algebra import is_batched
from braintrace._arguments import check_integer
from braintrace._compiler import (
    Approximation,
    ETraceGraph,
    InputRelation,
    Relation,
    reach,
    unit_patterns,
)

__all__ = ["SnAp", "saturation_steps", "snap_rule"]


def saturation_steps(adjacency: np.ndarray, immediate: np.ndarray) -> int:
    """The smallest ``n`` with ``reach(adjacency, immediate, n - 1)`` closed under ``adjacency``.

    Example:
        >>> import numpy as np
        >>> chain = np.array([[1, 0, 0], [1, 1, 0], [0, 1, 1]], bool)  # 0 → 1 → 2
        >>> saturation_steps(chain, np.eye(3, dtype=bool)[:, :1])
        3
    """
    n, pattern = 1, immediate.astype(bool)
    while True:
        grown = reach(adjacency, pattern, 1)
        if np.array_equal(grown, pattern):
            return n
        n, pattern = n + 1, grown


def _masked_input_update(pattern: np.ndarray):
    def update(r: InputRelation, m: dict, jac, df, x, theta) -> dict:
        new = RTRL_INPUT.update(r, m, jac, df, x, theta)
        y_sample = r.y_shape[1:] if r.batched else r.y_shape
        mask = jnp.asarray(pattern.reshape(-1, *y_sample))  # (N, *y)
        scale = jax.vmap(lambda d, t: r.primitive.rule("dt_to_t")(d, t, **r.params))
        per_sample = lambda t: scale(mask.astype(next(iter(t.values())).dtype), t)
        return jax.vmap(per_sample)(new) if r.batched else per_sample(new)
    return update


def _masked_elementwise_update(pattern: np.ndarray):
    def update(r, m: jax.Array, jac, df, x, theta) -> jax.Array:
        new = RTRL_ELEMENTWISE.update(r, m, jac, df, x, theta)
        return new * jnp.asarray(pattern.reshape(pattern.shape[0], *r.y_shape), new.dtype)
    return update


def snap_rule(relation: Relation, pattern: np.ndarray) -> RelationRule:
    """RTRL's rule for ``relation`` with its influence masked by ``pattern`` ``(N, |y|)``."""
    if isinstance(relation, InputRelation):
        return RTRL_INPUT._replace(
            update=_masked_input_update(pattern),
            rules=lambda r: (*RTRL_INPUT.rules(r), "dt_to_t"))
    return RTRL_ELEMENTWISE._replace(update=_masked_elementwise_update(pattern))


class SnAp(AbstractAlgorithm):
    """Sparse n-step approximation of RTRL: influences kept on the n-step reachable units.

    Args:
        n_steps: ``n >= 1``: how many steps of reach a parameter's influence keeps (a
            Python or NumPy integer).

    Raises:
        TypeError: ``n_steps`` is not an integer (a bool or a float is not one).
        ValueError: It is below 1.

    Example:
        >>> import braintrace
        >>> alg = braintrace.SnAp(2)
        >>> alg.name, alg.n_steps, alg.scope
        ('snap', 2, 'full')
    """

    name = "snap"
    scope = "full"

    def __init__(self, n_steps: int = 1):
        self.n_steps = check_integer("SnAp: n_steps", n_steps, minimum=1)

    def relation_rules(self, graph: ETraceGraph) -> tuple[RelationRule, ...]:
        """RTRL's rules, each masked by its relation's ``n_steps``-step reachable pattern."""
        adjacency, immediate = unit_patterns(graph, is_batched(graph))
        return tuple(snap_rule(r, reach(adjacency, imm, self.n_steps - 1))
                     for r, imm in zip(graph.relations, immediate))

    def _saturations(self, graph: ETraceGraph) -> list[int]:
        adjacency, immediate = unit_patterns(graph, is_batched(graph))
        return [saturation_steps(adjacency, imm) for imm in immediate]

    def saturation(self, graph: ETraceGraph) -> int:
        """The smallest ``n`` at which ``SnAp(n)`` equals RTRL on this compiled model.

        Structural (from the unit patterns, never from numbers), so ``SnAp(n)``
        for every ``n`` at or above it keeps all of RTRL's influence.

        Example:
            >>> import jax.numpy as jnp
            >>> from flax import nnx
            >>> import braintrace
            >>> from braintrace import layers
            >>> model = layers.RecurrentSpiking(3, layers.ALIF(4), rngs=nnx.Rngs(0))
            >>> braintrace.init_states(model, 2)
            >>> graph = braintrace.compile_graph(model, jnp.ones((2, 3)), scope="full")
            >>> braintrace.SnAp(1).saturation(graph)  # v_j -> v_k -> a_k
            3
        """
        return max(self._saturations(graph), default=1)

    def approximations(self, graph: ETraceGraph) -> tuple[Approximation, ...]:
        """Below saturation: the relations whose influence spreads beyond ``n_steps``."""
        below = [r for r, n in zip(graph.relations, self._saturations(graph))
                 if n > self.n_steps]
        if not below:
            return ()
        return algorithm_approximation(
            graph, below, kind="sparse-influence", label=f"SnAp({self.n_steps})",
            what=(f"keeps the influence only on the units reachable within {self.n_steps} "
                  "step(s), but on this model it spreads further over time, for"),
            detail=f"the influence is masked to the {self.n_steps}-step reachable units",
            remedy=(f"SnAp({self.saturation(graph)}) keeps all of it and equals RTRL() on "
                    "this model"))

    def relation_signal(self, graph: ETraceGraph, delta, relation: Relation) -> jax.Array:
        """Every hidden unit's signal of one sample, flattened: ``(*B, N)``."""
        return flat_signal(graph, delta)
