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

__all__ = ["ALGORITHMS", "algorithm_name", "get_algorithm"]

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


def _normalised(name: str) -> str:
    """``name`` without case, hyphens, underscores and spaces: ``'ES-D-RTRL'`` -> ``'esdrtrl'``."""
    return "".join(c for c in name.lower() if c not in "-_ ")


_BY_SPELLING = {_normalised(name): name for name in ALGORITHMS}
"""Every name of :data:`ALGORITHMS` by its :func:`_normalised` spelling, which also matches
the documented spellings (``'ES-D-RTRL'``, ``'D-RTRL'``, ``'e-prop'``, ``'BPTT'``) and the
class names (``'ESDRTRL'``, ``'OSTLRecurrent'``, ``'ThreeFactor'``)."""


def algorithm_name(name: str) -> str | None:
    """The key of :data:`ALGORITHMS` that ``name`` spells (``None``: none).

    Case, hyphens, underscores and spaces do not matter, so the documented
    spellings and the class names are all accepted.

    Example:
        >>> from braintrace._algorithms import algorithm_name
        >>> [algorithm_name(n) for n in ('ES-D-RTRL', 'es_d_rtrl', 'D-RTRL', 'BPTT', 'e-prop')]
        ['es_d_rtrl', 'es_d_rtrl', 'd_rtrl', 'bptt', 'eprop']
        >>> algorithm_name('ThreeFactor'), algorithm_name('bppt')
        ('three_factor', None)
    """
    return _BY_SPELLING.get(_normalised(name))


def get_algorithm(algorithm: str | AbstractAlgorithm) -> AbstractAlgorithm:
    """An algorithm instance from an instance or a name (``'d_rtrl'``, ``'ES-D-RTRL'``, ...).

    A name is any spelling of a key of :data:`ALGORITHMS` (:func:`algorithm_name`:
    case, hyphens, underscores and spaces do not matter).

    Raises:
        ValueError: ``algorithm`` is neither an instance nor a known name.

    Example:
        >>> from braintrace._algorithms import get_algorithm
        >>> get_algorithm('es_d_rtrl').name
        'es_d_rtrl'
        >>> get_algorithm('ES-D-RTRL').name
        'es_d_rtrl'
    """
    if isinstance(algorithm, AbstractAlgorithm):
        return algorithm
    name = algorithm_name(algorithm) if isinstance(algorithm, str) else None
    if name is not None:
        return ALGORITHMS[name]()
    raise ValueError(
        f"Unknown algorithm {algorithm!r}. Pass an instance such as braintrace.DRTRL() or "
        f"one of the names {sorted(ALGORITHMS)} (case, hyphens and underscores do not matter: "
        "'ES-D-RTRL' is 'es_d_rtrl').")
