"""Compiler: one model step's jaxpr to an eligibility-trace graph."""

from braintrace._compiler._compile import compile_graph as compile_graph
from braintrace._compiler._graph import ETraceGraph as ETraceGraph
from braintrace._compiler._layout import StepLeaves as StepLeaves
from braintrace._compiler._records import Approximation as Approximation
from braintrace._compiler._records import ElementwiseRelation as ElementwiseRelation
from braintrace._compiler._records import Exclusion as Exclusion
from braintrace._compiler._records import HiddenGroup as HiddenGroup
from braintrace._compiler._records import InputRelation as InputRelation
from braintrace._compiler._records import Relation as Relation

__all__ = ["Approximation", "ETraceGraph", "ElementwiseRelation", "Exclusion", "HiddenGroup",
           "InputRelation", "Relation", "StepLeaves", "compile_graph"]
