"""OSTL: online spatio-temporal learning (Bohnstingl et al. 2023), as configurations.

* :class:`OSTLRecurrent`: D-RTRL with the *coupled* hidden Jacobian: instead of
  ignoring operations that mix positions, it keeps the per-position blocks
  ``D[v, s, s'] = ∂h^t[v, s]/∂h^{t-1}[v, s']`` of the full Jacobian (a fixed
  recurrent matrix contributes its diagonal). Costs ``N·S`` JVPs per group and
  step, so it suits small layers.
* :class:`OSTLFeedforward`: ES-D-RTRL with no smoothing (``α = 0``): the
  trace of each weight is the previous step's ``Df ⊗ x`` only.
"""

from __future__ import annotations

from braintrace._algorithms._d_rtrl import DRTRL
from braintrace._algorithms._es_d_rtrl import ESDRTRL

__all__ = ["OSTLFeedforward", "OSTLRecurrent"]


class OSTLRecurrent(DRTRL):
    """D-RTRL with per-position blocks of the full (coupled) hidden Jacobian.

    Equal to BPTT on position-diagonal models; on models coupled through
    non-ETP operations it keeps their diagonal, unlike plain :class:`DRTRL`.

    Example:
        >>> import braintrace
        >>> alg = braintrace.OSTLRecurrent()
        >>> alg.name, alg.scope
        ('ostl_recurrent', 'coupled')
    """

    def __init__(self):
        super().__init__(coupled=True)


class OSTLFeedforward(ESDRTRL):
    """ES-D-RTRL with ``α_x = α_f = 0``: one-step factors only.

    Example:
        >>> import braintrace
        >>> alg = braintrace.OSTLFeedforward()
        >>> alg.name, alg.f_decay
        ('ostl_feedforward', 0.0)
    """

    def __init__(self):
        super().__init__(0.0, name="ostl_feedforward")
