"""braintrace: online learning with eligibility traces for Flax NNX models.

Mark trainable operations with ETP primitives (or use the drop-in layers in
:mod:`braintrace.layers`), compile one model step into an eligibility-trace
graph, and train forward in time with memory independent of sequence length.
"""

from braintrace import tasks as tasks
from braintrace._algorithms import D_RTRL as D_RTRL
from braintrace._algorithms import DNI as DNI
from braintrace._algorithms import ES_D_RTRL as ES_D_RTRL
from braintrace._algorithms import RTRL as RTRL
from braintrace._algorithms import UORO as UORO
from braintrace._algorithms import AbstractAlgorithm as AbstractAlgorithm
from braintrace._algorithms import EProp as EProp
from braintrace._algorithms import LinearSynthesizer as LinearSynthesizer
from braintrace._algorithms import OSTLFeedforward as OSTLFeedforward
from braintrace._algorithms import OSTLRecurrent as OSTLRecurrent
from braintrace._algorithms import SnAp as SnAp
from braintrace._algorithms import ThreeFactor as ThreeFactor
from braintrace._algorithms import pp_prop as pp_prop
from braintrace._compile_learner import compile as compile
from braintrace._compiler import ETraceGraph as ETraceGraph
from braintrace._compiler import compile_graph as compile_graph
from braintrace._hidden import HiddenState as HiddenState
from braintrace._learner import OnlineLearner as OnlineLearner
from braintrace._primitives import Connectivity as Connectivity
from braintrace._primitives import ETPPrimitive as ETPPrimitive
from braintrace._primitives import MissingRuleError as MissingRuleError
from braintrace._primitives import conv as conv
from braintrace._primitives import einsum as einsum
from braintrace._primitives import element_wise as element_wise
from braintrace._primitives import embed_lookup as embed_lookup
from braintrace._primitives import etp_conv_batched_p as etp_conv_batched_p
from braintrace._primitives import etp_conv_p as etp_conv_p
from braintrace._primitives import etp_dense_batched_p as etp_dense_batched_p
from braintrace._primitives import etp_dense_p as etp_dense_p
from braintrace._primitives import etp_einsum_batched_p as etp_einsum_batched_p
from braintrace._primitives import etp_einsum_p as etp_einsum_p
from braintrace._primitives import etp_elemwise_p as etp_elemwise_p
from braintrace._primitives import etp_embed_batched_p as etp_embed_batched_p
from braintrace._primitives import etp_embed_p as etp_embed_p
from braintrace._primitives import etp_grouped_batched_p as etp_grouped_batched_p
from braintrace._primitives import etp_grouped_p as etp_grouped_p
from braintrace._primitives import etp_lora_batched_p as etp_lora_batched_p
from braintrace._primitives import etp_lora_p as etp_lora_p
from braintrace._primitives import etp_primitives as etp_primitives
from braintrace._primitives import etp_sparse_batched_p as etp_sparse_batched_p
from braintrace._primitives import etp_sparse_p as etp_sparse_p
from braintrace._primitives import grouped_matmul as grouped_matmul
from braintrace._primitives import lora_matmul as lora_matmul
from braintrace._primitives import matmul as matmul
from braintrace._primitives import register_batched_counterpart as register_batched_counterpart
from braintrace._primitives import register_primitive as register_primitive
from braintrace._primitives import sparse_matmul as sparse_matmul
from braintrace._states import init_states as init_states
from braintrace._trainer import OnlineTrainer as OnlineTrainer
from braintrace._version import __version__ as __version__

__all__ = [
    "DNI",
    "D_RTRL",
    "ES_D_RTRL",
    "RTRL",
    "UORO",
    "AbstractAlgorithm",
    "Connectivity",
    "EProp",
    "ETPPrimitive",
    "ETraceGraph",
    "HiddenState",
    "LinearSynthesizer",
    "MissingRuleError",
    "OSTLFeedforward",
    "OSTLRecurrent",
    "OnlineLearner",
    "OnlineTrainer",
    "SnAp",
    "ThreeFactor",
    "__version__",
    "compile",
    "compile_graph",
    "conv",
    "einsum",
    "element_wise",
    "embed_lookup",
    "etp_conv_batched_p",
    "etp_conv_p",
    "etp_dense_batched_p",
    "etp_dense_p",
    "etp_einsum_batched_p",
    "etp_einsum_p",
    "etp_elemwise_p",
    "etp_embed_batched_p",
    "etp_embed_p",
    "etp_grouped_batched_p",
    "etp_grouped_p",
    "etp_lora_batched_p",
    "etp_lora_p",
    "etp_primitives",
    "etp_sparse_batched_p",
    "etp_sparse_p",
    "grouped_matmul",
    "init_states",
    "lora_matmul",
    "matmul",
    "pp_prop",
    "register_batched_counterpart",
    "register_primitive",
    "sparse_matmul",
    "tasks",
]
