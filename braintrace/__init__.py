"""braintrace: online learning with eligibility traces for Flax NNX models.

Mark trainable operations with ETP primitives (or use the drop-in layers in
:mod:`braintrace.layers`), compile one model step into an eligibility-trace
graph, and train forward in time with memory independent of sequence length:
with the stateful :class:`OnlineLearner` / :class:`OnlineTrainer`, or with the
pure :func:`online_grad` / :func:`online_update` inside your own ``jit``-ed
train step. :mod:`braintrace.primitives` holds the primitive objects and their
shared rules, :mod:`braintrace.tasks` the built-in tasks and data sets.
"""

from braintrace import primitives as primitives
from braintrace import tasks as tasks
from braintrace._algorithms import BPTT as BPTT
from braintrace._algorithms import DNI as DNI
from braintrace._algorithms import DRTRL as DRTRL
from braintrace._algorithms import ESDRTRL as ESDRTRL
from braintrace._algorithms import FPTT as FPTT
from braintrace._algorithms import OSTTP as OSTTP
from braintrace._algorithms import OTPE as OTPE
from braintrace._algorithms import OTTT as OTTT
from braintrace._algorithms import RTRL as RTRL
from braintrace._algorithms import SLTT as SLTT
from braintrace._algorithms import UORO as UORO
from braintrace._algorithms import AbstractAlgorithm as AbstractAlgorithm
from braintrace._algorithms import EProp as EProp
from braintrace._algorithms import LinearSynthesizer as LinearSynthesizer
from braintrace._algorithms import OSTLFeedforward as OSTLFeedforward
from braintrace._algorithms import OSTLRecurrent as OSTLRecurrent
from braintrace._algorithms import SnAp as SnAp
from braintrace._algorithms import ThreeFactor as ThreeFactor
from braintrace._algorithms import fptt_regularizer as fptt_regularizer
from braintrace._compiler import ETraceGraph as ETraceGraph
from braintrace._compiler import compile_graph as compile_graph
from braintrace._drivers import Callback as Callback
from braintrace._drivers import CheckpointManager as CheckpointManager
from braintrace._drivers import EarlyStopping as EarlyStopping
from braintrace._drivers import GradStats as GradStats
from braintrace._drivers import History as History
from braintrace._drivers import ModelCheckpoint as ModelCheckpoint
from braintrace._drivers import OnlineGradient as OnlineGradient
from braintrace._drivers import OnlineLearner as OnlineLearner
from braintrace._drivers import OnlineState as OnlineState
from braintrace._drivers import OnlineTrainer as OnlineTrainer
from braintrace._drivers import OnlineUpdate as OnlineUpdate
from braintrace._drivers import SpikeRates as SpikeRates
from braintrace._drivers import UpdateStats as UpdateStats
from braintrace._drivers import compile as compile
from braintrace._drivers import evaluate as evaluate
from braintrace._drivers import init_states as init_states
from braintrace._drivers import online_grad as online_grad
from braintrace._drivers import online_update as online_update
from braintrace._drivers import spike_rates as spike_rates
from braintrace._hidden import HiddenState as HiddenState
from braintrace._primitives import Connectivity as Connectivity
from braintrace._primitives import ETPPrimitive as ETPPrimitive
from braintrace._primitives import ETPRules as ETPRules
from braintrace._primitives import MissingRuleError as MissingRuleError
from braintrace._primitives import conv as conv
from braintrace._primitives import einsum as einsum
from braintrace._primitives import element_wise as element_wise
from braintrace._primitives import embed_lookup as embed_lookup
from braintrace._primitives import grouped_matmul as grouped_matmul
from braintrace._primitives import lora_matmul as lora_matmul
from braintrace._primitives import matmul as matmul
from braintrace._primitives import register_batched_counterpart as register_batched_counterpart
from braintrace._primitives import register_primitive as register_primitive
from braintrace._primitives import sparse_matmul as sparse_matmul
from braintrace._version import __version__ as __version__

__all__ = [
    "BPTT",
    "DNI",
    "DRTRL",
    "ESDRTRL",
    "FPTT",
    "OSTTP",
    "OTPE",
    "OTTT",
    "RTRL",
    "SLTT",
    "UORO",
    "AbstractAlgorithm",
    "Callback",
    "CheckpointManager",
    "Connectivity",
    "EarlyStopping",
    "EProp",
    "ETPPrimitive",
    "ETPRules",
    "ETraceGraph",
    "GradStats",
    "HiddenState",
    "History",
    "LinearSynthesizer",
    "MissingRuleError",
    "ModelCheckpoint",
    "OSTLFeedforward",
    "OSTLRecurrent",
    "OnlineGradient",
    "OnlineLearner",
    "OnlineState",
    "OnlineTrainer",
    "OnlineUpdate",
    "SnAp",
    "SpikeRates",
    "ThreeFactor",
    "UpdateStats",
    "__version__",
    "compile",
    "compile_graph",
    "conv",
    "einsum",
    "element_wise",
    "embed_lookup",
    "evaluate",
    "fptt_regularizer",
    "grouped_matmul",
    "init_states",
    "lora_matmul",
    "matmul",
    "online_grad",
    "online_update",
    "primitives",
    "register_batched_counterpart",
    "register_primitive",
    "sparse_matmul",
    "spike_rates",
    "tasks",
]

_ALIASES = {
    # earlier spellings of the algorithm constructors
    "D_RTRL": "DRTRL",
    "ES_D_RTRL": "ESDRTRL",
}
_MOVED_TO_PRIMITIVES = {name for name in primitives.__all__ if name.startswith("etp_")}


def __getattr__(name: str):
    """Earlier public names that keep working: ``D_RTRL``, ``ES_D_RTRL``, ``pp_prop`` and the
    primitive objects (``etp_dense_p``, ..., now in :mod:`braintrace.primitives`)."""
    if name in _ALIASES:
        return globals()[_ALIASES[name]]
    if name == "pp_prop":
        from braintrace._algorithms import pp_prop

        return pp_prop
    if name in _MOVED_TO_PRIMITIVES:
        return getattr(primitives, name)
    raise AttributeError(f"module 'braintrace' has no attribute {name!r}")
