"""OSTL: online spatio-temporal learning (Bohnstingl et al. 2023).

* :class:`OSTLRecurrent`: D-RTRL with the *coupled* hidden Jacobian: instead of
  ignoring operations that mix positions, it keeps the per-position blocks
  ``D[v, s, s'] = ∂h^t[v, s]/∂h^{t-1}[v, s']`` of the full Jacobian (a fixed
  recurrent matrix contributes its diagonal). Costs ``N·S`` JVPs per group and
  step, so it suits small layers.
* :class:`OSTLFeedforward`: ES-D-RTRL with no smoothing (``α = 0``): the
  gradient of each weight uses only the current input and ``Df``.
"""

from __future__ import annotations

from braintrace._algorithms._d_rtrl import D_RTRL
from braintrace._algorithms._es_d_rtrl import ES_D_RTRL

__all__ = ["OSTLFeedforward", "OSTLRecurrent"]


class OSTLRecurrent(D_RTRL):
    """D-RTRL with per-position blocks of the full (coupled) hidden Jacobian.

    Equal to BPTT on position-diagonal models; on models coupled through
    non-ETP operations it keeps their diagonal, unlike :class:`D_RTRL`.

    Example:
        >>> import braintrace
        >>> braintrace.OSTLRecurrent().scope
        'coupled'
    """

    name = "ostl_recurrent"
    scope = "coupled"


class OSTLFeedforward(ES_D_RTRL):
    """ES-D-RTRL with ``α_x = α_f = 0``: same-step factors only.

    Example:
        >>> import braintrace
        >>> braintrace.OSTLFeedforward().f_decay
        0.0
    """

    name = "ostl_feedforward"

    def __init__(self):
        super().__init__(0.0)
