"""e-prop: D-RTRL traces passed through a low-pass filter.

.. math::

    \\bar e^t = \\kappa\\, \\bar e^{t-1} + \\epsilon^t, \\qquad
    \\nabla_\\theta L = \\sum_t \\delta^t \\cdot \\bar e^t

where ``ε^t`` is the D-RTRL eligibility trace. ``κ = 0`` is D-RTRL. The filter
matches e-prop's treatment of a leaky readout (Bellec et al. 2020).
"""

from __future__ import annotations

from typing import NamedTuple

import jax

from braintrace._algorithms._base import AbstractAlgorithm, group_signal
from braintrace._algorithms._d_rtrl import (
    drtrl_contribution,
    drtrl_finalize,
    drtrl_init,
    drtrl_update,
)

__all__ = ["EProp"]


class FilteredTrace(NamedTuple):
    """The D-RTRL trace ``ε`` and its filtered version ``ē``."""

    trace: object
    filtered: object


class EProp(AbstractAlgorithm):
    """e-prop: filtered D-RTRL eligibility traces.

    .. math::

        \\bar e^t = \\kappa \\bar e^{t-1} + \\epsilon^t, \\qquad
        \\nabla_\\theta L = \\sum_t \\delta^t \\cdot \\bar e^t

    Args:
        kappa: The filter decay in ``[0, 1)``; ``0`` gives D-RTRL.

    Example:
        >>> import braintrace
        >>> braintrace.EProp(kappa=0.5).kappa
        0.5
    """

    name = "eprop"

    def __init__(self, kappa: float = 0.0):
        if not 0.0 <= kappa < 1.0:
            raise ValueError(f"EProp: kappa must lie in [0, 1), got {kappa}.")
        self.kappa = float(kappa)

    def init(self, graph, operands):
        traces = [drtrl_init(graph, r, theta) for r, theta in zip(graph.relations, operands)]
        return [FilteredTrace(t, t) for t in traces]

    def update(self, graph, state, jac, rel_x, operands):
        new = []
        for r, s, x, theta in zip(graph.relations, state, rel_x, operands):
            eps = drtrl_update(r, s.trace, jac.d[r.group], jac.df[r.index], x, theta)
            filtered = jax.tree.map(lambda f, e: self.kappa * f + e, s.filtered, eps)
            new.append(FilteredTrace(eps, filtered))
        return new

    def contribution(self, graph, state, delta, operands):
        return [drtrl_contribution(r, s.filtered, group_signal(graph, delta, r.group))
                for r, s in zip(graph.relations, state)]

    def finalize(self, graph, summed, operands):
        return [drtrl_finalize(r, total, theta)
                for r, total, theta in zip(graph.relations, summed, operands)]
