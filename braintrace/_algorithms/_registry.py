"""The algorithms by name: what ``braintrace.compile(model, 'd_rtrl', ...)`` accepts."""

from __future__ import annotations

from braintrace._algorithms._base import AbstractAlgorithm
from braintrace._algorithms._bptt import BPTT
from braintrace._algorithms._d_rtrl import DRTRL
from braintrace._algorithms._eprop import EProp
from braintrace._algorithms._es_d_rtrl import ESDRTRL
from braintrace._algorithms._fptt import FPTT
from braintrace._algorithms._ostl import OSTLFeedforward, OSTLRecurrent
from braintrace._algorithms._osttp import OSTTP
from braintrace._algorithms._otpe import OTPE
from braintrace._algorithms._ottt import OTTT
from braintrace._algorithms._rtrl import RTRL
from braintrace._algorithms._sltt import SLTT
from braintrace._algorithms._snap import SnAp
from braintrace._algorithms._three_factor import ThreeFactor
from braintrace._algorithms._uoro import UORO

__all__ = ["ALGORITHMS", "get_algorithm"]

ALGORITHMS = {
    "bptt": BPTT,
    "d_rtrl": DRTRL,
    "es_d_rtrl": ESDRTRL,
    "pp_prop": ESDRTRL,
    "eprop": EProp,
    "fptt": FPTT,
    "ostl_recurrent": OSTLRecurrent,
    "ostl_feedforward": OSTLFeedforward,
    "osttp": OSTTP,
    "ottt": OTTT,
    "otpe": OTPE,
    "sltt": SLTT,
    "rtrl": RTRL,
    "uoro": UORO,
    "snap": SnAp,
    "three_factor": ThreeFactor,
}
"""Every algorithm name and the constructor it stands for (called without arguments)."""


def get_algorithm(algorithm: str | AbstractAlgorithm) -> AbstractAlgorithm:
    """An algorithm instance from an instance or a name (``'d_rtrl'``, ``'pp_prop'``, ...).

    Raises:
        ValueError: ``algorithm`` is neither an instance nor a known name.

    Example:
        >>> from braintrace._algorithms import get_algorithm
        >>> get_algorithm('es_d_rtrl').name
        'es_d_rtrl'
    """
    if isinstance(algorithm, AbstractAlgorithm):
        return algorithm
    if isinstance(algorithm, str) and algorithm.lower() in ALGORITHMS:
        return ALGORITHMS[algorithm.lower()]()
    raise ValueError(
        f"Unknown algorithm {algorithm!r}. Pass an instance such as braintrace.DRTRL() or "
        f"one of the names {sorted(ALGORITHMS)}.")
