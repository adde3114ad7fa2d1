"""Online learning algorithms: rules per relation and hooks, bound to a graph once.

Design note. An algorithm (``AbstractAlgorithm``) is a configuration and a
factory of :class:`~braintrace._algorithms._relation_rule.RelationRule` records (pure
``init``/``update``/``contribution``/``finalize`` and block functions per
relation), with hooks for what is unusual about it: where its learning signal
comes from (``_signals``), what a window adds (DNI), what binds to the model,
fixed feedback, where it approximates BPTT. ``algorithm.rules(graph)`` binds it
to one graph, once, as a :class:`GraphRules` record; the time loops
(``braintrace/_loops``) run that record and never ask which algorithm it is.
Rules never import a loop.
"""

from __future__ import annotations

from braintrace._algorithms._base import AbstractAlgorithm as AbstractAlgorithm
from braintrace._algorithms._bptt import BPTT as BPTT
from braintrace._algorithms._d_rtrl import D_RTRL as D_RTRL
from braintrace._algorithms._d_rtrl import DRTRL as DRTRL
from braintrace._algorithms._dni import DNI as DNI
from braintrace._algorithms._dni import LinearSynthesizer as LinearSynthesizer
from braintrace._algorithms._eprop import EProp as EProp
from braintrace._algorithms._es_d_rtrl import ES_D_RTRL as ES_D_RTRL
from braintrace._algorithms._es_d_rtrl import ESDRTRL as ESDRTRL
from braintrace._algorithms._es_d_rtrl import GATHER_BOUND as GATHER_BOUND
from braintrace._algorithms._es_d_rtrl import pp_prop as pp_prop
from braintrace._algorithms._fptt import FPTT as FPTT
from braintrace._algorithms._fptt import FPTTState as FPTTState
from braintrace._algorithms._fptt import fptt_regularizer as fptt_regularizer
from braintrace._algorithms._graph_rules import GraphRules as GraphRules
from braintrace._algorithms._ostl import OSTLFeedforward as OSTLFeedforward
from braintrace._algorithms._ostl import OSTLRecurrent as OSTLRecurrent
from braintrace._algorithms._osttp import OSTTP as OSTTP
from braintrace._algorithms._otpe import OTPE as OTPE
from braintrace._algorithms._ottt import OTTT as OTTT
from braintrace._algorithms._registry import ALGORITHMS as ALGORITHMS
from braintrace._algorithms._registry import algorithm_name as algorithm_name
from braintrace._algorithms._registry import get_algorithm as get_algorithm
from braintrace._algorithms._relation_rule import BlockSteps as BlockSteps
from braintrace._algorithms._relation_rule import Jacobians as Jacobians
from braintrace._algorithms._relation_rule import RelationRule as RelationRule
from braintrace._algorithms._rtrl import RTRL as RTRL
from braintrace._algorithms._signals import AbstractLearningSignal as AbstractLearningSignal
from braintrace._algorithms._sltt import SLTT as SLTT
from braintrace._algorithms._snap import SnAp as SnAp
from braintrace._algorithms._three_factor import ThreeFactor as ThreeFactor
from braintrace._algorithms._trace_algebra import is_batched as is_batched
from braintrace._algorithms._trace_storage import check_trace_dtype as check_trace_dtype
from braintrace._algorithms._uoro import UORO as UORO

__all__ = [
    "ALGORITHMS",
    "BPTT",
    "DNI",
    "DRTRL",
    "D_RTRL",
    "ESDRTRL",
    "ES_D_RTRL",
    "FPTT",
    "GATHER_BOUND",
    "OSTTP",
    "OTPE",
    "OTTT",
    "RTRL",
    "SLTT",
    "UORO",
    "AbstractAlgorithm",
    "AbstractLearningSignal",
    "BlockSteps",
    "EProp",
    "FPTTState",
    "GraphRules",
    "Jacobians",
    "LinearSynthesizer",
    "OSTLFeedforward",
    "OSTLRecurrent",
    "RelationRule",
    "SnAp",
    "ThreeFactor",
    "algorithm_name",
    "check_trace_dtype",
    "fptt_regularizer",
    "get_algorithm",
    "is_batched",
    "pp_prop",
]
