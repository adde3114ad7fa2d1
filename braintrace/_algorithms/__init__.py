"""Online learning algorithms on an eligibility-trace graph."""

from __future__ import annotations

from braintrace._algorithms._base import AbstractAlgorithm as AbstractAlgorithm
from braintrace._algorithms._d_rtrl import D_RTRL as D_RTRL
from braintrace._algorithms._dni import DNI as DNI
from braintrace._algorithms._dni import LinearSynthesizer as LinearSynthesizer
from braintrace._algorithms._eprop import EProp as EProp
from braintrace._algorithms._es_d_rtrl import ES_D_RTRL as ES_D_RTRL
from braintrace._algorithms._es_d_rtrl import pp_prop as pp_prop
from braintrace._algorithms._ostl import OSTLFeedforward as OSTLFeedforward
from braintrace._algorithms._ostl import OSTLRecurrent as OSTLRecurrent
from braintrace._algorithms._rtrl import RTRL as RTRL
from braintrace._algorithms._snap import SnAp as SnAp
from braintrace._algorithms._three_factor import ThreeFactor as ThreeFactor
from braintrace._algorithms._uoro import UORO as UORO

ALGORITHMS = {
    "d_rtrl": D_RTRL,
    "es_d_rtrl": ES_D_RTRL,
    "pp_prop": ES_D_RTRL,
    "eprop": EProp,
    "ostl_recurrent": OSTLRecurrent,
    "ostl_feedforward": OSTLFeedforward,
    "rtrl": RTRL,
    "uoro": UORO,
    "snap": SnAp,
    "three_factor": ThreeFactor,
}


def get_algorithm(algorithm: str | AbstractAlgorithm) -> AbstractAlgorithm:
    """An algorithm instance from an instance or a name (``'d_rtrl'``, ``'pp_prop'``, ...)."""
    if isinstance(algorithm, AbstractAlgorithm):
        return algorithm
    if isinstance(algorithm, str) and algorithm.lower() in ALGORITHMS:
        return ALGORITHMS[algorithm.lower()]()
    raise ValueError(
        f"Unknown algorithm {algorithm!r}. Pass an instance such as braintrace.D_RTRL() or "
        f"one of the names {sorted(ALGORITHMS)}.")


__all__ = [
    "ALGORITHMS",
    "DNI",
    "D_RTRL",
    "ES_D_RTRL",
    "RTRL",
    "UORO",
    "AbstractAlgorithm",
    "EProp",
    "LinearSynthesizer",
    "OSTLFeedforward",
    "OSTLRecurrent",
    "SnAp",
    "ThreeFactor",
    "get_algorithm",
    "pp_prop",
]
