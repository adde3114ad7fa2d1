"""Compiler: one model step's jaxpr to an eligibility-trace graph.

The face other packages use: the graph and its records, :func:`compile_graph`,
the run-time programs over a graph (``programs``: the step's forward pass, its
Jacobians, the operands of the traced operations), which operations read a
group's new state unit by unit (``readers``), the structural unit
patterns (``reach``, ``unit_patterns``), the jaxpr walks and phrases an
algorithm uses to describe what it approximates (``feeding``, ``reached``,
``eqn_names``, ``operations``, ``params_phrase``, ``states_phrase``), what keeps the fast learning
signal from being exact (``fast_signal_obstacles``), which Flax cells learn without
credit over time (``flax_cell_advice``), which operations' outputs are
added before anything reads them (``summed_outputs``) and the model split helpers.
"""

from braintrace._compiler import _programs as programs
from braintrace._compiler._alternatives import flax_cell_advice as flax_cell_advice
from braintrace._compiler._batch_shards import batch_shards as batch_shards
from braintrace._compiler._batch_shards import splitting_batch as splitting_batch
from braintrace._compiler._compile import compile_graph as compile_graph
from braintrace._compiler._fast_signal import SignalObstacle as SignalObstacle
from braintrace._compiler._fast_signal import fast_signal_obstacles as fast_signal_obstacles
from braintrace._compiler._graph import ETraceGraph as ETraceGraph
from braintrace._compiler._layout import StepLeaves as StepLeaves
from braintrace._compiler._patterns import reach as reach
from braintrace._compiler._patterns import unit_patterns as unit_patterns
from braintrace._compiler._phrases import eqn_names as eqn_names
from braintrace._compiler._phrases import operations as operations
from braintrace._compiler._phrases import params_phrase as params_phrase
from braintrace._compiler._phrases import states_phrase as states_phrase
from braintrace._compiler._readers import reader_list as reader_list
from braintrace._compiler._readers import readers as readers
from braintrace._compiler._records import Approximation as Approximation
from braintrace._compiler._records import ElementwiseRelation as ElementwiseRelation
from braintrace._compiler._records import Exclusion as Exclusion
from braintrace._compiler._records import HiddenGroup as HiddenGroup
from braintrace._compiler._records import InputRelation as InputRelation
from braintrace._compiler._records import Relation as Relation
from braintrace._compiler._step import leaf_paths as leaf_paths
from braintrace._compiler._step import split_model as split_model
from braintrace._compiler._summed_outputs import summed_outputs as summed_outputs
from braintrace._compiler._walk import feeding as feeding
from braintrace._compiler._walk import is_var as is_var
from braintrace._compiler._walk import reached as reached

from braintrace._compiler._graph import REPORTER as _REPORTER
from braintrace._compiler._report import graph_report as _graph_report

_REPORTER.append(_graph_report)

__all__ = ["Approximation", "ETraceGraph", "ElementwiseRelation", "Exclusion", "HiddenGroup",
           "InputRelation", "Relation", "SignalObstacle", "StepLeaves", "batch_shards",
           "compile_graph",
           "eqn_names", "fast_signal_obstacles", "feeding", "flax_cell_advice", "is_var", "leaf_paths", "operations", "params_phrase", "programs", "reach", "reached", "reader_list", "readers",
           "split_model", "splitting_batch", "states_phrase", "summed_outputs", "unit_patterns"]
